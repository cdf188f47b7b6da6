"""Faults on a live `superinfer serve` (CPU, bundled model, loopback): SIGKILL the worker or
the scheduler under load, and flood a server that admits one waiting request."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from bench.live.server import start_server, wait_for
from tests.reliability.live import PROMPTS, child_by_role, client_for, stream_all, stream_one


async def kill_under_load(client, model: str, pid: int, meanwhile=None):
    """Stream PROMPTS undisturbed (the reference), then again, SIGKILLing `pid` once a
    quarter of the tokens have arrived; `meanwhile()` runs right after the kill. Returns
    (reference, disturbed, kill time, token times after the kill, meanwhile's result)."""
    reference = await stream_all(client, model, [])
    token_times: list[float] = []
    run = asyncio.create_task(stream_all(client, model, token_times))
    while len(token_times) < len(PROMPTS) * 12 and not run.done():
        await asyncio.sleep(0.01)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    during = await meanwhile() if meanwhile else None
    disturbed = await run
    after = [t for t in token_times if t > killed_at + 0.05]
    return reference, disturbed, killed_at, after, during


@pytest.mark.slow
def test_sigkilled_worker_is_restarted_and_every_request_completes_identically(tmp_path):
    server = start_server(tmp_path)
    try:
        client = client_for(server)
        worker = child_by_role(server.proc.pid, "worker")
        assert worker is not None, server.log_tail()

        reference, disturbed, killed_at, after, _ = asyncio.run(kill_under_load(client, server.model, worker))
        assert after, "no token after the kill: it came too late to test recovery"
        print(f"recovery: kill -> first token after restart {after[0] - killed_at:.2f}s")
        assert disturbed == reference
        new_worker = child_by_role(server.proc.pid, "worker")
        assert new_worker not in (None, worker), server.log_tail()
        assert server.logged("restarting it"), server.log_tail()
        assert asyncio.run(stream_one(client_for(server), server.model, PROMPTS[0], [])) == reference[0]
        assert wait_for(lambda: server.scheduler_stats()["num_running"] == 0)
    finally:
        server.stop()


@pytest.mark.slow
def test_sigkilled_scheduler_is_restarted_and_streams_continue_identically(tmp_path):
    """The gateway holds each stream's prompt and tokens, answers new requests 503 while no
    scheduler is there, and resubmits the streams to the restarted one: every client gets
    the same greedy text as in an undisturbed run."""
    server = start_server(tmp_path)
    try:
        client = client_for(server)
        scheduler = child_by_role(server.proc.pid, "scheduler")
        assert scheduler is not None, server.log_tail()

        async def new_requests_meanwhile() -> list[tuple[int, str | None]]:
            """A new request every 50 ms for 3 s, each on its own (one may wait a while)."""
            body = {"model": server.model, "prompt": "hi", "max_tokens": 2}

            async def probe(session):
                async with session.post(server.base_url + "/v1/completions", json=body) as resp:
                    return resp.status, resp.headers.get("Retry-After")

            async with aiohttp.ClientSession() as session:
                probes = []
                for _ in range(60):
                    probes.append(asyncio.create_task(probe(session)))
                    await asyncio.sleep(0.05)
                return await asyncio.gather(*probes)

        reference, disturbed, killed_at, after, probes = asyncio.run(
            kill_under_load(client, server.model, scheduler, new_requests_meanwhile)
        )
        refused = [p for p in probes if p[0] == 503]
        assert refused and all(int(retry) >= 1 for _, retry in refused), probes
        assert {status for status, _ in probes} <= {200, 503}, probes
        assert after, "no token after the kill: it came too late to test recovery"
        print(f"failover: kill -> first token from the restarted scheduler {after[0] - killed_at:.2f}s")
        assert disturbed == reference
        assert child_by_role(server.proc.pid, "scheduler") not in (None, scheduler), server.log_tail()
        assert server.logged("request_resubmitted"), server.log_tail()
        assert asyncio.run(stream_one(client_for(server), server.model, PROMPTS[0], [])) == reference[0]
        assert wait_for(lambda: server.scheduler_stats()["num_running"] == 0)
    finally:
        server.stop()


@pytest.mark.slow
def test_max_waiting_turns_the_excess_into_429_with_retry_after(tmp_path):
    server = start_server(tmp_path, "--max-waiting", "1", "--max-num-seqs", "1")
    body = {"model": server.model, "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def one(session, prompt):
        async with session.post(server.base_url + "/v1/completions", json={**body, "prompt": prompt}) as resp:
            return resp.status, resp.headers.get("Retry-After"), await resp.json()

    async def scenario():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, q) for q in PROMPTS))

    try:
        replies = asyncio.run(scenario())
    finally:
        server.stop()
    refused = [r for r in replies if r[0] == 429]
    served = [r for r in replies if r[0] == 200]
    assert refused and served and len(refused) + len(served) == len(PROMPTS), replies
    for _, retry_after, err in refused:
        assert retry_after is not None and int(retry_after) >= 1
        assert err["error"]["type"] == "overloaded" and err["error"]["message"]
    for _, _, done in served:
        assert done["usage"]["completion_tokens"] == 16
