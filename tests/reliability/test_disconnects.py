"""Clients that go away at random cost nothing after they leave: against a live server whose
HBM pool holds about three requests (so requests rotate to DRAM and back), 24 requests
read to the end, hang up after k tokens, hang up before their first token, or give up
waiting for a whole response. At idle the scheduler's admin socket shows no live request
and every HBM and DRAM block free, and the scheduler, which checks its invariants (block
ownership, queues, counts) each time it goes idle and dies on a violation, is still the
same process."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import aiohttp
import pytest

from bench.live.server import REPO, Server, free_port, start_server
from services.admin_cli import AdminClient, AdminFailure
from shared import protocol as p
from tests.reliability.live import child_by_role

pytestmark = pytest.mark.slow
NUM_REQUESTS = 24
HBM_BLOCKS = 12  # ~20 prompt + 32 output tokens = 4 blocks of 16: about three requests fit
MAX_TOKENS = 32
BEHAVIOURS = ("to_the_end", "after_k_tokens", "before_first_token", "client_timeout")
SCENARIO_TIMEOUT_S = 120  # a few seconds when healthy; a leak can starve a client forever
IDLE_TIMEOUT_S = 60


def prompt(i: int) -> str:
    return f"Write a short story about a lighthouse keeper named Ada, number {i}. Keep it simple."


async def stream(session: aiohttp.ClientSession, url: str, body: dict, num_chunks: int | None) -> int:
    """Read up to `num_chunks` SSE data lines (all when None), then leave; leaving the
    response unread closes the connection mid-stream."""
    seen = 0
    async with session.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                return seen
            seen += line.startswith(b"data: ")
            if num_chunks is not None and seen >= num_chunks:
                return seen
    raise AssertionError("stream ended without [DONE]")


async def one(session: aiohttp.ClientSession, url: str, i: int, rng: random.Random) -> str:
    behaviour = rng.choice(BEHAVIOURS)
    await asyncio.sleep(rng.uniform(0.0, 1.0))
    body = {"prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if behaviour == "to_the_end":
        assert await stream(session, url, body, None) >= 1
    elif behaviour == "after_k_tokens":
        await stream(session, url, body, rng.randint(1, MAX_TOKENS // 2))
    elif behaviour == "before_first_token":
        task = asyncio.create_task(stream(session, url, body, None))
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    else:
        timeout = aiohttp.ClientTimeout(total=rng.uniform(0.3, 2.0))
        try:
            async with session.post(url, json=body, timeout=timeout) as r:
                await r.read()
        except asyncio.TimeoutError:
            pass
    return behaviour


def is_idle(s: p.SchedulerStats) -> bool:
    live = s.num_waiting + s.num_running + s.num_rotary
    return not live and s.num_free_hbm_blocks == s.num_hbm_blocks and s.num_free_dram_blocks == s.num_dram_blocks


def last_traceback(server: Server) -> str:
    """The last traceback in the server's log (what an invariant violation leaves), else its tail."""
    log = server.log_path.read_text(errors="replace")
    at = log.rfind("Traceback")
    return log[at : at + 4000] if at >= 0 else server.log_tail()


def idle_stats(server: Server, admin: AdminClient) -> p.SchedulerStats:
    """The scheduler's stats once idle (or at the deadline); a scheduler that stopped
    answering fails with the server's log."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        try:
            s = admin.ask(p.StatsQuery()).stats
        except AdminFailure as e:
            raise AssertionError(f"{e}\n{last_traceback(server)}") from None
        if is_idle(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def cli_json(admin_addr: str, *args: str) -> dict | list:
    cmd = [sys.executable, "-m", "services.cli", *args, "--json", "--admin", admin_addr]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_random_disconnects_leak_no_block(tmp_path):
    admin_addr = f"tcp://127.0.0.1:{free_port()}"
    server = start_server(
        tmp_path, "--hbm-blocks", str(HBM_BLOCKS), "--admin-bind", admin_addr, "--ttft-slo", "0.5", "--tbt-slo", "0.05"
    )
    admin = AdminClient(admin_addr, timeout_s=10)
    try:
        scheduler = child_by_role(server.proc.pid, "scheduler")
        assert scheduler is not None, server.log_tail()
        rng = random.Random(20260)

        async def scenario() -> list[str]:
            async with aiohttp.ClientSession() as session:
                url = server.base_url + "/v1/completions"
                clients = asyncio.gather(*(one(session, url, i, rng) for i in range(NUM_REQUESTS)))
                return await asyncio.wait_for(clients, SCENARIO_TIMEOUT_S)

        t0 = time.monotonic()
        try:
            behaviours = asyncio.run(scenario())
        except TimeoutError:
            raise AssertionError(f"clients still waiting after {SCENARIO_TIMEOUT_S}s\n{last_traceback(server)}") from None
        assert set(behaviours) == set(BEHAVIOURS), behaviours
        assert is_idle(s := idle_stats(server, admin)), s
        took_s = time.monotonic() - t0

        reply = cli_json(admin_addr, "stats")  # what the operator sees
        s = reply["stats"]
        print(f"idle after {took_s:.1f}s: {reply['num_finished']} finished, {reply['num_aborted']} aborted, "
              f"{s['num_rotations_out']} rotations out")
        assert s["num_waiting"] == s["num_running"] == s["num_rotary"] == 0, s
        assert s["num_free_hbm_blocks"] == s["num_hbm_blocks"] == HBM_BLOCKS, s
        assert s["num_free_dram_blocks"] == s["num_dram_blocks"] > 0, s
        assert s["num_rotations_out"] > 0, f"nothing rotated: the test did not exercise DRAM {s}"
        assert reply["num_aborted"] > 0 and reply["num_finished"] > 0, reply
        assert reply["num_finished"] + reply["num_aborted"] <= NUM_REQUESTS, reply
        assert cli_json(admin_addr, "queues") == []
        # The invariant check at idle passed: a violation raises in the scheduler's loop and
        # takes the process (and with it `serve`) down.
        assert server.proc.poll() is None and child_by_role(server.proc.pid, "scheduler") == scheduler
        assert "Traceback" not in server.log_path.read_text(errors="replace"), last_traceback(server)
    finally:
        admin.close()
        server.stop()
