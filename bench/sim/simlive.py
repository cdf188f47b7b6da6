"""`superinfer bench simlive`: does the simulator agree with the live server on this machine?

Each policy of `--policies` (fcfs, lvf-paper, lvf) at each load of `--rates` (three under KV
pressure, one past capacity, on a pool of `--hbm-blocks` that holds a few requests' KV), the
same configuration for the server and the simulator:

1. Per policy, `superinfer serve` starts with that configuration and `--step-trace`, and
   serves one seeded ShareGPT trace (`--seed`) per rate, one after the other. Requests longer
   than the pool are left out of every trace (a server refuses them, and the replay could not
   place them); their count is printed, and more are sampled so that each trace has its size.
2. Two calibration traces (seeds `--calib-seed` and the next, half the size, `--calib-rate`)
   are served by the first policy's server before its traces and by the last one's after its
   traces: a machine whose load drifts meets the evaluation halfway.
3. Calibration, on the two calibration traces only. The scheduler's step trace gives every
   served step's compute time; which work each step did is re-derived by replaying the run
   through the same scheduler core (the live arrivals, from the scheduler's log, and the
   result times, planning as the service's loop does: `replay_plans`). `live_scale` = their
   served compute / what `bench calibrate`'s step model (`--step-model`, its `cpu` profile;
   `--micro` measures one in the run) prices the same steps at; the `cpu-live` profile is
   that profile with its step model scaled, plus two live terms (bench/sim/costmodel.py):
   `step_gap_ms`, the median of what a busy step's result period holds beyond its compute
   and its swap-in wait, and `client_latency_ms`, the median of each request's client TTFT
   minus the scheduler's (its `request_finished` log line).
4. Every evaluated trace is simulated with that profile; the table shows, per policy and
   load, preemptions and TTFT/TBT attainment live and simulated side by side with their gap
   in points (flagged past `POINTS`), and the p50s. Each evaluated trace's served compute
   over the calibrated price is printed (not used): how far the machine's speed drifted.
   The JSON (`--json`) and a line of history (`--history`) go under bench/results/.

What makes served steps differ from the micro-benchmark: it times the runner with the
machine to itself. Served on two shared cores, the same steps computed ~2.3x slower on an
otherwise quiet machine: the worker's torch runs two threads, and the gateway
(detokenization, SSE), the scheduler and the load client take a core during its steps (with
one torch thread the served steps matched the one-thread micro-benchmark). The gap between
steps is about a millisecond (on the CPU the scheduler plans each step after the previous
result: `config.default_pipeline_depth`);
the HTTP path adds ~8 ms to TTFT. Why one scale and not a refit of the four terms on served
steps: few of those steps prefill, so a refit leaves the prefill cost (hence TTFT) loose,
and decode count and KV read move together; under other load the micro-benchmark itself
swings (its fit is kept from a quiet moment: `--step-model`).
Outputs are capped at `--max-output-tokens` and traces are short (16 requests) so that the
12 served traces and two calibration traces take about 10 minutes on a quiet machine (the
simulated durations; a loaded one takes several times that); a request is 6 points of a
trace's TTFT attainment. On 64 blocks the simulator puts capacity near 0.45 req/s (fcfs'
TTFT attainment falls from there); 1.0 req/s is past it for every policy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path

from bench.live.server import REPO, start_server
from bench.live.workload import WorkItem, draw_arrivals, load_workload
from bench.report.metrics import summarize
from bench.sim import calibrate, engine
from bench.sim.costmodel import MODELS, PROFILE_DIR, StepWork, hardware_from_dict
from bench.sim.replay import LiveRun, Pools, Served, live_profile, serve_trace, served_ratio, step_gap_s
from services.cli import build_parser
from services.scheduler.core import POLICIES, SchedulerConfig
from shared.config import DEFAULT_BLOCK_SIZE, default_pipeline_depth

HERE = Path(__file__).resolve().parents[1]  # bench/
RESULTS = HERE / "results"
HISTORY = RESULTS / "simlive_runs.jsonl"
STEP_TRACE = "steps.jsonl"
AGREE = 0.25
MAX_CONTEXT = 8192  # SmolLM2's context window
POINTS = 10  # sim and live attainment further apart than this are explained (bench/REPRODUCTION.md)
POLICIES_RUN = ("fcfs", "lvf-paper", "lvf")
RATES = (0.3, 0.45, 0.6, 1.0)  # req/s: three under KV pressure, one past capacity (64 blocks)
KEYS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p90_ms", "tbt_p99_ms")
ATTAIN = ("ttft_attainment", "tbt_attainment", "slo_attainment")


@dataclass(frozen=True)
class Setting:
    """The one configuration both the server and the simulator run."""

    num_requests: int = 16
    rate: float = 0.45  # the calibration traces' (the evaluated ones run at each of `--rates`)
    seed: int = 0
    calib_seed: int = 1000
    max_output_tokens: int = 192
    policy: str = SchedulerConfig.policy
    ttft_slo: float = SchedulerConfig.ttft_slo
    tbt_slo: float = SchedulerConfig.tbt_slo
    hbm_blocks: int = 64  # ~2-3 ShareGPT requests' KV: pressure from the lowest rate on
    dram_gb: float = 2.0
    max_batched_tokens: int = SchedulerConfig.max_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    xfer_budget: int = SchedulerConfig().b_xfer
    transfer_mode: str = "duplex"
    pipeline_depth: int = default_pipeline_depth(on_cpu=True)  # the server runs on this machine's CPU

    def server_argv(self, step_trace: Path) -> list[str]:
        return [
            *("--policy", self.policy, "--ttft-slo", str(self.ttft_slo), "--tbt-slo", str(self.tbt_slo)),
            *("--hbm-blocks", str(self.hbm_blocks), "--dram-gb", str(self.dram_gb)),
            *("--max-batched-tokens", str(self.max_batched_tokens), "--max-num-seqs", str(self.max_num_seqs)),
            *("--xfer-budget", str(self.xfer_budget), "--transfer-mode", self.transfer_mode),
            *("--pipeline-depth", str(self.pipeline_depth)),
            *("--step-trace", str(step_trace), "--admin-bind", "off"),
        ]

    def scheduler_config(self) -> SchedulerConfig:
        """What the server's scheduler runs: its command line, parsed as the server parses it."""
        return SchedulerConfig.from_flags(build_parser().parse_args(["serve", *self.server_argv(Path(STEP_TRACE))]))


