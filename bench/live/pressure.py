"""`bench compare --rates`: the pressure comparison, the same ShareGPT trace at several rates
against every target, one row per target and run, with what each server counted.

A run is one (rate, burstiness) pair: every rate of `--rates` at each `--burstiness`, the
trace and its arrivals drawn once per pair and sent to every target alike. Around each run
the bench reads the target's Prometheus endpoints (its URL + /metrics, and any `--metrics`
given for it) and keeps the difference of each counter it finds:

| column        | ours (gateway /metrics; scheduler --metrics-port)            | vLLM                          |
| ------------- | ------------------------------------------------------------ | ----------------------------- |
| preemptions   | superinfer:num_preemptions_total                             | vllm:num_preemptions_total    |
| recomputes    | superinfer:num_recomputes_total                              | —                             |
| rotations out | superinfer:rotations_total{direction="out"}                  | —                             |
| swapped in    | superinfer:kv_blocks_moved_total{kind="swap_in"}             | —                             |
| stall ratio   | superinfer:pipeline_stalls_total / step_time_seconds_count   | —                             |
|               | {phase="compute"}, both on the scheduler's endpoint only     |                               |

A counter no endpoint exposes is None in the JSON and "n/a" in the table. Samples of one
name are summed over their other labels (vLLM's engine label); across endpoints the largest
counts (the gateway sums every scheduler's, a scheduler's endpoint has its own).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request

from dataclasses import asdict

from prometheus_client.parser import text_string_to_metric_families

from bench.report.metrics import format_summary, summarize

# Our gateway's figures are the schedulers' last load report, sent after a step at most
# every 50 ms and at least every second: read the "after" side once it has caught up.
SETTLE_S = 1.5

# counter -> its (sample name, labels it must carry) on each kind of server, first found wins
COUNTERS: dict[str, tuple[tuple[str, dict[str, str]], ...]] = {
    "preemptions": (("vllm:num_preemptions_total", {}), ("superinfer:num_preemptions_total", {})),
    "recomputes": (("superinfer:num_recomputes_total", {}),),
    "rotations_out": (("superinfer:rotations_total", {"direction": "out"}),),
    "blocks_swapped_in": (("superinfer:kv_blocks_moved_total", {"kind": "swap_in"}),),
    "stalls": (("superinfer:pipeline_stalls_total", {}),),
    "steps": (("superinfer:step_time_seconds_count", {"phase": "compute"}),),
}


def float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive numbers")
    return values


def parse_metrics(text: str) -> tuple[str, str]:
    """`NAME=URL`: one more Prometheus endpoint of target NAME."""
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or not url.strip().startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=URL, URL http(s)://...")
    return name.strip(), url.strip()


def add_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--rates", type=float_list, default=None, metavar="R1,R2,...",
        help="run the ShareGPT trace at each of these rates (req/s) instead of --rate: one row per target and "
        "run, with each server's preemption counters read from its /metrics around every run",
    )  # fmt: skip
    g.add_argument(
        "--metrics", type=parse_metrics, action="append", default=[], metavar="NAME=URL",
        help="with --rates: another Prometheus endpoint of target NAME, read beside its URL/metrics "
        "(ours: the scheduler's `--metrics-port`, which adds the stall ratio); repeatable",
    )  # fmt: skip
    g.add_argument(
        "--restart-per-run", action="store_true",
        help="with --rates: a target with a start command is started afresh for every run, so no run "
        "inherits a cache or a counter from the one before (default: started once per target)",
    )  # fmt: skip


def runs_of(args) -> list[tuple[float, float]]:
    """(rate, burstiness) of every run: each rate at each burstiness, in the order given."""
    return [(rate, b) for b in args.burstiness for rate in args.rates]


# ---------------------------------------------------------------- counters


def scrape(urls: list[str]) -> dict[str, float | None]:
    """Every counter of COUNTERS as the endpoints expose it now (None: no endpoint has it;
    an endpoint that does not answer adds nothing)."""
    samples: dict[str, list[tuple[dict, float]]] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                families = list(text_string_to_metric_families(resp.read().decode()))
        except (OSError, ValueError):  # no answer, or not Prometheus text
            continue
        for family in families:
            for s in family.samples:
                samples.setdefault(s.name, []).append((url, s.labels, s.value))
    out: dict[str, float | None] = {}
    for key, choices in COUNTERS.items():
        out[key] = None
        for name, want in choices:
            per_url: dict[str, float] = {}
            for url, labels, v in samples.get(name, []):
                if want.items() <= labels.items():
                    per_url[url] = per_url.get(url, 0.0) + v
            if per_url:
                # The gateway sums every scheduler's count; a scheduler's endpoint has its
                # own: the largest is the whole, not their sum.
                out[key] = max(per_url.values())
                break
    return out


def counted(before: dict, after: dict) -> dict:
    """What each counter added during the run: None where the "after" side lacks it, all of
    it where only the "before" side does (a labelled sample appears when first counted).
    The stall ratio is stalled steps over steps computed."""
    diff = {k: None if after[k] is None else after[k] - (before[k] or 0) for k in COUNTERS}
    stalls, steps = diff.pop("stalls"), diff.pop("steps")
    diff = {k: None if v is None else round(v) for k, v in diff.items()}
    diff["stall_ratio"] = stalls / steps if stalls is not None and steps else None
    return diff


def run(name: str, base_url: str, rate: float, burstiness: float, replay, args) -> dict:
    """One run: `replay()` -> (records, duration_s), the target's counters read around it."""
    print(f"{name}: ShareGPT at {rate:g} req/s, burstiness {burstiness:g}", file=sys.stderr)
    urls = [base_url + "/metrics", *(url for n, url in args.metrics if n == name)]
    before = scrape(urls)
    records, duration_s = replay()
    time.sleep(SETTLE_S)
    counters = counted(before, scrape(urls))
    summary = summarize(records, args.ttft_slo, args.tbt_slo, duration_s)
    print(format_summary(summary), file=sys.stderr)
    print(f"{name}: counted {counters}", file=sys.stderr)
    return {"rate": rate, "burstiness": burstiness, **summary, "counters": counters,
            "requests": [asdict(r) for r in records]}  # fmt: skip


