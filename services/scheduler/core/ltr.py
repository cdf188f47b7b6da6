"""`ltr`, learning to rank (Fu et al., the vllm-ltr fork of vLLM), as its scheduler runs.

Every live request, running or paused, is ranked by its predicted output length, shortest
first (`Request.predicted_output`: the core's predictor scores a request once, when it
arrives, as LTR's ranking model scores a prompt). Walking that ranking, each request takes
its tokens from the step's budget (a decode one, a prompt a chunk) until the budget or the
sequence cap is spent: requests ranked below, running ones too, wait a step. A paused
request that does not fit preempts running requests ranked after it, the lowest first, by
swap as vllm-ltr does (by recompute when DRAM or the copy budget has no room).

Starvation guard, as vllm-ltr's `starv<N>-period<M>` schedule types count it: a request
not scheduled for `STARVE_STEPS` consecutive steps is promoted above every ranked one for
its next `PROMOTE_STEPS` scheduled steps, then ranked by its prediction again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from .fcfs import make_room
from .policy import PolicyView
from .request import Request, Status
from .step import Step

STARVE_STEPS = 200  # vllm-ltr's fairness runs: starv200
PROMOTE_STEPS = 10  # ... period10


@dataclass(slots=True)
class Guard:
    idle: int = 0  # consecutive steps not scheduled
    runs: int = 0  # scheduled steps left of a promotion
    promoted: bool = False


# Each core's guards by request id (the policy is a function; the state is per core).
_GUARDS: WeakKeyDictionary[object, dict[str, Guard]] = WeakKeyDictionary()


def guards_of(core: PolicyView) -> dict[str, Guard]:
    return _GUARDS.setdefault(core, {})


def schedule_ltr(core: PolicyView, step: Step) -> None:
    guards = guards_of(core)
    live = [*core.running.values(), *itertools.chain(core.q_waiting.members(), core.q_rotary.members())]
    for rid in guards.keys() - {r.request_id for r in live}:
        del guards[rid]
    for r in live:
        g = guards.get(r.request_id)
        if g is None:
            g = guards[r.request_id] = Guard()
        if g.idle >= STARVE_STEPS:
            g.promoted, g.idle, g.runs = True, 0, PROMOTE_STEPS
        elif g.promoted and g.runs <= 0:
            g.promoted = False

    def rank(r: Request) -> tuple:
        return (0 if guards[r.request_id].promoted else 1, r.predicted_output, r.seq)

    serve_ranked(core, step, sorted(live, key=rank), rank)
    step_id = step.step_id
    for r in live:
        g = guards[r.request_id]
        if r.scheduled_step == step_id:  # `step.is_scheduled(r)`
            g.idle = 0
            g.runs -= g.promoted
        else:
            g.idle += 1


def serve_ranked(core: PolicyView, step: Step, order: list[Request], rank) -> None:
    """Give tokens in `order` until the step's budget is spent; a running request short of
    blocks preempts the lowest-ranked unscheduled one (possibly itself), a paused one
    preempts only those ranked after it, and one that cannot be placed ends the step."""
    memory, cfg, step_id = core.memory, core.cfg, step.step_id
    running = [r for r in order if r.status is Status.RUNNING]
    for req in order:
        if step.tokens_left == 0 or step.seqs_left == 0:
            return
        if req.status is Status.RUNNING:
            if req.scheduled_step == step_id or not (wanted := req.num_schedulable()):  # `step.is_scheduled`
                continue
            num_new = wanted if wanted == 1 else core.grant(req, step, wanted=wanted)  # a decode fits any budget left
            if num_new == 0:
                return
            need = memory.blocks_needed(req, num_new)
            step.num_blocks_wanted += need
            if need <= 0:  # most decodes: their last block has room
                step.schedule(req, num_new)
            elif make_room(core, step, req, need, running):
                memory.grow(req, num_new)
                step.schedule(req, num_new)
            continue
        if req.status not in (Status.WAITING, Status.ROTARY):
            continue  # preempted earlier in this walk
        if req.preempted_step == step.step_id or req.num_pending or not (wanted := req.num_schedulable()):
            continue
        if len(core.running) >= cfg.max_num_seqs:
            continue  # no slot: the running requests ranked below still take their tokens
        num_new = core.grant(req, step, wanted=wanted)
        if num_new == 0:
            return
        room = memory.blocks_to_admit(req, num_new, cfg.reserve_full_prompt)
        step.num_blocks_wanted += room
        if not fits(core, step, req, room):
            if memory.hbm.can_allocate(room):
                return  # HBM has room, the copy budget has not: displacing would not help
            key = rank(req)
            for victim in reversed(running):
                if victim.status is Status.RUNNING and not step.is_scheduled(victim) and rank(victim) > key:
                    core.preempt(victim, step)
                    room = memory.blocks_to_admit(req, num_new, cfg.reserve_full_prompt)
                    if fits(core, step, req, room):
                        break
            if not fits(core, step, req, room):
                return
        core.admit(req, step, num_new)


def fits(core: PolicyView, step: Step, req: Request, room: int) -> bool:
    if req.status is Status.ROTARY:
        return core.memory.can_swap_in(req, room, step.moves_left)
    return core.memory.hbm.can_allocate(room)
