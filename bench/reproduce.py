"""`superinfer bench reproduce` (or `python -m bench.reproduce`): regenerate
bench/REPRODUCTION.md — the paper's experiments next to ours, from simulator runs of the
scheduler core that serves, plus the cost model's transfer table.

Every number in the Markdown comes from this run, except the last section's: the simulator
against the live server, read from the runs `superinfer bench simlive` recorded in
bench/results/simlive_runs.jsonl. The rows, one CSV per figure and the PNGs go to
bench/results/. The whole reproduction takes a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench import sim
from bench.costmodel import GB, MODELS, MODES, ideal_time, load_hardware, transfer_time
from bench.report import RequestRecord
from services.scheduler.core import POLICIES, SchedulerConfig

HERE = Path(__file__).resolve().parent
RATES = (4, 8, 12, 16, 20)
PAPER_STEP = {"schedule_ms": 7.6, "transfer_ms": 15.8, "model_ms": 69.8, "stall_pct": 0.021}
PAPER_TABLE1 = {"naive": "~10 GB/s, 1556 ms", "duplex": "181+179 GB/s, 46.8 ms", "ideal": "41.7 ms"}
SMALL_BXFER = 96  # blocks naive copies move in about one step's compute (~40 ms at ~9.5 GB/s)
BXFER_SWEEP = (24, 96, 384, 1200, 2400, 4800)
BASELINES = tuple(p for p in POLICIES if p != "lvf")
PRESSURE = (0.5, 0.3)  # Fig. 16 again with the HBM pool cut to these shares of the profile's
KNOB_SWEEPS = {
    "alpha": (0.5, 1.0, 3.0, 5.0, 10.0),
    "beta_f": (0.0, 0.25, 0.5, 0.75, 1.0),
    "beta_b": (0.0, 0.25, 0.5, 1.0, 2.0),
}


class Ctx:
    """The shared setting: Qwen2.5-32B on gh200, ShareGPT, SLOs 5 s / 100 ms."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.hw = load_hardware("gh200")
        self.model = MODELS["qwen2.5-32b"]
        self.items = sim.load_items("sharegpt", args.num_requests, args.seed)
        self.num_runs = 0

    def setup(self, policy: str, mode: str = "duplex", hw=None, hbm: int | None = None, **knobs) -> sim.SimSetup:
        d = self.hw.defaults
        cfg = SchedulerConfig(
            policy=policy,
            max_batched_tokens=d["max_batched_tokens"],
            max_num_seqs=d["max_num_seqs"],
            xfer_budget=knobs.pop("xfer_budget", d["xfer_budget"]),
            ttft_slo=5.0,
            tbt_slo=0.1,
            **knobs,
        )
        return sim.make_setup(hw or self.hw, self.model, cfg, mode, hbm=hbm)

    def run(self, jobs: list[sim.Job], num_requests: int | None = None) -> list[dict]:
        items = self.items[: num_requests or len(self.items)]
        self.num_runs += len(jobs)
        return sim.sweep(items, jobs, 5.0, 0.1, seed=self.args.seed, num_procs=self.args.jobs)

    def records(self, setup: sim.SimSetup, rate: float) -> list[RequestRecord]:
        bare = [replace(it, prompt="") for it in self.items]
        items = sim.with_arrivals(bare, sim.arrival_times(len(bare), rate, 1.0, self.args.seed))
        self.num_runs += 1
        return sim.simulate(items, setup).records


# ---------------------------------------------------------------- experiments


def fig16(ctx: Ctx, hw=None, baseline_mode: str = "duplex", hbm: int | None = None) -> list[dict]:
    jobs = [
        sim.Job(r, ctx.setup(p, "duplex" if p == "lvf" else baseline_mode, hw, hbm))
        for p in POLICIES
        for r in ctx.args.rates
    ]
    return ctx.run(jobs)


def paper_speed(ctx: Ctx, rows16: list[dict]):
    """The gh200 profile slowed so that LVF's mean model time per step at the highest rate
    equals the paper's measured 69.8 ms (both efficiencies divided by one factor)."""
    top = max(ctx.args.rates)
    ours = next(r for r in rows16 if r["policy"] == "lvf" and r["rate"] == top)["compute_ms_mean"]
    over = ctx.hw.step_overhead_s * 1e3
    factor = max(1.0, (PAPER_STEP["model_ms"] - over) / max(ours - over, 1e-9))
    hw = replace(
        ctx.hw,
        name="gh200 (paper speed)",
        compute_efficiency=ctx.hw.compute_efficiency / factor,
        hbm_efficiency=ctx.hw.hbm_efficiency / factor,
    )
    return hw, factor


