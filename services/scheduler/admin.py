"""The operator's view of the scheduler.

`Observer` is fed by the service loop (request added, step planned, step done, request
ended) and keeps what the operator asks about: every live request's timeline, the last
minute of steps, the Prometheus metrics, and each request's final log line with its SLO-miss
attribution. `handle` answers one message of the admin socket (`superinfer queues|top|
stats|abort|drain`): queries are open, commands need the admin token, and a malformed
message gets an `AdminError`, never an exception into the loop.
"""

from __future__ import annotations

import hmac
import itertools
from typing import Any, Protocol

import msgspec

from services.scheduler.core import Request, SchedulerConfig, SchedulerCore
from services.scheduler.core.step import Step
from services.scheduler.core.vlt import vlt
from services.scheduler.metrics import (
    FinishSample,
    Flight,
    SchedulerMetrics,
    StepSample,
    Timeline,
    Window,
    admission_vlt,
    is_stall,
    max_paused_vlt,
    state_of,
)
from shared import protocol as p
from shared.config import ADMIN_TOKEN_ENV


class Observer:
    def __init__(self, log, now: float) -> None:
        self.log = log
        self.metrics = SchedulerMetrics()
        self.window = Window(now)
        self.timelines: dict[str, Timeline] = {}
        self.block_bytes = 0  # one KV block in bytes, once the worker reports it

    def added(self, req: Request, now: float) -> None:
        rid, num_prompt = req.request_id, len(req.prompt_token_ids)
        self.timelines[rid] = Timeline(req.arrival, req.ttft_slo, req.tbt_slo, num_prompt, since=now)
        self.log.debug("request_added", request_id=rid, num_prompt_tokens=num_prompt, max_tokens=req.params.max_tokens)

    def planned(self, step: Step, cfg: SchedulerConfig) -> None:
        """Record the state changes the core reports for a step it planned (at `step.now`)."""
        now = step.now
        for req in itertools.chain(step.preempted, step.admitted):
            tl = self.timelines.get(req.request_id)
            state = state_of(req)
            if tl is None or state == tl.state:
                continue  # not seen added (resumed after a worker loss), or already in that state
            old = tl.move(state, now)
            if state == "running":
                self.metrics.vlt_admitted.observe(admission_vlt(req, cfg, now))
            event = "request_admitted" if state == "running" else "request_preempted"
            self.log.debug(event, request_id=req.request_id, from_state=old, to_state=state)

    def stepped(self, flight: Flight, result: p.StepResult, now: float) -> bool:
        """A step's result is in; returns whether the step stalled."""
        t = result.timings
        stalled = is_stall(t, flight.after_idle)
        if t.transfer_wait_s > 0.0:
            for rid in flight.request_ids:
                if (tl := self.timelines.get(rid)) is not None:
                    tl.spent["transfer_wait"] += t.transfer_wait_s
        sample = StepSample(
            now, flight.schedule_s, t.transfer_s, t.compute_s, stalled, flight.num_blocks_moved, flight.num_rotations
        )
        self.window.add_step(sample)
        self.metrics.observe_step(flight, t, stalled, self.block_bytes)
        return stalled

    def outputs(self, outputs: list[p.TokenOutput], now: float) -> None:
        """Token times, and the attribution on each final output."""
        for out in outputs:
            if (tl := self.timelines.get(out.request_id)) is not None:
                for _ in out.token_ids:
                    tl.token(now)
            if out.finish_reason is not None:
                out.attribution = self.ended(out.request_id, out.finish_reason, now)

    def ended(self, request_id: str, reason: str, now: float) -> p.Attribution | None:
        """The request's final log line; aborted requests count toward no SLO."""
        tl = self.timelines.pop(request_id, None)
        if tl is None:
            return None
        att = tl.attribution(now)
        tbt_met = tl.num_gaps_met == tl.num_gaps
        if reason != "abort":
            self.window.add_finish(FinishSample(now, tl.ttft_met, tl.num_gaps, tl.num_gaps_met))
            self.metrics.observe_finish(tl, att)
        self.log.info(
            "request_finished",
            request_id=request_id,
            finish_reason=reason,
            num_prompt_tokens=tl.num_prompt_tokens,
            num_output_tokens=tl.num_tokens,
            ttft_s=None if tl.first_token is None else round(tl.first_token - tl.arrival, 4),
            max_tbt_s=round(tl.max_gap_s, 4),
            ttft_met=tl.ttft_met,
            tbt_met=tbt_met,
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in msgspec.structs.asdict(att).items()},
        )
        return att

    def reset(self) -> None:
        self.timelines.clear()

    def publish(self, core: SchedulerCore, draining: bool, now: float) -> None:
        """Hand the Prometheus thread a fresh copy of the core's counts."""
        values = core.stats()
        values["draining"] = int(draining)
        values["vlt_max"] = max_paused_vlt(core, now)
        self.metrics.snapshot.values = values