def trace(setting: Setting, seed: int, tokenizer, num_requests: int | None = None) -> list[WorkItem]:
    """ShareGPT requests with Poisson arrivals at the setting's rate, outputs capped, each
    fitting the KV pool whole (`fits_pool`)."""
    return fitting_trace(setting, seed, tokenizer, num_requests or setting.num_requests)[0]


def fitting_trace(setting: Setting, seed: int, tokenizer, num: int) -> tuple[list[WorkItem], int]:
    """`num` requests that fit the pool, and how many of those sampled before them did not
    (left out on both sides: the server refuses them, 400, and the replay could not place them).
    Arrivals are drawn for the kept requests, so the rate is the setting's."""
    drawn: list[WorkItem] = []
    num_draw = num
    while True:
        items = load_workload("sharegpt", num_draw, setting.rate, tokenizer, seed=seed)
        items = [replace(it, output_tokens=min(it.output_tokens, setting.max_output_tokens)) for it in items]
        drawn = [it for it in items if fits_pool(it, setting)]
        if len(drawn) >= num or len(items) < num_draw:
            break
        num_draw *= 2
    kept = drawn[:num]
    last = items.index(kept[-1]) if kept else len(items) - 1
    num_left_out = sum(1 for it in items[: last + 1] if not fits_pool(it, setting))
    return draw_arrivals(kept, setting.rate, seed=seed), num_left_out


