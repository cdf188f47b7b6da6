"""`superinfer bench simlive`: does the simulator agree with the live server on this machine?

One run, one configuration (policy, SLOs, `--hbm-blocks`, chunk budget, `--max-num-seqs`),
the same values for the server and the simulator:

1. `superinfer serve` starts with that configuration and `--step-trace`.
2. Three ShareGPT traces at the same rate are served one after the other: a calibration
   trace (seed `--calib-seed`, half the size), the evaluated trace (`--seed`), a second
   calibration trace (the next seed, half the size). Calibrating on both sides of the
   evaluation lets a machine whose load drifts meet it halfway.
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
4. The evaluated trace is simulated with that profile; the table shows live and simulated
   TTFT/TBT percentiles and attainment, sim/live, and whether each p50 is within 25%. The
   evaluated steps' served compute over the calibrated price is printed beside it (not
   used): how far the machine's speed drifted.

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
Outputs are capped at `--max-output-tokens` so that a run fits in a few minutes. The default
rate (0.5 req/s) keeps the server busy with a KV pool that forces rotations, and queueing
shows in the TTFT tail (p90 ~10x p50); at 0.8 req/s TTFT p50 sits on the knee of the
queueing curve, where a 10% slower step doubles it, live or simulated.
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
from bench.live.workload import WorkItem, load_workload
from bench.report.metrics import summarize
from bench.sim import calibrate, engine
from bench.sim.costmodel import MODELS, PROFILE_DIR, hardware_from_dict
from bench.sim.replay import LiveRun, Pools, Served, live_profile, serve_trace, served_ratio, step_gap_s
from services.cli import build_parser
from services.scheduler.core import POLICIES, SchedulerConfig
from shared.config import default_pipeline_depth

HERE = Path(__file__).resolve().parents[1]  # bench/
HISTORY = HERE / "results" / "simlive_runs.jsonl"
STEP_TRACE = "steps.jsonl"
AGREE = 0.25
KEYS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p90_ms", "tbt_p99_ms")
ATTAIN = ("ttft_attainment", "tbt_attainment", "slo_attainment")


@dataclass(frozen=True)
class Setting:
    """The one configuration both the server and the simulator run."""

    num_requests: int = 40
    rate: float = 0.5
    seed: int = 0
    calib_seed: int = 1000
    max_output_tokens: int = 192
    policy: str = SchedulerConfig.policy
    ttft_slo: float = SchedulerConfig.ttft_slo
    tbt_slo: float = SchedulerConfig.tbt_slo
    hbm_blocks: int = 128
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
    """ShareGPT requests with Poisson arrivals at the setting's rate, outputs capped."""
    items = load_workload("sharegpt", num_requests or setting.num_requests, setting.rate, tokenizer, seed=seed)
    return [replace(it, output_tokens=min(it.output_tokens, setting.max_output_tokens)) for it in items]


# ---------------------------------------------------------------- calibration


def calibrate_live(
    runs: list[tuple[LiveRun, list[WorkItem]]], log_path: Path, setting: Setting, pools: Pools, micro: dict
) -> dict:
    """The `cpu-live` profile from the calibration traces served before and after the
    evaluated one (a machine whose load drifts meets the evaluation halfway)."""
    cfg, depth = setting.scheduler_config(), setting.pipeline_depth
    served = [Served.of(run, items, log_path, cfg, pools, depth) for run, items in runs]
    scale = served_ratio([x for s in served for x in s.samples], micro)
    latencies = [x for s in served for x in s.latencies]
    gap = step_gap_s([step for run, _ in runs for step in run.steps])  # a run's first step follows idle: skipped
    profile = live_profile(micro, scale, gap, statistics.median(latencies) if latencies else 0.0)
    return {
        "profile": profile,
        "ratios": [served_ratio(s.samples, profile) for s in served],
        "num_live_steps": [len(run.steps) for run, _ in runs],
        "replay_same_samples": [s.same for s in served],
        "num_matched": len(latencies),
        "live": [slim(summarize(run.records, setting.ttft_slo, setting.tbt_slo, run.duration_s)) for run, _ in runs],
        "load": [run.load for run, _ in runs],
    }


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


def format_table(res: dict) -> str:
    live, simulated = res["live"], res["sim"]
    num = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = [f"{'':<18}{'live':>10}{'sim':>10}{'sim/live':>10}  within 25%"]
    for k in KEYS:
        name = f"{k.removesuffix('_ms')}_ratio"
        r = "n/a" if res[name] is None else f"{res[name]:.2f}"
        flag = {True: "yes", False: "NO"}.get(res["within"].get(name), "")
        lines.append(f"{k:<18}{num(live[k]):>10}{num(simulated[k]):>10}{r:>10}  {flag}")
    lines += [f"{k:<18}{pct(live[k]):>10}{pct(simulated[k]):>10}" for k in ATTAIN]
    return "\n".join(lines)


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


# ---------------------------------------------------------------- one run


