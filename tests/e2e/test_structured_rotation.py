"""Structured output through rotation and recompute: with an HBM pool that holds about two
requests' KV, greedy json_schema requests served among plain ones get exactly the output they
get when served alone (the worker keeps each request's grammar state while its KV moves, and
a recompute does not feed the grammar twice)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.e2e.test_rotation import HBM_BLOCKS, MAX_TOKENS, TOPICS, complete, serve_on_small_pool

CHARACTER = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "character", "schema": CHARACTER, "strict": True}}


async def character(client: openai.AsyncOpenAI, model: str, topic: str) -> tuple[str, str]:
    messages = [{"role": "user", "content": f"Invent a character for a story about {topic}. Answer in JSON."}]
    r = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, response_format=FORMAT
    )
    return r.choices[0].message.content, r.choices[0].finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("policy, moved", [("lvf", "num_rotations_out"), ("fcfs", "num_recomputes")])
def test_constrained_outputs_equal_solo_outputs_under_rotation(tmp_path, policy, moved):
    constrained, plain = TOPICS[:4], TOPICS[4:]

    async def scenario(client, server):
        solo = [await character(client, server.model, t) for t in constrained]
        together = await asyncio.gather(
            *(character(client, server.model, t) for t in constrained),
            *(complete(client, server.model, t) for t in plain),
        )
        return solo, together[: len(constrained)]

    (solo, together), stats = serve_on_small_pool(tmp_path, HBM_BLOCKS, scenario, "--policy", policy)
    assert stats[moved] > 0, stats
    for topic, a, b in zip(constrained, solo, together):
        assert a == b, f"{topic!r}: served alone {a!r} != served under rotation {b!r}"
        if a[1] == "stop":
            jsonschema.validate(json.loads(a[0]), CHARACTER)
    assert any(finish == "stop" for _, finish in solo)
