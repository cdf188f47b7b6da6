"""Every id and length of a Plan, checked against this worker before any of it runs.

A block id becomes a byte offset in native code (`block * block_stride`), a position an index
into the rope tables and a block table, a token id a row of the embedding: none of them may
be trusted because it crossed a socket (a scheduler bug, a scheduler that planned for a
bigger pool before this worker restarted, a bad peer). A Plan that fails here fails its step
as a whole with a `PlanError` naming the field and the request; nothing of it has run, so the
worker's state is as before, and the scheduler's recovery resets it as after any failed step.

Two halves, both a few microseconds for a step of decodes:
- `check_ids(plan)`, on receipt, before a swap-in of the plan may be started early: every
  block id inside its pool, every token id inside the vocabulary, counts and positions inside
  the context window, no table wider than a request can use;
- `check_tables(plan)`, at the step, against the requests the runner holds: each scheduled
  request's tokens inside those it knows, and its block table (after the plan's changes)
  covering every position the step computes. A request the runner does not know is left to
  the runner (it fails alone, as a request dropped by a failed step must).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import add

from shared import protocol as p


class PlanError(ValueError):
    """A Plan this worker cannot run: `field` of request `request_id` (None: of the plan)."""

    def __init__(self, step_id: int, field: str, message: str, request_id: str | None = None) -> None:
        self.step_id, self.field, self.request_id = step_id, field, request_id
        of = f" of request {request_id!r}" if request_id is not None else ""
        super().__init__(f"bad plan (step {step_id}): {field}{of}: {message}")


@dataclass(frozen=True, slots=True)
class Limits:
    """What a Plan's ids and lengths must fit: this worker's `WorkerReady`."""

    num_hbm_blocks: int
    num_dram_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int

    @classmethod
    def of(cls, ready: p.WorkerReady) -> Limits:
        return cls(ready.num_hbm_blocks, ready.num_dram_blocks, ready.block_size, ready.max_model_len, ready.vocab_size)

    @property
    def max_blocks_per_request(self) -> int:
        return -(-self.max_model_len // self.block_size)


class PlanChecker:
    """`check_ids` and `check_tables` for one worker. `known(request_id)` gives (tokens known,
    block table length) of a request the runner holds, else None (ModelRunner.extent)."""

    def __init__(self, limits: Limits, known) -> None:
        self.limits = limits
        self.known = known
        self.widest = limits.max_blocks_per_request

    def check_ids(self, plan: p.Plan) -> None:
        lim, step = self.limits, plan.step_id
        for r in plan.new_requests:
            rid = r.request_id
            num_tokens = len(r.prompt_token_ids) + len(r.output_token_ids)
            if not 1 <= num_tokens <= lim.max_model_len:
                why = f"{num_tokens} tokens, outside 1..{lim.max_model_len}"
                raise PlanError(step, "new_requests.prompt_token_ids", why, rid)
            for name, ids in (
                ("prompt_token_ids", r.prompt_token_ids),
                ("output_token_ids", r.output_token_ids),
                ("params.stop_token_ids", r.params.stop_token_ids),
                ("params.logit_bias", list(r.params.logit_bias)),
            ):
                _in_range(ids, lim.vocab_size, step, f"new_requests.{name}", "the vocabulary", rid)
            for name in ("logprobs", "prompt_logprobs"):
                k = getattr(r.params, name)
                if k is not None and not 0 <= k <= lim.vocab_size:
                    raise PlanError(step, f"new_requests.params.{name}", f"{k} outside 0..{lim.vocab_size}", rid)
        if not self._scheduled_fine(plan.scheduled):
            self._explain_scheduled(plan)
        hbm, dram = (lim.num_hbm_blocks, "the HBM pool"), (lim.num_dram_blocks, "the DRAM pool")
        for name, pairs, src, dst in (
            ("swap_in", plan.swap_in, dram, hbm),
            ("swap_out", plan.swap_out, hbm, dram),
            ("eager", plan.eager, hbm, dram),
        ):
            if pairs:
                _in_range([a for a, _ in pairs], src[0], step, f"{name} (source)", src[1])
                _in_range([b for _, b in pairs], dst[0], step, f"{name} (destination)", dst[1])

    def _scheduled_fine(self, scheduled: list[p.ScheduledRequest]) -> bool:
        """The common step (no table replaced) checked in a few builtin calls over lists; False
        where `_explain_scheduled` must look request by request."""
        if not scheduled:
            return True
        lim = self.limits
        starts = [s.num_computed_tokens for s in scheduled]
        counts = [s.num_new_tokens for s in scheduled]
        blocks = [s.new_block_ids for s in scheduled]
        flat = [b for ids in blocks for b in ids]
        return (
            min(starts) >= 0
            and min(counts) >= 1
            and max(map(add, starts, counts)) <= lim.max_model_len
            and (not flat or (min(flat) >= 0 and max(flat) < lim.num_hbm_blocks))
            and max(map(len, blocks)) <= self.widest
            and [s.block_table for s in scheduled].count(None) == len(scheduled)
            and len({s.request_id for s in scheduled}) == len(scheduled)
        )

    def _explain_scheduled(self, plan: p.Plan) -> None:
        """Request by request: raises naming the field and the request that fails."""
        lim, step = self.limits, plan.step_id
        seen: set[str] = set()
        for s in plan.scheduled:
            rid = s.request_id
            if rid in seen:
                raise PlanError(step, "scheduled", "scheduled twice in one step", rid)
            seen.add(rid)
            if s.num_computed_tokens < 0:
                raise PlanError(step, "scheduled.num_computed_tokens", f"{s.num_computed_tokens} is negative", rid)
            if s.num_new_tokens < 1:
                raise PlanError(step, "scheduled.num_new_tokens", f"{s.num_new_tokens} is not positive", rid)
            if (end := s.num_computed_tokens + s.num_new_tokens) > lim.max_model_len:
                why = f"positions up to {end} past the context window of {lim.max_model_len}"
                raise PlanError(step, "scheduled.num_new_tokens", why, rid)
            width = len(s.new_block_ids) + (len(s.block_table) if s.block_table is not None else 0)
            if width > lim.max_blocks_per_request:
                why = f"{width} blocks, more than the {lim.max_blocks_per_request} of a whole context"
                raise PlanError(step, "scheduled.block_table", why, rid)
            _in_range(s.new_block_ids, lim.num_hbm_blocks, step, "scheduled.new_block_ids", "the HBM pool", rid)
            if s.block_table is not None:
                _in_range(s.block_table, lim.num_hbm_blocks, step, "scheduled.block_table", "the HBM pool", rid)

    def check_tables(self, plan: p.Plan) -> None:
        """After `check_ids`; `plan.drop` and `plan.new_requests` are applied before the step."""
        new = {r.request_id: len(r.prompt_token_ids) + len(r.output_token_ids) for r in plan.new_requests}
        dropped = set(plan.drop) if plan.drop else ()
        bs, widest, known = self.limits.block_size, self.widest, self.known
        for s in plan.scheduled:
            rid = s.request_id
            if rid in new:
                num_tokens, width = new[rid], 0
            elif rid in dropped or (extent := known(rid)) is None:
                continue  # unknown to the runner: it fails this request alone
            else:
                num_tokens, width = extent
            if s.block_table is not None:
                width = len(s.block_table)
            width += len(s.new_block_ids)
            end = s.num_computed_tokens + s.num_new_tokens
            if end <= num_tokens and width <= widest and width * bs >= end:
                continue
            if end > num_tokens:
                why = f"positions up to {end}, the worker knows {num_tokens} tokens"
                raise PlanError(plan.step_id, "scheduled.num_new_tokens", why, rid)
            if width > widest:
                why = f"the table grows to {width} blocks, more than the {widest} of a whole context"
                raise PlanError(plan.step_id, "scheduled.new_block_ids", why, rid)
            if width * bs < end:
                why = f"{width} blocks of {bs} hold {width * bs} positions, the step computes up to {end}"
                raise PlanError(plan.step_id, "scheduled.block_table", why, rid)


def _in_range(ids: list[int], size: int, step: int, field: str, what: str, request_id: str | None = None) -> None:
    """Every id in 0..size-1 (min and max run in C: a 16-row step checks in microseconds)."""
    if ids and (min(ids) < 0 or max(ids) >= size):
        bad = next(i for i in ids if not 0 <= i < size)
        raise PlanError(step, field, f"id {bad} outside {what} (0..{size - 1})", request_id)
