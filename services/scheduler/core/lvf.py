"""Largest-VLT-First, the step RotaSched takes when HBM cannot hold every live request
(when it can, the core schedules FCFS and rotates nothing).

1. Paused requests come in VLT order (two heaps merged by their actual VLT, see vlt.py).
2. From the head, each is admitted if its blocks fit in free HBM; a request that lags
   (VLT > 0) may also take the blocks of running requests preempted from the tail of the
   VLT order (the longest-running first; running VLT = -(now - t_run_start) < 0). Requests
   within their slack (VLT = 0) only take free blocks: they are not late yet. Only memory
   rotates requests: a full batch (`max_num_seqs`) with spare HBM makes a request wait.
3. The first request that cannot be placed ends admission (no jumping ahead), as does an
   exhausted token or copy budget (B_xfer).
4. Running requests then get their tokens, decodes first, in arrival order; one short of
   blocks preempts the newest arrival (as FCFS does: the oldest request never loses its
   blocks to growth, so recompute cannot livelock).
"""

from __future__ import annotations

from collections.abc import Iterator

from .fcfs import schedule_running
from .policy import PolicyView
from .request import Request, Status
from .step import Step
from .vlt import lag_vlt


def schedule_lvf(core: PolicyView, step: Step) -> None:
    # Running in VLT order, largest first: the most recently started first.
    order = sorted(core.running.values(), key=lambda r: (-r.run_start, r.seq))
    try:
        admit_lagging(core, step, order, lvf_candidates(core, step.now))
    finally:
        core.q_first.restore()
        core.q_emitted.restore()
    schedule_running(core, step, sorted(core.running.values(), key=lambda r: r.seq))


def lvf_candidates(core: PolicyView, now: float) -> Iterator[tuple[float, Request]]:
    """Paused requests as (VLT, request), largest VLT first; equal VLTs (within slack)
    by the time they start to lag."""
    cfg = core.cfg
    first, emitted = core.q_first.iter_sorted(), core.q_emitted.iter_sorted()
    head_f, head_e = next(first, None), next(emitted, None)
    while head_f is not None or head_e is not None:
        vf = lag_vlt(head_f[0], False, now, cfg) if head_f else -1.0
        ve = lag_vlt(head_e[0], True, now, cfg) if head_e else -1.0
        take_f = head_e is None or (head_f is not None and (vf, -head_f[0]) >= (ve, -head_e[0]))
        if take_f:
            yield vf, head_f[1]
            head_f = next(first, None)
        else:
            yield ve, head_e[1]
            head_e = next(emitted, None)


def admit_lagging(
    core: PolicyView, step: Step, order: list[Request], candidates: Iterator[tuple[float, Request]]
) -> None:
    memory = core.memory
    num_decodes = sum(1 for r in order if r.num_schedulable() == 1)  # token reserve
    for v, req in candidates:
        if req.preempted_step == step.step_id or req.num_pending or not req.num_schedulable():
            continue  # evicted this step, or its sample is in flight
        num_new = min(req.num_schedulable(), step.tokens_left - num_decodes)
        if num_new <= 0 or step.seqs_left - num_decodes <= 0:
            return
        need = memory.blocks_to_admit(req, num_new, core.cfg.reserve_full_prompt)
        step.num_blocks_wanted += need
        if len(req.dram_blocks) > step.moves_left:
            return  # its swap-in does not fit in this step's copy budget
        if v > 0 and not memory.hbm.can_allocate(need):
            num_decodes -= _displace(core, step, req, need, order)
        if not _fits(core, req, need, step):
            return
        core.admit(req, step, num_new)


def _fits(core: PolicyView, req: Request, need: int, step: Step) -> bool:
    memory = core.memory
    if len(core.running) >= core.cfg.max_num_seqs:
        return False
    if req.status is Status.ROTARY:
        return memory.can_swap_in(req, need, step.moves_left)
    return memory.hbm.can_allocate(need)


def _displace(core: PolicyView, step: Step, req: Request, need: int, order: list[Request]) -> int:
    """Preempt running requests from the tail of the VLT order until `req` fits, but only
    if the victims can free enough (now, or when their copies are done) and their swaps
    fit in B_xfer. Returns how many of the victims were decodes.

    A victim that cannot be swapped (DRAM full) is recomputed only if it has sampled a
    token since it last started running: every admission then yields a token, so
    recompute cannot livelock (a long prompt would otherwise be evicted mid-prefill
    again and again)."""
    victims = _victims(step, order)
    hbm = core.memory.hbm
    num_freeable = sum(len(r.hbm_blocks) for r in victims)
    if hbm.num_free + hbm.num_deferred + num_freeable < need:
        return 0  # even all of them would not make room: disturb nobody
    num_decodes = 0
    for victim in victims:
        if hbm.num_free + hbm.num_deferred >= need:
            break  # room now, or once this step's copies are done
        num_copy = len(victim.hbm_blocks) - len(victim.dram_blocks)
        if num_copy > step.moves_left - len(req.dram_blocks):
            break  # its swap-out and req's swap-in would exceed B_xfer
        is_decode = victim.num_schedulable() == 1
        if core.preempt(victim, step, recompute_ok=victim.sampled_since_run_start()):
            num_decodes += is_decode
    return num_decodes


def _victims(step: Step, order: list[Request]) -> list[Request]:
    """Running requests with VLT < 0 not scheduled this step, longest-running first."""
    return [
        r
        for r in reversed(order)
        if r.status is Status.RUNNING and r.run_start < step.now and not step.is_scheduled(r)
    ]
