"""`superinfer bench reproduce` (or `python -m bench.sim.reproduce`): regenerate
bench/REPRODUCTION.md — the paper's experiments next to ours, from simulator runs of the
scheduler core that serves, plus the cost model's transfer table.

Every number in the Markdown comes from this run, except the last section's: the simulator
against the live server, read from the runs `superinfer bench simlive` recorded in
bench/results/simlive_runs.jsonl. The rows, one CSV per figure and the PNGs go to
bench/results/. The whole reproduction takes about a quarter of an hour on two cores. The Markdown is
rendered from the rows file (reproduction.json, which records the setting too) and those
runs alone: `--from-rows` re-renders it without running anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from bench.live import workload
from bench.live.workload import ChatSpec
from bench.report import plots, reproduction
from bench.report.metrics import RequestRecord
from bench.report.rows import BASELINES, PAPER_STEP, SYSTEMS, at, compare, mean_rows, name, pct
from bench.sim import engine, sweep
from bench.sim.costmodel import GB, MODELS, MODES, ideal_time, load_hardware, transfer_time
from services.scheduler.core import SchedulerConfig
from services.scheduler.core.config import SWAPPING
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE

HERE = Path(__file__).resolve().parents[1]  # bench/
RATES = (4, 8, 12, 16, 20)
MAX_TOKENS = 2048  # what the clients ask as max_tokens (a chat front-end's cap); outputs end at their true length
VLLM_BXFER = 300  # the paper's B_xfer on vLLM's swap path (Fig. 17)
BXFER_SWEEP = (24, 96, 384, 1200, 2400, 4800)
# Fig. 16's other models, each at the Qwen rates times its factor: about where each model's
# compute saturates on gh200 as 20 req/s is where Qwen2.5-32B's does (its output tok/s stops rising).
MODEL_ROWS = {"llama3-8b": 5.0, "mixtral-8x7b": 2.5}
# ShareGPT conversations turn by turn, each turn's prompt the whole history (their real lengths, up
# to a 32k context), arriving at these rates (conversations/s): on the paper's 144 GB the KV-cache
# fills before the GPU's compute does, where ShareGPT's single first turns never fill it.
CONVERSATIONS, CONV_RATES = 700, (2, 4, 6, 8, 10)
CHAT = ChatSpec(multi_turn=True)
PRESSURE = (0.3,)  # Fig. 16 again with the HBM pool cut to these shares of the profile's
KNOB_SWEEPS = {
    "alpha": (0.5, 1.0, 3.0, 5.0, 10.0),
    "beta_f": (0.0, 0.25, 0.5, 0.75, 1.0),
    "beta_b": (0.0, 0.25, 0.5, 1.0, 2.0),
}


class Ctx:
    """The shared setting: Qwen2.5-32B on gh200, ShareGPT, SLOs 5 s / 100 ms; every run
    once per seed (its own ShareGPT sample and arrivals), rows averaged over the seeds."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.hw = load_hardware("gh200")
        self.model = MODELS["qwen2.5-32b"]
        self.seeds = list(range(args.seed, args.seed + args.num_seeds))
        self.items_by_seed = {s: sweep.load_items("sharegpt", args.num_requests, s) for s in self.seeds}
        self.items = self.items_by_seed[args.seed]
        self.num_runs = 0
        self._rows: dict[str, dict] = {}  # Ctx.run's rows by job
        self._conversations: dict[int, list] | None = None

    def setup(
        self, policy: str, mode: str = "duplex", hw=None, hbm: int | None = None, model=None, **knobs
    ) -> engine.SimSetup:
        d = self.hw.defaults
        cfg = SchedulerConfig(
            policy="fcfs" if policy == "neo" else policy,  # NEO offloads under vLLM V1's scheduling
            max_batched_tokens=d["max_batched_tokens"],
            max_num_seqs=d["max_num_seqs"],
            xfer_budget=knobs.pop("xfer_budget", d["xfer_budget"]),
            ttft_slo=5.0,
            tbt_slo=0.1,
            **knobs,
        )
        # Each step takes the scheduling time our core's schedule() measured for it (not the
        # paper's 7.6 ms); it overlaps compute, so it costs only where it is longer.
        return engine.make_setup(
            hw or self.hw,
            model or self.model,
            cfg,
            mode,
            hbm=hbm,
            sched_time="measured",
            max_tokens=self.args.max_tokens,
            neo=policy == "neo",
        )

    def run(self, jobs: list[sweep.Job], workload: str = "sharegpt") -> list[dict]:
        """One row per job: its mean over the seeds, with the spreads (rows.mean_rows), on the
        ShareGPT requests or the ShareGPT `conversations`. A job run before (the same workload,
        rate and setup in another figure) is not run again."""
        key = lambda j: repr((workload, j.rate, j.setup))  # noqa: E731
        new = list({key(j): j for j in jobs if key(j) not in self._rows}.values())
        self.num_runs += len(new) * len(self.seeds)
        if new:
            t0 = time.perf_counter()
            items = self.items_by_seed if workload == "sharegpt" else self.conversations()
            rows = mean_rows(sweep.sweep_seeds(items, new, 5.0, 0.1, num_procs=self.args.jobs))
            self._rows.update(zip(map(key, new), rows))
            took = time.perf_counter() - t0
            print(f"  {len(new)} jobs x {len(self.seeds)} seeds on {workload} in {took:.0f} s", file=sys.stderr)
        return [self._rows[key(j)] for j in jobs]

    def conversations(self) -> dict[int, list]:
        """Each seed's ShareGPT conversations (CHAT), loaded on first use."""
        if self._conversations is None:
            n = self.args.conversations
            self._conversations = {s: sweep.load_items("sharegpt-long", n, s, chat=CHAT) for s in self.seeds}
        return self._conversations

    def records(self, setups: list[engine.SimSetup], rate: float) -> list[list[RequestRecord]]:
        """Each setup's requests in one run on the first seed's conversations (the CDFs of
        Fig. 1), the runs side by side."""
        bare = [replace(it, prompt="") for it in self.conversations()[self.args.seed]]
        items = workload.draw_arrivals(bare, rate, 1.0, self.args.seed)
        self.num_runs += len(setups)
        with ProcessPoolExecutor(max(1, min(self.args.jobs, len(setups)))) as pool:
            return list(pool.map(simulated_records, [items] * len(setups), setups))


