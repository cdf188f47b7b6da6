"""First-come-first-served stepping shared by every policy: running requests first
(decodes, then prefill chunks), growth preemption, then admission in a given order."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from .policy import PolicyView
from .queues import RequestHeap
from .request import Request, Status
from .step import Step


def schedule_fcfs(core: PolicyView, step: Step) -> None:
    """The fcfs, sf and wf policies, and lvf while HBM holds every live request.
    As vLLM, a step that had to preempt admits nobody."""
    schedule_running(core, step, sorted(core.running.values(), key=lambda r: r.seq))
    if step.num_preempted:
        return
    policy = core.cfg.policy
    queues = [core.q_waiting, core.q_rotary] if policy == "wf" else [core.q_rotary, core.q_waiting]
    try:
        admit_in_order(core, step, admission_order(policy, queues))
    finally:
        for q in queues:
            q.restore()


def admission_order(policy: str, queues: list[RequestHeap]) -> Iterator[Request]:
    """sf: rotary then waiting; wf: waiting then rotary; fcfs/lvf: both by arrival."""
    streams = [q.iter_sorted() for q in queues]
    if policy in ("sf", "wf"):
        merged = itertools.chain(*streams)
    else:
        merged = heapq.merge(*streams, key=lambda e: e[0])
    for _, req in merged:
        yield req


def schedule_running(core: PolicyView, step: Step, order: list[Request], preempt: bool = True) -> None:
    """Give each running request its tokens, decodes before prefill chunks, in `order`.
    A request short of blocks preempts the request at the end of `order` that has not
    been scheduled this step (possibly itself); without `preempt` it waits a step."""
    running = Status.RUNNING
    decodes: list[tuple[Request, int]] = []
    prefills: list[tuple[Request, int]] = []
    for req in order:
        if req.status is running and (n := req.num_schedulable()):
            (decodes if n == 1 else prefills).append((req, n))
    memory, step_id, block_size = core.memory, step.step_id, core.memory.block_size
    victims = order if preempt else []
    for req, num_new in itertools.chain(decodes, prefills):
        if step.tokens_left == 0 or step.seqs_left == 0:
            return
        if req.status is not running or req.scheduled_step == step_id:
            continue  # preempted or scheduled since (`step.is_scheduled`)
        if num_new > 1:  # a decode is granted its token: the budgets are not spent
            # `num_new` is still its `num_schedulable()`: only its own scheduling or preemption changes that
            num_new = core.grant(req, step, wanted=num_new)
            if num_new == 0:
                continue  # the step's prefill cap is spent
        need = -(-(req.num_computed_tokens + num_new) // block_size) - len(req.hbm_blocks)  # memory.blocks_needed
        step.num_blocks_wanted += need
        if need <= 0:  # most decodes: their last block has room
            step.schedule(req, num_new)
        elif make_room(core, step, req, need, victims):
            memory.grow(req, num_new)
            step.schedule(req, num_new)


def make_room(core: PolicyView, step: Step, req: Request, need: int, order: list[Request]) -> bool:
    """Free HBM for `need` blocks of `req` by preempting from the end of `order` (none if empty)."""
    hbm = core.memory.hbm
    while hbm.num_free < need:
        if hbm.num_free + hbm.num_deferred >= need:
            return False  # blocks being copied out come back next step: wait, don't preempt more
        victim = last_unscheduled(step, order)
        if victim is None:
            return False
        core.preempt(victim, step)
        if victim is req:
            return False
    return True


def last_unscheduled(step: Step, order: list[Request]) -> Request | None:
    for req in reversed(order):
        if req.status is Status.RUNNING and not step.is_scheduled(req):
            return req
    return None


def admit_in_order(core: PolicyView, step: Step, candidates: Iterable[Request]) -> None:
    """Admit waiting/rotary requests in `candidates` order until one does not fit
    (head-of-line: a later request never jumps a blocked earlier one). With
    `reserve_full_prompt` fitting means room for all its known tokens, not one chunk. While
    others run and HBM cannot hold every live request, an admission leaves `admit_watermark`
    of HBM free for their growth (0 by default for these policies; the ablation gives it them)."""
    memory = core.memory
    watermark = 0 if step.fits_all else round(core.cfg.admit_watermark * memory.hbm.num_blocks)
    for req in candidates:
        if step.tokens_left == 0 or step.seqs_left == 0:
            return
        if len(core.running) >= core.cfg.max_num_seqs:
            return
        if req.preempted_step == step.step_id or req.num_pending or not (wanted := req.num_schedulable()):
            continue  # not back in the step that evicted it; or its sample is in flight
        num_new = core.grant(req, step, wanted=wanted)
        if num_new == 0:
            return  # the step's prefill cap is spent
        if not admit_if_room(core, step, req, num_new, watermark):
            return


def admit_if_room(core: PolicyView, step: Step, req: Request, num_new: int, watermark: int) -> bool:
    """Admit `req` for `num_new` tokens where its blocks (plus `watermark` while others run) fit
    free HBM, or, rotary, the step's copies: True where admitted. The blocks it wanted count
    toward the step's demand either way."""
    memory = core.memory
    room = memory.blocks_to_admit(req, num_new, core.cfg.reserve_full_prompt)
    if core.running:
        room += watermark
    step.num_blocks_wanted += room
    if req.status is Status.ROTARY:
        if not memory.can_swap_in(req, room, step.moves_left):
            return False
    elif not memory.hbm.can_allocate(room):
        return False
    core.admit(req, step, num_new)
    return True
