"""The DRAM prefix-cache tier in the serving path: two-turn conversations on an HBM pool that
holds about two requests, so a conversation's first turn has left HBM (rotated, recomputed or
evicted) when its second turn comes. With `--kv-offloading-size` the second turn loads its
history from DRAM; every greedy token is the same as with the tier off, under rotation (lvf)
and recompute (fcfs)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.e2e.test_rotation import serve_on_small_pool

TOPICS = ["the ocean", "a mountain village", "trains", "the moon", "bread baking"]
MAX_TOKENS = 24
# ~30 prompt + 24 output tokens = 4 blocks of 16 per first turn, ~6 per second turn; 9 hold two.
HBM_BLOCKS = 9
TIER_GIB = "0.05"  # ~145 blocks of SmolLM2's 369 kB (bfloat16, beside the packed GGUF) in the DRAM pool


def first_prompt(topic: str) -> str:
    return f"Write a short poem about {topic}. Use simple words and vivid images, and give it a title."


async def complete(client: openai.AsyncOpenAI, model: str, prompt: str) -> tuple[str, int]:
    r = await client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0


def serve_conversations(tmp_path, policy: str, tier: bool) -> tuple[list[str], dict]:
    """Every first turn at once, then every second turn at once; (all outputs, scheduler stats)."""

    async def scenario(client, server):
        firsts = await asyncio.gather(*(complete(client, server.model, first_prompt(t)) for t in TOPICS))
        seconds = [first_prompt(t) + text + "\n\nNow write a second verse." for t, (text, _) in zip(TOPICS, firsts)]
        again = await asyncio.gather(*(complete(client, server.model, p) for p in seconds))
        return [text for text, _ in firsts + again]

    # The second turn's history is KV its first turn computed token by token (decode); with the
    # tier off it is computed again in one prefill. The default dtype on the bundled Q4_1 GGUF
    # (packed, int8 activations) computes both the same, to the bit (batch-invariant attention).
    flags = ["--policy", policy, "--kv-offloading-size", TIER_GIB if tier else "0"]
    return serve_on_small_pool(tmp_path, HBM_BLOCKS, scenario, *flags)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two servers, each a model start and ten requests on a busy host
@pytest.mark.parametrize("policy, moved", [("lvf", "num_rotations_out"), ("fcfs", "num_recomputes")])
def test_outputs_equal_with_the_dram_tier_on_and_off(tmp_path, policy, moved):
    off, stats_off = serve_conversations(tmp_path, policy, tier=False)
    on, stats_on = serve_conversations(tmp_path, policy, tier=True)
    assert stats_off["num_tier_hits"] == 0 and stats_on["num_tier_hits"] > 0, (stats_off, stats_on)
    assert stats_on["num_tier_blocks"] > 0 and stats_on[moved] > 0, stats_on
    for i, (a, b) in enumerate(zip(off, on)):
        turn, topic = divmod(i, len(TOPICS))
        assert a == b, f"{TOPICS[topic]!r} turn {turn + 1}: tier off {a!r} != tier on {b!r}"
