"""The HTTP application: routes, authentication, and one error shape for everything.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /tokenize              POST /detokenize       (vLLM's, tokens.py)
    GET  /health                GET  /metrics          GET /openapi.json
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import random
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from services.gateway import params, tokens, tools
from services.gateway.api import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    decode_request,
    encode_json,
)
from services.gateway.detokenizer import TextStream
from services.gateway.errors import ApiError, internal
from services.gateway.generate import Timing, WithAttribution, fan_in, generate
from services.gateway.logprobs import ChatLogprobsView, CompletionLogprobsView, PromptLogprobsView
from services.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from services.gateway.openapi import openapi_document
from services.gateway.responses import ChatFormat, CompletionFormat, PromptScores, respond_full, respond_stream
from services.gateway.scheduler_client import RequestHandle, SchedulerClient, SchedulerLink
from shared.modelfile import ModelConfig
from shared.protocol import AddRequest
from shared.tokenizer import ModelTokenizer

MAX_BODY_BYTES = 4 << 20
log = structlog.get_logger()


@dataclass
class GatewayState:
    client: SchedulerClient
    tokenizer: ModelTokenizer
    config: ModelConfig
    api_key: str | None = None
    served_model_names: list[str] = field(default_factory=list)  # --served-model-name
    seed: int | None = None  # --seed
    root: str | None = None  # the model's file or folder, absolute (/v1/models' `root`)
    tool_call_parser: str | None = None  # the tool-call format (tools.FORMATS); None: the template's
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    started: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self._seeds = None if self.seed is None else random.Random(self.seed)
        self.metrics.exposed.model_name = self.names()[0]

    def names(self) -> list[str]:
        """The names /v1/models lists, the first one the default in responses."""
        return self.served_model_names or [self.config.name]

    def served_names(self) -> set[str]:
        """The names a request may give. With --served-model-name only those (as vLLM does);
        without, the model's own name and the workers'."""
        if self.served_model_names:
            return set(self.served_model_names)
        return {self.config.name} | {s.model_name for s in self.client.live_stats()}

    def default_seed(self) -> int | None:
        """The seed of a request that gives none: None (the worker draws one at random), or
        with --seed the next of a generator seeded with it, so that the same requests in
        the same order sample the same tokens on a restarted server."""
        return None if self._seeds is None else self._seeds.getrandbits(63)

    def tool_format(self) -> str:
        """How tools are written and calls read: as set, else the chat template's format, else hermes."""
        return self.tool_call_parser or self.tokenizer.tool_call_format or "hermes"

    def max_model_len(self, scheduler_max: int | None) -> int:
        return self.config.max_position if scheduler_max is None else min(self.config.max_position, scheduler_max)


STATE = web.AppKey("state", GatewayState)
OPENAPI = web.AppKey("openapi", bytes)  # the document, encoded once


@dataclass(frozen=True)
class Endpoint:
    prefix: str
    request_type: type
    # Each prompt's token ids (chat: one), given the request and the tool-call format.
    prompts: Callable[[params.Request, ModelTokenizer, str], list[list[int]]]
    format: type[ChatFormat] | type[CompletionFormat]


CHAT = Endpoint("chatcmpl", ChatCompletionRequest, lambda r, t, f: [params.chat_prompt_ids(r, t, f)], ChatFormat)
COMPLETION = Endpoint("cmpl", CompletionRequest, lambda r, t, f: params.completion_prompts(r, t), CompletionFormat)


# ---------------------------------------------------------------- generation


async def read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large") from None


async def generation(request: web.Request, ep: Endpoint) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = f"{ep.prefix}-{uuid.uuid4().hex}"
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        try:
            return await _generation(request, state, ep, request_id)
        except ApiError as e:
            log.info("request_refused", status=e.status, error=e.info.message)
            raise
        except asyncio.CancelledError:  # the client went away (or the server is stopping)
            log.info("request_cancelled")
            raise


