"""The HTTP API end to end, against the whole stack (`server` fixture: gateway, scheduler and
worker serving the bundled model), through the official `openai` client where a client
would use it and raw HTTP where the point is a malformed request."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import openai
import pytest

from shared.modelfile import default_model_path

MAX_TOKENS = 16


def sync_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def raw(server, method: str, path: str, body: bytes | dict | None = None) -> tuple[int, dict, bytes]:
    """One HTTP exchange, with bodies sent exactly as given (no client-side validation)."""

    async def go():
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        async with aiohttp.ClientSession() as s:
            async with s.request(method, server.base_url + path, data=data) as r:
                return r.status, dict(r.headers), await r.read()

    return asyncio.run(go())


def greedy_completion(server, prompt: str, **kw) -> openai.types.Completion:
    return sync_client(server).completions.create(
        model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kw
    )


def assert_usage(usage, max_completion: int = MAX_TOKENS) -> None:
    assert usage.prompt_tokens > 0
    assert 1 <= usage.completion_tokens <= max_completion
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


MESSAGES = [{"role": "user", "content": "Name three colors."}]


def test_chat_completion_not_streamed(server):
    r = sync_client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert r.id.startswith("chatcmpl-")
    assert r.model == server.model
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert_usage(r.usage)


def test_chat_completion_streamed_equals_not_streamed(server):
    client = sync_client(server)
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def _stop_string_inside(text: str) -> str:
    """A short piece from the middle of `text` (so there is text before it)."""
    start = max(1, len(text) // 2)
    return text[start : start + 3]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_stop_string(server, stream):
    prompt = "Once upon a time, in a small village,"
    full = greedy_completion(server, prompt).choices[0].text
    assert len(full) >= 8, full
    stop = _stop_string_inside(full)
    expected = full[: full.index(stop)]
    if stream:
        chunks = list(greedy_completion(server, prompt, stop=[stop], stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = greedy_completion(server, prompt, stop=stop)
        text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert_usage(r.usage)
    assert stop not in text
    assert text == expected
    assert finish == ["stop"]


def test_completion_from_token_ids(server):
    r = sync_client(server).completions.create(model=server.model, prompt=[1, 4093, 198], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 3
    assert_usage(r.usage, 4)


def test_eight_concurrent_streams_complete(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        stream = await client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        text, finish = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=180)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    results = asyncio.run(all_of_them())
    assert len(results) == 8
    assert all(finish in ("stop", "length") for _, finish in results), results


def _scheduler_load(server) -> tuple[int, int]:
    """(free HBM blocks, requests running or waiting) over all schedulers, from /health."""
    status, _, body = raw(server, "GET", "/health")
    assert status == 200, body
    stats = json.loads(body)["schedulers"]
    return sum(s["num_free_hbm_blocks"] for s in stats), sum(s["num_running"] + s["num_waiting"] for s in stats)


def _wait_idle(server, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, busy = _scheduler_load(server)
        if busy == 0:
            return free
        time.sleep(0.1)
    raise AssertionError("scheduler did not become idle")


def test_client_disconnect_returns_blocks(server):
    free_before = _wait_idle(server)

    async def read_two_chunks_then_leave():
        # No max_tokens and ignore_eos: it would run to the end of the context window, for
        # minutes, so only the abort can free its blocks in time.
        body = {"model": server.model, "prompt": "Tell me a long story.", "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{server.base_url}/v1/completions", json=body) as r:
                assert r.status == 200
                seen = 0
                async for line in r.content:
                    seen += line.startswith(b"data: ")
                    if seen == 2:
                        break
        # leaving the session closes the connection mid-stream

    asyncio.run(read_two_chunks_then_leave())
    assert _wait_idle(server) == free_before


BAD_REQUESTS = [
    ("/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 129}, 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, None),
    ("/v1/completions", {"prompt": ""}, 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000_000}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi " * 20_000}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, None),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model_not_found"),
]


@pytest.mark.parametrize("path,body,status,code", BAD_REQUESTS)
def test_bad_request_gets_openai_error(server, path, body, status, code):
    got, headers, raw_body = raw(server, "POST", path, body)
    assert got == status, raw_body
    assert headers["Content-Type"].startswith("application/json")
    error = json.loads(raw_body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code


def test_unknown_route_is_openai_error(server):
    status, _, body = raw(server, "GET", "/v1/nothing-here")
    assert status == 404 and "error" in json.loads(body)


def test_server_still_serves_after_bad_requests(server):
    for path, body, _, _ in BAD_REQUESTS:
        raw(server, "POST", path, body)
    r = greedy_completion(server, "The capital of France is")
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")


def test_models_health_metrics(server):
    models = sync_client(server).models.list()
    assert [m.id for m in models.data] == [server.model]
    # vLLM's `root`: where the served model lies (what `bench serve` loads its tokenizer from)
    assert models.data[0].model_extra["root"] == str(default_model_path().resolve())
    status, _, body = raw(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = raw(server, "GET", "/metrics")
    text = body.decode()
    assert status == 200
    model = 'model_name="%s"' % server.model
    for name in ("superinfer:num_requests_running{%s}" % model, 'superinfer:kv_free_blocks{%s,tier="hbm"}' % model,
                 'superinfer:kv_total_blocks{%s,tier="dram"}' % model, "superinfer:time_to_first_token_seconds_bucket",
                 "superinfer:e2e_request_latency_seconds_count", "superinfer:http_requests_total"):
        assert name in text, name
    # vLLM's model_name label on every series, as dashboards built for vLLM select by it.
    assert all(model in line for line in text.splitlines() if line and not line.startswith("#")), text


def test_metrics_count_every_token_gap_and_keep_one_type_per_name(server):
    """Every gap between two tokens is observed; the schedulers' cumulative counts are
    counters here as on the scheduler's own endpoint (a name is never a gauge on one port
    and a counter on another)."""

    def gaps() -> float:
        text = raw(server, "GET", "/metrics")[2].decode()
        return float(re.search(r"^superinfer:inter_token_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M).group(1))

    before = gaps()
    r = greedy_completion(server, "Count from one to ten:", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS
    assert gaps() - before == MAX_TOKENS - 1
    text = raw(server, "GET", "/metrics")[2].decode()
    for name in ("num_preemptions", "num_recomputes", "rotations", "kv_blocks_moved"):
        assert f"# TYPE superinfer:{name}_total counter" in text, name


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(server):
    """The same long prompt twice: the second computes only what the cache lacked, as
    `usage.prompt_tokens_details.cached_tokens` says (whole blocks, never the last token)."""
    prompt = f"Request at {time.monotonic()}. " + "Tell me about the sea. " * 40  # no earlier request shares it
    first, second = (greedy_completion(server, prompt) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    assert second.choices[0].text == first.choices[0].text
    chunks = list(
        sync_client(server).completions.create(
            model=server.model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
