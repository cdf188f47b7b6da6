"""`superinfer bench sim`: simulated runs over rates and knobs, one result row each.

Each run is `engine.simulate` (the scheduler core driven by the service's step driver on a
virtual clock, with a cost-model worker); a row holds the knobs, the SLO metrics as `bench
serve` computes them (`bench.report.metrics.summarize`) and what the scheduler and the
worker did. Runs go to a process pool with `--jobs`.
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.live.workload import (
    ChatSpec,
    SyntheticSpec,
    WorkItem,
    add_chat_arguments,
    chat_spec,
    draw_arrivals,
    first_turns,
    load_workload,
)
from bench.report.metrics import summarize
from bench.report.plots import KNOBS, plot_attainment
from bench.sim.costmodel import MODELS, Hardware, ModelShape, check_pair, load_hardware
from bench.sim.engine import SimRun, SimSetup, make_setup, simulate
from services.scheduler.core import POLICIES, SchedulerConfig
from shared.config import PIPELINE_DEPTHS

# Row keys that depend on this machine's clocks, not on the simulation.
WALL_KEYS = ("wall_s", "cpu_s", "sched_wall_ms_p50", "sched_wall_ms_p99")


def row_of(
    run: SimRun, setup: SimSetup, rate: float, ttft_slo: float, tbt_slo: float, wall_s: float, cpu_s: float = 0.0
) -> dict:
    """One result row: the knobs, the SLO metrics (as `bench serve` reports them) and what
    the scheduler and the worker did."""
    s = summarize(run.records, ttft_slo, tbt_slo, run.duration_s)
    cfg, st = setup.cfg, run.stats
    total_s = sum(run.step_ms) / 1e3
    keep = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p90_ms", "tbt_p99_ms", "e2e_p50_ms")
    return {
        "policy": "neo" if setup.neo_host_blocks else cfg.policy,
        "rate": rate,
        **{k: getattr(cfg, k) for k in KNOBS if k != "transfer_mode"},
        "transfer_mode": setup.transfer_mode,
        **{k: getattr(cfg, k) for k in ("reserve_full_prompt", "min_residency_s", "admit_watermark", "rotary_yields", "slo_chunking")},
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "cached_token_share": s["cached_token_share"],
        "max_tokens": setup.max_tokens,
        "model": setup.model.name,
        "hardware": setup.hardware.name,
        "num_requests": s["num_requests"],
        "completed": s["completed"],
        "ttft_attainment": s["ttft_attainment"],
        "tbt_attainment": s["tbt_attainment"],
        "tbt_request_attainment": s["tbt_request_attainment"],
        "slo_attainment": s["slo_attainment"],
        "throughput_tok_s": s["output_tok_s"],
        "goodput_rps": s["goodput_rps"],
        **{k: s[k] for k in keep},
        **{k: st[k] for k in ("num_preemptions", "num_recomputes", "num_rotations_out", "num_rotations_in")},
        **{k: st[k] for k in ("num_blocks_swapped_in", "num_blocks_swapped_out", "num_blocks_mirrored", "num_steps")},
        **{k: st[k] for k in ("num_blocks_reused_at_swap_in", "num_dram_blocks_shared")},
        "kv_offloading_size": cfg.kv_offloading_size,
        **{k: st.get(k, 0) for k in ("num_tier_hits", "num_tier_queries", "num_tier_blocks_loaded", "num_blocks_offloaded")},
        "num_hbm_blocks": setup.num_hbm_blocks,
        "num_dram_blocks": setup.num_dram_blocks,
        "neo_host_blocks": setup.neo_host_blocks,
        "duration_s": run.duration_s,
        "step_ms_mean": _mean(run.step_ms),
        "compute_ms_mean": _mean(run.compute_ms),
        "xfer_ms_mean": _mean(run.xfer_ms),
        "stall_share": run.stall_s / total_s if total_s else 0.0,
        "wall_s": wall_s,
        "cpu_s": cpu_s,  # the run's own CPU time (its process's, user + system)
        "sched_wall_ms_p50": _pct(run.sched_wall_ms, 50),
        "sched_wall_ms_p99": _pct(run.sched_wall_ms, 99),
    }


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def _pct(xs: list[float], p: int) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(p / 100 * len(ys)))]


def run_one(items: list[WorkItem], setup: SimSetup, rate: float, ttft_slo: float, tbt_slo: float) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    run = simulate(items, setup)
    return row_of(run, setup, rate, ttft_slo, tbt_slo, time.perf_counter() - t0, time.process_time() - c0)


# ---------------------------------------------------------------- sweeps


@dataclass(frozen=True)
class Job:
    rate: float
    setup: SimSetup
    seeds: int = 0  # `bench reproduce`: run on its first this many seeds only (0: all)


def sweep(
    items: list[WorkItem],
    jobs: list[Job],
    ttft_slo: float,
    tbt_slo: float,
    burstiness: float = 1.0,
    seed: int = 0,
    num_procs: int = 1,
    redraw: bool = True,
) -> list[dict]:
    """One row per job; the same requests at every rate, with that rate's arrivals (a trace
    that brings its own arrivals keeps them: pass `redraw=False`)."""
    return sweep_seeds({seed: items}, jobs, ttft_slo, tbt_slo, burstiness, num_procs, redraw)[0]


def sweep_seeds(
    items_by_seed: dict[int, list[WorkItem]],
    jobs: list[Job],
    ttft_slo: float,
    tbt_slo: float,
    burstiness: float = 1.0,
    num_procs: int = 1,
    redraw: bool = True,
) -> list[list[dict]]:
    """`sweep` once per seed (its requests, arrivals drawn with it), all in one pool: per
    seed, one row per job."""
    args = []
    for seed, items in items_by_seed.items():
        bare = [replace(it, prompt="") for it in items]  # the text is not simulated; keep pickles small
        for j in jobs:
            timed = draw_arrivals(bare, j.rate, burstiness, seed) if redraw else bare
            args.append((timed, j.setup, j.rate, ttft_slo, tbt_slo))
    if num_procs <= 1 or len(args) == 1:
        rows = [run_one(*a) for a in args]
    else:
        with ProcessPoolExecutor(num_procs) as pool:
            rows = list(pool.map(run_one, *zip(*args)))
    return [rows[i : i + len(jobs)] for i in range(0, len(rows), len(jobs))]


def load_items(
    dataset: str,
    num_requests: int,
    seed: int = 0,
    tokenizer_path: str | None = None,
    synthetic: SyntheticSpec | None = None,
    chat: ChatSpec | None = None,
    vllm_filter: bool = False,
) -> list[WorkItem]:
    """Requests with token counts from our tokenizer; arrivals are drawn per rate later.
    Single-turn `sharegpt` is sampled as the paper's harness samples it (no 2,048 cap, outputs
    up to 8,192 tokens, ignore_eos) unless `vllm_filter` keeps vLLM's `bench serve` filter."""
    if dataset == "sharegpt" and not vllm_filter and not (chat and chat.multi_turn):
        dataset = "sharegpt-artifact"
    return load_workload(
        dataset, num_requests, 1.0, _tokenizer(tokenizer_path), seed=seed, synthetic=synthetic, chat=chat
    )


