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
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    Usage,
    encode_json,
)
from services.gateway.errors import ApiError
from services.gateway.generate import Piece
from services.gateway.logprobs import ChatLogprobsView, CompletionLogprobsView, PromptLogprobsView, join
from services.gateway.tool_parsers import Call, CallStream, parse
from services.gateway.tools import ToolUse

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = structlog.get_logger()


def usage(num_prompt: int, num_output: int, num_cached: int, num_dram: int = 0) -> Usage:
    """`num_dram`: of the `num_cached` tokens, those loaded from the prefix cache's DRAM tier."""
    by_tier = {"hbm": num_cached - num_dram, "dram": num_dram} if num_dram else None
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_output,
        total_tokens=num_prompt + num_output,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached, cached_tokens_by_tier=by_tier),
    )


class Format(Protocol):
    def whole(self, text: str, finish_reason: str | None, usage: Usage, pieces: list[Piece]): ...
    def opening(self): ...  # first chunk, before any text (None: nothing to send)
    def chunk(self, text: str, finish_reason: str | None, piece: Piece | None): ...  # a body, a list, None
    def usage_chunk(self, usage: Usage): ...
    def has_news(self, piece: Piece) -> bool: ...  # a chunk is due even without text


def _tokens(pieces: list[Piece]) -> tuple[list[int], list]:
    return [t for p in pieces for t in p.token_ids], [lp for p in pieces for lp in p.logprobs]


class PromptScores:
    """vLLM's `prompt_logprobs` of one prompt, rendered once: on the whole body, or on the
    chunk of the piece that brings them."""

    def __init__(self, view: PromptLogprobsView, prompt_ids: list[int]) -> None:
        self.view, self.prompt_ids = view, prompt_ids

    def render(self, pieces) -> list | None:
        lps = next((p.prompt_logprobs for p in pieces if p is not None and p.prompt_logprobs is not None), None)
        return None if lps is None else self.view.render(self.prompt_ids, list(lps))


