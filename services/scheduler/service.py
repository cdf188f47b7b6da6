"""The scheduler service: the pure RotaSched core between gateways and one worker.

    gateways ──DEALER──▶ ROUTER [scheduler] DEALER ◀──DEALER── worker
                         (bind)      ▲       (bind)
    superinfer queues ──DEALER──▶ ROUTER (admin, bind)

One loop: receive (bounded per tick) → dispatch → step → send. The core never sees a
socket or the clock: the step driver (driver.py, the same one the simulator runs) keeps
the pipeline of plans; this file feeds it `now`, moves its Plans and outputs, and tells
the `Observer` (admin.py) what happened so operators can see it.

A worker that dies or hangs costs a pause, not a request. It is declared lost when a step
result is overdue (`step_deadline_s`) or when a new `WorkerReady` arrives (a restarted
worker has empty pools). Every live request is then held, with its prompt, the output
tokens already streamed, its sampling params, SLOs and arrival time, and re-added to a fresh
core when the next worker is ready: its KV is recomputed and it carries on. Tokens of the
steps in flight at the crash were never streamed, so they are simply computed again; the
worker seeds sampling per position, so outputs match an undisturbed run. An overdue worker
is also sent `ResetWorker`: one that was only frozen (SIGSTOP, swapped out) answers it, once
it runs again, with a new `WorkerReady`, so no supervisor is needed to serve again; its
late results are for plans no longer in flight and are dropped (no token is sent twice). A
request held WORKER_WAIT_S in vain (resubmissions from gateways are held too) fails, naming why.

A step that raises fails only the requests that make it raise (the worker re-runs it, then
isolates them: `StepResult.failed`), each with an error naming the fault. A step whose copies
raise (`WorkerError`) is a lost worker that is reset, MAX_FAILED_STEPS in a row fail the rest.

A gateway that goes silent for `GATEWAY_STALE_S` (it says hello every second) is gone: its
requests are aborted, so a crashed or restarted gateway leaves nothing running here. A
gateway that lost this scheduler resubmits its requests elsewhere (under new ids) and,
should this scheduler answer again, aborts the old ones itself.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict

import msgspec
import zmq
import zmq.asyncio

from services.scheduler import admin
from services.scheduler.cache_report import STATS_COUNTS, CacheReport, core_report
from services.scheduler.core import Overloaded, SchedulerConfig, SchedulerCore
from services.scheduler.core.step import Step
from services.scheduler.driver import Driver
from services.scheduler.metrics import Flight, trace_line
from services.scheduler.recovery import STEP_TIMEOUT_S, WORKER_WAIT_S, Held, WorkerLink, out_of_vocab, send_now
from shared import config, protocol as p, zmqsec

MAX_RECV_PER_TICK = 256
MAX_ADMIN_PER_TICK = 16  # admin queries are O(live requests): few per tick
STATS_INTERVAL_S = 1.0
STATS_MIN_GAP_S = 0.05
GATEWAY_STALE_S = 5.0  # a gateway not heard from this long is gone: its requests are aborted
INVARIANT_CHECK_EVERY = 200  # steps
MAX_FAILED_STEPS = 3  # whole steps failed in a row (each followed by a reset) before live requests fail
DRAINING_MESSAGE = "the scheduler is draining: it admits no new requests"


class SchedulerService:
    def __init__(
        self,
        cfg: SchedulerConfig,
        bind: str,
        worker_bind: str,
        log,
        pipeline_depth: int | None = None,
        step_trace: str | None = None,
        admin_bind: str | None = None,
        admin_token: str | None = None,
        step_timeout_s: float = STEP_TIMEOUT_S,
        zmq_keys: str | None = None,
        worker_wait_s: float = WORKER_WAIT_S,
    ) -> None:
        self.cfg = cfg
        self.log = log
        self.id = f"sched-{uuid.uuid4().hex[:8]}"
        self.ctx = zmq.asyncio.Context()
        self.curve = zmqsec.Curve(self.ctx, zmq_keys, log)  # every bind here is a server
        self.front = self._socket(zmq.ROUTER, bind)
        self.back = self._socket(zmq.DEALER, worker_bind)
        self.admin = self._admin_socket(admin_bind)
        self.admin_token = admin_token
        self.observer = admin.Observer(log, time.monotonic())
        self._draining = False
        self.link = WorkerLink(self.back, cfg, log, pipeline_depth, step_timeout_s, worker_wait_s)
        self.owner: dict[str, bytes] = {}  # request_id -> gateway identity
        self.gateways: dict[bytes, float] = {}  # identity -> when it was last heard from
        self.idle = True  # nothing in flight and nothing to schedule
        self.trace = open(step_trace, "a", buffering=1) if step_trace else None
        self.num_steps = 0
        self.last_stats = 0.0
        self.cache_report = CacheReport()  # prefix-cache changes told to gateways with the reports
        self.stats_changed = False
        self.stopping = False

    @property
    def driver(self) -> Driver[Flight] | None:
        return self.link.driver

    @property
    def core(self) -> SchedulerCore | None:
        return self.driver.core if self.driver is not None else None

    @property
    def held(self) -> list[Held]:
        return self.link.held

    @property
    def draining(self) -> bool:
        """Refuse new requests, finish the live ones (`superinfer drain`)."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        self.stats_changed = True  # gateways learn it with the next report

    def _socket(self, kind: int, addr: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        if kind == zmq.ROUTER:  # a gateway that reconnects takes its routing id back at once
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.SNDHWM, config.ZMQ_HWM)
        sock.setsockopt(zmq.RCVHWM, config.ZMQ_HWM)
        sock.setsockopt(zmq.LINGER, config.ZMQ_LINGER_MS)
        self.curve.secure_server(sock, addr)
        sock.bind(addr)
        return sock

    def _admin_socket(self, addr: str | None) -> zmq.asyncio.Socket | None:
        """The admin endpoint is a convenience: an address in use disables it, not serving."""
        if not addr or addr == "off":
            return None
        try:
            return self._socket(zmq.ROUTER, addr)
        except zmq.ZMQError as e:
            self.log.error("admin endpoint disabled", addr=addr, error=str(e))
            return None

    async def run(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        if self.admin is not None:
            poller.register(self.admin, zmq.POLLIN)
        self.log.info("scheduler up", policy=self.cfg.policy, admin=self.admin is not None)
        while not self.stopping:
            events = dict(await poller.poll(timeout=100))
            if self.front in events:
                await self._drain(self.front, self._on_gateway)
            if self.back in events:
                await self._drain(self.back, self._on_worker)
            if self.admin in events:
                await self._drain(self.admin, self._on_admin, MAX_ADMIN_PER_TICK)
            self._check_worker()
            self._forget_silent_gateways()
            self._maybe_step()
            self._maybe_send_stats()
        self.close()

    async def _drain(self, sock: zmq.asyncio.Socket, handler, limit: int = MAX_RECV_PER_TICK) -> None:
        for _ in range(limit):
            try:
                frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            handler(frames)

    # ------------------------------------------------------------ gateway side

    def _on_gateway(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.log.warning("malformed gateway frame", parts=len(frames))
            return
        identity, payload = frames
        try:
            msg = p.gateway_msg_decoder.decode(payload)
        except msgspec.DecodeError as e:
            self.log.warning("undecodable gateway message", error=str(e))
            return
        self.gateways[identity] = time.monotonic()
        match msg:
            case p.GatewayHello(want_cache=want_cache):
                self._reply(identity, self.stats(self.cache_report.snapshot() if want_cache else None))
            case p.AddRequest():
                if self.core is None:
                    if refusal := self.link.hold(identity, msg, time.monotonic()):
                        self._refuse(identity, msg.request_id, refusal, "overloaded")
                else:
                    self._add(identity, msg)
            case p.AbortRequest(request_id=rid):
                self.abort(rid)

    def abort(self, rid: str, why: str | None = None) -> bool:
        """Abort a live or pending request (its gateway is told: an "abort" finish, or the
        error `why`); False if there is none."""
        told = [h.identity for h in self.held if h.req.request_id == rid]
        self.link.held = [h for h in self.held if h.req.request_id != rid]
        now = time.monotonic()
        out = self.core.abort_request(rid, now) if self.core else None
        owner = self.owner.pop(rid, None)
        self.stats_changed = True
        if out is not None:
            out.attribution = self.observer.ended(rid, "abort", now)
            told += [owner] if owner is not None else []
        for identity in told:
            ended = p.StepOutputs([out or p.TokenOutput(rid, [], "abort")])
            self._reply(identity, p.RequestError(rid, why, p.GATEWAY_SILENT) if why else ended)
        return out is not None or bool(told)

    def _forget_silent_gateways(self) -> None:
        now = time.monotonic()
        for identity in [g for g, seen in self.gateways.items() if now - seen > GATEWAY_STALE_S]:
            del self.gateways[identity]
            orphans = [rid for rid, owner in self.owner.items() if owner == identity]
            orphans += [h.req.request_id for h in self.held if h.identity == identity]
            self.log.warning("gateway gone; aborting its requests", gateway=identity.decode(errors="replace"),
                             num_requests=len(orphans))
            # An error, not a finish: a gateway that was only frozen (or cut off) resubmits them.
            why = f"aborted by the scheduler: its gateway was silent for over {GATEWAY_STALE_S:g}s"
            for rid in orphans:
                self.abort(rid, why)

    def _add(self, identity: bytes, req: p.AddRequest, arrival: float | None = None) -> None:
        if self.draining:
            self._refuse(identity, req.request_id, DRAINING_MESSAGE, "service_unavailable")
            return
        now = time.monotonic() if arrival is None else arrival
        if bad := out_of_vocab(req, self.link.worker.vocab_size):
            self._refuse(identity, req.request_id, bad, "invalid_request_error")
            return
        try:
            self.core.add_request(req, now, admitted=arrival is not None or req.resumed)  # held, or resubmitted
        except Overloaded as e:
            self._refuse(identity, req.request_id, str(e), "overloaded")
            return
        except ValueError as e:
            self._refuse(identity, req.request_id, str(e), "invalid_request_error")
            return
        self.owner[req.request_id] = identity
        self.observer.added(self.core.requests[req.request_id], now)

    def _refuse(self, identity: bytes, rid: str, message: str, kind: str, forget: bool = False) -> None:
        self.log.info("request_refused", request_id=rid, type=kind, error=message)
        if forget:  # it had been live here
            self.owner.pop(rid, None)
        self._reply(identity, p.RequestError(rid, message, kind))

    def _reply(self, identity: bytes, msg) -> None:
        self.front.send_multipart([identity, p.encode(msg)], flags=zmq.NOBLOCK)

    # ------------------------------------------------------------ operator side

    def _on_admin(self, frames: list[bytes]) -> None:
        """[identity, (empty delimiter from a REQ,) payload] in; the same envelope out."""
        if len(frames) < 2:
            return
        reply = admin.handle(frames[-1], self, time.monotonic())
        self.admin.send_multipart([*frames[:-1], p.encode(reply)], flags=zmq.NOBLOCK)

    # ------------------------------------------------------------ worker side

    def _on_worker(self, frames: list[bytes]) -> None:
        try:
            msg = p.worker_reply_decoder.decode(frames[-1])
        except msgspec.DecodeError as e:
            self.log.warning("undecodable worker message", error=str(e))
            return
        match msg:
            case p.WorkerReady():
                self._on_worker_ready(msg)
            case p.StepResult():
                self._on_result(msg)
            case p.WorkerError():
                self._on_worker_error(msg)
            case p.WorkerBusy(step_id=step_id):
                self.link.busy = (step_id, time.monotonic())

    def _on_worker_error(self, err: p.WorkerError) -> None:
        """A step failed whole (its copies raised): the worker is reset and every live request
        resumed on it, or failed once MAX_FAILED_STEPS came in a row."""
        if (driver := self.driver) is None or not driver.in_flight or driver.in_flight[0].step_id != err.step_id:
            self.log.warning("worker error for a step not in flight", step_id=err.step_id, error=err.message)
            return
        self.link.num_failed_steps += 1
        if self.link.num_failed_steps >= MAX_FAILED_STEPS:
            message = f"the worker failed {self.link.num_failed_steps} steps in a row, the last with {err.message}"
            for rid, owner in self.owner.items():
                self._reply(owner, p.RequestError(rid, message, "internal_error"))
            self.owner.clear()
            self.observer.reset()
            self.link.num_failed_steps = 0
        self._lose_worker(f"worker step {err.step_id} failed: {err.message}", reset=True)

    def _on_worker_ready(self, ready: p.WorkerReady) -> None:
        """A (new, restarted or reset) worker with empty pools: a fresh core, then every held
        request, resumed ones first (they are older), each with its original arrival."""
        if self.core is not None:
            self._lose_worker("a new worker connected")
        self.observer.block_bytes = ready.block_bytes
        self.observer.metrics.exposed.model_name = ready.model_name
        for h in self.link.connect(ready, self._send_plan):
            self._resume(h) if h.resumed else self._add(h.identity, h.req, h.arrival)

    def _resume(self, h: Held) -> None:
        """Re-add a request that was live on the lost worker; its timeline carries on.

        The core takes the arrival as its last-token time too, so a resumed request that
        has emitted tokens looks as late as it can be: LVF puts it first after the pause."""
        try:
            self.core.add_request(h.req, h.arrival, admitted=True)
        except ValueError as e:  # the new worker is smaller than the old one
            self._refuse(h.identity, h.req.request_id, str(e), "internal_error", forget=True)
            return
        self.owner[h.req.request_id] = h.identity

    def _check_worker(self) -> None:
        """Lose (and reset) the worker when the oldest plan's result is overdue; fail what waited for one in vain."""
        now = time.monotonic()
        if reason := self.link.overdue(now):
            self._lose_worker(reason, reset=True)
        for h in self.link.expired(now):  # waited for a worker in vain
            self._refuse(h.identity, h.req.request_id, self.link.wait_message(), "service_unavailable", forget=True)

    def _lose_worker(self, reason: str, reset: bool = False) -> None:
        """Hold every live request for the next worker; fail nothing."""
        self.link.lose(self.owner, reason, reset)
        self.idle = True
        self.stats_changed = True

    def _on_result(self, result: p.StepResult) -> None:
        now = time.monotonic()
        applied = self.driver.result(result, now) if self.driver is not None else None
        if applied is None:
            self.log.warning("unexpected step result", step_id=result.step_id)
            return
        flight, outputs = applied
        core = self.driver.core  # kept: planning below may lose the worker
        self.stats_changed = True
        self.link.stepped(flight.sent_at, flight.num_tokens, now)
        if result.failed:
            self._fail_requests(result.failed, now)
        stalled = self.observer.stepped(flight, result, now)
        self.observer.outputs(outputs, now)
        if self.trace:
            self.trace.write(trace_line(result, flight, stalled, core.stats(), time.time()))
        self._maybe_step()  # the next plan before the replies: at depth 1 the worker waits for it
        by_owner: dict[bytes, list[p.TokenOutput]] = defaultdict(list)
        for out in outputs:
            owner = self.owner.get(out.request_id)
            if owner is None:
                continue
            by_owner[owner].append(out)
            if out.finish_reason is not None:
                del self.owner[out.request_id]
        for owner, outs in by_owner.items():
            self._reply(owner, p.StepOutputs(outs))
        self.num_steps += 1
        if self.num_steps % INVARIANT_CHECK_EVERY == 0 or not core.has_unfinished():
            core.check_invariants()

    def _fail_requests(self, failed: dict[str, str], now: float) -> None:
        """Requests the worker's step raised on, twice and alone: each ends with the fault."""
        for rid, error in failed.items():
            self.log.error("request_failed_by_worker", request_id=rid, error=error)
            out = self.core.abort_request(rid, now)
            self.observer.ended(rid, "abort", now)
            owner = self.owner.pop(rid, None)
            if out is not None and owner is not None:
                message = f"the worker's step raised on this request ({error}); it alone was failed"
                self._reply(owner, p.RequestError(rid, message, "internal_error"))

    # ------------------------------------------------------------ stepping and stats

    def _maybe_step(self) -> None:
        """Keep up to `pipeline_depth` plans at the worker: plan t+1 is built and sent
        while t computes (the core assumes one new token per decoding request)."""
        if self.driver is None:
            return
        try:
            nothing_to_plan = self.driver.step(time.monotonic())
        except zmq.Again:  # no worker connected: its plan is recomputed on the next one
            self._lose_worker("no worker connected")
            return
        if nothing_to_plan:
            self.idle = self.idle or not self.driver.in_flight

    def _send_plan(self, plan: p.Plan, step: Step, schedule_s: float) -> Flight:
        """The driver's `send`: to the worker (zmq.Again if none is connected)."""
        t0 = time.perf_counter()
        if not send_now(self.back, p.encode(plan)):
            raise zmq.Again()
        # Its schedule time counts the send too, as the step trace always has.
        flight = Flight.of(plan, step, schedule_s + time.perf_counter() - t0, self.idle, time.monotonic())
        self.idle = False
        self.observer.planned(step, self.driver.core.cfg)
        return flight

    def _maybe_send_stats(self) -> None:
        """A load report after a change (at most every STATS_MIN_GAP_S), and at least every
        STATS_INTERVAL_S as a heartbeat."""
        now = time.monotonic()
        since = now - self.last_stats
        if since < STATS_MIN_GAP_S or (not self.stats_changed and since < STATS_INTERVAL_S):
            return
        self.last_stats = now
        self.stats_changed = False
        report = self.stats(self.cache_report.core_events(self.core))
        for identity in self.gateways:
            self._reply(identity, report)
        if self.core is not None:
            self.observer.publish(self.core, self.draining, now)

    def stats(self, cache: p.CacheEvents | None = None) -> p.SchedulerStats:
        """The load report; `cache`: the prefix-cache events it carries (cache_report.py)."""
        w = self.link.worker
        if self.core is not None:
            fields = core_report(self.core)
        else:
            fields = {**dict.fromkeys(STATS_COUNTS, 0), "num_waiting": len(self.held), "max_num_seqs": self.cfg.max_num_seqs}
        return p.SchedulerStats(
            scheduler_id=self.id,
            model_name=w.model_name if w else "",
            max_model_len=w.max_model_len if w else 0,
            worker_ready=self.core is not None,
            draining=self.draining,
            worker_id=w.worker_id if w and self.core else "",
            block_size=w.block_size if w else 0,
            native_missing=w.native_missing if w else "",
            **fields,
            cache_seq=self.cache_report.seq,
            cache=cache,
        )

    def close(self) -> None:
        if self.trace:
            self.trace.close()
        for sock in (self.front, self.back, self.admin):
            if sock is not None:
                sock.close()
        self.curve.close()
        self.ctx.term()

