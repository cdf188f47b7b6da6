"""The OpenAI request and response bodies, as msgspec Structs.

A body is decoded once, by `decode_request`, into one of these types, extensions included;
that *is* the check of everything the body alone decides: types and ranges (a mismatch
becomes a 400 naming the field). What needs the tokenizer or the scheduler's
context window is checked in params.py, the body size in app.py. The same types generate
the OpenAPI document. Every field OpenAI documents is either honoured, refused when it asks for
something we do not implement (unsupported.py: a 400 naming it), or one that asks nothing of
the output (`user`, `metadata`, `safety_identifier`, the prompt-cache hints), accepted; a field
nobody documents is ignored. Extensions beyond OpenAI: `top_k`, `ignore_eos`, `stop_token_ids`,
`repetition_penalty`, `min_tokens`, `prompt_logprobs` (vLLM's), `slo` (per-request latency targets in
milliseconds) and `superinfer` (what to report beyond OpenAI's response).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from services.gateway.errors import bad_request, from_validation
from services.gateway.unsupported import Refused, refusal, refused_fields

# Limits of the types below. OpenAI's: at most 4 stop strings.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_TOP_K = 2**31 - 1  # any k >= the vocabulary means "off"; the bound keeps it a machine int
# Positive temperatures below this sample as greedy: logits / T would overflow to inf (and
# softmax to NaN) for tiny T, and they pick the argmax anyway.
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit for chat, vLLM's default)
MAX_N = 128  # choices per request (OpenAI's limit)
T = TypeVar("T", "ChatCompletionRequest", "CompletionRequest")
_INT64 = Meta(ge=-(2**63), le=2**63 - 1)

Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description=f"0 (or below {MIN_TEMPERATURE:g}) means greedy")]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=MAX_TOP_K, description="0 means off (extension)")]
MaxTokens = Annotated[int, Meta(ge=1)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]
Milliseconds = Annotated[float, Meta(gt=0.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]


class StreamOptions(Struct):
    include_usage: bool = False


class SLOSpec(Struct):
    """Per-request latency targets (extension); unset ones use the scheduler's defaults."""

    ttft_ms: Milliseconds | None = None
    tbt_ms: Milliseconds | None = None


class Extensions:
    """`"superinfer": {"attribution": true}` (extension): report where the request's time went
    at the scheduler. Read leniently, as the one part of a body that is: a malformed extension
    is ignored, never refused (msgspec hands it over as plain JSON, see `_extensions`)."""

    __slots__ = ("attribution",)
    SCHEMA = {
        "type": "object",
        "properties": {"attribution": {"type": "boolean", "default": False}},
        "description": "SuperInfer extensions (a malformed one is ignored)",
    }

    def __init__(self, attribution: bool = False) -> None:
        self.attribution = attribution


def _extensions(type: type, obj) -> Extensions:
    """msgspec's hook for the custom type: `obj` is the decoded JSON value, whatever it is."""
    if type is not Extensions:
        raise NotImplementedError(type)
    return Extensions(isinstance(obj, dict) and obj.get("attribution") is True)


class JsonSchemaSpec(Struct):
    """`response_format.json_schema`, OpenAI's shape. The output is held to `schema` whether
    or not `strict` is set (an absent schema allows any JSON value)."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Struct):
    """`{"type": "text"}` asks for nothing; `json_object` for one JSON object; `json_schema`
    for JSON valid against `json_schema.schema` (params.py compiles it, or refuses it)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class ContentPart(Struct):
    type: str
    text: str | None = None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class ToolCall(Struct):
    """An assistant's call of a tool: in a request's history, and in a response."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers


class FunctionDef(Struct):
    """A tool the model may call; `parameters` is the JSON schema its arguments follow."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Struct):
    name: str


class NamedToolChoice(Struct):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
PromptLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description="prompt tokens' alternatives (vLLM's)")]


