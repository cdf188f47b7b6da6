"""Tool calling end to end (`server` fixture: the bundled SmolLM2, whose template knows no
tools, so they are written into the system message in the Hermes format) through the
official `openai` client: the round trip call -> tool result -> answer, streamed and not,
with `required`, a named function and `auto`; every call's arguments validate against its
function's schema."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.gateway.test_http import sync_client

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                         "parameters": TIME_PARAMS}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
MAX_TOKENS = 64  # a call takes about 35 tokens
ANSWER_TOKENS = 24


def create(client: openai.OpenAI, model: str, messages: list, stream: bool, max_tokens: int = MAX_TOKENS,
           **kw) -> tuple[str | None, list, str]:
    """(content, tool calls as dicts, finish_reason) of one choice, streamed or not; a stream
    is put together from its deltas as a client does."""
    kw = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens, **kw)
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
        return m.content, calls, r.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:  # the first delta of a call: id, type and name, arguments ""
                assert d.type == "function" and d.function.name and d.function.arguments == ""
                assert d.index not in calls
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c["name"] in names and c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def round_trip(client, model: str, messages: list, calls: list, stream: bool) -> tuple[str | None, list, str]:
    """Answer each call with a result and ask again: the answer is text."""
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]},
        *({"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"temperature": 21, "sky": "clear"})}
          for c in calls),
    ]
    content, more, finish = create(client, model, history, stream, ANSWER_TOKENS, tools=TOOLS, tool_choice="none")
    assert not more and content and finish in ("stop", "length")
    return content, more, finish


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_calls_validate_and_round_trip(server, stream):
    client = sync_client(server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_weather"})):
        content, calls, finish = create(client, server.model, ASK, stream, tools=TOOLS, tool_choice=choice,
                                        parallel_tool_calls=False)
        assert content is None and finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
        check_calls(calls, names)
        round_trip(client, server.model, ASK, calls, stream)


@pytest.mark.slow
def test_whole_and_streamed_calls_agree(server):
    client = sync_client(server)
    whole = create(client, server.model, ASK, False, tools=TOOLS, tool_choice="required")
    streamed = create(client, server.model, ASK, True, tools=TOOLS, tool_choice="required")
    # Ids differ; a whole answer's content is trimmed, a stream's cannot be. Parallel calls
    # allowed (the default), the model keeps calling until max_tokens cuts it inside a call: no
    # call is given out, the text is content, once.
    strip = lambda r: ((r[0] or "").strip(), [(c["name"], c["arguments"]) for c in r[1]], r[2])  # noqa: E731
    assert strip(whole) == strip(streamed)
    content, calls, finish = whole
    assert finish == "length" and not calls and content.startswith("<tool_call>")
    closed = [c.split("<tool_call>")[-1] for c in content.split("</tool_call>")[:-1]]
    assert closed  # every call the model closed validates
    check_calls([{**json.loads(c), "id": "call_", "arguments": json.dumps(json.loads(c)["arguments"])} for c in closed],
                {"get_weather", "get_time"})


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 14 requests; a busy host is slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_cut_short_makes_up_no_arguments(server, stream):
    """max_tokens ends the answer inside its one call: finish_reason "length", no tool call, and
    the text generated is the content, once."""
    client = sync_client(server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        kw = dict(model=server.model, messages=ASK, temperature=0, tools=TOOLS, tool_choice=choice,
                  parallel_tool_calls=False)
        whole = client.chat.completions.create(max_tokens=MAX_TOKENS, **kw)  # given room, the call completes
        assert whole.choices[0].finish_reason == "tool_calls" and len(whole.choices[0].message.tool_calls) == 1
        num_tokens = whole.usage.completion_tokens
        done = whole.choices[0].message.tool_calls[0].function
        texts = []
        # Cut early, and near the end (the call's closing tag, or the end after it).
        for max_tokens in (8, 20, *range(num_tokens - 5, num_tokens)):
            content, calls, finish = create(client, server.model, ASK, stream, tools=TOOLS, tool_choice=choice,
                                            parallel_tool_calls=False, max_tokens=max_tokens)
            assert finish == "length", (choice, max_tokens, content, calls, finish)
            if calls:  # the closing tag was out, only the end of the answer was not: the call itself
                assert content is None and [(c["name"], c["arguments"]) for c in calls] == [(done.name, done.arguments)]
                continue
            assert content.startswith('<tool_call>\n{"name') and content.count("<tool_call>") == 1, content
            assert "</tool_call>" not in content
            texts.append(content)
        assert all(a.strip() in b for a, b in zip(texts, texts[1:]))  # greedy: each cut begins the next


# The model calls a tool on its own once it has seen the pattern (two earlier turns).
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_a", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temperature": -3}'},
    {"role": "assistant", "content": "It is -3 degrees in Oslo."},
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_b", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_b", "content": '{"temperature": 18}'},
    {"role": "assistant", "content": "It is 18 degrees in Rome."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_the_models_own_calls_and_round_trips(server, stream):
    client = sync_client(server)
    content, calls, finish = create(client, server.model, FEW_SHOT, stream, tools=[WEATHER])  # auto: the default
    assert finish == "tool_calls" and content is None, (content, calls)
    check_calls(calls, {"get_weather"})
    assert json.loads(calls[0]["arguments"])["city"] == "Paris"
    round_trip(client, server.model, FEW_SHOT, calls, stream)
    # Without tools the same text is plain content: nothing reads calls out of it.
    content, calls, finish = create(client, server.model, FEW_SHOT, stream, tools=[WEATHER], tool_choice="none")
    assert not calls and "<tool_call>" in content and finish == "stop"


def test_tool_errors_are_400s_naming_the_field(server):
    client = sync_client(server)
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
              tool_choice="required"), "tools[0].function.parameters"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == param, e.value.body
