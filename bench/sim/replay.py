"""What a served trace measures, re-derived for `bench simlive`: the steps the live scheduler
planned (`replay_plans`: its arrivals and result times through a fresh core and the service's
step driver), their served compute, the gap between steps and the client's latency.

The live side comes from the run itself: the client's records (`bench serve`), the
scheduler's step trace (`--step-trace`) and its `request_finished` log events.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.live.server import Server
from bench.live.workload import WorkItem
from bench.report.metrics import RequestRecord
from bench.sim import engine
from bench.sim.costmodel import MODELS, StepWork, compute_time, hardware_from_dict
from services.scheduler.core import SchedulerConfig, SchedulerCore
from services.scheduler.core.step import Step
from services.scheduler.driver import Driver
from shared.protocol import Plan

MIN_COMPUTE_S = 1e-3  # a step below this computed nothing (drops only)
BUSY_PLAN_WAIT_S = 1e-3  # the worker had the plan queued: the period is all step
TICK_S = 0.002  # results traced closer than this were drained in one tick of the scheduler's loop
SCHEDULE_LAG_S = 3e-4  # the service plans this long after it applied a result (its metrics and trace go first)


@dataclass(frozen=True)
class Pools:
    """The worker's pools as its scheduler reports them; the simulator and the replay get the same."""

    num_hbm_blocks: int
    num_dram_blocks: int
    max_model_len: int

    @classmethod
    def of(cls, server: Server) -> Pools:
        st = server.scheduler_stats()
        return cls(st["num_hbm_blocks"], st["num_dram_blocks"], st["max_model_len"])


# ---------------------------------------------------------------- the live side


@dataclass
class LiveRun:
    records: list[RequestRecord]  # in workload order
    duration_s: float
    wall: tuple[float, float]  # epoch seconds at the start and the end of the replay
    steps: list[dict] = field(default_factory=list)  # step-trace lines inside `wall`
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before and after


def serve_trace(server: Server, items: list[WorkItem], step_trace: Path) -> LiveRun:
    """`bench serve`'s replay of `items`, and the steps the scheduler traced meanwhile."""
    from bench.live import serve

    args = serve.client_args(request_timeout=900.0)
    load0, w0 = os.getloadavg()[0], time.time()
    records, duration_s = asyncio.run(serve.replay(server.base_url, server.model, items, args))
    w1 = time.time()
    return LiveRun(records, duration_s, (w0, w1), read_steps(step_trace, w0, w1), (load0, os.getloadavg()[0]))


def read_steps(path: Path, t0: float, t1: float) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if t0 <= r["t"] <= t1]


