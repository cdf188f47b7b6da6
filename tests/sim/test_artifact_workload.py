"""The paper's workload as its harness samples it: ShareGPT pairs at their own lengths (no
2,048 cap), outputs cut at 8,192 tokens, sent with ignore_eos; vLLM's filter behind a flag."""

from __future__ import annotations

import pytest

from bench.live.workload import ARTIFACT_MAX_OUTPUT, MAX_TOTAL_TOKENS, sample_sharegpt
from bench.sim import sweep
from bench.sim.engine import requests_of
from shared.modelfile import resolve_model_path
from shared.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def long_pairs(tokenizer) -> list[tuple[str, str]]:
    """Hand-built pairs: short, past vLLM's 2,048 total, and an answer past 8,192 tokens."""
    word = " apple"
    assert len(tokenizer.encode(word * 10, add_special_tokens=False)) == 10
    return [
        ("Hello there, how are you?", word * 300),
        ("Write a long essay." + word * 1500, word * 1500),  # 3,000+ tokens in all
        ("Write a book.", word * 9000),  # an answer longer than the harness generated
    ]


def test_artifact_sampler_keeps_long_pairs_and_cuts_outputs_at_8192(tokenizer):
    pairs = long_pairs(tokenizer)
    items = sample_sharegpt(pairs, 3, tokenizer, seed=0, artifact=True)
    outputs = sorted(it.output_tokens for it in items)
    assert outputs[0] == 300 and outputs[1] == 1500
    assert outputs[2] == ARTIFACT_MAX_OUTPUT  # 9,000 cut to 8,192
    assert max(it.prompt_tokens + it.output_tokens for it in items) > MAX_TOTAL_TOKENS
    with pytest.raises(ValueError):  # vLLM's filter drops the two long ones
        sample_sharegpt(pairs, 2, tokenizer, seed=0)


def test_sim_sharegpt_is_the_artifacts_and_asks_ignore_eos():
    items = sweep.load_items("sharegpt", 1500, seed=0)
    totals = [it.prompt_tokens + it.output_tokens for it in items]
    assert max(totals) > MAX_TOTAL_TOKENS  # no 2,048 cap
    assert max(it.output_tokens for it in items) <= ARTIFACT_MAX_OUTPUT
    filtered = sweep.load_items("sharegpt", 1500, seed=0, vllm_filter=True)
    assert max(it.prompt_tokens + it.output_tokens for it in filtered) <= MAX_TOTAL_TOKENS
    # the simulator asks each output's own length with ignore_eos: it ends by length, not a stop
    for req, it in zip(requests_of(items[:50]), items[:50]):
        assert req.params.ignore_eos and req.params.max_tokens == it.output_tokens
