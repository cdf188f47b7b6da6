"""Loaded comparison of the scheduling policies on the live server (this machine, CPU).

For each policy: start `superinfer serve` with a small HBM pool and a step trace, replay
the same ShareGPT workload at a rate that overloads the pool, and report TTFT/TBT SLO
attainment from the client's view plus the pipeline stall ratio from the step trace
(steps that stalled / steps).

    superinfer bench policies --json bench/results/policies_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.live import serve as serve_bench
from bench.live.server import start_server
from bench.live.workload import arrival_times, with_arrivals
from bench.report.metrics import summarize
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default="lvf,fcfs,sf,wf")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=2.0, help="requests/s (default %(default)s)")
    p.add_argument("--max-output", type=int, default=48, help="clip ShareGPT outputs to this many tokens")
    p.add_argument("--hbm-blocks", type=int, default=64, help="HBM pool of the server, 16-token blocks")
    p.add_argument("--ttft-slo", type=float, default=3.0, help="S_F in seconds, scaled to a CPU")
    p.add_argument("--tbt-slo", type=float, default=0.5, help="S_B in seconds, scaled to a CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)


def stall_ratio(trace: Path) -> dict:
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    stalled = sum(r["stalled"] for r in rows)
    return {
        "steps": len(rows),
        "stalled_steps": stalled,
        "stall_ratio": stalled / len(rows) if rows else None,
        "schedule_ms_median": _median_ms(r["schedule_s"] for r in rows),
        "compute_ms_median": _median_ms(r["compute_s"] for r in rows),
        "transfer_ms_median": _median_ms(r["transfer_s"] for r in rows if r["transfer_s"] > 0),
    }


def _median_ms(values) -> float | None:
    v = sorted(values)
    return 1000 * v[len(v) // 2] if v else None


def run_policy(policy: str, items, args, log_dir: Path) -> dict:
    trace = log_dir / f"trace-{policy}.jsonl"
    server = start_server(
        log_dir,
        "--policy", policy,
        "--hbm-blocks", str(args.hbm_blocks),
        "--ttft-slo", str(args.ttft_slo),
        "--tbt-slo", str(args.tbt_slo),
        "--step-trace", str(trace),
    )  # fmt: skip
    try:
        client_args = serve_args(args, server.base_url)
        records, duration_s = asyncio.run(serve_bench.replay(server.base_url, server.model, items, client_args))
        stats = server.scheduler_stats()
    finally:
        server.stop()
    summary = summarize(records, args.ttft_slo, args.tbt_slo, duration_s)
    return {
        "policy": policy,
        **{k: v for k, v in summary.items() if not isinstance(v, (list, dict))},
        **stall_ratio(trace),
        "preemptions": stats["num_preemptions"],
        "recomputes": stats["num_recomputes"],
        "rotations_out": stats["num_rotations_out"],
        "blocks_swapped_out": stats["num_blocks_swapped_out"],
        "blocks_mirrored": stats["num_blocks_mirrored"],
    }


def serve_args(args, base_url: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_bench.add_arguments(p)
    return p.parse_args(["--base-url", base_url, "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)])


def run(args: argparse.Namespace) -> int:
    load_args = serve_args(args, "")
    load_args.dataset, load_args.num_requests, load_args.rate, load_args.seed = (
        "sharegpt", 4 * args.num_requests, args.rate, args.seed
    )
    # Keep requests that fit a quarter of the pool, so several compete for it at once.
    limit = args.hbm_blocks * BLOCK_SIZE // 4
    items = [
        replace(i, output_tokens=min(i.output_tokens, args.max_output))
        for i in serve_bench.workload_from_args(load_args)
        if i.prompt_tokens + min(i.output_tokens, args.max_output) <= limit
    ][: args.num_requests]
    # Arrivals of the kept requests at the requested rate.
    items = with_arrivals(items, arrival_times(len(items), args.rate, seed=args.seed))
    print(serve_bench.describe_workload(items, "sharegpt"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="superinfer-policies-") as tmp:
        for policy in args.policies.split(","):
            rows.append(run_policy(policy, items, args, Path(tmp)))
            print(format_row(rows[-1]), flush=True)
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }
    print(format_table(rows, args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def format_row(r: dict) -> str:
    return (
        f"{r['policy']:>5}  TTFT att {100 * (r['ttft_attainment'] or 0):5.1f}%  "
        f"TBT att {100 * (r['tbt_attainment'] or 0):5.1f}%  TTFT p50 {r['ttft_p50_ms']:7.0f} ms  "
        f"TBT p50 {r['tbt_p50_ms']:5.0f} ms  stall {100 * (r['stall_ratio'] or 0):4.2f}%  "
        f"rot-out {r['rotations_out']:3d}  recompute {r['recomputes']:3d}  failed {r['failed']}"
    )


def format_table(rows: list[dict], args) -> str:
    head = (
        f"policies on the live CPU server: {args.num_requests} ShareGPT requests at {args.rate}/s, "
        f"outputs ≤ {args.max_output} tokens, HBM {args.hbm_blocks} blocks, "
        f"SLOs TTFT {args.ttft_slo} s / TBT {args.tbt_slo} s"
    )
    return "\n".join([head, *(format_row(r) for r in rows)])
