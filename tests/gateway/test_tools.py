"""Tool calling without a server: the calls read back out of each format (whole and streamed
a character at a time, which must agree), the prompt a template without tools gets, and the
grammar that holds `required` and named calls to the functions' schemas."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from services.gateway import params, tools
from services.gateway.api import ChatCompletionRequest, decode_request
from services.gateway.tool_parsers import CallStream, parse
from shared.tokenizer import ModelTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters

HERMES = [
    ("hello", "hello", []),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", {"a": 1})]),
    (
        'Sure. <tool_call>{"name":"f","arguments":{}}</tool_call>\n<tool_call>{"name":"g","arguments":{"x":"y"}}</tool_call>',
        "Sure.",
        [("f", {}), ("g", {"x": "y"})],
    ),
    ('<tool_call>{"name":"f","arguments":{}}', None, [("f", {})]),  # ended by EOS before the tag
    ('<tool_call>{"name":"f","arguments":"{\\"a\\": 2}"}</tool_call>', None, [("f", {"a": 2})]),
    ("<tool_call>{bad}</tool_call>", "<tool_call>{bad}</tool_call>", []),
    ("a <tool_ca", "a <tool_ca", []),
    (  # cut short inside its second call: all of it is content, once
        '<tool_call>{"name":"f","arguments":{}}</tool_call>\n<tool_call>{"name": "f", "argu',
        '<tool_call>{"name":"f","arguments":{}}</tool_call>\n<tool_call>{"name": "f", "argu',
        [],
    ),
    (  # a bad second call: the first is no call either
        '<tool_call>{"name":"f","arguments":{}}</tool_call> <tool_call>{bad}</tool_call> so',
        '<tool_call>{"name":"f","arguments":{}}</tool_call> <tool_call>{bad}</tool_call> so',
        [],
    ),
]
# Answers cut short by max_tokens (finish_reason "length"): a call not closed was not finished,
# even where its JSON happens to parse.
CUT = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"city": "+{\\r\\n"}}', '<tool_call>\n{"name": "f", "arguments": {"city": "+{\\r\\n"}}', []),  # noqa: E501
    ("hermes", '<tool_call>{"name":"f","arguments":{}}</tool_call>\n<tool_call>{"name":"g","arguments":{}}',
     '<tool_call>{"name":"f","arguments":{}}</tool_call>\n<tool_call>{"name":"g","arguments":{}}', []),
    ("hermes", '<tool_call>{"name":"f","arguments":{}}</tool_call>\n', None, [("f", {})]),  # every call closed
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', '{"name": "f", "parameters": {"a": 1}}', []),
]
LLAMA = [
    ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None, [("f", {"a": 1}), ("g", {})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", {})]),
    ("Hello {x}", "Hello {x}", []),
    ('{"name": "f"', '{"name": "f"', []),
]


def streamed(text: str, fmt: str, cut: bool = False) -> tuple[str | None, list]:
    s, content, calls = CallStream(fmt), "", []
    for ch in text:
        c, more = s.push(ch)
        content, calls = content + c, calls + more
    c, more = s.finish(cut)
    return (content + c).strip() or None, calls + more


@pytest.mark.parametrize("fmt,text,content,calls", [("hermes", *c) for c in HERMES] + [("llama3_json", *c) for c in LLAMA])
def test_calls_are_read_back_whole_and_streamed_alike(fmt, text, content, calls):
    for got_content, got_calls in (parse(text, fmt), streamed(text, fmt)):
        assert got_content == content
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
        assert all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize("fmt,text,content,calls", CUT)
def test_an_answer_cut_short_gives_no_unfinished_call(fmt, text, content, calls):
    for got_content, got_calls in (parse(text, fmt, cut=True), streamed(text, fmt, cut=True)):
        assert got_content == content
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def test_streamed_content_goes_out_before_the_answer_ends():
    s = CallStream("hermes")
    assert s.push("The answer is 4") == ("The answer is 4", [])
    assert s.push(" <tool") == (" ", [])  # "<tool" could begin a call: held back
    assert s.push("s are fun") == ("<tools are fun", [])


def chat(**fields) -> ChatCompletionRequest:
    return decode_request(json.dumps(fields).encode(), ChatCompletionRequest)


ROUND_TRIP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer: ModelTokenizer):
    assert not tokenizer.template_knows_tools and tokenizer.tool_call_format is None
    req = chat(messages=ROUND_TRIP, tools=[WEATHER, TIME])
    prompt = tokenizer.decode(params.chat_prompt_ids(req, tokenizer, "hermes"), skip_special_tokens=False)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "<tools>" in system
    assert json.dumps(tools.tool_dicts([req.tools[0]])[0]) in system
    assert '"name": "get_time"' in system and '"parameters": {"type": "object", "properties": {}}' in system
    # The call in the model's own format, both results in one user turn.
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>' in prompt
    assert '<|im_start|>tool\n{"temp": -3}<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_template_that_refuses_the_tool_role_gets_results_as_a_user_turn():
    source = (
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('roles are system, user, assistant') }}{% endif %}{{ m.role }}:{{ m.content }}|{% endfor %}"
    )
    tok = word_tokenizer(source)
    req = chat(messages=ROUND_TRIP)
    text = params.render_chat(req.messages, None, "hermes", tok)
    assert text.endswith('|user:<tool_response>\n{"temp": -3}\n</tool_response>\n<tool_response>\nsunny\n</tool_response>|')
    with pytest.raises(ValueError):  # refused with no tool results in it: refused
        params.render_chat(chat(messages=ROUND_TRIP[:1]).messages, None, "hermes", word_tokenizer("{{ raise_exception('no') }}"))


def word_tokenizer(source: str) -> ModelTokenizer:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    return ModelTokenizer(Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), None, source, {})


def test_a_template_with_tools_renders_them_itself():
    source = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
        "{% if m.role == 'tool' %}({{ m.tool_call_id }}/{{ m.name }}){% endif %}|{% endfor %}"
    )
    tok = word_tokenizer(source)
    assert tok.template_knows_tools and tok.tool_call_format == "hermes"
    req = chat(messages=ROUND_TRIP[:3], tools=[WEATHER])
    messages = params.chat_messages(req.messages, tools.tool_dicts(req.tools), "hermes", True)
    text = tok.apply_chat_template(messages, tools.tool_dicts(req.tools))
    assert text == (
        '[get_weather]user:Weather in Oslo?|assistant:<tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Oslo", "unit": "c"}}</tool_call>|tool:{"temp": -3}(call_1/get_weather)|'
    )


@pytest.fixture(scope="module")
def accepts(tokenizer: ModelTokenizer):
    """`accepts(grammar, text)`: whether the grammar takes the text, token by token, whole."""
    lt = llguidance.LLTokenizer(tokenizer.backend_json(), eos_token=tokenizer.stop_token_ids)

    def go(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        return all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()

    return go


@pytest.mark.parametrize("fmt", tools.FORMATS)
def test_the_grammar_holds_calls_to_the_schemas(accepts, fmt):
    key = tools.ARGUMENTS_KEY[fmt]
    good = tools.call_text("get_weather", {"city": "Oslo", "unit": "c"}, fmt)
    other = tools.call_text("get_time", {}, fmt)
    sep = "\n" if fmt == "hermes" else "; "
    required = params.grammar(chat(messages=ROUND_TRIP[:1], tools=[WEATHER, TIME], tool_choice="required"), fmt)
    assert accepts(required, good) and accepts(required, other)
    assert accepts(required, good + sep + other)  # parallel calls by default
    assert not accepts(required, tools.call_text("get_weather", {"city": "Oslo", "unit": "k"}, fmt))
    assert not accepts(required, tools.call_text("get_weather", {"city": "Oslo"}, fmt))
    assert not accepts(required, tools.call_text("nope", {}, fmt))
    assert not accepts(required, "Hello")
    single = params.grammar(
        chat(messages=ROUND_TRIP[:1], tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), fmt
    )
    assert accepts(single, good) and not accepts(single, good + sep + other)
    named = {"type": "function", "function": {"name": "get_time"}}
    named = params.grammar(chat(messages=ROUND_TRIP[:1], tools=[WEATHER, TIME], tool_choice=named), fmt)
    assert accepts(named, other) and not accepts(named, good)
    assert key in good
    # auto and none: no grammar
    for choice in ("auto", "none"):
        assert params.grammar(chat(messages=ROUND_TRIP[:1], tools=[WEATHER], tool_choice=choice), fmt) is None


def test_a_call_the_grammar_allows_validates_against_its_schema():
    schema = tools.call_schema(chat(messages=ROUND_TRIP[:1], tools=[WEATHER]).tools[0], "hermes")
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)


def test_a_function_named_like_a_choice_is_called_by_name():
    auto = {"type": "function", "function": {"name": "auto"}}
    req = chat(messages=ROUND_TRIP[:1], tools=[auto, WEATHER], tool_choice={"type": "function", "function": {"name": "auto"}})
    tools.check(req)
    assert tools.choice_of(req) == ("named", "auto") and tools.tool_use(req, "hermes").choice == "named"
    assert params.grammar(req, "hermes") is not None
    assert tools.choice_of(chat(messages=ROUND_TRIP[:1], tools=[auto])) == ("auto", None)
