"""Rotation in the serving path: with an HBM pool that holds about two requests' KV, 8
concurrent greedy requests each get exactly the tokens they get when served alone."""

from __future__ import annotations

import asyncio

import openai
import pytest

from bench.live.server import start_server, wait_for

TOPICS = ["the ocean", "a mountain village", "trains", "the moon", "bread baking", "a lost cat", "bees", "rivers"]
MAX_TOKENS = 32
# ~30 prompt + 32 output tokens = 4 blocks of 16 per request; 9 blocks hold about two.
HBM_BLOCKS = 9


def prompt(topic: str) -> str:
    return f"Write a short poem about {topic}. Use simple words and vivid images, and give it a title."


async def complete(client: openai.AsyncOpenAI, model: str, topic: str) -> str:
    r = await client.completions.create(
        model=model, prompt=prompt(topic), max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def serve_on_small_pool(tmp_path, hbm_blocks: int, scenario, *flags: str):
    """Runs `scenario(client, server)` against a server whose HBM pool holds `hbm_blocks` KV
    blocks, with SLOs tight enough that the policy acts; once it is done, every block must be
    back in the pool. Returns the scenario's result and the scheduler's stats."""
    server = start_server(
        tmp_path, "--hbm-blocks", str(hbm_blocks), "--ttft-slo", "0.5", "--tbt-slo", "0.05", *flags
    )
    try:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        result = asyncio.run(scenario(client, server))
        stats = server.scheduler_stats
        assert wait_for(lambda: stats()["num_free_hbm_blocks"] == hbm_blocks), stats()
        return result, stats()
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("policy, moved", [("lvf", "num_rotations_out"), ("fcfs", "num_recomputes")])
def test_concurrent_outputs_equal_solo_outputs_under_rotation(tmp_path, policy, moved):
    async def scenario(client, server):
        solo = [await complete(client, server.model, t) for t in TOPICS]
        together = await asyncio.gather(*(complete(client, server.model, t) for t in TOPICS))
        return solo, together

    (solo, together), stats = serve_on_small_pool(tmp_path, HBM_BLOCKS, scenario, "--policy", policy)
    assert stats[moved] > 0, stats
    for topic, a, b in zip(TOPICS, solo, together):
        assert a == b, f"{topic!r}: served alone {a!r} != served under rotation {b!r}"
