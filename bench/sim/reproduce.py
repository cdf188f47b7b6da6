"""`superinfer bench reproduce` (or `python -m bench.sim.reproduce`): regenerate
bench/REPRODUCTION.md and bench/figures/ — the paper's experiments in the authors' own regime
(their artifact, AE_AIO_0309_v1.py: its rates, 120-s Poisson traces, outputs at their own
lengths with ignore_eos, 16,384-token and 16,384-sequence budgets, 400 GB of DRAM for KV,
B_xfer 2400), simulated on the scheduler core that serves.

By default: Qwen2.5-32B on the calibrated gh200, ShareGPT and LMSYS, every Fig. 16 policy, 3
seeds, at the artifact's lowest and two highest rates; the equal-knob table (the policy-agnostic
knobs on for every policy) at the ShareGPT top rate on 3 seeds; the guard ablation, Fig. 1,
Fig. 17 and the knob sweeps (Figs. 18-21) at the ShareGPT top rate on the first seed. `--full`:
every rate, and Llama-3-8B and Mixtral-8x7B too. All runs go to one pool of processes
(repro_ctx.py). The rows the page cites are kept in git, compact (ROWS, beside the renderer);
one CSV per figure goes to bench/results/. `--from-rows` re-renders the page from ROWS alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.report import plots, reproduction, simlive
from bench.sim import engine, sweep
from bench.sim.costmodel import GB, MODELS, MODES, ideal_time, neo_applicable, transfer_time
from bench.sim import repro_ctx
from bench.sim.repro_ctx import ARTIFACT_RATES, DURATION_S, LMSYS, SLOS, Ctx
from services.scheduler.core import POLICIES
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE

# Fig. 16's systems: the authors' released scheduler (once registered), the paper's LVF as its text
# defines it, ours, and the baselines the paper compares with (vLLM V1 = fcfs).
FIG16 = (*(p for p in ("superinfer-artifact", "lvf-paper", "lvf") if p in POLICIES), "fcfs", "trtllm", "lightllm", "ltr", "neo")
MODELS_DEFAULT = ("qwen2.5-32b",)
MODELS_FULL = ("qwen2.5-32b", "llama3-8b", "mixtral-8x7b")
DATASETS = ("sharegpt", "lmsys")
FULL_ROWS = "reproduction_full.json"
RUNS_CACHE = "reproduction_runs.jsonl"  # each run's row as it completes, in --results (for --resume)  # every column of every row, in --results (for --rerun)
VLLM_BXFER = 300  # the paper's B_xfer on vLLM's swap path (Fig. 17)
# The policy-agnostic knobs (any policy may take them): all off, or all on, for every policy.
KNOBS_OFF = {"admit_watermark": 0.0, "slo_chunking": False}
KNOBS_ON = {"admit_watermark": 0.25, "slo_chunking": True}
# LVF's guards (lvf's defaults): the ablation takes each one alone from lvf-paper, and each one
# away from lvf (all on).
GUARDS = {"admit_watermark": 0.25, "min_residency_s": 16.0, "rotary_yields": True, "slo_chunking": True}
GUARDS_OFF = {"admit_watermark": 0.0, "min_residency_s": 0.0, "rotary_yields": False, "slo_chunking": False}
KNOB_SWEEPS = {
    "alpha": (1.0, 3.0, 10.0),
    "beta_f": (0.0, 0.5, 1.0),
    "beta_b": (0.0, 1.0, 2.0),
    "xfer_budget": (300, 600, 2400),
}


def rates_of(model: str, dataset: str, full: bool) -> tuple[float, ...]:
    """The artifact's rates: all with --full, else its lowest and two highest."""
    rs = ARTIFACT_RATES[(model, dataset)]
    return rs if full else (rs[0], *rs[-2:])


def systems(model: str) -> tuple[str, ...]:
    """Fig. 16's systems on `model` (NEO runs dense models only)."""
    return tuple(p for p in FIG16 if p != "neo" or neo_applicable(MODELS[model]))


# ---------------------------------------------------------------- experiments


def equal_setup(ctx: Ctx, policy: str, knobs: dict, model: str, **extra) -> engine.SimSetup:
    """`policy` with the policy-agnostic `knobs`. lvf-paper refuses any of them (config.py), so
    with them on it is lvf with LVF's own two guards off: the paper's rule plus the knobs."""
    m = MODELS[model]
    if policy == "lvf-paper" and knobs["slo_chunking"]:
        return ctx.setup("lvf", model=m, min_residency_s=0.0, rotary_yields=False, **knobs, **extra)
    return ctx.setup(policy, model=m, **knobs, **extra)


