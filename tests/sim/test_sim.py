"""The simulator: the live scheduler core on a virtual clock with the cost-model worker."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from bench import sim
from bench.costmodel import MODELS, load_hardware
from bench.workload import WorkItem, arrival_times, with_arrivals
from services.scheduler.core import POLICIES, SchedulerConfig

QWEN = MODELS["qwen2.5-32b"]


def items_of(num: int, rate: float, seed: int = 0, prompt=(20, 400), output=(10, 300)) -> list[WorkItem]:
    rng = random.Random(seed)
    items = [WorkItem("", rng.randint(*prompt), rng.randint(*output), 0.0) for _ in range(num)]
    return with_arrivals(items, arrival_times(num, rate, 1.0, seed))


def setup_of(policy: str, hbm: int | None = None, mode: str = "duplex", check: bool = False, **kw) -> sim.SimSetup:
    cfg = SchedulerConfig(policy=policy, max_batched_tokens=2048, max_num_seqs=256, **kw)
    return sim.make_setup(load_hardware("gh200"), QWEN, cfg, mode, hbm=hbm, check=check)


def strip_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in sim.WALL_KEYS} for r in rows]


# ---------------------------------------------------------------- the clock


def test_clock_pipeline_overlaps_scheduling_and_copies_with_compute():
    c = sim.Clock(pipeline=True)
    assert c.step(now=0.0, sched_s=0.01, compute_s=0.05, in_s=0.0, xfer_s=0.0, reads_in=False) == pytest.approx(0.06)
    # Planned while step 1 computed (from 0.01): scheduling (0.01) and the 0.03 s swap-in
    # are hidden behind its compute; compute starts when step 1 ends.
    assert c.step(0.06, 0.01, 0.05, 0.03, 0.03, True) == pytest.approx(0.11)
    # A swap-in longer than the previous compute stalls the step: ready at 0.06+0.01+0.2.
    assert c.step(0.11, 0.01, 0.05, 0.2, 0.2, True) == pytest.approx(0.32)
    # Swap-outs only hold the link; the next swap-in queues behind them (in at 0.78).
    c.step(0.32, 0.0, 0.05, 0.0, 0.5, False)  # link busy until 0.27 + 0.5
    assert c.step(0.37, 0.0, 0.05, 0.01, 0.01, True) == pytest.approx(0.77 + 0.01 + 0.05)


def test_clock_without_pipeline_runs_everything_in_series():
    c = sim.Clock(pipeline=False)
    assert c.step(0.0, 0.01, 0.05, 0.02, 0.03, True) == pytest.approx(0.09)
    assert c.step(0.09, 0.01, 0.05, 0.0, 0.0, False) == pytest.approx(0.15)


# ---------------------------------------------------------------- runs


def test_every_request_gets_exactly_its_output_length():
    items = items_of(40, rate=5.0)
    run = sim.simulate(items, setup_of("lvf", hbm=200, check=True))
    for it, rec in zip(items, run.records):
        assert rec.ok and rec.output_tokens == it.output_tokens
        assert len(rec.tbt_s) == it.output_tokens - 1
        assert rec.ttft_s > 0 and all(g > 0 for g in rec.tbt_s)
        assert rec.e2e_s == pytest.approx(rec.ttft_s + sum(rec.tbt_s))
    assert run.stats["num_finished"] == len(items)


@pytest.mark.parametrize("policy", POLICIES)
def test_invariants_hold_after_every_step_under_memory_pressure(policy):
    """HBM holds ~4 requests' worth, DRAM a few more: preemption, rotation and the
    recompute fallback all happen; the core's invariants are checked every step."""
    items = items_of(60, rate=30.0, seed=1)
    run = sim.simulate(items, setup_of(policy, hbm=80, check=True, xfer_budget=64))
    assert run.stats["num_finished"] == len(items)
    assert run.stats["num_preemptions"] > 0