@functools.cache
def _tokenizer(path: str | None):
    """Loaded once per process (reading a GGUF's vocabulary takes seconds; a reproduction
    loads items once per seed)."""
    from shared.modelfile import resolve_model_path
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(path))


# ---------------------------------------------------------------- command line


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _strs(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SchedulerConfig()  # the scheduler's defaults are the simulator's
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-32b")
    p.add_argument(
        "--hardware", default="gh200", help="profile name in bench/profiles (gh200, h200-pcie, cpu) or a JSON path"
    )
    p.add_argument(
        "--dataset",
        default="sharegpt",
        help="sharegpt (as the paper's harness samples it), sharegpt-long, synthetic, or a JSONL trace path",
    )
    p.add_argument(
        "--vllm-filter",
        action="store_true",
        help="sharegpt: vLLM's `bench serve` filter (prompt <= 1024, prompt + output <= 2048), for live comparisons",
    )
    p.add_argument("--num-requests", type=int, default=1000, help="requests per run (default %(default)s)")
    p.add_argument("--duration-s", type=float, default=None, help="instead of --num-requests: rate × this many")
    p.add_argument("--rates", type=_floats, default=[4, 8, 12, 16, 20], help="requests/s, comma-separated")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument(
        "--policies", type=_strs, default=list(POLICIES), help="the core's, and neo (vllm-v1 with NEO's CPU attention)"
    )
    p.add_argument("--ttft-slo", type=float, default=d.ttft_slo, help="S_F, seconds")
    p.add_argument("--tbt-slo", type=float, default=d.tbt_slo, help="S_B, seconds")
    p.add_argument("--alpha", type=_floats, default=[d.alpha], help="comma-separated values sweep")
    p.add_argument("--beta-f", type=_floats, default=[d.beta_f])
    p.add_argument("--beta-b", type=_floats, default=[d.beta_b])
    p.add_argument("--xfer-budget", type=_ints, default=None, help="B_xfer blocks (default: the profile's)")
    p.add_argument(
        "--min-residency", type=_floats, default=[d.min_residency_s], help="lvf: min_residency_s, seconds (sweep)"
    )
    p.add_argument(
        "--admit-watermark",
        type=_floats,
        default=[None],
        help="admit_watermark, HBM share, any policy (sweep; default: the policy's, 0.25 for lvf, 0 for the others)",
    )
    p.add_argument("--rotary-yields", action=argparse.BooleanOptionalAction, default=d.rotary_yields, help="lvf")
    p.add_argument(
        "--slo-chunking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lvf: cap prefill chunks to keep decodes within the TBT SLO (default: on for a GPU profile)",
    )
    p.add_argument(
        "--reserve-full-prompt",
        action=argparse.BooleanOptionalAction,
        default=d.reserve_full_prompt,
        help="admit only with HBM room for every known token",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="the clients' max_tokens cap; requests still end at their true length (default: ask the true length)",
    )
    p.add_argument(
        "--predictor-noise", type=float, default=1.0, help="ltr: log-normal sigma of the output-length predictor"
    )
    p.add_argument("--transfer-mode", type=_strs, default=["duplex"], help="naive, merged, batched, duplex, vllm (vLLM's swap path)")
    p.add_argument("--max-batched-tokens", type=int, default=None, help="default: the profile's")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the profile's")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--hbm-blocks", type=int, default=None, help="override the HBM pool size")
    p.add_argument("--dram-blocks", type=int, default=None, help="override the DRAM pool size")
    p.add_argument("--sched-time", default="model", help="model (the profile's), measured (schedule()'s CPU time), or milliseconds")
    p.add_argument(
        "--pipeline-depth",
        type=int,
        choices=PIPELINE_DEPTHS,
        default=None,
        help="plans in flight, as the live scheduler's --pipeline-depth (default: the live one for the device)",
    )
    p.add_argument("--check-invariants", action="store_true", help="check the core's invariants every step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="processes (at most the CPU count)")
    p.add_argument("--tokenizer", default=None, help="GGUF or model directory to count tokens with (default: bundled)")
    p.add_argument("--input-len", type=int, default=128, help="synthetic: mean prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="synthetic: mean output tokens")
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
        help="share full KV blocks by content",
    )  # fmt: skip
    add_chat_arguments(p)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--plots", type=Path, default=None, help="write attainment-vs-rate PNGs here")


def jobs_from_args(args: argparse.Namespace, hw: Hardware, model: ModelShape) -> list[Job]:
    d, base = hw.defaults, SchedulerConfig()  # the profile's defaults, then the scheduler's
    jobs = []
    knobs = itertools.product(
        args.policies,
        args.transfer_mode,
        args.xfer_budget or [d.get("xfer_budget", base.b_xfer)],
        args.alpha,
        args.beta_f,
        args.beta_b,
        args.min_residency,
        args.admit_watermark,
        args.rates,
    )
    for policy, mode, budget, alpha, beta_f, beta_b, residency, watermark, rate in knobs:
        cfg = SchedulerConfig(
            policy="fcfs" if policy == "neo" else policy,  # NEO offloads under vLLM V1's scheduling
            block_size=args.block_size,
            max_batched_tokens=args.max_batched_tokens or d.get("max_batched_tokens", base.max_batched_tokens),
            max_num_seqs=args.max_num_seqs or d.get("max_num_seqs", base.max_num_seqs),
            alpha=alpha,
            beta_f=beta_f,
            beta_b=beta_b,
            ttft_slo=args.ttft_slo,
            tbt_slo=args.tbt_slo,
            xfer_budget=budget,
            reserve_full_prompt=args.reserve_full_prompt,
            min_residency_s=residency,
            admit_watermark=watermark,
            rotary_yields=args.rotary_yields,
            slo_chunking=args.slo_chunking,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        jobs.append(
            Job(
                rate,
                make_setup(
                    hw,
                    model,
                    cfg,
                    mode,
                    args.hbm_blocks,
                    args.dram_blocks,
                    args.sched_time,
                    args.check_invariants,
                    args.pipeline_depth,
                    args.max_tokens,
                    args.predictor_noise,
                    neo=policy == "neo",
                ),
            )
        )
    return jobs


def run(args: argparse.Namespace) -> int:
    hw, model = load_hardware(args.hardware), MODELS[args.model]
    check_pair(hw, args.model)
    num = args.num_requests if args.duration_s is None else math.ceil(max(args.rates) * args.duration_s)
    spec = SyntheticSpec(args.input_len, args.output_len)
    items = load_items(args.dataset, num, args.seed, args.tokenizer, spec, chat_spec(args), args.vllm_filter)
    jobs = jobs_from_args(args, hw, model)
    timed = args.dataset not in ("sharegpt", "sharegpt-long", "synthetic") and trace_has_arrivals(Path(args.dataset))
    t0 = time.perf_counter()
    rows = []
    for rate in args.rates:  # with --duration-s, each rate sends rate × duration requests (or conversations)
        mine = [j for j in jobs if j.rate == rate]
        n = num if args.duration_s is None else math.ceil(rate * args.duration_s)
        mine_items = items[: first_turns(items, n)] if args.multi_turn else items[:n]
        rows += sweep(mine_items, mine, args.ttft_slo, args.tbt_slo, args.burstiness, args.seed, args.jobs, not timed)
    print(format_rows(rows))
    print(f"{len(rows)} runs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    write_outputs(
        rows,
        args.json,
        args.csv,
        {"args": {k: str(v) for k, v in vars(args).items()}, "setup": describe(jobs[0].setup)},
    )
    if args.plots:
        plot_attainment(rows, args.plots, f"{model.name} on {hw.name}")
    return 0


def trace_has_arrivals(path: Path) -> bool:
    """Whether a JSONL trace brings its own arrival times (then they are kept)."""
    with open(path) as f:
        first = next((line for line in f if line.strip()), "{}")
    return "arrival_s" in json.loads(first)


def describe(setup: SimSetup) -> dict:
    return {
        "hardware": setup.hardware.name,
        "max_tokens": setup.max_tokens,
        "model": setup.model.name,
        "num_hbm_blocks": setup.num_hbm_blocks,
        "num_dram_blocks": setup.num_dram_blocks,
        "scheduler": asdict(setup.cfg),
    }


def format_rows(rows: list[dict]) -> str:
    pct = lambda v: "  n/a" if v is None else f"{100 * v:5.1f}"  # noqa: E731
    lines = [f"policy  rate  {'knobs':<52} TTFT%  TBT%  tok/s   ttft p50 ms  tbt p99 ms  preempt  cached%"]
    for r in rows:
        knobs = (
            f"{r['transfer_mode']} B={r['xfer_budget']} a={r['alpha']:g} bF={r['beta_f']:g} bB={r['beta_b']:g} "
            f"mr={r['min_residency_s']:g} wm={r['admit_watermark']:g}"
        )
        lines.append(
            f"{r['policy']:<6} {r['rate']:5g}  {knobs:<52} {pct(r['ttft_attainment'])} {pct(r['tbt_attainment'])} "
            f"{r['throughput_tok_s'] or 0:7.0f} {r['ttft_p50_ms'] or 0:12.0f} {r['tbt_p99_ms'] or 0:11.0f} {r['num_preemptions']:8d}  {pct(r['cached_token_share'])}"
        )
    return "\n".join(lines)


def write_outputs(rows: list[dict], json_path: Path | None, csv_path: Path | None, meta: dict) -> None:
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    if csv_path and rows:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
