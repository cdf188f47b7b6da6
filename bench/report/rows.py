"""What the reports read from simulated rows, and the paper's own figures they compare with."""

from __future__ import annotations

import statistics

from services.scheduler.core import POLICIES

SYSTEMS = (*POLICIES, "neo")  # what the reproduction compares: our core's policies, and NEO on vllm-v1's
LVFS = ("lvf-paper", "lvf")  # the paper's LVF (none of our guards) and ours
BASELINES = tuple(p for p in SYSTEMS if p not in LVFS)
LABELS = {"fcfs": "vllm-v1"}  # our fcfs is vLLM V1's scheduler (FCFS, recompute preemption)
SPREAD_KEYS = ("ttft_attainment", "tbt_attainment", "tbt_request_attainment")
PAPER_STEP = {"schedule_ms": 7.6, "transfer_ms": 15.8, "model_ms": 69.8, "stall_pct": 0.021}
PAPER_TABLE1 = {"naive": "~10 GB/s, 1556 ms", "duplex": "181+179 GB/s, 46.8 ms", "ideal": "41.7 ms"}


def at(rows: list[dict], policy: str, rate: float, **knobs) -> dict:
    return next(
        r for r in rows if r["policy"] == policy and r["rate"] == rate and all(r[k] == v for k, v in knobs.items())
    )


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def operating_points(res: dict) -> dict[int, list[dict]]:
    """HBM blocks -> that Fig. 16's rows: the profile's pool first, then the cut ones."""
    out: dict[int, list[dict]] = {}
    for r in [*res["fig16"], *res["fig16_pressure"]]:
        out.setdefault(r["num_hbm_blocks"], []).append(r)
    return out


def fig1_rows(res: dict) -> list[dict]:
    """WF and SF on vLLM's swap path and vLLM V1's FCFS, on the conversations at their
    highest rate."""
    rows = res["fig16_conv"]
    hi = max(r["rate"] for r in rows)
    return [at(rows, "wf", hi, transfer_mode="vllm"), at(rows, "sf", hi, transfer_mode="vllm"), at(rows, "fcfs", hi)]


def dig(d, path: tuple[str, ...]):
    """The value at `path` (keys, outermost first) in nested dicts, or None where one is missing."""
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def knob_rows(res: dict) -> dict[str, list[dict]]:
    """Knob (alpha, beta_f, beta_b) -> the rows of its sweep, kept as `fig_<knob>`."""
    return {name.removeprefix("fig_"): rows for name, rows in res.items() if name.startswith("fig_")}


def tbt_behind(rows: list[dict], rate: float) -> float:
    """Points by which LVF's TBT attainment at `rate` trails the best policy's."""
    return 100 * (max(r["tbt_attainment"] for r in rows if r["rate"] == rate) - at(rows, "lvf", rate)["tbt_attainment"])


def name(policy: str) -> str:
    """A policy as the reports name it: the paper's system where ours stands for one."""
    return LABELS.get(policy, policy)


def mean_rows(per_seed: list[list[dict]]) -> list[dict]:
    """One row per job from its rows at every seed (`per_seed[s][j]`): numbers that differ
    between seeds are averaged, and each attainment gets `<key>_spread`, max - min over the
    seeds; `seeds` says how many."""
    out = []
    for runs in zip(*per_seed):
        row = dict(runs[0])
        for k, v in row.items():
            vals = [r[k] for r in runs]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and None not in vals and len(set(vals)) > 1:
                row[k] = statistics.fmean(vals)
        for k in SPREAD_KEYS:
            vals = [r[k] for r in runs if r[k] is not None]
            row[f"{k}_spread"] = max(vals) - min(vals) if vals else 0.0
        vals = [r["num_preemptions"] for r in runs if "num_preemptions" in r]
        if vals:
            row["num_preemptions_min"] = min(vals)
        row["seeds"] = len(runs)
        out.append(row)
    return out


def compare(a: dict, b: dict, key: str) -> tuple[float, float]:
    """(a - b, the larger spread of the two) for `key`, in points: a difference within the
    spread is a tie."""
    spread = max(a.get(f"{key}_spread", 0.0), b.get(f"{key}_spread", 0.0))
    return 100 * (a[key] - b[key]), 100 * spread


def verdict(diff: float, spread: float) -> str:
    return "tie" if abs(diff) <= spread else f"{diff:+.1f}"
