"""Batched prompts on /v1/completions and vLLM's `prompt_logprobs`, against the whole stack
(`server` fixture) through the official `openai` client: an lm-eval-style scoring batch
returns what the same prompts return one at a time."""

from __future__ import annotations

import json
import math

import openai
import pytest

from bench.live.server import wait_for
from tests.gateway.test_http import raw, sync_client

PROMPTS = [
    f"Question {i}: what is {i} plus {3 * i}? Every careful student of arithmetic knows the answer is {4 * i}."
    for i in range(8)
]


def test_a_scoring_batch_equals_its_prompts_one_at_a_time(server):
    """lm-eval's local-completions: echo, logprobs and max_tokens 0 over a batch. The single
    requests come second and find the batch's prompts in the prefix cache: a scoring request
    must compute its whole prompt anyway."""
    client = sync_client(server)
    kw = dict(model=server.model, echo=True, logprobs=1, max_tokens=0, temperature=0)
    batch = client.completions.create(prompt=PROMPTS, **kw)
    assert [c.index for c in batch.choices] == list(range(8))
    singles = [client.completions.create(prompt=p, **kw) for p in PROMPTS]
    for prompt, got, alone in zip(PROMPTS, batch.choices, singles):
        want = alone.choices[0]
        assert got.text == want.text == prompt
        assert got.logprobs.tokens == want.logprobs.tokens
        assert got.logprobs.text_offset == want.logprobs.text_offset
        assert got.logprobs.token_logprobs[0] is None and want.logprobs.token_logprobs[0] is None
        assert got.logprobs.token_logprobs[1:] == pytest.approx(want.logprobs.token_logprobs[1:], abs=1e-4)
        assert len(got.logprobs.tokens) == alone.usage.prompt_tokens
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 0


def test_batch_choices_are_indexed_prompt_times_n(server):
    client = sync_client(server)
    r = client.completions.create(model=server.model, prompt=PROMPTS[:3], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == list(range(6))
    for i in range(3):
        alone = client.completions.create(model=server.model, prompt=PROMPTS[i], max_tokens=4, temperature=0)
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == alone.choices[0].text
    ids = client.completions.create(model=server.model, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 5 and len(ids.choices) == 2
    # Streamed: each chunk names its choice; usage counts each prompt once, however many choices.
    chunks = client.completions.create(
        model=server.model, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = ["", "", "", ""], None
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
        usage = c.usage or usage
    assert texts == [c.text for c in r.choices[:4]]
    two = [client.completions.create(model=server.model, prompt=p, max_tokens=1) for p in PROMPTS[:2]]
    assert usage.prompt_tokens == sum(t.usage.prompt_tokens for t in two)


@pytest.mark.parametrize(
    "prompt,param",
    [(["fine", ""], "prompt[1]"), (["a", "b", [49152]], "prompt[2]"), ([[1, 2], []], "prompt[1]"), ([1, "a"], "prompt")],
)
def test_one_bad_prompt_refuses_the_batch_naming_its_index(server, prompt, param):
    def idle() -> bool:  # what earlier tests sent on this shared server has finished
        stats = server.scheduler_stats()
        return stats["num_running"] + stats["num_waiting"] == 0

    assert wait_for(idle, 60.0), server.scheduler_stats()
    with pytest.raises(openai.BadRequestError) as e:
        sync_client(server).completions.create(model=server.model, prompt=prompt, max_tokens=2)
    assert e.value.body["param"] == param, e.value.body
    if param != "prompt":
        assert f"prompt {param[7]}" in e.value.body["message"]
    assert idle(), "the refused batch started some of its prompts"


def test_prompt_logprobs_on_both_endpoints(server):
    client = sync_client(server)
    echo = client.completions.create(model=server.model, prompt=PROMPTS[0], echo=True, logprobs=0, max_tokens=0)
    r = client.completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    scores = r.choices[0].model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == r.usage.prompt_tokens
    tokens = json.loads(raw(server, "POST", "/tokenize", {"model": server.model, "prompt": PROMPTS[0]})[2])["tokens"]
    for pos, (token, entry, want) in enumerate(zip(tokens[1:], scores[1:], echo.choices[0].logprobs.token_logprobs[1:])):
        assert str(token) in entry, pos  # the prompt's own token, and the top 3
        assert entry[str(token)]["logprob"] == pytest.approx(want, abs=1e-4)
        ranked = sorted((v for v in entry.values() if v["rank"] is not None), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:3] == [1, 2, 3]
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(ranked, ranked[1:]))
        assert len(entry) in (3, 4)
        assert all(math.isfinite(v["logprob"]) for v in entry.values())
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    scores = chat.model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in scores[1:])
    # Streamed: on the first chunk only.
    chunks = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
        extra_body={"prompt_logprobs": 0},
    ))
    carrying = [c for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert len(carrying) == 1 and carrying[0].model_extra["prompt_logprobs"] == scores


def test_metrics_have_no_created_series(server):
    sync_client(server).completions.create(model=server.model, prompt="hi", max_tokens=1)
    status, _, body = raw(server, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and "superinfer:time_to_first_token_seconds_count" in text and "_created" not in text
