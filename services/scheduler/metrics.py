"""What the scheduler measures, fed by its loop at four points (request added, step planned,
step done, request ended):

- each live request's `Timeline`: time spent waiting, rotary, running and blocked on
  swap-ins, its first token and every gap between tokens (SLO-miss attribution);
- a `Window` over the last minute of steps and finished requests (`superinfer top/stats`);
- the Prometheus registry (`SchedulerMetrics`), served on --metrics-port when asked.

No clock here either: `now` comes from the loop, the same value the core sees.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.scheduler.core import Request, SchedulerConfig, SchedulerCore
from services.scheduler.core.step import Step
from services.scheduler.core.vlt import lag_key, lag_vlt
from shared import protocol as p
from shared.prometheus import Exposed

WINDOW_S = 60.0
STALL_THRESHOLD_S = 0.001
PHASES = ("waiting", "rotary", "running", "transfer_wait")
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_VLT_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_MOVED_KINDS = {  # label of superinfer:kv_blocks_moved -> core stats key
    "swap_in": "num_blocks_swapped_in",
    "swap_out": "num_blocks_swapped_out",
    "mirror": "num_blocks_mirrored",
}


def is_stall(t: p.StepTimings, after_idle: bool) -> bool:
    """Compute waited on a swap-in, or the busy worker sat idle waiting for this plan (the
    first plan after an idle spell, and a plan with nothing to compute, are no stall)."""
    return t.transfer_wait_s > STALL_THRESHOLD_S or (
        not after_idle and t.compute_s > 0 and t.plan_wait_s > STALL_THRESHOLD_S
    )


@dataclass(slots=True)
class Flight:
    """One plan sent to the worker and not yet reported."""

    step_id: int
    schedule_s: float
    after_idle: bool
    request_ids: list[str]
    num_blocks_moved: int
    num_rotations: int  # requests swapped in or out by this plan
    sent_at: float  # monotonic seconds
    num_tokens: int  # tokens it computes

    @classmethod
    def of(cls, plan: p.Plan, step: Step, schedule_s: float, after_idle: bool, sent_at: float) -> Flight:
        return cls(
            step_id=plan.step_id,
            schedule_s=schedule_s,
            after_idle=after_idle,
            request_ids=[s.request_id for s in plan.scheduled],
            num_blocks_moved=len(plan.swap_in) + len(plan.swap_out) + len(plan.eager),
            num_rotations=step.num_swapped_in_reqs + step.num_preempted - step.num_recomputed,
            sent_at=sent_at,
            num_tokens=sum(s.num_new_tokens for s in plan.scheduled),
        )


def trace_line(result: p.StepResult, flight: Flight, stalled: bool, stats: dict, wall_time: float) -> str:
    """One JSON line of the step trace (--step-trace)."""
    t = result.timings
    line = {
        "step_id": result.step_id,
        "t": wall_time,
        "schedule_s": flight.schedule_s,
        "transfer_s": t.transfer_s,
        "compute_s": t.compute_s,
        "transfer_wait_s": t.transfer_wait_s,
        "plan_wait_s": t.plan_wait_s,
        "stalled": stalled,
        "num_tokens": len(result.token_ids),
        "num_running": stats["num_running"],
        "num_waiting": stats["num_waiting"],
        "num_rotary": stats["num_rotary"],
    }
    return msgspec.json.encode(line).decode() + "\n"


@dataclass(slots=True)
class Timeline:
    """One request as the scheduler saw it. Time is charged to the state it was in."""

    arrival: float
    ttft_slo: float
    tbt_slo: float
    num_prompt_tokens: int
    state: str = "waiting"
    since: float = 0.0
    spent: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    num_preemptions: int = 0
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    num_gaps_met: int = 0
    max_gap_s: float = 0.0

    def move(self, state: str, now: float) -> str:
        """Enter `state` at `now`; returns the state it left."""
        old = self.state
        self.spent[old] += now - self.since
        self.state, self.since = state, now
        if old == "running" and state != "running":
            self.num_preemptions += 1
        return old

    def token(self, now: float) -> None:
        if self.last_token is None:
            self.first_token = now
        else:
            gap = now - self.last_token
            self.num_gaps_met += gap <= self.tbt_slo
            self.max_gap_s = max(self.max_gap_s, gap)
        self.last_token = now
        self.num_tokens += 1

    @property
    def ttft_met(self) -> bool:
        return self.first_token is not None and self.first_token - self.arrival <= self.ttft_slo

    @property
    def num_gaps(self) -> int:
        return max(0, self.num_tokens - 1)

    def attribution(self, now: float) -> p.Attribution:
        spent = dict(self.spent)
        spent[self.state] += now - self.since
        return p.Attribution(
            waiting_s=spent["waiting"],
            rotary_s=spent["rotary"],
            running_s=spent["running"],
            transfer_wait_s=spent["transfer_wait"],
            num_preemptions=self.num_preemptions,
        )


@dataclass(slots=True)
class StepSample:
    t: float
    schedule_s: float
    transfer_s: float
    compute_s: float
    stalled: bool
    num_blocks_moved: int
    num_rotations: int


@dataclass(slots=True)
class FinishSample:
    t: float
    ttft_met: bool
    num_gaps: int
    num_gaps_met: int


class Window:
    """The last `span_s` seconds of steps and finished requests."""

    def __init__(self, started: float, span_s: float = WINDOW_S) -> None:
        self.started = started
        self.span_s = span_s
        self.steps: deque[StepSample] = deque()
        self.finishes: deque[FinishSample] = deque()

    def add_step(self, s: StepSample) -> None:
        self.steps.append(s)
        self._prune(s.t)

    def add_finish(self, f: FinishSample) -> None:
        self.finishes.append(f)
        self._prune(f.t)

    def _prune(self, now: float) -> None:
        for q in (self.steps, self.finishes):
            while q and q[0].t < now - self.span_s:
                q.popleft()

    def summary(self, now: float, block_bytes: int) -> p.WindowStats:
        self._prune(now)
        span = max(1e-9, min(self.span_s, now - self.started))
        steps, fins = self.steps, self.finishes
        n = len(steps)
        mean = lambda attr: sum(getattr(s, attr) for s in steps) / n if n else 0.0  # noqa: E731
        ratio = lambda num, den: num / den if den else None  # noqa: E731
        num_moved = sum(s.num_blocks_moved for s in steps)
        num_gaps = sum(f.num_gaps for f in fins)
        return p.WindowStats(
            span_s=span,
            num_steps=n,
            schedule_s=mean("schedule_s"),
            transfer_s=mean("transfer_s"),
            compute_s=mean("compute_s"),
            stall_ratio=ratio(sum(s.stalled for s in steps), n),
            rotations_per_s=sum(s.num_rotations for s in steps) / span,
            blocks_moved_per_s=num_moved / span,
            transfer_bytes_per_s=num_moved * block_bytes / span if block_bytes else None,
            num_finished=len(fins),
            ttft_attainment=ratio(sum(f.ttft_met for f in fins), len(fins)),
            tbt_attainment=ratio(sum(f.num_gaps_met for f in fins), num_gaps),
            slo_attainment=ratio(sum(f.ttft_met and f.num_gaps_met == f.num_gaps for f in fins), len(fins)),
        )


class _Snapshot:
    """Gauges and cumulative counters read from the core's counts, as the loop last
    published them (the HTTP thread never touches the core)."""

    def __init__(self) -> None:
        self.values: dict = {}

    def collect(self):
        v = self.values
        if not v:
            return
        gauge = lambda name, doc, value: GaugeMetricFamily(name, doc, value=value)  # noqa: E731
        yield gauge("superinfer:num_requests_running", "Requests with KV in HBM, scheduled", v["num_running"])
        yield gauge("superinfer:num_requests_waiting", "Requests with no KV yet", v["num_waiting"])
        yield gauge("superinfer:num_requests_rotary", "Requests paused with KV in DRAM", v["num_rotary"])
        yield gauge("superinfer:draining", "1 while new requests are refused", v["draining"])
        yield gauge("superinfer:vlt_max_seconds", "Largest VLT among paused requests", v["vlt_max"])
        usage = GaugeMetricFamily("superinfer:kv_cache_usage_perc", "Share of KV blocks in use", labels=["tier"])
        free = GaugeMetricFamily("superinfer:kv_free_blocks", "Free KV blocks", labels=["tier"])
        for tier in ("hbm", "dram"):
            total, num_free = v[f"num_{tier}_blocks"], v[f"num_free_{tier}_blocks"]
            usage.add_metric([tier], 1.0 - num_free / total if total else 0.0)
            free.add_metric([tier], num_free)
        yield usage
        yield free
        counter = lambda name, doc, value: CounterMetricFamily(name, doc, value=value)  # noqa: E731
        yield counter("superinfer:num_preemptions", "Running requests preempted", v["num_preemptions"])
        yield counter("superinfer:num_recomputes", "Preemptions that dropped KV for recompute", v["num_recomputes"])
        yield counter("superinfer:scheduler_steps", "Plans built", v["num_steps"])
        yield counter("superinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", v["num_prefix_queries"])
        yield counter("superinfer:prefix_cache_hits", "Prompt tokens found in the prefix cache", v["num_prefix_hits"])
        # The DRAM tier, vLLM's names for the hits its KV connector (CPU offloading) finds.
        yield counter(
            "superinfer:external_prefix_cache_queries", "Prompt tokens looked up in the DRAM tier", v["num_tier_queries"]
        )
        yield counter(
            "superinfer:external_prefix_cache_hits", "Prompt tokens loaded from the DRAM tier", v["num_tier_hits"]
        )
        yield gauge("superinfer:kv_tier_blocks", "DRAM blocks the prefix-cache tier may keep", v["num_tier_blocks"])
        yield gauge("superinfer:kv_tier_cached_blocks", "DRAM blocks the tier keeps now", v["num_cached_dram_blocks"])
        rot = CounterMetricFamily("superinfer:rotations", "Requests rotated between tiers", labels=["direction"])
        rot.add_metric(["out"], v["num_rotations_out"])
        rot.add_metric(["in"], v["num_rotations_in"])
        yield rot
        moved = CounterMetricFamily("superinfer:kv_blocks_moved", "KV blocks copied between tiers", labels=["kind"])
        for kind, key in _MOVED_KINDS.items():
            moved.add_metric([kind], v[key])
        yield moved


class SchedulerMetrics:
    """The scheduler's Prometheus registry; names follow vLLM's where the meaning is the same."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.step_time = Histogram(
            "superinfer:step_time_seconds", "Step time by phase", ["phase"], buckets=_STEP_BUCKETS, registry=r
        )
        self.transfer_bytes = Counter("superinfer:kv_transfer_bytes", "KV bytes copied between tiers", registry=r)
        self.transfer_seconds = Counter("superinfer:kv_transfer_seconds", "Worker time spent on KV copies", registry=r)
        self.stalls = Counter("superinfer:pipeline_stalls", "Steps that waited on a swap-in or a plan", registry=r)
        self.phase_time = Histogram(
            "superinfer:request_phase_seconds", "Time of finished requests by state", ["phase"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.vlt_admitted = Histogram(
            "superinfer:vlt_at_admission_seconds", "VLT of paused requests when put on the GPU",
            buckets=_VLT_BUCKETS, registry=r,
        )
        self.slo_requests = Counter(
            "superinfer:slo_requests", "Finished requests by SLO met", ["slo", "attained"], registry=r
        )
        self.slo_gaps = Counter("superinfer:slo_tbt_gaps", "Token gaps by TBT SLO met", ["attained"], registry=r)
        self.snapshot = _Snapshot()
        r.register(self.snapshot)
        # What /metrics serves: every series with model_name, the worker's (set when it is ready).
        self.exposed = Exposed(r)

    def observe_step(self, flight: Flight, t: p.StepTimings, stalled: bool, block_bytes: int) -> None:
        self.step_time.labels(phase="schedule").observe(flight.schedule_s)
        self.step_time.labels(phase="transfer").observe(t.transfer_s)
        self.step_time.labels(phase="compute").observe(t.compute_s)
        self.transfer_seconds.inc(t.transfer_s)
        self.transfer_bytes.inc(flight.num_blocks_moved * block_bytes)
        if stalled:
            self.stalls.inc()

    def observe_finish(self, tl: Timeline, att: p.Attribution) -> None:
        for phase in PHASES:
            self.phase_time.labels(phase=phase).observe(getattr(att, f"{phase}_s"))
        tbt_met = tl.num_gaps_met == tl.num_gaps
        yes = lambda ok: "yes" if ok else "no"  # noqa: E731
        self.slo_requests.labels(slo="ttft", attained=yes(tl.ttft_met)).inc()
        self.slo_requests.labels(slo="tbt", attained=yes(tbt_met)).inc()
        self.slo_requests.labels(slo="all", attained=yes(tl.ttft_met and tbt_met)).inc()
        self.slo_gaps.labels(attained="yes").inc(tl.num_gaps_met)
        self.slo_gaps.labels(attained="no").inc(tl.num_gaps - tl.num_gaps_met)

    def serve(self, host: str, port: int | None, log):
        """/metrics over HTTP on a daemon thread when a port is given; returns the server
        (to shut down), or None. A port in use is logged, not fatal: serving matters more."""
        if port is None:
            return None
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.exposed.registry)
        except OSError as e:
            log.error("metrics endpoint disabled", port=port, error=str(e))
            return None
        log.info("metrics up", url=f"http://{host}:{port}/metrics")
        return server


def max_paused_vlt(core: SchedulerCore, now: float) -> float:
    """The head of each paused heap is its largest VLT (vlt.py)."""
    heads = ((core.q_first.peek(), False), (core.q_emitted.peek(), True))
    return max((lag_vlt(h[0], emitted, now, core.cfg) for h, emitted in heads if h is not None), default=0.0)


def admission_vlt(req: Request, cfg: SchedulerConfig, now: float) -> float:
    return lag_vlt(lag_key(req, cfg), req.has_emitted, now, cfg)


def state_of(req: Request) -> str:
    return req.status.value if req.is_live else "done"
