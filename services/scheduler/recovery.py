"""Surviving a lost worker: when a step result is overdue, and how a live request is held
and re-created on the next worker (see the scheduler service's docstring)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from services.scheduler.core import Request
from shared import protocol as p

STEP_TIMEOUT_S = 2.0  # a step result later than this (at least) means the worker is lost
STEP_TIMEOUT_FACTOR = 10.0  # ... or this many median recent steps, when steps are slow
FIRST_STEP_TIMEOUT_S = 30.0  # before any step is measured: warm-up and first prefills are slow
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


@dataclass(slots=True)
class Held:
    """A request the scheduler holds while no worker is ready: new (arrived before any
    worker) or resumed (was live when its worker was lost). `arrival` is kept so a resumed
    request keeps its place and its TTFT clock."""

    identity: bytes
    req: p.AddRequest
    arrival: float
    resumed: bool = False


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
