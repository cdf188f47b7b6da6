"""The server's side of `bench soak`: RSS per process of the server's tree, and the
scheduler's own counts through its admin socket (leaked blocks, live requests, steps)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from bench.live.server import children_of

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

def tree_pids(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children_of(p)
    return out


def role_of(argv: list[bytes], pid: int) -> str:
    """`worker` for `python -m services.cli worker ...`; the pid for anything else."""
    if b"services.cli" in argv[:-1]:
        return argv[argv.index(b"services.cli") + 1].decode(errors="replace")
    return str(pid)


def rss_by_process(pid: int | None) -> dict[str, float]:
    """Resident memory of each process of a tree, MiB, by role (shared pages count once
    per process)."""
    out: dict[str, float] = {}
    for p in tree_pids(pid) if pid is not None else []:
        try:
            pages = int(Path(f"/proc/{p}/statm").read_text().split()[1])
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        role = role_of(argv, p)
        out[role if role not in out else f"{role}:{p}"] = pages * PAGE_BYTES / (1 << 20)
    return out


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process tree, MiB."""
    return None if pid is None else sum(rss_by_process(pid).values())


def admin_stats(addr: str):
    from services.admin_cli import AdminClient
    from shared import protocol as p

    client = AdminClient(addr, timeout_s=10.0)
    try:
        return client.ask(p.StatsQuery())
    finally:
        client.close()


def idle_state(reply) -> tuple[int, int]:
    """(live requests, KV blocks in use) from a StatsReply."""
    st = reply.stats
    used = st.num_hbm_blocks - st.num_free_hbm_blocks + st.num_dram_blocks - st.num_free_dram_blocks
    return st.num_running + st.num_waiting + st.num_rotary, used


async def wait_idle(addr: str, timeout_s: float, settle_s: float = 5.0):
    """Poll until nothing is live and no block is used, or nothing has been live for
    `settle_s` (blocks still used then are leaked), or `timeout_s`. The last reply."""
    deadline, idle_since = time.monotonic() + timeout_s, None
    while True:
        reply = await asyncio.to_thread(admin_stats, addr)
        live, used = idle_state(reply)
        now = time.monotonic()
        idle_since = (idle_since or now) if live == 0 else None
        if (live == 0 and used == 0) or (idle_since and now - idle_since >= settle_s) or now >= deadline:
            return reply
        await asyncio.sleep(0.5)


def scheduler_delta(before, after) -> dict:
    a, b = after.stats, before.stats
    return {
        "finished": after.num_finished - before.num_finished,
        "aborted": after.num_aborted - before.num_aborted,
        "preemptions": a.num_preemptions - b.num_preemptions,
        "rotations_out": a.num_rotations_out - b.num_rotations_out,
        "rotations_in": a.num_rotations_in - b.num_rotations_in,
    }
