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
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from bench.live import workload
from bench.live.workload import ChatSpec, SyntheticSpec
from bench.report import plots, reproduction
from bench.report.metrics import RequestRecord
from bench.report.rows import SYSTEMS, mean_rows, name
from bench.sim import engine, sweep
from bench.sim.costmodel import GB, MODELS, MODES, ideal_time, load_hardware, transfer_time
from services.scheduler.core import SchedulerConfig
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE

HERE = Path(__file__).resolve().parents[1]  # bench/
# ShareGPT's single first turns (the paper's workload) on the calibrated gh200: its compute
# saturates near 7 req/s (~1.4 k output tok/s), the top rate is past it.
RATES = (2, 4, 6, 8, 12)
MAX_TOKENS = 2048  # what the clients ask as max_tokens (a chat front-end's cap); outputs end at their true length
VLLM_BXFER = 300  # the paper's B_xfer on vLLM's swap path (Fig. 17)
LVFS = ("lvf-paper", "lvf")  # the paper's LVF (no guard of ours) and ours (our defaults)
# ShareGPT conversations turn by turn, each turn's prompt the whole history (their real lengths, up
# to a 32k context), arriving at these rates (conversations/s): on the paper's 144 GB the KV-cache
# fills before the GPU's compute does, where ShareGPT's single first turns never fill it.
CONVERSATIONS, CONV_RATES = 200, (2, 4, 6, 8)
CHAT = ChatSpec(multi_turn=True)
# LMSYS-Chat-1M's length mix as a synthetic workload: its published means (Zheng et al., 2023,
# arXiv 2309.11998, Table 1: 69.5 prompt and 214.5 response tokens per turn); lognormal lengths
# with sigma 1 (the spread is ours: the data set does not ship with us).
LMSYS = SyntheticSpec(input_len=70, output_len=215, dist="lognormal", spread=1.0)
LMSYS_RATES = (4, 8, 12)
# The guards of ours that the ablation adds one at a time to lvf-paper (their lvf defaults), and
# the two that work with any policy, which it also gives vllm-v1 (fcfs) and wf.
GUARDS = {"admit_watermark": 0.25, "min_residency_s": 16.0, "rotary_yields": True, "slo_chunking": True}
GUARDS_OFF = {"admit_watermark": 0.0, "min_residency_s": 0.0, "rotary_yields": False, "slo_chunking": False}
AGNOSTIC = ("admit_watermark", "slo_chunking")
# Sensitivity (Figs. 18-21) on the conversations at CONV_KNOB_RATE. (At 200 conversations a seed
# and the calibrated speed the KV-cache does not fill; 700 at 4 and 8/s do, at ~3x the time.)
CONV_KNOB_RATE = 6
KNOB_SWEEPS = {
    "alpha": (1.0, 3.0, 10.0),
    "beta_f": (0.0, 0.5, 1.0),
    "beta_b": (0.0, 1.0, 2.0),
    "xfer_budget": (96, 600, 2400),
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
        self._lmsys: dict[int, list] | None = None

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
        ShareGPT requests, the `lmsys` mix or the ShareGPT `conversations`. A job run before (the same workload,
        rate and setup in another figure) is not run again."""
        key = lambda j: job_key(workload, j)  # noqa: E731
        new = list({key(j): j for j in jobs if key(j) not in self._rows}.values())
        self.num_runs += len(new) * len(self.seeds)
        if new:
            t0 = time.perf_counter()
            items = {"sharegpt": self.items_by_seed, "lmsys": self.lmsys()}.get(workload) or self.conversations()
            rows = mean_rows(sweep.sweep_seeds(items, new, 5.0, 0.1, num_procs=self.args.jobs))
            self._rows.update(zip(map(key, new), rows))
            took = time.perf_counter() - t0
            print(f"  {len(new)} jobs x {len(self.seeds)} seeds on {workload} in {took:.0f} s", file=sys.stderr)
        return [self._rows[key(j)] for j in jobs]

    def lmsys(self) -> dict[int, list]:
        """Each seed's requests of LMSYS-Chat-1M's length mix (LMSYS), as many as --num-requests."""
        if self._lmsys is None:
            n = self.args.num_requests
            self._lmsys = {s: sweep.load_items("synthetic", n, s, synthetic=LMSYS) for s in self.seeds}
        return self._lmsys

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


# What tells one run of the reproduction from another (all share the model, hardware and pools):
# a row's key is its workload and these fields; a job's, the same fields of its setup.
ROW_KEY = ("rate", "policy", "transfer_mode", "xfer_budget", "alpha", "beta_f", "beta_b", "admit_watermark",
           "min_residency_s", "rotary_yields", "slo_chunking", "enable_prefix_caching")  # fmt: skip
FIGURE_WORKLOADS = {"fig16": "sharegpt", "ablation": "sharegpt", "fig16_lmsys": "lmsys"}  # the others: conversations


def row_key(workload: str, row: dict) -> str:
    return repr((workload, *(row[k] for k in ROW_KEY)))


def job_key(workload: str, job: sweep.Job) -> str:
    cfg = job.setup.cfg
    fields = {k: getattr(cfg, k) for k in ROW_KEY[3:]}
    policy = "neo" if job.setup.neo_host_blocks else cfg.policy
    return row_key(workload, {"rate": job.rate, "policy": policy, "transfer_mode": job.setup.transfer_mode, **fields})


def reuse_rows(ctx: Ctx, record: dict, rerun: set[str]) -> None:
    """Seed `ctx`'s rows with a previous run's (`record`, its rows file), but for the policies
    in `rerun`: only their jobs then run again."""
    for fig, rows in record.items():
        if fig.startswith(("fig", "ablation")) and isinstance(rows, list):
            wl = FIGURE_WORKLOADS.get(fig, "conversations")
            for r in rows:
                if r["policy"] not in rerun and wl not in rerun:
                    ctx._rows[row_key(wl, r)] = {k: v for k, v in r.items() if k != "variant"}


def simulated_records(items: list, setup: engine.SimSetup) -> list[RequestRecord]:
    return engine.simulate(items, setup).records


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=500, help="ShareGPT requests per run (default %(default)s)")
    p.add_argument(
        "--conversations", type=int, default=CONVERSATIONS, help="ShareGPT conversations per run (default %(default)s)"
    )
    p.add_argument("--rates", type=sweep._floats, default=list(RATES), help="requests/s (default 2,4,6,8,12)")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--num-seeds", type=int, default=3, help="seeds per run, from --seed (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="the clients' max_tokens cap (default %(default)s)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: the CPUs, %(default)s)")
    p.add_argument("--out", type=Path, default=HERE / "REPRODUCTION.md")
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument(
        "--rerun",
        type=sweep._strs,
        default=None,
        help="run only these policies (or workloads: sharegpt, lmsys, conversations) again, the other rows taken "
        "from --results' rows file (after a policy's code changed)",
    )
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
    before = json.loads((out / reproduction.ROWS_FILE).read_text()) if args.rerun else None
    if before:
        reuse_rows(ctx, before, set(args.rerun))
    out.mkdir(parents=True, exist_ok=True)
    top, conv_top = max(args.rates), max(CONV_RATES)
    res: dict = {"fig16": fig16(ctx), "fig16_lmsys": fig16(ctx, "lmsys"), "fig16_conv": fig16(ctx, "conversations")}
    res["ablation"] = ablation(ctx, "sharegpt", top)
    res["ablation_conv"] = ablation(ctx, "conversations", conv_top)
    fig1(ctx, conv_top, out)
    res["fig17"] = fig17(ctx, conv_top)
    res["knobs"] = knob_sweeps(ctx, CONV_KNOB_RATE)
    res["table1"] = table1(ctx)
    record = write_results(res, out)
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
    print(f"wrote {args.out} and {out}/ in {time.perf_counter() - t0:.0f} s ({ctx.num_runs} runs)", file=sys.stderr)
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


def write_results(res: dict, out: Path) -> dict[str, list[dict]]:
    """One CSV per figure and the plots; returns the rows by figure, as the rows file keeps them."""
    figs = {k: v for k, v in res.items() if k.startswith(("fig", "ablation")) or k == "table1"}
    figs.update({f"fig_{k}": v for k, v in res["knobs"].items()})
    for key, rows in figs.items():  # rows of a --rerun may have fields the reused ones lack: one header for all
        columns = list(dict.fromkeys(k for r in rows for k in r))
        sweep.write_outputs([{k: r.get(k) for k in columns} for r in rows], None, out / f"{key}.csv", {})
    plots.plot_attainment(res["fig16"], out, "Qwen2.5-32B on gh200 (calibrated), ShareGPT", "fig16")
    plots.plot_attainment(res["fig16_conv"], out, "Qwen2.5-32B on gh200 (calibrated), conversations", "fig16_conv")
    plots.plot_attainment(res["fig17"], out, "ablation", "fig17")
    for k, rows in res["knobs"].items():
        plots.plot_sweep(rows, k, out / f"fig_{k}.png", f"{k} sweep (conversations)", by="policy")
    return figs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.sim.reproduce", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
