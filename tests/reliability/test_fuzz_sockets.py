"""Every socket survives garbage: random bytes, truncated frames, msgpack of the wrong shape,
messages of another socket's union, and extra frames. After each batch of garbage the loop
still serves: a real request completes or a query answers.

The scheduler runs in-process (rig.py) with a toy worker; the gateway's receive path is a
real `SchedulerClient` fed by a bare ROUTER; the worker's plan decoder is fuzzed directly and
one live worker process is checked to keep serving after garbage."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import uuid

import msgspec
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings, strategies as st

from bench.live.server import REPO
from services.gateway.scheduler_client import SchedulerClient
from services.scheduler.core import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared import protocol as p
from shared.log import setup_logging
from tests.reliability.rig import ToyWorker, run_rig, undisturbed, until

FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXAMPLE_TIMEOUT_S = 20.0

# One message of every kind, from every union.
_STATS = p.SchedulerStats("s", "m", 256, 0, 0, 0, 64, 64, 256, 256)
_WINDOW = p.WindowStats(span_s=1.0)
SAMPLES = [
    p.GatewayHello("gw"),
    p.AddRequest("r", [1, 2, 3], p.SamplingParams(4, temperature=0.0), p.SLO(1.0, 0.1), [5]),
    p.AbortRequest("r"),
    p.StepOutputs([p.TokenOutput("r", [1], "stop", p.Attribution())]),
    p.RequestError("r", "no"),
    _STATS,
    p.Plan(1, [p.NewRequestData("r", [1, 2], p.SamplingParams(2))], [p.ScheduledRequest("r", 0, 2, [0])],
           swap_in=[(1, 2)], drop=["x"]),
    p.WorkerReady("m", 64, 256, 4, 256, "cpu"),
    p.StepResult(1, ["r"], [7]),
    p.WorkerError(1, "boom"),
    p.QueuesQuery(),
    p.StatsQuery(),
    p.AbortCommand("r", "t"),
    p.DrainCommand("t", True),
    p.QueuesReply([]),
    p.StatsReply(_STATS, _WINDOW, "lvf", 5.0, 0.1, 1.0),
    p.AdminAck("ok"),
    p.AdminError("no"),
]
TAGS = [type(m).__struct_config__.tag for m in SAMPLES]

leaves = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8)
)
values = st.recursive(
    leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4), max_leaves=12
)
encoded = st.sampled_from(SAMPLES).map(p.encode)
truncated = encoded.flatmap(lambda b: st.integers(0, len(b) - 1).map(lambda n: b[:n]))
wrong_shape = values.map(msgspec.msgpack.encode)
wrong_fields = st.tuples(st.sampled_from(TAGS), st.lists(values, max_size=5)).map(lambda t: p.encode([t[0], *t[1]]))
payloads = st.binary(max_size=64) | truncated | wrong_shape | wrong_fields | encoded
# A message is one or more frames: a socket expecting one payload may get extras.
messages = st.lists(payloads, min_size=1, max_size=3)


def not_decodable_by(decoder):
    """Frames a peer of that socket could not mistake for a real message."""

    def ok(frames: list[bytes]) -> bool:
        try:
            decoder.decode(frames[-1])
        except msgspec.DecodeError:
            return True
        return False

    return ok


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, EXAMPLE_TIMEOUT_S))


async def probe(rig) -> None:
    """A real request through the scheduler completes with the toy model's exact tokens."""
    rid = f"probe-{uuid.uuid4().hex[:8]}"
    await rig.gateway.add(rid, [11, 12, 13], 5)
    assert await until(lambda: rid in rig.gateway.finished, timeout=10), "the scheduler stopped serving"
    assert rig.gateway.tokens[rid] == undisturbed([11, 12, 13], 5)


# ---------------------------------------------------------------- decoders