def pressure(ctx: Ctx) -> list[dict]:
    """Fig. 16 with less HBM for the KV cache (the same requests and rates): more memory
    pressure at every rate."""
    full = ctx.setup("lvf").num_hbm_blocks
    return [r for share in PRESSURE for r in fig16(ctx, hbm=round(full * share))]


def fig1(ctx: Ctx, rate: float, out: Path) -> dict:
    recs = {p: ctx.records(ctx.setup(p), rate) for p in ("wf", "sf", "fcfs")}
    plot_cdfs(recs, out / "fig1_wf_vs_sf_cdf.png")
    return recs


def fig17(ctx: Ctx) -> list[dict]:
    variants = [
        ("naive", SMALL_BXFER),
        ("naive", ctx.hw.defaults["xfer_budget"]),
        ("duplex", ctx.hw.defaults["xfer_budget"]),
    ]
    jobs = [sim.Job(r, ctx.setup("lvf", mode, xfer_budget=b)) for mode, b in variants for r in ctx.args.rates]
    return ctx.run(jobs)


def fig21(ctx: Ctx, rate: float) -> list[dict]:
    jobs = [sim.Job(rate, ctx.setup("lvf", mode, xfer_budget=b)) for mode in ("duplex", "naive") for b in BXFER_SWEEP]
    return ctx.run(jobs)


def knob_sweeps(ctx: Ctx, rate: float) -> dict[str, list[dict]]:
    return {k: ctx.run([sim.Job(rate, ctx.setup("lvf", **{k: v})) for v in vals]) for k, vals in KNOB_SWEEPS.items()}


def table1(ctx: Ctx) -> list[dict]:
    """8 GB each way (16 GB moved) on gh200 with Qwen2.5-32B's 4 MiB blocks."""
    block = ctx.model.kv_block_bytes(16, ctx.hw.dtype_bytes)
    n = int(8e9 // block)
    nbytes = n * block
    rows = []
    for mode in MODES:
        x = transfer_time(ctx.hw, ctx.model, mode, n, n, 16)
        rows.append({"mode": mode, "ms": x.total_s * 1e3, "gbs_total": 2 * nbytes / x.total_s / GB})
    rows.append({"mode": "ideal", "ms": ideal_time(ctx.hw, nbytes, nbytes) * 1e3, "gbs_total": ctx.hw.link.dram_gbs})
    return rows


# ---------------------------------------------------------------- checks


def at(rows: list[dict], policy: str, rate: float, **knobs) -> dict:
    return next(
        r for r in rows if r["policy"] == policy and r["rate"] == rate and all(r[k] == v for k, v in knobs.items())
    )


def claims(rows: list[dict], rates) -> list[tuple[str, str, bool]]:
    """The paper's Fig. 16 claims, checked on our rows: (claim, what we measured, holds)."""
    hi, lo = max(rates), min(rates)
    lvf = at(rows, "lvf", hi)
    base = [at(rows, p, hi) for p in POLICIES if p != "lvf"]
    best_ttft = max(base, key=lambda r: r["ttft_attainment"])
    best_tbt = max(r["tbt_attainment"] for r in [lvf, *base])
    gap = 100 * (lvf["ttft_attainment"] - best_ttft["ttft_attainment"])
    tbt_gap = 100 * (best_tbt - lvf["tbt_attainment"])
    low = [at(rows, p, lo) for p in POLICIES]
    spread = 100 * max(max(r[k] for r in low) - min(r[k] for r in low) for k in ("ttft_attainment", "tbt_attainment"))
    return [
        (
            f"at {hi:g} req/s LVF's TTFT attainment is >= 30 points above the best baseline",
            f"LVF {pct(lvf['ttft_attainment'])} vs {best_ttft['policy']} {pct(best_ttft['ttft_attainment'])}: {gap:+.1f} points",
            gap >= 30,
        ),
        (
            f"at {hi:g} req/s LVF's TBT attainment is within 5 points of the best",
            f"LVF {pct(lvf['tbt_attainment'])}, best {pct(best_tbt)}: {tbt_gap:.1f} points below",
            tbt_gap <= 5,
        ),
        (f"at {lo:g} req/s all policies tie", f"largest spread {spread:.1f} points", spread <= 1.0),
    ]


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


# ---------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(recs: dict[str, list[RequestRecord]], path: Path) -> None:
    import numpy as np

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for policy, rs in recs.items():
        for ax, values in ((axes[0], [r.ttft_s for r in rs if r.ok]), (axes[1], [g for r in rs for g in r.tbt_s])):
            xs = np.sort(np.asarray(values)) * 1e3
            ax.step(xs, np.arange(1, xs.size + 1) / max(xs.size, 1), where="post", label=policy)
    for ax, name, slo in ((axes[0], "TTFT", 5000), (axes[1], "TBT", 100)):
        ax.axvline(slo, color="red", linestyle="--", linewidth=1)
        ax.set(xscale="log", xlabel=f"{name} (ms)", ylabel="fraction <= x", title=f"{name} CDF under memory pressure")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_sweep(rows: list[dict], key: str, path: Path, title: str, by: str | None = None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r[by]) if by else "lvf", []).append(r)
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r[key])
        xs = [r[key] for r in rs]
        ax.plot(xs, [100 * r["ttft_attainment"] for r in rs], marker="o", label=f"TTFT {name}")
        ax.plot(xs, [100 * r["tbt_attainment"] for r in rs], marker="s", linestyle="--", label=f"TBT {name}")
    ax.set(xlabel=key, ylabel="SLO attainment (%)", ylim=(0, 102), title=title)
    if key == "xfer_budget":
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------- Markdown


