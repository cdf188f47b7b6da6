"""`/tokenize` and `/detokenize` in vLLM's shapes: on a gateway alone (they need only the
tokenizer) and, for agreement with what generation counts, on the whole stack."""

from __future__ import annotations

import json

import pytest

from shared.modelfile import read_model_config

from .conftest import AUTH
from .test_http import raw, sync_client

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]


def post(gateway, path: str, body: dict, headers=AUTH) -> tuple[int, dict]:
    status, _, data = gateway("POST", path, body, headers)
    return status, json.loads(data)


def test_a_prompt_is_tokenized_as_completions_do(lone_gateway, tokenizer, model_path):
    status, body = post(lone_gateway, "/tokenize", {"prompt": "Hello world"})
    assert status == 200, body
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == read_model_config(model_path).max_position  # no scheduler: the model's
    assert body["token_strs"] is None
    status, body = post(lone_gateway, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert body["token_strs"] == ["Hello", "Ġworld"]


def test_messages_are_tokenized_through_the_chat_template(lone_gateway, tokenizer):
    status, body = post(lone_gateway, "/tokenize", {"messages": MESSAGES, "model": "SmolLM2-135M-Instruct"})
    assert status == 200, body
    assert body["tokens"] == tokenizer.encode_chat(MESSAGES)
    status, back = post(lone_gateway, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": tokenizer.apply_chat_template(MESSAGES)}  # special tokens kept


@pytest.mark.parametrize("text", ["Hello world", "  spaces, ünïcode and 🙂 emoji\n"])
def test_detokenize_inverts_tokenize(lone_gateway, text):
    _, body = post(lone_gateway, "/tokenize", {"prompt": text, "add_special_tokens": False})
    status, back = post(lone_gateway, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": text}


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, 400, "add_generation_prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
        ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {}, 400, None),
    ],
)
def test_refusals_are_openai_errors_naming_the_field(lone_gateway, path, body, status, param):
    got, error = post(lone_gateway, path, body)
    assert got == status, error
    assert error["error"]["param"] == param, error


def test_the_api_key_guards_them(lone_gateway):
    assert post(lone_gateway, "/tokenize", {"prompt": "a"}, headers=None)[0] == 401
    assert post(lone_gateway, "/detokenize", {"tokens": [1]}, headers=None)[0] == 401


def test_counts_agree_with_what_generation_counts(server):
    status, _, data = raw(server, "POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200, data
    body = json.loads(data)
    status, _, data = raw(server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert status == 200, data
    assert json.loads(data)["usage"]["prompt_tokens"] == body["count"]
    status, _, data = raw(server, "GET", "/v1/models")
    assert body["max_model_len"] == json.loads(data)["data"][0]["max_model_len"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_end_the_output_at_that_token(server, tokenizer, stream):
    """Greedy output, then the same request told to stop at its third token: it ends there,
    "stop", the token counted and its text left out (vLLM's rule)."""
    client = sync_client(server)
    ask = dict(model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0)
    full = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text
    ids = tokenizer.encode(full, add_special_tokens=False)
    assert len(ids) >= 4 and tokenizer.decode(ids) == full
    stop_at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # its first occurrence
    extra = {"stop_token_ids": [ids[stop_at]]}
    if stream:
        chunks = list(client.completions.create(**ask, stream=True, extra_body=extra))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = client.completions.create(**ask, extra_body=extra)
        text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert r.usage.completion_tokens == stop_at + 1
    assert finish == ["stop"]
    assert text == tokenizer.decode(ids[:stop_at])
