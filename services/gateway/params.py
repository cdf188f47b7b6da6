"""From a validated OpenAI body to what the scheduler is sent: prompt token ids, sampling
parameters, SLO, plus the stop strings the gateway itself enforces.

Everything here is pure and raises `ApiError` (400, naming the `param`) for what the body
alone cannot decide: content that is not text, token ids outside the vocabulary, an empty
prompt, and a prompt plus max_tokens beyond the context window (OpenAI's
`context_length_exceeded`, in vLLM's words), logit_bias ids outside the vocabulary, a
`response_format` or tool `parameters` schema llguidance cannot compile, and combinations
(top_logprobs without logprobs, min_tokens above max_tokens, max_tokens 0 without echo,
response_format with ignore_eos or min_tokens, the tool checks of tools.py). A completions
batch (a list of prompts) is refused whole for one bad prompt, the error naming its index
(`prompt[i]`). Decoding (api.py) checked the rest: max_tokens >= 1 (0 on completions),
at most MAX_STOP_STRINGS non-empty stop strings of at most MAX_STOP_CHARS characters,
temperature, top_p, top_k, seed, penalty, bias and logprobs ranges, at least one message,
1 <= n <= MAX_N, and no field we do not implement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec
from llguidance import LLMatcher

from services.gateway.api import (
    MIN_TEMPERATURE,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SLOSpec,
)
from services.gateway import tools as tools_mod
from services.gateway.errors import ApiError, bad_request
from shared.chat_template import ChatTemplateError
from shared.protocol import SLO, SamplingParams
from shared.tokenizer import ModelTokenizer

_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_CHOICES = 1024  # prompts x n in one completions request
Request = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class Prepared:
    """One accepted request, ready to submit."""

    prompt_ids: list[int]
    params: SamplingParams
    slo: SLO | None
    stop: list[str]
    stream: bool
    include_usage: bool
    top_logprobs: int | None = None  # alternatives per token to report; None: no logprobs
    echo: bool = False  # completions: the prompt comes first in the text (and its logprobs)
    # max_tokens 0 (completions with echo): one token is generated for the prompt's
    # logprobs to come back with, and is not reported.
    num_hidden_tokens: int = 0
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs`: alternatives per prompt token


def chat_messages(messages: list[ChatMessage], tools: list[dict] | None = None, fmt: str = "hermes",
                  template_knows_tools: bool = True, results_as: str = "tool") -> list[dict]:
    """Messages as the chat template expects them: role, plain-text content, and the tool
    calls and results (tools.py: as they go to a template that knows tools, or written into
    the text for one that does not, `fmt` then the call format)."""
    out, names = [], {}
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise bad_request(f"unknown role {m.role!r}", param=f"messages[{i}].role")
        role = "system" if m.role == "developer" else m.role
        out.append(tools_mod.template_message(m, role, _text_content(m, i), i, names))
    return out if template_knows_tools else tools_mod.fallback_messages(out, tools, fmt, results_as)


def render_chat(messages: list[ChatMessage], tools: list[dict] | None, fmt: str, tok: ModelTokenizer) -> str:
    """The prompt text of a conversation. A template that knows no tools and refuses the
    "tool" role gets tool results as user turns (tools.fallback_messages)."""
    if tok.template_knows_tools:
        return tok.apply_chat_template(chat_messages(messages, tools, fmt), tools)
    try:
        return tok.apply_chat_template(chat_messages(messages, tools, fmt, False))
    except ChatTemplateError:
        if not any(m.role == "tool" for m in messages):
            raise
    return tok.apply_chat_template(chat_messages(messages, tools, fmt, False, "user"))


def _text_content(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            message = f"content part type {part.type!r} is not supported (text is)"
            raise bad_request(message, f"messages[{i}].content[{j}]")
        parts.append(part.text)
    return "".join(parts)


def chat_prompt_ids(req: ChatCompletionRequest, tok: ModelTokenizer, fmt: str = "hermes") -> list[int]:
    """The conversation through the chat template, the tools with it (`fmt`: their format)."""
    try:
        text = render_chat(req.messages, tools_mod.tool_dicts(req.tools), fmt, tok)
        return tok.encode(text, add_special_tokens=False)  # the template writes BOS where the model wants one
    except (ChatTemplateError, ValueError) as e:
        raise bad_request(str(e), param="messages") from None


def prompt_items(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: one (a string, or token ids), or a batch (a list
    of strings or of token-id lists); a 400 naming `prompt` for any other shape."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return [list(p)]
    if p and all(isinstance(t, (str, list)) for t in p):
        if len(p) * req.n > MAX_CHOICES:
            raise bad_request(f"{len(p)} prompts x n {req.n} is over {MAX_CHOICES} choices", param="prompt")
        return list(p)
    raise bad_request("prompt must be a string, token ids, or a list of strings or of token-id lists", "prompt")


def completion_prompts(req: CompletionRequest, tok: ModelTokenizer) -> list[list[int]]:
    """Each prompt's token ids; a bad prompt refuses the whole request, naming its index."""
    items = prompt_items(req)
    out = []
    for i, item in enumerate(items):
        where, param = ("prompt", "prompt") if len(items) == 1 else (f"prompt {i}", f"prompt[{i}]")
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{where} is empty", param=param)
            out.append(tok.encode(item))
            continue
        if not item or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise bad_request(f"{where} must be a non-empty string or list of token ids", param)
        bad = next((t for t in item if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{where}: token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})", param)
        out.append(list(item))
    return out