class _Sampling(Struct, kw_only=True):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Annotated[int, _INT64] | None = None
    stop: Stop | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1  # choices: that many requests for one prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None  # vLLM's
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None  # token id (as a string) -> bias
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None  # vLLM's
    min_tokens: Annotated[int, Meta(ge=0)] | None = None  # vLLM's
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # vLLM's
    response_format: ResponseFormat | None = None  # OpenAI's for chat, vLLM's for completions
    slo: SLOSpec | None = None
    superinfer: Extensions | None = None
    # Accepted: they ask nothing of the output.
    user: str | None = None
    metadata: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    # Refused unless they ask for nothing (unsupported.py).
    include_stop_str_in_output: Refused = None
    skip_special_tokens: Refused = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's: each prompt token's logprob
    guided_json: Refused = None
    guided_regex: Refused = None
    guided_choice: Refused = None
    guided_grammar: Refused = None
    structured_outputs: Refused = None

    @property
    def wants_attribution(self) -> bool:
        return self.superinfer is not None and self.superinfer.attribution


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None  # needs logprobs: true
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # default true: more than one call per turn
    functions: Refused = None
    function_call: Refused = None
    audio: Refused = None
    modalities: Refused = None
    prediction: Refused = None
    reasoning_effort: Refused = None
    verbosity: Refused = None
    web_search_options: Refused = None
    moderation: Refused = None
    store: Refused = None
    service_tier: Refused = None


class CompletionRequest(_Sampling, kw_only=True):
    # A string, token ids, or a batch: a list of strings or of token-id lists (params.py).
    prompt: str | list[str | int | list[int]]
    # 0 scores the prompt without generating (with echo; params.py checks).
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    logprobs: NumLogprobs | None = None  # the sampled token's and this many alternatives
    echo: bool | None = None
    best_of: Refused = None
    suffix: Refused = None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(Struct, omit_defaults=True):
    cached_tokens: int  # prompt tokens whose KV the prefix cache held
    # Our extension, when the DRAM tier gave some: cached_tokens by tier, {"hbm": n, "dram": m}.
    cached_tokens_by_tier: dict[str, int] | None = None


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Reported(Struct):
    """What a response reports beyond OpenAI's, when the request asked (`Extensions`)."""

    attribution: dict[str, float]  # protocol.Attribution's fields by name


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET  # left out unless the model called tools


class PromptLogprob(Struct):
    """One alternative at one prompt position, as vLLM reports `prompt_logprobs`."""

    logprob: float
    rank: int | None
    decoded_token: str


# Per prompt token (the first is null): token id (as a string) -> its logprob and the top ones'.
PromptLogprobsList = list[dict[str, PromptLogprob] | None]


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobsList | UnsetType = UNSET  # vLLM's, when asked
    superinfer: Reported | UnsetType = UNSET  # left out unless set


class DeltaFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A streamed tool call: the first delta of call `index` has its id, type and name."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    prompt_logprobs: PromptLogprobsList | UnsetType = UNSET  # vLLM's, on the first chunk
    superinfer: Reported | UnsetType = UNSET  # left out unless set


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobsList | UnsetType = UNSET  # vLLM's, when asked


class Completion(Struct):
    """Both the whole response and (with `usage` null until the end) each stream chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"
    superinfer: Reported | UnsetType = UNSET  # left out unless set


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int | None = None
    root: str | None = None  # the served model's file or folder on the server's disk, as vLLM gives it
    owned_by: str = "superinfer"
    object: Literal["model"] = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


# ---------------------------------------------------------------- codec

_decoders = {t: msgspec.json.Decoder(t, dec_hook=_extensions) for t in (ChatCompletionRequest, CompletionRequest)}
_refused = {t: refused_fields(t) for t in _decoders}
encode_json = msgspec.json.Encoder().encode


def decode_request(body: bytes, type: type[T]) -> T:
    """The request body as `type`, checked as far as the body alone decides; raises a 400
    `ApiError` naming the bad field."""
    try:
        req = _decoders[type].decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation(e) from None
    if (e := refusal(req, _refused[type])) is not None:
        raise e
    return req
