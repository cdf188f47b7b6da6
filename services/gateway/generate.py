"""One request in flight: scheduler replies in, text pieces out.

The generator ends with exactly one final piece (finish_reason "stop" or "length") or
raises `ApiError`. However it ends — finished, stop string, client gone, cancelled — the
`finally` tells the scheduler to abort, which is a no-op for a request already finished,
so an abandoned request never keeps its KV blocks.

A request with `n` > 1 is n such requests (its choices) for the same prompt; `fan_in`
interleaves their pieces, and when one fails or the client goes, stops them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from services.gateway.api import Reported
from services.gateway.detokenizer import TextStream
from services.gateway.errors import from_scheduler, internal
from services.gateway.scheduler_client import RequestHandle, SchedulerClient
from shared.protocol import Attribution, RequestError, TokenLogprobs, TokenOutput


@dataclass(frozen=True)
class Piece:
    text: str
    num_tokens: int  # tokens this piece adds to the completion
    finish_reason: str | None = None
    # When the request asked for logprobs: its tokens and their logprobs (one each), and,
    # on the first piece only when asked, the prompt's (from its second token on).
    token_ids: Sequence[int] = ()
    logprobs: Sequence[TokenLogprobs] = ()
    prompt_logprobs: Sequence[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # on the first piece: prompt tokens the prefix cache held
    num_dram_cached_tokens: int = 0  # ... of which its DRAM tier loaded


@dataclass
class Timing:
    """What the metrics and the final log line need about one request."""

    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)  # between replies that carried tokens
    num_output_tokens: int = 0
    finish_reason: str | None = None
    attribution: Attribution | None = None  # the scheduler's, on its final output

    def on_tokens(self, n: int) -> None:
        if n:
            now = time.monotonic()
            if self.first_token is None:
                self.first_token = now
            else:
                self.gaps.append(now - self.last_token)
            self.last_token = now
        self.num_output_tokens += n


async def generate(
    client: SchedulerClient, handle: RequestHandle, text: TextStream, timing: Timing, scoring_only: bool = False
) -> AsyncIterator[Piece]:
    """`scoring_only` (max_tokens 0 with echo): the one token generated is not reported; the
    request ends with it, as "length", carrying the prompt's logprobs."""
    try:
        while True:
            reply = await handle.get()
            if isinstance(reply, RequestError):
                raise from_scheduler(reply)
            timing.attribution = reply.attribution or timing.attribution
            if scoring_only:
                if reply.finish_reason == "abort":
                    raise internal("the scheduler aborted this request")
                piece = Piece("", 0, "length", prompt_logprobs=reply.prompt_logprobs)
            else:
                timing.on_tokens(len(reply.token_ids))
                piece = _with_logprobs(_piece(reply.token_ids, reply.finish_reason, text), reply)
                if reply.num_cached_tokens:
                    piece = dataclasses.replace(
                        piece, num_cached_tokens=reply.num_cached_tokens, num_dram_cached_tokens=reply.num_dram_cached_tokens
                    )
            timing.finish_reason = piece.finish_reason
            yield piece
            if piece.finish_reason is not None:
                return
    finally:
        client.abort(handle.request_id)


async def fan_in(choices: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) as they come. The first error of any choice is raised, and
    however this ends every choice is cancelled (each then aborts its request)."""
    if len(choices) == 1:  # no task in between
        async for p in choices[0]:
            yield 0, p
        return
    queue: asyncio.Queue = asyncio.Queue()  # (index, piece or None when done, error or None)

    async def pump(i: int, choice: AsyncIterator[Piece]) -> None:
        try:
            async for p in choice:
                queue.put_nowait((i, p, None))
        except Exception as e:  # an ApiError, or a bug: either fails the whole request
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        num_live = len(tasks)
        while num_live:
            i, p, error = await queue.get()
            if error is not None:
                raise error
            if p is None:
                num_live -= 1
            else:
                yield i, p
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _with_logprobs(piece: Piece, reply: TokenOutput) -> Piece:
    if not reply.logprobs and not reply.prompt_logprobs:
        return piece
    return dataclasses.replace(
        piece, token_ids=reply.token_ids, logprobs=reply.logprobs, prompt_logprobs=reply.prompt_logprobs or None
    )


def _piece(token_ids: list[int], finish_reason: str | None, text: TextStream) -> Piece:
    """A stop string ends the request as "stop" whatever the scheduler said; an abort the
    gateway did not ask for is an error, not a silent truncation. The scheduler's "stop" is
    a stop token (EOS, end of turn, `stop_token_ids`), the last one: counted, but its text
    is not output (as vLLM does; EOS has none anyway)."""
    delta = text.push(token_ids[:-1] if finish_reason == "stop" else token_ids)
    if text.stopped:
        return Piece(delta, len(token_ids), "stop")
    if finish_reason == "abort":
        raise internal("the scheduler aborted this request")
    if finish_reason is not None:
        return Piece(delta + text.finish(), len(token_ids), finish_reason)
    return Piece(delta, len(token_ids))


class WithAttribution:
    """A response format that also reports where the request's time went at the scheduler,
    for clients that ask with `"superinfer": {"attribution": true}`: the whole body, or the
    final stream chunk, gains `"superinfer": {"attribution": {waiting_s, rotary_s,
    running_s, transfer_wait_s, num_preemptions}}` (absent when a stop string ended the
    request before the scheduler did)."""

    def __init__(self, fmt, timing: Timing) -> None:
        self.fmt, self.timing = fmt, timing

    def whole(self, text, finish_reason, usage, pieces=()):
        return self._add(self.fmt.whole(text, finish_reason, usage, pieces))

    def opening(self):
        return self.fmt.opening()

    def chunk(self, text, finish_reason, piece=None):
        body = self.fmt.chunk(text, finish_reason, piece)
        if finish_reason is not None:
            self._add(body[-1] if isinstance(body, list) else body)
        return body

    def usage_chunk(self, usage):
        return self.fmt.usage_chunk(usage)

    def has_news(self, piece):
        return self.fmt.has_news(piece)

    def _add(self, body):
        att = self.timing.attribution
        if att is not None:
            body.superinfer = Reported(attribution={f: getattr(att, f) for f in att.__struct_fields__})
        return body
