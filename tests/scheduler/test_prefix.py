"""Prefix caching in the core: shared full blocks, reference counts, LRU eviction of cached
blocks, hits after recompute, and rotation that never frees or moves a shared block. The
symbolic worker checks that every block a request reads holds its own tokens."""

from __future__ import annotations

from collections import Counter

import pytest

from services.scheduler.core import SchedulerCore
from shared.protocol import AddRequest, SamplingParams

from .harness import Driver, make_core

BS = 4
SYSTEM = [100 + i for i in range(24)]  # 6 full blocks


def add_prompt(core, rid: str, prompt: list[int], max_tokens: int, now: float = 0.0) -> None:
    core.add_request(AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)), now)


def first_entry(d: Driver, rid: str):
    for plan in d.plans:
        for s in plan.scheduled:
            if s.request_id == rid:
                return s
    raise AssertionError(f"{rid} never scheduled")


def run_until_running(d: Driver, rid: str) -> None:
    for _ in range(50):
        d.step()
        if rid in d.core.running:
            return
    raise AssertionError(f"{rid} never ran")


@pytest.mark.parametrize("policy", ["fcfs", "lvf"])
def test_a_shared_prefix_is_computed_once_and_its_blocks_shared(policy):
    core = make_core(policy, num_hbm=32, block_size=BS)
    d = Driver(core)
    add_prompt(core, "a", SYSTEM + [1, 2, 3], 8)
    run_until_running(d, "a")
    d.step()
    add_prompt(core, "b", SYSTEM + [7, 8], 8, d.now)
    run_until_running(d, "b")
    a, b = core.running["a"], core.running["b"]
    assert first_entry(d, "b").num_computed_tokens == len(SYSTEM)  # its 6 prompt blocks were hits
    assert b.num_cached_tokens == len(SYSTEM)
    assert b.hbm_blocks[:6] == a.hbm_blocks[:6]
    assert all(core.memory.hbm.ref[x] == 2 for x in a.hbm_blocks[:6])
    stats = core.stats()
    assert stats["num_prefix_hits"] == len(SYSTEM) and stats["num_prefix_queries"] == 27 + 26
    d.run()
    assert d.finish == {"a": "length", "b": "length"}


def test_the_last_prompt_token_is_always_computed():
    """A prompt that is all cached blocks still computes its last block's tokens: a step
    must produce logits to sample from."""
    core = make_core("fcfs", num_hbm=32, block_size=BS)
    d = Driver(core)
    add_prompt(core, "a", SYSTEM, 4)
    d.run()
    add_prompt(core, "b", SYSTEM, 4, d.now)
    d.run()
    s = first_entry(d, "b")
    assert s.num_computed_tokens == len(SYSTEM) - BS and s.num_new_tokens == BS


def test_a_shared_block_is_freed_only_by_its_last_holder():
    core = make_core("fcfs", num_hbm=32, block_size=BS)
    d = Driver(core)
    add_prompt(core, "a", SYSTEM + [1], 2)
    run_until_running(d, "a")
    d.step()
    add_prompt(core, "b", SYSTEM + [2], 30, d.now)
    run_until_running(d, "b")
    shared = core.running["b"].hbm_blocks[:6]
    while "a" not in d.finish:
        d.step()
    hbm = core.memory.hbm
    assert all(hbm.ref[x] == 1 and not hbm.is_cached(x) for x in shared)  # b still reads them
    assert not set(shared) & set(hbm.free_ids())
    d.run()
    assert all(hbm.ref[x] == 0 and hbm.is_cached(x) for x in shared)  # free, and cached
    assert hbm.num_free == hbm.num_blocks


def test_cached_blocks_are_evicted_least_recently_freed_first():
    # 16 blocks: x (6 blocks) and y (6 blocks) finish and stay cached; z needs 8 fresh blocks,
    # 4 free + the 4 least recently freed cached ones, all x's (its tail first).
    core = make_core("fcfs", num_hbm=16, block_size=BS)
    d = Driver(core)
    x, y = [200 + i for i in range(24)], [300 + i for i in range(24)]
    add_prompt(core, "x", x, 1)
    d.run()
    add_prompt(core, "y", y, 1, d.now)
    d.run()
    hbm = core.memory.hbm
    assert hbm.num_cached == 12 and hbm.num_free == 16
    add_prompt(core, "z", [400 + i for i in range(31)], 1, d.now)
    d.run()
    assert hbm.num_cached == 12 - 4 + 7  # and z's 7 full blocks
    # y's prefix is whole; x kept its first two blocks only.
    add_prompt(core, "y2", y + [9], 1, d.now)
    add_prompt(core, "x2", x + [9], 1, d.now)
    d.run()
    assert first_entry(d, "y2").num_computed_tokens == 24
    assert first_entry(d, "x2").num_computed_tokens == 8


