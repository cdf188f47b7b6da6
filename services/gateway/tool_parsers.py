"""Tool calls read back out of the model's text, whole or as it streams (formats: tools.py).

`parse(text)` splits a whole answer into its content and its calls. `CallStream` does the same
piece by piece: text before the first call streams as content at once (minus a tail that could
still begin a call), and the calls are given out at the end of the answer, all or none. Text
that claims to be a call and does not parse stays content, as vLLM's parsers leave it; so does a
call that an answer cut short (max_tokens) was still writing, and with it every call of that
answer: what was generated shows once, in one field, and no arguments are made up.
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


def parse(text: str, fmt: str, cut: bool = False) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole answer, as `CallStream` gives them out; content is None
    when the answer is only calls. `cut`: the answer did not end on its own (max_tokens)."""
    stream = CallStream(fmt)
    content, calls = stream.push(text)
    rest, more = stream.finish(cut)
    content = (content + rest).strip()
    return content or None, calls + more


def _held_back(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag` (it may be a call's start)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class CallStream:
    """A streamed answer: `push(text)` and then `finish(cut)` each give (content delta, calls);
    the concatenated content and calls equal `parse` of the whole text.

    The calls are given out at the end, all of them or none: an answer whose calls all read
    back gives them as calls; one where any does not (a call that does not parse, or the call
    an answer cut short by max_tokens was writing, whose arguments may happen to parse but were
    never finished) gives its text from the first call on as content, once, and no calls."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.buffer = ""  # text not yet given out: from the first call's start on, all of it
        self.in_calls = False  # past the start of the first call
        self.calls: list[Call] = []  # closed calls read so far (hermes), given out at the end
        self.read = 0  # of `buffer`: the closed calls before this are in `calls`

    def push(self, text: str) -> tuple[str, list[Call]]:
        self.buffer += text
        if self.fmt == "content":  # no calls after all: everything streams
            out, self.buffer = self.buffer, ""
            return out, []
        if self.fmt == "llama3_json":
            return self._push_json()
        out = ""
        if not self.in_calls:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _held_back(self.buffer, OPEN)
                out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                return out, []
            out, self.buffer, self.in_calls = self.buffer[:start], self.buffer[start:], True
        while (end := self.buffer.find(CLOSE, self.read)) >= 0:  # read each call as it closes
            body = self.buffer[self.read : end].strip()
            call = _hermes_call(body[len(OPEN) :]) if body.startswith(OPEN) else None
            if call is None:  # no call after all: it and the rest stream as content
                return self._give_up(out)
            self.calls.append(call)
            self.read = end + len(CLOSE)
        return out, []

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

    def finish(self, cut: bool = False) -> tuple[str, list[Call]]:
        """The end of the answer; `cut`: it did not end on its own (max_tokens)."""
        if self.fmt == "content" or not self.in_calls:
            out, self.buffer = self.buffer, ""
            return out, []
        if self.fmt == "llama3_json":  # no closing mark: a cut answer's last call may be unfinished
            calls = None if cut else _json_calls(self.buffer)
            return self._give_up("") if calls is None else ("", calls)
        if rest := self.buffer[self.read :].strip():
            # The last call, unclosed: read only where the model ended the answer itself.
            call = _hermes_call(rest[len(OPEN) :]) if rest.startswith(OPEN) and not cut else None
            if call is None:
                return self._give_up("")
            self.calls.append(call)
        calls, self.calls, self.buffer = self.calls, [], ""
        return "", calls

    def _give_up(self, out: str) -> tuple[str, list[Call]]:
        """Calls that do not read back: their text goes out as content, and no call."""
        out, self.buffer, self.calls = out + self.buffer, "", []
        self.fmt = "content"
        return out, []
