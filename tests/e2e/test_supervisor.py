"""`superinfer serve` as an operator sees it: it stops cleanly, and a dead worker or
gateway is restarted (the scheduler's restart is tests/reliability/test_live_faults.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from bench.live.server import start_server, wait_for
from services.supervisor import HUNG_KILL_S
from tests.reliability.live import children_of


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_all_three_within_5s(tmp_path):
    server = start_server(tmp_path)
    kids = children_of(server.proc.pid)
    assert len(kids) == 3, server.log_tail()
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        rc = server.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        for pid in [*kids, server.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"still running 10 s after SIGTERM\n{server.log_tail()}")
    elapsed = time.monotonic() - t0
    assert elapsed < 5.0, f"took {elapsed:.1f}s\n{server.log_tail()}"
    assert rc == 0
    assert not any(alive(k) for k in kids)


def role_of(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return next(r for r in ("gateway", "scheduler", "worker") if r.encode() in argv)


def test_dead_worker_is_restarted_and_the_server_serves_again(tmp_path):
    server = start_server(tmp_path)
    try:
        kids = {role_of(k): k for k in children_of(server.proc.pid)}
        os.kill(kids["worker"], signal.SIGKILL)
        assert wait_for(lambda: server.logged("restarting it"), timeout=10), server.log_tail()
        assert _complete(server)["usage"]["completion_tokens"] == 4, server.log_tail()
        now = {role_of(k): k for k in children_of(server.proc.pid)}
        assert now["worker"] != kids["worker"]
        assert (now["gateway"], now["scheduler"]) == (kids["gateway"], kids["scheduler"])
        assert server.proc.poll() is None
    finally:
        assert server.stop() == 0


def test_dead_gateway_is_restarted_and_leaves_no_orphans(tmp_path):
    """A long request is running when its gateway is killed: the new gateway serves, and
    the scheduler aborts the dead gateway's request once that gateway stays silent."""
    server = start_server(tmp_path)
    try:
        kids = {role_of(k): k for k in children_of(server.proc.pid)}
        body = {"model": server.model, "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(
            server.base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        stream = urllib.request.urlopen(req, timeout=30)
        stream.readline()  # tokens are flowing
        # the stats are the scheduler's latest report, which may predate the first step
        assert wait_for(lambda: server.scheduler_stats()["num_running"] == 1, timeout=10), server.log_tail()
        os.kill(kids["gateway"], signal.SIGKILL)
        stream.close()
        assert wait_for(lambda: server.logged("restarting it"), timeout=10), server.log_tail()
        assert wait_for(server.healthy, timeout=60), server.log_tail()
        assert _complete(server)["usage"]["completion_tokens"] == 4, server.log_tail()
        assert wait_for(lambda: server.scheduler_stats()["num_running"] == 0, timeout=15), server.log_tail()
        assert server.logged("gateway gone; aborting its requests"), server.log_tail()
        now = {role_of(k): k for k in children_of(server.proc.pid)}
        assert now["gateway"] != kids["gateway"]
        assert (now["worker"], now["scheduler"]) == (kids["worker"], kids["scheduler"])
    finally:
        assert server.stop() == 0


def test_hung_worker_is_killed_and_replaced(tmp_path):
    """A stopped (SIGSTOP) worker mid-stream: the scheduler declares it lost, the supervisor
    sees the worker it started stay unready, kills it and starts another, which serves."""
    server = start_server(tmp_path)
    try:
        kids = {role_of(k): k for k in children_of(server.proc.pid)}
        ready_id = server.scheduler_stats()["worker_id"]
        assert ready_id in Path(f"/proc/{kids['worker']}/cmdline").read_bytes().decode(errors="replace")
        body = {"model": server.model, "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(
            server.base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as stream:
            stream.readline()  # tokens are flowing
            os.kill(kids["worker"], signal.SIGSTOP)
            assert wait_for(lambda: server.logged("worker hung"), timeout=30), server.log_tail()
        assert wait_for(lambda: not alive(kids["worker"]), timeout=10)
        assert wait_for(server.healthy, timeout=60), server.log_tail()  # until then: 503 + Retry-After
        assert _complete(server)["usage"]["completion_tokens"] == 4, server.log_tail()
        now = {role_of(k): k for k in children_of(server.proc.pid)}
        assert now["worker"] != kids["worker"]
        assert server.scheduler_stats()["worker_id"] not in ("", ready_id)
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_a_frozen_scheduler_does_not_get_the_worker_killed(tmp_path):
    """While the scheduler is stopped the gateway reports no ready worker, which is no news
    about the worker: the supervisor keeps it. Thawed, the scheduler resets the worker it lost
    track of (its step overdue by the clock) and the server serves again, same processes."""
    server = start_server(tmp_path)
    try:
        kids = {role_of(k): k for k in children_of(server.proc.pid)}
        assert _complete(server)["usage"]["completion_tokens"] == 4
        os.kill(kids["scheduler"], signal.SIGSTOP)
        time.sleep(5.0 + 2 * HUNG_KILL_S)  # the gateway's staleness, then the watch's limit twice
        os.kill(kids["scheduler"], signal.SIGCONT)
        assert wait_for(server.healthy, timeout=60), server.log_tail()
        assert _complete(server)["usage"]["completion_tokens"] == 4, server.log_tail()
        assert not server.logged("worker hung"), server.log_tail()
        assert {role_of(k): k for k in children_of(server.proc.pid)} == kids
    finally:
        assert server.stop() == 0


def _complete(server) -> dict:
    """One small completion; it waits at the scheduler while the new worker loads."""
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        server.base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())