def test_turning_prefix_caching_off_shares_nothing():
    core = make_core("fcfs", num_hbm=32, block_size=BS, enable_prefix_caching=False)
    d = Driver(core)
    add_prompt(core, "a", SYSTEM + [1], 2)
    d.run()
    add_prompt(core, "b", SYSTEM + [2], 2, d.now)
    d.run()
    assert first_entry(d, "b").num_computed_tokens == 0
    assert core.memory.hbm.num_cached == 0 and core.stats()["num_prefix_queries"] == 0


def test_recompute_keeps_full_blocks_cached_for_the_restart():
    # 20 blocks of 4, two requests of 6 prompt blocks growing to 16: fcfs recomputes the newer.
    core = make_core("fcfs", num_hbm=20, block_size=BS)
    d = Driver(core)
    add_prompt(core, "a", [200 + i for i in range(24)], 40)
    add_prompt(core, "b", [300 + i for i in range(24)], 40)
    d.run()
    assert core.num_recomputes > 0
    restarts = [s for p in d.plans for s in p.scheduled if s.block_table is not None]
    # its full blocks stayed cached (those the other one's growth did not evict first)
    assert restarts and all(s.num_computed_tokens > 0 and s.num_computed_tokens % BS == 0 for s in restarts)
    assert d.finish == {"a": "length", "b": "length"}


def two_sharing_the_system_prompt(eager: bool) -> tuple[SchedulerCore, Driver]:
    """lvf on 20 blocks: a runs, then b arrives; they share 6 prompt blocks and grow to 17
    blocks each, so they must take turns."""
    core = make_core("lvf", num_hbm=20, num_dram=64, block_size=BS, eager_rotation=eager)
    d = Driver(core)
    add_prompt(core, "a", SYSTEM + [1], 40)
    run_until_running(d, "a")
    d.step()
    add_prompt(core, "b", SYSTEM + [2], 40, d.now)
    return core, d


@pytest.mark.parametrize("eager", [False, True])
def test_rotating_out_a_request_never_frees_or_moves_a_block_another_holds(eager):
    # lvf on 20 blocks: a and b share 6 prompt blocks and grow to 17 each, so the newer one
    # is rotated out; a keeps running on the shared blocks, which stay where they are.
    core, d = two_sharing_the_system_prompt(eager)
    shared, seen = None, 0
    while core.has_unfinished():
        plan = d.step()
        a, b = core.requests.get("a"), core.requests.get("b")
        if shared is None and b is not None and b.hbm_blocks[:6] == a.hbm_blocks[:6]:
            shared = a.hbm_blocks[:6]
        if shared and a is not None and b is not None and b.status.value == "rotary":
            seen += 1
            hbm = core.memory.hbm
            assert a.hbm_blocks[:6] == shared and all(hbm.ref[x] == 1 for x in shared)
            assert not set(shared) & set(hbm.free_ids())
            assert plan is None or not set(shared) & {h for _, h in plan.swap_in}
    assert shared is not None and seen > 0 and core.num_rotations_out > 0
    assert d.finish == {"a": "length", "b": "length"}
    hbm = core.memory.hbm
    assert hbm.num_free == hbm.num_blocks


@pytest.mark.parametrize("policy", ["lvf", "fcfs", "sf"])
def test_many_requests_sharing_a_prefix_on_a_tiny_pool_all_finish_intact(policy):
    """Rotation and recompute on a pool that holds about two requests, with every request
    sharing the system prompt: invariants after every step, KV checked by content."""
    core = make_core(policy, num_hbm=24, num_dram=256, block_size=BS, max_batched_tokens=16, tbt_slo=0.02)
    d = Driver(core, dt=0.01)
    for i in range(10):
        add_prompt(core, f"r{i}", SYSTEM + [10 + i, 11 + i, 12 + i], 16, i * 0.005)
    d.run()
    assert len(d.finish) == 10 and all(len(v) == 16 for v in d.outputs.values())
    assert core.stats()["num_prefix_hits"] > 0 and core.num_preemptions > 0
    hbm = core.memory.hbm
    assert hbm.num_free == hbm.num_blocks


