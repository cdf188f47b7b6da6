"""`n` > 1 over HTTP, against the whole stack (`server` fixture), through the official
`openai` client: n choices for one prompt, streamed and not, each choice the request it would
be alone with seed + index; usage counts the prompt once and sums the completions; a client
that leaves stops every choice."""

from __future__ import annotations

import openai
import pytest

from bench.live.server import wait_for
from services.worker import cpu_quant
from tests.gateway.test_http import MESSAGES, sync_client

SEED = 11
N = 3
# A choice equals its request alone only where a row's logits do not depend on the batch: the
# served default (the packed GGUF, batch-invariant attention) on AVX512-VNNI or AVX2. Elsewhere the
# model runs float32 matmuls in torch, whose bits follow the number of rows, and a sample can differ.
batch_invariant = pytest.mark.skipif(
    not cpu_quant.quant_fast(), reason="the served path is batch-invariant on AVX512-VNNI or AVX2 only"
)


def chat(server, **kw):
    return sync_client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=1.0, max_tokens=12, **kw
    )


def completion(server, **kw):
    return sync_client(server).completions.create(
        model=server.model, prompt="Once upon a time", temperature=1.0, max_tokens=10, **kw
    )


@batch_invariant
def test_chat_n_choices_are_the_seeded_requests_alone(server):
    r = chat(server, n=N, seed=SEED)
    assert [c.index for c in r.choices] == list(range(N))
    alone = [chat(server, seed=SEED + i) for i in range(N)]
    assert [c.message.content for c in r.choices] == [a.choices[0].message.content for a in alone]
    assert [c.finish_reason for c in r.choices] == [a.choices[0].finish_reason for a in alone]
    assert len({c.message.content for c in r.choices}) > 1  # different seeds: different samples
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_n_streamed_chunks_carry_their_index(server):
    whole = chat(server, n=N, seed=SEED)
    chunks = list(chat(server, n=N, seed=SEED, stream=True, stream_options={"include_usage": True}))
    texts, roles, finishes = [""] * N, [None] * N, [None] * N
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] = roles[choice.index] or choice.delta.role
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert roles == ["assistant"] * N
    assert finishes == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


@batch_invariant
def test_completion_n_streamed_and_not(server):
    whole = completion(server, n=2, seed=SEED, logprobs=1)
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.text for c in whole.choices] == [completion(server, seed=SEED + i).choices[0].text for i in range(2)]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) > 0 for c in whole.choices)
    texts = ["", ""]
    for c in completion(server, n=2, seed=SEED, stream=True):
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    assert whole.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in whole.choices)


def test_greedy_n_gives_n_equal_choices(server):
    r = sync_client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, max_tokens=6, n=2
    )
    assert r.choices[0].message.content == r.choices[1].message.content


def test_a_client_that_leaves_stops_every_choice(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    health = lambda: server.get_json("/health")["schedulers"][0]  # noqa: E731
    assert wait_for(lambda: health()["num_running"] == 0 and health()["num_waiting"] == 0)
    free = health()["num_free_hbm_blocks"]
    stream = client.completions.create(
        model=server.model, prompt="Write a long story. " * 4, max_tokens=400, temperature=1.0, n=3, stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 8:
            break
    stream.close()
    assert wait_for(lambda: health()["num_running"] == 0 and health()["num_waiting"] == 0), health()
    assert wait_for(lambda: health()["num_free_hbm_blocks"] == free), health()
