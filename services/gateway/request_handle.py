"""One request as the gateway keeps it while schedulers come and go, and one scheduler as the
gateway sees it (scheduler_client.py drives both)."""

from __future__ import annotations

import asyncio

import msgspec
import zmq.asyncio

from services.gateway.headroom import headroom_score, num_blocks
from shared.protocol import AddRequest, RequestError, SchedulerStats, TokenOutput

STALE_AFTER_S = 5.0  # no message for this long: the scheduler is considered gone

Reply = TokenOutput | RequestError


class RequestHandle:
    """One submitted request's replies, in order; the last is final.

    It outlives its scheduler: `token_ids` (what the client has been sent) and `req` are
    all a resubmission needs. Each submission goes out under its own wire id (the request
    id, then `<id>~<n>` for the n-th resubmission), so late replies from a lost scheduler
    never reach the new attempt."""

    def __init__(self, req: AddRequest, link: SchedulerLink) -> None:
        self.req = req
        self.request_id = req.request_id
        self.link = link
        self.wire_id = req.request_id
        self.num_submissions = 1
        self.token_ids: list[int] = []  # streamed so far
        self.lost_at: float | None = None  # its scheduler was lost; cleared by the next token
        # Since when no scheduler has it (the failover grace runs): set when one is lost, kept
        # through resubmissions that are refused, cleared by the next token.
        self.orphaned_at: float | None = None
        self.last_refusal: str | None = None  # why the last resubmission was refused ...
        self.refused_by: set[str] = set()  # ... and by whom: no scheduler holds it twice
        self.queue: asyncio.Queue[Reply] = asyncio.Queue()  # bounded by max_tokens

    async def get(self) -> Reply:
        return await self.queue.get()

    def resubmission(self) -> AddRequest:
        """The request as a new scheduler must see it: its prompt plus what was streamed."""
        self.wire_id = f"{self.request_id}~{self.num_submissions}"
        self.num_submissions += 1
        return msgspec.structs.replace(
            self.req,
            request_id=self.wire_id,
            output_token_ids=[*self.req.output_token_ids, *self.token_ids],
            resumed=True,
        )

    def num_generated(self) -> int:
        return len(self.req.output_token_ids) + len(self.token_ids)


class SchedulerLink:
    """One scheduler: its socket, its latest load report, and the requests it serves."""

    def __init__(self, addr: str, socket: zmq.asyncio.Socket) -> None:
        self.addr = addr
        self.socket = socket
        self.stats: SchedulerStats | None = None
        self.last_seen = float("-inf")
        self.request_ids: set[str] = set()  # wire ids of the requests it serves
        self.abandoned: set[str] = set()  # wire ids to abort when it is heard from again
        self.next_hello = 0.0
        self.unreachable = False  # a send failed: out of rotation until it is heard from again
        # Requests sent since the last load report, which does not count them yet.
        self.num_unreported = 0
        self.num_unreported_blocks = 0

    def is_live(self, now: float) -> bool:
        return self.stats is not None and not self.unreachable and now - self.last_seen < STALE_AFTER_S

    def routable(self, now: float) -> bool:
        return self.is_live(now) and self.stats.worker_ready

    def holds(self, now: float) -> bool:
        """There, not draining, its worker not ready: it holds a resubmission until one is."""
        return self.is_live(now) and not self.stats.worker_ready and not self.stats.draining

    def score(self) -> float:
        return headroom_score(self.stats, self.num_unreported, self.num_unreported_blocks)

    def is_new_instance(self, stats: SchedulerStats) -> bool:
        return self.stats is not None and stats.scheduler_id != self.stats.scheduler_id

    def on_sent(self, req: AddRequest) -> None:
        self.request_ids.add(req.request_id)
        self.num_unreported += 1
        self.num_unreported_blocks += num_blocks(req, self.stats.block_size if self.stats else 0)

    def on_report(self, stats: SchedulerStats, now: float) -> None:
        self.stats = stats
        self.num_unreported = self.num_unreported_blocks = 0
        self.on_heard(now)

    def on_heard(self, now: float) -> None:
        self.last_seen = now
        self.unreachable = False
