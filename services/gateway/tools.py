"""Tool calling on /v1/chat/completions: the tools in the prompt, the grammar that holds
`required` and named calls to the functions' schemas, and the tool calls read back out.

Formats, by vLLM's `--tool-call-parser` names (tool_parsers.py reads them back):

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, Hermes)
    llama3_json  {"name": "f", "parameters": {...}}; {...}                        (Llama 3.1)

The format is the one the chat template writes (`ModelTokenizer.tool_call_format`), else
hermes. A template that renders `tools` itself gets them, and the history's tool calls and
results, as `transformers` passes them (arguments as objects). One that does not (the bundled
SmolLM2's) gets them written into the messages: a system message lists the tools (as JSON
schemas inside `<tools></tools>`) and shows the call format; an assistant's calls become its
text in that format; tool results are turns of role "tool" or, where the template refuses
that role, user turns of `<tool_response>` blocks (as Qwen2.5 writes them).

`tool_choice`: "none" renders the tools and reads no calls; "auto" (the default with tools)
reads the model's calls in its own format; "required" and a named function constrain the
output with a grammar (llguidance Lark with `%json` bodies): one call, or with
`parallel_tool_calls` (default true) one or more, each naming one of the functions with
arguments valid against its `parameters` schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llguidance import LLMatcher

from services.gateway.api import ChatCompletionRequest, ChatMessage, Tool
from services.gateway.errors import bad_request

FORMATS = ("hermes", "llama3_json")
ARGUMENTS_KEY = {"hermes": "arguments", "llama3_json": "parameters"}
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without `parameters`


@dataclass(frozen=True)
class ToolUse:
    """What a request with tools asks of the output."""

    format: str  # one of FORMATS
    choice: str  # "auto", "required" or "named" ("none": no ToolUse at all)
    names: tuple[str, ...]  # the functions it may call


def choice_of(req: ChatCompletionRequest) -> tuple[str, str | None]:
    """("none" | "auto" | "required", None), or ("named", the one function to call)."""
    if req.tool_choice is None:
        return ("auto" if req.tools else "none"), None
    if isinstance(req.tool_choice, str):
        return req.tool_choice, None
    return "named", req.tool_choice.function.name


def check(req: ChatCompletionRequest) -> None:
    """400s for tool fields that are valid alone and not together."""
    choice, name = choice_of(req)
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) < len(names):
        raise bad_request("tools name the same function twice", param="tools")
    if choice in ("required", "named") and not names:
        raise bad_request(f"tool_choice {name or choice!r} needs tools", param="tool_choice")
    if choice == "named" and name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    if names and choice != "none" and req.response_format is not None and req.response_format.type != "text":
        raise bad_request("response_format cannot be combined with tools (unless tool_choice is none)", "response_format")
    if choice not in ("none", "auto"):  # the grammar ends the output, once complete
        if req.ignore_eos or req.min_tokens:
            field = "ignore_eos" if req.ignore_eos else "min_tokens"
            raise bad_request(f"{field} cannot be combined with tool_choice {name or choice!r}", param=field)


def tool_use(req: ChatCompletionRequest, fmt: str) -> ToolUse | None:
    choice, _ = choice_of(req)
    if choice == "none" or not req.tools:
        return None
    return ToolUse(fmt, choice, tuple(t.function.name for t in req.tools))


def grammar(req: ChatCompletionRequest, fmt: str) -> str | None:
    """The llguidance grammar for `required` or a named function, None otherwise; a 400
    naming the function whose `parameters` schema llguidance cannot compile. Call it off the
    event loop (a large schema takes a while)."""
    choice, name = choice_of(req)
    if choice in ("none", "auto") or not req.tools:
        return None
    tools = [(i, t) for i, t in enumerate(req.tools) if choice == "required" or t.function.name == name]
    bodies = []
    for i, t in tools:
        _check_schema(t, i)
        bodies.append(call_schema(t, fmt))
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    many = choice == "required" and req.parallel_tool_calls is not False
    if fmt == "hermes":
        start = 'start: call ("\\n" call)*' if many else "start: call"
        lark = f'{start}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {json.dumps(body)}\n'
    else:
        start = 'start: body ("; " body)*' if many else "start: body"
        lark = f"{start}\nbody: %json {json.dumps(body)}\n"
    compiled = LLMatcher.grammar_from_lark(lark)
    if error := LLMatcher.validate_grammar(compiled):
        raise bad_request(f"tools cannot be turned into a grammar: {error}", param="tools")
    return compiled


def call_schema(tool: Tool, fmt: str) -> dict:
    """The JSON schema of one call of `tool` in format `fmt`: its name, then its arguments."""
    key = ARGUMENTS_KEY[fmt]
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, key: parameters(tool)},
        "required": ["name", key],
        "additionalProperties": False,
    }


def parameters(tool: Tool) -> dict:
    return NO_PARAMETERS if tool.function.parameters is None else tool.function.parameters


def _check_schema(tool: Tool, i: int) -> None:
    try:
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(json.dumps(parameters(tool))))
    except ValueError as e:
        error = str(e)
    if error:
        raise bad_request(f"tools[{i}].function.parameters is not a usable JSON schema: {error}", f"tools[{i}].function.parameters")


# ---------------------------------------------------------------- rendering


def tool_dicts(tools: list[Tool] | None) -> list[dict] | None:
    """OpenAI's tool list as plain JSON, as templates and the system prompt show it."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn = {"name": t.function.name}
        if t.function.description is not None:
            fn["description"] = t.function.description
        fn["parameters"] = parameters(t)
        out.append({"type": "function", "function": fn})
    return out