async def _generation(request: web.Request, state: GatewayState, ep: Endpoint, request_id: str):
    timing = Timing()  # arrival: latencies count the gateway's own work too
    body = await read_body(request)
    req = decode_request(body, ep.request_type)
    model = _check_model(req.model, state)
    stop_ids = params.stop_token_ids(req, state.tokenizer.stop_token_ids, state.tokenizer.vocab_size)
    params.check_combinations(req)
    bias = params.logit_bias(req, state.tokenizer.vocab_size)
    tool_format = state.tool_format()
    # Off the event loop: a long prompt (or a large schema) takes a while, and every stream's
    # next token waits on the loop.
    grammar = await asyncio.to_thread(params.grammar, req, tool_format)
    prompts = await asyncio.to_thread(ep.prompts, req, state.tokenizer, tool_format)
    # Picked after that await, and nothing awaits from here to submit(): a scheduler lost
    # meanwhile is out of the choice, never handed a request it can no longer answer.
    # Routed by its first prompt (a chat has one) and its session: the `user` field, or the
    # x-session-id header.
    session = request.headers.get("x-session-id") or req.user
    link = state.client.pick(prompts[0] if prompts else None, session)
    max_len = state.max_model_len(link.stats.max_model_len)
    default_seed = state.default_seed() if req.seed is None else None
    preps = params.prepare_batch(req, prompts, max_len, stop_ids, default_seed, bias, grammar)
    # Choice i = prompt i // n, its (i % n)-th sample, as OpenAI indexes a batch with n; n
    # choices of one prompt are n requests for it (the prefix cache shares its full blocks).
    choices = [(preps[i // req.n], i) for i in range(len(preps) * req.n)]
    adds = [
        AddRequest(
            request_id=request_id if len(choices) == 1 else f"{request_id}-{i}",
            prompt_token_ids=prep.prompt_ids,
            params=params.choice_params(prep.params, i),
            slo=prep.slo,
        )
        for prep, i in choices
    ]
    timings = [timing] + [Timing(arrival=timing.arrival) for _ in adds[1:]]
    texts = params.prompt_items(req) if ep.format is CompletionFormat else [None]
    fmts = [_format(ep, request_id, model, req, prep, state, i, texts[i // req.n]) for prep, i in choices]
    for f in fmts[1:]:
        f.created = fmts[0].created
    if req.wants_attribution:
        fmts = [WithAttribution(f, t) for f, t in zip(fmts, timings)]
    handles = _submit_all(state.client, adds, link)
    prep = preps[0]
    num_prompt = sum(len(p.prompt_ids) for p in preps)
    log.info(
        "request_accepted",
        num_prompt_tokens=num_prompt,
        max_tokens=prep.params.max_tokens,
        stream=prep.stream,
        n=req.n,
        num_prompts=len(preps),
    )
    prompt_of = [i // req.n for _, i in choices]
    try:
        async with AsyncExitStack() as stack:
            each = [
                await stack.enter_async_context(
                    aclosing(generate(state.client, h, _text(state, p), t, p.num_hidden_tokens > 0))
                )
                for h, t, (p, _) in zip(handles, timings, choices)
            ]
            pieces = await stack.enter_async_context(aclosing(fan_in(each)))
            if prep.stream:
                return await respond_stream(request, pieces, fmts, num_prompt, prep.include_usage, prompt_of)
            return await respond_full(pieces, fmts, num_prompt, prompt_of)
    finally:
        for t, (p, _) in zip(timings, choices):
            _finished(state, t, len(p.prompt_ids))


def _text(state: GatewayState, prep: params.Prepared) -> TextStream:
    return TextStream(state.tokenizer.decode, prep.stop, prep.prompt_ids)


def _submit_all(client: SchedulerClient, adds: list[AddRequest], link: SchedulerLink) -> list[RequestHandle]:
    """All to `link`, or none: a refusal of one aborts those already sent."""
    handles: list[RequestHandle] = []
    try:
        for add in adds:
            handles.append(client.submit(add, link))
    except BaseException:
        for h in handles:
            client.abort(h.request_id)
        raise
    return handles


def _format(ep: Endpoint, request_id: str, model: str, req, prep: params.Prepared, state: GatewayState,
            index: int, prompt_text: str | list[int] | None):
    """The response format of choice `index`, with the logprobs views, the echoed prompt
    (`prompt_text`: the prompt as given) and the tool calls the request asked for."""
    decode = functools.partial(state.tokenizer.decode, skip_special_tokens=False)  # a token's own text, as vLLM shows it
    k, n = prep.top_logprobs, prep.prompt_logprobs
    scores = None if n is None else PromptScores(PromptLogprobsView(decode, n), prep.prompt_ids)
    if ep.format is ChatFormat:
        view = None if k is None else ChatLogprobsView(decode, k)
        return ChatFormat(request_id, model, view, index, tools.tool_use(req, state.tool_format()), scores)
    echo = None
    if prep.echo:
        echo = (prompt_text if isinstance(prompt_text, str) else state.tokenizer.decode(prep.prompt_ids), prep.prompt_ids)
    view = None if k is None else CompletionLogprobsView(decode, k)
    return CompletionFormat(request_id, model, view, echo, index, scores)


def _finished(state: GatewayState, timing: Timing, num_prompt: int) -> None:
    end = time.monotonic()
    if timing.finish_reason is not None:
        state.metrics.observe_finished(timing, num_prompt, end)
    log.info(
        "request_finished",
        finish_reason=timing.finish_reason,
        num_output_tokens=timing.num_output_tokens,
        ttft_s=None if timing.first_token is None else round(timing.first_token - timing.arrival, 4),
        e2e_s=round(end - timing.arrival, 4),
    )


def _check_model(name: str | None, state: GatewayState) -> str:
    if name is None or name in state.served_names():
        return name or state.names()[0]
    message = f"model {name!r} does not exist (served: {', '.join(state.names())})"
    raise ApiError(404, message, param="model", code="model_not_found")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generation(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await generation(request, COMPLETION)


# ---------------------------------------------------------------- information


def _served_max_model_len(state: GatewayState) -> int:
    """The context window every live scheduler can serve."""
    return state.max_model_len(min((s.max_model_len for s in state.client.live_stats()), default=None))


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    max_len = _served_max_model_len(state)
    cards = [
        ModelCard(id=name, created=state.started, max_model_len=max_len, root=state.root) for name in state.names()
    ]
    return _json(ModelList(data=cards))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = tokens.decode(await read_body(request), tokens.TokenizeRequest)
    _check_model(req.model, state)
    max_len = _served_max_model_len(state)
    return _json(await asyncio.to_thread(tokens.tokenize, req, state.tokenizer, max_len, state.tool_format()))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = tokens.decode(await read_body(request), tokens.DetokenizeRequest)
    _check_model(req.model, state)
    return _json(await asyncio.to_thread(tokens.detokenize, req, state.tokenizer))


async def health(request: web.Request) -> web.Response:
    """200 while at least one scheduler with a ready worker reports in; 503 otherwise."""
    state = request.app[STATE]
    stats = state.client.live_stats()
    body = {"status": "ok" if stats else "unavailable", "schedulers": [_fields(s) for s in stats]}
    return _json(body, 200 if stats else 503)


def _fields(struct) -> dict:
    """A struct as a JSON object (wire structs encode as arrays)."""
    return {f: getattr(struct, f) for f in struct.__struct_fields__}


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(state.client.live_stats()), headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


def _json(obj, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=encode_json(obj), status=status, headers=headers, content_type="application/json")


# ---------------------------------------------------------------- middleware


def error_response(e: ApiError) -> web.Response:
    return _json(e.body(), e.status, e.headers())


@web.middleware
async def errors_and_metrics(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI-style body; every response is counted."""
    try:
        resp = await handler(request)
    except ApiError as e:
        resp = error_response(e)
    except web.HTTPException as e:  # router: 404 no route, 405 wrong method
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        resp = error_response(ApiError(e.status, e.reason, kind))
    except Exception:
        log.exception("handler_failed", path=request.path)
        resp = error_response(internal("internal error"))
    route = request.match_info.route.resource
    request.app[STATE].metrics.http_requests.labels(
        route=route.canonical if route is not None else "other", status=str(resp.status)
    ).inc()
    return resp


@web.middleware
async def bearer_auth(request: web.Request, handler) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key is not None and (request.path.startswith("/v1/") or request.path in ("/tokenize", "/detokenize")):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "missing or invalid API key", "authentication_error", code="invalid_api_key")
    return await handler(request)


def build_app(state: GatewayState) -> web.Application:
    app = web.Application(middlewares=[errors_and_metrics, bearer_auth], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app[OPENAPI] = encode_json(openapi_document(state.names()[0]))
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app
