"""What a policy sees of the scheduler core: its state, and the two transitions it may ask for.

`SchedulerCore` (scheduler.py) is the one implementation; the policies (fcfs.py, lvf.py, baselines.py)
take this view, so they do not import the core that imports them. A policy reads the queues
and the pools, decides, and calls `admit` or `preempt`; the core applies the transition
and records it on the `Step` (`step.admitted`, `step.preempted`).
"""

from __future__ import annotations

from typing import Protocol

from .config import SchedulerConfig
from .memory import Memory
from .queues import RequestHeap
from .request import Request
from .step import Step


class PolicyView(Protocol):
    cfg: SchedulerConfig
    memory: Memory
    running: dict[str, Request]
    q_waiting: RequestHeap  # paused requests by arrival (FCFS family)
    q_rotary: RequestHeap
    q_first: RequestHeap  # paused requests by VLT lag key (LVF): no token emitted yet
    q_emitted: RequestHeap
    num_finished: int
    num_finished_output_tokens: int  # outputs of the requests finished so far, summed

    def grant(self, req: Request, step: Step, reserve: int = 0, wanted: int | None = None) -> int:
        """Tokens `req` may compute this step: its schedulable ones (`wanted`, when the caller
        has `req.num_schedulable()` at hand) within the step's token budget less `reserve`,
        and a prefill chunk within the step's prefill cap. 0 when none."""
        ...

    def admit(self, req: Request, step: Step, num_new_tokens: int) -> None:
        """WAITING/ROTARY -> RUNNING with its first `num_new_tokens` scheduled (capacity checked)."""
        ...

    def preempt(self, req: Request, step: Step, recompute_ok: bool = True) -> bool:
        """RUNNING -> ROTARY (swap) or WAITING (recompute, if `recompute_ok`); whether it was preempted."""
        ...