def max_new_tokens(req: Request, num_prompt: int, max_model_len: int) -> int:
    """Requested max_tokens, or the remaining context when none is given."""
    room = max_model_len - num_prompt
    if room <= 0:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt} input tokens. Please reduce the length of the input messages.",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
    asked = getattr(req, param)
    if asked is None:
        return room
    if asked > room:
        raise bad_request(
            f"'{param}' is too large: {asked}. This model's maximum context length is {max_model_len} tokens "
            f"and your request has {num_prompt} input tokens ({asked} > {max_model_len} - {num_prompt}).",
            param=param,
            code="context_length_exceeded",
        )
    return asked


def temperature(req: Request) -> float:
    """1 when unset; 0 (greedy) below MIN_TEMPERATURE, where dividing logits by it overflows."""
    t = 1.0 if req.temperature is None else req.temperature
    return 0.0 if t < MIN_TEMPERATURE else t


def to_slo(spec: SLOSpec | None) -> SLO | None:
    if spec is None or (spec.ttft_ms is None and spec.tbt_ms is None):
        return None
    ms = lambda v: None if v is None else v / 1000.0  # noqa: E731
    return SLO(ttft_s=ms(spec.ttft_ms), tbt_s=ms(spec.tbt_ms))


def stop_strings(req: Request) -> list[str]:
    return [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)


def stop_token_ids(req: Request, model_stop_ids: list[int], vocab_size: int) -> list[int]:
    """The model's stop tokens (EOS, end of turn) and the request's `stop_token_ids`."""
    asked = req.stop_token_ids or []
    bad = next((i for i, t in enumerate(asked) if t >= vocab_size), None)
    if bad is not None:
        message = f"token id {asked[bad]} is outside the vocabulary (0..{vocab_size - 1})"
        raise bad_request(message, param=f"stop_token_ids[{bad}]")
    if asked and req.ignore_eos:  # the scheduler ignores every stop token then, not only EOS
        raise bad_request("stop_token_ids cannot be combined with ignore_eos", param="stop_token_ids")
    return list(dict.fromkeys([*model_stop_ids, *asked]))


