"""`bench simlive`: the replay of a live run, the live terms of the profile, the comparison,
and a tiny run against the live server."""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict

import pytest

from bench.live.workload import WorkItem, arrival_times, with_arrivals
from bench.report import simlive as report_simlive
from bench.report.metrics import RequestRecord
from bench.sim import replay, simlive
from bench.sim.costmodel import PROFILE_DIR, StepWork, hardware_from_dict

PROFILE = {
    "name": "t",
    "notes": "test",
    "linear": {
        "model": "smollm2",
        "overhead_s": 0.015,
        "prefill_token_s": 7e-4,
        "decode_token_s": 9e-4,
        "kv_token_s": 3e-6,
    },
    "dtype_bytes": 4,
    "pipeline": False,
    "sched_ms": 0.0,
    "kv_hbm_gb": 1.0,
    "kv_dram_gb": 1.0,
    "link": {"curve": [[12288, 2.0], [737280, 12.0], [47185920, 12.0]], "dram_gbs": 13.0},
}
POOLS = replay.Pools(num_hbm_blocks=96, num_dram_blocks=2000, max_model_len=96 * 16)


def items_of(num: int, rate: float, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed)
    items = [WorkItem("", rng.randint(5, 700), rng.randint(2, 120), 0.0) for _ in range(num)]
    return with_arrivals(items, arrival_times(num, rate, 1.0, seed))


# ---------------------------------------------------------------- the replay


@pytest.mark.parametrize("policy", ["lvf", "fcfs"])
def test_replay_rederives_every_plan_of_a_simulated_run(policy, monkeypatch):
    """The simulator plans as the live loop does; fed its arrivals and result times, the
    replay builds the same plans (LVF under memory pressure: rotations every few steps).
    The simulator plans at the very instant a result is back, so the replay must too."""
    monkeypatch.setattr(replay, "SCHEDULE_LAG_S", 0.0)
    items = items_of(40, 3.0)
    setting = simlive.Setting(policy=policy, hbm_blocks=POOLS.num_hbm_blocks)
    run = simlive.simulate(items, PROFILE, setting, POOLS)
    assert policy == "fcfs" or run.stats["num_preemptions"] > 40
    plans = replay.replay_plans(
        items, [it.arrival_s for it in items], run.step_end_s, setting.scheduler_config(), POOLS, setting.pipeline_depth
    )
    assert [n for _, n in plans] == run.step_num_sampled
    assert sum(n for _, n in plans) == sum(it.output_tokens for it in items)


def test_served_steps_scale_the_step_model_that_priced_them(monkeypatch):
    """Steps served 2.5x slower than a known model priced them, paired with their replayed
    work, scale that model by 2.5: the calibrated profile prices them as served."""
    monkeypatch.setattr(replay, "SCHEDULE_LAG_S", 0.0)
    items = items_of(30, 2.0, seed=1)
    setting = simlive.Setting(hbm_blocks=POOLS.num_hbm_blocks)
    run = simlive.simulate(items, PROFILE, setting, POOLS)
    plans = replay.replay_plans(
        items, [it.arrival_s for it in items], run.step_end_s, setting.scheduler_config(), POOLS, setting.pipeline_depth
    )
    steps = [{"num_tokens": n, "compute_s": 2.5 * ms / 1e3} for n, ms in zip(run.step_num_sampled, run.compute_ms)]
    samples, same = replay.step_samples(plans, steps)
    assert same == 1.0 and len(samples) > 100
    scale = replay.served_ratio(samples, PROFILE)
    assert scale == pytest.approx(2.5)
    prof = json.loads(json.dumps(replay.live_profile(PROFILE, scale, gap_s=0.0005, latency_s=0.008)))
    assert replay.served_ratio(samples, prof) == pytest.approx(1.0)
    hw = hardware_from_dict(prof)
    assert (hw.step_gap_s, hw.client_latency_s, prof["live_scale"]) == pytest.approx((0.0005, 0.008, 2.5))
    assert prof["link"] == PROFILE["link"] and PROFILE["linear"]["overhead_s"] == 0.015  # the input is kept


def test_step_samples_pair_in_order_and_skip_empty_steps():
    work = StepWork()
    work.add(10, 1, True)
    plans = [(work, 1), (StepWork(), 0), (work, 1)]
    steps = [
        {"num_tokens": 1, "compute_s": 0.05},
        {"num_tokens": 0, "compute_s": 0.0001},  # drops only
        {"num_tokens": 2, "compute_s": 0.06},  # the replay sampled 1: paired all the same
    ]
    samples, same = replay.step_samples(plans, steps)
    assert [s for _, s in samples] == [0.05, 0.06]
    assert same == pytest.approx(2 / 3)


# ---------------------------------------------------------------- the live terms


