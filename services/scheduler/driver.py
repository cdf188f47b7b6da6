"""The step driver: the scheduler's loop, written once.

    arrivals ──core.add_request──▶ SchedulerCore ──step(now): plans──▶ send ──▶ worker
                                        ▲                                       │
                                        └──── result(...): oldest plan first ◀──┘

Pipelined: up to `depth` plans are at the worker at once, so plan t+1 is built and sent
while t computes (the core assumes one new token per decoding request; the worker drops
entries of requests that finished in t). A result is applied to the oldest plan in flight.

Pure like the core: no I/O and no clock of its own. The caller passes `now`, `send` hands a
plan to the worker and returns what to keep with it until its result is back, and `timer`
(if any) times each `schedule()` call. The live service (service.py) plugs in its sockets
and monotonic clock; the simulator and the replay of a live run (bench/sim/engine.py, `run_clock`)
a virtual clock. What the simulator says about the server holds because both run this.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from services.scheduler.core import SchedulerCore
from services.scheduler.core.step import Step
from shared.protocol import Plan, StepResult, TokenOutput


class Sent(Protocol):
    """What the caller keeps for a plan in flight; the driver needs only its step id."""

    step_id: int


S = TypeVar("S", bound=Sent)


class Driver(Generic[S]):
    def __init__(
        self,
        core: SchedulerCore,
        send: Callable[[Plan, Step, float], S],
        depth: int,
        timer: Callable[[], float] | None = None,
    ) -> None:
        """`send(plan, step, schedule_s)`: the plan, the core's record of the step that
        built it, and how long `schedule()` took by `timer` (0 without one)."""
        self.core = core
        self.send = send
        self.depth = depth
        self.timer = timer
        self.in_flight: deque[S] = deque()  # what `send` returned per plan not yet back, oldest first
        self.schedule_s = 0.0  # the latest schedule() call, by `timer`

    def step(self, now: float) -> bool:
        """Plan and send until `depth` plans are in flight or the core has nothing to plan.
        Returns True when it had nothing (the last `schedule()` call built no plan)."""
        while len(self.in_flight) < self.depth:
            t0 = self.timer() if self.timer else 0.0
            plan = self.core.schedule(now)
            self.schedule_s = self.timer() - t0 if self.timer else 0.0
            if plan is None:
                return True
            self.in_flight.append(self.send(plan, self.core.last_step, self.schedule_s))
        return False

    def result(self, result: StepResult, now: float) -> tuple[S, list[TokenOutput]] | None:
        """Apply the result of the oldest plan in flight: (what `send` kept for it, the
        core's outputs). None, applying nothing, when it is not that plan's result."""
        if not self.in_flight or result.step_id != self.in_flight[0].step_id:
            return None
        sent = self.in_flight.popleft()
        return sent, self.core.update(result, now)