def simulated_records(items: list, setup: engine.SimSetup) -> list[RequestRecord]:
    return engine.simulate(items, setup).records


# ---------------------------------------------------------------- experiments


def fig16(ctx: Ctx, hw=None, baseline_mode: str = "duplex", hbm: int | None = None, policies=SYSTEMS) -> list[dict]:
    jobs = [
        sweep.Job(r, ctx.setup(p, "duplex" if p == "lvf" else baseline_mode, hw, hbm))
        for p in policies
        for r in ctx.args.rates
    ]
    return ctx.run(jobs)


def fig16_models(ctx: Ctx) -> list[dict]:
    """Fig. 16's policies on the paper's other two models, at the lowest, middle and highest of
    the rates scaled per model (MODEL_ROWS)."""
    rates = sorted(ctx.args.rates)
    jobs = [
        sweep.Job(r * factor, ctx.setup(p, model=MODELS[key]))
        for key, factor in MODEL_ROWS.items()
        for p in SYSTEMS
        for r in dict.fromkeys((rates[0], rates[len(rates) // 2], rates[-1]))
    ]
    return ctx.run(jobs)


def fig16_conv(ctx: Ctx) -> list[dict]:
    """Fig. 16's policies on the ShareGPT conversations, prefix caching on for all (vLLM V1's
    default; a later turn's history is then found in HBM if it is still there), on our copy
    engine; then sf and wf once more on vLLM's swap path, as vLLM runs them (at the highest rate:
    Fig. 1)."""
    jobs = [sweep.Job(r, ctx.setup(p, enable_prefix_caching=True)) for p in SYSTEMS for r in CONV_RATES]
    jobs += [sweep.Job(r, ctx.setup(p, "vllm", enable_prefix_caching=True)) for p in ("sf", "wf") for r in CONV_RATES[-1:]]
    return ctx.run(jobs, "conversations")


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


def conv_ablation(ctx: Ctx) -> list[dict]:
    """Where LVF's lead on the conversations comes from, at their highest rate: LVF without its
    admission watermark, and LVF and vllm-v1 without prefix caching."""
    top = max(CONV_RATES)
    jobs = [sweep.Job(top, ctx.setup("lvf", admit_watermark=0.0, enable_prefix_caching=True))]
    jobs += [sweep.Job(top, ctx.setup(p, enable_prefix_caching=False)) for p in ("lvf", "fcfs")]
    return ctx.run(jobs, "conversations")


def fig1(ctx: Ctx, rate: float, out: Path) -> dict:
    """WF and SF on vLLM's swap path, and vLLM V1's FCFS, on the conversations."""
    policies = ("wf", "sf", "fcfs")
    setups = [ctx.setup(p, "duplex" if p == "fcfs" else "vllm", enable_prefix_caching=True) for p in policies]
    recs = dict(zip(policies, ctx.records(setups, rate)))
    plots.plot_policy_cdfs(recs, out / "fig1_wf_vs_sf_cdf.png")
    return recs


def fig17(ctx: Ctx) -> list[dict]:
    """LVF on vLLM's swap path with the paper's B_xfer and with a large one, and on DuplexKV,
    on the conversations (where it rotates)."""
    large = ctx.hw.defaults["xfer_budget"]
    variants = [("vllm", VLLM_BXFER), ("vllm", large), ("duplex", large)]
    jobs = [
        sweep.Job(r, ctx.setup("lvf", mode, xfer_budget=b, enable_prefix_caching=True))
        for mode, b in variants
        for r in CONV_RATES
    ]
    return ctx.run(jobs, "conversations")


def fig21(ctx: Ctx, rate: float) -> list[dict]:
    jobs = [sweep.Job(rate, ctx.setup("lvf", mode, xfer_budget=b)) for mode in ("duplex", "naive") for b in BXFER_SWEEP]
    return ctx.run(jobs)


def knob_sweeps(ctx: Ctx, rate: float) -> dict[str, list[dict]]:
    return {k: ctx.run([sweep.Job(rate, ctx.setup("lvf", **{k: v})) for v in vals]) for k, vals in KNOB_SWEEPS.items()}


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


# ---------------------------------------------------------------- checks


def claims(rows: list[dict], rates, unit: str = "req/s") -> list[tuple[str, str, bool]]:
    """The paper's Fig. 16 claims as the issue states them, checked on our rows (means over
    the seeds; a difference within the spread is a tie): (claim, what we measured, holds)."""
    hi, lo = max(rates), min(rates)
    lvf, v1 = at(rows, "lvf", hi), at(rows, "fcfs", hi)
    gap, gap_spread = compare(lvf, v1, "ttft_attainment")
    best = max((at(rows, p, hi) for p in SYSTEMS), key=lambda r: r["tbt_attainment"])
    tbt_gap, tbt_spread = compare(best, lvf, "tbt_attainment")
    beaten = [
        f"{name(p)} at {r:g} {unit}"
        for r in rates
        for p in BASELINES
        if all(d > s for d, s in (compare(at(rows, p, r), at(rows, "lvf", r), k) for k in ("ttft_attainment", "tbt_attainment")))
    ]
    low = [at(rows, p, lo) for p in SYSTEMS]
    spread = 100 * max(max(r[k] for r in low) - min(r[k] for r in low) for k in ("ttft_attainment", "tbt_attainment"))
    return [
        (
            f"at {hi:g} {unit} LVF's TTFT attainment is >= vllm-v1's + 30 points",
            f"LVF {pct(lvf['ttft_attainment'])} vs vllm-v1 {pct(v1['ttft_attainment'])}: {gap:+.1f} points (spread {gap_spread:.1f})",
            gap >= 30,
        ),
        (
            f"at {hi:g} {unit} LVF's TBT attainment is within 5 points of the best policy's",
            f"LVF {pct(lvf['tbt_attainment'])}, best {name(best['policy'])} {pct(best['tbt_attainment'])}: "
            f"{tbt_gap:.1f} points below (spread {tbt_spread:.1f})",
            tbt_gap <= 5,
        ),
        (
            "at no rate does a baseline beat LVF on both TTFT and TBT attainment by more than the spread",
            "none does" if not beaten else "beaten by " + ", ".join(beaten),
            not beaten,
        ),
        (f"at {lo:g} {unit} all policies tie", f"largest difference {spread:.1f} points", spread <= 1.0),
    ]


# ---------------------------------------------------------------- command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=1000, help="ShareGPT requests per run (default %(default)s)")
    p.add_argument(
        "--conversations", type=int, default=CONVERSATIONS, help="ShareGPT conversations per run (default %(default)s)"
    )
    p.add_argument("--rates", type=sweep._floats, default=list(RATES), help="requests/s (default 4,8,12,16,20)")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--num-seeds", type=int, default=3, help="seeds per run, from --seed (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="the clients' max_tokens cap (default %(default)s)")
    p.add_argument("--jobs", type=int, default=1, help="processes")
    p.add_argument("--out", type=Path, default=HERE / "REPRODUCTION.md")
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument(
        "--from-rows",
        action="store_true",
        help="run nothing: rewrite --out from the rows in --results (after `bench simlive` recorded a run)",
    )


def run(args: argparse.Namespace) -> int:
    if args.from_rows:
        args.out.write_text(reproduction.render_results(args.results))
        return 0
    t0 = time.perf_counter()
    ctx = Ctx(args)
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    hi = max(args.rates)
    res: dict = {"fig16": fig16(ctx)}
    res["fig16_systems"] = fig16(ctx, baseline_mode="vllm", policies=SWAPPING)  # the others copy nothing
    res["fig16_models"] = fig16_models(ctx)
    res["fig16_conv"] = fig16_conv(ctx)
    res["fig16_conv_ablation"] = conv_ablation(ctx)
    res["fig16_no_chunking"] = ctx.run([sweep.Job(r, ctx.setup("lvf", slo_chunking=False)) for r in args.rates])
    slow_hw, res["paper_factor"] = paper_speed(ctx, res["fig16"])
    res["fig16_slow"] = fig16(ctx, hw=slow_hw)
    res["fig16_pressure"] = pressure(ctx)
    fig1(ctx, max(CONV_RATES), out)
    res["fig17"] = fig17(ctx)
    res["fig21"] = fig21(ctx, hi)
    res["knobs"] = knob_sweeps(ctx, hi)
    res["table1"] = table1(ctx)
    smallest = min(r["num_hbm_blocks"] for r in res["fig16_pressure"])
    claims_pressure = claims([r for r in res["fig16_pressure"] if r["num_hbm_blocks"] == smallest], args.rates)
    figs = write_results(res, out)
    record = {**figs, "claims": claims(res["fig16"], args.rates), "claims_pressure": claims_pressure}
    record["claims_conv"] = claims([r for r in res["fig16_conv"] if r["transfer_mode"] == "duplex"], CONV_RATES, "conversations/s")
    record["paper_factor"] = res["paper_factor"]
    record["setting"] = setting_record(ctx, time.perf_counter() - t0)
    (out / reproduction.ROWS_FILE).write_text(json.dumps(record, indent=1))
    args.out.write_text(reproduction.render_results(out))
    print(f"wrote {args.out} and {out}/ in {time.perf_counter() - t0:.0f} s ({ctx.num_runs} runs)", file=sys.stderr)
    return 0


def setting_record(ctx: Ctx, seconds: float) -> dict:
    """What the reproduction ran, as REPRODUCTION.md's setting paragraph tells it (the rows
    file keeps it, so the document is rendered from that file alone)."""
    hw, m, items, setup = ctx.hw, ctx.model, ctx.items, ctx.setup("lvf")
    long = sweep.load_items("sharegpt-long", len(items), ctx.args.seed)
    return {
        "seconds": seconds,
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


def write_results(res: dict, out: Path) -> dict[str, list[dict]]:
    """One CSV per figure and the plots; returns the rows by figure, as the rows file keeps them."""
    figs = {k: v for k, v in res.items() if k.startswith("fig") or k == "table1"}
    figs.update({f"fig_{k}": v for k, v in res["knobs"].items()})
    for name, rows in figs.items():
        sweep.write_outputs(rows, None, out / f"{name}.csv", {})
    plots.plot_attainment(res["fig16"], out, "Qwen2.5-32B on gh200", "fig16")
    plots.plot_attainment(res["fig16_slow"], out, "gh200 at the paper's step time", "fig16_paper_speed")
    plots.plot_attainment(res["fig17"], out, "ablation", "fig17")
    plots.plot_sweep(res["fig21"], "xfer_budget", out / "fig21.png", "B_xfer sweep", by="transfer_mode")
    for k, rows in res["knobs"].items():
        plots.plot_sweep(rows, k, out / f"fig_{k}.png", f"{k} sweep")
    return figs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.sim.reproduce", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
