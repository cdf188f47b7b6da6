"""The served worker's compute threads: one OpenMP thread per core, each kept on its core."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.live.server import children_of


def cpus_allowed(pid: int, tid: str) -> str:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no threads to keep apart")
def test_the_workers_compute_threads_each_keep_to_their_own_core(server):
    services = children_of(server.proc.pid)
    (worker,) = [p for p in services if b"\0worker\0" in Path(f"/proc/{p}/cmdline").read_bytes()]
    allowed = [cpus_allowed(worker, tid) for tid in os.listdir(f"/proc/{worker}/task")]
    bound = [a for a in allowed if a.isdigit()]  # threads allowed on a single CPU
    # at least two threads, on two different cores; the service's other threads float
    assert len(set(bound)) >= 2, allowed
    others = [p for p in services if p != worker]  # gateway and scheduler
    assert others and all(not cpus_allowed(p, str(p)).isdigit() for p in others)
