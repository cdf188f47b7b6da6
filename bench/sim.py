"""`superinfer bench sim`: the live scheduler core on a virtual clock, with a cost-model worker.

The steps are driven by the live scheduler's own step driver (services/scheduler/driver.py)
on a virtual clock (`run_clock`): requests arrive at their times, the driver keeps
`--pipeline-depth` plans at the worker (2, the live default: plan t+1 is built while t
computes, so a step stalls only if scheduling takes longer; 1 plans each step after the
previous result), and a result, synthesized (one token for every request whose scheduled
tokens reach the end of its known tokens), is applied when the cost model (bench/costmodel.py)
says its step ends. A request that arrives while a step computes is planned at once if the
pipeline has room, as the live loop plans after every message. Fed a live run's arrivals
and result times instead, the same clock re-derives what the live scheduler planned
(`bench simlive`). Output lengths come from the workload: each request asks `max_tokens` =
its output length, so it finishes ("length") exactly there. Per request we record TTFT and
every gap between tokens, then `bench.report.summarize` computes the same metrics as
`bench serve` does against a live server.

Where copies go (`Clock.step`): with a profile's `pipeline` (GPU profiles, the paper's
design) step t+1's copies start as soon as its plan exists, overlapping step t's compute,
and queue on the link behind earlier copies; compute waits only for the swap-ins it reads.
(The live worker holds back the swap-outs and eager mirrors that read blocks step t still
writes until t's compute is done; the model does not, and with eager rotation those are
mostly the one dirty block of each preempted request.) Without it (the `cpu` profile, as
the live worker executes plans one after the other) a step's copies start after the
previous step is done, both directions at once, compute waits for the swap-ins, and the
step ends when compute and the out-direction copies are both done.

A profile measured on the live server (`bench simlive`) adds two of its terms here: the
worker's gap between two steps (`step_gap_ms`: a step starts that long after the previous
one ends at the earliest) and the client's latency on top of the scheduler's token times
(`client_latency_ms`, added to each request's TTFT and end-to-end time).

The scheduling time is modelled (the profile's `sched_ms`, or `--sched-time MS`);
`--sched-time measured` uses the wall time of the real `schedule()` call instead (runs are
then no longer bit-for-bit repeatable).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.costmodel import (
    MODELS,
    Hardware,
    ModelShape,
    StepWork,
    check_pair,
    compute_time,
    load_hardware,
    num_kv_blocks,
    transfer_time,
)
from bench.report import RequestRecord, summarize
from bench.workload import SyntheticSpec, WorkItem, arrival_times, load_workload, with_arrivals
from services.scheduler.core import SchedulerConfig, SchedulerCore
from services.scheduler.core.step import Step
from services.scheduler.driver import Driver
from shared.protocol import AddRequest, Plan, SamplingParams, StepResult, TokenOutput

TOKEN = 1  # the id every synthesized sample carries (never a stop token: no stop ids are set)
# Row keys that depend on this machine's wall clock, not on the simulation.
WALL_KEYS = ("wall_s", "sched_wall_ms_p50", "sched_wall_ms_p99")
KNOBS = ("transfer_mode", "xfer_budget", "alpha", "beta_f", "beta_b")


# ---------------------------------------------------------------- the clock


@dataclass
class Clock:
    """When the link is free again; how one step's copies and compute fall in time."""

    overlap_copies: bool  # copies of a step may run during the previous step's compute
    link_free: float = 0.0
    gap_s: float = 0.0  # the worker's time between the end of one step and the next's start

    def step(
        self,
        plan_at: float,
        prev_end: float,
        sched_s: float,
        compute_s: float,
        in_s: float,
        xfer_s: float,
        reads_in: bool,
    ) -> tuple[float, float]:
        """(compute start, step end) of a step planned at `plan_at` after a step ending at
        `prev_end` (`plan_at` itself when the worker is idle)."""
        ready = plan_at + sched_s
        link_start = max(ready, self.link_free if self.overlap_copies else max(self.link_free, prev_end))
        self.link_free = link_start + xfer_s
        start = max(prev_end + self.gap_s, ready, link_start + in_s if reads_in else ready)
        end = start + compute_s
        return start, end if self.overlap_copies else max(end, self.link_free)


# ---------------------------------------------------------------- one run


