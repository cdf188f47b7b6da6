"""`superinfer bench reproduce` (or `python -m bench.sim.reproduce`): regenerate
bench/REPRODUCTION.md — the paper's experiments next to ours, from simulator runs of the
scheduler core that serves, plus the cost model's transfer table.

Every number in the Markdown comes from this run, except the last section's: the simulator
against the live server, read from the runs `superinfer bench simlive` recorded in
bench/results/simlive_runs.jsonl. The rows and one CSV per figure go to bench/results/, the
plots to bench/figures/ (beside the Markdown, which shows them). The whole reproduction
takes about 17 minutes on two idle cores (its jobs in one pool, repro_ctx.py). The Markdown is
rendered from the rows file (reproduction.json, which records the setting too) and those
runs alone: `--from-rows` re-renders it without running anything.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.report import plots, reproduction
from bench.report.rows import SYSTEMS, name
from bench.sim import engine, sweep, tier
from bench.sim.costmodel import GB, MODES, ideal_time, transfer_time
from bench.sim.repro_ctx import CHAT, HERE, LMSYS, Ctx, add_arguments, reuse_rows
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE

VLLM_BXFER = 300  # the paper's B_xfer on vLLM's swap path (Fig. 17)
LVFS = ("lvf-paper", "lvf")  # the paper's LVF (no guard of ours) and ours (our defaults)
CONV_RATES = (2, 4, 6, 8)  # conversations/s
LMSYS_RATES = (4, 8, 12)
# The guards of ours that the ablation adds one at a time to lvf-paper (their lvf defaults), and
# the two that work with any policy, which it also gives vllm-v1 (fcfs) and wf.
GUARDS = {"admit_watermark": 0.25, "min_residency_s": 16.0, "rotary_yields": True, "slo_chunking": True}
GUARDS_OFF = {"admit_watermark": 0.0, "min_residency_s": 0.0, "rotary_yields": False, "slo_chunking": False}
AGNOSTIC = ("admit_watermark", "slo_chunking")
# Sensitivity (Figs. 18-21) on the conversations at CONV_KNOB_RATE. (At 200 conversations a seed
# and the calibrated speed the KV-cache does not fill; 700 at 4 and 8/s do, at ~3x the time.)
CONV_KNOB_RATE = 6
# The per-step calibration's own runs: both LVFs on 1000 ShareGPT requests at rates where the
# batch grows to the paper's per-step model time.
CALIBRATION_RATES = (12, 16)
# Each figure's workload, for `--rerun` (the others: conversations).
FIGURE_WORKLOADS = {"fig16": "sharegpt", "ablation": "sharegpt", "fig16_lmsys": "lmsys", "calibration": "calibration"}
KNOB_SWEEPS = {
    "alpha": (1.0, 3.0, 10.0),
    "beta_f": (0.0, 0.5, 1.0),
    "beta_b": (0.0, 1.0, 2.0),
    "xfer_budget": (96, 600, 2400),
}


# ---------------------------------------------------------------- experiments


def mode_of(policy: str, baseline_mode: str = "duplex") -> str:
    return "duplex" if policy in LVFS else baseline_mode


def fig16(ctx: Ctx, workload: str = "sharegpt", rates=None) -> list[dict]:
    """Fig. 16's policies (both LVFs and every baseline) on `workload`: the paper's ShareGPT
    single turns, LMSYS-Chat-1M's length mix (`lmsys`), or the conversations (prefix caching on
    for all, vLLM V1's default; then sf and wf once more on vLLM's swap path at the top rate)."""
    conv = workload == "conversations"
    rates = rates or (CONV_RATES if conv else LMSYS_RATES if workload == "lmsys" else ctx.args.rates)
    jobs = [sweep.Job(r, ctx.setup(p, enable_prefix_caching=conv)) for p in SYSTEMS for r in rates]
    if conv:
        jobs += [sweep.Job(rates[-1], ctx.setup(p, "vllm", enable_prefix_caching=True)) for p in ("sf", "wf")]
    return ctx.run(jobs, workload)


def ablation_setups(ctx: Ctx, conv: bool) -> list[tuple[str, engine.SimSetup]]:
    """(label, setup): lvf-paper, lvf-paper plus each guard alone (lvf with the other three off),
    lvf; vllm-v1 and wf bare and with each policy-agnostic guard."""
    pc = {"enable_prefix_caching": conv}
    out = [("lvf-paper", ctx.setup("lvf-paper", **pc))]
    out += [(f"lvf-paper + {g}", ctx.setup("lvf", **{**GUARDS_OFF, g: GUARDS[g]}, **pc)) for g in GUARDS]
    out += [("lvf (all four)", ctx.setup("lvf", **pc))]
    for p in ("fcfs", "wf"):
        out += [(name(p), ctx.setup(p, **pc))]
        out += [(f"{name(p)} + {g}", ctx.setup(p, **{g: GUARDS[g]}, **pc)) for g in AGNOSTIC]
    return out


def ablation(ctx: Ctx, workload: str, rate: float) -> list[dict]:
    """The guard ablation at one rate: each row labelled (`variant`)."""
    labelled = ablation_setups(ctx, workload == "conversations")
    rows = ctx.run([sweep.Job(rate, s) for _, s in labelled], workload)
    return [{**r, "variant": label} for (label, _), r in zip(labelled, rows)]


def fig1(ctx: Ctx, rate: float, out: Path) -> dict:
    """WF and SF on vLLM's swap path, and vLLM V1's FCFS, on the conversations."""
    policies = ("wf", "sf", "fcfs")
    setups = [ctx.setup(p, "duplex" if p == "fcfs" else "vllm", enable_prefix_caching=True) for p in policies]
    recs = dict(zip(policies, ctx.records(setups, rate)))
    plots.plot_policy_cdfs(recs, out / "fig1_wf_vs_sf_cdf.png")
    return recs


def fig17(ctx: Ctx, rate: float) -> list[dict]:
    """Both LVFs on vLLM's swap path with the paper's B_xfer and with a large one, and on
    DuplexKV, on the conversations (where they rotate)."""
    large = ctx.hw.defaults["xfer_budget"]
    variants = [("vllm", VLLM_BXFER), ("vllm", large), ("duplex", large)]
    jobs = [
        sweep.Job(rate, ctx.setup(p, mode, xfer_budget=b, enable_prefix_caching=True))
        for p in LVFS
        for mode, b in variants
    ]
    return ctx.run(jobs, "conversations")


def knob_sweeps(ctx: Ctx, rate: float) -> dict[str, list[dict]]:
    """Figs. 18-21: each knob swept for both LVFs on the conversations (where they rotate)."""
    return {
        k: ctx.run(
            [sweep.Job(rate, ctx.setup(p, enable_prefix_caching=True, **{k: v})) for p in LVFS for v in vals],
            "conversations",
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


# ---------------------------------------------------------------- command


def experiments(ctx: Ctx, figures: Path | None) -> dict:
    """Every figure's rows (Fig. 1's plot to `figures`, when given)."""
    top, conv_top = max(ctx.args.rates), max(CONV_RATES)
    res: dict = {"fig16": fig16(ctx), "fig16_lmsys": fig16(ctx, "lmsys"), "fig16_conv": fig16(ctx, "conversations")}
    res["calibration"] = ctx.run([sweep.Job(r, ctx.setup(p)) for p in LVFS for r in CALIBRATION_RATES], "calibration")
    res["ablation"] = ablation(ctx, "sharegpt", top)
    res["ablation_conv"] = ablation(ctx, "conversations", conv_top)
    res["tier"] = tier.compare(ctx, CONV_RATES, hbm_share=None)
    if figures is not None:
        fig1(ctx, conv_top, figures)
    res["fig17"] = fig17(ctx, conv_top)
    res["knobs"] = knob_sweeps(ctx, CONV_KNOB_RATE)
    res["table1"] = table1(ctx)
    return res


def run(args: argparse.Namespace) -> int:
    if args.from_rows:
        args.out.write_text(reproduction.render_results(args.results))
        return 0
    t0 = time.perf_counter()
    ctx = Ctx(args)
    out, figures = args.results, args.out.parent / reproduction.FIGURES
    before = json.loads((out / reproduction.ROWS_FILE).read_text()) if args.rerun else None
    if before:
        reuse_rows(ctx, before, set(args.rerun), FIGURE_WORKLOADS)
    out.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    ctx.planning = True  # collect every figure's jobs, run them in one pool, then build the figures
    experiments(ctx, None)
    ctx.execute()
    res = experiments(ctx, figures)
    record = write_results(res, out, figures)
    record["setting"] = setting_record(ctx, time.perf_counter() - t0)
    if before:  # the whole run's figures stay the first run's; the rerun is told apart
        st = before["setting"]
        rerun = {"policies": args.rerun, "seconds": record["setting"]["seconds"], "num_runs": ctx.num_runs}
        rerun["cpu_seconds"] = record["setting"]["cpu_seconds"]
        for k in ("seconds", "cpu_seconds", "num_runs", "jobs"):
            record["setting"][k] = st.get(k)
        record["setting"]["rerun"] = rerun
    (out / reproduction.ROWS_FILE).write_text(json.dumps(record, indent=1))
    args.out.write_text(reproduction.render_results(out))
    print(f"wrote {args.out}, {figures}/ and {out}/ in {time.perf_counter() - t0:.0f} s ({ctx.num_runs} runs)", file=sys.stderr)
    return 0


def cpu_seconds() -> float:
    """CPU time of this process and its finished workers (user + system)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def setting_record(ctx: Ctx, seconds: float) -> dict:
    """What the reproduction ran, as REPRODUCTION.md's setting paragraph tells it (the rows
    file keeps it, so the document is rendered from that file alone)."""
    hw, m, items, setup = ctx.hw, ctx.model, ctx.items, ctx.setup("lvf")
    long = sweep.load_items("sharegpt-long", len(items), ctx.args.seed)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds(),
        "jobs": ctx.args.jobs,
        "num_runs": ctx.num_runs,
        "rates": list(ctx.args.rates),
        "seed": ctx.args.seed,
        "seeds": ctx.seeds,
        "max_tokens": ctx.args.max_tokens,
        "predictor_noise": setup.predictor_noise,
        "model": {
            "name": m.name,
            "params_b": m.num_params / 1e9,
            "block_mib": m.kv_block_bytes(setup.cfg.block_size, hw.dtype_bytes) / (1 << 20),
        },
        "hardware": {
            "name": hw.name,
            "tflops": hw.flops / 1e12,
            "compute_efficiency": hw.compute_efficiency,
            "hbm_tbs": hw.hbm_bw / 1e12,
            "hbm_efficiency": hw.hbm_efficiency,
            "step_overhead_ms": hw.step_overhead_s * 1e3,
            "hbm_gb": hw.hbm_bytes / GB,
            "mem_utilization": hw.mem_utilization,
            "dram_fraction": hw.dram_fraction,
            "kv_dram_gb": None if hw.kv_dram_bytes is None else hw.kv_dram_bytes / GB,
            "host_gb": hw.host_bytes / GB,
            "link_gbs": hw.link.curve[-1][1],
            "link_gbs_64k": hw.link.rate(65536) / GB,
            "dram_gbs": hw.link.dram_gbs,
            "duplex_efficiency": hw.link.duplex_efficiency,
            "sched_ms": hw.sched_s * 1e3,
        },
        "num_hbm_blocks": setup.num_hbm_blocks,
        "num_dram_blocks": setup.num_dram_blocks,
        "sched_time": setup.sched_time,
        "conversations": conversation_record(ctx.conversations()[ctx.args.seed]),
        "lmsys": {
            "mean_prompt_tokens": sum(i.prompt_tokens for i in ctx.lmsys()[ctx.args.seed]) / ctx.args.num_requests,
            "mean_output_tokens": sum(i.output_tokens for i in ctx.lmsys()[ctx.args.seed]) / ctx.args.num_requests,
            "spec": asdict(LMSYS),
        },
        "knob_rate": CONV_KNOB_RATE,
        "workload": {
            "num_requests": len(items),
            "mean_prompt_tokens": sum(i.prompt_tokens for i in items) / len(items),
            "mean_output_tokens": sum(i.output_tokens for i in items) / len(items),
            # the same seed's sample at the pairs' real lengths (the workload not chosen; discussion.py)
            "long_mean_prompt_tokens": sum(i.prompt_tokens for i in long) / len(long),
            "long_mean_output_tokens": sum(i.output_tokens for i in long) / len(long),
        },
        "scheduler": asdict(setup.cfg),
    }


