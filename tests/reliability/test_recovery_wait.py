"""While no worker is ready the scheduler holds requests — those live on the lost worker and
the gateways' resubmissions — for at most its worker wait: past it each fails with an error
that names the lost worker; resubmissions are not refused by the waiting-queue bound (they
were admitted once); a gateway that went silent gets its requests back as GATEWAY_SILENT
errors, which it resubmits rather than show."""

from __future__ import annotations

import asyncio

import msgspec

from services.scheduler import service as scheduler_service
from shared import protocol as p
from tests.reliability.rig import ToyWorker, run_rig, undisturbed, until


def test_held_requests_fail_after_the_worker_wait_naming_the_lost_worker(tmp_path):
    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr)
        await rig.gateway.add("r0", [5, 6, 7], 200)
        assert await until(lambda: len(rig.gateway.tokens.get("r0", [])) >= 3)
        worker.hung = True  # stuck in a step: lost after the step deadline, never back
        assert await until(lambda: rig.service.core is None, 5)
        assert [h.req.request_id for h in rig.service.held] == ["r0"]
        await asyncio.sleep(0.5)
        assert "r0" not in rig.gateway.errors  # within the wait: held, not failed
        assert await until(lambda: "r0" in rig.gateway.errors, 5)
        err = rig.gateway.errors["r0"]
        assert err.type == "service_unavailable", err
        assert "no model worker was ready within 1.5s" in err.message and "not back after" in err.message, err
        assert rig.service.held == [] and "r0" not in rig.service.owner
        await worker.kill()

    asyncio.run(run_rig(tmp_path, scenario, worker_wait_s=1.5))


def test_resubmissions_are_held_past_the_waiting_bound_and_complete_on_the_next_worker(tmp_path):
    """No worker yet and --max-waiting 1: a second new request is refused, but a gateway's
    resubmissions (`resumed`, with the tokens it streamed) are all held and resume exactly."""

    async def scenario(rig):
        gw = rig.gateway
        params = p.SamplingParams(max_tokens=12, temperature=0.0)
        prompts = {f"m{i}~1": [9, 4 + i, 11] for i in range(3)}
        for rid, prompt in prompts.items():
            streamed = undisturbed(prompt, 12)[:4]
            add = p.AddRequest(rid, prompt, params, output_token_ids=streamed, resumed=True)
            await gw.sock.send(p.encode(add))
        await gw.add("n0", [3, 3, 3], 12)
        await gw.add("n1", [4, 4, 4], 12)
        assert await until(lambda: "n1" in gw.errors)
        assert gw.errors["n1"].type == "overloaded"
        assert sorted(h.req.request_id for h in rig.service.held) == ["m0~1", "m1~1", "m2~1", "n0"]
        worker = ToyWorker(rig.worker_addr)
        try:
            assert await until(lambda: len(gw.finished) == 4), gw.finished
        finally:
            await worker.kill()
        for rid, prompt in prompts.items():
            assert gw.tokens[rid] == undisturbed(prompt, 12)[4:], rid
        assert gw.tokens["n0"] == undisturbed([3, 3, 3], 12)

    asyncio.run(run_rig(tmp_path, scenario, max_waiting=1))


def test_a_silent_gateway_gets_its_requests_back_as_gateway_silent(tmp_path, monkeypatch):
    """The rig's gateway says hello every second; taken for gone after 0.5 s of silence, its
    running request is aborted with the type a gateway resubmits on."""
    monkeypatch.setattr(scheduler_service, "GATEWAY_STALE_S", 0.5)

    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr, step_s=0.05)
        try:
            await rig.gateway.add("r0", [5, 6, 7], 200)
            assert await until(lambda: "r0" in rig.gateway.errors, 5)
            err = rig.gateway.errors["r0"]
            assert err.type == p.GATEWAY_SILENT and "its gateway was silent" in err.message, err
            assert "r0" not in rig.service.owner
        finally:
            await worker.kill()

    asyncio.run(run_rig(tmp_path, scenario))


def test_resumed_defaults_to_off_and_round_trips():
    """`resumed` defaults to off and round-trips."""
    plain = p.AddRequest("r", [1], p.SamplingParams(max_tokens=4))
    resumed = msgspec.structs.replace(plain, resumed=True)
    assert p.gateway_msg_decoder.decode(p.encode(plain)).resumed is False
    assert p.gateway_msg_decoder.decode(p.encode(resumed)).resumed is True


async def say_busy(worker: ToyWorker, every_s: float = 0.2) -> None:
    """What the worker's socket thread does while a step computes."""
    while True:
        await asyncio.sleep(every_s)
        if worker.computing is not None:
            await worker.sock.send(p.encode(p.WorkerBusy(worker.computing)))


def test_a_slow_step_that_says_so_is_not_a_lost_worker_and_a_silent_one_is(tmp_path):
    """Steps go from 5 ms to 1.5 s (a saturated host): past the step deadline (0.3 s here) a
    worker that says it is still computing keeps its requests; the same worker silent is lost."""

    async def scenario(rig, busy: bool):
        worker = ToyWorker(rig.worker_addr)
        talker = asyncio.create_task(say_busy(worker)) if busy else None
        try:
            await rig.gateway.add("r0", [5, 6, 7], 14)
            assert await until(lambda: len(rig.gateway.tokens.get("r0", [])) >= 10)
            worker.step_s = 1.5
            assert await until(lambda: "r0" in rig.gateway.finished or rig.service.link.num_losses > 0, 60)
            return rig.service.link.num_losses
        finally:
            if talker is not None:
                talker.cancel()
            await worker.kill()

    for name in ("busy", "silent"):
        (tmp_path / name).mkdir()
    assert asyncio.run(run_rig(tmp_path / "busy", lambda rig: scenario(rig, True))) == 0
    assert asyncio.run(run_rig(tmp_path / "silent", lambda rig: scenario(rig, False))) >= 1
