"""The simulator: the live scheduler core on a virtual clock with the cost-model worker."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace

import pytest

from bench.live.workload import WorkItem, arrival_times, with_arrivals
from bench.sim import costmodel, engine, sweep
from bench.sim.costmodel import MODELS, PROFILE_DIR, load_hardware
from services.scheduler.core import POLICIES, SchedulerConfig
from services.scheduler.core.config import SWAPPING

QWEN = MODELS["qwen2.5-32b"]


def items_of(num: int, rate: float, seed: int = 0, prompt=(20, 400), output=(10, 300)) -> list[WorkItem]:
    rng = random.Random(seed)
    items = [WorkItem("", rng.randint(*prompt), rng.randint(*output), 0.0) for _ in range(num)]
    return with_arrivals(items, arrival_times(num, rate, 1.0, seed))


def setup_of(
    policy: str, hbm: int | None = None, mode: str = "duplex", check: bool = False, dram: int | None = None, **kw
) -> engine.SimSetup:
    cfg = SchedulerConfig(policy=policy, max_batched_tokens=2048, max_num_seqs=256, **kw)
    return engine.make_setup(load_hardware("gh200"), QWEN, cfg, mode, hbm=hbm, dram=dram, check=check)


def strip_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in sweep.WALL_KEYS} for r in rows]


# ---------------------------------------------------------------- the clock


def test_clock_overlapping_copies_hide_behind_the_previous_compute():
    c = engine.Clock(overlap_copies=True)
    # Idle worker: planned at 0, scheduling 0.01, compute 0.05.
    assert c.step(0.0, 0.0, 0.01, 0.05, 0.0, 0.0, False) == pytest.approx((0.01, 0.06))
    # Planned when step 1 started (0.01): scheduling and a 0.03 s swap-in end by 0.05,
    # under step 1's compute; compute starts when step 1 ends.
    assert c.step(0.01, 0.06, 0.01, 0.05, 0.03, 0.03, True) == pytest.approx((0.06, 0.11))
    # A swap-in longer than the previous compute stalls the step.
    assert c.step(0.06, 0.11, 0.01, 0.05, 0.2, 0.2, True) == pytest.approx((0.27, 0.32))
    # Swap-outs only hold the link (until 0.27 + 0.5); the next swap-in queues behind them.
    assert c.step(0.27, 0.32, 0.0, 0.05, 0.0, 0.5, False) == pytest.approx((0.32, 0.37))
    assert c.step(0.32, 0.37, 0.0, 0.05, 0.01, 0.01, True) == pytest.approx((0.78, 0.83))


def test_clock_serial_copies_follow_the_previous_step():
    """As the live worker runs plans: copies start after the previous step, compute waits
    for the swap-ins, the step ends when compute and the out-copies are done."""
    c = engine.Clock(overlap_copies=False)
    assert c.step(0.0, 0.0, 0.01, 0.05, 0.02, 0.03, True) == pytest.approx((0.03, 0.08))
    # Planned at 0.03 while step 1 computes; its copies wait for step 1's end (0.08).
    assert c.step(0.03, 0.08, 0.01, 0.05, 0.02, 0.02, True) == pytest.approx((0.10, 0.15))
    assert c.step(0.10, 0.15, 0.0, 0.05, 0.0, 0.2, False) == pytest.approx((0.15, 0.35))  # out-copies outlast compute


def test_clock_on_vllms_swap_path_compute_waits_for_every_copy():
    """vLLM's swap path: the worker copies before it runs the model, both directions, and
    the copies do not start before the previous step is done."""
    c = engine.Clock(overlap_copies=True)
    assert c.step(0.0, 0.0, 0.01, 0.05, 0.0, 0.0, False, blocking=True) == pytest.approx((0.01, 0.06))
    # Planned at 0.01 under step 1: its 0.02 in + 0.03 out copies start at 0.06, compute at 0.11.
    assert c.step(0.01, 0.06, 0.01, 0.05, 0.02, 0.05, True, blocking=True) == pytest.approx((0.11, 0.16))
    # Swap-outs alone hold the step as well.
    assert c.step(0.11, 0.16, 0.0, 0.05, 0.0, 0.04, False, blocking=True) == pytest.approx((0.20, 0.25))


# ---------------------------------------------------------------- runs


def test_every_request_gets_exactly_its_output_length():
    items = items_of(40, rate=5.0)
    run = engine.simulate(items, setup_of("lvf", hbm=200, dram=400, check=True))
    for it, rec in zip(items, run.records):
        assert rec.ok and rec.output_tokens == it.output_tokens
        assert len(rec.tbt_s) == it.output_tokens - 1
        assert rec.ttft_s > 0 and all(g > 0 for g in rec.tbt_s)
        assert rec.e2e_s == pytest.approx(rec.ttft_s + sum(rec.tbt_s))
    assert run.stats["num_finished"] == len(items)


@pytest.mark.parametrize("policy", POLICIES)
def test_invariants_hold_after_every_step_under_memory_pressure(policy):
    """HBM holds a few requests' worth, DRAM a few more: preemption, rotation and the
    recompute fallback (DRAM full) all happen; the invariants are checked every step."""
    items = items_of(60, rate=30.0, seed=1)
    run = engine.simulate(items, setup_of(policy, hbm=80, dram=60, check=True, xfer_budget=64))
    assert run.stats["num_finished"] == len(items)
    if policy in ("trtllm", "lightllm"):
        assert run.stats["num_preemptions"] == 0  # guaranteed no eviction; LightLLM's safe schedule
    else:
        assert run.stats["num_preemptions"] > 0
    if policy in SWAPPING:
        assert run.stats["num_rotations_out"] > 0
    else:
        assert run.stats["num_rotations_out"] == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_pipeline_depths_agree_on_outputs(depth):
    items = items_of(40, rate=10.0, seed=5)
    run = engine.simulate(items, replace(setup_of("lvf", hbm=150, dram=300, check=True), pipeline_depth=depth))
    assert [r.output_tokens for r in run.records] == [it.output_tokens for it in items]


@pytest.mark.parametrize(("profile", "depth"), [("gh200", 2), ("cpu", 1)])
def test_the_depth_left_unset_is_the_live_one_for_the_profiles_device(profile, depth):
    """A GPU profile plans ahead as the live scheduler does on a GPU worker; the cpu one plans
    each step after the previous result, as on a CPU worker."""
    items = items_of(30, rate=4.0, seed=7)
    cfg = SchedulerConfig(policy="lvf", max_batched_tokens=2048, max_num_seqs=256)
    setup = engine.make_setup(load_hardware(profile), MODELS["smollm2"], cfg, "duplex", hbm=60, dram=300)
    unset, explicit, other = (
        engine.simulate(items, replace(setup, pipeline_depth=d)) for d in (None, depth, 3 - depth)
    )
    assert unset.step_end_s == explicit.step_end_s
    assert unset.step_end_s != other.step_end_s


def test_planning_ahead_hides_scheduling_time():
    """Depth 2 builds plan t+1 while t computes: a scheduling cost below the step's compute
    costs nothing; depth 1 pays it every step."""
    items = items_of(30, rate=2.0, seed=6)
    base = setup_of("fcfs")
    slow = replace(base, sched_time="20")  # 20 ms per schedule() call
    d2 = [engine.simulate(items, replace(s, pipeline_depth=2)).duration_s for s in (base, slow)]
    d1 = [engine.simulate(items, replace(s, pipeline_depth=1)).duration_s for s in (base, slow)]
    assert d2[1] - d2[0] < 0.25 * (d1[1] - d1[0])


def test_same_seed_same_rows():
    items = items_of(80, rate=20.0, seed=3)
    jobs = [sweep.Job(20.0, setup_of(p, hbm=300)) for p in ("lvf", "fcfs")]
    a = sweep.sweep(items, jobs, 5.0, 0.1, seed=3)
    b = sweep.sweep(items, jobs, 5.0, 0.1, seed=3)
    assert strip_wall(a) == strip_wall(b)
    c = sweep.sweep(items, jobs, 5.0, 0.1, seed=4)  # other arrivals
    assert strip_wall(a) != strip_wall(c)


def test_low_rate_all_policies_meet_the_slos():
    items = items_of(40, rate=0.5, seed=2)
    rows = sweep.sweep(items, [sweep.Job(0.5, setup_of(p)) for p in POLICIES], 5.0, 0.1)
    for r in rows:
        assert r["ttft_attainment"] == 1.0, r
        assert r["tbt_attainment"] >= 0.99, r
        assert r["num_preemptions"] == 0
    assert len({r["throughput_tok_s"] for r in rows}) == 1  # no pressure: the policies coincide


def test_overloaded_gh200_lvf_beats_fcfs_on_ttft():
    items = items_of(150, rate=20.0)
    rows = sweep.sweep(items, [sweep.Job(20.0, setup_of(p, hbm=300)) for p in ("lvf", "fcfs")], 5.0, 0.1)
    lvf, fcfs = rows
    assert lvf["ttft_attainment"] > fcfs["ttft_attainment"] + 0.2, (lvf, fcfs)
    assert lvf["num_rotations_out"] > 0 and fcfs["num_recomputes"] > 0


def test_naive_transfers_slow_lvf_down():
    """The ablation's direction: the same LVF decisions cost more time on naive copies."""
    items = items_of(150, rate=20.0)
    rows = sweep.sweep(items, [sweep.Job(20.0, setup_of("lvf", hbm=300, mode=m)) for m in ("duplex", "naive")], 5.0, 0.1)
    duplex, naive = rows
    assert naive["xfer_ms_mean"] > 5 * duplex["xfer_ms_mean"]
    assert naive["duration_s"] > duplex["duration_s"]


