"""Surviving a lost worker: when a step result is overdue, how a live request is held and
re-created on the next worker, and the link that does it (see the scheduler service's docstring)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from services.scheduler.core import Request, SchedulerConfig, SchedulerCore
from services.scheduler.driver import Driver
from shared import config, protocol as p

STEP_TIMEOUT_S = 2.0  # a step result later than this (at least) means the worker is lost
STEP_TIMEOUT_FACTOR = 10.0  # ... or this many median recent steps, when steps are slow
FIRST_STEP_TIMEOUT_S = 30.0  # before any step is measured: warm-up and first prefills are slow
# A request held while no worker is ready fails after this long (--worker-wait; a worker that
# restarts loads its model first: ~11 s on an idle 2-core host, 30-100 s on a busy one).
WORKER_WAIT_S = config.DEFAULT_WORKER_WAIT_S
# A worker that says it still computes the overdue step (`WorkerBusy`, every second) is slow,
# not lost: while its word is this fresh, up to MAX_BUSY_STEP_S for one step (a compute thread
# stuck for good, its socket thread still talking, is lost then).
BUSY_FRESH_S = 5.0
MAX_BUSY_STEP_S = 300.0
NUM_STEP_SAMPLES = 64


def step_deadline_s(recent: Sequence[tuple[float, int]], num_tokens: int, base_s: float = STEP_TIMEOUT_S) -> float:
    """How long a step computing `num_tokens` may run before its worker is declared lost.

    `recent` holds (seconds, tokens) of the last steps. The deadline scales with them, so
    a slow CPU or a big prefill is not mistaken for a dead worker: the largest of the
    base, 10 x the median step, 2 x the slowest step, and 10 x `num_tokens` x the median
    time per token (per-token time of small decode steps overstates a prefill's, so this
    bound is generous for big steps). Before any step is measured (the first steps warm
    up), FIRST_STEP_TIMEOUT_S.
    """
    if not recent:
        return max(base_s, FIRST_STEP_TIMEOUT_S)
    times = [t for t, _ in recent]
    per_token = statistics.median(t / max(1, n) for t, n in recent)
    return max(
        base_s,
        STEP_TIMEOUT_FACTOR * statistics.median(times),
        2.0 * max(times),
        STEP_TIMEOUT_FACTOR * num_tokens * per_token,
    )


def out_of_vocab(req: p.AddRequest, vocab_size: int) -> str | None:
    """A token id the model has no embedding for would fail the whole step on the worker
    (and with it every request in that step): refuse it here, alone. 0: not reported."""
    if not vocab_size:
        return None
    for t in (*req.prompt_token_ids, *req.output_token_ids, *req.params.logit_bias):
        if not 0 <= t < vocab_size:
            return f"token id {t} is outside the model's vocabulary (0..{vocab_size - 1})"
    return None


def send_now(sock: zmq.asyncio.Socket, data: bytes) -> bool:
    """Send without waiting; False when no peer is connected (or its queue is full). An
    asyncio socket reports that in the future it returns, not by raising."""
    exc = sock.send(data, flags=zmq.NOBLOCK).exception()
    if exc is not None and not isinstance(exc, zmq.Again):
        raise exc
    return exc is None


@dataclass(slots=True)
class Held:
    """A request the scheduler holds while no worker is ready: new (arrived before any
    worker) or resumed (was live when its worker was lost). `arrival` is kept so a resumed
    request keeps its place and its TTFT clock."""

    identity: bytes
    req: p.AddRequest
    arrival: float
    resumed: bool = False
    held_at: float = 0.0  # since when it waits for a worker (WORKER_WAIT_S)


def resubmission(r: Request) -> p.AddRequest:
    """A live core request as the AddRequest that re-creates it on a fresh worker: the
    prompt, the outputs already streamed, its sampling params and its resolved SLOs."""
    return p.AddRequest(
        r.request_id,
        list(r.prompt_token_ids),
        r.params,
        p.SLO(r.ttft_slo, r.tbt_slo),
        list(r.output_token_ids),
    )


class WorkerLink:
    """The scheduler's side of its one worker: the driver of a fresh core for each ready
    worker, the requests held while none is ready, when a worker counts as lost, and the
    reset that brings a frozen or failed one back without a restart (service.py's docstring)."""

    def __init__(self, sock: zmq.asyncio.Socket, cfg: SchedulerConfig, log, pipeline_depth: int | None,
                 step_timeout_s: float, worker_wait_s: float = WORKER_WAIT_S) -> None:  # fmt: skip
        self.sock = sock
        self.cfg = cfg
        self.log = log
        self.pipeline_depth = pipeline_depth  # None: by the worker's device (config.default_pipeline_depth)
        self.step_timeout_s = step_timeout_s
        self.worker_wait_s = worker_wait_s
        self.lost_reason: str | None = None  # why the last worker was lost
        self.worker: p.WorkerReady | None = None
        self.driver: Driver | None = None  # with a ready worker: its core and the plans in flight
        self.held: list[Held] = []  # requests waiting for a ready worker, oldest first
        self.step_times: deque[tuple[float, int]] = deque(maxlen=NUM_STEP_SAMPLES)  # (seconds, tokens)
        self.last_result_at = 0.0
        self.busy: tuple[int, float] = (-1, 0.0)  # (step id, when) of the last WorkerBusy
        self.num_losses = 0
        self.num_failed_steps = 0  # whole steps failed (WorkerError) since the last result

    def hold(self, identity: bytes, req: p.AddRequest, now: float) -> str | None:
        """Keep a new request until a worker is ready, within the same admission bounds as
        the core's waiting queue (resumed requests were admitted already, here or, for a
        gateway's resubmission, elsewhere: they do not count). Returns the refusal, if any."""
        new = [h.req for h in self.held if not (h.resumed or h.req.resumed)]
        num_tokens = sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in new)
        own = len(req.prompt_token_ids) + len(req.output_token_ids)
        if not req.resumed and (refusal := self.cfg.admission_refusal(len(new), num_tokens, own)):
            return refusal
        self.held.append(Held(identity, req, now, held_at=now))
        return None

    def expired(self, now: float) -> list[Held]:
        """The held requests that waited WORKER_WAIT_S for a worker in vain (none is held
        any more): each fails with `wait_message()`."""
        late = [h for h in self.held if now - h.held_at > self.worker_wait_s]
        if late:
            self.held = [h for h in self.held if now - h.held_at <= self.worker_wait_s]
        return late

    def wait_message(self) -> str:
        last = f"the last one was lost: {self.lost_reason}" if self.lost_reason else "none has connected yet"
        return f"no model worker was ready within {self.worker_wait_s:g}s ({last})"

    def connect(self, ready: p.WorkerReady, send) -> list[Held]:
        """A fresh core and driver for `ready` (empty pools). Returns the held requests to
        add to it, resumed ones first (they are older); none is held any more."""
        self.worker = ready
        on_cpu = ready.device.startswith("cpu")
        # The worker owns the KV layout, so its block size wins.
        cfg = dataclasses.replace(self.cfg, block_size=ready.block_size).for_device(on_cpu)
        cfg = cfg.for_worker(ready.block_bytes, ready.copy_gbps)  # the DRAM tier's copy costs, B_xfer
        core = SchedulerCore(cfg, ready.num_hbm_blocks, ready.num_dram_blocks, ready.max_model_len, ready.model_name)
        depth = self.pipeline_depth or config.default_pipeline_depth(on_cpu=on_cpu)
        self.driver = Driver(core, send, depth, time.perf_counter)
        self.step_times.clear()
        held, self.held = self.held, []
        self.log.info("worker ready", model=ready.model_name, device=ready.device, pipeline_depth=depth,
                      hbm_blocks=ready.num_hbm_blocks, dram_blocks=ready.num_dram_blocks,
                      num_resumed=sum(h.resumed for h in held))  # fmt: skip
        return [h for h in held if h.resumed] + [h for h in held if not h.resumed]

    def overdue(self, now: float) -> str | None:
        """Why the worker is lost when the oldest plan's result is overdue; None while not."""
        if self.driver is None or not self.driver.in_flight:
            return None
        oldest = self.driver.in_flight[0]
        started = max(oldest.sent_at, self.last_result_at)
        if now - started <= step_deadline_s(self.step_times, oldest.num_tokens, self.step_timeout_s):
            return None
        busy_step, busy_at = self.busy
        if busy_step == oldest.step_id and now - busy_at < BUSY_FRESH_S and now - started < MAX_BUSY_STEP_S:
            return None  # slow, and says so
        return f"step {oldest.step_id} not back after {now - started:.1f}s"

    def stepped(self, sent_at: float, num_tokens: int, now: float) -> None:
        """A step's result is back: its time feeds the deadline."""
        self.step_times.append((now - max(sent_at, self.last_result_at), num_tokens))
        self.last_result_at = now
        self.num_failed_steps = 0

    def lose(self, owner: dict[str, bytes], reason: str, reset: bool) -> None:
        """Hold every live request that has a gateway for the next ready worker; fail
        nothing. `reset`: the worker may still be there (frozen, or its step failed): ask it
        to drop everything and announce itself again once it gets to it."""
        core = self.driver.core if self.driver is not None else None
        live = sorted(core.requests.values(), key=lambda r: r.seq) if core else []
        now = time.monotonic()
        resumed = [
            Held(owner[r.request_id], resubmission(r), r.arrival, True, now) for r in live if r.request_id in owner
        ]
        self.held = resumed + self.held
        self.num_losses += 1
        self.lost_reason = reason
        self.driver = None
        self.log.error("worker lost; holding live requests for the next worker", reason=reason,
                       num_held=len(resumed), reset=reset)  # fmt: skip
        if reset:
            send_now(self.sock, p.encode(p.ResetWorker(reason)))  # none connected: the next starts afresh