def fits_pool(item: WorkItem, setting: Setting) -> bool:
    """Prompt and output within the KV pool (and SmolLM2's context): else no server can run it."""
    num_tokens = item.prompt_tokens + item.output_tokens
    return num_tokens <= min(setting.hbm_blocks * DEFAULT_BLOCK_SIZE, MAX_CONTEXT)


# ---------------------------------------------------------------- calibration


@dataclass
class Trace:
    """One served trace and what served it (its server's log, its configuration)."""

    run: LiveRun
    items: list[WorkItem]
    log_path: Path
    setting: Setting

    def served(self, pools: Pools) -> Served:
        st = self.setting
        return Served.of(self.run, self.items, self.log_path, st.scheduler_config(), pools, st.pipeline_depth)


def calibrate_live(traces: list[Trace], pools: Pools, micro: dict) -> dict:
    """The `cpu-live` profile from the calibration traces served before and after the
    evaluated ones (a machine whose load drifts meets the evaluation halfway)."""
    served = [t.served(pools) for t in traces]
    scale = served_ratio([x for s in served for x in s.samples], micro)
    latencies = [x for s in served for x in s.latencies]
    gap = step_gap_s([step for t in traces for step in t.run.steps])  # a run's first step follows idle: skipped
    profile = live_profile(micro, scale, gap, statistics.median(latencies) if latencies else 0.0)
    return {
        "profile": profile,
        "ratios": [served_ratio(s.samples, profile) for s in served],
        # Served over calibrated compute of the steps that prefill and of the decode-only ones:
        # one scale prices both only if these agree (the evaluated traces' are in their rows).
        "ratio_by_kind": ratio_by_kind([x for s in served for x in s.samples], profile),
        "num_live_steps": [len(t.run.steps) for t in traces],
        "replay_same_samples": [s.same for s in served],
        "num_matched": len(latencies),
        "live": [summarize_trace(t) for t in traces],
        "load": [t.run.load for t in traces],
    }


def ratio_by_kind(samples: list[tuple[StepWork, float]], profile: dict) -> dict:
    """Served over `profile`'s compute, apart for steps with prefill tokens and decode-only steps."""
    kinds = {"prefill": [x for x in samples if x[0].num_prefill_tokens]}
    kinds["decode"] = [x for x in samples if not x[0].num_prefill_tokens]
    return {k: served_ratio(v, profile) if v else None for k, v in kinds.items()}


def summarize_trace(t: Trace) -> dict:
    return slim(summarize(t.run.records, t.setting.ttft_slo, t.setting.tbt_slo, t.run.duration_s))