# ---------------------------------------------------------------- the table

COLUMNS = (  # header, key of a run's result (None: the whole run), kind: compare.cell's or "count"
    ("TTFT ≤ {ttft} s", "ttft_attainment", "pct"),
    ("TBT gaps ≤ {tbt} ms", "tbt_attainment", "pct"),
    ("requests meeting TBT on every gap", "tbt_request_attainment", "pct"),
    ("output tok/s", "output_tok_s", "rate"),
    ("TTFT p50 (s)", "ttft_p50_ms", "ms_as_s"),
    ("e2e p50 (s)", "e2e_p50_ms", "ms_as_s"),
    ("preemptions", "preemptions", "count"),
    ("recomputes", "recomputes", "count"),
    ("rotations out", "rotations_out", "count"),
    ("blocks swapped in", "blocks_swapped_in", "count"),
    ("stall ratio", "stall_ratio", "count"),
    ("completed / failed", None, "counts"),
)


def run_label(rate: float, burstiness: float) -> str:
    return f"{rate:g}" + (f", bursty {burstiness:g}" if burstiness != 1 else "")


def markdown(body: dict, cell) -> str:
    """One row per run and target: runs as `runs_of` orders them, targets as given."""
    cfg, targets = body["config"], body["targets"]
    slo = {"ttft": f"{cfg['ttft_slo']:g}", "tbt": f"{cfg['tbt_slo'] * 1000:g}"}
    header = ["rate (req/s)", "server", *(h.format(**slo) for h, _, _ in COLUMNS)]
    lines = [
        f"ShareGPT, {cfg['num_requests']} requests, seed {cfg['seed']}; counters read from each server's /metrics",
        "",
        "| " + " | ".join(header) + " |",
        "| --- | --- |" + " ---: |" * len(COLUMNS),
    ]
    for i, (rate, burstiness) in enumerate(runs_of(argparse.Namespace(**cfg))):
        for t in targets:
            done = t.get("runs", [])
            run = done[i] if i < len(done) else None  # None: the target failed before this run
            cells = [run_cell(run, key, kind, cell) for _, key, kind in COLUMNS]
            lines.append("| " + " | ".join([run_label(rate, burstiness), t["name"], *cells]) + " |")
    return "\n".join(lines)


def run_cell(run: dict | None, key: str | None, kind: str, cell) -> str:
    if run is None:
        return "—"
    if key is None:
        return cell(run, kind)
    if kind != "count":
        return cell(run[key], kind)
    v = run["counters"][key]
    if v is None:
        return "n/a"
    return f"{100 * v:.1f}%" if key == "stall_ratio" else f"{v:,}"