def labelled(ctx: Ctx, jobs: list[tuple[dict, sweep.Job]], wl: str) -> list[dict]:
    """Each job's row with its labels (policy, knobs, ...) on it."""
    rows = ctx.run([j for _, j in jobs], wl)
    return [{**r, "sim_policy": r.get("policy"), **lab} for (lab, _), r in zip(jobs, rows) if r is not None]


def reuse_rows(ctx: Ctx, full: dict, rerun: set[str]) -> None:
    """Seed `ctx` with the rows of the last run (`full`, FULL_ROWS) but for the policies in
    `rerun`: only their jobs run again."""
    figures = {k: v for k, v in full.items() if isinstance(v, list) and k != "table1"}
    figures.update({f"knobs/{k}": v for k, v in full.get("knobs", {}).items()})
    for fig, rows in figures.items():
        for r in rows:
            raw = r.get("sim_policy") or r["policy"]
            if raw in rerun or r["policy"] in rerun:
                continue
            key = repro_ctx.row_key(f"a-{r.get('dataset', 'sharegpt')}", {**r, "policy": raw})
            bare = {k: v for k, v in r.items() if k not in ("knobs", "dataset", "variant", "sim_policy")}
            ctx._rows[key if fig == "fig16" else key + "/1"] = {**bare, "policy": raw}


def fig16(ctx: Ctx, model: str, dataset: str, knobs: str, rates) -> list[dict]:
    """Fig. 16: every system at `rates` (the highest first), the policy-agnostic knobs all
    `knobs` (off/on)."""
    kv = KNOBS_ON if knobs == "on" else KNOBS_OFF
    jobs = [
        ({"policy": p, "knobs": knobs, "dataset": dataset, "model": MODELS[model].name}, sweep.Job(r, equal_setup(ctx, p, kv, model)))
        for r in sorted(rates, reverse=True)
        for p in systems(model)
    ]
    return labelled(ctx, jobs, f"a-{dataset}")


def ablation_setups(ctx: Ctx) -> list[tuple[str, engine.SimSetup]]:
    """(label, setup): LVF's guards one at a time onto lvf-paper, and leave-one-out from lvf
    (all four on)."""
    m = MODELS["qwen2.5-32b"]
    setups = [("lvf-paper (none)", ctx.setup("lvf-paper", model=m))]
    setups += [(f"lvf-paper + {g}", ctx.setup("lvf", model=m, **{**GUARDS_OFF, g: GUARDS[g]})) for g in GUARDS]
    setups += [(f"lvf − {g}", ctx.setup("lvf", model=m, **{**GUARDS, g: GUARDS_OFF[g]})) for g in GUARDS]
    return setups + [("lvf (all four)", ctx.setup("lvf", model=m, **GUARDS))]


def ablation(ctx: Ctx, rate: float) -> list[dict]:
    """The guard ablation at one rate, first seed."""
    jobs = [({"variant": v}, sweep.Job(rate, s, seeds=1)) for v, s in ablation_setups(ctx)]
    return labelled(ctx, jobs, "a-sharegpt")


def fig1(ctx: Ctx, rate: float) -> list[dict]:
    """WF and SF on vLLM's swap path, and vLLM V1's FCFS (recompute), first seed."""
    m = MODELS["qwen2.5-32b"]
    jobs = [({"variant": f"{p} (vLLM swap path)"}, sweep.Job(rate, ctx.setup(p, "vllm", model=m), seeds=1)) for p in ("wf", "sf")]
    jobs += [({"variant": "vllm-v1 (recompute)"}, sweep.Job(rate, ctx.setup("fcfs", model=m), seeds=1))]
    return labelled(ctx, jobs, "a-sharegpt")


def fig17(ctx: Ctx, rate: float) -> list[dict]:
    """Both LVFs on vLLM's swap path with B_xfer 300 and 2400, and on DuplexKV, first seed."""
    m, large = MODELS["qwen2.5-32b"], ctx.hw.defaults["xfer_budget"]
    variants = [("vllm", VLLM_BXFER), ("vllm", large), ("duplex", large)]
    jobs = [
        ({"variant": f"{p}, {mode}, B_xfer {b}"}, sweep.Job(rate, ctx.setup(p, mode, model=m, xfer_budget=b), seeds=1))
        for p in ("lvf-paper", "lvf")
        for mode, b in variants
    ]
    return labelled(ctx, jobs, "a-sharegpt")


