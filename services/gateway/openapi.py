"""The OpenAPI 3.1 document of the HTTP API, generated from the very Structs that decode and
validate requests, so the published schema cannot drift from what the server enforces."""

from __future__ import annotations

import msgspec

from services.gateway.api import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    Extensions,
    ModelList,
)
from services.gateway.errors import ErrorResponse
from services.gateway.tokens import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

_REF = "#/components/schemas/{name}"
_ERRORS = {
    "400": "Malformed JSON, a wrong type, a value out of range, or a request beyond the context window",
    "401": "Missing or invalid API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "429": "Overloaded; retry after Retry-After seconds",
    "500": "Internal error",
    "503": "No scheduler reachable; retry after Retry-After seconds",
}


# One server-sent event (OpenAPI 3.1 describes a stream by its events): `data` is a JSON
# chunk, or `[DONE]` last.
_SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}


def _ref(name: str) -> dict:
    return {"$ref": _REF.format(name=name)}


def _error_responses() -> dict:
    body = {"application/json": {"schema": _ref("ErrorResponse")}}
    return {code: {"description": text, "content": body} for code, text in _ERRORS.items()}


def _generation_path(summary: str, request: str, whole: str, chunk: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {
                "200": {
                    "description": f"`{whole}`; with `stream: true`, server-sent `{chunk}` events, then `[DONE]`",
                    "content": {
                        "application/json": {"schema": _ref(whole)},
                        "text/event-stream": {"schema": _SSE_EVENT},
                    },
                },
                **_error_responses(),
            },
        }
    }


def _get_path(summary: str, schema: dict, media: str = "application/json") -> dict:
    ok = {"description": summary, "content": {media: {"schema": schema}}}
    return {"get": {"summary": summary, "responses": {"200": ok}}}


def _post_path(summary: str, request: str, response: str) -> dict:
    body = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    ok = {"description": summary, "content": {"application/json": {"schema": _ref(response)}}}
    return {"post": {"summary": summary, "requestBody": body, "responses": {"200": ok, **_error_responses()}}}


def _schema_hook(type: type) -> dict:
    if type is Extensions:
        return Extensions.SCHEMA
    raise NotImplementedError(type)


def openapi_document(model_name: str) -> dict:
    requests = [ChatCompletionRequest, CompletionRequest]
    types = [*requests, ChatCompletion, ChatCompletionChunk, Completion, ModelList, ErrorResponse]
    types += [TokenizeRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse]
    _, components = msgspec.json.schema_components(types, schema_hook=_schema_hook, ref_template=_REF)
    health = {"type": "object", "properties": {"status": {"type": "string"}, "schedulers": {"type": "array"}}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "SuperInfer gateway",
            "version": "1",
            "description": f"OpenAI-compatible API serving {model_name}",
        },
        "paths": {
            "/v1/chat/completions": _generation_path(
                "Chat completion", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
            ),
            "/v1/completions": _generation_path("Text completion", "CompletionRequest", "Completion", "Completion"),
            "/v1/models": _get_path("Served models", _ref("ModelList")),
            "/tokenize": _post_path("Token ids of a prompt or messages", "TokenizeRequest", "TokenizeResponse"),
            "/detokenize": _post_path("Text of token ids (vLLM's)", "DetokenizeRequest", "DetokenizeResponse"),
            "/health": _get_path("Scheduler load when ready (503 otherwise)", health),
            "/metrics": _get_path("Prometheus metrics", {"type": "string"}, "text/plain"),
        },
        "components": {"schemas": components},
    }
