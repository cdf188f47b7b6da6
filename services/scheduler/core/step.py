"""The record of one step while it is planned: budgets, scheduled work, copies, and the
requests it admitted and preempted (what the service's observer reports)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.protocol import Plan

from .request import Request


def samples(num_computed_tokens: int, num_new_tokens: int, num_known: int) -> bool:
    """Whether a request samples a token in a step that computes `num_new_tokens` of its
    tokens from position `num_computed_tokens`: when they reach the end of its `num_known`
    tokens (prompt + every token sampled before, those planned but not back yet included).
    A prefill chunk short of the end samples nothing. The one place the rule is written: the
    core counts a pending token by it, and the simulator's worker, calibration and the
    scheduling micro-benchmark pick the requests that sample by it."""
    return num_computed_tokens + num_new_tokens == num_known


def sampling(plan: Plan, num_known: Callable[[str], int]) -> list[str]:
    """The ids of the plan's scheduled requests that sample, in plan order; `num_known(id)`
    is the request's known tokens as the plan was built."""
    return [
        s.request_id
        for s in plan.scheduled
        if samples(s.num_computed_tokens, s.num_new_tokens, num_known(s.request_id))
    ]


@dataclass
class Step:
    step_id: int
    now: float
    tokens_left: int  # chunked-prefill token budget
    prefill_left: int  # of which capped prefill chunks may still take (slo_chunking, steptime.py)
    moves_left: int  # B_xfer: blocks that may still be copied this step
    seqs_left: int  # requests that may still be scheduled this step
    free_hbm_at_start: int
    scheduled: list[Request] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (dram, hbm)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (hbm, dram)
    eager: list[tuple[int, int]] = field(default_factory=list)  # (hbm, dram)
    admitted: list[Request] = field(default_factory=list)  # WAITING/ROTARY -> RUNNING, in order
    preempted: list[Request] = field(default_factory=list)  # RUNNING -> ROTARY/WAITING, in order
    num_recomputed: int = 0
    num_swapped_in_reqs: int = 0
    # HBM blocks the step tried to place (admissions and growth), met or not: a step may
    # preempt only when this exceeds the free blocks it started with.
    num_blocks_wanted: int = 0
    fits_all: bool = False  # HBM held every live request's KV when the step began

    @property
    def num_preempted(self) -> int:  # swap and recompute
        return len(self.preempted)

    @property
    def num_moved(self) -> int:
        return len(self.swap_in) + len(self.swap_out) + len(self.eager)

    def schedule(self, req: Request, num_new_tokens: int) -> None:
        """Advance `req` by `num_new_tokens` (its blocks must already be allocated)."""
        req.step_new_tokens = num_new_tokens
        req.scheduled_step = self.step_id
        num_known = len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_pending  # `req.num_known`
        if samples(req.num_computed_tokens, num_new_tokens, num_known):
            req.num_pending += 1  # its token's position is known, its id when the result is back
        req.num_computed_tokens += num_new_tokens
        self.tokens_left -= num_new_tokens
        if num_new_tokens > 1:
            self.prefill_left -= num_new_tokens
        self.seqs_left -= 1
        self.scheduled.append(req)

    def is_scheduled(self, req: Request) -> bool:
        return req.scheduled_step == self.step_id
