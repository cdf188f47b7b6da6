"""The DRAM prefix-cache tier's section (bench/sim/tier.py runs it; REPRODUCTION.md and
`bench tier` show it)."""

from __future__ import annotations

from bench.report.rows import LABELS, compare as diff_points, pct

SYSTEMS = (("lvf", True), ("fcfs", True), ("lvf", False), ("fcfs", False))  # (policy, with the tier)


def label(policy: str, tier: bool) -> str:
    return f"{LABELS.get(policy, policy)} + {'tier' if tier else 'HBM only'}"


def render(rows: list[dict]) -> str:
    """The Markdown section: per rate, TTFT and TBT attainment of each system (± the spread over
    the seeds), LVF + tier minus vLLM V1 + tier in points, and what the tier did."""
    rates = sorted({r["rate"] for r in rows})
    tier = next((r["kv_offloading_size"] for r in rows if r["kv_offloading_size"]), 0.0)
    seeds = rows[0].get("seeds", 1) if rows else 0
    share, think = (rows[0].get("hbm_share", 1.0), rows[0].get("think_s", 1.0)) if rows else (1.0, 1.0)
    pool = "its whole HBM KV pool" if share in (None, 1.0) else f"{100 * share:.0f}% of its HBM KV pool"
    head = [label(p, t) for p, t in SYSTEMS]
    out = [
        "## The DRAM prefix-cache tier",
        "",
        f"ShareGPT conversations (each turn's prompt the whole history, the next turn {think:g} s after the "
        f"last one ends), Qwen2.5-32B on gh200 with {pool}, {seeds} seeds; tier {tier:g} GiB of the DRAM pool "
        "for both systems. Each cell: TTFT / TBT attainment. Δ: LVF + tier minus vLLM V1 + tier, in points (± the "
        "larger spread over the seeds).",
        "",
        "| rate | " + " | ".join(head) + " | Δ TTFT | Δ TBT | tier hits (tokens) lvf / vllm-v1 |",
        "|---" * (len(head) + 4) + "|",
    ]
    for rate in rates:
        cells = []
        for p, t in SYSTEMS:
            r = _at(rows, p, rate, t)
            cells.append(f"{pct(r['ttft_attainment'])} / {pct(r['tbt_attainment'])}" if r else "—")
        ours, base = _at(rows, "lvf", rate, True), _at(rows, "fcfs", rate, True)
        if ours and base:
            dt, st = diff_points(ours, base, "ttft_attainment")
            db, sb = diff_points(ours, base, "tbt_attainment")
            delta = [f"{dt:+.1f} (±{st:.1f})", f"{db:+.1f} (±{sb:.1f})"]
            hits = f"{ours['num_tier_hits']:.0f} / {base['num_tier_hits']:.0f}"
        else:
            delta, hits = ["—", "—"], "—"
        out.append(f"| {rate:g} | " + " | ".join(cells + delta + [hits]) + " |")
    out += [
        "",
        "Rates in conversations/s. vLLM V1 + tier is vLLM's scheduler with its offloading connector's policy "
        "(copy what leaves the GPU, load every hit); its copies are priced on our duplex engine. LVF's tier "
        "decides per request and step whether to load, recompute or split, from the copy rate, the step-time fit "
        "and the TTFT slack.",
    ]
    return "\n".join(out) + "\n"


def _at(rows: list[dict], policy: str, rate: float, tier: bool) -> dict | None:
    try:
        return next(r for r in rows if r["policy"] == policy and r["rate"] == rate and bool(r["kv_offloading_size"]) == tier)
    except StopIteration:
        return None