def test_same_seed_same_rows():
    items = items_of(80, rate=20.0, seed=3)
    jobs = [sim.Job(20.0, setup_of(p, hbm=300)) for p in ("lvf", "fcfs")]
    a = sim.sweep(items, jobs, 5.0, 0.1, seed=3)
    b = sim.sweep(items, jobs, 5.0, 0.1, seed=3)
    assert strip_wall(a) == strip_wall(b)
    c = sim.sweep(items, jobs, 5.0, 0.1, seed=4)  # other arrivals
    assert strip_wall(a) != strip_wall(c)


def test_low_rate_all_policies_meet_the_slos():
    items = items_of(40, rate=0.5, seed=2)
    rows = sim.sweep(items, [sim.Job(0.5, setup_of(p)) for p in POLICIES], 5.0, 0.1)
    for r in rows:
        assert r["ttft_attainment"] == 1.0, r
        assert r["tbt_attainment"] >= 0.99, r
        assert r["num_preemptions"] == 0
    assert len({r["throughput_tok_s"] for r in rows}) == 1  # no pressure: the policies coincide


def test_overloaded_gh200_lvf_beats_fcfs_on_ttft():
    items = items_of(150, rate=20.0)
    rows = sim.sweep(items, [sim.Job(20.0, setup_of(p, hbm=300)) for p in ("lvf", "fcfs")], 5.0, 0.1)
    lvf, fcfs = rows
    assert lvf["ttft_attainment"] > fcfs["ttft_attainment"] + 0.2, (lvf, fcfs)
    assert lvf["num_rotations_out"] > 0 and fcfs["num_recomputes"] > 0


def test_naive_transfers_slow_lvf_down():
    """The ablation's direction: the same LVF decisions cost more time on naive copies."""
    items = items_of(150, rate=20.0)
    rows = sim.sweep(items, [sim.Job(20.0, setup_of("lvf", hbm=300, mode=m)) for m in ("duplex", "naive")], 5.0, 0.1)
    duplex, naive = rows
    assert naive["xfer_ms_mean"] > 5 * duplex["xfer_ms_mean"]
    assert naive["duration_s"] > duplex["duration_s"]


def test_cli_writes_rows(tmp_path, monkeypatch):
    items = items_of(30, rate=1.0)
    monkeypatch.setattr(sim, "load_items", lambda *a, **k: [replace(i, prompt="x") for i in items])
    out_json, out_csv = tmp_path / "rows.json", tmp_path / "rows.csv"
    parser = sim.argparse.ArgumentParser()
    sim.add_arguments(parser)
    args = parser.parse_args(["--rates", "2,8", "--policies", "lvf,wf", "--alpha", "1,3", "--json", str(out_json), "--csv", str(out_csv)])
    assert sim.run(args) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2
    assert {(r["policy"], r["rate"], r["alpha"]) for r in rows} == {(p, r, a) for p in ("lvf", "wf") for r in (2.0, 8.0) for a in (1.0, 3.0)}
    for key in ("policy", "rate", "ttft_attainment", "tbt_attainment", "throughput_tok_s", "ttft_p99_ms", "num_preemptions"):
        assert key in rows[0]
    assert out_csv.read_text().count("\n") == len(rows) + 1


def test_calibrated_profile_refuses_other_models(tmp_path):
    profile = json.loads((sim.Path(sim.__file__).parent / "profiles" / "gh200.json").read_text())
    profile["linear"] = {"model": "smollm2", "overhead_s": 0.01, "prefill_token_s": 1e-3, "decode_token_s": 1e-3, "kv_token_s": 1e-6}
    path = tmp_path / "lin.json"
    path.write_text(json.dumps(profile))
    parser = sim.argparse.ArgumentParser()
    sim.add_arguments(parser)
    with pytest.raises(ValueError, match="calibrated on"):
        sim.run(parser.parse_args(["--hardware", str(path), "--model", "qwen2.5-32b"]))
