"""Largest-VLT-First, the step RotaSched takes when HBM cannot hold every live request
(when it can, the core schedules FCFS and rotates nothing). As the paper defines it:

1. All live requests stand in one VLT order, largest first (vlt.py, no clamp). Paused
   requests come from two heaps merged by their actual VLT; running requests follow by
   time since they were put on the GPU (VLT = -(now - t_run_start)).
2. From the head, each paused request is admitted if its blocks (all its known tokens,
   `reserve_full_prompt`) fit in free HBM, or once running requests from the tail of the
   order are preempted: those with VLT < 0 and below the candidate's VLT, the longest-
   running first, whose copies fit in this step's B_xfer (`xfer_budget`).
3. The first request that cannot be placed ends admission (no jumping ahead; but see
   `rotary_yields`), as does an exhausted token, sequence or copy budget.
4. Running requests then get their tokens, decodes first, in arrival order; one short of
   blocks preempts the newest arrival (as FCFS does: the oldest request never loses its
   blocks to growth, so recompute cannot livelock).

Guards against rotation that costs more than it gains (SchedulerConfig; defaults chosen by
measurement in the simulator, docs/design.md "Scheduling and memory knobs"). Without them a paused request that has
emitted tokens, whose VLT is positive the moment it is paused, displaces the longest-running
request at once, which does the same a step later: a carousel (the simulator, seeds 0-2 at
1 req/s, no guard: 78 rotations per request, TBT attainment 73%). Such a displacement gains
no TBT (the paused request's gap is missed already) and costs the victim a gap; a request
waiting for its first token gains its TTFT.
- `min_residency_s`: a paused request that has emitted tokens displaces only running
  requests that have run at least this long since they were put on the GPU. Requests
  waiting for their first token displace by VLT order alone.
- `admit_watermark`: a paused request is admitted only if it leaves this share of HBM free
  while others run. Without it admission fills HBM to the last block, and the running
  requests' next blocks then preempt one of them (growth preemption, step 4): each a paused
  request and a missed gap. (Simulator, ShareGPT seed 0, 65 blocks of 32 tokens, `cpu-live`:
  at 1.25 req/s TBT attainment 93.5% without, 97.2% with 0.25, TTFT attainment 98-100% both.)
- `rotary_yields`: such a request that cannot be placed does not end admission (step 3):
  the requests behind it may still be admitted. Off, the paused decodes held back by the
  residency block every new arrival behind them. (Measured against passing over only to
  requests waiting for their first token: e2e p50 25-35% lower, TBT attainment 0.5 points
  lower.)
"""

from __future__ import annotations

from collections.abc import Iterator

from .fcfs import schedule_running
from .policy import PolicyView
from .request import Request, Status
from .step import Step
from .vlt import lag_vlt


def schedule_lvf(core: PolicyView, step: Step) -> None:
    # The tail of the VLT order, as victims are taken: the longest-running first.
    tail = sorted(core.running.values(), key=lambda r: (r.run_start, -r.seq))
    try:
        admit_by_vlt(core, step, tail, lvf_candidates(core, step.now))
    finally:
        core.q_first.restore()
        core.q_emitted.restore()
    schedule_running(core, step, sorted(core.running.values(), key=lambda r: r.seq))


def lvf_candidates(core: PolicyView, now: float) -> Iterator[tuple[float, Request]]:
    """Paused requests as (VLT, request), largest VLT first; equal VLTs by the time they
    start to lag."""
    cfg = core.cfg
    first, emitted = core.q_first.iter_sorted(), core.q_emitted.iter_sorted()

    def head(stream: Iterator[tuple[float, Request]], is_emitted: bool) -> tuple[float, float, Request] | None:
        """(VLT, lag key, request) of the stream's next request, None at its end."""
        entry = next(stream, None)
        return None if entry is None else (lag_vlt(entry[0], is_emitted, now, cfg), entry[0], entry[1])

    head_f, head_e = head(first, False), head(emitted, True)
    while head_f is not None or head_e is not None:
        if head_e is None:
            take_f = True
        elif head_f is None:
            take_f = False
        else:
            take_f = (head_f[0], -head_f[1]) >= (head_e[0], -head_e[1])
        if take_f:
            yield head_f[0], head_f[2]
            head_f = head(first, False)
        else:
            yield head_e[0], head_e[2]
            head_e = head(emitted, True)