def _finish(finish_reason: str | None, num_calls: int) -> str | None:
    """An answer that called tools and ended on its own ends as "tool_calls"."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


class ChatFormat:
    """With `tools`, the answer's tool calls (tool_parsers.py) become `message.tool_calls`,
    streamed as OpenAI streams them: per call, a delta with its index, id, type and name
    (arguments ""), then one with its arguments."""

    def __init__(
        self,
        request_id: str,
        model: str,
        logprobs: ChatLogprobsView | None = None,
        index: int = 0,
        tools: ToolUse | None = None,
        prompt: PromptScores | None = None,
    ) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.logprobs = logprobs
        self.index = index  # of the choice
        self.tools, self.prompt = tools, prompt
        self.calls = None if tools is None else CallStream(tools.format)
        self.num_calls = 0  # streamed so far

    def whole(self, text, finish_reason, usage, pieces=()) -> ChatCompletion:
        cut = finish_reason != "stop"  # max_tokens: a call it was writing is unfinished
        content, calls = (text, []) if self.tools is None else parse(text, self.tools.format, cut)
        message = AssistantMessage(content=content)
        if calls:
            message.tool_calls = [ToolCall(c.id, FunctionCall(c.name, c.arguments)) for c in calls]
        choice = ChatChoice(index=self.index, message=message, finish_reason=_finish(finish_reason, len(calls)))
        if self.logprobs is not None:
            choice.logprobs = self.logprobs.render(*_tokens(pieces))
        body = ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)
        if self.prompt is not None and (lps := self.prompt.render(pieces)) is not None:
            body.prompt_logprobs = lps
        return body

    def opening(self) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=self.index, delta=Delta(role="assistant", content=""))])

    def chunk(self, text, finish_reason, piece=None):
        calls: list[Call] = []
        if self.calls is not None:
            text, calls = self.calls.push(text)
            if finish_reason is not None:
                rest, more = self.calls.finish(cut=finish_reason != "stop")
                text, calls = text + rest, calls + more
        chunks = [self._chunk([ChatChunkChoice(index=self.index, delta=Delta(content=text or None))])] if text else []
        for c in calls:
            head = DeltaToolCall(self.num_calls, c.id, "function", DeltaFunction(name=c.name, arguments=""))
            args = DeltaToolCall(self.num_calls, function=DeltaFunction(arguments=c.arguments))
            chunks += [self._chunk([ChatChunkChoice(index=self.index, delta=Delta(tool_calls=[d]))]) for d in (head, args)]
            self.num_calls += 1
        if finish_reason is not None and chunks and not calls:  # the last text and the end at once
            chunks[-1].choices[0].finish_reason = _finish(finish_reason, self.num_calls)
        elif finish_reason is not None or (not chunks and piece is not None and self.has_news(piece)):
            reason = _finish(finish_reason, self.num_calls)
            chunks.append(self._chunk([ChatChunkChoice(index=self.index, delta=Delta(), finish_reason=reason)]))
        if chunks and piece is not None:
            if self.logprobs is not None:
                chunks[0].choices[0].logprobs = self.logprobs.render(*_tokens([piece]))
            if self.prompt is not None and (lps := self.prompt.render([piece])) is not None:
                chunks[0].prompt_logprobs = lps
        return chunks

    def has_news(self, piece: Piece) -> bool:
        return (self.logprobs is not None and bool(piece.token_ids)) or (
            self.prompt is not None and piece.prompt_logprobs is not None
        )

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
        prompt: PromptScores | None = None,
    ) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.logprobs = logprobs
        self.echo = echo  # cleared once sent
        self.index = index  # of the choice
        self.prompt = prompt

    def whole(self, text, finish_reason, usage, pieces=()) -> Completion:
        choice = CompletionChoice(index=self.index, text=self._echoed(text), finish_reason=finish_reason)
        self._prompt_logprobs(choice, pieces)
        choice.logprobs = self._logprobs(pieces)
        return self._body([choice], usage)

    def opening(self) -> None:
        return None

    def chunk(self, text, finish_reason, piece=None) -> Completion:
        choice = CompletionChoice(index=self.index, text=self._echoed(text), finish_reason=finish_reason)
        self._prompt_logprobs(choice, [piece])
        choice.logprobs = self._logprobs([piece] if piece is not None else [])
        return self._body([choice])

    def has_news(self, piece: Piece) -> bool:
        return (
            self.echo is not None
            or (self.logprobs is not None and bool(piece.token_ids))
            or (self.prompt is not None and piece.prompt_logprobs is not None)
        )

    def _prompt_logprobs(self, choice: CompletionChoice, pieces) -> None:
        if self.prompt is not None and (lps := self.prompt.render(pieces)) is not None:
            choice.prompt_logprobs = lps

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


def num_cached_of(per_choice: list[int], prompt_of: list[int] | None) -> int:
    """Prompt tokens the cache held: per prompt the most any of its choices found, summed
    (`prompt_of[i]`: choice i's prompt in a batch; None: one prompt)."""
    best: dict[int, int] = {}
    for i, v in enumerate(per_choice):
        k = 0 if prompt_of is None else prompt_of[i]
        best[k] = max(best.get(k, 0), v)
    return sum(best.values())


async def respond_full(
    pieces: AsyncIterator[tuple[int, Piece]], fmts: list[Format], num_prompt: int, prompt_of: list[int] | None = None
) -> web.Response:
    """`pieces`: (choice index, piece), the choices interleaved; fmts[i] wraps choice i;
    `num_prompt`: the prompt tokens of all prompts (a batch: `prompt_of` maps choices to them)."""
    by_choice: list[list[Piece]] = [[] for _ in fmts]
    async for i, p in pieces:
        by_choice[i].append(p)
    all_pieces = [p for ps in by_choice for p in ps]
    num_output = sum(p.num_tokens for p in all_pieces)
    num_cached = num_cached_of([max((p.num_cached_tokens for p in ps), default=0) for ps in by_choice], prompt_of)
    num_dram = num_cached_of([max((p.num_dram_cached_tokens for p in ps), default=0) for ps in by_choice], prompt_of)
    u = usage(num_prompt, num_output, num_cached, num_dram)
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
    prompt_of: list[int] | None = None,
) -> web.StreamResponse:
    """`pieces` and `fmts` as for `respond_full`; each chunk carries its choice's index."""
    first = await anext(pieces)  # an ApiError here becomes a plain error response
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    try:
        await _write_events(resp, first, pieces, fmts, num_prompt, include_usage, prompt_of)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client_disconnected")
    return resp


async def _write_events(resp, first, pieces, fmts: list[Format], num_prompt: int, include_usage: bool,
                        prompt_of: list[int] | None) -> None:
    num_output = 0
    cached, dram = [0] * len(fmts), [0] * len(fmts)  # per choice
    try:
        for fmt in fmts:
            if (opening := fmt.opening()) is not None:
                await resp.write(sse(opening))
        async for i, p in _chain(first, pieces):
            num_output += p.num_tokens
            cached[i] = max(cached[i], p.num_cached_tokens)
            dram[i] = max(dram[i], p.num_dram_cached_tokens)
            fmt = fmts[i]
            if p.text or p.finish_reason or fmt.has_news(p):
                out = fmt.chunk(p.text, p.finish_reason, p)  # a body, a list of them, or none
                for body in out if isinstance(out, list) else [out]:
                    await resp.write(sse(body))
        if include_usage:
            num_cached, num_dram = num_cached_of(cached, prompt_of), num_cached_of(dram, prompt_of)
            await resp.write(sse(fmts[0].usage_chunk(usage(num_prompt, num_output, num_cached, num_dram))))
    except ApiError as e:  # headers are gone: the error travels as an event
        log.warning("stream_failed", status=e.status, error=e.info.message)
        await resp.write(sse(e.body()))
    await resp.write(SSE_DONE)


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for p in rest:
        yield p
