"""Latency records in, SLO metrics out: the same arithmetic for a live run and a simulated one.

A request's record holds its time to first token (TTFT), every gap between two streamed
chunks (TBT, as the paper's client and vLLM's benchmark measure it: per chunk, so a chunk
carrying several tokens is one gap), its end-to-end latency, and its output token count.
Beside every-gap TBT, a request's TPOT (time per output token, vLLM's definition) is
(e2e − TTFT) / (output tokens − 1), for completed requests with two tokens or more: one
figure per request, so a request that streams several tokens per chunk, or stalls once
and then runs fast, counts once (TBT counts every gap).

Attainment is counted against everything that was asked, so a failed request never
improves a score:
- `ttft_attainment`: requests with TTFT ≤ S_F, over all requests;
- `tbt_attainment`: gaps ≤ S_B, over all gaps of completed requests (the paper's metric);
- `tbt_request_attainment`: requests whose every gap ≤ S_B, over all requests (a request
  with one chunk has no gap and meets it);
- `goodput_rps`: requests meeting both SLOs, per second of the run.
A ratio with nothing to count is None (JSON null).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds. The simulator fills the same."""

    ok: bool
    ttft_s: float | None = None
    tbt_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    expected_output_tokens: int = 0
    arrival_s: float = 0.0  # when it was due, from the start of the run
    start_s: float = 0.0  # when it was sent (later than due under --max-concurrency)
    error: str | None = None
    usage_prompt_tokens: int | None = None  # as the server counted them (its final `usage`), if it did
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache, if it said


def ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def percentiles_ms(values_s: Sequence[float], prefix: str) -> dict[str, float | None]:
    """`{prefix}_mean_ms` and `{prefix}_p50_ms`… (numpy's linear interpolation, as vLLM)."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out: dict[str, float | None] = {f"{prefix}_mean_ms": float(ms.mean()) if ms.size else None}
    for p in PERCENTILES:
        out[f"{prefix}_p{p}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    return out


def tpot_s(r: RequestRecord) -> float | None:
    """(e2e − TTFT) / (output tokens − 1); None under two tokens or without both times."""
    if r.output_tokens < 2 or r.e2e_s is None or r.ttft_s is None:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def meets_ttft(r: RequestRecord, ttft_slo: float) -> bool:
    return r.ok and r.ttft_s is not None and r.ttft_s <= ttft_slo


def meets_tbt(r: RequestRecord, tbt_slo: float) -> bool:
    return r.ok and all(gap <= tbt_slo for gap in r.tbt_s)


def summarize(records: Sequence[RequestRecord], ttft_slo: float, tbt_slo: float, duration_s: float) -> dict:
    """Every figure the bench reports, from records alone (pure: no clock, no I/O)."""
    done = [r for r in records if r.ok]
    gaps = [g for r in done for g in r.tbt_s]
    num_out = sum(r.output_tokens for r in done)
    expected = [r for r in done if r.expected_output_tokens]
    per_s = lambda n: n / duration_s if duration_s > 0 else None  # noqa: E731
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "failures": dict(Counter(r.error or "unknown" for r in records if not r.ok)),
        "duration_s": duration_s,
        "ttft_slo_s": ttft_slo,
        "tbt_slo_s": tbt_slo,
        "ttft_attainment": ratio(sum(meets_ttft(r, ttft_slo) for r in records), len(records)),
        "tbt_attainment": ratio(sum(g <= tbt_slo for g in gaps), len(gaps)),
        "tbt_request_attainment": ratio(sum(meets_tbt(r, tbt_slo) for r in records), len(records)),
        "slo_attainment": ratio(sum(meets_ttft(r, ttft_slo) and meets_tbt(r, tbt_slo) for r in records), len(records)),
        "goodput_rps": per_s(sum(meets_ttft(r, ttft_slo) and meets_tbt(r, tbt_slo) for r in records)),
        "request_rps": per_s(len(done)),
        "input_tok_s": per_s(sum(r.prompt_tokens for r in done)),
        "output_tok_s": per_s(num_out),
        "total_output_tokens": num_out,
        "cached_token_share": cached_share(done),
        "output_len_match": ratio(sum(r.output_tokens == r.expected_output_tokens for r in expected), len(expected)),
        **percentiles_ms([r.ttft_s for r in done if r.ttft_s is not None], "ttft"),
        **percentiles_ms(gaps, "tbt"),
        **percentiles_ms([t for r in done if (t := tpot_s(r)) is not None], "tpot"),
        **percentiles_ms([r.e2e_s for r in done if r.e2e_s is not None], "e2e"),
    }


def cached_share(done: Sequence[RequestRecord]) -> float | None:
    """Prompt tokens served from the prefix cache, over the prompt tokens of the requests
    whose server said (OpenAI `usage.prompt_tokens_details.cached_tokens`)."""
    told = [r for r in done if r.cached_tokens is not None]
    return ratio(sum(r.cached_tokens for r in told), sum(r.usage_prompt_tokens or r.prompt_tokens for r in told))


def format_summary(s: dict) -> str:
    """The console table printed at the end of a run."""
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    num = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [
        f"requests      {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.1f} s",
        f"SLO           TTFT ≤ {s['ttft_slo_s']} s: {pct(s['ttft_attainment'])}   "
        f"TBT ≤ {s['tbt_slo_s']} s: {pct(s['tbt_attainment'])} of gaps, "
        f"{pct(s['tbt_request_attainment'])} of requests",
        f"throughput    {num(s['output_tok_s'])} output tok/s, goodput {num(s['goodput_rps'])} req/s",
    ]
    if s.get("cached_token_share") is not None:
        lines.append(f"prefix cache  {pct(s['cached_token_share'])} of prompt tokens cached")
    for name in ("ttft", "tbt", "tpot", "e2e"):
        cols = "  ".join(f"p{p} {num(s[f'{name}_p{p}_ms'])}" for p in PERCENTILES)
        lines.append(f"{name + ' ms':<13} mean {num(s[f'{name}_mean_ms'])}  {cols}")
    lines += [f"failure       {n} × {reason}" for reason, n in s["failures"].items()]
    return "\n".join(lines)


def plot_cdfs(records: Sequence[RequestRecord], ttft_slo: float, tbt_slo: float, out_dir: Path) -> list[Path]:
    """TTFT and TBT CDFs as PNGs, each with its SLO marked. matplotlib is imported here so
    the bench runs without it when no plot is asked for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r.ok]
    series = {
        "ttft": ([r.ttft_s for r in done if r.ttft_s is not None], ttft_slo, "time to first token (ms)"),
        "tbt": ([g for r in done for g in r.tbt_s], tbt_slo, "time between tokens (ms)"),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (values_s, slo_s, label) in series.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = np.sort(np.asarray(values_s, dtype=float)) * 1000.0
        ax.step(xs, np.arange(1, xs.size + 1) / max(xs.size, 1), where="post")
        ax.axvline(slo_s * 1000.0, color="red", linestyle="--", label=f"SLO {slo_s * 1000:g} ms")
        ax.set(xlabel=label, ylabel="fraction ≤ x", ylim=(0, 1.02), title=f"{name.upper()} CDF (n={xs.size})")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        path = out_dir / f"{name}_cdf.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths
