"""Fault injection: make the worker's step raise on purpose, for the reliability tests and
`superinfer bench chaos`. Off unless `SUPERINFER_FAULTS` is set; refused (the worker does not
start) in production, which is a worker with CURVE keys or a non-loopback endpoint.

    SUPERINFER_FAULTS="step=5"        the 5th plan this worker executes raises once: its re-run passes
    SUPERINFER_FAULTS="token=9001"    a step raises whenever it computes a request whose prompt
                                      holds token id 9001: that request fails alone, the rest run
    SUPERINFER_FAULTS="request=cmpl-" the same for request ids starting with the prefix
    SUPERINFER_FAULTS="signals"       SIGUSR1: the next step raises once; SIGUSR2: the next step's
                                      first request raises until it is failed; BAD_PLAN_SIGNAL: the
                                      next plan that schedules a request arrives with a bad id or
                                      length (`corrupt`), as a scheduler bug would send it
    SUPERINFER_FAULTS="plan=5"        the 5th plan this worker receives arrives bad, the same way

Entries combine with commas ("step=5,signals"). A fault raises `InjectedFault` after the step's
compute has run (tokens sampled and appended, block tables grown, grammars advanced): the
hardest place to undo, so the re-run's rollback is tested where it matters.
"""

from __future__ import annotations

import os
import signal
import threading

import msgspec

from shared import zmqsec
from shared.protocol import NewRequestData, Plan, ScheduledRequest, WorkerReady

FAULTS_ENV = "SUPERINFER_FAULTS"
BAD_PLAN_SIGNAL = signal.SIGRTMIN + 1
# What `corrupt` breaks, in turn: a block id past the HBM pool, a negative position, a block
# table wider than a whole context, a prompt token past the vocabulary, a swap-in from past the
# DRAM pool.
CORRUPTIONS = ("block_id", "position", "table", "token_id", "swap_in")


class InjectedFault(RuntimeError):
    """Raised by a step on purpose (`SUPERINFER_FAULTS`)."""


def refusal(spec: str, addrs: list[str], zmq_keys: str | None) -> str | None:
    """Why the worker must not start with `spec` (None: it may)."""
    if not spec:
        return None
    if zmq_keys or any(zmqsec.needs_keys(a) for a in addrs if a):
        return f"{FAULTS_ENV} is set: fault injection is refused in production (CURVE keys or a network endpoint)"
    return None


class Faults:
    """The parsed spec, and the step counter and victims it acts on. `check` is called once
    per compute attempt of a step, from the step thread; the signal handlers only set flags."""

    def __init__(self, spec: str = "") -> None:
        self.on_step: int | None = None
        self.tokens: set[int] = set()
        self.prefixes: list[str] = []
        self.victims: set[str] = set()  # request ids that raise whenever computed
        self.num_plans = 0
        self.raise_next = False
        self.poison_next = False
        self.bad_plan_next = False
        self.bad_plan_on: int | None = None
        self.num_received = 0
        self.num_corrupted = 0
        self._lock = threading.Lock()
        for entry in filter(None, (e.strip() for e in spec.split(","))):
            key, _, value = entry.partition("=")
            if key == "step":
                self.on_step = int(value)
            elif key == "token":
                self.tokens.add(int(value))
            elif key == "request":
                self.prefixes.append(value)
            elif key == "plan":
                self.bad_plan_on = int(value)
            elif key == "signals":
                signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "raise_next", True))
                signal.signal(signal.SIGUSR2, lambda *_: setattr(self, "poison_next", True))
                signal.signal(BAD_PLAN_SIGNAL, lambda *_: setattr(self, "bad_plan_next", True))
            else:
                raise ValueError(
                    f"{FAULTS_ENV}: unknown entry {entry!r} (step=N, token=T, request=PREFIX, plan=N, signals)"
                )
        self.enabled = bool(spec.strip())

    @classmethod
    def from_env(cls) -> Faults:
        return cls(os.environ.get(FAULTS_ENV, ""))

    def plan_started(self) -> None:
        self.num_plans += 1

    def added(self, new: list[NewRequestData]) -> None:
        """Requests that will raise whenever computed: by a prompt token or an id prefix."""
        for r in new:
            if self.tokens.intersection(r.prompt_token_ids) or any(r.request_id.startswith(x) for x in self.prefixes):
                self.victims.add(r.request_id)

    def check(self, scheduled: list[ScheduledRequest], retry: bool) -> None:
        """After a compute attempt of the current plan (`retry`: not its first)."""
        if not self.enabled or not scheduled:
            return
        with self._lock:
            if self.poison_next and scheduled:
                self.poison_next = False
                self.victims.add(scheduled[0].request_id)
            once = not retry and (self.raise_next or self.num_plans == self.on_step)
            self.raise_next = self.raise_next and not once
        if once:
            raise InjectedFault(f"injected fault: step {self.num_plans} raises once")
        hit = [s.request_id for s in scheduled if s.request_id in self.victims]
        if hit:
            raise InjectedFault(f"injected fault: computing request {hit[0]} raises")

    def corrupt(self, plan: Plan, ready: WorkerReady) -> Plan:
        """`plan` as received, or, when a bad plan is due and it schedules a request, a copy with
        one id or length out of range (CORRUPTIONS, in turn). Called from the socket thread."""
        if not self.enabled:
            return plan
        self.num_received += 1
        due = self.bad_plan_next or self.num_received == self.bad_plan_on
        if not due or not plan.scheduled:
            self.bad_plan_on = self.num_received + 1 if due else self.bad_plan_on  # the next one, then
            return plan
        self.bad_plan_next = False
        kind = CORRUPTIONS[self.num_corrupted % len(CORRUPTIONS)]
        self.num_corrupted += 1
        first, rest = plan.scheduled[0], plan.scheduled[1:]
        replace = msgspec.structs.replace
        if kind == "block_id":
            first = replace(first, new_block_ids=[*first.new_block_ids, ready.num_hbm_blocks + 7])
        elif kind == "position":
            first = replace(first, num_computed_tokens=-3)
        elif kind == "table":
            first = replace(first, block_table=[0] * (ready.max_model_len // ready.block_size + 2))
        elif kind == "token_id" and plan.new_requests:
            r = plan.new_requests[0]
            bad = replace(r, prompt_token_ids=[*r.prompt_token_ids[:-1], ready.vocab_size + 11])
            return replace(plan, new_requests=[bad, *plan.new_requests[1:]])
        else:
            return replace(plan, swap_in=[*plan.swap_in, (ready.num_dram_blocks + 5, 0)])
        return replace(plan, scheduled=[first, *rest])

    def forget(self, request_ids: list[str]) -> None:
        self.victims.difference_update(request_ids)