def knob_sweeps(ctx: Ctx, rate: float) -> dict[str, list[dict]]:
    """Figs. 18-21: each knob swept for both LVFs, first seed."""
    m = MODELS["qwen2.5-32b"]
    return {
        k: labelled(
            ctx,
            [({"policy": p, k: v}, sweep.Job(rate, ctx.setup(p, model=m, **{k: v}), seeds=1)) for p in ("lvf-paper", "lvf") for v in vals],
            "a-sharegpt",
        )
        for k, vals in KNOB_SWEEPS.items()
    }


def table1(ctx: Ctx) -> list[dict]:
    """8 GB each way (16 GB moved) on gh200 with Qwen2.5-32B's 4 MiB blocks."""
    block = ctx.model.kv_block_bytes(BLOCK_SIZE, ctx.hw.dtype_bytes)
    n = int(8e9 // block)
    nbytes = n * block
    rows = []
    for mode in MODES:
        x = transfer_time(ctx.hw, ctx.model, mode, n, n, BLOCK_SIZE)
        rows.append({"mode": mode, "ms": x.total_s * 1e3, "gbs_total": 2 * nbytes / x.total_s / GB})
    rows.append({"mode": "ideal", "ms": ideal_time(ctx.hw, nbytes, nbytes) * 1e3, "gbs_total": ctx.hw.link.dram_gbs})
    return rows


def experiments(ctx: Ctx, full: bool) -> dict:
    models = MODELS_FULL if full else MODELS_DEFAULT
    res: dict = {"fig16": []}
    for model in models:
        for ds in DATASETS:
            res["fig16"] += fig16(ctx, model, ds, "off", rates_of(model, ds, full))
    top = ARTIFACT_RATES[("qwen2.5-32b", "sharegpt")][-1]
    res["fig16"] += fig16(ctx, "qwen2.5-32b", "sharegpt", "on", (top,))
    res["ablation"] = ablation(ctx, top)
    res["fig1"] = fig1(ctx, top)
    res["fig17"] = fig17(ctx, top)
    res["knobs"] = knob_sweeps(ctx, top)
    res["table1"] = table1(ctx)
    return res


# ---------------------------------------------------------------- command


def run(args: argparse.Namespace) -> int:
    if args.from_rows:  # the simulator-vs-live runs on record in --results, if any, replace the rows' own
        record = json.loads(args.rows.read_text())
        record["simlive"] = simlive.load_runs(args.results) or record.get("simlive", [])
        args.rows.write_text(json.dumps(record, indent=0, separators=(",", ":")) + "\n")
        args.out.write_text(reproduction.render(record))
        return 0
    t0 = time.perf_counter()
    ctx = Ctx(args)
    models = MODELS_FULL if args.full else MODELS_DEFAULT
    ctx.pool_rate = {f"a-{ds}": max(max(ARTIFACT_RATES[(m, ds)]) for m in models) for ds in DATASETS}
    ctx.load_cache(args.results / RUNS_CACHE, args.resume)
    if args.max_minutes:
        ctx.deadline = t0 + 60 * args.max_minutes
    before = json.loads((args.results / FULL_ROWS).read_text()) if args.rerun else None
    if before:
        reuse_rows(ctx, before, set(args.rerun))
    figures = args.out.parent / reproduction.FIGURES
    args.results.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    ctx.planning = True  # collect every figure's jobs, run them in one pool, then build the figures
    experiments(ctx, args.full)
    ctx.execute()
    res = experiments(ctx, args.full)
    res["setting"] = setting_record(ctx, args, time.perf_counter() - t0)
    if before:  # the whole run's time stays the first run's; the rerun is told apart
        rerun = {k: res["setting"][k] for k in ("seconds", "cpu_seconds", "runs_cpu_seconds", "num_runs")}
        res["setting"].update({k: before["setting"].get(k) for k in rerun}, rerun={"policies": args.rerun, **rerun})
    write_csvs(res, args.results)
    (args.results / FULL_ROWS).write_text(json.dumps(res))
    record = reproduction.compact(res)
    record["simlive"] = simlive.load_runs(args.results)
    args.rows.write_text(json.dumps(record, indent=0, separators=(",", ":")) + "\n")
    plots.reproduction_figures(record, figures)
    args.out.write_text(reproduction.render(record))
    took = time.perf_counter() - t0
    print(f"wrote {args.out}, {figures}/ and {args.rows} in {took:.0f} s ({ctx.num_runs} runs)", file=sys.stderr)
    return 0


def cpu_seconds(ctx: Ctx) -> float:
    """CPU time (user + system) of this process and of the runs its pool of workers did: each
    run reports its own (`cpu_s`). Not the workers' rusage: a pool shut down without waiting
    (the deadline) leaves them unreaped, and RUSAGE_CHILDREN counts only reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime + ctx.runs_cpu_s


def workload_record(items: list) -> dict:
    out = [i.output_tokens for i in items]
    return {
        "pool": len(items),
        "mean_prompt_tokens": sum(i.prompt_tokens for i in items) / len(items),
        "mean_output_tokens": sum(out) / len(items),
        "max_output_tokens": max(out),
        "max_total_tokens": max(i.prompt_tokens + i.output_tokens for i in items),
        "share_over_2048": sum(i.prompt_tokens + i.output_tokens > 2048 for i in items) / len(items),
    }


def setting_record(ctx: Ctx, args: argparse.Namespace, seconds: float) -> dict:
    """What the reproduction ran, as the page's setting section tells it."""
    hw, setup = ctx.hw, ctx.setup("lvf")
    models = MODELS_FULL if args.full else MODELS_DEFAULT
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds(ctx),
        "runs_cpu_seconds": ctx.runs_cpu_s,
        "jobs": args.jobs,
        "full": args.full,
        "num_runs": ctx.num_runs,
        "num_missing": ctx.num_missing,
        "max_minutes": args.max_minutes,
        "seeds": ctx.seeds,
        "duration_s": DURATION_S,
        "slos": list(SLOS),
        "rates": {f"{MODELS[m].name}/{ds}": list(rates_of(m, ds, args.full)) for m in models for ds in DATASETS},
        "artifact_rates": {f"{MODELS[m].name}/{ds}": list(ARTIFACT_RATES[(m, ds)]) for m in MODELS_FULL for ds in DATASETS},
        "systems": list(FIG16),
        "sharegpt": workload_record(ctx.items_for("a-sharegpt")[args.seed]),
        "lmsys": {**workload_record(ctx.items_for("a-lmsys")[args.seed]), "spec": asdict(LMSYS)},
        "hardware": {
            "name": hw.name,
            "tflops": hw.flops / 1e12,
            "compute_efficiency": hw.compute_efficiency,
            "hbm_tbs": hw.hbm_bw / 1e12,
            "hbm_efficiency": hw.hbm_efficiency,
            "step_overhead_ms": hw.step_overhead_s * 1e3,
            "hbm_gb": hw.hbm_bytes / GB,
            "kv_dram_gb": None if hw.kv_dram_bytes is None else hw.kv_dram_bytes / GB,
            "link_gbs": hw.link.curve[-1][1],
            "dram_gbs": hw.link.dram_gbs,
        },
        "num_hbm_blocks": {MODELS[m].name: ctx.setup("fcfs", model=MODELS[m]).num_hbm_blocks for m in models},
        "num_dram_blocks": setup.num_dram_blocks,
        "scheduler": {k: v for k, v in asdict(setup.cfg).items() if k in ("max_batched_tokens", "max_num_seqs", "xfer_budget", "block_size", "alpha", "beta_f", "beta_b")},
    }


def write_csvs(res: dict, out: Path) -> None:
    """One CSV per figure to `out` (bench/results/, not in git)."""
    figs = {k: v for k, v in res.items() if isinstance(v, list)}
    figs.update({f"fig_{k}": v for k, v in res["knobs"].items()})
    for key, rows in figs.items():
        columns = list(dict.fromkeys(k for r in rows for k in r))
        sweep.write_outputs([{k: r.get(k) for k in columns} for r in rows], None, out / f"{key}.csv", {})


def add_arguments(p: argparse.ArgumentParser) -> None:
    repro_ctx.add_arguments(p)
    p.add_argument("--full", action="store_true", help="every artifact rate, and Llama-3-8B and Mixtral-8x7B too")
    p.add_argument("--resume", action="store_true", help="reuse the runs an interrupted run completed (--results)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0,
        help="drop the runs still pending after this long and render what ran (the page says so); 0: no limit",
    )
    p.add_argument("--rows", type=Path, default=reproduction.ROWS, help="the compact rows the page renders from (in git)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.sim.reproduce", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