def scheduler_finishes(log_path: Path, t0: float, t1: float) -> list[dict]:
    """The scheduler's `request_finished` log events of requests that arrived in [t0, t1],
    each with its arrival (epoch s): finish time minus the time it spent at the scheduler."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if '"request_finished"' not in line:
            continue
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("service") != "scheduler" or e.get("ttft_s") is None:
            continue
        spent = sum(e.get(k, 0.0) for k in ("waiting_s", "rotary_s", "running_s"))
        e["arrival"] = datetime.fromisoformat(e["timestamp"]).timestamp() - spent
        if t0 <= e["arrival"] <= t1:
            out.append(e)
    return out


def match_requests(records: list[RequestRecord], finishes: list[dict]) -> dict[int, dict]:
    """Record index -> its scheduler event: same prompt and output lengths, in the order
    they arrived (the k-th such record sent is the k-th such event)."""
    by_key: dict[tuple[int, int], deque[dict]] = {}
    for e in sorted(finishes, key=lambda e: e["arrival"]):
        by_key.setdefault((e["num_prompt_tokens"], e["num_output_tokens"]), deque()).append(e)
    out = {}
    for i in sorted((i for i, r in enumerate(records) if r.ok), key=lambda i: records[i].start_s):
        queue = by_key.get((records[i].prompt_tokens, records[i].output_tokens))
        if queue:
            out[i] = queue.popleft()
    return out


# ---------------------------------------------------------------- the replay and the live terms


def replay_plans(
    items: list[WorkItem],
    arrivals: list[float],
    result_times: list[float],
    cfg: SchedulerConfig,
    pools: Pools,
    depth: int,
) -> list[tuple[StepWork, int]]:
    """(work, number of samples) of every plan the live scheduler built, re-derived: a fresh
    core, driven as the service drives it (the step driver, `depth` plans in flight, as
    the server ran), gets each request at its arrival and each result at the time the service got
    it, and plans once per tick after its updates (results closer than `TICK_S` came in one
    tick), `SCHEDULE_LAG_S` later. Times are epoch seconds; only their order and spacing
    matter."""
    # the live server's scheduler, with its CPU worker's defaults
    core = SchedulerCore(cfg.for_device(on_cpu=True), pools.num_hbm_blocks, pools.num_dram_blocks, pools.max_model_len)
    num_samples = [0] * len(items)
    plans: list[tuple[StepWork, int]] = []

    def send(plan: Plan, step: Step, schedule_s: float) -> engine.InFlight:
        work, sampled = engine.plan_work(plan, items, num_samples)
        plans.append((work, len(sampled)))
        return engine.InFlight(plan.step_id, sampled)

    timed = sorted(zip(arrivals, engine.requests_of(items)), key=lambda a: a[0])
    start = min([*arrivals, *result_times], default=0.0)
    driver = Driver(core, send, depth)
    engine.run_clock(driver, timed, start=start, result_times=result_times, lag_s=SCHEDULE_LAG_S, tick_s=TICK_S)
    return plans


def step_samples(plans: list[tuple[StepWork, int]], steps: list[dict]) -> tuple[list[tuple[StepWork, float]], float]:
    """(work, served compute seconds) per step that computed, paired in order, and the share
    of steps whose replayed plan samples as many tokens as the live step did."""
    pairs = list(zip(plans, steps))
    same = sum(n == s["num_tokens"] for (_, n), s in pairs) / max(len(pairs), 1)
    return [(w, s["compute_s"]) for (w, _), s in pairs if w.num_tokens and s["compute_s"] >= MIN_COMPUTE_S], same


def served_ratio(samples: list[tuple[StepWork, float]], profile: dict) -> float:
    """Served compute over what `profile` prices the same steps at: 1 for the profile fitted
    on them, the drift of the machine for steps served later."""
    hw, model = hardware_from_dict(profile), MODELS["smollm2"]
    return sum(s for _, s in samples) / sum(compute_time(hw, model, w) for w, _ in samples)


def step_gap_s(steps: list[dict]) -> float:
    """Median of what a busy step's result period holds beyond its compute and its wait for
    swap-ins: the pipeline's own cost per step (never negative)."""
    gaps = [
        b["t"] - a["t"] - b["compute_s"] - b["transfer_wait_s"]
        for a, b in zip(steps, steps[1:])
        if b["plan_wait_s"] < BUSY_PLAN_WAIT_S and b["compute_s"] >= MIN_COMPUTE_S
    ]
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def client_latencies(records: list[RequestRecord], matched: dict[int, dict]) -> list[float]:
    """Client TTFT minus the scheduler's, per request: HTTP, tokenization, hops and SSE."""
    return [records[i].ttft_s - e["ttft_s"] for i, e in matched.items() if records[i].ttft_s is not None]


def arrivals_at_scheduler(run: LiveRun, items: list[WorkItem], matched: dict[int, dict]) -> list[float]:
    """Each request's arrival at the scheduler (epoch s); one the log misses is placed at its
    send time plus the median hop of the others."""
    sent = [run.wall[0] + r.start_s for r in run.records]
    hops = [e["arrival"] - sent[i] for i, e in matched.items()]
    hop = statistics.median(hops) if hops else 0.0
    return [matched[i]["arrival"] if i in matched else sent[i] + hop for i in range(len(items))]


# ---------------------------------------------------------------- one served trace


@dataclass
class Served:
    """What one served trace measures: its steps' work (replayed) with their served compute,
    and each request's client-side TTFT beyond the scheduler's."""

    samples: list[tuple[StepWork, float]]
    same: float  # share of steps the replay samples as the live step did
    latencies: list[float]

    @classmethod
    def of(
        cls, run: LiveRun, items: list[WorkItem], log_path: Path, cfg: SchedulerConfig, pools: Pools, depth: int
    ) -> Served:
        matched = match_requests(run.records, scheduler_finishes(log_path, *run.wall))
        arrivals = arrivals_at_scheduler(run, items, matched)
        plans = replay_plans(items, arrivals, [s["t"] for s in run.steps], cfg, pools, depth)
        samples, same = step_samples(plans, run.steps)
        return cls(samples, same, client_latencies(run.records, matched))


def live_profile(micro: dict, scale: float, gap_s: float, latency_s: float) -> dict:
    """The `cpu-live` profile: the micro-benchmark's, its step model scaled to served speed,
    with the two live terms."""
    prof = json.loads(json.dumps(micro))
    for k in ("overhead_s", "prefill_token_s", "decode_token_s", "kv_token_s"):
        prof["linear"][k] *= scale
    prof |= {"name": "cpu-live", "live_scale": round(scale, 4)}
    prof |= {"step_gap_ms": round(gap_s * 1e3, 3), "client_latency_ms": round(latency_s * 1e3, 3)}
    prof["notes"] = f"{micro.get('notes', '')}; step model x{scale:.3f} and the live terms: `bench simlive`"
    return prof
