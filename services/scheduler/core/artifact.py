"""superinfer-artifact: the scheduler the SuperInfer authors released, as its code runs (their
vLLM 0.6.6 fork, `vllm/v1/core/scheduler.py`: `Scheduler.schedule_early` and `Scheduler.schedule`;
`vllm/v1/core/kv_cache_manager.py` for what "fits" and "host use" count). Not the paper's VLT
ordering (that is `lvf-paper`, lvf.py): no VLT is computed anywhere. Each step:

1. Fits (`can_hold_all_requests`): the free HBM blocks hold every running request's blocks for
   its tokens still to compute and every paused request's blocks for all its known tokens,
   less its prefix-cache hits. Then steps 2 is skipped and the rest is vLLM's plain step.
2. Proactive swap (`schedule_early`), when it does not fit, while host use < 0.95 and fewer
   than the budget of HBM blocks are free (the artifact's `--proactive-swap-budget`, 2,400 in
   its runs; here B_xfer): running decodes, the longest on the GPU first (`in_running_since`:
   since it was last put there, not since it arrived), are swapped out while the blocks they
   free (those no other request shares) add up to less than the budget; the first that would
   reach it ends the list. Prefill chunks are passed over. So a step frees up to the budget
   whatever is free already, not budget minus free.
3. Running requests (`schedule`), in the order they were admitted: each gets its tokens to
   compute within the token budget (no decodes-first pass); one short of blocks swaps out the
   last admitted (`self.running.pop()`), itself included; a partial prefill chunk or a request
   that cannot be scheduled ends the pass.
4. Admission, unless step 3 preempted and step 2 did not: paused requests, new and swapped-out
   alike, by how long they have waited (`in_waiting_since`: the arrival, or when it was last
   preempted), each needing room for the chunk it computes now (no full-prompt reservation),
   or a swapped-out one for all its blocks. The first that does not fit ends admission, as does
   a partial chunk. While host use is above 0.9 a new request (never preempted) is passed over.

Host use (`get_kv_caches_usage()[1]`): the artifact's host pool keeps a block for every GPU
block for good (a swap-out copies only the blocks written since), so its `--swap-space S` holds
S − HBM of paused requests' KV, and its use is (HBM blocks + blocks paused requests hold) / S.
Our DRAM pool holds paused requests' KV only: it is the artifact's S − HBM, and host use is
(HBM + DRAM in use) / (HBM + DRAM). (The paper's runs: S = 400 GiB, so the like-for-like DRAM
pool is 400 GiB less the KV HBM.) With DRAM under a ninth of HBM, where the artifact cannot run,
new requests are held back only while DRAM holds something (`holds_back_new`).

Where our core differs from the artifact (docs/design.md, "The authors' released scheduler"):
a step's copies, swap-ins included, stay within B_xfer (an invariant; the artifact bounds only
step 2's swap-outs); a request is not readmitted in the step that preempted it, nor while its
sample is in flight; the paused requests are sorted every step (the artifact sorts its deque only
when not all fits, and moves passed-over new requests to its tail); a victim that cannot be
swapped is recomputed (the artifact's growth preemption reads `scheduler_config.eviction_policy`,
which its config does not define).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from .fcfs import admit_if_room, make_room
from .memory import Memory
from .policy import PolicyView
from .request import Request, Status
from .step import Step

SWAP_BELOW_HOST_USE = 0.95  # schedule_early swaps out only while host use is below this
ADMIT_NEW_UP_TO_HOST_USE = 0.9  # schedule admits new requests only while host use is not above this


def host_use(memory: Memory) -> float:
    """The artifact's host KV use: a host block for every HBM block, plus the DRAM blocks in use."""
    hbm, dram = memory.hbm.num_blocks, memory.dram
    return (hbm + dram.num_blocks - dram.num_free) / (hbm + dram.num_blocks)


def holds_back_new(memory: Memory) -> bool:
    """Host use above 0.9, and DRAM holds something. Wherever the artifact can run (HBM at most
    0.9 of HBM + DRAM) the first implies the second; on a smaller DRAM pool host use starts above
    0.9 and the first alone would hold every new request back for good."""
    dram = memory.dram
    return host_use(memory) > ADMIT_NEW_UP_TO_HOST_USE and dram.num_free < dram.num_blocks


def schedule_artifact(core: PolicyView, step: Step) -> None:
    fits = holds_all(core)
    swapped_early = False if fits else swap_out_early(core, step)
    order = list(core.running.values())  # the order they were admitted in
    num_growth_preempted = step.num_preempted
    partial = schedule_in_order(core, step, order)
    if step.num_preempted > num_growth_preempted and not swapped_early:
        return
    if not partial:
        admit_oldest_waiting(core, step, fits)


