"""Response bodies of the two generation endpoints, whole and as SSE chunks.

A `Format` knows only how to wrap one choice's text (and, when asked, the pieces' logprobs and
the echoed prompt); `respond_full` and `respond_stream` know only how to drain pieces, tagged
with their choice's index (`n` > 1: one format per choice, the whole body gathers their
choices; usage counts the prompt once and sums the completions). Streaming waits for the first
piece before sending headers, so an error the scheduler reports up front (overloaded, invalid)
still gets its own HTTP status.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

import structlog
from aiohttp import web

from services.gateway.api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    PromptTokensDetails,
    Usage,
    encode_json,
)
from services.gateway.errors import ApiError
from services.gateway.generate import Piece
from services.gateway.logprobs import ChatLogprobsView, CompletionLogprobsView, join

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = structlog.get_logger()


def usage(num_prompt: int, num_output: int, num_cached: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_output,
        total_tokens=num_prompt + num_output,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )


class Format(Protocol):
    def whole(self, text: str, finish_reason: str | None, usage: Usage, pieces: list[Piece]): ...
    def opening(self): ...  # first chunk, before any text (None: nothing to send)
    def chunk(self, text: str, finish_reason: str | None, piece: Piece | None): ...
    def usage_chunk(self, usage: Usage): ...
    def has_news(self, piece: Piece) -> bool: ...  # a chunk is due even without text


def _tokens(pieces: list[Piece]) -> tuple[list[int], list]:
    return [t for p in pieces for t in p.token_ids], [lp for p in pieces for lp in p.logprobs]


class ChatFormat:
    def __init__(
        self, request_id: str, model: str, logprobs: ChatLogprobsView | None = None, index: int = 0
    ) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.logprobs = logprobs
        self.index = index  # of the choice

    def whole(self, text, finish_reason, usage, pieces=()) -> ChatCompletion:
        choice = ChatChoice(index=self.index, message=AssistantMessage(content=text), finish_reason=finish_reason)
        if self.logprobs is not None:
            choice.logprobs = self.logprobs.render(*_tokens(pieces))
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)

    def opening(self) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=self.index, delta=Delta(role="assistant", content=""))])

    def chunk(self, text, finish_reason, piece=None) -> ChatCompletionChunk:
        delta = Delta(content=text) if text else Delta()
        choice = ChatChunkChoice(index=self.index, delta=delta, finish_reason=finish_reason)
        if self.logprobs is not None and piece is not None:
            choice.logprobs = self.logprobs.render(*_tokens([piece]))
        return self._chunk([choice])

    def has_news(self, piece: Piece) -> bool:
        return self.logprobs is not None and bool(piece.token_ids)

    def usage_chunk(self, usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(self, choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


class CompletionFormat:
    """With `echo` (the prompt's text and ids), the prompt comes first: in the whole text, or
    in the first chunk; with logprobs too, the prompt's tokens lead the logprobs."""

    def __init__(
        self,
        request_id: str,
        model: str,
        logprobs: CompletionLogprobsView | None = None,
        echo: tuple[str, list[int]] | None = None,
        index: int = 0,
    ) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.logprobs = logprobs
        self.echo = echo  # cleared once sent
        self.index = index  # of the choice

    def whole(self, text, finish_reason, usage, pieces=()) -> Completion:
        choice = CompletionChoice(index=self.index, text=self._echoed(text), finish_reason=finish_reason)
        choice.logprobs = self._logprobs(pieces)
        return self._body([choice], usage)

    def opening(self) -> None:
        return None

    def chunk(self, text, finish_reason, piece=None) -> Completion:
        choice = CompletionChoice(index=self.index, text=self._echoed(text), finish_reason=finish_reason)
        choice.logprobs = self._logprobs([piece] if piece is not None else [])
        return self._body([choice])

    def has_news(self, piece: Piece) -> bool:
        return self.echo is not None or (self.logprobs is not None and bool(piece.token_ids))

    def _echoed(self, text: str) -> str:
        return text if self.echo is None else self.echo[0] + text

    def _logprobs(self, pieces: list[Piece]):
        """Rendered in text order (the view keeps the text offset): the prompt's, once, first."""
        if self.logprobs is None:
            self.echo = None
            return None
        parts = []
        if self.echo is not None:
            prompt = next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), [])
            parts.append(self.logprobs.render_prompt(self.echo[1], list(prompt)))
        self.echo = None
        parts.append(self.logprobs.render(*_tokens(pieces)))
        return join(parts)

    def usage_chunk(self, usage) -> Completion:
        return self._body([], usage)

    def _body(self, choices, usage=None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


async def respond_full(pieces: AsyncIterator[tuple[int, Piece]], fmts: list[Format], num_prompt: int) -> web.Response:
    """`pieces`: (choice index, piece), the choices interleaved; fmts[i] wraps choice i."""
    by_choice: list[list[Piece]] = [[] for _ in fmts]
    async for i, p in pieces:
        by_choice[i].append(p)
    all_pieces = [p for ps in by_choice for p in ps]
    num_output = sum(p.num_tokens for p in all_pieces)
    num_cached = max((p.num_cached_tokens for p in all_pieces), default=0)
    u = usage(num_prompt, num_output, num_cached)
    bodies = [
        fmt.whole("".join(p.text for p in ps), ps[-1].finish_reason if ps else None, u, ps)
        for fmt, ps in zip(fmts, by_choice)
    ]
    body = bodies[0]
    body.choices = [b.choices[0] for b in bodies]
    return web.Response(body=encode_json(body), content_type="application/json")


def sse(obj) -> bytes:
    return b"data: " + encode_json(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def respond_stream(
    request: web.Request,
    pieces: AsyncIterator[tuple[int, Piece]],
    fmts: list[Format],
    num_prompt: int,
    include_usage: bool,
) -> web.StreamResponse:
    """`pieces` and `fmts` as for `respond_full`; each chunk carries its choice's index."""
    first = await anext(pieces)  # an ApiError here becomes a plain error response
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    try:
        await _write_events(resp, first, pieces, fmts, num_prompt, include_usage)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client_disconnected")
    return resp


async def _write_events(resp, first, pieces, fmts: list[Format], num_prompt: int, include_usage: bool) -> None:
    num_output = num_cached = 0
    try:
        for fmt in fmts:
            if (opening := fmt.opening()) is not None:
                await resp.write(sse(opening))
        async for i, p in _chain(first, pieces):
            num_output += p.num_tokens
            num_cached = max(num_cached, p.num_cached_tokens)
            fmt = fmts[i]
            if p.text or p.finish_reason or fmt.has_news(p):
                await resp.write(sse(fmt.chunk(p.text, p.finish_reason, p)))
        if include_usage:
            await resp.write(sse(fmts[0].usage_chunk(usage(num_prompt, num_output, num_cached))))
    except ApiError as e:  # headers are gone: the error travels as an event
        log.warning("stream_failed", status=e.status, error=e.info.message)
        await resp.write(sse(e.body()))
    await resp.write(SSE_DONE)


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for p in rest:
        yield p
