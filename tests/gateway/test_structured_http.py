"""Structured output over HTTP, against the whole stack (`server` fixture), through the
official `openai` client: `response_format` json_schema and json_object, and the 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.gateway.test_http import raw, sync_client

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}}


def test_json_schema_output_validates_against_the_schema(server):
    client = sync_client(server)
    r = client.chat.completions.create(
        model=server.model, messages=ASK, temperature=0, max_tokens=60, response_format=schema_format(PERSON)
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    # Streamed, sampled with a seed: still valid, and the completions endpoint takes it too.
    chunks = client.chat.completions.create(
        model=server.model, messages=ASK, temperature=1.0, seed=3, max_tokens=60, stream=True,
        response_format=schema_format(PERSON),
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    c = client.completions.create(
        model=server.model, prompt="A person, as JSON:", temperature=0, max_tokens=60,
        extra_body={"response_format": schema_format(PERSON)},
    )
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)


def test_json_object_output_parses(server):
    r = sync_client(server).chat.completions.create(
        model=server.model, messages=ASK, temperature=0, max_tokens=80, response_format={"type": "json_object"}
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_text_format_asks_for_nothing(server):
    kw = dict(model=server.model, messages=ASK, temperature=0, max_tokens=8)
    client = sync_client(server)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw, response_format={"type": "text"}).choices[0].message.content == plain


@pytest.mark.parametrize(
    "fmt, param, words",
    [
        (schema_format({"type": "frobnicate"}), "response_format.json_schema.schema", "frobnicate"),
        (schema_format({"type": "string", "pattern": "(("}), "response_format.json_schema.schema", "regex"),
        (schema_format({"$ref": "#/$defs/missing"}), "response_format.json_schema.schema", "missing"),
        ({"type": "json_schema"}, "response_format.json_schema", "json_schema"),
        ({"type": "yaml"}, "response_format.type", "yaml"),
        ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema", "`name`"),
    ],
)
def test_bad_formats_are_400_naming_the_problem(server, fmt, param, words):
    body = {"model": server.model, "messages": ASK, "max_tokens": 4, "response_format": fmt}
    status, _, data = raw(server, "POST", "/v1/chat/completions", body)
    error = json.loads(data)["error"]
    assert status == 400, data
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error


def test_combinations_that_would_hold_off_the_end_are_400(server):
    client = sync_client(server)
    for extra, param in [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 3}, "min_tokens")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=server.model, messages=ASK, max_tokens=8, response_format={"type": "json_object"},
                extra_body=extra,
            )
        assert e.value.body["param"] == param