@FUZZ
@given(payloads)
def test_decoders_raise_only_decode_errors(payload):
    """Each decoder either returns a message of its union or raises msgspec.DecodeError
    (which the loops catch); nothing else escapes."""
    for decoder in (p.gateway_msg_decoder, p.gateway_reply_decoder, p.worker_msg_decoder,
                    p.worker_reply_decoder, p.admin_request_decoder, p.admin_reply_decoder):
        try:
            decoder.decode(payload)
        except msgspec.DecodeError:
            pass


# ---------------------------------------------------------------- scheduler, gateway side

bad_adds = st.builds(
    p.AddRequest,
    request_id=st.text(max_size=6),
    prompt_token_ids=st.lists(st.integers(-(2**31), 2**31), max_size=6),
    params=st.builds(p.SamplingParams, max_tokens=st.integers(-3, 24), temperature=st.floats()),
    slo=st.none() | st.builds(p.SLO, st.none() | st.floats(), st.none() | st.floats()),
    output_token_ids=st.lists(st.integers(0, 9), max_size=3),
).map(lambda m: [p.encode(m)])


@FUZZ
@given(st.lists(messages | bad_adds, min_size=1, max_size=8))
def test_scheduler_gateway_socket_survives_garbage(batch):
    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr, step_s=0.001)
        ctx = zmq.asyncio.Context()
        fuzz = ctx.socket(zmq.DEALER)
        fuzz.setsockopt(zmq.LINGER, 0)
        fuzz.connect(rig.worker_addr.replace("worker.sock", "sched.sock"))
        try:
            for frames in batch:
                await fuzz.send_multipart(frames)
            await probe(rig)
        finally:
            fuzz.close()
            ctx.term()
            await worker.kill()

    with tempfile.TemporaryDirectory() as tmp:
        run(run_rig(tmp, scenario))


# ---------------------------------------------------------------- scheduler, worker side


@FUZZ
@given(st.lists(messages.filter(not_decodable_by(p.worker_reply_decoder)), min_size=1, max_size=8))
def test_scheduler_worker_socket_survives_garbage(batch):
    """The worker's own connection sends garbage between its real replies."""

    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr, step_s=0.001)
        try:
            assert await until(lambda: rig.service.core is not None)
            for frames in batch:
                await worker.sock.send_multipart(frames)
            await probe(rig)
            assert rig.service.link.num_losses == 0
        finally:
            await worker.kill()

    with tempfile.TemporaryDirectory() as tmp:
        run(run_rig(tmp, scenario))


# ---------------------------------------------------------------- scheduler, admin side


async def _admin_scenario(tmp: str, batch: list[list[bytes]]) -> None:
    cfg = SchedulerConfig(max_batched_tokens=32)
    service = SchedulerService(
        cfg, f"ipc://{tmp}/s.sock", f"ipc://{tmp}/w.sock", setup_logging("scheduler", "error"),
        admin_bind=f"ipc://{tmp}/a.sock", admin_token="secret",
    )
    loop = asyncio.create_task(service.run())
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{tmp}/a.sock")
    try:
        for frames in batch:
            await sock.send_multipart(frames)
            reply = await asyncio.wait_for(sock.recv_multipart(), 5)
            assert reply[:-1] == frames[:-1], "the envelope comes back as it went"
            answer = p.admin_reply_decoder.decode(reply[-1])
            if not_decodable_by(p.admin_request_decoder)(frames):
                assert isinstance(answer, p.AdminError)
        await sock.send(p.encode(p.StatsQuery()))
        answer = p.admin_reply_decoder.decode((await asyncio.wait_for(sock.recv_multipart(), 5))[-1])
        assert isinstance(answer, p.StatsReply)
        assert not loop.done()
    finally:
        service.stopping = True
        await loop
        sock.close()
        ctx.term()


@FUZZ
@given(st.lists(messages, min_size=1, max_size=8))
def test_scheduler_admin_socket_answers_garbage_with_errors(batch):
    with tempfile.TemporaryDirectory() as tmp:
        run(_admin_scenario(tmp, batch))


