"""Turning a growing list of token ids into streamed text, cut at stop strings.

Two problems, both about not sending text we may have to take back:

1. A multi-byte character (an emoji, most CJK) can span several byte-level tokens; decoding
   a prefix of them gives U+FFFD. The prefix-offset technique decodes a short window of
   recent tokens twice — without and with the new ones — and sends only the difference,
   holding it back while it still ends in U+FFFD.
2. A stop string can arrive split across tokens ("<", "/answer", ">"). Output is cut before
   the first stop string, which is never sent; while streaming, a tail that could still be
   the start of a stop string is held back until it is known not to be one.

Both are pure: `decode` is any `list[int] -> str` (the model tokenizer's, in the service).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]

# Prompt tokens kept as left context, so a decoder that treats the sequence start specially
# (sentencepiece dropping a leading space) decodes the first output token as mid-text.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for appended token ids; never a broken multi-byte character mid-stream."""

    def __init__(self, decode: Decode, prompt_tail: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_tail[-PROMPT_CONTEXT_TOKENS:] if prompt_tail else ())
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # ids up to here have been turned into text

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (a trailing incomplete character becomes U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""  # the new ids decode to nothing yet
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""  # a character still incomplete; wait for its next byte
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]


class StopStringFilter:
    """Cuts text before the first stop string and holds back a tail that may begin one."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._text = ""  # everything received
        self._num_sent = 0  # characters of _text already released
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        self._text += delta
        cut = find_first_stop(self._text, self._stop, self._num_sent)
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self._text) - held_back_len(self._text, self._stop))

    def flush(self) -> str:
        """The held-back tail, once no more text will come (it was not a stop string)."""
        return "" if self.stopped else self._release(len(self._text))

    def _release(self, end: int) -> str:
        out = self._text[self._num_sent : end] if end > self._num_sent else ""
        self._num_sent = max(self._num_sent, end)
        return out


def find_first_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Where the output is cut: the start of the stop string that is complete first, as
    generation would reach it (earliest end; of two ending together, the longer one), so
    the cut never depends on how the text arrived in pieces."""
    hits = [(i + len(s), i) for s in stop if (i := text.find(s, start)) >= 0]
    return min(hits)[1] if hits else None


def held_back_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """Token ids in, sendable text out: detokenization followed by stop strings."""

    def __init__(self, decode: Decode, stop: Sequence[str] = (), prompt_tail: Sequence[int] = ()) -> None:
        self._detok = IncrementalDetokenizer(decode, prompt_tail)
        self._stop = StopStringFilter(stop)

    @property
    def stopped(self) -> bool:
        """A stop string was found: the output is complete and further ids are ignored."""
        return self._stop.stopped

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        return self._stop.push(self._detok.push(token_ids))

    def finish(self) -> str:
        """Everything still held back, at the end of generation."""
        if self.stopped:
            return ""
        text = self._stop.push(self._detok.flush())
        return text + self._stop.flush()
