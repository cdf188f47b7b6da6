"""The REPRODUCTION.md section on the simulator against the live server, from the runs
`superinfer bench simlive` recorded in bench/results/simlive_runs.jsonl (minutes of live
serving each: recorded, not rerun by the reproduction)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RUNS_FILE = "simlive_runs.jsonl"


def load_runs(results: Path) -> list[dict]:
    """The runs on record in the `results` folder, oldest first; none when it has no record."""
    path = results / RUNS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def markdown(runs: list[dict]) -> list[str]:
    """The REPRODUCTION.md section: the runs of the latest setting and their medians."""
    head = ["## The simulator vs the live server (SmolLM2 on this machine's CPU)", ""]
    if not runs:
        return [*head, "Not measured yet (`superinfer bench simlive` records its runs).", ""]
    st = runs[-1]["setting"]
    runs = [r for r in runs if r["setting"] == st]
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    rows = [
        f"| {r['when'][:16]} | {r['load'][0]:.1f}–{r['load'][1]:.1f} | {r['live']['ttft_p50_ms']:.0f} / "
        f"{r['sim']['ttft_p50_ms']:.0f} | {r['ttft_p50_ratio']:.2f} | {r['live']['tbt_p50_ms']:.0f} / "
        f"{r['sim']['tbt_p50_ms']:.0f} | {r['tbt_p50_ratio']:.2f} | {r['live_scale']:.2f}; {r['calib_ratios'][0]:.2f}, "
        f"{r['calib_ratios'][1]:.2f} ({r['eval_ratio_unused']:.2f}) | {'yes' if r['within_25pct'] else 'no'} |"
        for r in runs
    ]
    return [
        *head,
        f"`superinfer bench simlive` serves one seeded ShareGPT trace ({st['num_requests']} requests, Poisson "
        f"{st['rate']:g} req/s, outputs capped at {st['max_output_tokens']} tokens, seed {st['seed']}) on `superinfer "
        f"serve` and simulates it with the same configuration ({st['policy']}, SLOs {st['ttft_slo']:g} s / "
        f"{1e3 * st['tbt_slo']:g} ms, {st['hbm_blocks']} KV blocks, {st['max_batched_tokens']}-token chunks). The "
        "simulator's profile is `bench calibrate`'s (`profiles/cpu.json`) with its step model scaled to served "
        "speed, plus the measured gap between steps and the client's HTTP latency, all measured in the same run on "
        f"two other traces of half the size (seeds {st['calib_seed']} and {st['calib_seed'] + 1}) served just before "
        "and just after the evaluated one: the scale is their served compute over the step model's price of the "
        "same steps, each step's work re-derived by replaying the trace's arrivals and result times through the "
        "scheduler core.",
        "",
        "| run | load avg | TTFT p50 ms live / sim | ratio | TBT p50 ms live / sim | ratio | scale; drift | ±25% |",
        "|---|---|---:|---:|---:|---:|---:|---|",
        *rows,
        f"| **median of {len(runs)}** | | | **{med('ttft_p50_ratio'):.2f}** | | **{med('tbt_p50_ratio'):.2f}** | "
        f"{med('live_scale'):.2f} | |",
        "",
        "Load avg: the machine's (two cores, shared with other work) before and after a run. Scale: served over "
        "micro-benchmark compute on the calibration traces; drift: served over calibrated compute on the calibration "
        "traces before and after, and in parentheses on the evaluated trace itself (measured afterwards, not used). "
        f"Served steps compute {med('live_scale'):.2f}x (median) what the micro-benchmark measured: the worker's "
        "torch runs two threads while the gateway, the scheduler, the load client and other work take a core during "
        f"its steps. The gap between steps is {med('step_gap_ms'):.2f} ms and the client sees its first token "
        f"{med('client_latency_ms'):.1f} ms after the scheduler (medians). A run misses when the machine's speed "
        "drifts during it (a drift far from 1 in parentheses); TBT attainment agrees less than the p50s: live step "
        "times vary with the other load on the machine, simulated ones do not.",
        "",
    ]
