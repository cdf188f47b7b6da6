"""A scheduler service in the test's own event loop, between a gateway socket and a worker
that executes plans on the symbolic KV-cache of tests/scheduler/harness.py: the real loop,
admin socket and observer, without a model."""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from services.scheduler.core import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared import protocol as p
from shared.log import setup_logging
from tests.reliability.rig import heartbeat
from tests.scheduler.harness import SymbolicWorker

TOKEN = "s3cret"


async def symbolic_worker(addr: str, stop: asyncio.Event, num_hbm: int, num_dram: int, block_size: int, step_s: float):
    """Executes plans in order; reports a transfer wait on steps that swap in."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    worker = SymbolicWorker(num_hbm, num_dram, block_size)
    await sock.send(p.encode(p.WorkerReady("toy", num_hbm, num_dram, block_size, 256, "cpu")))
    try:
        while not stop.is_set():
            if not await sock.poll(20):
                continue
            plan = p.worker_msg_decoder.decode(await sock.recv())
            await asyncio.sleep(step_s)
            result = worker.execute(plan)
            moved = bool(plan.swap_in or plan.swap_out or plan.eager)
            result.timings = p.StepTimings(
                transfer_s=0.001 if moved else 0.0,
                compute_s=step_s,
                transfer_wait_s=0.002 if plan.swap_in else 0.0,
            )
            await sock.send(p.encode(result))
    finally:
        sock.close()
        ctx.term()


@dataclass
class Gateway:
    """A gateway's DEALER: sends requests, collects every reply per request id."""

    sock: zmq.asyncio.Socket
    outputs: dict[str, list[p.TokenOutput]] = field(default_factory=dict)
    errors: dict[str, p.RequestError] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)
    final_at: dict[str, float] = field(default_factory=dict)

    async def add(self, rid: str, prompt_len: int = 6, max_tokens: int = 20) -> None:
        prompt = [10 + i for i in range(prompt_len)]
        params = p.SamplingParams(max_tokens=max_tokens, temperature=0.0)
        self.sent_at[rid] = time.monotonic()
        await self.sock.send(p.encode(p.AddRequest(rid, prompt, params)))

    async def recv_loop(self) -> None:
        while True:
            msg = p.gateway_reply_decoder.decode(await self.sock.recv())
            match msg:
                case p.StepOutputs(outputs=outs):
                    for o in outs:
                        self.outputs.setdefault(o.request_id, []).append(o)
                        if o.finish_reason is not None:
                            self.final_at[o.request_id] = time.monotonic()
                case p.RequestError(request_id=rid):
                    self.errors[rid] = msg

    def final(self, rid: str) -> p.TokenOutput | None:
        outs = self.outputs.get(rid, [])
        return outs[-1] if outs and outs[-1].finish_reason is not None else None


class Admin:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    async def raw(self, payload: bytes, timeout: float = 5.0) -> p.AdminReply:
        await self.sock.send(payload)
        assert await self.sock.poll(int(timeout * 1000)), "no admin reply"
        return p.admin_reply_decoder.decode((await self.sock.recv_multipart())[-1])

    async def ask(self, msg) -> p.AdminReply:
        return await self.raw(p.encode(msg))


@dataclass
class Rig:
    service: SchedulerService
    gateway: Gateway
    admin: Admin


async def until(predicate, timeout: float = 10.0, every: float = 0.01) -> bool:
    """Poll a predicate (plain or async) until it holds."""

    async def check() -> bool:
        value = predicate()
        return bool(await value) if inspect.isawaitable(value) else bool(value)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(every)
    return await check()


async def run_rig(tmp_path, scenario, *, num_hbm=10, num_dram=200, block_size=4, step_s=0.005, **cfg):
    """Start service, worker and gateway; run `scenario(rig)`; stop everything."""
    cfg = SchedulerConfig(**{"ttft_slo": 0.05, "tbt_slo": 0.02, **cfg})
    addr = lambda name: f"ipc://{tmp_path}/{name}.sock"  # noqa: E731
    service = SchedulerService(
        cfg, addr("sched"), addr("worker"), setup_logging("scheduler", "warning"),
        admin_bind=addr("admin"), admin_token=TOKEN,
    )
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(service.run()),
        asyncio.create_task(symbolic_worker(addr("worker"), stop, num_hbm, num_dram, block_size, step_s)),
    ]
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"gw-test")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr("sched"))
    gateway = Gateway(sock)
    recv = [asyncio.create_task(heartbeat(sock)), asyncio.create_task(gateway.recv_loop())]
    admin = Admin(ctx, addr("admin"))
    try:
        assert await until(lambda: _ready(service)), "worker never reported ready"
        return await scenario(Rig(service, gateway, admin))
    finally:
        for t in recv:
            t.cancel()
        await asyncio.gather(*recv, return_exceptions=True)
        service.stopping = True  # first: a plan sent to a stopped worker would find no peer
        await tasks[0]
        stop.set()
        await tasks[1]
        admin.sock.close()
        sock.close()
        ctx.term()


async def _ready(service: SchedulerService) -> bool:
    return service.core is not None