# ---------------------------------------------------------------- gateway receive path


async def _gateway_client_scenario(tmp: str, batch: list[list[bytes]]) -> None:
    """A bare ROUTER plays the scheduler: garbage first, then a load report and a real
    reply, which the client must route to the request's handle."""
    addr = f"ipc://{tmp}/sched.sock"
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(addr)
    client = SchedulerClient([addr], gateway_id="gw-fuzz")
    await client.start()
    try:
        identity, _ = await asyncio.wait_for(router.recv_multipart(), 5)  # its hello
        for frames in batch:
            await router.send_multipart([identity, *frames])
        await router.send_multipart([identity, p.encode(_STATS)])
        assert await until(lambda: bool(client.live_links()), timeout=5), "the receive loop died"
        req = p.AddRequest("fuzz-probe", [1, 2], p.SamplingParams(1))
        handle = client.submit(req, client.pick())
        while True:  # hellos may come first
            _, payload = await asyncio.wait_for(router.recv_multipart(), 5)
            if isinstance(p.gateway_msg_decoder.decode(payload), p.AddRequest):
                break
        await router.send_multipart([identity, p.encode(p.StepOutputs([p.TokenOutput("fuzz-probe", [9], "stop")]))])
        reply = await asyncio.wait_for(handle.get(), 5)
        assert reply.token_ids == [9] and reply.finish_reason == "stop"
    finally:
        await client.close()
        router.close()
        ctx.term()


@FUZZ
@given(st.lists(messages, min_size=1, max_size=8))
def test_gateway_receive_path_survives_garbage(batch):
    with tempfile.TemporaryDirectory() as tmp:
        run(_gateway_client_scenario(tmp, batch))


# ---------------------------------------------------------------- a live worker


async def _live_worker_scenario(tmp: str) -> None:
    """This test is the worker's scheduler: garbage first, then a real plan, which the
    worker must still execute."""
    addr = f"ipc://{tmp}/worker.sock"
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    args = [sys.executable, "-m", "services.cli", "--log-level", "error", "worker", "--connect", addr,
            "--device", "cpu", "--hbm-blocks", "16", "--dram-gb", "0.01"]
    proc = await asyncio.create_subprocess_exec(*args, cwd=REPO)
    try:
        exited = asyncio.create_task(proc.wait())
        done, _ = await asyncio.wait([asyncio.ensure_future(sock.recv()), exited], timeout=120,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert done and exited not in done, f"the worker did not start (exit code {proc.returncode})"
        ready = p.worker_reply_decoder.decode(done.pop().result())
        assert isinstance(ready, p.WorkerReady)
        garbage = [b"", b"\xc1", p.encode(p.Plan(1))[:-1], p.encode(p.StatsQuery()), msgspec.msgpack.encode({"a": 1})]
        await sock.send_multipart(garbage)
        for payload in garbage:
            await sock.send(payload)
        plan = p.Plan(
            step_id=1,
            new_requests=[p.NewRequestData("r", [1, 2, 3], p.SamplingParams(1, temperature=0.0))],
            scheduled=[p.ScheduledRequest("r", 0, 3, [0])],
        )
        await sock.send(p.encode(plan))
        result = p.worker_reply_decoder.decode(await asyncio.wait_for(sock.recv(), 60))
        while isinstance(result, p.WorkerBusy):  # said every second of a slow step on a busy host
            result = p.worker_reply_decoder.decode(await asyncio.wait_for(sock.recv(), 60))
        assert isinstance(result, p.StepResult) and result.step_id == 1 and result.request_ids == ["r"]
        assert proc.returncode is None
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()
        sock.close()
        ctx.term()


def test_live_worker_keeps_serving_after_garbage(tmp_path):
    asyncio.run(_live_worker_scenario(str(tmp_path)))