def logit_bias(req: Request, vocab_size: int) -> dict[int, float]:
    """`logit_bias` with token ids as ints; 400 for a key that is not a token id."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            message = f"logit_bias key {key!r} is not a token id (0..{vocab_size - 1})"
            raise bad_request(message, param="logit_bias")
        out[token] = float(bias)
    return out


def check_combinations(req: Request) -> None:
    """400 for fields that are valid alone and not together."""
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if isinstance(req, ChatCompletionRequest):
        tools_mod.check(req)
    if isinstance(req, CompletionRequest) and req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 needs echo (it scores the prompt)", param="max_tokens")
    if wants_grammar(req) and (req.ignore_eos or req.min_tokens):
        # The grammar ends the request with a stop token, once complete: neither may hold it off.
        field = "ignore_eos" if req.ignore_eos else "min_tokens"
        raise bad_request(f"{field} cannot be combined with response_format", param=field)
    if req.min_tokens and req.max_tokens is not None and req.min_tokens > req.max_tokens:
        message = f"min_tokens ({req.min_tokens}) is above max_tokens ({req.max_tokens})"
        raise bad_request(message, param="min_tokens")


def wants_grammar(req: Request) -> bool:
    return req.response_format is not None and req.response_format.type != "text"


def grammar(req: Request, tool_format: str = "hermes") -> str | None:
    """The llguidance grammar (its JSON text) that `response_format` asks for, or tools with
    `tool_choice` required or named (tools.py); None for no constraint; a 400 naming the
    problem for a schema it cannot compile. It may take a while for a large schema: call it
    off the event loop."""
    if isinstance(req, ChatCompletionRequest) and (g := tools_mod.grammar(req, tool_format)) is not None:
        return g
    if not wants_grammar(req):
        return None
    fmt = req.response_format
    if fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema", "response_format.json_schema")
    else:
        schema = {} if fmt.json_schema.schema is None else fmt.json_schema.schema
    try:
        compiled = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except ValueError as e:
        compiled, error = None, str(e)
    else:
        error = LLMatcher.validate_grammar(compiled)
    if error:
        raise bad_request(f"response_format json_schema is invalid: {error}", "response_format.json_schema.schema")
    return compiled


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a request with `n` > 1: the same, with seed + index when seeded (so
    the choices differ, and each is reproducible)."""
    if index == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=params.seed + index)


def top_logprobs(req: Request) -> int | None:
    """How many alternatives to report per token; None: no logprobs at all."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def prompt_logprobs_k(req: Request, k: int | None, echo: bool) -> int | None:
    """Alternatives per prompt token the worker scores: for `echo` with logprobs (k) and for
    `prompt_logprobs` (vLLM's), the larger; each view takes as many as it reports."""
    asked = [v for v in (k if echo else None, req.prompt_logprobs) if v is not None]
    return max(asked) if asked else None


def prepare_batch(req: Request, prompts: list[list[int]], *args, **kw) -> list[Prepared]:
    """`prepare` for each prompt of a batch; a refusal names the prompt's index."""
    out = []
    for i, ids in enumerate(prompts):
        try:
            out.append(prepare(req, ids, *args, **kw))
        except ApiError as e:
            if len(prompts) > 1:
                e.info.message = f"prompt {i}: {e.info.message}"
                e.info.param = f"prompt[{i}]" if e.info.param == "prompt" else e.info.param
            raise
    return out


def prepare(
    req: Request,
    prompt_ids: list[int],
    max_model_len: int,
    stop_token_ids: list[int],
    default_seed: int | None = None,
    bias: dict[int, float] | None = None,
    grammar: str | None = None,
) -> Prepared:
    """The scheduler's view of a request whose prompt is already tokenized and whose fields
    passed `check_combinations`; `default_seed` is the seed of a request that gives none
    (--seed); `bias` is `logit_bias(req, ...)`, `grammar` is `grammar(req)`."""
    echo = bool(getattr(req, "echo", False))
    num_hidden = 1 if req.max_tokens == 0 else 0  # decoding let 0 through on completions only
    k = top_logprobs(req)
    params = SamplingParams(
        max_tokens=max_new_tokens(req, len(prompt_ids) + num_hidden, max_model_len) + num_hidden,
        temperature=temperature(req),
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed if req.seed is not None else default_seed,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=k,
        prompt_logprobs=prompt_logprobs_k(req, k, echo),
        min_tokens=req.min_tokens or 0,
        logit_bias=bias or {},
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        grammar=grammar,
    )
    if params.min_tokens > params.max_tokens:  # max_tokens not given: the context's room
        message = f"min_tokens ({params.min_tokens}) is above the {params.max_tokens} tokens the context has room for"
        raise bad_request(message, param="min_tokens")
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return Prepared(
        prompt_ids, params, to_slo(req.slo), stop_strings(req), req.stream, include_usage, k, echo, num_hidden,
        req.prompt_logprobs,
    )
