"""The paper's baselines (Fig. 16) as policies on this core, each as that system behaves.
None of them swaps: a preempted request's KV is dropped and recomputed (vLLM V1's `fcfs`
is fcfs.py). bench/REPRODUCTION.md describes them beside the paper's systems.

- `trtllm`, TensorRT-LLM's guaranteed-no-evict scheduler: in arrival order, a request is
  admitted only if HBM holds prompt + `max_tokens` for it on top of what every running
  request has reserved the same way (`max_tokens` is the client's cap, not the true output
  length: the reservation is mostly never used). The first that does not fit ends
  admission. A running request therefore always finds its next block, and nobody is ever
  preempted.
- `lightllm`, LightLLM's router: in arrival order, a request is admitted while the
  predicted peak KV of the running set with it fits HBM. A request's output is estimated
  from what has been seen: the mean output length of the requests finished so far (its
  cap until one has finished), at least what it has generated + 1, at most its cap. The
  peak is LightLLM's: with the requests sorted by estimated tokens left, longest first,
  when the i-th finishes the first i hold their tokens now + i × its tokens left (those
  after it have finished). An estimate that was too short runs out of blocks: growth
  preempts the newest arrival, as FCFS does.
- `ltr`, learning to rank (Fu et al.): requests by predicted output length, shortest
  first (`Request.predicted_output`, from the core's predictor: the simulator's is a noisy
  one of the true length, seeded per request). A paused request that has waited longer
  than the TTFT SLO since its last token (or arrival) is starving and goes first, in
  arrival order. A paused request that does not fit displaces running requests ranked
  after it, the lowest first, that have sampled since they were put on the GPU (so that
  recompute cannot livelock); the first that cannot be placed ends admission.
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
from .policy import PolicyView
from .request import Request, Status, blocks_for
from .step import Step


def paused(core: PolicyView) -> Iterable[Request]:
    return itertools.chain(core.q_waiting.members(), core.q_rotary.members())


# ---------------------------------------------------------------- trtllm


def schedule_trtllm(core: PolicyView, step: Step) -> None:
    schedule_running(core, step, sorted(core.running.values(), key=lambda r: r.seq), preempt=False)
    owed = sum(reserved_blocks(core, r) - len(r.hbm_blocks) for r in core.running.values())
    for req in sorted(paused(core), key=lambda r: r.seq):
        if step.tokens_left == 0 or step.seqs_left == 0 or len(core.running) >= core.cfg.max_num_seqs:
            return
        if req.num_pending or not req.num_schedulable():
            continue
        num_new = min(req.num_schedulable(), step.tokens_left)
        need = reserved_blocks(core, req)
        step.num_blocks_wanted += need
        if core.memory.hbm.num_free - owed < need:
            return
        core.admit(req, step, num_new)
        owed += need - len(req.hbm_blocks)


def reserved_blocks(core: PolicyView, req: Request) -> int:
    """HBM blocks a request may ever hold: prompt + max_tokens (within the context window)."""
    return blocks_for(min(len(req.prompt_token_ids) + req.params.max_tokens, req.max_model_len), core.cfg.block_size)


# ---------------------------------------------------------------- lightllm


def schedule_lightllm(core: PolicyView, step: Step) -> None:
    schedule_running(core, step, sorted(core.running.values(), key=lambda r: r.seq))
    if step.num_preempted:
        return
    mean_out = core.num_finished_output_tokens / core.num_finished if core.num_finished else None
    held = [(r.num_known, tokens_left(r, mean_out)) for r in core.running.values()]
    bs = core.cfg.block_size
    for req in sorted(paused(core), key=lambda r: r.seq):
        if step.tokens_left == 0 or step.seqs_left == 0 or len(core.running) >= core.cfg.max_num_seqs:
            return
        if req.preempted_step == step.step_id or req.num_pending or not req.num_schedulable():
            continue
        num_new = min(req.num_schedulable(), step.tokens_left)
        need = core.memory.blocks_to_admit(req, num_new, core.cfg.reserve_full_prompt)
        step.num_blocks_wanted += need
        mine = (req.num_known, tokens_left(req, mean_out))
        # Each request may leave its last block part empty: count a block of slack per request.
        capacity = (core.memory.hbm.num_blocks - len(held) - 1) * bs
        if peak_tokens([*held, mine]) > capacity or not core.memory.hbm.can_allocate(need):
            return
        core.admit(req, step, num_new)
        held.append(mine)


def tokens_left(req: Request, mean_out: float | None) -> int:
    """Output tokens `req` is expected to add still: LightLLM's estimate from what has been seen."""
    num_out = len(req.output_token_ids) + req.num_pending
    cap = req.params.max_tokens
    est = cap if mean_out is None else min(cap, max(round(mean_out), num_out + 1))
    return max(est - num_out, 0)


def peak_tokens(held: list[tuple[int, int]]) -> int:
    """The peak KV tokens of requests (tokens now, tokens still to come) run to the end:
    max over i of the tokens of the i longest-to-go now + i × the i-th one's tokens to go."""
    peak, now = 0, 0
    for i, (num_now, num_left) in enumerate(sorted(held, key=lambda h: -h[1]), 1):
        now += num_now
        peak = max(peak, now + i * num_left)
    return peak


# ---------------------------------------------------------------- ltr and edf


def schedule_ltr(core: PolicyView, step: Step) -> None:
    now, slo = step.now, core.cfg.ttft_slo

    def rank(r: Request) -> tuple:
        starving = r.status is not Status.RUNNING and now - r.last_token_time > slo
        return (0, r.seq) if starving else (1, r.predicted_output, r.seq)

    admit_displacing(core, step, sorted(paused(core), key=rank), rank)
    schedule_running(core, step, sorted(core.running.values(), key=rank))


def admit_displacing(core: PolicyView, step: Step, candidates: list[Request], rank: Callable[[Request], tuple]) -> None:
    """Admit `candidates` in order (ranked by `rank`), each displacing lower-ranked running
    requests (recompute) if it does not fit; running decodes keep a token each."""
    memory, cfg = core.memory, core.cfg
    tail = sorted(core.running.values(), key=rank, reverse=True)  # lowest rank first
    num_decodes = sum(1 for r in tail if r.num_schedulable() == 1)
    for req in candidates:
        if req.preempted_step == step.step_id or req.num_pending or not req.num_schedulable():
            continue
        num_new = min(req.num_schedulable(), step.tokens_left - num_decodes)
        if num_new <= 0 or step.seqs_left - num_decodes <= 0 or len(core.running) >= cfg.max_num_seqs:
            return
        need = memory.blocks_to_admit(req, num_new, cfg.reserve_full_prompt)
        step.num_blocks_wanted += need
        if not memory.hbm.can_allocate(need):
            key = rank(req)
            victims = [
                r
                for r in tail
                if r.status is Status.RUNNING
                and rank(r) > key
                and r.sampled_since_run_start()
                and not step.is_scheduled(r)
            ]
            if memory.hbm.num_free + sum(len(v.hbm_blocks) for v in victims) < need:
                return  # even all of them would not make room: disturb nobody
            for victim in victims:
                if memory.hbm.can_allocate(need):
                    break
                num_decodes -= victim.num_schedulable() == 1
                core.preempt(victim, step)
            # A victim's blocks that another request shares (prefix caching) stay in use.
            if not memory.hbm.can_allocate(memory.blocks_to_admit(req, num_new, cfg.reserve_full_prompt)):
                return
        core.admit(req, step, num_new)


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
    "lightllm": schedule_lightllm,
    "ltr": schedule_ltr,
    "edf": schedule_edf,
}
