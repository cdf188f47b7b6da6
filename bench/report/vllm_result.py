"""`bench serve --result-format vllm`: a run's records under the keys vLLM's serving
benchmark (`vllm bench serve`, formerly `benchmark_serving.py`) writes, so dashboards and
scripts made for its result files read ours.

Meanings follow vLLM's: times per request in seconds, summary figures in ms; `itls` are the
gaps between streamed chunks of each request (its ITL, our TBT); TPOT is (e2e − TTFT) /
(output tokens − 1) over completed requests of two tokens or more; `std_*` is numpy's
population deviation, `median_*` and `p99_*` its linear-interpolated percentiles. Totals,
throughputs and the statistics count completed requests; the per-request lists hold every
request in workload order, a failed one with output length 0 (as vLLM writes it).

Where vLLM writes a value we do not record, we write what we have, never a made-up figure:
- `generated_texts` is null: records keep no text;
- `ttfts`, `latencies`: null for a request that never got its first token or never ended
  (vLLM writes 0.0);
- a statistic with nothing to count is null (vLLM writes 0.0);
- `request_goodput` is ours: requests with TTFT ≤ S_F and every gap ≤ S_B, per second of
  the run (vLLM's counts TTFT/TPOT/e2e bounds given by `--goodput`; null without them;
  our SLOs always apply, so it is null only for a run of no duration).
vLLM's peak-throughput, queue-time and start-time keys are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bench.report.metrics import RequestRecord, tpot_s

STATISTICS = ("ttft", "tpot", "itl", "e2el")


def vllm_result(records: Sequence[RequestRecord], summary: dict, meta: dict) -> dict:
    """`summary` is `summarize(records, …)`; `meta` vLLM's run keys (date, model_id, …)."""
    done = [r for r in records if r.ok]
    duration = summary["duration_s"]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = summary["total_output_tokens"]
    values = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [t for r in done if (t := tpot_s(r)) is not None],
        "itl": [g for r in done for g in r.tbt_s],
        "e2el": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    out = {
        **meta,
        "duration": duration,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": summary["request_rps"],
        "request_goodput": summary["goodput_rps"],
        "output_throughput": summary["output_tok_s"],
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else None,
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts": [r.ttft_s for r in records],
        "itls": [list(r.tbt_s) for r in records],
        "latencies": [r.e2e_s for r in records],
        "generated_texts": None,
        "errors": [r.error or "" for r in records],
    }
    for name in STATISTICS:
        out.update(statistics_ms(values[name], name))
    return out


def statistics_ms(values_s: Sequence[float], name: str) -> dict[str, float | None]:
    """`mean_{name}_ms`, `median_{name}_ms`, `std_{name}_ms`, `p99_{name}_ms`."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    stat = lambda f: float(f(ms)) if ms.size else None  # noqa: E731
    return {
        f"mean_{name}_ms": stat(np.mean),
        f"median_{name}_ms": stat(np.median),
        f"std_{name}_ms": stat(np.std),
        f"p99_{name}_ms": stat(lambda a: np.percentile(a, 99)),
    }
