"""The DRAM pool as a second prefix-cache level (core/tier.py): what leaves HBM is copied to
DRAM once, found again by the hash chain and loaded by swap-ins instead of recomputed, kept LRU
within `kv_offloading_size`, and given up to rotated requests. The symbolic worker checks that
every block a request reads holds its own tokens; the invariants run after every step."""

from __future__ import annotations

from collections import Counter

import pytest

from services.scheduler.core import SchedulerConfig, SchedulerCore
from services.scheduler.core.memory import Memory
from services.scheduler.core.step import Step
from services.scheduler.core.tier import num_tier_blocks, plan_loads
from shared.protocol import AddRequest, SamplingParams

from .harness import Driver

BS = 4
BLOCK_BYTES = 1 << 20  # a made-up block size in bytes: the tier's GiB become blocks


def gib(num_blocks: int) -> float:
    return num_blocks * BLOCK_BYTES / (1 << 30)


def make(policy: str, num_hbm: int = 16, num_dram: int = 64, tier: int = 32, **kw) -> SchedulerCore:
    cfg = SchedulerConfig(
        policy=policy, block_size=BS, block_bytes=BLOCK_BYTES, kv_offloading_size=gib(tier), **kw
    )
    return SchedulerCore(cfg, num_hbm, num_dram, 2048)


def add(core, rid: str, prompt: list[int], max_tokens: int, now: float) -> None:
    core.add_request(AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)), now)


def first_entry(d: Driver, rid: str):
    return next(s for p in d.plans for s in p.scheduled if s.request_id == rid)


def prompt(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


def turn_two(core, d: Driver, policy_flush: bool = True) -> list[int]:
    """Conversation c: turn 1 (6 full prompt blocks) finishes, a 16-block request flushes HBM,
    then turn 2 asks the history and a new question. Returns turn 2's prompt."""
    first = prompt(100, 24)
    add(core, "c1", first, 4, d.now)
    d.run()
    if policy_flush:
        add(core, "flush", prompt(5000, 60), 4, d.now)
        d.run()
    second = first + d.outputs["c1"] + [7, 8, 9, 10, 11]
    add(core, "c2", second, 4, d.now)
    d.run()
    return second


@pytest.mark.parametrize("policy", ["fcfs", "lvf"])
def test_a_turn_whose_history_left_hbm_loads_it_from_dram(policy):
    core = make(policy)
    d = Driver(core)
    turn_two(core, d)
    s = first_entry(d, "c2")
    assert s.num_computed_tokens == 24, "its 6 history blocks came from DRAM, not recomputed"
    loads = next(p.swap_in for p in d.plans if any(e.request_id == "c2" for e in p.scheduled))
    assert len(loads) == 6
    st = core.stats()
    assert st["num_tier_hits"] == 24 and st["num_tier_blocks_loaded"] == 6
    assert st["num_tier_queries"] >= 33 and st["num_prefix_hits"] == 0
    assert d.finish["c2"] == "length" and len(d.outputs["c2"]) == 4
    m = core.memory
    assert m.hbm.num_free == m.hbm.num_blocks and m.dram.num_free == m.dram.num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "lvf"])
def test_without_the_tier_the_history_is_recomputed(policy):
    cfg = SchedulerConfig(policy=policy, block_size=BS, block_bytes=BLOCK_BYTES)
    core = SchedulerCore(cfg, 16, 64, 2048)
    d = Driver(core)
    turn_two(core, d)
    assert first_entry(d, "c2").num_computed_tokens == 0
    assert core.stats()["num_tier_queries"] == 0 and core.memory.num_tier_blocks == 0
    assert not any(p.swap_in for p in d.plans)


def test_cached_tokens_per_tier_reach_the_first_output():
    core = make("fcfs")
    d = Driver(core)
    outs = []
    record = d.record
    d.record = lambda o: (outs.extend(o), record(o))
    turn_two(core, d)
    first = next(o for o in outs if o.request_id == "c2")
    assert first.num_cached_tokens == 24 and first.num_dram_cached_tokens == 24


def test_a_block_is_copied_to_dram_once():
    """Each full block's content goes to DRAM once: c1's blocks when it finishes, and not again
    when turn 2, which loaded them, finishes (DRAM still has them)."""
    core = make("fcfs")
    d = Driver(core)
    copied = Counter()
    execute = d.worker.execute

    def spy(plan):
        copied.update(d.worker.hbm[h] for h, _ in plan.eager)  # the content each copy reads
        return execute(plan)

    d.worker.execute = spy
    turn_two(core, d)
    assert copied and max(copied.values()) == 1, copied.most_common(2)
    # c1's 6 full blocks, flush's 15 (63 tokens computed), c2's 3 past the 6 it loaded (36 computed)
    assert core.memory.num_offloaded == sum(copied.values()) == 6 + 15 + 3


def test_the_tier_keeps_the_least_recently_freed_blocks_out_first():
    # Room for 21 blocks: y's 6 and flush's 15 stay, x's 6 (the oldest out of HBM) go.
    core = make("fcfs", tier=21)
    d = Driver(core)
    x, y = prompt(100, 24), prompt(300, 24)
    add(core, "x", x + [1], 1, d.now)
    d.run()
    add(core, "y", y + [1], 1, d.now)
    d.run()
    add(core, "flush", prompt(5000, 60), 4, d.now)
    d.run()
    d.step()  # flush's blocks offloaded
    assert core.memory.dram.num_cached == 21
    add(core, "x2", x + [2, 3], 1, d.now)
    add(core, "y2", y + [2, 3], 1, d.now)
    d.run()
    assert first_entry(d, "y2").num_computed_tokens == 24
    assert first_entry(d, "x2").num_computed_tokens == 0


