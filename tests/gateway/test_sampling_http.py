"""Logprobs, echo scoring, penalties, logit_bias and min_tokens over HTTP, against the whole
stack (`server` fixture), through the official `openai` client."""

from __future__ import annotations

import json
import math

from tests.gateway.test_http import MESSAGES, raw, sync_client

PROMPT = "The capital of France is"


def chat(server, **kw):
    return sync_client(server).chat.completions.create(model=server.model, messages=MESSAGES, temperature=0, **kw)


def completion(server, prompt=PROMPT, **kw):
    return sync_client(server).completions.create(model=server.model, prompt=prompt, temperature=0, **kw)


def test_chat_logprobs_whole_and_streamed(server):
    r = chat(server, max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob  # greedy: its top-1
        assert e.bytes == list(e.token.encode())
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4
    assert "".join(e.token for e in content) == r.choices[0].message.content
    chunks = list(chat(server, max_tokens=8, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, content))
    assert chat(server, max_tokens=2).choices[0].logprobs is None  # not asked


def test_completion_logprobs_whole_and_streamed(server):
    r = completion(server, max_tokens=6, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top, key=top.get) == token and top[token] == value
    chunks = list(completion(server, max_tokens=6, logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    only_token = completion(server, max_tokens=2, logprobs=0).choices[0].logprobs
    assert [list(d) for d in only_token.top_logprobs] == [[t] for t in only_token.tokens]


def test_echo_scores_the_prompt_without_generating(server):
    """max_tokens 0 with echo (how evaluation harnesses score): the prompt's text and token
    logprobs, nothing generated. The score of "... is Paris" at " Paris" equals the logprob
    the model gave " Paris" when it generated it."""
    nxt = completion(server, max_tokens=1, logprobs=1).choices[0]
    target = nxt.logprobs.tokens[0]
    r = completion(server, prompt=PROMPT + target, max_tokens=0, echo=True, logprobs=1)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == PROMPT + target and r.usage.completion_tokens == 0
    assert len(lp.tokens) == r.usage.prompt_tokens and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[-1] == target and abs(lp.token_logprobs[-1] - nxt.logprobs.token_logprobs[0]) < 1e-3
    streamed = list(completion(server, prompt=PROMPT, max_tokens=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices).startswith(PROMPT)


def test_penalties_bias_and_min_tokens_change_the_output(server):
    long = {"max_tokens": 40, "extra_body": {"ignore_eos": True}}
    plain = completion(server, prompt="one, two, three, one, two, three, one,", **long).choices[0].text
    penalised = completion(
        server, prompt="one, two, three, one, two, three, one,", frequency_penalty=2.0, **long
    ).choices[0].text
    assert penalised != plain and penalised.count(" two") < plain.count(" two")
    first = completion(server, max_tokens=1, logprobs=0).choices[0].logprobs
    status, _, body = raw(server, "POST", "/tokenize", {"prompt": first.tokens[0], "add_special_tokens": False})
    token_id = json.loads(body)["tokens"][0]
    banned = completion(server, max_tokens=1, logprobs=0, logit_bias={str(token_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first.tokens[0]
    short = chat(server, max_tokens=256)  # a reply that ends on its own, however long this path's greedy text runs
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens + 5
    longer = chat(server, max_tokens=n + 64, extra_body={"min_tokens": n})
    assert longer.usage.completion_tokens >= n