# ---------------------------------------------------------------- the admin socket


class Served(Protocol):
    """What the admin socket needs of the scheduler service (service.py), which imports this
    module: what it serves, and the two things an operator may change."""

    log: Any  # a structlog logger
    admin_token: str | None
    cfg: SchedulerConfig
    core: SchedulerCore | None
    observer: Observer
    draining: bool

    def abort(self, request_id: str) -> bool: ...

    def stats(self) -> p.SchedulerStats: ...


def handle(payload: bytes, svc: Served, now: float) -> p.AdminReply:
    try:
        msg = p.admin_request_decoder.decode(payload)
    except msgspec.DecodeError as e:  # ValidationError included
        return p.AdminError(f"malformed admin message: {e}")
    if isinstance(msg, (p.AbortCommand, p.DrainCommand)):
        if (denied := authorize(svc.admin_token, msg.token)) is not None:
            svc.log.warning("admin_command_refused", command=type(msg).__name__, reason=denied.message)
            return denied
    try:
        return _dispatch(msg, svc, now)
    except Exception as e:  # an admin bug must not take the serving loop down
        svc.log.exception("admin_command_failed", command=type(msg).__name__)
        return p.AdminError(f"{type(e).__name__}: {e}", "internal_error")


def _dispatch(msg: p.AdminRequest, svc: Served, now: float) -> p.AdminReply:
    match msg:
        case p.QueuesQuery():
            rows = request_rows(svc.core, svc.observer.timelines, now) if svc.core else []
            return p.QueuesReply(rows, svc.draining)
        case p.StatsQuery():
            return stats_reply(svc, now)
        case p.AbortCommand(request_id=rid):
            if not svc.abort(rid):
                return p.AdminError(f"no live request {rid!r}", "not_found")
            svc.log.info("admin_abort", request_id=rid)
            return p.AdminAck(f"aborted {rid}")
        case p.DrainCommand(undo=undo):
            svc.draining = not undo
            svc.log.info("admin_drain", draining=svc.draining)
            num_live = len(svc.core.requests) if svc.core else 0
            if undo:
                return p.AdminAck("admitting new requests again")
            return p.AdminAck(f"draining: new requests are refused; {num_live} live requests will finish")


def authorize(configured: str | None, given: str) -> p.AdminError | None:
    if not configured:
        return p.AdminError(
            f"commands are disabled: start the scheduler with --admin-token (or {ADMIN_TOKEN_ENV})", "permission_denied"
        )
    if not hmac.compare_digest(given.encode(), configured.encode()):
        return p.AdminError("wrong admin token", "permission_denied")
    return None


def request_rows(core: SchedulerCore, timelines: dict[str, Timeline], now: float) -> list[p.RequestRow]:
    return [request_row(req, timelines.get(rid), core.cfg, now) for rid, req in core.requests.items()]


def request_row(req: Request, tl: Timeline | None, cfg: SchedulerConfig, now: float) -> p.RequestRow:
    since_token = now - req.last_token_time if req.has_emitted else None
    first_token = tl.first_token if tl else None
    if first_token is not None:
        ttft_slack = req.ttft_slo - (first_token - req.arrival)
    else:  # a resubmitted request arrives with tokens: its TTFT was another scheduler's
        ttft_slack = None if req.has_emitted else req.ttft_slo - (now - req.arrival)
    return p.RequestRow(
        request_id=req.request_id,
        state=req.status.value,
        vlt=vlt(req, now, cfg),
        age_s=now - req.arrival,
        since_last_token_s=since_token,
        ttft_slack_s=ttft_slack,
        tbt_slack_s=None if since_token is None else req.tbt_slo - since_token,
        num_prompt_tokens=len(req.prompt_token_ids),
        num_output_tokens=len(req.output_token_ids),
        num_hbm_blocks=len(req.hbm_blocks),
        num_dram_blocks=len(req.dram_blocks),
        times=tl.attribution(now) if tl else p.Attribution(),
        num_cached_tokens=req.num_cached_tokens,
        num_dram_cached_tokens=req.num_dram_cached_tokens,
    )


def stats_reply(svc: Served, now: float) -> p.StatsReply:
    counts = svc.core.stats() if svc.core else {}
    obs = svc.observer
    return p.StatsReply(
        stats=svc.stats(),
        window=obs.window.summary(now, obs.block_bytes),
        policy=svc.cfg.policy,
        ttft_slo_s=svc.cfg.ttft_slo,
        tbt_slo_s=svc.cfg.tbt_slo,
        uptime_s=now - obs.window.started,
        draining=svc.draining,
        num_steps=counts.get("num_steps", 0),
        num_finished=counts.get("num_finished", 0),
        num_aborted=counts.get("num_aborted", 0),
    )
