"""Helpers for the live fault tests: find a child of `superinfer serve` by its role, and
stream greedy completions while recording when each token arrived."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai

from bench.live.server import children_of

MAX_TOKENS = 48
PROMPTS = [
    "Write a short poem about the ocean.",
    "Describe a mountain village at dawn.",
    "Explain how trains run on time.",
    "Tell a story about a lost cat.",
    "List some facts about bees.",
    "Describe an old library.",
    "Write about the first snow of winter.",
    "Explain why rivers bend.",
]


def child_by_role(pid: int, role: str) -> int | None:
    """The child whose command line runs `services.cli <role>`."""
    for kid in children_of(pid):
        try:
            argv = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if role.encode() in argv:
            return kid
    return None


def client_for(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


async def stream_one(client, model: str, prompt: str, token_times: list[float]) -> str:
    """One greedy streamed completion of exactly MAX_TOKENS tokens."""
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            token_times.append(time.monotonic())
    return "".join(parts)


async def stream_all(client, model: str, token_times: list[float]) -> list[str]:
    return list(await asyncio.gather(*(stream_one(client, model, q, token_times) for q in PROMPTS)))
