"""Well-formed Plans with bad ids and lengths, sent to a live worker process over its real
socket: each fails its step with a `WorkerError` naming the field and the request, the worker
does not crash, and the next good step is served from the state the bad one found.

This test is the worker's scheduler (as in test_fuzz_sockets.py's live worker)."""

from __future__ import annotations

import asyncio
import sys

import msgspec
import pytest
import zmq
import zmq.asyncio

from bench.live.server import REPO
from services.worker.plan_check import Limits, PlanChecker, PlanError
from shared import protocol as p

RID = "req-good"


def bad_plans(ready: p.WorkerReady, known: int) -> list[tuple[p.Plan, str, str | None]]:
    """(plan, the field its error must name, the request it must name) for step ids from 100;
    `known`: tokens the worker holds for RID (its table is [0, 1, 2, 3])."""
    hbm, dram, vocab = ready.num_hbm_blocks, ready.num_dram_blocks, ready.vocab_size
    widest = -(-ready.max_model_len // ready.block_size)
    decode = p.ScheduledRequest(RID, known - 1, 1)
    new = p.NewRequestData("req-bad", [1, 2, vocab + 3], p.SamplingParams(2, temperature=0.0))
    replace = msgspec.structs.replace
    cases = [
        (p.Plan(0, scheduled=[replace(decode, new_block_ids=[hbm])]), "scheduled.new_block_ids", RID),
        (p.Plan(0, scheduled=[replace(decode, new_block_ids=[2**62])]), "scheduled.new_block_ids", RID),
        (p.Plan(0, scheduled=[replace(decode, new_block_ids=[-1])]), "scheduled.new_block_ids", RID),
        (p.Plan(0, scheduled=[replace(decode, block_table=[0, hbm + 100])]), "scheduled.block_table", RID),
        (p.Plan(0, scheduled=[replace(decode, num_computed_tokens=-2, num_new_tokens=3)]),
         "scheduled.num_computed_tokens", RID),  # fmt: skip
        (p.Plan(0, scheduled=[replace(decode, num_new_tokens=0)]), "scheduled.num_new_tokens", RID),
        (p.Plan(0, scheduled=[replace(decode, block_table=[0] * (widest + 1))]), "scheduled.block_table", RID),
        (p.Plan(0, scheduled=[replace(decode, new_block_ids=list(range(widest)))]), "scheduled.new_block_ids", RID),
        (p.Plan(0, scheduled=[replace(decode, num_new_tokens=ready.max_model_len)]), "scheduled.num_new_tokens", RID),
        (p.Plan(0, scheduled=[replace(decode, num_new_tokens=5)]), "scheduled.num_new_tokens", RID),  # past the known
        (p.Plan(0, scheduled=[replace(decode, block_table=[])]), "scheduled.block_table", RID),  # covers nothing
        (p.Plan(0, [new], [p.ScheduledRequest("req-bad", 0, 3, [5])]), "new_requests.prompt_token_ids", "req-bad"),
        (p.Plan(0, [replace(new, prompt_token_ids=[1, -5])], [p.ScheduledRequest("req-bad", 0, 2, [5])]),
         "new_requests.prompt_token_ids", "req-bad"),  # fmt: skip
        (p.Plan(0, scheduled=[decode], swap_in=[(dram, 3)]), "swap_in (source)", None),
        (p.Plan(0, scheduled=[decode], swap_in=[(0, hbm)]), "swap_in (destination)", None),
        (p.Plan(0, scheduled=[decode], swap_out=[(5, -1)]), "swap_out (destination)", None),
        (p.Plan(0, scheduled=[decode], eager=[(hbm + 1, 0)]), "eager (source)", None),
    ]
    return [(replace(plan, step_id=100 + i), field, rid) for i, (plan, field, rid) in enumerate(cases)]


async def reply(sock) -> p.WorkerReply:
    while True:  # WorkerBusy is said every second of a slow step on a busy host
        msg = p.worker_reply_decoder.decode(await asyncio.wait_for(sock.recv(), 120))
        if not isinstance(msg, p.WorkerBusy):
            return msg


async def _scenario(tmp: str) -> None:
    addr = f"ipc://{tmp}/worker.sock"
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    args = [sys.executable, "-m", "services.cli", "--log-level", "error", "worker", "--connect", addr,
            "--device", "cpu", "--hbm-blocks", "16", "--dram-gb", "0.01"]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*args, cwd=REPO)
    try:
        exited = asyncio.create_task(proc.wait())
        done, _ = await asyncio.wait([asyncio.ensure_future(sock.recv()), exited], timeout=180,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        assert done and exited not in done, f"the worker did not start (exit code {proc.returncode})"
        ready = p.worker_reply_decoder.decode(done.pop().result())
        assert isinstance(ready, p.WorkerReady) and ready.vocab_size > 0
        params = p.SamplingParams(64, temperature=0.0, ignore_eos=True)
        first = p.Plan(1, [p.NewRequestData(RID, [1, 2, 3], params)], [p.ScheduledRequest(RID, 0, 3, [0, 1, 2, 3])])
        await sock.send(p.encode(first))
        result = await reply(sock)
        assert isinstance(result, p.StepResult) and result.request_ids == [RID], result
        known, step = 4, 2
        for i in range(len(bad_plans(ready, known))):
            plan, field, rid = bad_plans(ready, known)[i]
            await sock.send(p.encode(plan))
            err = await reply(sock)
            assert isinstance(err, p.WorkerError) and err.step_id == plan.step_id, (plan, err)
            assert f"{field} " in err.message or f"{field}:" in err.message, (field, err.message)
            assert (rid is None) or repr(rid) in err.message, (rid, err.message)
            # The next good step: the bad one changed nothing (its position is the next one).
            await sock.send(p.encode(p.Plan(step, scheduled=[p.ScheduledRequest(RID, known - 1, 1)])))
            good = await reply(sock)
            assert isinstance(good, p.StepResult) and good.step_id == step and good.request_ids == [RID], good
            known, step = known + 1, step + 1
        assert proc.returncode is None
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()
        sock.close()
        ctx.term()


@pytest.mark.slow
def test_live_worker_fails_bad_plans_and_serves_the_next_step(tmp_path):
    asyncio.run(_scenario(str(tmp_path)))


def test_a_good_plan_passes_both_halves():
    ready = p.WorkerReady("m", 16, 8, 16, 256, "cpu", vocab_size=100)
    check = PlanChecker(Limits.of(ready), lambda rid: (4, 1) if rid == "a" else None)
    plan = p.Plan(
        3,
        [p.NewRequestData("b", [1, 99], p.SamplingParams(4, logit_bias={5: 1.0}))],
        [p.ScheduledRequest("a", 3, 1), p.ScheduledRequest("b", 0, 2, [15]), p.ScheduledRequest("gone", 0, 1)],
        swap_in=[(7, 15)],
        swap_out=[(0, 7)],
        eager=[(1, 0)],
    )
    check.check_ids(plan)
    check.check_tables(plan)  # "gone" is unknown: the runner fails it alone
    try:
        check.check_tables(msgspec.structs.replace(plan, scheduled=[p.ScheduledRequest("a", 3, 14)]))
    except PlanError as e:
        assert e.field == "scheduled.num_new_tokens" and e.request_id == "a"
    else:
        raise AssertionError("17 positions on 4 known tokens passed")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three processes and a model start; a busy host is slow
def test_a_bad_plan_mid_stream_loses_nothing(tmp_path, monkeypatch):
    """A scheduler, a worker and a gateway on real processes; the worker receives its 30th plan
    with an id out of range (SUPERINFER_FAULTS plan=30, as a scheduler bug would send it): that
    step fails whole, the scheduler resets the worker and recomputes, and every stream ends
    with the text of an undisturbed run."""
    from tests.reliability.live import client_for, stream_all
    from tests.reliability.test_step_faults_live import Http, model_name, start

    monkeypatch.setenv("SUPERINFER_FAULTS", "plan=30")
    procs: list = []
    try:
        pair, url = start(tmp_path, procs)
        model = model_name()
        disturbed = asyncio.run(stream_all(client_for(Http(url)), model, []))
        reference = asyncio.run(stream_all(client_for(Http(url)), model, []))
        assert disturbed == reference
        bad = pair.worker.log_events("bad plan")
        assert len(bad) == 1 and bad[0]["field"] == "scheduled.new_block_ids", bad
        assert "bad plan" in "\n".join(pair.scheduler.log_lines())
        assert all(proc.alive() for proc in procs)
    finally:
        for proc in procs:
            proc.stop()
