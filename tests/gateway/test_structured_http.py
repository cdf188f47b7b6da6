"""Structured output over HTTP, against the whole stack (`server` fixture), through the
official `openai` client: `response_format` json_schema and json_object, and the 400s."""

from __future__ import annotations

import asyncio
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


def schema_format(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


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


def obj(properties: dict, required: list[str] | None = None) -> dict:
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
# Twenty schemas, each with a prompt that asks for it, covering what clients send: enums,
# consts, bounds, patterns, optional and nullable fields, nesting, arrays of objects,
# tuples, unions, `$defs`/`$ref`, and a top-level array. Every string and array is bounded
# so that a greedy answer ends well within `max_tokens`.
SCHEMAS = {
    "person": (PERSON, "a person with a name and an age"),
    "colour": (obj({"colour": {"enum": ["red", "green", "blue"]}}), "your favourite colour"),
    "flag": (obj({"ok": {"type": "boolean"}}), "whether the sky is blue"),
    "point": (obj({"x": {"type": "number"}, "y": {"type": "number"}}), "a point on a plane"),
    "bounded": (obj({"score": SMALL, "out_of": {"const": 100}}), "a test score out of 100"),
    "pattern": (obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}), "a product code"),
    "optional": (obj({"title": NAME, "subtitle": NAME}, required=["title"]), "a book title"),
    "nullable": (obj({"city": NAME, "zip": {"type": ["string", "null"], "maxLength": 8}}), "an address"),
    "tags": (obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}), "tags for a photo"),
    "nested": (obj({"owner": obj({"name": NAME}), "pet": obj({"kind": NAME, "legs": SMALL})}), "a pet and its owner"),
    "list_of_objects": (
        obj({"items": {"type": "array", "items": obj({"name": NAME, "qty": SMALL}), "maxItems": 2}}),
        "a short shopping list",
    ),
    "tuple": (
        obj({"pair": {"type": "array", "prefixItems": [NAME, SMALL], "items": False, "minItems": 2}}),
        "a word and its length",
    ),
    "any_of": (obj({"value": {"anyOf": [SMALL, {"type": "boolean"}]}}), "a small number or a yes/no"),
    "one_of_kinds": (
        obj({"shape": {"oneOf": [obj({"radius": SMALL}), obj({"side": SMALL, "sides": {"enum": [3, 4]}})]}}),
        "a circle or a polygon",
    ),
    "defs": (
        {"$defs": {"name": NAME}, **obj({"first": {"$ref": "#/$defs/name"}, "last": {"$ref": "#/$defs/name"}})},
        "a first and a last name",
    ),
    "top_level_array": ({"type": "array", "items": SMALL, "minItems": 2, "maxItems": 4}, "a few small numbers"),
    "enum_list": (
        obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}, "maxItems": 3}}),
        "the days of a short work week",
    ),
    "date_like": (obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}), "a date"),
    "mixed": (
        obj({"id": SMALL, "name": NAME, "active": {"type": "boolean"}, "rating": {"type": "number"}}),
        "a user record",
    ),
    "empty_allowed": (obj({"note": {"type": "string", "maxLength": 12}}, required=[]), "an optional note"),
}


def test_twenty_schemas_each_answer_validates(server):
    """Twenty requests at once through the official client, greedy: every answer ends on
    its own and validates against its own schema."""
    assert len(SCHEMAS) == 20
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)

    async def ask(name: str, schema: dict, what: str):
        r = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": f"Give me {what}, as JSON."}],
            temperature=0, max_tokens=120, response_format=schema_format(schema, name),
        )
        return r.choices[0]

    async def all_of_them():
        return await asyncio.gather(*(ask(name, schema, what) for name, (schema, what) in SCHEMAS.items()))

    failures = []
    for (name, (schema, _)), choice in zip(SCHEMAS.items(), asyncio.run(all_of_them())):
        try:
            assert choice.finish_reason == "stop", choice.finish_reason
            jsonschema.validate(json.loads(choice.message.content), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name}: {choice.message.content!r} ({e})")
    assert not failures, "\n".join(failures)
