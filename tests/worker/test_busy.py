"""The worker's socket loop says `WorkerBusy` every second while a step computes, and nothing
while it does not: the real `WorkerService` over real ZeroMQ, its step a slow stand-in (the
model's compute is not what is tested here; a saturated host is)."""

from __future__ import annotations

import threading
import time

import zmq

from services.worker.service import WorkerService
from shared import protocol as p
from shared.log import setup_logging

STEP_S = 2.6


class SlowSteps:
    """The executor's interface, each plan taking STEP_S."""

    def __call__(self, plan: p.Plan, plan_wait_s: float) -> p.StepResult:
        if plan.step_id >= 0:
            time.sleep(STEP_S)
        return p.StepResult(step_id=plan.step_id)

    def reset_plan(self) -> p.Plan:
        return p.Plan(-1)

    def try_prefetch(self, plan: p.Plan, log) -> None:
        pass


def test_a_computing_worker_says_it_is_busy_every_second(tmp_path):
    addr = f"ipc://{tmp_path}/w.sock"
    ctx = zmq.Context()
    sched = ctx.socket(zmq.DEALER)
    sched.setsockopt(zmq.LINGER, 0)
    sched.bind(addr)
    ready = p.WorkerReady("toy", 8, 8, 4, 32, "cpu")
    service = WorkerService(addr, ready, SlowSteps(), setup_logging("worker", "warning"))
    runner = threading.Thread(target=service.run)
    runner.start()
    try:
        assert sched.poll(20_000), "no WorkerReady"
        assert isinstance(p.worker_reply_decoder.decode(sched.recv()), p.WorkerReady)
        time.sleep(1.5)
        assert not sched.poll(0), "busy while idle"
        sched.send(p.encode(p.Plan(0)))
        replies, t0 = [], time.monotonic()
        while not any(isinstance(r, p.StepResult) for r in replies) and time.monotonic() - t0 < 20:
            if sched.poll(500):
                replies.append(p.worker_reply_decoder.decode(sched.recv()))
        busy = [r for r in replies if isinstance(r, p.WorkerBusy)]
        assert isinstance(replies[-1], p.StepResult) and replies[-1].step_id == 0, replies
        assert len(busy) >= 2 and all(b.step_id == 0 for b in busy), replies
    finally:
        service.stop()
        runner.join(10)
        sched.close()
        ctx.term()
