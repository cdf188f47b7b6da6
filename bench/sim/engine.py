"""The simulator: the live scheduler core on a virtual clock, with a cost-model worker
(`superinfer bench sim` sweeps it: sweep.py).

The steps are driven by the live scheduler's own step driver (services/scheduler/driver.py)
on a virtual clock (`run_clock`): requests arrive at their times, the driver keeps
`--pipeline-depth` plans at the worker (by default the live server's for the profile's
device: 2 on a GPU profile, where plan t+1 is built while t computes, so a step stalls only
if scheduling takes longer; 1 on a cpu profile, planning each step after the previous
result), and a result, synthesized (one token for every request whose scheduled
tokens reach the end of its known tokens), is applied when the cost model (bench/sim/costmodel.py)
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
step ends when compute and the out-direction copies are both done. On vLLM's swap path
(transfer mode `vllm`) a step's copies start once the previous step is done and its compute
waits for both directions: the worker swaps before it runs the model.

A profile measured on the live server (`bench simlive`) adds two of its terms here: the
worker's gap between two steps (`step_gap_ms`: a step starts that long after the previous
one ends at the earliest) and the client's latency on top of the scheduler's token times
(`client_latency_ms`, added to each request's TTFT and end-to-end time).

The scheduling time is modelled (the profile's `sched_ms`, or `--sched-time MS`);
`--sched-time measured` uses the real `schedule()` call's time instead, as the CPU time of
the thread that runs it (runs are then no longer bit-for-bit repeatable): on cores shared
with other processes, wall time would also count the time the others ran, and a slower
simulated step leaves more work to every later one.
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from bench.live.workload import WorkItem
from bench.report.metrics import RequestRecord
from bench.sim.costmodel import (
    Hardware,
    ModelShape,
    StepWork,
    compute_time,
    host_attention_time,
    neo_applicable,
    neo_host_blocks,
    neo_host_share,
    neo_prompt_copy_blocks,
    num_kv_blocks,
    transfer_time,
)
from bench.sim.costmodel import GB, direction_rate
from services.scheduler.core import Request, SchedulerConfig, SchedulerCore
from services.scheduler.core.baselines import CLIENT_SENDS_OUTPUT_LEN
from services.scheduler.core.step import Step, samples
from services.scheduler.driver import Driver
from shared.config import default_pipeline_depth
from shared.protocol import AddRequest, Plan, SamplingParams, StepResult, StepTimings, TokenOutput

TOKEN = 1  # the id every synthesized sample carries but a request's last
STOP = 2  # a request's last sample when it asks for more than its true output (`SimSetup.max_tokens`)
SYSTEM = -1  # the first id of shared system prompt k is SYSTEM - k
DECISION_COPY_BLOCKS = 64  # the copy size (blocks) whose rate the core's tier decisions assume


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
        blocking: bool = False,
    ) -> tuple[float, float]:
        """(compute start, step end) of a step planned at `plan_at` after a step ending at
        `prev_end` (`plan_at` itself when the worker is idle). `blocking` (vLLM's swap path):
        the copies start once the previous step is done and compute waits for all of them."""
        ready = plan_at + sched_s
        overlap = self.overlap_copies and not blocking
        link_start = max(ready, self.link_free if overlap else max(self.link_free, prev_end))
        self.link_free = link_start + xfer_s
        copied = link_start + xfer_s if blocking else link_start + in_s if reads_in else ready
        start = max(prev_end + self.gap_s, ready, copied)
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
    # Plans at the worker at once; None: the live default for the profile's device (a GPU
    # profile has `pipeline`, the cpu ones do not).
    pipeline_depth: int | None = None
    # The client's max_tokens: 0 asks each request's true output length (it ends by length);
    # else this cap (at least the true length, within the context window), and the request
    # ends at its true length with a stop token, as a model's EOS ends it.
    max_tokens: int = 0
    predictor_noise: float = 1.0  # sigma of the log-normal error of the output-length predictor
    # NEO: this many of the KV blocks are in host DRAM, their decode attention on the CPU
    # (costmodel.neo_host_blocks), a pool beside the HBM one that the core sees as one.
    neo_host_blocks: int = 0


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


def requests_of(items: list[WorkItem], max_tokens: int = 0, max_model_len: int = 0) -> list[AddRequest]:
    """One AddRequest per item: its prompt length in placeholder ids, `max_tokens` = its
    output length (no stop ids: the output ends exactly there), or with `max_tokens` that
    cap within `max_model_len` (the output ends with a STOP sample at its true length). The
    first id of its own text is the item's own, so no two prompts share a prefix-cache
    block (real prompts rarely share whole ones) but for what they share by design: a
    system prompt (its own first id, then placeholders), and a later turn of a
    conversation, whose prompt is the turn before's prompt and output (the ids the
    simulated worker samples) and then the new user text."""

    def params(it: WorkItem) -> SamplingParams:
        if not max_tokens:
            return SamplingParams(max_tokens=it.output_tokens, ignore_eos=True)
        cap = max(it.output_tokens, min(max_tokens, max_model_len - it.prompt_tokens))
        return SamplingParams(max_tokens=cap, stop_token_ids=[STOP])

    out: list[AddRequest] = []
    for i, it in enumerate(items):
        if it.turn > 0:
            prev, before = items[i - 1], out[-1].prompt_token_ids
            history = before + [TOKEN] * (prev.output_tokens - 1) + [STOP]
            prompt = history + [STOP + 1 + i] + [TOKEN] * (it.prompt_tokens - len(history) - 1)
        else:
            system = [SYSTEM - it.system] + [TOKEN] * (it.system_tokens - 1) if it.system >= 0 else []
            prompt = system + [STOP + 1 + i] + [TOKEN] * (it.prompt_tokens - len(system) - 1)
        out.append(AddRequest(str(i), prompt, params(it)))
    return out


def noisy_predictor(items: list[WorkItem], sigma: float) -> Callable[[Request], float]:
    """An output-length predictor as LTR's learned one: the true length times a log-normal
    error of `sigma` (1.0: Kendall's tau about 0.55 on ShareGPT, as the LTR paper's
    predictor), drawn per request from its index and lengths, so every run draws the same."""
    pred = [
        it.output_tokens * math.exp(random.Random(f"{i}:{it.prompt_tokens}:{it.output_tokens}").gauss(0.0, sigma))
        for i, it in enumerate(items)
    ]
    return lambda req: pred[int(req.request_id)]


@dataclass
class InFlight:
    """A plan at the simulated worker."""

    step_id: int
    sampled: list[str]  # request ids that sample in this step
    tokens: list[int] | None = None  # the id each samples (TOKEN for all when None)
    end: float = math.inf  # when its result is back (the cost model's)
    compute_s: float = 0.0  # reported back, as a worker does (the core learns step times from it)


def simulate(items: list[WorkItem], setup: SimSetup) -> SimRun:
    hw, model = setup.hardware, setup.model
    cfg = setup.cfg
    num_kv = setup.num_hbm_blocks + setup.neo_host_blocks
    max_model_len = min(model.max_position, num_kv * cfg.block_size)
    predictor = noisy_predictor(items, setup.predictor_noise)
    core = SchedulerCore(cfg, num_kv, setup.num_dram_blocks, max_model_len, predictor=predictor)
    requests = requests_of(items, setup.max_tokens, max_model_len)
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
        num_neo_out = 0
        if setup.neo_host_blocks:
            num_used = num_kv - core.memory.hbm.num_free
            compute_s = neo_compute_time(setup, work, num_used)
            share = neo_host_share(num_used, setup.num_hbm_blocks)
            num_neo_out = neo_prompt_copy_blocks(work.num_prefill_tokens, share, cfg.block_size)
        x = transfer_time(
            hw,
            model,
            setup.transfer_mode,
            len(plan.swap_in),
            len(plan.swap_out) + len(plan.eager) + num_neo_out,
            cfg.block_size,
        )
        busy = driver.in_flight[-1] if driver.in_flight else None
        prev_end = busy.end if busy is not None else step.now
        sched_s = schedule_s if fixed_sched is None else fixed_sched
        start, end = clock.step(
            step.now, prev_end, sched_s, compute_s, x.in_s, x.total_s, bool(plan.swap_in), setup.transfer_mode == "vllm"
        )
        run.stall_s += start - prev_end if busy is not None else 0.0
        run.step_ms.append((end - prev_end) * 1e3)
        run.step_end_s.append(end)
        run.step_num_sampled.append(len(sampled))
        run.compute_ms.append(compute_s * 1e3)
        run.xfer_ms.append(x.total_s * 1e3)
        last = [STOP if num_samples[i] == items[i].output_tokens else TOKEN for i in map(int, sampled)]
        return InFlight(plan.step_id, sampled, last, end, compute_s)

    def idle() -> None:  # a schedule() call that built no plan
        run.sched_wall_ms.append(driver.schedule_s * 1e3)
        check()

    arrived = [it.arrival_s for it in items]  # a later turn: when the turn before ended + think time
    cached = [0] * len(items)

    def applied(outputs: list[TokenOutput], now: float) -> None:
        for out in outputs:
            i = int(out.request_id)
            times[i].append(now)
            if len(times[i]) == 1:
                cached[i] = out.num_cached_tokens
            if out.finish_reason is not None and i + 1 < len(items) and items[i + 1].turn > 0:
                arrived[i + 1] = now + items[i + 1].think_s
                bisect.insort(arrivals, (arrived[i + 1], requests[i + 1]), key=lambda a: a[0])
        check()

    depth = setup.pipeline_depth or default_pipeline_depth(on_cpu=not hw.pipeline)
    driver = Driver(core, send, depth, time.thread_time)
    first = [(it.arrival_s, req) for it, req in zip(items, requests) if it.turn == 0]
    arrivals = sorted(first, key=lambda a: a[0])
    run_clock(driver, arrivals, idle=idle, applied=applied)
    if core.has_unfinished():
        raise RuntimeError(f"simulation stuck: {core.stats()}")
    run.records = [
        _record(replace(it, arrival_s=t0), [t + hw.client_latency_s for t in ts], n)
        for it, t0, ts, n in zip(items, arrived, times, cached)
    ]
    run.duration_s = max((ts[-1] for ts in times if ts), default=0.0) - min((it.arrival_s for it in items), default=0.0)
    m = core.memory
    run.stats = {**core.stats(), "num_blocks_reused_at_swap_in": m.num_swap_in_reused, "num_dram_blocks_shared": m.num_dram_shared}
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
            tokens = f.tokens if f.tokens is not None else [TOKEN] * len(f.sampled)
            _, outputs = driver.result(StepResult(f.step_id, f.sampled, tokens, StepTimings(compute_s=f.compute_s)), now)
            applied(outputs, now)
        following = next_result()
        merged = following - now < tick_s and following <= arrival


def plan_work(plan, items: list[WorkItem], num_samples: list[int]) -> tuple[StepWork, list[str]]:
    """What the plan computes, and which requests sample (the core's rule, `samples`: the
    scheduled tokens reach the end of the known ones, prompt + every sample planned before)."""
    work, sampled = StepWork(), []
    add = work.add
    for s in plan.scheduled:
        i = int(s.request_id)
        num_computed, num_new = s.num_computed_tokens, s.num_new_tokens
        sample = samples(num_computed, num_new, items[i].prompt_tokens + num_samples[i])
        add(num_computed, num_new, sample)
        if sample:
            num_samples[i] += 1
            sampled.append(s.request_id)
    return work, sampled


def _sched_s(sched_time: str, hw: Hardware) -> float:
    return hw.sched_s if sched_time == "model" else float(sched_time) / 1e3


def _record(item: WorkItem, token_times: list[float], num_cached: int | None = None) -> RequestRecord:
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
        cached_tokens=num_cached,
    )


def neo_compute_time(setup: SimSetup, work: StepWork, num_used: int) -> float:
    """A NEO step: KV beyond the GPU's blocks lies in host DRAM and the CPU computes its share
    of the decode attention while the GPU computes the rest and every linear layer (NEO's
    asymmetric pipeline, taken as perfect overlap); the step takes the longer of the two."""
    hw, model = setup.hardware, setup.model
    num_host_kv = round(work.num_kv_read * max(0, num_used - setup.num_hbm_blocks) / max(num_used, 1))
    gpu_s = compute_time(hw, model, replace(work, num_kv_read=work.num_kv_read - num_host_kv))
    return max(gpu_s, host_attention_time(hw, model, num_host_kv))


def make_setup(
    hw: Hardware,
    model: ModelShape,
    cfg: SchedulerConfig,
    mode: str,
    hbm: int | None = None,
    dram: int | None = None,
    sched_time: str = "model",
    check: bool = False,
    depth: int | None = None,
    max_tokens: int = 0,
    predictor_noise: float = 1.0,
    neo: bool = False,
) -> SimSetup:
    """`neo`: NEO's offloading on `cfg`'s policy (vLLM V1's in the reproduction): the KV pool
    grows by the host blocks NEO's CPU attention can serve."""
    if neo and not neo_applicable(model):
        raise ValueError(f"NEO does not run MoE models ({model.name})")
    if cfg.policy in CLIENT_SENDS_OUTPUT_LEN:
        max_tokens = 0  # benchmark clients send each request's output length as max_tokens
    num_hbm, num_dram = num_kv_blocks(hw, model, cfg.block_size)
    dram = num_dram if dram is None else dram
    cfg = cfg.for_device(on_cpu=not hw.pipeline)  # a profile without the pipeline is a CPU's
    # What the live worker reports: a block's bytes and the DRAM->HBM copy rate (the DRAM tier's
    # load-or-recompute decision prices copies by it).
    block_bytes = model.kv_block_bytes(cfg.block_size, hw.dtype_bytes)
    rate = direction_rate(hw, model, mode, DECISION_COPY_BLOCKS, cfg.block_size) / GB
    cfg = replace(cfg, block_bytes=cfg.block_bytes or block_bytes, copy_gbps=cfg.copy_gbps or rate)
    if mode == "vllm":  # vLLM's swap path copies a request's KV when it is preempted, never ahead
        cfg = replace(cfg, eager_rotation=False)
    hbm = hbm or num_hbm
    host = neo_host_blocks(hw, model, hbm, cfg.block_size) if neo else 0
    return SimSetup(
        cfg, hw, model, mode, hbm, dram - host, sched_time, check, depth, max_tokens, predictor_noise, host
    )
