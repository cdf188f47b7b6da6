"""Markdown tables of simulated rows: attainment vs rate, one line per run, labels."""

from __future__ import annotations

from bench.report.rows import name, pct


def attainment_table(rows: list[dict], label, unit: str = "req/s") -> list[str]:
    """Rates down, one column per series: 'TTFT / TBT' attainment, means over the seeds
    with each one's spread (max - min) in parentheses."""
    names = list(dict.fromkeys(label(r) for r in rows))
    lines = [f"| rate ({unit}) | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for rate in sorted({r["rate"] for r in rows}):
        cells = []
        for n in names:
            r = next((r for r in rows if r["rate"] == rate and label(r) == n), None)
            cells.append("" if r is None else f"{spread_cell(r, 'ttft_attainment')} / {spread_cell(r, 'tbt_attainment')}")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    return lines


def detail_table(rows: list[dict], first: str, label, cached: bool = False, spread: bool = False) -> list[str]:
    """One row per run; `cached` adds the share of prompt tokens found in the prefix cache;
    `spread` gives each attainment its spread over the seeds (points, in parentheses)."""
    cols = (
        "ttft_attainment",
        "tbt_attainment",
        "throughput_tok_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tbt_p50_ms",
        "tbt_p99_ms",
        "num_preemptions",
        "num_recomputes",
        "xfer_ms_mean",
        "stall_share",
    ) + (("cached_token_share",) if cached else ())
    lines = [
        f"| {first} | TTFT att. | TBT att. | tok/s | TTFT p50 ms | TTFT p99 ms | TBT p50 ms | TBT p99 ms | preempt. | recomp. | "
        "copy ms/step | stall |" + (" cached |" if cached else ""),
        "|---|" + "---:|" * len(cols),
    ]
    for r in rows:
        vals = [
            (spread_cell(r, c) if spread else pct(r[c]))
            if "attainment" in c
            else f"{100 * r[c]:.2f}%"
            if c == "stall_share"
            else f"{100 * r[c]:.0f}%"
            if c == "cached_token_share"
            else f"{r[c]:.0f}"
            if isinstance(r[c], (int, float))
            else "n/a"
            for c in cols
        ]
        lines.append(f"| {label(r)} | " + " | ".join(vals) + " |")
    return lines


def spread_cell(r: dict, key: str) -> str:
    spread = r.get(f"{key}_spread")
    return pct(r[key]) if spread is None or r[key] is None else f"{pct(r[key])} ({100 * spread:.1f})"


def policy_label(r: dict) -> str:
    """A policy as the tables name it, with its copy path where that is not ours."""
    if r["policy"] in ("lvf", "lvf-paper") or r["transfer_mode"] == "duplex":
        return name(r["policy"])
    return f"{name(r['policy'])} ({r['transfer_mode']})"


def flat(rows: list[dict]) -> bool:
    """Whether a sweep moves neither attainment by more than the seeds' spread (then it is not
    shown as a result)."""
    out = True
    for k in ("ttft_attainment", "tbt_attainment"):
        vals = [r[k] for r in rows]
        spread = max(r.get(f"{k}_spread", 0.0) for r in rows)
        out &= max(vals) - min(vals) <= max(spread, 0.005)
    return out
