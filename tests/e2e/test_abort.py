"""A client that walks away mid-stream costs nothing after it leaves."""

from __future__ import annotations

import openai

from bench.live.server import wait_for


def free_hbm_blocks(server) -> int:
    return server.get_json("/health")["schedulers"][0]["num_free_hbm_blocks"]


def test_aborted_stream_returns_its_blocks(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    assert wait_for(lambda: server.get_json("/health")["schedulers"][0]["num_running"] == 0)
    before = free_hbm_blocks(server)

    stream = client.completions.create(
        model=server.model,
        prompt="Write a long story about a lighthouse keeper. " * 8,
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    received = 0
    for chunk in stream:
        received += 1
        if received == 5:
            assert wait_for(lambda: free_hbm_blocks(server) < before)  # it holds KV blocks now
            break
    stream.close()

    assert wait_for(lambda: free_hbm_blocks(server) == before), (
        f"free blocks {free_hbm_blocks(server)} != {before} after the client left"
    )
    health = server.get_json("/health")["schedulers"][0]
    assert health["num_running"] == 0 and health["num_waiting"] == 0

    # and the server still serves
    r = client.completions.create(model=server.model, prompt="Hello", max_tokens=4, temperature=0)
    assert r.choices[0].text
