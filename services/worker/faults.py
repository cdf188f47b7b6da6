"""Fault injection: make the worker's step raise on purpose, for the reliability tests and
`superinfer bench chaos`. Off unless `SUPERINFER_FAULTS` is set; refused (the worker does not
start) in production, which is a worker with CURVE keys or a non-loopback endpoint.

    SUPERINFER_FAULTS="step=5"        the 5th plan this worker executes raises once: its re-run passes
    SUPERINFER_FAULTS="token=9001"    a step raises whenever it computes a request whose prompt
                                      holds token id 9001: that request fails alone, the rest run
    SUPERINFER_FAULTS="request=cmpl-" the same for request ids starting with the prefix
    SUPERINFER_FAULTS="signals"       SIGUSR1: the next step raises once; SIGUSR2: the next step's
                                      first request raises until it is failed

Entries combine with commas ("step=5,signals"). A fault raises `InjectedFault` after the step's
compute has run (tokens sampled and appended, block tables grown, grammars advanced): the
hardest place to undo, so the re-run's rollback is tested where it matters.
"""

from __future__ import annotations

import os
import signal
import threading

from shared import zmqsec
from shared.protocol import NewRequestData, ScheduledRequest

FAULTS_ENV = "SUPERINFER_FAULTS"


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
        self._lock = threading.Lock()
        for entry in filter(None, (e.strip() for e in spec.split(","))):
            key, _, value = entry.partition("=")
            if key == "step":
                self.on_step = int(value)
            elif key == "token":
                self.tokens.add(int(value))
            elif key == "request":
                self.prefixes.append(value)
            elif key == "signals":
                signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "raise_next", True))
                signal.signal(signal.SIGUSR2, lambda *_: setattr(self, "poison_next", True))
            else:
                raise ValueError(f"{FAULTS_ENV}: unknown entry {entry!r} (step=N, token=T, request=PREFIX, signals)")
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

    def forget(self, request_ids: list[str]) -> None:
        self.victims.difference_update(request_ids)
