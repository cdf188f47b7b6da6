"""Hand-built RotaSched scenarios: LVF displacement, VLT order, alpha/beta, B_xfer,
eager rotation, DRAM-full fallback, and the baselines' admission orders."""

from __future__ import annotations

from services.scheduler.core import SchedulerConfig, Status
from services.scheduler.core.lvf import lvf_candidates
from services.scheduler.core.vlt import vlt
from shared.protocol import SLO, AddRequest, SamplingParams

from .harness import Driver, SymbolicWorker, add, make_core


def entries(plan):
    return {s.request_id: s for s in plan.scheduled}


def resubmit(core, rid, now, outputs, **slo):
    params = SamplingParams(max_tokens=50)
    core.add_request(AddRequest(rid, [5] * 4, params, slo=SLO(**slo), output_token_ids=outputs), now)


def test_vlt_definitions_with_per_request_slo():
    cfg = SchedulerConfig(alpha=3.0, beta_f=0.5, beta_b=1.0, ttft_slo=2.0, tbt_slo=0.1)
    core = make_core("lvf")
    core.cfg = cfg
    core.add_request(AddRequest("w", [1] * 4, SamplingParams(max_tokens=4)), 1.0)
    core.add_request(AddRequest("o", [1] * 4, SamplingParams(max_tokens=4), slo=SLO(ttft_s=0.5)), 1.0)
    resubmit(core, "e", 1.0, [7], tbt_s=0.2)
    w, o, e = (core.requests[r] for r in "woe")
    assert vlt(w, 1.5, cfg) == -0.5  # within beta_F * S_F = 1 s: negative, no clamp
    assert vlt(w, 2.5, cfg) == 0.5
    assert vlt(o, 2.5, cfg) == 2.5 - 1.0 - 0.25  # per-request TTFT SLO
    assert abs(vlt(e, 2.0, cfg) - 3.0 * (2.0 - 1.0 - 0.2)) < 1e-12  # alpha, beta_B, own S_B
    e.status, e.run_start = Status.RUNNING, 1.5
    assert vlt(e, 2.0, cfg) == -0.5


def candidate_ids(core, now):
    try:
        return [r.request_id for _, r in lvf_candidates(core, now)]
    finally:
        core.q_first.restore()
        core.q_emitted.restore()


def test_alpha_and_beta_move_the_order():
    def build(**kw):
        core = make_core("lvf", **kw)
        core.add_request(AddRequest("w1", [1] * 4, SamplingParams(max_tokens=4), slo=SLO(ttft_s=1.0)), 0.0)
        core.add_request(AddRequest("w2", [1] * 4, SamplingParams(max_tokens=4), slo=SLO(ttft_s=0.2)), 0.2)
        resubmit(core, "e1", 0.4, [9], tbt_s=0.1)
        return core

    # now = 1: w1 lags 1 - 0 - 0.5 = 0.5, w2 lags 1 - 0.2 - 0.1 = 0.7, e1 lags alpha * 0.6.
    assert candidate_ids(build(alpha=3.0, beta_b=0.0), 1.0) == ["e1", "w2", "w1"]
    assert candidate_ids(build(alpha=0.5, beta_b=0.0), 1.0) == ["w2", "w1", "e1"]
    # beta_B = 5 gives e1 0.5 s of slack: it no longer lags at all.
    assert candidate_ids(build(alpha=3.0, beta_b=5.0), 1.0) == ["w2", "w1", "e1"]
    # beta_F = 0: w1 lags 1.0, w2 0.8.
    assert candidate_ids(build(alpha=0.5, beta_f=0.0, beta_b=0.0), 1.0) == ["w1", "w2", "e1"]
    # Iteration leaves the heaps intact.
    core = build()
    assert candidate_ids(core, 1.0) == candidate_ids(core, 1.0)