def rotate_after_cache(tier: int) -> tuple[SchedulerCore, Driver]:
    core = make("lvf", num_hbm=20, num_dram=24, tier=tier, min_residency_s=0.0)
    d = Driver(core)
    for k in range(4):
        add(core, f"old{k}", prompt(1000 * (k + 1), 24) + [1], 1, d.now)
        d.run()
    for _ in range(4):
        d.step()
    assert core.memory.dram.num_cached == tier
    add(core, "a", prompt(7000, 25), 40, d.now)
    d.step()
    d.step()
    add(core, "b", prompt(8000, 25), 40, d.now)
    d.run()
    return core, d


def test_rotated_requests_win_dram_space_over_the_cache():
    """DRAM (24 blocks) is all cache when two requests that must take turns on 20 HBM blocks
    arrive: they rotate and recompute exactly as they do without the tier."""
    core, d = rotate_after_cache(24)
    bare, _ = rotate_after_cache(0)
    assert core.num_rotations_out == bare.num_rotations_out > 0
    assert core.num_recomputes == bare.num_recomputes
    assert d.finish["a"] == d.finish["b"] == "length"


@pytest.mark.parametrize("policy", ["lvf", "fcfs", "sf"])
def test_many_conversations_on_a_tiny_pool_all_finish_intact(policy):
    """Rotation, recompute, offloads and loads together on a pool that holds about two
    requests: second turns of ten conversations, invariants after every step, KV by content."""
    core = make(policy, num_hbm=24, num_dram=96, tier=48, max_batched_tokens=16, tbt_slo=0.02)
    d = Driver(core, dt=0.01)
    firsts = {i: prompt(100 * (i + 1), 13 + i) for i in range(10)}
    for i, p in firsts.items():
        add(core, f"a{i}", p, 8, i * 0.005)
    d.run()
    for i, p in firsts.items():
        add(core, f"b{i}", p + d.outputs[f"a{i}"] + [9, 9, 9], 8, d.now + i * 0.005)
    d.run()
    assert len(d.finish) == 20 and all(len(v) == 8 for v in d.outputs.values())
    st = core.stats()
    assert st["num_tier_hits"] > 0 and core.num_preemptions > 0
    m = core.memory
    assert m.hbm.num_free == m.hbm.num_blocks and m.dram.num_free == m.dram.num_blocks


# ---------------------------------------------------------------- load, recompute or split


def decide(policy="lvf", moves_left=16, num_dram=6, fit=(0.01, 0.001), ttft_slo=5.0, now=0.0, **kw):
    cfg = SchedulerConfig(policy=policy, block_size=BS, block_bytes=BLOCK_BYTES, kv_offloading_size=1.0,
                          ttft_slo=ttft_slo, **kw)
    core = SchedulerCore(cfg, 64, 64, 2048)
    add(core, "r", prompt(100, 40), 4, 0.0)
    step = Step(0, now, 512, 512, moves_left, 64, 64)
    chain = [(i, True) for i in range(num_dram)]
    return plan_loads(cfg, core.memory, fit, step, core.requests["r"], chain)


def test_hits_load_whole_when_the_budget_holds_them():
    assert decide(copy_gbps=10.0) == 6


def test_hits_are_recomputed_when_copying_is_slower_than_computing():
    # a 1 MiB block at 0.001 GB/s takes 1 s; computing 4 tokens takes 4 ms
    assert decide(copy_gbps=0.001) == 0
    assert decide(copy_gbps=0.001, tier_loads="all") == 6  # vLLM's connector loads every hit


def test_short_budget_waits_with_slack_and_splits_without():
    assert decide(moves_left=4, copy_gbps=10.0) is None  # a later step loads all 6, in its slack
    assert decide(moves_left=4, copy_gbps=10.0, now=4.99) == 4  # no slack: head loaded, tail recomputed
    assert decide(moves_left=4, copy_gbps=10.0, policy="fcfs", tier_loads="slo") == 4  # FCFS never waits
    assert decide(moves_left=4, copy_gbps=10.0, xfer_budget=5) == 4  # no step's budget would hold them


def test_the_tier_size_in_blocks():
    cfg = SchedulerConfig(block_bytes=BLOCK_BYTES, kv_offloading_size=gib(10))
    assert num_tier_blocks(cfg, 64) == 10 and num_tier_blocks(cfg, 8) == 8
    assert num_tier_blocks(SchedulerConfig(block_bytes=BLOCK_BYTES), 64) == 0
    assert num_tier_blocks(SchedulerConfig(kv_offloading_size=gib(10), enable_prefix_caching=False), 64) == 0
    assert cfg.tier_mode == "slo" and SchedulerConfig(policy="fcfs", kv_offloading_size=1.0).tier_mode == "all"


def test_b_xfer_from_the_measured_bandwidth_unless_set():
    cfg = SchedulerConfig(tbt_slo=0.1).for_worker(4 << 20, 200.0)
    assert cfg.xfer_budget == int(200e9 * 0.05 / (4 << 20)) and cfg.copy_gbps == 200.0
    assert SchedulerConfig(xfer_budget=96).for_worker(4 << 20, 200.0).xfer_budget == 96
    assert SchedulerConfig().for_worker(4 << 20, 0.0).b_xfer == 2400  # the paper's, with no measurement
    assert SchedulerConfig(xfer_budget=2400).for_worker(4 << 20, 200.0).b_xfer == 2400  # given, kept


def test_memory_without_caching_has_no_tier():
    assert Memory(8, 8, BS, False, caching=False, num_tier_blocks=8).num_tier_blocks == 0