@dataclass
class SimSetup:
    """Everything one simulated run depends on (picklable, for the process pool)."""

    cfg: SchedulerConfig
    hardware: Hardware
    model: ModelShape
    transfer_mode: str = "duplex"
    num_hbm_blocks: int = 0
    num_dram_blocks: int = 0
    sched_time: str = "model"  # "model" | "measured" | milliseconds
    check_invariants: bool = False
    pipeline_depth: int = 2  # plans at the worker at once, as the live scheduler keeps


@dataclass
class SimRun:
    records: list[RequestRecord]
    duration_s: float
    stats: dict
    step_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    xfer_ms: list[float] = field(default_factory=list)
    sched_wall_ms: list[float] = field(default_factory=list)
    stall_s: float = 0.0
    # What a live step trace shows: when each step's result is back, how many tokens it sampled.
    step_end_s: list[float] = field(default_factory=list)
    step_num_sampled: list[int] = field(default_factory=list)


def requests_of(items: list[WorkItem]) -> list[AddRequest]:
    """One AddRequest per item: its prompt length in placeholder ids, `max_tokens` = its
    output length (no stop ids: the output ends exactly there)."""
    return [
        AddRequest(str(i), [TOKEN] * it.prompt_tokens, SamplingParams(max_tokens=it.output_tokens, ignore_eos=True))
        for i, it in enumerate(items)
    ]


@dataclass
class InFlight:
    """A plan at the simulated worker."""

    step_id: int
    sampled: list[str]  # request ids that sample in this step
    end: float = math.inf  # when its result is back (the cost model's)


def simulate(items: list[WorkItem], setup: SimSetup) -> SimRun:
    cfg, hw, model = setup.cfg, setup.hardware, setup.model
    max_model_len = min(model.max_position, setup.num_hbm_blocks * cfg.block_size)
    core = SchedulerCore(cfg, setup.num_hbm_blocks, setup.num_dram_blocks, max_model_len)
    requests = requests_of(items)
    num_samples = [0] * len(items)  # samples planned so far (emitted + in flight)
    times: list[list[float]] = [[] for _ in items]
    clock = Clock(hw.pipeline, gap_s=hw.step_gap_s)
    run = SimRun([], 0.0, {})
    fixed_sched = None if setup.sched_time == "measured" else _sched_s(setup.sched_time, hw)
    check = core.check_invariants if setup.check_invariants else lambda: None

    def send(plan: Plan, step: Step, schedule_s: float) -> InFlight:
        """The cost-model worker: when the plan's result is back."""
        run.sched_wall_ms.append(schedule_s * 1e3)
        check()
        work, sampled = plan_work(plan, items, num_samples)
        compute_s = compute_time(hw, model, work)
        x = transfer_time(
            hw, model, setup.transfer_mode, len(plan.swap_in), len(plan.swap_out) + len(plan.eager), cfg.block_size
        )
        busy = driver.in_flight[-1] if driver.in_flight else None
        prev_end = busy.end if busy is not None else step.now
        sched_s = schedule_s if fixed_sched is None else fixed_sched
        start, end = clock.step(step.now, prev_end, sched_s, compute_s, x.in_s, x.total_s, bool(plan.swap_in))
        run.stall_s += start - prev_end if busy is not None else 0.0
        run.step_ms.append((end - prev_end) * 1e3)
        run.step_end_s.append(end)
        run.step_num_sampled.append(len(sampled))
        run.compute_ms.append(compute_s * 1e3)
        run.xfer_ms.append(x.total_s * 1e3)
        return InFlight(plan.step_id, sampled, end)

    def idle() -> None:  # a schedule() call that built no plan
        run.sched_wall_ms.append(driver.schedule_s * 1e3)
        check()

    def applied(outputs: list[TokenOutput], now: float) -> None:
        for out in outputs:
            times[int(out.request_id)].append(now)
        check()

    driver = Driver(core, send, setup.pipeline_depth, time.perf_counter)
    arrivals = sorted(((it.arrival_s, req) for it, req in zip(items, requests)), key=lambda a: a[0])
    run_clock(driver, arrivals, idle=idle, applied=applied)
    if core.has_unfinished():
        raise RuntimeError(f"simulation stuck: {core.stats()}")
    run.records = [_record(it, [t + hw.client_latency_s for t in ts]) for it, ts in zip(items, times)]
    run.duration_s = max((ts[-1] for ts in times if ts), default=0.0) - min((it.arrival_s for it in items), default=0.0)
    run.stats = core.stats()
    return run