def test_vllms_swap_path_costs_lvf_time_that_duplexkv_hides():
    items = items_of(150, rate=20.0)
    jobs = [sweep.Job(20.0, setup_of("lvf", hbm=300, mode=m)) for m in ("duplex", "vllm")]
    duplex, vllm = sweep.sweep(items, jobs, 5.0, 0.1)
    assert vllm["num_blocks_mirrored"] == 0 < duplex["num_blocks_mirrored"]  # no eager rotation on vLLM's path
    # the GPU waits for vLLM's copies (gh200's calibrated step, ~70 ms, hides part of them)
    assert vllm["stall_share"] > 0.02 and vllm["stall_share"] > 10 * duplex["stall_share"]
    assert vllm["tbt_attainment"] < duplex["tbt_attainment"]


def test_neo_serves_from_host_memory_at_the_cpus_attention_speed():
    """NEO on vLLM V1's scheduling: more KV than HBM holds, so fewer preemptions, and a step
    with KV on the host takes at least the CPU's attention over it."""
    items = items_of(150, rate=20.0)
    cfg = SchedulerConfig(policy="fcfs", max_batched_tokens=2048, max_num_seqs=256)
    neo = engine.make_setup(load_hardware("gh200"), QWEN, cfg, "duplex", hbm=300, neo=True)
    assert neo.num_hbm_blocks == 300 and neo.neo_host_blocks > 0
    rows = sweep.sweep(items, [sweep.Job(20.0, s) for s in (neo, setup_of("fcfs", hbm=300))], 5.0, 0.1)
    assert [r["policy"] for r in rows] == ["neo", "fcfs"]
    assert rows[0]["num_recomputes"] < rows[1]["num_recomputes"]
    assert rows[0]["ttft_attainment"] > rows[1]["ttft_attainment"]

    hw, work = neo.hardware, costmodel.StepWork(num_decode_tokens=64, num_kv_read=64 * 900)
    assert engine.neo_compute_time(neo, work, 300) == costmodel.compute_time(hw, QWEN, work)  # all KV in HBM
    on_host = engine.neo_compute_time(neo, work, 600)  # half of it on the host
    assert on_host >= costmodel.host_attention_time(hw, QWEN, 32 * 900)
    assert on_host >= costmodel.compute_time(hw, QWEN, replace(work, num_kv_read=32 * 900))