def attainment_table(rows: list[dict], label) -> list[str]:
    """Rates down, one column per series: 'TTFT / TBT' attainment."""
    names = list(dict.fromkeys(label(r) for r in rows))
    lines = ["| rate (req/s) | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for rate in sorted({r["rate"] for r in rows}):
        cells = []
        for n in names:
            r = next((r for r in rows if r["rate"] == rate and label(r) == n), None)
            cells.append("" if r is None else f"{pct(r['ttft_attainment'])} / {pct(r['tbt_attainment'])}")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    return lines


def detail_table(rows: list[dict], first: str, label) -> list[str]:
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
    )
    lines = [
        f"| {first} | TTFT att. | TBT att. | tok/s | TTFT p50 ms | TTFT p99 ms | TBT p50 ms | TBT p99 ms | preempt. | recomp. | copy ms/step | stall |",
        "|---|" + "---:|" * len(cols),
    ]
    for r in rows:
        vals = [
            pct(r[c])
            if "attainment" in c
            else f"{100 * r[c]:.2f}%"
            if c == "stall_share"
            else f"{r[c]:.0f}"
            if isinstance(r[c], (int, float))
            else "n/a"
            for c in cols
        ]
        lines.append(f"| {label(r)} | " + " | ".join(vals) + " |")
    return lines


def policy_label(r: dict) -> str:
    return (
        r["policy"]
        if r["policy"] == "lvf" or r["transfer_mode"] == "duplex"
        else f"{r['policy']} ({r['transfer_mode']})"
    )