def calibrate_micro(out: Path, reps: int = 3) -> dict:
    """`bench calibrate` (a subprocess with the worker's torch threads, the default), keeping
    each shape's fastest repetition."""
    cmd = [sys.executable, "-m", "services.cli", "bench", "calibrate", "--keep", "min", "--reps", str(reps)]
    subprocess.run([*cmd, "--out", str(out)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


# ---------------------------------------------------------------- the simulated side and the comparison


def simulate(items: list[WorkItem], profile: dict, setting: Setting, pools: Pools) -> engine.SimRun:
    hw = hardware_from_dict(profile)
    cfg = setting.scheduler_config()
    setup = engine.make_setup(
        hw, MODELS["smollm2"], cfg, setting.transfer_mode, pools.num_hbm_blocks, pools.num_dram_blocks,
        depth=setting.pipeline_depth,
    )
    return engine.simulate([replace(it, prompt="") for it in items], setup)


def compare(live: dict, simulated: dict) -> dict:
    """Ratios sim/live of the latency percentiles, and whether each p50 is within 25%."""
    ratio = lambda k: simulated[k] / live[k] if live.get(k) and simulated.get(k) is not None else None  # noqa: E731
    out = {f"{k.removesuffix('_ms')}_ratio": ratio(k) for k in KEYS}
    within = {k: r is not None and abs(r - 1.0) <= AGREE for k, r in out.items() if "p50" in k}
    return {**out, "within": within, "within_25pct": all(within.values())}


def slim(summary: dict) -> dict:
    keep = ("num_requests", "completed", "failed", "duration_s", "output_tok_s", *ATTAIN, *KEYS)
    return {k: summary[k] for k in keep} | {k: v for k, v in summary.items() if k.endswith("_mean_ms")}


def describe_profile(prof: dict) -> str:
    scale = prof["live_scale"]
    lin = {k: v / scale for k, v in prof["linear"].items() if k != "model"}
    return (
        f"served step = ({lin['overhead_s'] * 1e3:.1f} ms + {lin['prefill_token_s'] * 1e6:.0f} us/prefill"
        f" + {lin['decode_token_s'] * 1e6:.0f} us/decode + {lin['kv_token_s'] * 1e6:.2f} us/KV) "
        f"x {scale:.2f}, gap {prof['step_gap_ms']:.2f} ms, client latency {prof['client_latency_ms']:.1f} ms"
    )


# ---------------------------------------------------------------- the runs


def run_matrix(
    base: Setting, policies: list[str], rates: list[float], log_dir: Path, micro: dict | None = None
) -> dict:
    """Serve each policy at each rate, calibrate, simulate the same traces (the module's
    docstring). `micro`: the micro-benchmark profile whose step model is scaled; None
    measures one first."""
    from shared.modelfile import resolve_model_path
    from shared.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(resolve_model_path(None))
    half = max(1, base.num_requests // 2)
    calib = [fitting_trace(base, base.calib_seed + i, tokenizer, half)[0] for i in (0, 1)]
    cells = [replace(base, policy=p, rate=r) for p in policies for r in rates]
    work = {c: fitting_trace(c, c.seed, tokenizer, c.num_requests) for c in cells}
    if num_left_out := max(n for _, n in work.values()):
        print(
            f"left out on both sides: up to {num_left_out} sampled requests a trace longer than the "
            f"{base.hbm_blocks}-block KV pool ({base.hbm_blocks * DEFAULT_BLOCK_SIZE} tokens)",
            file=sys.stderr,
        )
    served: dict[Setting, tuple[Trace, int]] = {}
    calib_traces: list[Trace] = []
    pools = None
    for i, policy in enumerate(policies):
        setting = replace(base, policy=policy)
        steps = log_dir / f"steps-{policy}.jsonl"
        server = start_server(log_dir, *setting.server_argv(steps))
        try:
            micro = micro or calibrate_micro(log_dir / "micro.json")
            pools = pools or Pools.of(server)
            serve = lambda items, st: Trace(serve_trace(server, items, steps), items, server.log_path, st)  # noqa: E731
            if i == 0:
                calib_traces.append(serve(calib[0], setting))
            for cell in (c for c in cells if c.policy == policy):
                before = server.scheduler_stats()["num_preemptions"]
                served[cell] = (serve(work[cell][0], cell), server.scheduler_stats()["num_preemptions"] - before)
            if i == len(policies) - 1:
                calib_traces.append(serve(calib[1], setting))
        finally:
            server.stop()
    cal = calibrate_live(calib_traces, pools, micro)
    print(f"calibrated: {describe_profile(cal['profile'])}", file=sys.stderr)
    rows = [cell_row(*served[c], work[c][1], cal["profile"], pools) for c in cells]
    return {"setting": asdict(base), "rows": rows, "calibration": cal, "wall_s": time.perf_counter() - t0}


def cell_row(t: Trace, num_preempted: int, num_left_out: int, profile: dict, pools: Pools) -> dict:
    """One policy at one rate: live and simulated figures side by side."""
    st = t.setting
    srun = simulate(t.items, profile, st, pools)
    res = {
        "policy": st.policy,
        "rate": st.rate,
        "num_left_out": num_left_out,
        "live": summarize_trace(t),
        "sim": slim(summarize(srun.records, st.ttft_slo, st.tbt_slo, srun.duration_s)),
        "preemptions": [num_preempted, srun.stats["num_preemptions"]],
        "steps": [len(t.run.steps), len(srun.step_ms)],
        "load": list(t.run.load),
        # Not used by the simulator: the evaluated steps against the calibrated model (the drift).
        "eval_ratio_unused": served_ratio(samples := t.served(pools).samples, profile),
        "eval_ratio_by_kind": ratio_by_kind(samples, profile),
    }
    return res | compare(res["live"], res["sim"]) | points(res["live"], res["sim"])


def points(live: dict, simulated: dict) -> dict:
    """Sim minus live attainment, in points, and whether any passes ±POINTS."""
    gap = lambda k: None if None in (live[k], simulated[k]) else 100 * (simulated[k] - live[k])  # noqa: E731
    out = {f"{k.removesuffix('_attainment')}_points": gap(k) for k in ATTAIN}
    return out | {"differs": any(v is not None and abs(v) > POINTS for v in out.values())}


def format_rows(res: dict) -> str:
    pct = lambda v: "  n/a" if v is None else f"{100 * v:5.1f}"  # noqa: E731
    num = lambda v: "n/a" if v is None else f"{v:.0f}"  # noqa: E731
    lines = [
        f"{'policy':<20}{'req/s':>6}  {'preempt':>9}  {'TTFT% live  sim     Δ':>22}  {'TBT% live  sim     Δ':>21}"
        f"  {'TTFT p50 ms':>14}  {'TBT p50 ms':>11}"
    ]
    for r in res["rows"]:
        lv, sm = r["live"], r["sim"]
        flag = f"  >{POINTS} points" if r["differs"] else ""
        lines.append(
            f"{r['policy']:<20}{r['rate']:>6g}  {r['preemptions'][0]:>4}/{r['preemptions'][1]:<4}"
            f"  {pct(lv['ttft_attainment']):>10} {pct(sm['ttft_attainment'])} {r['ttft_points']:+6.1f}"
            f"  {pct(lv['tbt_attainment']):>9} {pct(sm['tbt_attainment'])} {r['tbt_points']:+6.1f}"
            f"  {num(lv['ttft_p50_ms']):>6}/{num(sm['ttft_p50_ms']):<7}"
            f"  {num(lv['tbt_p50_ms']):>4}/{num(sm['tbt_p50_ms']):<6}{flag}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- runs on record


def history_line(res: dict) -> dict:
    """One run, as bench/results/simlive_runs.jsonl keeps it (REPRODUCTION.md reads them)."""
    prof, cal = res["calibration"]["profile"], res["calibration"]
    keep = ("ttft_p50_ms", "tbt_p50_ms", *ATTAIN)
    rows = [
        {k: r[k] for k in ("policy", "rate", "preemptions", "num_left_out", "differs")}
        | {k: r[k] for k in ("ttft_p50_ratio", "tbt_p50_ratio", "ttft_points", "tbt_points")}
        | {side: {k: r[side][k] for k in keep} for side in ("live", "sim")}
        | {"num_requests": r["live"]["num_requests"], "eval_ratio_unused": round(r["eval_ratio_unused"], 4)}
        for r in res["rows"]
    ]
    return {
        "when": datetime.now().astimezone().isoformat(timespec="seconds"),
        "setting": res["setting"],
        "load": [round(cal["load"][0][0], 2), round(cal["load"][-1][1], 2)],
        "rows": rows,
        **{k: prof[k] for k in ("live_scale", "step_gap_ms", "client_latency_ms")},
        "calib_ratios": [round(x, 4) for x in cal["ratios"]],
    }


# ---------------------------------------------------------------- command line


def _strs(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in _strs(text)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Setting()
    p.add_argument("--policies", type=_strs, default=list(POLICIES_RUN), help="comma-separated (default %(default)s)")
    p.add_argument("--rates", type=_floats, default=list(RATES), help="requests/s, Poisson (default %(default)s)")
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="per trace (default %(default)s)")
    p.add_argument("--calib-rate", type=float, default=d.rate, help="the calibration traces' (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="the evaluated traces (default %(default)s)")
    p.add_argument("--calib-seed", type=int, default=d.calib_seed, help="calibration: it, +1 (default %(default)s)")
    p.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens, help="cap (default %(default)s)")
    p.add_argument("--ttft-slo", type=float, default=d.ttft_slo, help="S_F, seconds (default %(default)s)")
    p.add_argument("--tbt-slo", type=float, default=d.tbt_slo, help="S_B, seconds (default %(default)s)")
    p.add_argument("--hbm-blocks", type=int, default=d.hbm_blocks, help="KV pool, blocks (default %(default)s)")
    p.add_argument("--dram-gb", type=float, default=d.dram_gb, help="host KV pool, GiB (default %(default)s)")
    p.add_argument("--max-batched-tokens", type=int, default=d.max_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--xfer-budget", type=int, default=d.xfer_budget)
    p.add_argument(
        "--step-model",
        type=Path,
        default=PROFILE_DIR / "cpu.json",
        help="profile whose step model is scaled to served speed (default: `bench calibrate`'s, %(default)s)",
    )
    p.add_argument("--micro", action="store_true", help="measure that step model in the run instead (+20-60 s)")
    p.add_argument("--json", type=Path, default=RESULTS / "simlive_cpu.json")
    p.add_argument("--history", type=Path, default=HISTORY, help="append the run's summary here ('' = nowhere)")
    p.add_argument("--profile-out", type=Path, default=None, help="also write the `cpu-live` profile here")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the server logs and step traces here")


def run(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.policies) - set(POLICIES))
    if unknown or not args.policies or not args.rates:
        raise SystemExit(f"simlive: policies from {', '.join(POLICIES)} and at least one rate (unknown: {unknown})")
    fields = {k: getattr(args, k) for k in Setting.__dataclass_fields__ if hasattr(args, k)}
    base = Setting(**fields | {"rate": args.calib_rate, "policy": args.policies[0]})  # the calibration traces'

    with tempfile.TemporaryDirectory(prefix="simlive-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        micro = None if args.micro else json.loads(args.step_model.read_text())
        res = run_matrix(base, args.policies, args.rates, log_dir, micro)
    print(format_rows(res))
    cal = res["calibration"]
    same = "/".join(f"{100 * x:.0f}%" for x in cal["replay_same_samples"])
    print(f"calibration: {describe_profile(cal['profile'])}; replayed steps sampling as live: {same}")
    kind = lambda d: "/".join("n/a" if d[k] is None else f"{d[k]:.2f}" for k in ("prefill", "decode"))  # noqa: E731
    by_kind = ", ".join(kind(r["eval_ratio_by_kind"]) for r in res["rows"])
    print(f"served / calibrated compute, steps with prefill / decode-only: {kind(cal['ratio_by_kind'])}; {by_kind}")
    before, after = cal["ratios"][0], cal["ratios"][-1]
    drift = ", ".join(f"{r['eval_ratio_unused']:.2f}" for r in res["rows"])
    print(
        f"drift (served / calibrated compute): {before:.2f} before, {after:.2f} after the evaluated traces, "
        f"{drift} on them (not used); {res['wall_s']:.0f} s"
    )
    for path in (args.json, args.history if args.history and args.history.name else None, args.profile_out):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no bench/results/
    args.json.write_text(json.dumps(res, indent=1))
    if args.history and args.history.name:
        with open(args.history, "a") as f:
            f.write(json.dumps(history_line(res)) + "\n")
    if args.profile_out:
        args.profile_out.write_text(calibrate.dump(cal["profile"]))
    numbers = [r[side][k] for r in res["rows"] for side in ("live", "sim") for k in ("ttft_p50_ms", "tbt_p50_ms")]
    return 0 if all(v is not None and math.isfinite(v) for v in numbers) else 1