def test_cli_writes_rows(tmp_path, monkeypatch):
    items = items_of(30, rate=1.0)
    monkeypatch.setattr(sweep, "load_items", lambda *a, **k: [replace(i, prompt="x") for i in items])
    out_json, out_csv = tmp_path / "rows.json", tmp_path / "rows.csv"
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    args = parser.parse_args(
        ["--rates", "2,8", "--policies", "lvf,wf", "--alpha", "1,3", "--json", str(out_json), "--csv", str(out_csv)]
    )
    assert sweep.run(args) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2
    assert {(r["policy"], r["rate"], r["alpha"]) for r in rows} == {
        (p, r, a) for p in ("lvf", "wf") for r in (2.0, 8.0) for a in (1.0, 3.0)
    }
    for key in (
        "policy",
        "rate",
        "ttft_attainment",
        "tbt_attainment",
        "throughput_tok_s",
        "ttft_p99_ms",
        "num_preemptions",
    ):
        assert key in rows[0]
    assert out_csv.read_text().count("\n") == len(rows) + 1


def test_calibrated_profile_refuses_other_models(tmp_path):
    profile = json.loads((PROFILE_DIR / "gh200.json").read_text())
    profile["linear"] = {
        "model": "smollm2",
        "overhead_s": 0.01,
        "prefill_token_s": 1e-3,
        "decode_token_s": 1e-3,
        "kv_token_s": 1e-6,
    }
    path = tmp_path / "lin.json"
    path.write_text(json.dumps(profile))
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    with pytest.raises(ValueError, match="calibrated on"):
        sweep.run(parser.parse_args(["--hardware", str(path), "--model", "qwen2.5-32b"]))