def render(ctx: Ctx, res: dict, seconds: float) -> str:
    a, hw, m = ctx.args, ctx.hw, ctx.model
    hi = max(a.rates)
    r16 = res["fig16"]
    setup = ctx.setup("lvf")
    block_mib = m.kv_block_bytes(16, hw.dtype_bytes) / (1 << 20)
    L = [
        "# SuperInfer's experiments, reproduced in the simulator",
        "",
        f"Generated by `superinfer bench reproduce` in {seconds:.0f} s ({ctx.num_runs} simulated runs); every number below",
        "comes from that run (rows: `bench/results/reproduction.json`, one CSV per figure; plots: `bench/results/*.png`).",
        "Regenerate it rather than edit it.",
        "",
        "The simulator (`superinfer bench sim`) drives the scheduler core the live service runs — the",
        "same `SchedulerCore`, policies and block manager — on a virtual clock. Its worker is a cost model",
        "(`bench/costmodel.py`): a roofline step time from the model's shape and the GPU's compute and HBM",
        "bandwidth, and copy times from the link's segment-size curve, the transfer mode and the duplex cap.",
        "",
        "## Setting",
        "",
        f"- **Model** {m.name} ({m.num_params / 1e9:.1f} B parameters, bf16; KV block of 16 tokens = {block_mib:g} MiB).",
        f"- **Hardware** `gh200`: {hw.flops / 1e12:g} TFLOP/s bf16 dense at {hw.compute_efficiency:g} efficiency, "
        f"{hw.hbm_bw / 1e12:g} TB/s HBM3 at {hw.hbm_efficiency:g}, {hw.step_overhead_s * 1e3:g} ms fixed per step; "
        f"{hw.hbm_bytes / GB:g} GB HBM at {hw.mem_utilization:g} utilization minus the weights = "
        f"**{setup.num_hbm_blocks} HBM blocks** ({setup.num_hbm_blocks * 16 / 1000:.1f} k tokens); "
        f"{hw.dram_fraction:g} × {hw.host_bytes / GB:g} GB Grace DRAM = {setup.num_dram_blocks} DRAM blocks. "
        f"Link: {hw.link.curve[-1][1]:g} GB/s per direction at >= 8 MB segments, {hw.link.rate(65536) / GB:.1f} GB/s at 64 KB, "
        f"{hw.link.dram_gbs:g} GB/s DRAM both ways (x{hw.link.duplex_efficiency:g} reached).",
        f"- **Workload** ShareGPT, {len(ctx.items)} requests sampled as vLLM's benchmark samples them "
        f"(mean {sum(i.prompt_tokens for i in ctx.items) / len(ctx.items):.0f} prompt / "
        f"{sum(i.output_tokens for i in ctx.items) / len(ctx.items):.0f} output tokens, counted with the bundled "
        "SmolLM2 tokenizer), Poisson arrivals, seed "
        f"{a.seed}; each request generates exactly its ShareGPT answer length.",
        f"- **Scheduler** chunked prefill {setup.cfg.max_batched_tokens} tokens and {setup.cfg.max_num_seqs} requests per step "
        "(vLLM V1's defaults on a >= 70 GiB GPU), "
        f"B_xfer {setup.cfg.xfer_budget}, α {setup.cfg.alpha:g}, β_F {setup.cfg.beta_f:g}, β_B {setup.cfg.beta_b:g}; "
        f"SLOs TTFT 5 s, TBT 100 ms. Scheduling is modelled at the paper's {hw.sched_s * 1e3:g} ms per step, overlapped with compute.",
        "- **Metrics** as `bench serve` computes them (`bench/report.py`): TTFT attainment = requests with TTFT <= 5 s;",
        "  TBT attainment = token gaps <= 100 ms over all gaps (the paper's client).",
        "",
        "## The paper's claims, checked",
        "",
        "| claim (Fig. 16) | ours | holds |",
        "|---|---|---|",
        *[f"| {c} | {o} | {'yes' if ok else '**no**'} |" for c, o, ok in res["claims"]],
        "",
        *res["discussion"],
        "",
        f"## Fig. 16 — TTFT and TBT SLO attainment vs rate ({m.name}, gh200, ShareGPT, 5 s / 100 ms)",
        "",
        "Cells are TTFT / TBT attainment. Every policy runs on our core and our DuplexKV cost model.",
        "",
        *attainment_table(r16, policy_label),
        "",
        "![Fig. 16](results/fig16.png)",
        "",
        f"At {hi:g} req/s:",
        "",
        *detail_table([r for r in r16 if r["rate"] == hi], "policy", policy_label),
        "",
        "**Baselines on naive copies** (the rate of vLLM's stock swap, ~10 GB/s; still overlapped with compute as "
        "our pipeline does), LVF on DuplexKV:",
        "",
        *attainment_table(res["fig16_systems"], policy_label),
        "",
        f"**At the paper's measured speed**: the GPU slowed by ×{res['paper_factor']:.2f} so that LVF's mean model time per "
        f"step at {hi:g} req/s is the paper's {PAPER_STEP['model_ms']} ms (ours, as profiled: "
        f"{at(r16, 'lvf', hi)['compute_ms_mean']:.1f} ms):",
        "",
        *attainment_table(res["fig16_slow"], policy_label),
        "",
        "![Fig. 16 at paper speed](results/fig16_paper_speed.png)",
        "",
    ]
    L += render_pressure(res)
    L += render_fig1(res, hi)
    L += render_rest(ctx, res, hi)
    L += simlive_section(ctx.args.results)
    return "\n".join(L) + "\n"


def simlive_section(results: Path) -> list[str]:
    """The simulator against the live server, from the runs `bench simlive` recorded (minutes
    of live serving each: recorded, not rerun here)."""
    from bench import simlive

    path = results / "simlive_runs.jsonl"
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return simlive.markdown(runs)


def operating_points(res: dict) -> dict[int, list[dict]]:
    """HBM blocks -> that Fig. 16's rows: the profile's pool first, then the cut ones."""
    out: dict[int, list[dict]] = {}
    for r in [*res["fig16"], *res["fig16_pressure"]]:
        out.setdefault(r["num_hbm_blocks"], []).append(r)
    return out


