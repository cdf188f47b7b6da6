"""Every request field OpenAI documents is honoured, or refused with a 400 naming it: the test
walks the field lists of the `openai` package's own request types, over HTTP (a gateway with
no scheduler: a body that passes validation gets 503, one that does not gets 400)."""

from __future__ import annotations

import json

import pytest
from openai.types import completion_create_params as completion_spec
from openai.types.chat import completion_create_params as chat_spec

from services.gateway.api import ChatCompletionRequest, CompletionRequest, decode_request
from services.gateway.errors import ApiError
from services.gateway.unsupported import NO_OP, refused_fields

from .conftest import AUTH

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
BASE = {CHAT: {"messages": [{"role": "user", "content": "hi"}]}, COMPLETION: {"prompt": "hi"}}

# Implemented, with a value each that the test sends (it must pass validation).
HONOURED = {
    "messages": [{"role": "user", "content": "hi"}],
    "prompt": "hi",
    "model": "SmolLM2-135M-Instruct",
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "n": 1,
    "seed": 7,
    "stop": ["x"],
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "top_p": 0.9,
    "frequency_penalty": 0.5,
    "presence_penalty": -1,
    "logit_bias": {"1": 5},
    "logprobs": {CHAT: True, COMPLETION: 2},  # chat: a bool; completions: a count
    "top_logprobs": 2,  # with logprobs: true
    "echo": True,
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
}
# Accepted because they ask nothing of the output (who is asking, caching hints).
ACCEPTED = {
    "user": "u",
    "metadata": {"k": "v"},
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "24h"},
}
# Not implemented: a value that asks for something (refused), and the no-op defaults clients
# send (accepted; null is accepted for every one of them too).
REFUSED = {
    "best_of": (2, [1]),
    "suffix": ("end", [""]),
    "functions": ([{"name": "f"}], [[]]),
    "function_call": ("auto", ["none"]),
    "audio": ({"voice": "alloy", "format": "wav"}, []),
    "modalities": (["text", "audio"], [["text"]]),
    "prediction": ({"type": "content", "content": "x"}, []),
    "reasoning_effort": ("low", []),
    "verbosity": ("low", []),
    "web_search_options": ({}, []),
    "moderation": ({"model": "m"}, []),
    "store": (True, [False]),
    "service_tier": ("priority", ["auto", "default"]),
}
# vLLM's extensions that change the output, refused the same way.
VLLM_REFUSED = {
    "include_stop_str_in_output": (True, [False]),
    "skip_special_tokens": (False, [True]),
    "guided_json": ({"type": "object"}, []),
    "guided_regex": ("a+", []),
    "guided_choice": (["a"], []),
    "guided_grammar": ("root ::= 'a'", []),
    "structured_outputs": ({"json": {}}, []),
}


def spec_fields(module) -> set[str]:
    return {
        f
        for t in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming)
        for f in t.__required_keys__ | t.__optional_keys__
    }


SPEC = {CHAT: spec_fields(chat_spec), COMPLETION: spec_fields(completion_spec)}
REFUSED_CASES = [(path, f) for path in SPEC for f in sorted(SPEC[path]) if f in REFUSED]
REFUSED_CASES += [(path, f) for path in SPEC for f in VLLM_REFUSED]
ALL_REFUSED = REFUSED | VLLM_REFUSED


def post(gateway, path: str, **fields) -> tuple[int, dict]:
    status, _, raw = gateway("POST", path, {**BASE[path], **fields}, AUTH)
    return status, json.loads(raw)


@pytest.mark.parametrize("path", SPEC)
def test_every_spec_field_is_classified(path):
    unclassified = SPEC[path] - set(HONOURED) - set(ACCEPTED) - set(REFUSED)
    assert not unclassified, f"fields of the openai package this server neither implements nor refuses: {unclassified}"


def test_the_refusal_table_is_what_the_structs_check():
    checked = set(refused_fields(ChatCompletionRequest)) | set(refused_fields(CompletionRequest))
    assert checked == set(NO_OP) == set(ALL_REFUSED)