def test_step_gap_counts_only_busy_steps():
    """A step the worker had to wait for (here after an idle spell) holds no gap."""
    steps = [
        {"t": 0.0, "compute_s": 0.05, "transfer_wait_s": 0.0, "plan_wait_s": 0.0},
        {"t": 0.051, "compute_s": 0.05, "transfer_wait_s": 0.0, "plan_wait_s": 0.0},  # gap 1 ms
        {"t": 0.113, "compute_s": 0.05, "transfer_wait_s": 0.01, "plan_wait_s": 0.0},  # 2 ms
        {"t": 5.0, "compute_s": 0.05, "transfer_wait_s": 0.0, "plan_wait_s": 4.8},  # after idle
        {"t": 5.053, "compute_s": 0.05, "transfer_wait_s": 0.0, "plan_wait_s": 0.0},  # 3 ms
    ]
    assert replay.step_gap_s(steps) == pytest.approx(0.002)


def finished_line(rid: str, ts: str, prompt: int, output: int, ttft: float, running: float) -> str:
    e = {"service": "scheduler", "event": "request_finished", "request_id": rid, "timestamp": ts, "ttft_s": ttft}
    e |= {"num_prompt_tokens": prompt, "num_output_tokens": output, "waiting_s": 0.5, "rotary_s": 0.0}
    return json.dumps(e | {"running_s": running})


def test_requests_match_the_scheduler_log_in_arrival_order(tmp_path):
    """Two requests with the same lengths pair in the order they arrived; gateway lines and
    lines from outside the window are ignored."""
    log = tmp_path / "serve.log"
    lines = [
        "not json: a traceback line",
        finished_line("a", "2026-01-01T00:00:10+00:00", 50, 8, 0.30, 9.0),  # arrived at 0.5 s
        finished_line("b", "2026-01-01T00:00:06+00:00", 50, 8, 0.20, 3.0),  # arrived at 2.5 s
        finished_line("c", "2026-01-01T00:00:09+00:00", 70, 8, 0.40, 4.0),  # arrived at 4.5 s
        finished_line("old", "2026-01-01T00:00:00+00:00", 70, 8, 0.1, 0.0),  # before the window
        json.dumps({"service": "gateway", "event": "request_finished", "request_id": "a", "ttft_s": 0.31}),
    ]
    log.write_text("\n".join(lines) + "\n")
    t0 = 1767225600.0  # 2026-01-01T00:00:00Z
    finishes = replay.scheduler_finishes(log, t0 + 0.1, t0 + 20)
    assert sorted(e["request_id"] for e in finishes) == ["a", "b", "c"]
    assert min(e["arrival"] for e in finishes) == pytest.approx(t0 + 0.5)
    records = [
        RequestRecord(ok=True, ttft_s=0.41, prompt_tokens=70, output_tokens=8, start_s=4.49),
        RequestRecord(ok=True, ttft_s=0.31, prompt_tokens=50, output_tokens=8, start_s=0.49),
        RequestRecord(ok=True, ttft_s=0.22, prompt_tokens=50, output_tokens=8, start_s=2.49),
        RequestRecord(ok=False, prompt_tokens=50, output_tokens=0, start_s=3.0),
    ]
    matched = replay.match_requests(records, finishes)
    assert {i: e["request_id"] for i, e in matched.items()} == {0: "c", 1: "a", 2: "b"}
    assert sorted(replay.client_latencies(records, matched)) == pytest.approx([0.01, 0.01, 0.02])


# ---------------------------------------------------------------- the simulator's live terms


def test_sim_charges_the_step_gap_and_the_client_latency():
    """One request alone: every step starts `gap` after the previous one (the first after
    the idle worker too), and the client sees its tokens `latency` later."""
    items = [WorkItem("", 100, 6, 0.0)]
    setting = simlive.Setting(hbm_blocks=POOLS.num_hbm_blocks)
    bare = simlive.simulate(items, PROFILE, setting, POOLS).records[0]
    measured = PROFILE | {"step_gap_ms": 4.0, "client_latency_ms": 20.0}
    live = simlive.simulate(items, measured, setting, POOLS).records[0]
    assert live.ttft_s - bare.ttft_s == pytest.approx(0.004 + 0.02)
    assert [b - a for a, b in zip(bare.tbt_s, live.tbt_s)] == pytest.approx([0.004] * 5)


def test_compare_flags_each_p50():
    live = dict.fromkeys(simlive.KEYS, 100.0)
    sim = dict.fromkeys(simlive.KEYS, 100.0) | {"ttft_p50_ms": 130.0, "tbt_p50_ms": 80.0, "tbt_p99_ms": None}
    cmp = simlive.compare(live, sim)
    assert (cmp["ttft_p50_ratio"], cmp["tbt_p50_ratio"], cmp["tbt_p99_ratio"]) == pytest.approx((1.3, 0.8, None))
    assert cmp["within"] == {"ttft_p50_ratio": False, "tbt_p50_ratio": True}
    assert cmp["within_25pct"] is False


