"""One request as the gateway keeps it while schedulers come and go (scheduler_client.py)."""

from __future__ import annotations

import asyncio

import msgspec

from shared.protocol import AddRequest, RequestError, TokenOutput

Reply = TokenOutput | RequestError


class RequestHandle:
    """One submitted request's replies, in order; the last is final.

    It outlives its scheduler: `token_ids` (what the client has been sent) and `req` are
    all a resubmission needs. Each submission goes out under its own wire id (the request
    id, then `<id>~<n>` for the n-th resubmission), so late replies from a lost scheduler
    never reach the new attempt."""

    def __init__(self, req: AddRequest, link: object) -> None:  # link: scheduler_client.SchedulerLink
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
