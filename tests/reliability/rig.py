"""A scheduler service in the test's own event loop, a gateway socket, and workers that can
be killed or hung at will: the recovery path without a model.

The worker samples a deterministic function of the request's tokens so far, so any run that
resumes a request from the right tokens yields exactly the tokens of an undisturbed run."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from services.scheduler.core import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared import protocol as p
from shared.log import setup_logging

NUM_HBM_BLOCKS = 64
BLOCK_SIZE = 4
VOCAB_SIZE = 1000  # next_token() stays below it


def next_token(tokens: list[int]) -> int:
    """The 'model': the next token depends on every token before it."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) % 997) + 3


def undisturbed(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class ToyWorker:
    """Executes plans in order, checks the plan's positions against what it has computed,
    and replies unless hung (stuck for good). `kill()` closes its socket at once, like SIGKILL; `frozen` (an
    Event cleared) stops it where it is, like SIGSTOP, and setting it again is SIGCONT.
    `ResetWorker` is answered as the worker does: forget everything, announce again.
    `fail_step` answers that step with a `WorkerError` once; requests in `fail_requests`
    are failed by every step that computes them (as the worker reports a request that makes
    its step raise)."""

    def __init__(self, addr: str, step_s: float = 0.005, device: str = "cpu") -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.step_s = step_s
        self.device = device
        self.computing: int | None = None  # the step id of the plan being executed
        self.scheduled: dict[int, list[str]] = {}  # step id -> the requests it scheduled
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.hung = False
        self.num_steps = 0
        self.num_resets = 0
        self.frozen = asyncio.Event()
        self.frozen.set()  # set: running
        self.fail_step: int | None = None
        self.fail_requests: set[str] = set()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        ready = p.WorkerReady("toy", NUM_HBM_BLOCKS, 256, BLOCK_SIZE, 256, self.device, vocab_size=VOCAB_SIZE)
        await self.sock.send(p.encode(ready))
        while True:
            await self.frozen.wait()
            plan = p.worker_msg_decoder.decode(await self.sock.recv())
            await self.frozen.wait()
            if isinstance(plan, p.ResetWorker):
                if self.hung:  # stuck in a step: it never gets to the reset
                    continue
                self.tokens.clear()
                self.num_resets += 1
                await self.sock.send(p.encode(ready))
                continue
            self.computing = plan.step_id
            self.scheduled[plan.step_id] = [s.request_id for s in plan.scheduled]
            await asyncio.sleep(self.step_s)
            await self.frozen.wait()
            if plan.step_id == self.fail_step:
                self.fail_step = None
                await self.sock.send(p.encode(p.WorkerError(plan.step_id, "RuntimeError: a copy failed")))
            elif not self.hung:
                await self.sock.send(p.encode(self.execute(plan)))

    def execute(self, plan: p.Plan) -> p.StepResult:
        for rid in plan.drop:
            self.tokens.pop(rid, None)
        fresh = set()  # a whole new block table: it may start at a prefix-cache hit
        for new in plan.new_requests:
            assert new.request_id not in self.tokens, f"{new.request_id} sent twice"
            self.tokens[new.request_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            fresh.add(new.request_id)
        ids, toks = [], []
        failed = {}
        for s in plan.scheduled:
            if s.request_id not in self.tokens:  # failed in an earlier step
                continue
            if s.request_id in self.fail_requests:
                failed[s.request_id] = f"InjectedFault: computing request {s.request_id} raises"
                del self.tokens[s.request_id]
                continue
            tokens = self.tokens[s.request_id]
            if s.request_id in fresh or s.block_table is not None:
                if s.num_computed_tokens % BLOCK_SIZE == 0:
                    self.computed[s.request_id] = s.num_computed_tokens
            assert s.num_computed_tokens == self.computed[s.request_id], s
            end = s.num_computed_tokens + s.num_new_tokens
            assert end <= len(tokens), s
            self.computed[s.request_id] = end
            if end == len(tokens):
                tokens.append(next_token(tokens))
                ids.append(s.request_id)
                toks.append(tokens[-1])
        self.num_steps += 1
        return p.StepResult(step_id=plan.step_id, request_ids=ids, token_ids=toks, failed=failed)

    async def kill(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close()
        self.ctx.term()


@dataclass
class Gateway:
    sock: zmq.asyncio.Socket
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    errors: dict[str, p.RequestError] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)

    async def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        params = p.SamplingParams(max_tokens=max_tokens, temperature=0.0)
        await self.sock.send(p.encode(p.AddRequest(rid, prompt, params)))

    async def recv_loop(self) -> None:
        while True:
            match p.gateway_reply_decoder.decode(await self.sock.recv()):
                case p.StepOutputs(outputs=outs):
                    for o in outs:
                        self.tokens.setdefault(o.request_id, []).extend(o.token_ids)
                        self.token_times.append(time.monotonic())
                        if o.finish_reason is not None:
                            self.finished[o.request_id] = o.finish_reason
                case p.RequestError(request_id=rid) as err:
                    self.errors[rid] = err

    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


async def heartbeat(sock: zmq.asyncio.Socket, gateway_id: str = "gw-test") -> None:
    """Hello every second, as a real gateway says it: a silent one is taken for gone."""
    while True:
        await sock.send(p.encode(p.GatewayHello(gateway_id)))
        await asyncio.sleep(1.0)


async def until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


@dataclass
class Rig:
    service: SchedulerService
    gateway: Gateway
    worker_addr: str


async def run_rig(tmp_path, scenario, step_timeout_s: float = 0.3, worker_wait_s: float = 120.0, **cfg):
    """Start the service and a gateway; `scenario(rig)` starts and kills workers."""
    cfg = SchedulerConfig(**{"max_batched_tokens": 32, **cfg})
    addr = lambda name: f"ipc://{tmp_path}/{name}.sock"  # noqa: E731
    service = SchedulerService(
        cfg, addr("sched"), addr("worker"), setup_logging("scheduler", "warning"),
        admin_bind="off", step_timeout_s=step_timeout_s, worker_wait_s=worker_wait_s,
    )
    loop_task = asyncio.create_task(service.run())
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr("sched"))
    gateway = Gateway(sock)
    tasks = [asyncio.create_task(heartbeat(sock)), asyncio.create_task(gateway.recv_loop())]
    try:
        return await scenario(Rig(service, gateway, addr("worker")))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        service.stopping = True
        await loop_task
        sock.close()
        ctx.term()