def run_clock(
    driver: Driver[InFlight],
    arrivals: list[tuple[float, AddRequest]],
    *,
    start: float = 0.0,
    result_times: list[float] | None = None,
    lag_s: float = 0.0,
    tick_s: float = 0.0,
    idle: Callable[[], None] = lambda: None,
    applied: Callable[[list[TokenOutput], float], None] = lambda outputs, now: None,
) -> None:
    """The virtual clock around the step driver: events in time order, a result before an
    arrival at the same time, and after each the driver plans (`lag_s` later).

    An arrival is added at its time. A result is applied to the oldest plan in flight; it
    comes back at that plan's `end` (the simulator's cost model) or, given `result_times`
    (a replay of a live run), at the next of those (one with no plan in flight is skipped).
    A result followed by another within `tick_s`, no arrival between, is planned after
    both, as the service plans once per tick of its loop. `arrivals` are sorted by time.
    `idle` is called when the driver had nothing to plan, `applied` with each result's
    outputs and time."""
    core, upcoming = driver.core, deque(result_times) if result_times is not None else None

    def next_result() -> float:
        if upcoming is not None:
            return upcoming[0] if upcoming else math.inf
        return driver.in_flight[0].end if driver.in_flight else math.inf

    now, nxt, merged = start, 0, False
    while True:
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            core.add_request(arrivals[nxt][1], arrivals[nxt][0])
            nxt += 1
        if not merged and driver.step(now + lag_s):
            idle()
        arrival, back = arrivals[nxt][0] if nxt < len(arrivals) else math.inf, next_result()
        if arrival < back:
            now, merged = max(now, arrival), False
            continue
        if back == math.inf:
            return
        now = max(now, back)
        if upcoming is not None:
            upcoming.popleft()
        if driver.in_flight:
            f = driver.in_flight[0]
            _, outputs = driver.result(StepResult(f.step_id, f.sampled, [TOKEN] * len(f.sampled)), now)
            applied(outputs, now)
        following = next_result()
        merged = following - now < tick_s and following <= arrival


def plan_work(plan, items: list[WorkItem], num_samples: list[int]) -> tuple[StepWork, list[str]]:
    """What the plan computes, and which requests sample: those whose scheduled tokens
    reach the end of their known tokens (prompt + every sample planned before)."""
    work, sampled = StepWork(), []
    for s in plan.scheduled:
        i = int(s.request_id)
        samples = s.num_computed_tokens + s.num_new_tokens == items[i].prompt_tokens + num_samples[i]
        work.add(s.num_computed_tokens, s.num_new_tokens, samples)
        if samples:
            num_samples[i] += 1
            sampled.append(s.request_id)
    return work, sampled


def _sched_s(sched_time: str, hw: Hardware) -> float:
    return hw.sched_s if sched_time == "model" else float(sched_time) / 1e3


def _record(item: WorkItem, token_times: list[float]) -> RequestRecord:
    if not token_times:
        return RequestRecord(ok=False, prompt_tokens=item.prompt_tokens, arrival_s=item.arrival_s, error="no output")
    return RequestRecord(
        ok=True,
        ttft_s=token_times[0] - item.arrival_s,
        tbt_s=[b - a for a, b in zip(token_times, token_times[1:])],
        e2e_s=token_times[-1] - item.arrival_s,
        output_tokens=len(token_times),
        prompt_tokens=item.prompt_tokens,
        expected_output_tokens=item.output_tokens,
        arrival_s=item.arrival_s,
        start_s=item.arrival_s,
    )


