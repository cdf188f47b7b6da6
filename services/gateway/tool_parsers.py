"""Tool calls read back out of the model's text, whole or as it streams (formats: tools.py).

`parse(text)` splits a whole answer into its content and its calls. `CallStream` does the same
piece by piece: text before the first call streams as content at once (minus a tail that could
still begin a call), and each call is given out once it is complete (its closing tag, or the
end of the answer). Text that claims to be a call and does not parse stays content, as vLLM's
parsers leave it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str


def new_call(name: str, arguments) -> Call:
    return Call(name, json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def _call_of(obj, keys: tuple[str, ...]) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return new_call(obj["name"], args)


def _hermes_call(body: str) -> Call | None:
    try:
        return _call_of(json.loads(body), ("arguments", "parameters"))
    except json.JSONDecodeError:
        return None


def _json_calls(text: str) -> list[Call] | None:
    """Llama 3.1's calls: JSON objects separated by ";" (None: not that)."""
    s = text.strip()
    s = s[len(PYTHON_TAG):].lstrip() if s.startswith(PYTHON_TAG) else s
    decoder, pos, calls = json.JSONDecoder(), 0, []
    while pos < len(s):
        try:
            obj, pos = decoder.raw_decode(s, pos)
        except json.JSONDecodeError:
            return None
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        while pos < len(s) and s[pos] in " \t\r\n;":
            pos += 1
    return calls or None


def parse(text: str, fmt: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole answer, as `CallStream` gives them out; content is None
    when the answer is only calls. An answer cut short keeps its complete calls, and the
    unfinished rest is content."""
    stream = CallStream(fmt)
    content, calls = stream.push(text)
    rest, more = stream.finish()
    content = (content + rest).strip()
    return content or None, calls + more


def _held_back(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag` (it may be a call's start)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class CallStream:
    """A streamed answer: `push(text)` and then `finish()` each give (content delta, calls
    completed); the concatenated content and calls equal `parse` of the whole text."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.buffer = ""  # text not yet given out
        self.in_calls = False  # past the start of the first call
        self.text = ""  # all of it: a call that does not parse turns it back into content

    def push(self, text: str) -> tuple[str, list[Call]]:
        self.text += text
        self.buffer += text
        if self.fmt == "content":  # no calls after all: everything streams
            out, self.buffer = self.buffer, ""
            return out, []
        if self.fmt == "llama3_json":
            return self._push_json()
        out, calls = "", []
        if not self.in_calls:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _held_back(self.buffer, OPEN)
                out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                return out, []
            out, self.buffer, self.in_calls = self.buffer[:start], self.buffer[start:], True
        while (end := self.buffer.find(CLOSE)) >= 0:
            self.buffer = self.buffer.lstrip()  # the space between two calls
            end = self.buffer.find(CLOSE)
            call = _hermes_call(self.buffer[len(OPEN) : end] if self.buffer.startswith(OPEN) else "")
            if call is None:
                return self._give_up(out, calls)
            calls.append(call)
            self.buffer = self.buffer[end + len(CLOSE) :]
        return out, calls

    def _push_json(self) -> tuple[str, list[Call]]:
        head = self.buffer.lstrip()
        if self.in_calls or not head:
            return "", []
        if head.startswith(("{", PYTHON_TAG[: len(head)])) or PYTHON_TAG.startswith(head):
            self.in_calls = True
            return "", []
        self.fmt = "content"  # plain text: everything streams
        out, self.buffer = self.buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[Call]]:
        if self.fmt == "content":
            out, self.buffer = self.buffer, ""
            return out, []
        if not self.in_calls:
            out, self.buffer = self.buffer, ""
            return out, []
        if self.fmt == "llama3_json":
            calls = _json_calls(self.buffer)
            return (self.buffer, []) if calls is None else ("", calls)
        rest = self.buffer.strip()
        if not rest:
            return "", []
        if rest.startswith(OPEN) and (call := _hermes_call(rest[len(OPEN) :])) is not None:
            return "", [call]  # the last call, unclosed at the end of the answer
        return self._give_up("", [])

    def _give_up(self, out: str, calls: list[Call]) -> tuple[str, list[Call]]:
        """A call that does not parse: what was held back goes out as content (calls already
        given out stay given)."""
        out, self.buffer = out + self.buffer, ""
        self.fmt = "content"
        return out, calls
