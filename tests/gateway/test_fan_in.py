"""`fan_in`, the merge of a request's choices: pieces tagged with their choice, and the first
error of any choice fails the whole and stops the others."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.errors import ApiError, internal
from services.gateway.generate import Piece, fan_in


async def choice(texts: list[str], closed: list[bool], fail_after: int | None = None, delay: float = 0.0):
    try:
        for i, t in enumerate(texts):
            await asyncio.sleep(delay)
            if i == fail_after:
                raise internal("the scheduler aborted this request")
            yield Piece(t, 1, "stop" if i == len(texts) - 1 else None)
    finally:
        closed.append(True)


def test_pieces_keep_their_choice_index():
    async def go():
        closed: list[bool] = []
        choices = [choice(["a", "b"], closed), choice(["x", "y", "z"], closed)]
        return [(i, p.text) async for i, p in fan_in(choices)], closed

    got, closed = asyncio.run(go())
    assert [t for i, t in got if i == 0] == ["a", "b"] and [t for i, t in got if i == 1] == ["x", "y", "z"]
    assert closed == [True, True]


def test_one_failing_choice_fails_all_and_stops_the_others():
    async def go():
        closed: list[bool] = []
        slow = choice(["s"] * 1000, closed, delay=0.01)
        failing = choice(["a", "b", "c"], closed, fail_after=1)
        with pytest.raises(ApiError) as e:
            async for _ in fan_in([slow, failing]):
                pass
        return e.value, closed

    error, closed = asyncio.run(go())
    assert error.status == 500 and "aborted" in error.info.message
    assert closed == [True, True]  # the slow choice was cancelled, not left running