# ---------------------------------------------------------------- end to end


@pytest.mark.slow  # starts the server and serves three tiny traces (~60 s on two quiet cores)
def test_a_small_run_on_a_pool_smaller_than_some_prompts_completes(tmp_path):
    """As on a fresh clone: no results folder yet, and a 12-block pool (192 tokens) that two of
    the trace's first four ShareGPT requests do not fit: they are left out on both sides (more
    are sampled), the run completes and writes its JSON and history line."""
    results = tmp_path / "bench" / "results"
    p = argparse.ArgumentParser()
    simlive.add_arguments(p)
    argv = ["--policies", "fcfs", "--rates", "2", "--num-requests", "4", "--max-output-tokens", "8"]
    argv += ["--hbm-blocks", "12", "--json", str(results / "simlive.json"), "--history", str(results / "runs.jsonl")]
    assert simlive.run(p.parse_args(argv)) == 0
    res = json.loads((results / "simlive.json").read_text())
    (row,) = res["rows"]
    assert row["num_left_out"] == 2
    for side in ("live", "sim"):
        assert row[side]["completed"] == row[side]["num_requests"] == 4, side
        assert math.isfinite(row[side]["ttft_p50_ms"]) and row[side]["ttft_p50_ms"] > 0, side
    cal = res["calibration"]
    assert cal["profile"]["live_scale"] > 0 and all(r > 0 for r in cal["ratios"])
    lines = (results / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["rows"][0]["policy"] == "fcfs"


def history_of(rows: list[tuple[str, float, float, float]]) -> dict:
    """A history line of a run whose rows are (policy, rate, live and sim TTFT attainment)."""
    cal = {"load": [[1.0, 1.5], [1.5, 2.0]], "ratios": [1.0, 1.0]}
    res = {"setting": asdict(simlive.Setting()), "calibration": cal}
    res["calibration"]["profile"] = {"live_scale": 2.5, "step_gap_ms": 0.2, "client_latency_ms": 8.0}
    res["rows"] = []
    for policy, rate, live, sim in rows:
        sides = {
            "live": dict.fromkeys(simlive.ATTAIN, 0.9) | {"ttft_attainment": live, "num_requests": 16},
            "sim": dict.fromkeys(simlive.ATTAIN, 0.9) | {"ttft_attainment": sim},
        }
        for side in sides.values():
            side |= {"ttft_p50_ms": 500.0, "tbt_p50_ms": 60.0}
        row = {"policy": policy, "rate": rate, "preemptions": [3, 4], "num_left_out": 0, "eval_ratio_unused": 1.0}
        row |= sides | simlive.compare(dict.fromkeys(simlive.KEYS, 100.0), dict.fromkeys(simlive.KEYS, 100.0))
        res["rows"].append(row | simlive.points(sides["live"], sides["sim"]))
    return json.loads(json.dumps(simlive.history_line(res)))


def test_points_flag_attainments_more_than_ten_points_apart():
    live = {"ttft_attainment": 0.5, "tbt_attainment": 0.9, "slo_attainment": None}
    gaps = simlive.points(live, {"ttft_attainment": 0.625, "tbt_attainment": 0.85, "slo_attainment": 0.4})
    assert gaps["ttft_points"] == pytest.approx(12.5) and gaps["tbt_points"] == pytest.approx(-5.0)
    assert gaps["slo_points"] is None and gaps["differs"] is True
    close = simlive.points(live, {"ttft_attainment": 0.55, "tbt_attainment": 0.9, "slo_attainment": 0.4})
    assert close["ttft_points"] == pytest.approx(5.0) and close["differs"] is False


def test_markdown_shows_the_latest_run_side_by_side(tmp_path):
    old = {"when": "2026-01-01T00:00", "setting": {}, "ttft_p50_ratio": 1.0}  # the single-run command's
    first = history_of([("fcfs", 0.3, 1.0, 1.0)])
    latest = history_of([("fcfs", 0.3, 0.5, 0.625), ("lvf", 1.0, 0.25, 0.3125)])
    (tmp_path / report_simlive.RUNS_FILE).write_text("\n".join(json.dumps(r) for r in (old, first, latest)) + "\n")
    runs = report_simlive.load_runs(tmp_path)
    assert len(runs) == 2
    text = "\n".join(report_simlive.markdown(runs))
    assert "| fcfs | 0.3 | 3 / 4 | 50 / 62 | +12 |" in text and "| lvf | 1 | 3 / 4 | 25 / 31 | +6 |" in text
    assert "meeting both SLOs (not shown): fcfs at 0.3." in text
    assert "Not measured" in "\n".join(report_simlive.markdown([old]))
