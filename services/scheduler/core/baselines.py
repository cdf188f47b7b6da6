"""The paper's baselines (Fig. 16) as policies on this core, each as that system's code
behaves (bench/report/baselines_table.py names the file each rule was read from, and what
is left out). vLLM V1's `fcfs` is fcfs.py; `ltr` is ltr.py.

- `trtllm`, TensorRT-LLM's GUARANTEED_NO_EVICT capacity scheduler: the running requests go
  first, each keeping what it needs to run to completion; then the waiting ones in arrival
  order, each admitted only if the free blocks, less what every admitted request still
  needs to complete, hold its prompt + `max_tokens` less the prefix-cache hits it shares;
  the first that does not fit ends admission. Nobody is ever preempted: a running request
  always finds its next block.
- `trtllm-maxutil`, its MAX_UTILIZATION scheduler: every live request in arrival order
  asks for its next step's blocks only; one that does not fit pauses (recompute) the
  newest started request behind it, again until it fits or none is left, which ends the
  step's scheduling. An older request thus takes blocks from newer ones.
- `lightllm`, LightLLM's router: waiting requests in arrival order are admitted while the
  predicted peak KV of the running set with them stays under the pool. A request counts
  (a, b) tokens: `a` those it holds now + 1, `b` those it may still add: what is left of
  its `max_tokens` while the router is busy (always, at its default `router_token_ratio`
  0.0), else of max(1.1 × its output so far, `router_max_new_token_len`), plus 6, plus
  (`max_wait_tokens` + 1) per prefill chunk still to run. The peak is, longest to go first,
  the max over i of the first i's `a` summed + i × the i-th's `b`. At ratio 0.0 the
  estimate is an upper bound and LightLLM never pauses a request; above it, a request
  short of its next block pauses (recompute) the newest.
- `edf`, earliest deadline first (our own extra baseline): a request's deadline is its TTFT
  deadline (arrival + TTFT SLO) until it has emitted a token, then its next token's
  (last token + TBT SLO). Running requests get their tokens in deadline order and one
  short of blocks preempts the latest deadline; paused requests are admitted in deadline
  order while they fit (no displacement: a paused request's next-token deadline has
  passed, so it would displace a running one every step).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from .fcfs import admit_in_order, schedule_running
from .ltr import schedule_ltr
from .policy import PolicyView
from .request import Request, Status, blocks_for
from .step import Step


# The policies whose admission reads a request's max_tokens: benchmarked as `vllm bench serve`
# runs them, the client sending each request's own output length as its max_tokens.
CLIENT_SENDS_OUTPUT_LEN = ("trtllm", "trtllm-maxutil", "lightllm")


def paused(core: PolicyView) -> Iterable[Request]:
    return itertools.chain(core.q_waiting.members(), core.q_rotary.members())


def by_seq(reqs: Iterable[Request]) -> list[Request]:
    return sorted(reqs, key=lambda r: r.seq)


def out_of_budget(core: PolicyView, step: Step) -> bool:
    return step.tokens_left == 0 or step.seqs_left == 0 or len(core.running) >= core.cfg.max_num_seqs


# ---------------------------------------------------------------- trtllm (GUARANTEED_NO_EVICT)


def schedule_trtllm(core: PolicyView, step: Step) -> None:
    schedule_running(core, step, by_seq(core.running.values()), preempt=False)
    owed = sum(max(reserved_blocks(core, r) - len(r.hbm_blocks), 0) for r in core.running.values())
    for req in by_seq(paused(core)):
        if out_of_budget(core, step):
            return
        if req.num_pending or not req.num_schedulable():
            continue
        num_new = core.grant(req, step)
        if num_new == 0:
            return
        need = blocks_to_reserve(core, req)
        step.num_blocks_wanted += need
        if core.memory.hbm.num_free - owed < need:
            return  # TensorRT-LLM: the first request that does not fit ends admission
        core.admit(req, step, num_new)
        owed += max(reserved_blocks(core, req) - len(req.hbm_blocks), 0)


def reserved_blocks(core: PolicyView, req: Request) -> int:
    """HBM blocks a request may ever hold: prompt + max_tokens (within the context window),
    TensorRT-LLM's `getRemainingBlocksToCompletion` before anything is allocated."""
    num_tokens = min(len(req.prompt_token_ids) + req.params.max_tokens, req.max_model_len)
    return blocks_for(num_tokens, core.cfg.block_size)


def blocks_to_reserve(core: PolicyView, req: Request) -> int:
    """Free blocks a waiting request's admission must find: its whole reservation less the
    prefix-cache hits it shares (a hit on a cached, unreferenced block still takes one)."""
    hits = core.memory.match_prefix(req)
    return reserved_blocks(core, req) - len(hits) + core.memory.hbm.count_cached(hits)


# ---------------------------------------------------------------- trtllm-maxutil (MAX_UTILIZATION)