def conversation_record(items: list) -> dict:
    """The conversations' shape, as the setting paragraph tells it."""
    last = {it.conversation: it for it in items}.values()  # each conversation's last turn
    return {
        "num_conversations": len(last),
        "num_turns": len(items),
        "rates": list(CONV_RATES),
        "think_s": CHAT.think_s,
        "mean_prompt_tokens": sum(i.prompt_tokens for i in items) / len(items),
        "mean_output_tokens": sum(i.output_tokens for i in items) / len(items),
        "mean_context_tokens": sum(i.prompt_tokens + i.output_tokens for i in last) / len(last),
        "max_context_tokens": max(i.prompt_tokens + i.output_tokens for i in last),
    }


def write_results(res: dict, out: Path, figures: Path) -> dict[str, list[dict]]:
    """One CSV per figure to `out`, the plots to `figures`; returns the rows by figure, as the
    rows file keeps them."""
    figs = {k: v for k, v in res.items() if k.startswith(("fig", "ablation", "tier", "calibration")) or k == "table1"}
    figs.update({f"fig_{k}": v for k, v in res["knobs"].items()})
    for key, rows in figs.items():  # rows of a --rerun may have fields the reused ones lack: one header for all
        columns = list(dict.fromkeys(k for r in rows for k in r))
        sweep.write_outputs([{k: r.get(k) for k in columns} for r in rows], None, out / f"{key}.csv", {})
    plots.plot_attainment(res["fig16"], figures, "Qwen2.5-32B on gh200 (calibrated), ShareGPT", "fig16")
    plots.plot_attainment(res["fig16_conv"], figures, "Qwen2.5-32B on gh200 (calibrated), conversations", "fig16_conv")
    plots.plot_attainment(res["fig17"], figures, "ablation", "fig17")
    for k, rows in res["knobs"].items():
        plots.plot_sweep(rows, k, figures / f"fig_{k}.png", f"{k} sweep (conversations)", by="policy")
    return figs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.sim.reproduce", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
