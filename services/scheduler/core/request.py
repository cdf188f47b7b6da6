"""One request's scheduling state.

Token accounting follows vLLM v1: `num_computed_tokens` advances when a step is planned,
not when its result arrives, so the next plan can be built while the previous one runs.
A step that computes up to the end of the known tokens samples one token; until that
token comes back it is a *pending* token (`num_pending`): its position is known, its id is
not (the worker has it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.protocol import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # no KV anywhere
    RUNNING = "running"  # KV in HBM
    ROTARY = "rotary"  # paused, KV complete in DRAM
    FINISHED = "finished"
    ABORTED = "aborted"


LIVE = (Status.WAITING, Status.RUNNING, Status.ROTARY)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    seq: int  # arrival order, the FCFS priority
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    ttft_slo: float
    tbt_slo: float
    arrival: float
    max_model_len: int
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_pending: int = 0
    # Live KV blocks in HBM (RUNNING) and DRAM blocks: the live copy (ROTARY) or mirrors
    # of the first len(dram_blocks) synced blocks (RUNNING, eager rotation).
    hbm_blocks: list[int] = field(default_factory=list)
    dram_blocks: list[int] = field(default_factory=list)
    last_token_time: float = 0.0
    run_start: float = 0.0
    num_outputs_at_run_start: int = 0
    sent: bool = False  # the worker has seen it in Plan.new_requests
    num_sent_blocks: int = 0  # prefix of hbm_blocks the worker's block table holds
    table_reset: bool = False  # next ScheduledRequest carries the whole block table
    scheduled_step: int = -1  # last step that computed tokens for it
    step_new_tokens: int = 0  # tokens planned in `scheduled_step`
    preempted_step: int = -1
    paused_at: float = 0.0  # `now` of the step that last preempted it
    swap_in_step: int = -1  # its DRAM blocks are read and HBM blocks written in that step
    # Prefix caching: chain hashes of its first full blocks of known tokens (prefix.py), how
    # many of hbm_blocks have been offered to the cache, and the prompt tokens its first
    # admission found cached (OpenAI usage.prompt_tokens_details.cached_tokens).
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0
    num_cached_tokens: int = 0
    num_dram_cached_tokens: int = 0  # of those, loaded from the DRAM tier (tier.py)
    demand_blocks: int = 0  # blocks_for(num_known), summed by the core
    num_waiting_tokens: int = 0  # num_tokens while in the core's waiting queue, summed by the core
    finish_reason: str | None = None
    predicted_output: float = 0.0  # output tokens the core's predictor expects (the ltr policy ranks by it)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known(self) -> int:
        """Tokens whose positions are known: prompt + outputs + pending samples."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def has_emitted(self) -> bool:
        return bool(self.output_token_ids)

    @property
    def is_live(self) -> bool:
        return self.status in LIVE

    def sampled_since_run_start(self) -> bool:
        return len(self.output_token_ids) > self.num_outputs_at_run_start

    def wants_more(self) -> bool:
        num_out = len(self.output_token_ids) + self.num_pending
        return num_out < self.params.max_tokens and self.num_known < self.max_model_len

    def num_schedulable(self) -> int:
        """Tokens it could compute now (0 while all it needs is a pending sample, or when it
        wants no more: `wants_more`, inlined; the scheduler asks this of every request each step)."""
        num_out = len(self.output_token_ids) + self.num_pending
        num_known = len(self.prompt_token_ids) + num_out
        if num_out < self.params.max_tokens and num_known < self.max_model_len:
            return num_known - self.num_computed_tokens
        return 0

    def token_all(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def finish_check(self, stop: bool) -> str | None:
        """Finish reason after a token was appended, or None."""
        if stop:
            return "stop"
        num_out = len(self.output_token_ids)
        if num_out >= self.params.max_tokens:
            return "length"
        if len(self.prompt_token_ids) + num_out >= self.max_model_len:  # num_tokens
            return "length"
        return None