def admit_by_vlt(
    core: PolicyView, step: Step, tail: list[Request], candidates: Iterator[tuple[float, Request]]
) -> None:
    memory = core.memory
    num_decodes = sum(1 for r in tail if r.num_schedulable() == 1)  # token reserve
    watermark = round(core.cfg.admit_watermark * memory.hbm.num_blocks)
    for v, req in candidates:
        if req.preempted_step == step.step_id or req.num_pending or not (wanted := req.num_schedulable()):
            continue  # evicted this step, or its sample is in flight
        if step.tokens_left - num_decodes <= 0 or step.seqs_left - num_decodes <= 0:
            return
        num_new = core.grant(req, step, reserve=num_decodes, wanted=wanted)
        if num_new == 0:
            continue  # the step's prefill cap is spent; a paused decode may still fit
        need = _need(core, req, num_new, watermark)
        step.num_blocks_wanted += need
        num_in = memory.num_swap_in_copies(req)
        if num_in > step.moves_left:
            return  # its swap-in does not fit in this step's copy budget
        may_fit = memory.hbm.can_allocate(need)
        if not may_fit:
            num_preempted = step.num_preempted
            num_decodes -= _displace(core, step, need, num_in, _victims(core, step, req, v, tail))
            may_fit = step.num_preempted > num_preempted  # else HBM is as it was: no room (as `_fits` would say)
            if may_fit:  # a victim's blocks may be req's cached prefix, now to be revived out of the free ones
                need = _need(core, req, num_new, watermark)
        if not (may_fit and _fits(core, req, need, step)):
            if req.has_emitted and core.cfg.rotary_yields:
                continue
            return
        core.admit(req, step, num_new)


def _need(core: PolicyView, req: Request, num_new: int, watermark: int) -> int:
    """HBM blocks `req` must find free to be admitted computing `num_new` tokens."""
    need = core.memory.blocks_to_admit(req, num_new, core.cfg.reserve_full_prompt)
    return need + watermark if core.running else need  # the running requests' room to grow; the first needs none


def _fits(core: PolicyView, req: Request, need: int, step: Step) -> bool:
    memory = core.memory
    if len(core.running) >= core.cfg.max_num_seqs:
        return False
    if req.status is Status.ROTARY:
        return memory.can_swap_in(req, need, step.moves_left)
    return memory.hbm.can_allocate(need)


def _displace(core: PolicyView, step: Step, need: int, num_in: int, victims: list[Request]) -> int:
    """Preempt `victims` in order until a request needing `need` HBM blocks and `num_in`
    swap-in copies fits, but only if they can free enough (now, or when their copies are
    done) and their swaps fit in B_xfer. Returns how many of the victims were decodes.

    A victim that cannot be swapped (DRAM full) is recomputed only if it has sampled a
    token since it last started running: every admission then yields a token, so
    recompute cannot livelock (a long prompt would otherwise be evicted mid-prefill
    again and again)."""
    memory, hbm = core.memory, core.memory.hbm
    num_freeable = sum(len(r.hbm_blocks) for r in victims)
    if hbm.num_free + hbm.num_deferred + num_freeable < need:
        return 0  # even all of them would not make room: disturb nobody
    num_decodes = 0
    for victim in victims:
        if hbm.num_free + hbm.num_deferred >= need:
            break  # room now, or once this step's copies are done
        if memory.num_swap_out_copies(victim) > step.moves_left - num_in:
            break  # its swap-out and req's swap-in would exceed B_xfer
        is_decode = victim.num_schedulable() == 1
        if core.preempt(victim, step, recompute_ok=victim.sampled_since_run_start()):
            num_decodes += is_decode
    return num_decodes


def _victims(core: PolicyView, step: Step, req: Request, v: float, tail: list[Request]) -> list[Request]:
    """Who `req`, of VLT `v`, may displace: running requests below it in the order with
    VLT < 0 (not put on the GPU in this step), not scheduled this step and, if `req` has
    emitted tokens, past their minimum residency; longest-running first.

    A running request's VLT is minus the time it has run, so both bounds are on that time,
    which only falls along `tail`: the scan ends at the first request too young (admission
    tries every paused request each step, so this is the scheduler's hot loop)."""
    now, min_run = step.now, core.cfg.min_residency_s if req.has_emitted else 0.0
    min_lag = -min(0.0, v)  # running_vlt(r, now) < min(0, v)  <=>  now - r.run_start > min_lag
    victims = []
    for r in tail:
        age = now - r.run_start
        if age <= min_lag or age < min_run:
            break
        if r.status is Status.RUNNING and not step.is_scheduled(r):
            victims.append(r)
    return victims