def render_pressure(res: dict) -> list[str]:
    """Fig. 16 with less HBM, and LVF's leads at every operating point."""
    points = operating_points(res)
    L = [
        "## Fig. 16 under more memory pressure",
        "",
        "The same requests and rates with the KV cache cut to "
        + " and ".join(f"{round(100 * s)}%" for s in PRESSURE)
        + " of the HBM blocks (as if the model or the context were larger).",
        "",
    ]
    for blocks, rows in list(points.items())[1:]:
        L += [f"**{blocks} HBM blocks**", "", *attainment_table(rows, policy_label), ""]
    L += [
        "LVF's TTFT attainment minus the best of the named baselines', in points: its largest lead at any rate "
        "(with LVF's TBT attainment there, in points below the best policy's) and its largest deficit.",
        "",
        "| HBM blocks | vs the best baseline | vs fcfs (vLLM V1) | vs sf (vLLM V0) | vs wf |",
        "|---:|---|---|---|---|",
    ]
    for blocks, rows in points.items():
        cells = [lead_cell(rows, bases) for bases in (BASELINES, ("fcfs",), ("sf",), ("wf",))]
        L.append(f"| {blocks} | " + " | ".join(cells) + " |")
    return [*L, ""]


def tbt_behind(rows: list[dict], rate: float) -> float:
    """Points by which LVF's TBT attainment at `rate` trails the best policy's."""
    return 100 * (max(r["tbt_attainment"] for r in rows if r["rate"] == rate) - at(rows, "lvf", rate)["tbt_attainment"])


def lead_cell(rows: list[dict], baselines) -> str:
    ls = leads(rows, baselines)
    lead, rate, _ = max(ls)
    worst, wrate, _ = min(ls)
    if lead < 0.05:
        return f"never ahead; {worst:+.1f} at {wrate:g} req/s"
    tbt_gap = tbt_behind(rows, rate)
    deficit = f"; {worst:+.1f} at {wrate:g} req/s" if worst < -0.05 else ""
    return f"**{lead:+.1f}** at {rate:g} req/s (TBT {tbt_gap:.1f} below){deficit}"


def render_fig1(res: dict, hi: float) -> list[str]:
    rows = [at(res["fig16"], p, hi) for p in ("wf", "sf", "fcfs")]
    wf, sf, fcfs = rows
    return [
        f"## Fig. 1 — WF vs SF under memory pressure ({hi:g} req/s)",
        "",
        "Paper: waiting-first gets better TTFT but worse TBT; swapped-first keeps TBT steady with TTFT close to FCFS.",
        "",
        *detail_table(rows, "policy", policy_label),
        "",
        f"Ours: WF's TTFT attainment is {100 * (wf['ttft_attainment'] - sf['ttft_attainment']):+.1f} points vs SF "
        f"(SF vs FCFS: {100 * (sf['ttft_attainment'] - fcfs['ttft_attainment']):+.1f}); WF's TBT attainment "
        f"{100 * (wf['tbt_attainment'] - sf['tbt_attainment']):+.1f} points vs SF, TBT p99 {wf['tbt_p99_ms']:.0f} vs "
        f"{sf['tbt_p99_ms']:.0f} ms, requests meeting TBT on every gap {pct(wf['tbt_request_attainment'])} vs "
        f"{pct(sf['tbt_request_attainment'])}.",
        "",
        "![Fig. 1](results/fig1_wf_vs_sf_cdf.png)",
        "",
    ]