def _held_copies(d: Driver, attr: str) -> Counter:
    """Full-block KV contents (by the symbolic worker's record) of the blocks live requests
    hold in one tier, counted once per distinct block."""
    pool = d.worker.hbm if attr == "hbm_blocks" else d.worker.dram
    blocks = {b for r in d.core.requests.values() for b in getattr(r, attr)}
    return Counter(pool[b] for b in blocks if pool[b] is not None and len(pool[b][1]) == BS)


@pytest.mark.parametrize("eager", [False, True])
def test_a_request_rotated_back_takes_its_prefix_from_hbm_and_copies_only_the_rest(eager):
    # As above, a and b take turns; the 6 shared blocks stay in HBM (held by the other, or
    # cached when the other is rotated out in the same step, without a copy: DRAM has
    # them), so a request coming back takes them by reference and copies only the blocks
    # HBM lacks, and only those count in B_xfer.
    core, d = two_sharing_the_system_prompt(eager)
    run_until_running(d, "b")
    shared = core.running["a"].hbm_blocks[:6]
    returns = 0
    while core.has_unfinished():
        was_rotary = {r.request_id: len(r.dram_blocks) for r in core.requests.values() if r.status.value == "rotary"}
        reused, copied = core.memory.num_swap_in_reused, core.memory.num_swapped_in
        plan = d.step()
        back = [core.requests[r] for r in was_rotary if r in core.requests and core.requests[r].status.value == "running"]
        for r in back:
            returns += 1
            assert r.hbm_blocks[:6] == shared
            assert not set(shared) & {h for _, h in plan.swap_in}
        if back:  # its own blocks may still be cached too
            num_reused = core.memory.num_swap_in_reused - reused
            assert num_reused >= 6 * len(back)
            num_copied = core.memory.num_swapped_in - copied
            assert num_copied == len(plan.swap_in) == sum(was_rotary[r.request_id] for r in back) - num_reused
    assert returns > 0 and core.stats()["num_blocks_swapped_in"] < 17 * returns
    assert d.finish == {"a": "length", "b": "length"}


def test_a_shared_block_is_mirrored_to_dram_once():
    # HBM holds both: no rotation, only eager mirrors; the 6 shared blocks get one DRAM copy.
    core = make_core("lvf", num_hbm=64, num_dram=64, block_size=BS, eager_rotation=True)
    d = Driver(core)
    add_prompt(core, "a", SYSTEM + [1], 12)
    run_until_running(d, "a")
    d.step()
    add_prompt(core, "b", SYSTEM + [2], 12, d.now)
    for _ in range(6):
        d.step()
    a, b = core.requests["a"], core.requests["b"]
    assert len(b.dram_blocks) >= 6 and b.dram_blocks[:6] == a.dram_blocks[:6]
    assert all(core.memory.dram.ref[x] == 2 for x in a.dram_blocks[:6])
    sources = Counter(h for p in d.plans for h, _ in p.eager)
    assert all(sources[x] == 1 for x in a.hbm_blocks[:6])
    assert core.memory.num_dram_shared >= 6
    d.run()
    dram = core.memory.dram
    assert dram.num_free == dram.num_blocks


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("policy", ["lvf", "sf"])
def test_under_rotation_each_shared_block_has_one_copy_per_tier(policy, eager):
    """Ten requests sharing the system prompt rotate on a pool that holds about two: at every
    step no content is held twice in DRAM (copied out once, shared after), nor in HBM by a
    request that came back (it took the resident block), and every KV read checks out."""
    core = make_core(policy, num_hbm=24, num_dram=256, block_size=BS, max_batched_tokens=16, tbt_slo=0.02,
                     eager_rotation=eager)
    d = Driver(core, dt=0.01)
    for i in range(10):
        add_prompt(core, f"r{i}", SYSTEM + [10 + i, 11 + i, 12 + i], 16, i * 0.005)
    while core.has_unfinished():
        d.step()
        dup = [c for c, n in _held_copies(d, "dram_blocks").items() if n > 1]
        assert not dup, f"step {core.step_id}: DRAM holds {dup[0]} more than once"
    assert len(d.finish) == 10 and core.num_rotations_in > 0
    m = core.memory
    assert m.num_swap_in_reused > 0 and m.num_dram_shared > 0
    assert m.hbm.num_free == m.hbm.num_blocks and m.dram.num_free == m.dram.num_blocks
