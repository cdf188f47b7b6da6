"""Request validation: body decoding (types, ranges) and the checks that need the tokenizer
or the context window."""

from __future__ import annotations

import json

import pytest

from services.gateway import params
from services.gateway.api import ChatCompletionRequest, CompletionRequest, decode_request, encode_json
from services.gateway.errors import ApiError, from_scheduler
from services.gateway.openapi import openapi_document
from shared.protocol import SLO, RequestError

HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return decode_request(json.dumps({"messages": HI, **fields}).encode(), ChatCompletionRequest)


def completion(**fields) -> CompletionRequest:
    return decode_request(json.dumps(fields).encode(), CompletionRequest)


def refused(fn, *args, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args, **kw)
    return e.value


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "warm"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": 7}, "stop"),
        ({"n": 0}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"seed": 2**64}, "seed"),
        ({"slo": {"ttft_ms": 0}}, "slo.ttft_ms"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ],
)
def test_bad_fields_are_400_naming_the_field(fields, param):
    e = refused(chat, **fields)
    assert e.status == 400 and e.info.type == "invalid_request_error"
    assert e.info.param == param, e.info.message


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b"[1, 2]", b'{"messages": [{"role": "user"'])
def test_malformed_bodies_are_400(body):
    e = refused(decode_request, body, ChatCompletionRequest)
    assert e.status == 400


def test_unknown_fields_and_no_op_defaults_are_accepted():
    """Fields nobody documents are ignored; known ones we do not implement pass only with a
    value that asks for nothing (tests/gateway/test_fields.py walks them all)."""
    req = chat(vendor_field=0.5, include_stop_str_in_output=False, best_of=1, response_format={"type": "text"})
    assert req.messages[0].content == "hi"
    e = refused(chat, include_stop_str_in_output=True)
    assert e.status == 400 and e.info.param == "include_stop_str_in_output"
    assert chat(min_p=0.5).min_p == 0.5  # vLLM's min_p is honoured; out of [0, 1] it is a 400
    assert refused(chat, min_p=1.5).status == 400


def test_n_is_bounded():
    for n in (0, 129):
        e = refused(chat, n=n)
        assert e.status == 400 and e.info.param == "n"
    assert [chat(n=n).n for n in (1, 2, 128)] == [1, 2, 128]


def test_chat_messages_text_parts_and_roles():
    req = chat(
        messages=[
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ]
    )
    assert params.chat_messages(req.messages) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    "messages,param",
    [
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ],
)
def test_chat_messages_refused(messages, param):
    e = refused(params.chat_messages, chat(messages=messages).messages)
    assert e.status == 400 and e.info.param == param


@pytest.mark.parametrize(
    "prompt,expected",
    [("hi there", None), (["hi there"], None), ([1, 2, 3], [1, 2, 3]), ([[5, 6]], [5, 6])],
)
def test_completion_prompt_forms(tokenizer, prompt, expected):
    ids = params.completion_prompts(completion(prompt=prompt), tokenizer)
    assert ids == [expected if expected is not None else tokenizer.encode("hi there")]


def test_a_batch_of_prompts_is_one_list_per_prompt(tokenizer):
    ids = params.completion_prompts(completion(prompt=["a b", [5, 6], "c"]), tokenizer)
    assert ids == [tokenizer.encode("a b"), [5, 6], tokenizer.encode("c")]


@pytest.mark.parametrize("prompt", ["", [], [[]], [1, "a"], [True], [49152], [-1]])
def test_completion_prompt_refused(tokenizer, prompt):
    e = refused(lambda: params.completion_prompts(completion(prompt=prompt), tokenizer))
    assert e.status == 400 and e.info.param.startswith("prompt")


@pytest.mark.parametrize(
    "prompt,param", [(["a", ""], "prompt[1]"), (["a", "b", [49152]], "prompt[2]"), ([[1], [], [2]], "prompt[1]")]
)
def test_a_bad_prompt_in_a_batch_is_named_by_its_index(tokenizer, prompt, param):
    e = refused(lambda: params.completion_prompts(completion(prompt=prompt), tokenizer))
    assert e.status == 400 and e.info.param == param and f"prompt {param[7]}" in e.info.message


def test_a_batch_over_the_context_window_names_the_prompt():
    req = completion(prompt=["a", "b"], max_tokens=10)
    e = refused(params.prepare_batch, req, [[1] * 5, [1] * 60], 64, [])
    assert e.info.code == "context_length_exceeded" and e.info.param == "max_tokens", e.info
    assert e.info.message.startswith("prompt 1: ")
    e = refused(params.prepare_batch, completion(prompt=["a", "b"]), [[1] * 5, [1] * 64], 64, [])
    assert e.info.code == "context_length_exceeded" and e.info.param == "prompt[1]", e.info


def test_max_tokens_defaults_to_remaining_context():
    assert params.max_new_tokens(completion(prompt="x"), num_prompt=100, max_model_len=2048) == 1948
    assert params.max_new_tokens(completion(prompt="x", max_tokens=7), 100, 2048) == 7
    assert params.max_new_tokens(chat(max_tokens=7, max_completion_tokens=9), 100, 2048) == 9


@pytest.mark.parametrize("num_prompt,max_tokens", [(100, 1949), (2048, None), (3000, 1)])
def test_beyond_context_window_is_refused(num_prompt, max_tokens):
    e = refused(params.max_new_tokens, completion(prompt="x", max_tokens=max_tokens), num_prompt, 2048)
    assert e.status == 400 and e.info.code == "context_length_exceeded"


def test_prepare_maps_sampling_slo_and_stop():
    req = chat(temperature=0, top_p=0.5, top_k=20, seed=7, stop="END", stream=True,
               stream_options={"include_usage": True}, slo={"ttft_ms": 250, "tbt_ms": 40})
    p = params.prepare(req, [1, 2, 3], max_model_len=64, stop_token_ids=[2])
    sp = p.params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (61, 0, 0.5, 20, 7)
    assert sp.stop_token_ids == [2] and not sp.ignore_eos
    assert p.slo == SLO(ttft_s=0.25, tbt_s=0.04)
    assert p.stop == ["END"] and p.stream and p.include_usage


def test_prepare_defaults():
    p = params.prepare(completion(prompt="x", stream_options={"include_usage": True}), [1], 16, [])
    assert (p.params.temperature, p.params.top_p, p.params.top_k, p.params.seed) == (1.0, 1.0, 0, None)
    assert p.slo is None and p.stop == [] and not p.stream
    assert not p.include_usage  # only meaningful when streaming


@pytest.mark.parametrize(
    "kind,status", [("invalid_request_error", 400), ("overloaded", 429), ("internal_error", 500), ("weird", 500)]
)
def test_scheduler_errors_map_to_status(kind, status):
    e = from_scheduler(RequestError(request_id="r", message="m", type=kind))
    assert e.status == status
    assert ("Retry-After" in e.headers()) == (status == 429)
    assert json.loads(encode_json(e.body())) == {"error": {"message": "m", "type": kind, "param": None, "code": None}}


def test_openapi_document_is_generated_from_the_structs():
    doc = json.loads(encode_json(openapi_document("m")))
    schemas = doc["components"]["schemas"]
    temperature = schemas["ChatCompletionRequest"]["properties"]["temperature"]["anyOf"][0]
    assert temperature["maximum"] == 2.0 and temperature["minimum"] == 0.0
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert set(doc["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
    assert {"/tokenize", "/detokenize"} <= set(doc["paths"]) and "TokenizeRequest" in schemas