def test_trace_arrivals_are_detected(tmp_path):
    timed, untimed = tmp_path / "t.jsonl", tmp_path / "u.jsonl"
    timed.write_text('\n{"prompt": "hi", "output_tokens": 4, "arrival_s": 0.5}\n')
    untimed.write_text('{"prompt": "hi", "output_tokens": 4}\n')
    assert sweep.trace_has_arrivals(timed) and not sweep.trace_has_arrivals(untimed)


def test_a_timed_trace_keeps_its_arrivals():
    items = [WorkItem("", 50, 5, t) for t in (0.0, 3.0, 7.0)]
    row = sweep.sweep(items, [sweep.Job(100.0, setup_of("fcfs"))], 5.0, 0.1, redraw=False)[0]
    assert row["duration_s"] > 7.0  # not squeezed into 100 req/s


@pytest.mark.parametrize("policy", ["lvf", "trtllm", "lightllm"])
def test_a_max_tokens_cap_still_ends_each_request_at_its_true_length(policy):
    """With a cap the clients ask more than they get: each request ends at its true output
    length with a stop token, and trtllm reserves for the cap (it runs fewer at once)."""
    items = items_of(20, rate=20.0, seed=3, output=(10, 100))
    capped = replace(setup_of(policy, hbm=120, check=True), max_tokens=400)
    run = engine.simulate(items, capped)
    assert [r.output_tokens for r in run.records] == [it.output_tokens for it in items]
    if policy == "trtllm":
        exact = engine.simulate(items, setup_of(policy, hbm=120))
        ttft = lambda r: sum(x.ttft_s for x in r.records)  # noqa: E731
        assert ttft(run) > ttft(exact)  # the cap's reservation keeps requests waiting
