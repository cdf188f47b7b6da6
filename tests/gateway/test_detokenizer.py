"""Incremental detokenization and stop strings, fed one token (or one slice) at a time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.detokenizer import (
    IncrementalDetokenizer,
    StopStringFilter,
    TextStream,
    find_first_stop,
    held_back_len,
)


def stream_tokens(decode, ids, stop=(), prompt_tail=()) -> tuple[list[str], bool]:
    """Pieces emitted token by token, then the final flush; and whether a stop string hit."""
    ts = TextStream(decode, stop, prompt_tail)
    pieces = [ts.push([t]) for t in ids]
    pieces.append(ts.finish())
    return pieces, ts.stopped


def test_emoji_split_across_tokens_is_never_emitted_broken(tokenizer):
    ids = tokenizer.encode("ok 👍🏽 done")
    assert len(ids) > 4  # the emoji takes several byte-level tokens
    pieces, _ = stream_tokens(tokenizer.decode, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "ok 👍🏽 done"
    assert "" in pieces  # something was held back while a character was incomplete


@pytest.mark.parametrize(
    "text",
    ["日本語のテキスト", "naïve café", "  spaced   out  ", "code:\n\tx = [1, 2]\n", "🤖👨‍👩‍👧🇫🇷"],
)
def test_pieces_concatenate_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, stopped = stream_tokens(tokenizer.decode, ids, prompt_tail=tokenizer.encode("Prompt: "))
    assert not stopped
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_truncated_character_becomes_replacement_only_at_the_end(tokenizer):
    ids = tokenizer.encode("a👍")
    pieces, _ = stream_tokens(tokenizer.decode, ids[:-1])  # cut mid-character (as max_tokens can)
    assert all("\ufffd" not in p for p in pieces[:-1])
    assert "".join(pieces) == "a\ufffd"


def test_special_tokens_are_not_text(tokenizer):
    ids = tokenizer.encode("hi<|im_end|>")
    pieces, _ = stream_tokens(tokenizer.decode, ids)
    assert "".join(pieces) == "hi"


def test_stop_string_split_across_tokens_is_cut_and_never_sent(tokenizer):
    text = "The answer is 42.</answer> and more"
    ids = tokenizer.encode(text)
    assert "</answer>" not in [tokenizer.decode([t]) for t in ids]  # it spans tokens
    pieces, stopped = stream_tokens(tokenizer.decode, ids, stop=["</answer>"])
    assert stopped
    assert "".join(pieces) == "The answer is 42."
    for i in range(len(pieces)):  # no prefix of the output ever showed part of the stop string
        assert "<" not in "".join(pieces[: i + 1])


def test_earliest_of_several_stop_strings_wins(tokenizer):
    pieces, stopped = stream_tokens(tokenizer.decode, tokenizer.encode("alpha beta gamma"), stop=["gamma", "beta"])
    assert stopped and "".join(pieces) == "alpha "


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tokenizer):
    pieces, stopped = stream_tokens(tokenizer.decode, tokenizer.encode("x </ans y"), stop=["</answer>"])
    assert not stopped
    assert "".join(pieces) == "x </ans y"


def test_ids_after_a_stop_are_ignored():
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731  one char per id
    ts = TextStream(decode, ["c"])
    assert ts.push([ord("a"), ord("b"), ord("c"), ord("d")]) == "ab"
    assert ts.stopped and ts.push([ord("e")]) == "" and ts.finish() == ""


def test_held_back_len():
    assert held_back_len("abc<", ["</x>"]) == 1
    assert held_back_len("abc</x", ["</x>"]) == 3
    assert held_back_len("abc", ["</x>"]) == 0
    assert held_back_len("aa", ["aab"]) == 2
    assert held_back_len("x", []) == 0


def test_find_first_stop():
    assert find_first_stop("one two three", ["three", "two"]) == 4
    assert find_first_stop("one", ["x"]) is None
    assert find_first_stop("abab", ["ab"], start=1) == 2


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab<>/x", max_size=30),
    stop=st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_filter_matches_cutting_the_whole_text(text, stop, cuts):
    """However the text is sliced into deltas, the output is the text up to the first stop."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    f = StopStringFilter(stop)
    out = "".join(f.push(text[a:b]) for a, b in zip(bounds, bounds[1:])) + f.flush()
    first = find_first_stop(text, stop)
    assert out == (text if first is None else text[:first])
    assert f.stopped == (first is not None)


def test_detokenizer_without_prompt_context(tokenizer):
    d = IncrementalDetokenizer(tokenizer.decode)
    out = "".join(d.push([t]) for t in tokenizer.encode(" leading space")) + d.flush()
    assert out == " leading space"