def schedule_trtllm_maxutil(core: PolicyView, step: Step) -> None:
    memory, cfg = core.memory, core.cfg
    order = by_seq([*core.running.values(), *paused(core)])
    num_free, end, chosen = memory.hbm.num_free, len(order), []
    i = 0
    while i < end:
        req = order[i]
        if req.status is Status.RUNNING:
            num_new = min(req.num_schedulable(), cfg.max_batched_tokens)
            need = memory.blocks_needed(req, num_new) if num_new else 0
        elif req.preempted_step != step.step_id and not req.num_pending and req.num_schedulable():
            num_new = min(req.num_schedulable(), cfg.max_batched_tokens)
            need = memory.blocks_to_admit(req, num_new, cfg.reserve_full_prompt)
        else:
            i += 1
            continue
        if need > num_free:
            step.num_blocks_wanted += need
        while need > num_free:  # pause the newest started request behind it, and cut the list there
            if num_free + memory.hbm.num_deferred >= need:
                break  # blocks still read by the step in flight come back next step: wait for them
            j = next((j for j in range(end - 1, i, -1) if order[j].status is Status.RUNNING), None)
            if j is None:
                break
            core.preempt(order[j], step)
            num_free, end = memory.hbm.num_free, j
        if need > num_free:
            break  # nothing started behind it: TensorRT-LLM stops scheduling here
        num_free -= need
        chosen.append(req)
        i += 1
    to_admit = [r for r in chosen if r.status is not Status.RUNNING]
    schedule_running(core, step, [r for r in chosen if r.status is Status.RUNNING])
    for req in to_admit:
        if out_of_budget(core, step):
            return
        if req.preempted_step == step.step_id:
            continue
        num_new = core.grant(req, step)
        if num_new == 0:
            return
        room = memory.blocks_to_admit(req, num_new, cfg.reserve_full_prompt)
        step.num_blocks_wanted += room
        if not memory.hbm.can_allocate(room):
            return
        core.admit(req, step, num_new)


# ---------------------------------------------------------------- lightllm

ROUTER_TOKEN_RATIO = 0.0  # LightLLM's default: the router is always "busy" (its estimate is max_new_tokens)
ROUTER_MAX_NEW_TOKEN_LEN = 1024  # its default: the output length assumed when not busy
ROUTER_MAX_WAIT_TOKENS = 6  # its default: decode steps between two prefill batches
ADDED_OUTPUT_LEN = 6  # its constant slack on every request's tokens to come


def schedule_lightllm(core: PolicyView, step: Step, token_ratio: float = ROUTER_TOKEN_RATIO) -> None:
    memory, cfg = core.memory, core.cfg
    hbm, bs = memory.hbm, cfg.block_size
    busy = (hbm.num_blocks - hbm.num_free) / max(hbm.num_blocks, 1) >= token_ratio
    # At ratio 0.0 (its "safe schedule") the estimate is an upper bound and nobody is paused.
    schedule_running(core, step, by_seq(core.running.values()), preempt=token_ratio > 0.0)
    if step.num_preempted:
        return
    held = [lightllm_tokens(r, busy, cfg.max_batched_tokens) for r in core.running.values()]
    for req in by_seq(paused(core)):
        if out_of_budget(core, step):
            return
        if req.preempted_step == step.step_id or req.num_pending or not req.num_schedulable():
            continue
        num_new = core.grant(req, step)
        if num_new == 0:
            return
        need = memory.blocks_to_admit(req, num_new, cfg.reserve_full_prompt)
        step.num_blocks_wanted += need
        mine = lightllm_tokens(req, busy, cfg.max_batched_tokens)
        # LightLLM's pool is token-granular; ours leaves up to a block part empty per request.
        # A request alone is admitted whatever its estimate (LightLLM would hold it forever).
        capacity = (hbm.num_blocks - len(held) - 1) * bs
        if (held and peak_tokens([*held, mine]) >= capacity) or not hbm.can_allocate(need):
            return
        core.admit(req, step, num_new)
        held.append(mine)


def lightllm_tokens(req: Request, busy: bool, chunk: int) -> tuple[int, int]:
    """LightLLM's (tokens held now + 1, tokens it may still add) for a request, as its
    chunked-prefill request computes them (`get_tuple_tokens`)."""
    num_out = len(req.output_token_ids) + req.num_pending
    cap = req.params.max_tokens
    if busy or req.params.ignore_eos:
        est = cap
    else:
        est = min(cap, max(int(1.1 * num_out), ROUTER_MAX_NEW_TOKEN_LEN))
    num_known = req.num_known
    num_left = max(num_known - req.num_computed_tokens, 0)
    num_chunks = -(-num_left // chunk)
    held = max(num_known + 1, req.num_computed_tokens + 1)
    to_come = max(0, num_chunks * (ROUTER_MAX_WAIT_TOKENS + 1) + est - num_out - 1) + ADDED_OUTPUT_LEN
    return held, to_come


def peak_tokens(held: list[tuple[int, int]]) -> int:
    """The peak KV tokens of requests (tokens now, tokens still to come) run to the end:
    max over i of the tokens of the i longest-to-go now + i × the i-th one's tokens to go."""
    peak, now = 0, 0
    for i, (num_now, num_left) in enumerate(sorted(held, key=lambda h: -h[1]), 1):
        now += num_now
        peak = max(peak, now + i * num_left)
    return peak


# ---------------------------------------------------------------- edf


def deadline(req: Request) -> float:
    """TTFT deadline until the first token, then the next token's."""
    return req.last_token_time + req.tbt_slo if req.has_emitted else req.arrival + req.ttft_slo


def schedule_edf(core: PolicyView, step: Step) -> None:
    by_deadline = lambda r: (deadline(r), r.seq)  # noqa: E731
    schedule_running(core, step, sorted(core.running.values(), key=by_deadline))
    if step.num_preempted:
        return
    admit_in_order(core, step, sorted(paused(core), key=by_deadline))


BASELINE_STEPS: dict[str, Callable[[PolicyView, Step], None]] = {
    "trtllm": schedule_trtllm,
    "trtllm-maxutil": schedule_trtllm_maxutil,
    "lightllm": schedule_lightllm,
    "ltr": schedule_ltr,
    "edf": schedule_edf,
}
