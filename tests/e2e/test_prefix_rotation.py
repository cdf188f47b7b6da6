"""Prefix caching in the serving path, under rotation: requests that share a long system
prompt, on an HBM pool that holds about two of them unshared, get exactly the same greedy
tokens with prefix caching on as with it off, and the cache is hit."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import openai
import pytest

from bench.live.server import free_port
from tests.e2e.test_rotation import serve_on_small_pool

SYSTEM = (
    "You are a careful assistant for a small public library. You answer questions about opening "
    "hours, borrowing rules, late fees, events for children, the reading room, the archive of local "
    "newspapers, interlibrary loans, printing, and the quiet study rooms on the second floor. Keep "
    "every answer short and friendly, name the desk that can help, and never invent a rule. "
)
QUESTIONS = [
    "When does the library open on Sundays?", "How many books may I borrow at once?",
    "What is the late fee for a DVD?", "Is there a story hour for toddlers?",
    "Can I print in colour?", "How do I book a study room?",
    "Where are the old newspapers kept?", "Can you get a book from another city?",
]  # fmt: skip
MAX_TOKENS = 16
# ~150 prompt + 16 output tokens = 11 blocks of 16 per request; 24 blocks hold two unshared.
HBM_BLOCKS = 24


async def complete(client: openai.AsyncOpenAI, model: str, question: str) -> str:
    r = await client.completions.create(
        model=model, prompt=SYSTEM + question, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def serve_all(tmp_path, caching: bool) -> tuple[list[str], dict, float]:
    """Every question at once; (outputs, scheduler stats, prefix-cache hit tokens)."""
    metrics_port = free_port()

    async def scenario(client, server):
        outputs = await asyncio.gather(*(complete(client, server.model, q) for q in QUESTIONS))
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        hits = re.search(r"^superinfer:prefix_cache_hits_total\{model_name=\"[^\"]+\"\} (\S+)$", text, re.M)
        assert hits is not None, text[-2000:]
        return outputs, float(hits.group(1))

    flags = ["--policy", "lvf", "--metrics-port", str(metrics_port)]
    flags.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
    (outputs, hits), stats = serve_on_small_pool(tmp_path, HBM_BLOCKS, scenario, *flags)
    return outputs, stats, hits


@pytest.mark.slow
def test_outputs_equal_with_prefix_caching_on_and_off_under_rotation(tmp_path):
    off, stats_off, hits_off = serve_all(tmp_path, caching=False)
    on, stats_on, hits_on = serve_all(tmp_path, caching=True)
    assert hits_off == 0 and hits_on > 0, (hits_off, hits_on)
    assert stats_off["num_preemptions"] > 0, stats_off
    for q, a, b in zip(QUESTIONS, off, on):
        assert a == b, f"{q!r}: caching off {a!r} != caching on {b!r}"