def render_rest(ctx: Ctx, res: dict, hi: float) -> list[str]:
    d = ctx.hw.defaults["xfer_budget"]
    abl = lambda r: f"LVF {r['transfer_mode']} B_xfer={r['xfer_budget']}"  # noqa: E731
    knob = lambda k: lambda r: f"{k}={r[k]:g}"  # noqa: E731
    lvf = at(res["fig16"], "lvf", hi)
    t1 = res["table1"]
    L = [
        "## Fig. 17 — ablation: LVF with naive copies (small and large B_xfer) vs LVF with DuplexKV",
        "",
        f"Small B_xfer = {SMALL_BXFER} blocks (what naive copies move in about one step), large = {d}.",
        "",
        *attainment_table(res["fig17"], abl),
        "",
        "![Fig. 17](results/fig17.png)",
        "",
        f"## Fig. 21 — B_xfer sweep (LVF, {hi:g} req/s)",
        "",
        *detail_table(res["fig21"], "B_xfer", lambda r: f"{r['transfer_mode']} {r['xfer_budget']}"),
        "",
        "![Fig. 21](results/fig21.png)",
        "",
        f"## Figs. 18–20 — α, β_F, β_B (LVF, {hi:g} req/s)",
        "",
        "Paper: raising β_F delays waiting requests (TTFT falls); raising β_B delays paused ones (TBT falls);",
        "α weighs paused requests that have emitted tokens against waiting ones.",
        "",
    ]
    for k, rows in res["knobs"].items():
        L += [f"**{k}**", "", *detail_table(rows, k, knob(k)), "", f"![{k}](results/fig_{k}.png)", ""]
    L += [
        "## Table 1 — moving 16 GB on gh200 (8 GB each way, Qwen2.5-32B blocks)",
        "",
        "| mode | ours ms | ours GB/s (both ways) | paper |",
        "|---|---:|---:|---|",
        *[f"| {r['mode']} | {r['ms']:.1f} | {r['gbs_total']:.1f} | {PAPER_TABLE1.get(r['mode'], '')} |" for r in t1],
        "",
        "## Per-step costs (LVF at the highest rate)",
        "",
        "| | paper (GH200) | ours (simulated gh200) |",
        "|---|---:|---:|",
        f"| scheduling ms | {PAPER_STEP['schedule_ms']} | {ctx.hw.sched_s * 1e3:g} modelled; our core's `schedule()` measured "
        f"{lvf['sched_wall_ms_p50']:.2f} p50 / {lvf['sched_wall_ms_p99']:.2f} p99 on this CPU |",
        f"| copies ms | {PAPER_STEP['transfer_ms']} | {lvf['xfer_ms_mean']:.1f} |",
        f"| model ms | {PAPER_STEP['model_ms']} | {lvf['compute_ms_mean']:.1f} |",
        f"| steps that stall | {PAPER_STEP['stall_pct']}% | {100 * lvf['stall_share']:.3f}% of GPU time |",
        "",
    ]
    return L


