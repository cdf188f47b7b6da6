"""The REPRODUCTION.md section on the simulator against the live server, from the runs
`superinfer bench simlive` recorded in bench/results/simlive_runs.jsonl (minutes of live
serving each: recorded, not rerun by the reproduction)."""

from __future__ import annotations

import json
from pathlib import Path

RUNS_FILE = "simlive_runs.jsonl"
POINTS = 10  # bench/sim/simlive.py's: attainments further apart are explained


def load_runs(results: Path) -> list[dict]:
    """The runs on record in the `results` folder, oldest first (those of the policy-by-load
    command; an older command's single runs are left out); none when it has no record."""
    path = results / RUNS_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    return [run for line in lines if line.strip() and "rows" in (run := json.loads(line))]


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def table(run: dict) -> list[str]:
    """Each policy at each load: attainment live / sim and its gap in points, TTFT and TBT p50."""
    rows = [
        f"| {r['policy']} | {r['rate']:g} | {r['preemptions'][0]} / {r['preemptions'][1]} | "
        f"{_pct(r['live']['ttft_attainment'])} / {_pct(r['sim']['ttft_attainment'])} | {r['ttft_points']:+.0f} | "
        f"{_pct(r['live']['tbt_attainment'])} / {_pct(r['sim']['tbt_attainment'])} | {r['tbt_points']:+.0f} | "
        f"{_ms(r['live']['ttft_p50_ms'])} / {_ms(r['sim']['ttft_p50_ms'])} | "
        f"{_ms(r['live']['tbt_p50_ms'])} / {_ms(r['sim']['tbt_p50_ms'])} |"
        for r in run["rows"]
    ]
    return [
        "| policy | req/s | preemptions live / sim | TTFT % live / sim | Δ points | TBT % live / sim | Δ points | "
        "TTFT p50 ms live / sim | TBT p50 ms live / sim |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


def markdown(runs: list[dict]) -> list[str]:
    """The REPRODUCTION.md section: the latest run's table."""
    head = ["## The simulator vs the live server (SmolLM2 on this machine's CPU)", ""]
    runs = [r for r in runs if "rows" in r]  # an older command's single runs have none
    if not runs:
        return [*head, "Not measured yet (`superinfer bench simlive` records its runs).", ""]
    run = runs[-1]
    st = run["setting"]
    num = {r["num_requests"] for r in run["rows"]}
    far = [f"{r['policy']} at {r['rate']:g}" for r in run["rows"] if r["differs"]]
    return [
        *head,
        f"`superinfer bench simlive` ({run['when'][:16]}) serves seeded ShareGPT traces "
        f"({'/'.join(map(str, sorted(num)))} requests each, Poisson, outputs capped at "
        f"{st['max_output_tokens']} tokens, seed {st['seed']}) on `superinfer serve`, one server per policy, and simulates the same traces with the same configuration (SLOs "
        f"{st['ttft_slo']:g} s / {1e3 * st['tbt_slo']:g} ms, {st['hbm_blocks']} KV blocks of 16 tokens: a few "
        f"requests' KV, so every load is under KV pressure; {st['max_batched_tokens']}-token chunks). Requests "
        "longer than the pool are left out on both sides. The simulator's profile is `bench calibrate`'s "
        "(`profiles/cpu.json`) with its step model scaled to served speed, plus the measured gap between steps and "
        "the client's HTTP latency, all measured in the same run on two calibration traces (seeds "
        f"{st['calib_seed']} and {st['calib_seed'] + 1}, {st['rate']:g} req/s) served before the first policy's "
        f"traces and after the last one's: served step = step model × {run['live_scale']:.2f}, gap "
        f"{run['step_gap_ms']:.2f} ms, client latency {run['client_latency_ms']:.1f} ms; load average "
        f"{run['load'][0]:.1f} → {run['load'][1]:.1f}.",
        "",
        *table(run),
        "",
        f"Δ: simulated minus live attainment; more than {POINTS} points apart in TTFT, TBT or the share of requests "
        "meeting both SLOs (not shown): "
        + (", ".join(far) if far else "none")
        + ". TTFT attainment counts requests (one request of a trace is 100 / its size points); TBT attainment counts "
        "gaps between tokens.",
        "",
    ]
