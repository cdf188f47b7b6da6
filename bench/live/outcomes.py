"""One request of `bench soak`, as the client saw it: sent, hung up on purpose, refused,
failed or completed (`classify`), and why a failed one failed."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import aiohttp

from bench.live.serve import HUNG_UP, error_message, read_stream
from bench.live.workload import WorkItem
from bench.report.metrics import RequestRecord

REFUSALS = (429, 503)  # with Retry-After: the server said no, not lost
KINDS = ("completed", "disconnected", "failed", "rejected")


@dataclass(frozen=True)
class Hangup:
    """Where a request leaves on purpose: after `after_tokens` streamed chunks; with 0,
    after `patience_s` without an answer, or on the answer if it comes first."""

    after_tokens: int
    patience_s: float


def plan_hangups(items: list[WorkItem], frac: float, patience_s: float, seed: int) -> list[Hangup | None]:
    rng = random.Random(f"hangups-{seed}")
    plan: list[Hangup | None] = []
    for item in items:
        if rng.random() >= frac:
            plan.append(None)
        elif rng.random() < 0.5 or item.output_tokens < 2:
            plan.append(Hangup(0, rng.uniform(0.0, patience_s)))
        else:
            plan.append(Hangup(rng.randint(1, item.output_tokens - 1), math.inf))
    return plan


@dataclass
class Outcome:
    """One request as the client saw it; `record` holds its timings (bench.report.metrics)."""

    record: RequestRecord
    hangup: Hangup | None = None
    status: int | None = None
    retry_after: bool = False
    num_chunks: int = 0
    finish_reason: str | None = None
    hung_up: bool = False
    unfinished: bool = False  # still open when the drain timeout ran out
    ended: bool = False

    def on_event(self, event: dict) -> bool:
        """read_stream's hook: note chunks and the finish reason; True where we hang up."""
        choices = event.get("choices") or []
        if choices and self.hangup is not None and self.num_chunks >= self.hangup.after_tokens:
            self.hung_up = True
            return True
        if choices:
            self.num_chunks += 1
            self.finish_reason = choices[0].get("finish_reason") or self.finish_reason
        return False


def classify(o: Outcome) -> str:
    if o.status in REFUSALS and o.retry_after:
        return "rejected"
    if o.hung_up:
        return "disconnected"
    r = o.record
    if r.ok and o.finish_reason and r.output_tokens == r.expected_output_tokens and not o.unfinished:
        return "completed"
    return "failed"


def failure_reason(o: Outcome) -> str:
    r = o.record
    if o.unfinished:
        return "still open after the drain timeout"
    if r.error:
        return r.error
    if not o.finish_reason:
        return "stream ended without finish_reason"
    return f"finished with {r.output_tokens} of {r.expected_output_tokens} tokens"


async def attempt(session: aiohttp.ClientSession, url: str, body: dict, out: Outcome, t0: float) -> None:
    """Send one streamed completion and fill `out`; never raises but for cancellation."""
    try:
        await _attempt(session, url, body, out, t0)
    finally:
        out.ended = True


async def _attempt(session: aiohttp.ClientSession, url: str, body: dict, out: Outcome, t0: float) -> None:
    start = time.perf_counter()
    out.record.start_s = start - t0
    patience = out.hangup.patience_s if out.hangup and out.hangup.after_tokens == 0 else math.inf
    try:
        async with asyncio.timeout(None if math.isinf(patience) else patience) as waited:
            resp = await session.post(url, json=body)
    except (aiohttp.ClientError, TimeoutError) as e:
        out.hung_up = isinstance(e, TimeoutError) and waited.expired()
        out.record.error = HUNG_UP if out.hung_up else f"{type(e).__name__}: {e}"[:160]
        return
    async with resp:
        out.status = resp.status
        try:
            if resp.status != 200:
                out.retry_after = "Retry-After" in resp.headers
                out.record.error = f"HTTP {resp.status}: {error_message(await resp.text())}"
            else:
                await read_stream(resp, out.record, start, out.on_event)
        except (aiohttp.ClientError, TimeoutError) as e:
            out.record.error = f"{type(e).__name__}: {e}"[:160]


def new_outcome(item: WorkItem, hangup: Hangup | None = None) -> Outcome:
    record = RequestRecord(
        False, prompt_tokens=item.prompt_tokens, expected_output_tokens=item.output_tokens, arrival_s=item.arrival_s
    )
    return Outcome(record, hangup)