# ---------------------------------------------------------------- command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=1000, help="ShareGPT requests per run (default %(default)s)")
    p.add_argument("--rates", type=sim._floats, default=list(RATES), help="requests/s (default 4,8,12,16,20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="processes")
    p.add_argument("--out", type=Path, default=HERE / "REPRODUCTION.md")
    p.add_argument("--results", type=Path, default=HERE / "results")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    ctx = Ctx(args)
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    hi = max(args.rates)
    res: dict = {"fig16": fig16(ctx)}
    res["fig16_systems"] = fig16(ctx, baseline_mode="naive")
    slow_hw, res["paper_factor"] = paper_speed(ctx, res["fig16"])
    res["fig16_slow"] = fig16(ctx, hw=slow_hw)
    res["fig16_pressure"] = pressure(ctx)
    fig1(ctx, hi, out)
    res["fig17"] = fig17(ctx)
    res["fig21"] = fig21(ctx, hi)
    res["knobs"] = knob_sweeps(ctx, hi)
    res["table1"] = table1(ctx)
    res["claims"] = claims(res["fig16"], args.rates)
    res["claims_slow"] = claims(res["fig16_slow"], args.rates)
    res["discussion"] = discussion(res, hi)
    write_results(res, out)
    args.out.write_text(render(ctx, res, time.perf_counter() - t0))
    print(f"wrote {args.out} and {out}/ in {time.perf_counter() - t0:.0f} s ({ctx.num_runs} runs)", file=sys.stderr)
    return 0


def write_results(res: dict, out: Path) -> None:
    figs = {k: v for k, v in res.items() if k.startswith("fig") or k == "table1"}
    figs.update({f"fig_{k}": v for k, v in res["knobs"].items()})
    for name, rows in figs.items():
        sim.write_outputs(rows, None, out / f"{name}.csv", {})
    (out / "reproduction.json").write_text(
        json.dumps({**figs, "claims": res["claims"], "paper_factor": res["paper_factor"]}, indent=1)
    )
    sim.plot_attainment(res["fig16"], out, "Qwen2.5-32B on gh200", "fig16")
    sim.plot_attainment(res["fig16_slow"], out, "gh200 at the paper's step time", "fig16_paper_speed")
    sim.plot_attainment(res["fig17"], out, "ablation", "fig17")
    plot_sweep(res["fig21"], "xfer_budget", out / "fig21.png", "B_xfer sweep", by="transfer_mode")
    for k, rows in res["knobs"].items():
        plot_sweep(rows, k, out / f"fig_{k}.png", f"{k} sweep")


def leads(rows: list[dict], baselines=BASELINES) -> list[tuple[float, float, str]]:
    """LVF's TTFT lead over the best of `baselines` at each rate: (points, rate, baseline)."""
    out = []
    for rate in sorted({r["rate"] for r in rows}):
        base = max((at(rows, p, rate) for p in baselines), key=lambda r: r["ttft_attainment"])
        out.append((100 * (at(rows, "lvf", rate)["ttft_attainment"] - base["ttft_attainment"]), rate, base["policy"]))
    return out


def best_lead(rows: list[dict], baselines=BASELINES) -> tuple[float, float, str]:
    """LVF's largest TTFT lead over the best of `baselines` at any rate: (points, rate, baseline)."""
    return max(leads(rows, baselines))


def first_pressure(rows: list[dict]) -> str:
    rate = min((r["rate"] for r in rows if r["num_preemptions"]), default=None)
    return "no rate" if rate is None else f"{rate:g} req/s"


def pressure_bullet(points: dict[int, list[dict]], top: dict, worst_wf: float) -> str:
    (fcfs, rate, blocks), sf, wf = top["fcfs"], top["sf"][0], top["wf"][0]
    rows = points[blocks]
    fcfs_tbt = tbt_behind(rows, rate)
    lvf_r, wf_r = at(rows, "lvf", rate), at(rows, "wf", rate)
    vs_wf = (
        f"it is never ahead of WF at any rate and size we ran (at worst {worst_wf:+.1f})"
        if wf < 0.05
        else f"against WF at most {wf:+.1f}"
    )
    return (
        f"- **More memory pressure: LVF leads vLLM V1's policy by up to {fcfs:+.1f} points"
        f"{' (the headline, against that baseline)' if fcfs >= 30 else ''}.** "
        f"With the KV cache cut (section below), that lead is at {rate:g} req/s with "
        f"{blocks} HBM blocks, LVF's TBT attainment {fcfs_tbt:.1f} points below the best policy's. Against SF its lead "
        f"is at most {sf:+.1f}, and {vs_wf}. WF admits every waiting request before any paused one, which is exactly "
        "what TTFT attainment rewards; what it costs (a request preempted to make room waits behind every new "
        "arrival) is one long gap among hundreds, which TBT attainment over all gaps barely sees; it shows in the "
        f"requests that meet the TBT SLO on every gap ({pct(wf_r['tbt_request_attainment'])} for WF, "
        f"{pct(lvf_r['tbt_request_attainment'])} for LVF there) and in the median end-to-end latency "
        f"({wf_r['e2e_p50_ms'] / 1e3:.1f} s vs {lvf_r['e2e_p50_ms'] / 1e3:.1f} s). LVF instead gives a "
        f"paused request that has emitted tokens α = {lvf_r['alpha']:g} times the urgency of a waiting one (VLT), so "
        "under sustained pressure it serves paused requests first."
    )


def discussion(res: dict, hi: float) -> list[str]:
    """Where ours differs from the paper, and why — each statement from this run's numbers."""
    r16, slow = res["fig16"], res["fig16_slow"]
    lvf, fcfs, wf, sf = (at(r16, p, hi) for p in ("lvf", "fcfs", "wf", "sf"))
    lead, lead_rate, lead_base = best_lead(r16)
    slead, slead_rate, slead_base = best_lead(slow)
    pressure = first_pressure(r16)
    spressure = first_pressure(slow)
    best = max((at(r16, p, hi) for p in POLICIES if p != "lvf"), key=lambda r: r["ttft_attainment"])
    same = all(r["ttft_attainment"] == at(r16, r["policy"], r["rate"])["ttft_attainment"] for r in res["fig16_systems"])
    rot = lvf["num_preemptions"] / max(lvf["num_steps"], 1)
    k = res["knobs"]
    points = operating_points(res)
    top = {  # baseline -> (LVF's largest lead over it at any rate and HBM size, rate, HBM blocks)
        b: max((*best_lead(rows, (b,))[:2], blocks) for blocks, rows in points.items()) for b in BASELINES
    }
    worst_wf = min(min(leads(rows, ("wf",)))[0] for rows in points.values())
    trend = lambda rows, key: 100 * (rows[-1][key] - rows[0][key])  # noqa: E731
    return [
        "### Where ours differs from the paper, and why",
        "",
        "- **The TTFT lead is smaller.** "
        + (
            f"LVF's largest lead over the best baseline is {lead:+.1f} points ({lead_rate:g} req/s, over {lead_base}); "
            if lead >= 0.05
            else "LVF is never ahead of the best baseline; "
        )
        + f"over FCFS, vLLM V1's policy, it is "
        f"{100 * (lvf['ttft_attainment'] - fcfs['ttft_attainment']):+.1f} at {hi:g} req/s. The best baseline there is "
        f"{best['policy']} ({pct(best['ttft_attainment'])}); WF preempts with swap like LVF and admits waiting requests "
        "first, which is most of what TTFT needs.",
        pressure_bullet(points, top, worst_wf),
        f"- **Our baselines are not vLLM.** All four policies run on one core, one block manager and one copy model. "
        f"Giving the baselines vLLM's stock swap path (`naive`, ~10 GB/s) {'changes nothing' if same else 'changes little'}: "
        f"they preempt rarely (SF {sf['num_preemptions']}, WF {wf['num_preemptions']} times in {sf['num_requests']} requests) "
        "and a swap-in of a few dozen 4 MiB blocks hides behind one step's compute in the pipeline.",
        f"- **Operating point.** Our roofline GH200 takes {lvf['compute_ms_mean']:.1f} ms of model time per step at {hi:g} req/s; "
        f"the paper measured {PAPER_STEP['model_ms']} ms. Memory pressure (any preemption) starts at {pressure} here. "
        f"Slowed to the paper's step time (×{res['paper_factor']:.2f}) it starts at {spressure}, "
        f"LVF's largest lead is {slead:+.1f} points ({slead_rate:g} req/s, over {slead_base}), and beyond that rate "
        "the GPU cannot keep up with the arrivals: the run becomes a queue drain that no ordering fixes, and every policy "
        "misses TTFT for the late arrivals. The paper's LVF keeps TTFT at its highest rates, so its system had more "
        "capacity per request than either of our operating points.",
        f"- **Rotation volume.** The paper's copies take {PAPER_STEP['transfer_ms']} ms per step (~{PAPER_STEP['transfer_ms'] * 0.36:.1f} GB "
        f"at DuplexKV's 360 GB/s); ours {lvf['xfer_ms_mean']:.1f} ms. Our LVF preempts {rot:.2f} requests per step and, "
        "with eager rotation, a preemption copies only the request's last, partly filled block.",
        f"- **TBT at every rate** is below 100% for all policies alike: with vLLM V1's 8192-token chunk, a step carrying "
        f"several prompts takes longer than 100 ms and every decode in it misses the SLO (TBT p99 {lvf['tbt_p99_ms']:.0f} ms "
        f"for LVF, {wf['tbt_p99_ms']:.0f} ms for WF at {hi:g} req/s).",
        f"- **Fig. 1.** WF's TTFT is {100 * (wf['ttft_attainment'] - sf['ttft_attainment']):+.1f} points vs SF and SF is "
        f"{100 * (sf['ttft_attainment'] - fcfs['ttft_attainment']):+.1f} vs FCFS, as in the paper; WF's TBT attainment "
        f"differs from SF's by {100 * (wf['tbt_attainment'] - sf['tbt_attainment']):+.1f} points"
        + (
            " (the paper's WF loses clearly more: on our copy engine its swaps are cheap and hidden behind compute)."
            if sf["tbt_attainment"] - wf["tbt_attainment"] < 0.02
            else ", worse as in the paper."
        ),
        f"- **Sensitivity (Figs. 18–20)**: raising α moves TTFT by {trend(k['alpha'], 'ttft_attainment'):+.1f} and TBT by "
        f"{trend(k['alpha'], 'tbt_attainment'):+.1f} points; raising β_F moves TTFT by {trend(k['beta_f'], 'ttft_attainment'):+.1f} "
        f"(paper: TTFT falls); raising β_B moves TBT by {trend(k['beta_b'], 'tbt_attainment'):+.1f} (paper: TBT falls; "
        "ours is small because chunked-prefill steps, not rotations, cause most slow gaps).",
        "- **Workload details.** Token counts come from the bundled SmolLM2 tokenizer (Qwen's does not ship with us); "
        "every request generates exactly its ShareGPT answer length; the run is a fixed set of requests, so at the "
        "highest rates part of it is the drain after the last arrival.",
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.reproduce", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