def test_waiting_request_displaces_the_longest_running_below_it_in_vlt_order():
    # 6 HBM blocks of 4 tokens; a and b hold 3 each. c's VLT is 0.2 + 0.5 s behind its
    # arrival: it ranks above a running request once that has run longer than c's slack left.
    core = make_core("lvf", num_hbm=6, num_dram=32, block_size=4, admit_watermark=0.0)
    d = Driver(core)
    add(core, "a", 9, 15, now=0.0)
    d.now = 0.0
    d.step()  # a: prefill
    d.now = 0.1
    add(core, "b", 9, 15, now=0.1)
    d.step()  # a: decode, b: prefill; a's first two blocks are mirrored
    a_blocks = list(core.requests["a"].hbm_blocks)
    core.add_request(AddRequest("c", [1] * 4, SamplingParams(max_tokens=4), slo=SLO(ttft_s=1.0)), 0.2)
    d.now = 0.21  # c (VLT -0.49) below a (-0.21) and b (-0.11): it waits, nobody moves
    plan = d.step()
    assert "c" not in entries(plan) and not plan.swap_out
    d.now = 0.45  # c (-0.25) above a (-0.45) and b (-0.35): a, the longest-running, goes; b stays
    plan = d.step()
    assert core.requests["a"].status is Status.ROTARY
    assert core.requests["b"].status is Status.RUNNING
    assert entries(plan)["c"].num_new_tokens == 4
    step = core.last_step  # the core tells what the step did
    assert [r.request_id for r in step.preempted] == ["a"] and [r.request_id for r in step.admitted] == ["c"]
    # Eager rotation: only a's unmirrored blocks are copied; its mirrored blocks are
    # reused in the same step by c.
    assert [h for h, _ in plan.swap_out] == a_blocks[2:]
    assert entries(plan)["c"].new_block_ids[0] in a_blocks[:2]


def test_admissions_follow_vlt_order_under_pressure():
    """Every step, the requests LVF admits are a prefix of the paused requests in VLT order
    (the paper's loop: `rotary_yields` off; test_held_back_decode_lets_arrivals_pass has it on)."""
    core = make_core("lvf", num_hbm=12, num_dram=200, block_size=4, tbt_slo=0.05, alpha=3.0, rotary_yields=False)
    d = Driver(core, dt=0.02)
    for i in range(8):
        slo = SLO(ttft_s=0.05 * (1 + i % 3), tbt_s=0.02 * (1 + i % 2))
        core.add_request(AddRequest(f"r{i}", [3] * (6 + i), SamplingParams(max_tokens=12), slo=slo), 0.0)
    checked = 0
    while core.has_unfinished():
        now = d.now
        paused = [r for r in core.requests.values() if r.status is not Status.RUNNING and not r.num_pending]
        lag = {r.request_id: vlt(r, now, core.cfg) for r in paused}
        fits = core.num_demand_blocks <= core.memory.hbm.num_blocks
        plan = d.step()
        if plan is None or fits:
            continue
        admitted = {s.request_id for s in plan.scheduled} & set(lag)
        passed = set(lag) - admitted
        if admitted and passed:
            assert min(lag[r] for r in admitted) >= max(lag[r] for r in passed), (admitted, lag)
        checked += len(admitted)
    assert checked > 10 and core.num_rotations_in > 5


def test_rotary_requests_return_in_vlt_order():
    # HBM holds two of six requests; B_xfer lets about one request rotate per step. The
    # paper's rule: no guard against rotation (test_min_residency_* has them). The prompts
    # are the same: without prefix caching, so that every swap copies all its blocks.
    core = make_core(
        "lvf", num_hbm=8, num_dram=64, block_size=4, beta_b=1.0, xfer_budget=6, eager_rotation=False,
        rotary_yields=False, min_residency_s=0.0, admit_watermark=0.0, enable_prefix_caching=False,
    )
    d = Driver(core, dt=0.05)
    for i, tbt in enumerate([0.04, 0.01, 0.03, 0.02, 0.005, 0.015]):
        core.add_request(AddRequest(f"r{i}", [3] * 5, SamplingParams(max_tokens=8), slo=SLO(tbt_s=tbt)), 0.0)
    num_choices = 0
    while core.has_unfinished():
        now = d.now
        rotary = {r.request_id: vlt(r, now, core.cfg) for r in core.requests.values() if r.status is Status.ROTARY}
        plan = d.step()
        back = [s.request_id for s in plan.scheduled if s.request_id in rotary] if plan else []
        left = [v for r, v in rotary.items() if r not in back]
        for rid in back:
            assert rotary[rid] >= max(left, default=0.0), (rid, rotary)
        num_choices += bool(back and left)
    assert num_choices >= 3 and core.num_rotations_in >= 5


def test_fcfs_when_hbm_holds_everything():
    core = make_core("lvf", num_hbm=64, block_size=4, ttft_slo=0.01)
    d = Driver(core, dt=1.0)  # everybody lags hugely, yet nothing rotates
    for i in range(6):
        add(core, f"r{i}", 10, 8)
    d.run()
    assert core.num_preemptions == 0 and all(not (p.swap_out or p.swap_in) for p in d.plans)


def test_requests_larger_than_b_xfer_are_recomputed_not_swapped():
    core = make_core("lvf", num_hbm=8, num_dram=64, block_size=4, xfer_budget=2, eager_rotation=False, admit_watermark=0.0)
    d = Driver(core, dt=0.05)
    add(core, "big", 20, 8, now=0.0)  # 5+ blocks: more than B_xfer
    d.step()
    core.add_request(AddRequest("late", [1] * 12, SamplingParams(max_tokens=4), slo=SLO(ttft_s=0.01)), d.now)
    d.run()
    assert core.num_recomputes >= 1 and core.memory.num_swapped_out == 0
    assert all(len(p.swap_in) + len(p.swap_out) + len(p.eager) <= 2 for p in d.plans)