def run_once(setting: Setting, log_dir: Path, micro: dict | None = None) -> dict:
    """Serve, calibrate, evaluate, simulate (see the module's docstring). `micro`: the
    micro-benchmark profile whose step model is scaled; None measures one first."""
    from shared.tokenizer import load_tokenizer
    from shared.modelfile import resolve_model_path

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(resolve_model_path(None))
    half = max(1, setting.num_requests // 2)
    before, after = (trace(setting, setting.calib_seed + i, tokenizer, half) for i in (0, 1))
    items = trace(setting, setting.seed, tokenizer)
    server = start_server(log_dir, *setting.server_argv(log_dir / STEP_TRACE))
    try:
        micro = micro or calibrate_micro(log_dir / "micro.json")
        pools = Pools.of(server)
        runs = [serve_trace(server, trace_, log_dir / STEP_TRACE) for trace_ in (before, items, after)]
    finally:
        server.stop()
    cal = calibrate_live([(runs[0], before), (runs[2], after)], server.log_path, setting, pools, micro)
    print(f"calibrated: {describe_profile(cal['profile'])}", file=sys.stderr)
    srun = simulate(items, cal["profile"], setting, pools)
    live = runs[1]
    res = {
        "setting": asdict(setting),
        "live": slim(summarize(live.records, setting.ttft_slo, setting.tbt_slo, live.duration_s)),
        "sim": slim(summarize(srun.records, setting.ttft_slo, setting.tbt_slo, srun.duration_s)),
        "num_live_steps": len(live.steps),
        "num_sim_steps": len(srun.step_ms),
        "load": [runs[0].load[0], runs[2].load[1]],
        # Not used by the simulator: the evaluated steps against the calibrated model (the drift).
        "eval_ratio_unused": served_ratio(
            Served.of(live, items, server.log_path, setting.scheduler_config(), pools, setting.pipeline_depth).samples,
            cal["profile"],
        ),
    }
    return res | compare(res["live"], res["sim"]) | {"calibration": cal, "wall_s": time.perf_counter() - t0}


# ---------------------------------------------------------------- runs on record


def history_line(res: dict) -> dict:
    """One run, as bench/results/simlive_runs.jsonl keeps it (REPRODUCTION.md reads them)."""
    prof, cal = res["calibration"]["profile"], res["calibration"]
    sides = {side: {k: res[side][k] for k in ("ttft_p50_ms", "tbt_p50_ms", *ATTAIN)} for side in ("live", "sim")}
    return {
        "when": datetime.now().astimezone().isoformat(timespec="seconds"),
        "setting": res["setting"],
        "load": [round(x, 2) for x in res["load"]],
        **sides,
        **{k: res[k] for k in ("ttft_p50_ratio", "tbt_p50_ratio", "within_25pct", "eval_ratio_unused")},
        **{k: prof[k] for k in ("live_scale", "step_gap_ms", "client_latency_ms")},
        "calib_ratios": [round(x, 4) for x in cal["ratios"]],
    }


# ---------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Setting()
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="per trace (default %(default)s)")
    p.add_argument("--rate", type=float, default=d.rate, help="requests/s, Poisson (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="the evaluated trace (default %(default)s)")
    p.add_argument("--calib-seed", type=int, default=d.calib_seed, help="the calibration trace (default %(default)s)")
    p.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens, help="cap (default %(default)s)")
    p.add_argument("--policy", choices=POLICIES, default=d.policy)
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
    p.add_argument("--json", type=Path, default=HERE / "results" / "simlive_cpu.json")
    p.add_argument("--history", type=Path, default=HISTORY, help="append the run's summary here ('' = nowhere)")
    p.add_argument("--profile-out", type=Path, default=None, help="also write the `cpu-live` profile here")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the server log and step trace here")


def run(args: argparse.Namespace) -> int:
    setting = Setting(**{k: getattr(args, k) for k in Setting.__dataclass_fields__ if hasattr(args, k)})
    with tempfile.TemporaryDirectory(prefix="simlive-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        res = run_once(setting, log_dir, None if args.micro else json.loads(args.step_model.read_text()))
    print(format_table(res))
    cal = res["calibration"]
    same = "/".join(f"{100 * x:.0f}%" for x in cal["replay_same_samples"])
    print(f"calibration: {describe_profile(cal['profile'])}; replayed steps sampling as live: {same}")
    before, after = cal["ratios"]
    print(
        f"drift (served / calibrated compute): {before:.2f} before, {after:.2f} after the evaluated trace, "
        f"{res['eval_ratio_unused']:.2f} on it (not used); load average {res['load'][0]:.2f} -> "
        f"{res['load'][1]:.2f}; {res['wall_s']:.0f} s"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    if args.history and args.history.name:
        with open(args.history, "a") as f:
            f.write(json.dumps(history_line(res)) + "\n")
    if args.profile_out:
        args.profile_out.write_text(calibrate.dump(cal["profile"]))
    numbers = [res[side][k] for side in ("live", "sim") for k in ("ttft_p50_ms", "tbt_p50_ms")]
    return 0 if all(v is not None and math.isfinite(v) for v in numbers) else 1