@pytest.mark.parametrize("path", SPEC)
def test_honoured_and_accepted_fields_pass_validation(lone_gateway, path):
    for field in sorted(SPEC[path] - set(REFUSED)):
        value = {**HONOURED, **ACCEPTED}[field]
        fields = {field: value[path] if isinstance(value, dict) and path in value else value}
        if field == "top_logprobs":
            fields["logprobs"] = True
        status, body = post(lone_gateway, path, **fields)
        assert status == 503, (field, body)  # valid: it got as far as looking for a scheduler


@pytest.mark.parametrize("path,field", REFUSED_CASES)
def test_a_field_not_implemented_is_400_naming_it(lone_gateway, path, field):
    asked, no_ops = ALL_REFUSED[field]
    status, body = post(lone_gateway, path, **{field: asked})
    assert status == 400, body
    assert body["error"]["param"] == field and body["error"]["code"] == "unsupported_parameter"
    assert field in body["error"]["message"]
    for value in [None, *no_ops]:
        status, body = post(lone_gateway, path, **{field: value})
        assert status == 503, (field, value, body)


@pytest.mark.parametrize("path", SPEC)
def test_vllm_extensions_we_implement_pass_validation(lone_gateway, path):
    for fields in (
        {"stop_token_ids": [2, 5]},
        {"top_k": 3},
        {"ignore_eos": True},
        {"repetition_penalty": 1.2},
        {"min_tokens": 3, "max_tokens": 4},
        {"prompt_logprobs": 2},
    ):
        status, body = post(lone_gateway, path, **fields)
        assert status == 503, (fields, body)
    status, body = post(lone_gateway, path, stop_token_ids=[49152])
    assert status == 400 and body["error"]["param"] == "stop_token_ids[0]"
    status, body = post(lone_gateway, path, stop_token_ids=[2], ignore_eos=True)
    assert status == 400 and body["error"]["param"] == "stop_token_ids"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_VALUES = [
    (CHAT, {"frequency_penalty": 2.5}, "frequency_penalty"),
    (CHAT, {"presence_penalty": -2.1}, "presence_penalty"),
    (COMPLETION, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"logit_bias": {"5": 101}}, "logit_bias[...]"),  # msgspec's path for a map value
    (CHAT, {"logit_bias": {"49152": 1}}, "logit_bias"),  # outside the vocabulary
    (COMPLETION, {"logit_bias": {"x": 1}}, "logit_bias"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (CHAT, {"logprobs": 2}, "logprobs"),  # chat's is a bool
    (COMPLETION, {"logprobs": 21}, "logprobs"),
    (COMPLETION, {"logprobs": True}, "logprobs"),  # completions' is a count
    (COMPLETION, {"max_tokens": 0}, "max_tokens"),  # only with echo
    (CHAT, {"max_tokens": 0, "echo": True}, "max_tokens"),
    (CHAT, {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    (COMPLETION, {"min_tokens": -1}, "min_tokens"),
    (COMPLETION, {"prompt_logprobs": -1}, "prompt_logprobs"),
    (CHAT, {"prompt_logprobs": 21}, "prompt_logprobs"),
    (COMPLETION, {"prompt": ["ok", ""]}, "prompt[1]"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),  # without tools
    (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (CHAT, {"tools": [TOOL], "tool_choice": "bogus"}, "tool_choice"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    (CHAT, {"tools": [TOOL, TOOL]}, "tools"),
    (CHAT, {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tool_choice": "required"}, "tools[0].function.parameters"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]},
     "messages[0].tool_calls[0]"),
]


@pytest.mark.parametrize("path,fields,param", BAD_VALUES)
def test_sampling_and_scoring_ranges_are_400_naming_the_field(lone_gateway, path, fields, param):
    status, body = post(lone_gateway, path, **fields)
    assert status == 400, body
    assert body["error"]["param"] == param, body


def test_completion_logprobs_zero_asks_for_the_sampled_tokens():
    """In completions `logprobs` is a count and 0 still asks for the sampled token's logprob."""
    assert decode_request(b'{"prompt": "hi", "logprobs": 0}', CompletionRequest).logprobs == 0
    assert decode_request(b'{"prompt": "hi", "logprobs": null}', CompletionRequest).logprobs is None
