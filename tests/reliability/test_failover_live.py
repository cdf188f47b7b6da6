"""A request is not failed because a replacement worker is still loading: the scheduler and the
worker of a live `superinfer serve` die together; the gateway's failover grace (3 s here) is
shorter than the worker's restart, and every stream still completes, identical to an
undisturbed run — the restarted scheduler holds the resubmissions until its worker is ready."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from bench.live.server import start_server, wait_for
from tests.reliability.live import PROMPTS, child_by_role, client_for, stream_all

GRACE_S = 3.0


@pytest.mark.slow
def test_streams_outlive_a_failover_grace_shorter_than_the_worker_restart(tmp_path):
    server = start_server(tmp_path, "--failover-grace", str(GRACE_S))
    try:
        client = client_for(server)
        scheduler = child_by_role(server.proc.pid, "scheduler")
        worker = child_by_role(server.proc.pid, "worker")
        assert scheduler and worker, server.log_tail()

        async def scenario():
            reference = await stream_all(client, server.model, [])
            token_times: list[float] = []
            run = asyncio.create_task(stream_all(client, server.model, token_times))
            while len(token_times) < len(PROMPTS) * 12 and not run.done():
                await asyncio.sleep(0.01)
            killed_at = time.monotonic()
            os.kill(worker, signal.SIGKILL)
            os.kill(scheduler, signal.SIGKILL)
            return reference, await run, killed_at, [t for t in token_times if t > killed_at + 0.05]

        reference, disturbed, killed_at, after = asyncio.run(scenario())
        assert after, "no token after the kills"
        print(f"kills -> first token {after[0] - killed_at:.2f}s (failover grace {GRACE_S:g}s)")
        assert disturbed == reference
        assert server.logged("request_resubmitted"), server.log_tail()
        assert not server.logged("none took it back"), server.log_tail()
        assert wait_for(lambda: server.scheduler_stats()["num_running"] == 0)
    finally:
        server.stop()
