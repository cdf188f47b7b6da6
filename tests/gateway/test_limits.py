"""The limits of the HTTP API, over real HTTP against the whole stack: every refusal is an
OpenAI-style error naming the `param` at fault (400), the body size is capped (413), values
at the edge of a range are served, and a full waiting queue answers 429 with Retry-After."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from bench.live.server import start_server, wait_for
from services.gateway.api import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOP_K, CompletionRequest
from services.gateway.errors import ApiError
from services.gateway.params import max_new_tokens

from .test_http import raw

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
INT64_MAX = 2**63 - 1


def chat(**kw) -> dict:
    return {"messages": MESSAGES, **kw}


def completion(**kw) -> dict:
    return {"prompt": "hi", **kw}


# (path, body, param, code): each one a 400 naming `param`.
REFUSED = [
    (CHAT, {"messages": []}, "messages", None),
    (CHAT, chat(max_tokens=0), "max_tokens", None),
    (CHAT, chat(max_completion_tokens=0), "max_completion_tokens", None),
    (CHAT, chat(max_completion_tokens=10**7), "max_completion_tokens", "context_length_exceeded"),
    (COMPLETIONS, completion(max_tokens=-1), "max_tokens", None),
    (COMPLETIONS, completion(max_tokens=10**7), "max_tokens", "context_length_exceeded"),
    (COMPLETIONS, completion(stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop", None),
    (COMPLETIONS, completion(stop=""), "stop", None),
    (COMPLETIONS, completion(stop=["ok", ""]), "stop[1]", None),
    (COMPLETIONS, completion(stop="x" * (MAX_STOP_CHARS + 1)), "stop", None),
    (CHAT, chat(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop[0]", None),
    (CHAT, chat(n=129), "n", None),
    (CHAT, chat(n=0), "n", None),
    (CHAT, chat(temperature=-0.01), "temperature", None),
    (CHAT, chat(temperature=2.01), "temperature", None),
    (CHAT, chat(top_p=0), "top_p", None),
    (CHAT, chat(top_p=1.01), "top_p", None),
    (CHAT, chat(top_k=-1), "top_k", None),
    (CHAT, chat(top_k=MAX_TOP_K + 1), "top_k", None),
    (COMPLETIONS, completion(seed=INT64_MAX + 1), "seed", None),
    (COMPLETIONS, completion(seed=-INT64_MAX - 2), "seed", None),
    (COMPLETIONS, {"prompt": ""}, "prompt", None),
    (COMPLETIONS, {"prompt": [1, -5, 3]}, "prompt", None),
    (CHAT, chat(slo={"ttft_ms": 0}), "slo.ttft_ms", None),
]


def error_of(status: int, headers: dict, body: bytes) -> dict:
    assert headers["Content-Type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


@pytest.mark.parametrize("path,body,param,code", REFUSED, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_out_of_range_is_400_naming_the_param(server, path, body, param, code):
    status, headers, raw_body = raw(server, "POST", path, body)
    assert status == 400, raw_body
    error = error_of(status, headers, raw_body)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def max_model_len(server) -> int:
    status, _, body = raw(server, "GET", "/v1/models")
    assert status == 200, body
    return json.loads(body)["data"][0]["max_model_len"]


@pytest.mark.parametrize("path,field", [(COMPLETIONS, "prompt"), (CHAT, "messages")])
def test_a_prompt_over_the_context_window_names_the_prompt(server, path, field):
    n = max_model_len(server)
    body = {"prompt": [1] * n} if field == "prompt" else {"messages": [{"role": "user", "content": "hi " * n}]}
    status, headers, raw_body = raw(server, "POST", path, body)
    assert status == 400, raw_body
    error = error_of(status, headers, raw_body)
    assert (error["param"], error["code"]) == (field, "context_length_exceeded"), error


def test_a_body_over_the_size_cap_is_413(server):
    body = json.dumps({"prompt": "x" * (5 << 20)}).encode()
    status, headers, raw_body = raw(server, "POST", COMPLETIONS, body)
    assert status == 413, raw_body[:200]
    assert error_of(status, headers, raw_body)["code"] == "request_too_large"


# Bodies at the edge of every range: each is served.
ACCEPTED = [
    completion(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS),
    completion(top_k=MAX_TOP_K, temperature=2.0, top_p=1e-9, seed=INT64_MAX),
    completion(seed=-INT64_MAX - 1, temperature=0.5),
    chat(max_completion_tokens=1, stop="\n"),
]


@pytest.mark.parametrize("body", ACCEPTED, ids=range(len(ACCEPTED)))
def test_edge_values_are_served(server, body):
    path = CHAT if "messages" in body else COMPLETIONS
    status, _, raw_body = raw(server, "POST", path, {"max_tokens": 2, **body})
    assert status == 200, raw_body
    assert json.loads(raw_body)["usage"]["completion_tokens"] >= 1


def test_a_tiny_temperature_samples_greedily(server):
    """logits / 1e-30 would be inf and softmax NaN: the gateway sends it as greedy."""
    texts = []
    for t in (0.0, 1e-30):
        status, _, body = raw(server, "POST", COMPLETIONS, completion(prompt="The sky is", max_tokens=6, temperature=t))
        assert status == 200, body
        texts.append(json.loads(body)["choices"][0]["text"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "asked,num_prompt,expected",
    [(None, 10, 90), (90, 10, 90), (91, 10, None), (1, 99, 1), (None, 100, None)],
)
def test_max_new_tokens_fills_the_context_window_exactly(asked, num_prompt, expected):
    req = CompletionRequest(prompt="p", max_tokens=asked)
    if expected is None:
        with pytest.raises(ApiError) as e:
            max_new_tokens(req, num_prompt, 100)
        assert e.value.info.code == "context_length_exceeded"
    else:
        assert max_new_tokens(req, num_prompt, 100) == expected


# ---------------------------------------------------------------- overload: 429


@pytest.mark.slow
def test_waiting_tokens_over_the_bound_is_429_with_retry_after(tmp_path):
    """One request runs (`--max-num-seqs 1`), a second of 40 tokens waits; a third of 40
    would bring the waiting tokens to 80 > 64 and is refused; once the first is gone the
    second is served."""
    srv = start_server(tmp_path, "--max-waiting-tokens", "64", "--max-num-seqs", "1")
    url = srv.base_url + COMPLETIONS

    def body(n: int, max_tokens: int, **kw) -> dict:
        return {"prompt": list(range(100, 100 + n)), "max_tokens": max_tokens, "temperature": 0, **kw}

    async def scenario():
        async with aiohttp.ClientSession() as session:
            running = await session.post(url, json=body(8, 2000, ignore_eos=True, stream=True))
            assert running.status == 200
            await running.content.readline()  # its first token: it runs
            waiting = asyncio.create_task(session.post(url, json=body(40, 2)))
            loop = asyncio.get_running_loop()
            stats = lambda: srv.scheduler_stats()["num_waiting"] == 1  # noqa: E731
            assert await loop.run_in_executor(None, wait_for, stats, 30.0), srv.scheduler_stats()
            async with session.post(url, json=body(40, 2)) as refused:
                refusal = refused.status, refused.headers.get("Retry-After"), await refused.json()
            running.close()  # the client goes away: the running request is aborted
            served = await waiting
            return refusal, served.status, await served.json()

    try:
        t0 = time.monotonic()
        (status, retry_after, err), served_status, served = asyncio.run(scenario())
        print(f"429 scenario {time.monotonic() - t0:.1f}s")
    finally:
        srv.stop()
    assert status == 429 and retry_after is not None and int(retry_after) >= 1, (status, err)
    assert err["error"]["type"] == "overloaded", err
    assert all(n in err["error"]["message"] for n in ("40 tokens", "80", "64")), err
    assert served_status == 200 and served["usage"]["completion_tokens"] == 2, served
