"""`superinfer serve` as an operator sees it: it stops cleanly, and a dead child is not hidden."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from bench.live import start_server


def children_of(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


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
    rc = server.proc.wait(timeout=10)
    elapsed = time.monotonic() - t0
    assert elapsed < 5.0, f"took {elapsed:.1f}s\n{server.log_tail()}"
    assert rc == 0
    assert not any(alive(k) for k in kids)


def test_dead_child_is_reported_and_the_rest_shut_down(tmp_path):
    server = start_server(tmp_path)
    kids = children_of(server.proc.pid)
    worker = next(k for k in kids if b" worker " in Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" "))
    os.kill(worker, signal.SIGKILL)
    rc = server.proc.wait(timeout=15)
    assert rc != 0
    assert "child exited" in server.log_tail()
    assert not any(alive(k) for k in kids)
