"""The scheduler's invariants, checked by the tests after every step and by the live
service. Each failure raises AssertionError naming what broke."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from .policy import PolicyView
from .request import Request, Status, blocks_for
from .step import Step


class CoreState(PolicyView, Protocol):
    """What the checks read of `SchedulerCore` (scheduler.py, which imports this module):
    the policies' view, every live request, the last step and the core's running counts."""

    requests: dict[str, Request]
    last_step: Step | None
    num_waiting_tokens: int
    num_demand_blocks: int


def check_invariants(core: CoreState) -> None:
    _check_ownership(core)
    for req in core.requests.values():
        _check_request(core, req)
    _check_sets(core)
    if core.last_step is not None:
        _check_step(core)


def _check_ownership(core: CoreState) -> None:
    """Each block is held by as many requests as its reference count says (DRAM blocks and
    unhashed HBM blocks by one at most), or else free, cached or deferred, never both;
    free (cached included) + deferred + used = total; the cache index names held,
    cached or deferred blocks only."""
    m = core.memory
    for pool, attr in ((m.hbm, "hbm_blocks"), (m.dram, "dram_blocks")):
        owned = Counter(b for r in core.requests.values() for b in getattr(r, attr))
        bad = [b for b, c in owned.items() if c != pool.ref[b] or (c > 1 and pool.hash_of[b] is None)]
        assert not bad, f"{pool.name} blocks held by a count other than their reference count: {sorted(bad)[:8]}"
        held = [b for b in range(pool.num_blocks) if pool.ref[b] > 0]
        assert len(held) == len(owned), f"{pool.name} blocks referenced by no request: {sorted(set(held) - owned.keys())[:8]}"
        counts = Counter(list(owned) + pool.free_ids())
        dup = [b for b, c in counts.items() if c > 1]
        assert not dup, f"{pool.name} blocks both held and free, or free twice: {sorted(dup)[:8]}"
        missing = set(range(pool.num_blocks)) - counts.keys()
        assert not missing, f"{pool.name} blocks leaked (neither free nor owned): {sorted(missing)[:8]}"
        assert len(counts) == pool.num_blocks, f"{pool.name} has blocks outside 0..{pool.num_blocks - 1}"
        assert pool.num_free + pool.num_deferred + len(owned) == pool.num_blocks, f"{pool.name}: free + used != total"
        for h, b in pool.index.items():
            assert pool.hash_of[b] == h, f"{pool.name}: cache index names block {b} for another hash"


def _check_request(core: CoreState, req) -> None:
    bs, rid = core.cfg.block_size, req.request_id
    num_kv_blocks = blocks_for(req.num_computed_tokens, bs)
    assert 0 <= req.num_pending, f"{rid}: negative pending samples"
    assert req.num_computed_tokens <= req.num_known, f"{rid}: computed past its known tokens"
    if req.status is Status.RUNNING:
        assert len(req.hbm_blocks) == num_kv_blocks, (
            f"{rid}: RUNNING with {len(req.hbm_blocks)} HBM blocks for {req.num_computed_tokens} tokens"
        )
        assert len(req.dram_blocks) <= req.num_computed_tokens // bs, f"{rid}: DRAM mirror of an unsynced block"
        assert core.running.get(rid) is req, f"{rid}: RUNNING but not in the running set"
    elif req.status is Status.ROTARY:
        assert not req.hbm_blocks, f"{rid}: ROTARY but holds HBM blocks"
        assert req.num_computed_tokens > 0, f"{rid}: ROTARY without KV"
        assert len(req.dram_blocks) == num_kv_blocks, (
            f"{rid}: ROTARY KV incomplete in DRAM ({len(req.dram_blocks)}/{num_kv_blocks})"
        )
    elif req.status is Status.WAITING:
        assert not req.hbm_blocks and not req.dram_blocks, f"{rid}: WAITING but holds blocks"
        assert req.num_computed_tokens == 0, f"{rid}: WAITING with computed tokens"
    else:
        raise AssertionError(f"{rid}: {req.status} but still live")


def _check_sets(core: CoreState) -> None:
    num_paused = sum(1 for r in core.requests.values() if r.status is not Status.RUNNING)
    assert len(core.q_waiting) + len(core.q_rotary) == num_paused, "paused requests missing from the queues"
    assert len(core.q_first) + len(core.q_emitted) == num_paused, "paused requests missing from the VLT heaps"
    assert all(r.status is Status.RUNNING for r in core.running.values()), "non-running request in the running set"
    demand = sum(blocks_for(r.num_known, core.cfg.block_size) for r in core.requests.values())
    assert demand == core.num_demand_blocks, f"demand {core.num_demand_blocks} != {demand}"
    waiting = sum(r.num_tokens for r in core.q_waiting.members())
    assert waiting == core.num_waiting_tokens, f"waiting tokens {core.num_waiting_tokens} != {waiting}"


def _check_step(core: CoreState) -> None:
    step = core.last_step
    assert step.num_moved <= core.cfg.b_xfer, f"step {step.step_id} moved {step.num_moved} > B_xfer"
    assert len(step.scheduled) <= core.cfg.max_num_seqs, f"step {step.step_id}: too many requests"
    num_tokens = sum(r.step_new_tokens for r in step.scheduled)
    assert num_tokens <= core.cfg.max_batched_tokens, f"step {step.step_id}: {num_tokens} tokens over budget"
    assert not set(step.admitted) & set(step.preempted), f"step {step.step_id} admitted and preempted a request"
    assert all(step.is_scheduled(r) for r in step.admitted), f"step {step.step_id} admitted a request it left out"
    if step.num_preempted:
        lvf_fits = step.fits_all and core.cfg.is_lvf
        assert not lvf_fits, f"step {step.step_id} rotated although HBM held everything"
        assert step.free_hbm_at_start < step.num_blocks_wanted, (
            f"step {step.step_id} preempted with spare HBM ({step.free_hbm_at_start} free, "
            f"{step.num_blocks_wanted} wanted)"
        )
    if not core.cfg.swaps:
        assert not step.swap_out, f"{core.cfg.policy} swapped a request out"
        if not core.memory.num_tier_blocks:  # the DRAM tier's loads and offloads are its only copies
            assert not (step.swap_in or step.eager), f"{core.cfg.policy} copied blocks"