def row_of(run: SimRun, setup: SimSetup, rate: float, ttft_slo: float, tbt_slo: float, wall_s: float) -> dict:
    """One result row: the knobs, the SLO metrics (as `bench serve` reports them) and what
    the scheduler and the worker did."""
    s = summarize(run.records, ttft_slo, tbt_slo, run.duration_s)
    cfg, st = setup.cfg, run.stats
    total_s = sum(run.step_ms) / 1e3
    keep = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p90_ms", "tbt_p99_ms", "e2e_p50_ms")
    return {
        "policy": cfg.policy,
        "rate": rate,
        **{k: getattr(cfg, k) for k in KNOBS if k != "transfer_mode"},
        "transfer_mode": setup.transfer_mode,
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
        "num_hbm_blocks": setup.num_hbm_blocks,
        "num_dram_blocks": setup.num_dram_blocks,
        "duration_s": run.duration_s,
        "step_ms_mean": _mean(run.step_ms),
        "compute_ms_mean": _mean(run.compute_ms),
        "xfer_ms_mean": _mean(run.xfer_ms),
        "stall_share": run.stall_s / total_s if total_s else 0.0,
        "wall_s": wall_s,
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
    t0 = time.perf_counter()
    run = simulate(items, setup)
    return row_of(run, setup, rate, ttft_slo, tbt_slo, time.perf_counter() - t0)


# ---------------------------------------------------------------- sweeps


@dataclass(frozen=True)
class Job:
    rate: float
    setup: SimSetup


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
    bare = [replace(it, prompt="") for it in items]  # the text is not simulated; keep pickles small
    timed = lambda rate: with_arrivals(bare, arrival_times(len(bare), rate, burstiness, seed)) if redraw else bare  # noqa: E731
    args = [(timed(j.rate), j.setup, j.rate, ttft_slo, tbt_slo) for j in jobs]
    if num_procs <= 1 or len(jobs) == 1:
        return [run_one(*a) for a in args]
    with ProcessPoolExecutor(num_procs) as pool:
        return list(pool.map(run_one, *zip(*args)))


def make_setup(
    hw: Hardware,
    model: ModelShape,
    cfg: SchedulerConfig,
    mode: str,
    hbm: int | None = None,
    dram: int | None = None,
    sched_time: str = "model",
    check: bool = False,
    depth: int = 2,
) -> SimSetup:
    num_hbm, num_dram = num_kv_blocks(hw, model, cfg.block_size)
    return SimSetup(cfg, hw, model, mode, hbm or num_hbm, num_dram if dram is None else dram, sched_time, check, depth)


def load_items(
    dataset: str,
    num_requests: int,
    seed: int = 0,
    tokenizer_path: str | None = None,
    synthetic: SyntheticSpec | None = None,
) -> list[WorkItem]:
    """Requests with token counts from our tokenizer; arrivals are drawn per rate later."""
    from services.gateway.tokenizer import load_tokenizer
    from shared.modelfile import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(tokenizer_path))
    return load_workload(dataset, num_requests, 1.0, tokenizer, seed=seed, synthetic=synthetic)


# ---------------------------------------------------------------- command line


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _strs(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-32b")
    p.add_argument(
        "--hardware", default="gh200", help="profile name in bench/profiles (gh200, h200-pcie, cpu) or a JSON path"
    )
    p.add_argument("--dataset", default="sharegpt", help="sharegpt, synthetic, or a JSONL trace path")
    p.add_argument("--num-requests", type=int, default=1000, help="requests per run (default %(default)s)")
    p.add_argument("--duration-s", type=float, default=None, help="instead of --num-requests: rate × this many")
    p.add_argument("--rates", type=_floats, default=[4, 8, 12, 16, 20], help="requests/s, comma-separated")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--policies", type=_strs, default=["lvf", "fcfs", "sf", "wf"])
    p.add_argument("--ttft-slo", type=float, default=5.0, help="S_F, seconds")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="S_B, seconds")
    p.add_argument("--alpha", type=_floats, default=[3.0], help="comma-separated values sweep")
    p.add_argument("--beta-f", type=_floats, default=[0.5])
    p.add_argument("--beta-b", type=_floats, default=[0.0])
    p.add_argument("--xfer-budget", type=_ints, default=None, help="B_xfer blocks (default: the profile's)")
    p.add_argument("--transfer-mode", type=_strs, default=["duplex"], help="naive, merged, batched, duplex")
    p.add_argument("--max-batched-tokens", type=int, default=None, help="default: the profile's")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the profile's")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hbm-blocks", type=int, default=None, help="override the HBM pool size")
    p.add_argument("--dram-blocks", type=int, default=None, help="override the DRAM pool size")
    p.add_argument("--sched-time", default="model", help="model (the profile's), measured (wall time), or milliseconds")
    p.add_argument(
        "--pipeline-depth",
        type=int,
        choices=(1, 2),
        default=2,
        help="plans in flight (the live scheduler's default is 2)",
    )
    p.add_argument("--check-invariants", action="store_true", help="check the core's invariants every step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="processes (at most the CPU count)")
    p.add_argument("--tokenizer", default=None, help="GGUF or model directory to count tokens with (default: bundled)")
    p.add_argument("--input-len", type=int, default=128, help="synthetic: mean prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="synthetic: mean output tokens")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--plots", type=Path, default=None, help="write attainment-vs-rate PNGs here")


def jobs_from_args(args: argparse.Namespace, hw: Hardware, model: ModelShape) -> list[Job]:
    d = hw.defaults
    jobs = []
    knobs = itertools.product(
        args.policies,
        args.transfer_mode,
        args.xfer_budget or [d.get("xfer_budget", 2400)],
        args.alpha,
        args.beta_f,
        args.beta_b,
        args.rates,
    )
    for policy, mode, budget, alpha, beta_f, beta_b, rate in knobs:
        cfg = SchedulerConfig(
            policy=policy,
            block_size=args.block_size,
            max_batched_tokens=args.max_batched_tokens or d.get("max_batched_tokens", 512),
            max_num_seqs=args.max_num_seqs or d.get("max_num_seqs", 64),
            alpha=alpha,
            beta_f=beta_f,
            beta_b=beta_b,
            ttft_slo=args.ttft_slo,
            tbt_slo=args.tbt_slo,
            xfer_budget=budget,
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
                ),
            )
        )
    return jobs