def arguments_object(text: str, where: str):
    """A call's arguments (JSON text in OpenAI's messages) as the object templates expect."""
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        raise bad_request("tool call arguments are not JSON", param=where) from None


def template_message(m: ChatMessage, role: str, content: str, i: int, names: dict[str, str]) -> dict:
    """One message for a template that knows tools (as `transformers` passes them)."""
    out = {"role": role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": arguments_object(c.function.arguments, f"messages[{i}].tool_calls[{j}]"),
                },
            }
            for j, c in enumerate(m.tool_calls)
        ]
        names.update({c.id: c.function.name for c in m.tool_calls})
    if role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
        name = m.name or names.get(m.tool_call_id or "")
        if name:
            out["name"] = name
    return out


def call_text(name: str, arguments, fmt: str) -> str:
    """One call as the model writes it in `fmt` (arguments: an object)."""
    body = json.dumps({"name": name, ARGUMENTS_KEY[fmt]: arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>" if fmt == "hermes" else body


def system_prompt(tools: list[dict], fmt: str) -> str:
    """The tools and the call format, for a template that does not render tools itself."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = call_text("<function-name>", "<arguments-object>", fmt).replace('"<arguments-object>"', "<arguments-object>")
    several = "one block per call" if fmt == "hermes" else 'calls separated by "; "'
    return (
        "You may call functions to help answer. Their signatures, as JSON schemas, are in <tools></tools> tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        f"To call a function, answer with its name and arguments as JSON, {several}:\n{example}"
    )


def fallback_messages(messages: list[dict], tools: list[dict] | None, fmt: str, results_as: str = "tool") -> list[dict]:
    """Messages for a template that knows no tools: the tools go into the system message and
    an assistant's calls into its text. Tool results stay turns of role "tool" (their content
    alone), or with `results_as` "user" each run of them becomes one user turn of
    `<tool_response>` blocks (as Qwen2.5 writes them) for a template that refuses the role."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool" and results_as == "user":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        calls = m.get("tool_calls") or []
        if calls:
            texts = [call_text(c["function"]["name"], c["function"]["arguments"], fmt) for c in calls]
            m = {"role": m["role"], "content": "\n".join(([m["content"]] if m["content"] else []) + texts)}
        out.append({"role": m["role"], "content": m["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        prompt = system_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