def test_dram_full_falls_back_to_recompute_and_nothing_is_aborted():
    for policy in ("lvf", "sf", "wf"):
        core = make_core(policy, num_hbm=8, num_dram=0, block_size=4, tbt_slo=0.01)
        d = Driver(core, dt=0.05)
        for i in range(6):
            add(core, f"r{i}", 9, 10)
        d.run()
        assert core.num_recomputes > 0 and core.num_rotations_out == 0, policy
        assert set(d.finish.values()) == {"length"} and len(d.finish) == 6, policy


def test_eager_mirrors_only_synced_blocks_within_budget():
    core = make_core("lvf", num_hbm=64, num_dram=64, block_size=4, xfer_budget=3)
    d = Driver(core)
    add(core, "a", 30, 10)
    p0 = d.step()
    assert p0.eager == []  # nothing was full before this plan's compute
    p1 = d.step()
    assert len(p1.eager) == 3  # 7 synced blocks, budget 3
    p2 = d.step()
    assert len(p2.eager) == 3
    p3 = d.step()
    assert len(p3.eager) == 2  # the 7th, and the 8th (tokens 28..31) that p2 filled
    a = core.requests["a"]
    assert [h for h, _ in p1.eager + p2.eager + p3.eager] == a.hbm_blocks[:8]
    assert d.step().eager == []


def test_mirrors_start_past_the_watermark_of_hbm_in_use():
    """A CPU worker's default (0.5): a request holding 9 of 64 HBM blocks is not mirrored;
    once three more bring the blocks in use to 39, the next plans mirror its synced blocks.
    None (a core built without a device, the simulator's GPUs) mirrors from the first synced
    block."""
    assert SchedulerConfig().for_device(on_cpu=True).mirror_watermark == 0.5
    assert SchedulerConfig().for_device(on_cpu=False).mirror_watermark == 0.0
    assert SchedulerConfig(mirror_watermark=0.2).for_device(on_cpu=True).mirror_watermark == 0.2
    core = make_core("lvf", num_hbm=64, num_dram=64, block_size=4, mirror_watermark=0.5)
    d = Driver(core)
    add(core, "a", 30, 40)
    assert not any(d.step().eager for _ in range(4))  # 9 of 64 blocks in use
    for rid in "bcd":
        add(core, rid, 40, 10, now=d.now)
    eager = [h for _ in range(6) for h, _ in d.step().eager]
    assert set(core.requests["a"].hbm_blocks[:7]) <= set(eager)
    core = make_core("lvf", num_hbm=64, num_dram=64, block_size=4)
    d = Driver(core)
    add(core, "a", 30, 10)
    d.step()
    assert d.step().eager


def rotate_one(policy):
    """a, b, c fill HBM; c is swapped out when they grow; then d arrives and a finishes:
    who gets a's blocks first?"""
    core = make_core(policy, num_hbm=7, num_dram=64, block_size=4)
    d = Driver(core)
    add(core, "a", 8, 3)
    add(core, "b", 8, 12)
    add(core, "c", 8, 12)
    while core.requests["c"].status is not Status.ROTARY:
        d.step()
    add(core, "d", 4, 2, now=d.now)
    order = []
    while len(order) < 2:
        plan = d.step()
        order += [s.request_id for s in plan.scheduled if s.request_id in ("c", "d") and s.request_id not in order]
    return order


def test_swapped_first_and_waiting_first():
    assert rotate_one("sf") == ["c", "d"]
    assert rotate_one("wf") == ["d", "c"]


def test_pipelined_swap_keeps_kv_intact():
    """Plans built two at a time across preemptions and swap-ins still read valid KV."""
    core = make_core("lvf", num_hbm=8, num_dram=64, block_size=2, tbt_slo=0.01, max_batched_tokens=8)
    w = SymbolicWorker(8, 64, 2, seed=3, p_stop=0.0)
    for i in range(5):
        add(core, f"r{i}", 3 + i, 6)
    now, done = 0.0, 0
    for _ in range(500):
        if not core.has_unfinished():
            break
        plans = [core.schedule(now), core.schedule(now)]
        core.check_invariants()
        for plan in plans:
            if plan is not None:
                now += 0.01
                done += sum(o.finish_reason is not None for o in core.update(w.execute(plan), now))
                core.check_invariants()
        now += 0.01
    assert done == 5 and core.num_rotations_in > 0
