"""Prometheus metrics of one gateway, in a registry of its own (several gateways may run in
one process under test). Names follow vLLM's where the meaning is the same, and every series
carries `model_name` (the first served name); the scheduler gauges are summed over the live
schedulers each time /metrics is read."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily

from services.gateway.generate import Timing
from shared.prometheus import Exposed
from shared.protocol import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TBT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# No `<name>_created` series (the time each counter and histogram was made), as vLLM serves
# them: a scrape carries only the values. (A process-wide switch of prometheus_client.)
disable_created_metrics()


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "superinfer:http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.request_success = Counter(
            "superinfer:request_success", "Requests finished, by reason", ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("superinfer:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("superinfer:generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "superinfer:time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tbt = Histogram(
            "superinfer:time_per_output_token_seconds", "Mean time between tokens", buckets=_TBT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "superinfer:inter_token_latency_seconds", "Every gap between two tokens", buckets=_TBT_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "superinfer:e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "superinfer:request_queue_time_seconds",
            "Time spent waiting for a run (no KV yet), as the scheduler reports it",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        g = lambda name, doc, labels=(): Gauge(name, doc, labels, registry=r)  # noqa: E731
        self.num_schedulers = g("superinfer:num_schedulers", "Schedulers reporting in")
        self.running = g("superinfer:num_requests_running", "Requests running on the GPU")
        self.waiting = g("superinfer:num_requests_waiting", "Requests waiting for their first step")
        self.rotary = g("superinfer:num_requests_rotary", "Requests paused with KV in DRAM")
        self.free_blocks = g("superinfer:kv_free_blocks", "Free KV blocks", ["tier"])
        self.total_blocks = g("superinfer:kv_total_blocks", "KV blocks", ["tier"])
        self.native = g(
            "superinfer:native_kernels",
            "1 where a scheduler's worker runs its native kernels (or a GPU), 0 where every step runs on "
            "the torch path, 5-10x slower (reason: why)",
            ["scheduler_id", "reason"],
        )
        self._stats: list[SchedulerStats] = []
        r.register(_SchedulerCounters(lambda: self._stats))
        self.exposed = Exposed(r)  # every series with model_name, once the app sets it

    def observe_finished(self, timing: Timing, num_prompt_tokens: int, end: float) -> None:
        self.request_success.labels(finished_reason=timing.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(timing.num_output_tokens)
        self.e2e.observe(end - timing.arrival)
        if timing.attribution is not None:
            self.queue_time.observe(timing.attribution.waiting_s)
        if timing.first_token is not None:
            self.ttft.observe(timing.first_token - timing.arrival)
            if timing.num_output_tokens > 1:
                self.tbt.observe((end - timing.first_token) / (timing.num_output_tokens - 1))
        for gap in timing.gaps:
            self.itl.observe(gap)

    def render(self, stats: list[SchedulerStats]) -> bytes:
        self._set_scheduler_gauges(stats)
        return generate_latest(self.exposed.registry)

    def _set_scheduler_gauges(self, stats: list[SchedulerStats]) -> None:
        self.num_schedulers.set(len(stats))
        self.running.set(sum(s.num_running for s in stats))
        self.waiting.set(sum(s.num_waiting for s in stats))
        self.rotary.set(sum(s.num_rotary for s in stats))
        self._stats = stats
        self.free_blocks.labels(tier="hbm").set(sum(s.num_free_hbm_blocks for s in stats))
        self.free_blocks.labels(tier="dram").set(sum(s.num_free_dram_blocks for s in stats))
        self.total_blocks.labels(tier="hbm").set(sum(s.num_hbm_blocks for s in stats))
        self.total_blocks.labels(tier="dram").set(sum(s.num_dram_blocks for s in stats))
        self.native.clear()
        for s in stats:
            if s.worker_ready:
                self.native.labels(scheduler_id=s.scheduler_id, reason=s.native_missing).set(int(not s.native_missing))


class _SchedulerCounters:
    """The schedulers' cumulative counts, summed, as counters under the names and types the
    scheduler's own endpoint gives them (services/scheduler/metrics.py): one series, one type,
    on every port."""

    def __init__(self, stats) -> None:
        self._stats = stats  # () -> the latest list[SchedulerStats]

    def collect(self):
        stats = self._stats()
        total = lambda key: sum(getattr(s, key) for s in stats)  # noqa: E731
        yield CounterMetricFamily(
            "superinfer:num_preemptions", "Running requests preempted", value=total("num_preemptions")
        )
        yield CounterMetricFamily(
            "superinfer:num_recomputes", "Preemptions that dropped KV for recompute", value=total("num_recomputes")
        )
        rot = CounterMetricFamily("superinfer:rotations", "Requests rotated between tiers", labels=["direction"])
        rot.add_metric(["out"], total("num_rotations_out"))
        rot.add_metric(["in"], total("num_rotations_in"))
        yield rot
        moved = CounterMetricFamily("superinfer:kv_blocks_moved", "KV blocks copied between tiers", labels=["kind"])
        for kind, key in (("swap_in", "num_blocks_swapped_in"), ("swap_out", "num_blocks_swapped_out"),
                          ("mirror", "num_blocks_mirrored")):  # fmt: skip
            moved.add_metric([kind], total(key))
        yield moved
