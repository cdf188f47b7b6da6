"""The gateway process on its own (no scheduler running): what it answers while it has no
scheduler, API keys, and a prompt, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from services.gateway.server import serve

from .conftest import AUTH, free_port, wait_listening

ROOT = Path(__file__).resolve().parents[2]


def test_no_scheduler_is_503_with_retry_after(lone_gateway):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    status, headers, raw = lone_gateway("POST", "/v1/chat/completions", body, AUTH)
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert json.loads(raw)["error"]["type"] == "service_unavailable"
    status, _, raw = lone_gateway("GET", "/health")
    assert status == 503 and json.loads(raw)["status"] == "unavailable"


def test_validation_comes_before_scheduler_availability(lone_gateway):
    status, _, raw = lone_gateway("POST", "/v1/completions", {"prompt": "x", "top_p": 9}, AUTH)
    assert status == 400 and json.loads(raw)["error"]["param"] == "top_p"


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}])
def test_api_key_is_required_on_the_api(lone_gateway, headers):
    status, _, raw = lone_gateway("GET", "/v1/models", headers=headers)
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"


def test_models_with_key(lone_gateway):
    status, _, raw = lone_gateway("GET", "/v1/models", headers=AUTH)
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "SmolLM2-135M-Instruct"


def test_openapi_and_metrics_are_served(lone_gateway):
    status, _, raw = lone_gateway("GET", "/openapi.json")
    assert status == 200 and "ChatCompletionRequest" in json.loads(raw)["components"]["schemas"]
    status, _, raw = lone_gateway("GET", "/metrics")
    text = raw.decode()
    assert status == 200
    assert 'route="/openapi.json",status="200"}' in text
    assert re.search(r"^superinfer:num_schedulers\{model_name=\"[^\"]+\"\} 0\.0$", text, re.M), text
    # As vLLM serves them: counters and histograms without their `_created` series.
    assert "superinfer:http_requests_total{" in text and "_created" not in text


def test_wrong_method_and_oversized_body_are_openai_errors(lone_gateway):
    status, _, raw = lone_gateway("GET", "/v1/completions", headers=AUTH)
    assert status == 405 and "error" in json.loads(raw)
    status, _, raw = lone_gateway("POST", "/v1/completions", {"prompt": "x" * (5 << 20)}, AUTH)
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"


def test_sigterm_stops_the_process_quickly(tmp_path):
    port = free_port()
    code = f"from services.gateway.server import run; run('127.0.0.1', {port}, ['ipc://{tmp_path}/x.sock'], None)"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.PIPE)
    try:
        asyncio.run(wait_listening(f"http://127.0.0.1:{port}"))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 3.0
        assert b"gateway_stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_scheduler_lost_while_the_prompt_is_tokenized_is_503_not_500(tmp_path, monkeypatch):
    """The only scheduler's connection closes while a request's prompt is being tokenized
    (off the event loop): the request is refused as unavailable, not failed with a 500."""
    from services.gateway import app
    from shared.protocol import GatewayHello

    from .test_scheduler_client import STATS, Peer

    tokenizing, release = threading.Event(), threading.Event()

    def slow_prompts(req, tokenizer, tool_format):
        tokenizing.set()
        release.wait(10)
        return app.params.completion_prompts(req, tokenizer)

    monkeypatch.setattr(app, "COMPLETION", dataclasses.replace(app.COMPLETION, prompts=slow_prompts))
    port, addr = free_port(), f"ipc://{tmp_path}/s.sock"
    url = f"http://127.0.0.1:{port}"

    async def go():
        peer, stop = Peer(addr), asyncio.Event()
        gateway = asyncio.create_task(serve("127.0.0.1", port, [addr], None, stop=stop))
        try:
            await peer.recv_until(GatewayHello)
            await peer.send(STATS)
            await wait_listening(url)
            async with aiohttp.ClientSession() as s:
                post = asyncio.create_task(s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
                while not tokenizing.is_set():
                    await asyncio.sleep(0.01)
                peer.close()  # the gateway's socket monitor reports the closed connection
                while (await s.get(url + "/health")).status != 503:
                    await asyncio.sleep(0.01)
                release.set()
                async with await post as resp:
                    body = await resp.json()
                    assert resp.status == 503, body
                    assert body["error"]["type"] == "service_unavailable"
        finally:
            release.set()
            stop.set()
            await gateway

    asyncio.run(asyncio.wait_for(go(), 60))