def run(args: argparse.Namespace) -> int:
    hw, model = load_hardware(args.hardware), MODELS[args.model]
    check_pair(hw, args.model)
    num = args.num_requests if args.duration_s is None else math.ceil(max(args.rates) * args.duration_s)
    items = load_items(args.dataset, num, args.seed, args.tokenizer, SyntheticSpec(args.input_len, args.output_len))
    jobs = jobs_from_args(args, hw, model)
    timed = args.dataset not in ("sharegpt", "synthetic") and trace_has_arrivals(Path(args.dataset))
    t0 = time.perf_counter()
    rows = []
    for rate in args.rates:  # with --duration-s, each rate sends rate × duration requests
        mine = [j for j in jobs if j.rate == rate]
        n = num if args.duration_s is None else math.ceil(rate * args.duration_s)
        rows += sweep(items[:n], mine, args.ttft_slo, args.tbt_slo, args.burstiness, args.seed, args.jobs, not timed)
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
        "model": setup.model.name,
        "num_hbm_blocks": setup.num_hbm_blocks,
        "num_dram_blocks": setup.num_dram_blocks,
        "scheduler": asdict(setup.cfg),
    }


def format_rows(rows: list[dict]) -> str:
    pct = lambda v: "  n/a" if v is None else f"{100 * v:5.1f}"  # noqa: E731
    lines = ["policy  rate  knobs                              TTFT%  TBT%  tok/s   ttft p50 ms  tbt p99 ms  preempt"]
    for r in rows:
        knobs = f"{r['transfer_mode']} B={r['xfer_budget']} a={r['alpha']:g} bF={r['beta_f']:g} bB={r['beta_b']:g}"
        lines.append(
            f"{r['policy']:<6} {r['rate']:5g}  {knobs:<34} {pct(r['ttft_attainment'])} {pct(r['tbt_attainment'])} "
            f"{r['throughput_tok_s'] or 0:7.0f} {r['ttft_p50_ms'] or 0:12.0f} {r['tbt_p99_ms'] or 0:11.0f} {r['num_preemptions']:8d}"
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


def plot_attainment(rows: list[dict], out_dir: Path, title: str, name: str = "attainment") -> Path:
    """TTFT and TBT attainment vs rate, one line per policy (and knob set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(line_label(r, rows), []).append(r)
    for ax, key, label in ((axes[0], "ttft_attainment", "TTFT"), (axes[1], "tbt_attainment", "TBT")):
        for name_, rs in series.items():
            rs = sorted(rs, key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in rs], [100 * (r[key] or 0) for r in rs], marker="o", label=name_)
        ax.set(
            xlabel="request rate (req/s)",
            ylabel=f"{label} SLO attainment (%)",
            ylim=(0, 102),
            title=f"{label} — {title}",
        )
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def line_label(row: dict, rows: list[dict]) -> str:
    """The policy, plus every knob that varies across `rows`."""
    varying = [k for k in KNOBS if len({r[k] for r in rows}) > 1]
    return " ".join([row["policy"], *(f"{k}={row[k]}" for k in varying)])