def holds_all(core: PolicyView) -> bool:
    """`can_hold_all_requests`: HBM (blocks being copied out count as free, as they are by the
    artifact's next step) holds every running request's next tokens and every paused one whole."""
    memory = core.memory
    num_free = memory.hbm.num_free + memory.hbm.num_deferred
    block_size = memory.block_size
    for req in core.running.values():
        num_tokens = req.num_computed_tokens + req.num_schedulable()
        num_free -= max(-(-num_tokens // block_size) - len(req.hbm_blocks), 0)  # memory.blocks_needed
        if num_free < 0:
            return False
    for req in paused(core):
        num_free -= memory.blocks_to_admit(req, req.num_schedulable(), reserve_full=True)
        if num_free < 0:
            return False
    return True


def swap_out_early(core: PolicyView, step: Step) -> bool:
    """`schedule_early`'s proactive swap-out; whether it swapped any request out."""
    memory, budget = core.memory, core.cfg.b_xfer
    hbm = memory.hbm
    if host_use(memory) >= SWAP_BELOW_HOST_USE or hbm.num_free + hbm.num_deferred >= budget:
        return False
    step.num_blocks_wanted += budget  # the step wants the budget free: it may preempt
    num_freed, swapped = 0, False
    # Longest on the GPU first; the sort is stable, so ties stay in the order they were admitted.
    for req in sorted(core.running.values(), key=lambda r: r.run_start):
        if req.num_schedulable() != 1:
            continue  # a prefill chunk
        num = sum(1 for b in req.hbm_blocks if hbm.ref[b] == 1)  # `get_num_blocks_to_free`
        if num_freed + num >= budget:
            break
        if not core.preempt(req, step, recompute_ok=False):
            break  # no DRAM room or copy budget left for it
        num_freed += num
        swapped = True
    return swapped


def schedule_in_order(core: PolicyView, step: Step, order: list[Request]) -> bool:
    """The running pass; whether it ended on a partial prefill chunk (then nobody is admitted)."""
    memory, step_id, running = core.memory, step.step_id, Status.RUNNING
    block_size = memory.block_size
    for req in order:
        if step.tokens_left == 0 or step.seqs_left == 0:
            return False
        if req.status is not running or req.scheduled_step == step_id:
            continue  # swapped out by step 2, or by this pass for another's growth (`step.is_scheduled`)
        wanted = req.num_schedulable()
        if wanted == 0:
            continue  # its sample is in flight
        num_new = wanted if wanted == 1 else core.grant(req, step, wanted=wanted)  # a decode fits any budget left
        if num_new == 0:
            return False
        need = -(-(req.num_computed_tokens + num_new) // block_size) - len(req.hbm_blocks)  # memory.blocks_needed
        if need > 0:  # most decodes: their last block has room
            step.num_blocks_wanted += need
            if not make_room(core, step, req, need, order):
                return False  # the artifact breaks out of its running loop here
            memory.grow(req, num_new)
        step.schedule(req, num_new)
        if num_new < wanted:
            return True
    return False


def admit_oldest_waiting(core: PolicyView, step: Step, fits: bool) -> None:
    cfg, memory = core.cfg, core.memory
    hold_new = holds_back_new(memory)
    watermark = 0 if fits else round(cfg.admit_watermark * memory.hbm.num_blocks)  # 0 unless given: the knob's ablation
    try:
        admit_in_turn(core, step, by_waiting_since(core), hold_new, watermark)
    finally:
        core.q_waiting.restore()


def admit_in_turn(core: PolicyView, step: Step, candidates: Iterator[Request], hold_new: bool, watermark: int) -> None:
    for req in candidates:
        if step.tokens_left == 0 or step.seqs_left == 0 or len(core.running) >= core.cfg.max_num_seqs:
            return
        if hold_new and is_new(req):
            continue  # "prevent cpu kv caches overflow"
        if req.preempted_step == step.step_id or req.num_pending or not (wanted := req.num_schedulable()):
            continue  # not back in the step that evicted it; or its sample is in flight
        num_new = core.grant(req, step, wanted=wanted)
        if num_new == 0:
            return
        if not admit_if_room(core, step, req, num_new, watermark):  # reserve_full_prompt is off for it (config)
            return
        if num_new < wanted:
            return  # a partial chunk is the last request of the step


def is_new(req: Request) -> bool:
    """Never preempted: the artifact's RequestStatus.WAITING (a preempted one is SWAPPED)."""
    return req.preempted_step < 0


def waiting_since(req: Request) -> float:
    """`in_waiting_since`: its arrival, or the step that last preempted it."""
    return req.arrival if is_new(req) else req.paused_at


def paused(core: PolicyView) -> Iterator[Request]:
    yield from core.q_rotary.members()
    yield from core.q_waiting.members()


def by_waiting_since(core: PolicyView) -> Iterator[Request]:
    """Paused requests, the longest waiting first. New ones come from the arrival-ordered
    queue lazily (admission usually stops after a few); the preempted ones, few, are sorted."""
    q = core.q_waiting
    preempted = [r for r in paused(core) if not is_new(r)]
    preempted.sort(key=lambda r: (waiting_since(r), r.seq))
    new = ((waiting_since(r), r.seq, r) for _, r in q.iter_sorted() if is_new(r))  # the caller restores q
    for _, _, req in heapq.merge(new, ((waiting_since(r), r.seq, r) for r in preempted), key=lambda e: e[:2]):
        yield req
