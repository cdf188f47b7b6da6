"""`superinfer bench soak`: overload the live server for a long while and check that it
stays whole: nothing it accepted is lost, no KV block outlives its request, memory is flat.

1. Start `superinfer serve` on loopback with bounded admission (`--max-waiting`: overload
   yields 429s, not an unbounded queue) and an HBM pool small enough that requests rotate;
   or soak a running server (`--url`, `--admin`, `--server-pid` for the RSS figures).
2. Capacity: a closed loop of `--clients` streams over the same ShareGPT sample. Output
   tokens/s after its first seconds, over the sample's mean output length, is the capacity
   in requests/s (robust to a short window, where few requests complete).
3. Warm-up: `--warmup-s` of the soak's own load, then idle. The RSS baseline is taken
   here, once every process has seen the overload's high water (allocator arenas), so that
   growth after it means a leak. The server it starts writes its KV pools at start
   (`--kv-prefault`): otherwise their pages count in RSS as rotation first touches them.
4. Soak: Poisson arrivals at `--load` x capacity for `--duration` s. A seeded
   `--disconnect-frac` of requests hang up: half before their first token (after a random
   wait of up to `--patience` s, or on the answer if it comes first), half after k tokens.
5. Every request ends as rejected (429/503 with Retry-After), completed (finish_reason,
   [DONE], every token), disconnected (by us) or failed (anything else); accepted is all
   but rejected. A request we left before any answer counts as accepted: it was not refused.
6. At idle, from the scheduler's admin socket: blocks still used with no request live
   (leaked) and live requests, both must be 0; RSS of the server's process tree must have
   grown by less than 5% since the baseline. The exit status says whether all goals hold.

    superinfer bench soak --duration 600 --json bench/results/soak_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import aiohttp

from bench.live.outcomes import KINDS, Outcome, attempt, classify, failure_reason, new_outcome, plan_hangups
from bench.live.serve import first_model, request_body
from bench.live.server import free_port, start_server
from bench.live.watch import idle_state, rss_by_process, rss_mb, scheduler_delta, wait_idle
from bench.live.workload import WorkItem, arrival_times, sample_sharegpt, sharegpt_conversations
from bench.report.metrics import RequestRecord, percentiles_ms
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE

RSS_GOAL_PCT = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=600.0, help="seconds of open-loop load (default %(default)s)")
    p.add_argument("--load", type=float, default=1.5, help="offered load, x capacity (default %(default)s)")
    p.add_argument("--capacity", type=float, default=None, help="req/s; skips the capacity phase")
    p.add_argument("--capacity-s", type=float, default=45.0, help="closed-loop phase, seconds (default %(default)s)")
    p.add_argument("--capacity-skip-s", type=float, default=15.0, help="its first seconds, not counted")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=300.0,
        help="open-loop warm-up at the soak's load before the RSS baseline (default %(default)s: "
        "the worker's allocator reaches its high-water mark within the first minutes)",
    )
    p.add_argument("--clients", type=int, default=16, help="closed-loop streams (default %(default)s)")
    p.add_argument("--disconnect-frac", type=float, default=0.1, help="share that hangs up (default %(default)s)")
    p.add_argument("--patience", type=float, default=5.0, help="longest wait before an early hang-up, s")
    p.add_argument("--num-prompts", type=int, default=1000, help="ShareGPT sample size, cycled (default %(default)s)")
    p.add_argument("--max-output", type=int, default=256, help="clip outputs to this many tokens; 0 = no clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-timeout", type=float, default=900.0, help="s for accepted requests to end after the load")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="s for the scheduler to go idle after that")
    p.add_argument("--json", type=Path, default=Path("bench/results/soak_cpu.json"))
    g = p.add_argument_group("server started here (without --url)")
    g.add_argument("--hbm-blocks", type=int, default=256, help="HBM pool, 16-token blocks (default %(default)s)")
    g.add_argument("--dram-gb", type=float, default=0.25, help="DRAM pool in GiB (default %(default)s)")
    g.add_argument("--max-waiting", type=int, default=16, help="admission bound (default %(default)s)")
    g.add_argument("--policy", default="lvf")
    g.add_argument("--log-dir", type=Path, default=None, help="server log folder (default: a new temp folder)")
    g = p.add_argument_group("a running server")
    g.add_argument("--url", default=None, help="soak this server instead of starting one")
    g.add_argument("--admin", default=None, help="its scheduler's admin address")
    g.add_argument("--server-pid", type=int, default=None, help="its `superinfer serve` pid, for RSS")


# ---------------------------------------------------------------- phases


async def closed_loop(session, url: str, model: str, pool: list[WorkItem], args) -> list[Outcome]:
    """`args.clients` streams back to back for `args.capacity_s`; then every one still
    open hangs up (so the soak starts on an empty server)."""
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()

    async def client(i: int) -> None:
        for j in range(i, 1 << 30, args.clients):
            out = new_outcome(pool[j % len(pool)])
            outcomes.append(out)
            await attempt(session, url, request_body(model, pool[j % len(pool)], True), out, t0)
            if classify(out) == "rejected":
                await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(client(i)) for i in range(args.clients)]
    await asyncio.sleep(args.capacity_s)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


def chunk_times(r: RequestRecord) -> list[float]:
    """When each streamed chunk arrived, in seconds from the phase's start."""
    if r.ttft_s is None:
        return []
    times = [r.start_s + r.ttft_s]
    for gap in r.tbt_s:
        times.append(times[-1] + gap)
    return times


def capacity_from(outcomes: list[Outcome], pool: list[WorkItem], skip_s: float, end_s: float) -> dict:
    """Output tokens/s in [skip_s, end_s] over the sample's mean output length."""
    span = max(end_s - skip_s, 1e-9)
    chunks = sum(skip_s <= t <= end_s for o in outcomes for t in chunk_times(o.record))
    finished = sum(o.record.ok and skip_s <= o.record.start_s + (o.record.e2e_s or 0) <= end_s for o in outcomes)
    mean_out = sum(i.output_tokens for i in pool) / len(pool)
    tok_s = chunks / span
    return {"output_tok_s": tok_s, "completed_req_s": finished / span, "capacity_req_s": tok_s / mean_out}


async def open_loop(session, url: str, model: str, items: list[WorkItem], hangups, args, watch) -> list[Outcome]:
    """Send each item at its arrival time; wait (up to the drain timeout) for all to end."""
    outcomes = [new_outcome(item, h) for item, h in zip(items, hangups, strict=True)]
    t0 = time.perf_counter()

    async def one(item: WorkItem, out: Outcome) -> None:
        await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.perf_counter()))
        await attempt(session, url, request_body(model, item, True), out, t0)

    tasks = [asyncio.create_task(one(i, o)) for i, o in zip(items, outcomes, strict=True)]
    watch.outcomes, watch.t0 = outcomes, t0
    last = items[-1].arrival_s if items else 0.0
    _, pending = await asyncio.wait(tasks, timeout=last + args.drain_timeout) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for o, t in zip(outcomes, tasks, strict=True):
        o.unfinished = t in pending
    watch.outcomes = []
    return outcomes


# ---------------------------------------------------------------- the run


class Watch:
    """The server's RSS every second (for the peak); a progress line every `every_s`
    while the open loop runs."""

    def __init__(self, pid: int | None, every_s: float = 10.0) -> None:
        self.pid, self.every_s, self.peak_mb = pid, every_s, None
        self.samples: list[tuple[float, float]] = []  # (perf_counter, MiB)
        self.outcomes: list[Outcome] = []
        self.t0 = 0.0

    async def run(self) -> None:
        shown = time.perf_counter()
        while True:
            mb = await asyncio.to_thread(rss_mb, self.pid)
            self.peak_mb = max(self.peak_mb or 0.0, mb) if mb is not None else None
            now = time.perf_counter()
            if mb is not None:
                self.samples.append((now, mb))
            if self.outcomes and now - shown >= self.every_s:
                shown = now
                print(self.line(now - self.t0, mb), file=sys.stderr, flush=True)
            await asyncio.sleep(1.0)

    def line(self, elapsed: float, mb: float | None) -> str:
        sent = sum(o.record.arrival_s <= elapsed for o in self.outcomes)
        ended = [o for o in self.outcomes if o.ended]
        kinds = Counter(classify(o) for o in ended)
        rss = "" if mb is None else f", rss {mb:.0f} MiB"
        return f"{elapsed:6.0f} s: sent {sent}, open {sent - len(ended)}, " + ", ".join(
            f"{k} {kinds.get(k, 0)}" for k in KINDS
        ) + rss


def tally(outcomes: list[Outcome]) -> dict:
    """Counts by kind, failure reasons, and TTFT/TBT of the completed requests (pure)."""
    kinds = [(o, classify(o)) for o in outcomes]
    counts = Counter(k for _, k in kinds)
    done = [o.record for o, k in kinds if k == "completed"]
    return {
        "sent": len(outcomes),
        "accepted": len(outcomes) - counts["rejected"],
        **{k: counts[k] for k in KINDS},
        "disconnected_before_first_token": sum(k == "disconnected" and o.num_chunks == 0 for o, k in kinds),
        "failures": dict(Counter(failure_reason(o) for o, k in kinds if k == "failed")),
        **percentiles_ms([r.ttft_s for r in done if r.ttft_s is not None], "ttft"),
        **percentiles_ms([g for r in done for g in r.tbt_s], "tbt"),
    }


def goals(r: dict) -> dict[str, bool]:
    growth = r["rss_growth_pct"]
    return {
        "nothing accepted lost": r["failed"] == 0
        and r["accepted"] == r["completed"] + r["disconnected"]
        and r["warmup"]["failed"] == 0,
        "zero leaked blocks": r["leaked_blocks"] == 0 and r["live_requests_at_idle"] == 0,
        f"RSS growth < {RSS_GOAL_PCT:g}%": growth is None or growth < RSS_GOAL_PCT,
    }


def soak_items(pool: list[WorkItem], rate: float, duration_s: float, seed: int) -> list[WorkItem]:
    """Poisson arrivals in [0, duration_s), cycling through the pool."""
    n = math.ceil(rate * duration_s) + 16
    while (times := arrival_times(n, rate, seed=seed))[-1] < duration_s:
        n *= 2
    return [replace(pool[i % len(pool)], arrival_s=t) for i, t in enumerate(t for t in times if t < duration_s)]


async def measure_capacity(session, url: str, model: str, pool: list[WorkItem], args) -> dict:
    if args.capacity is not None:
        return {"capacity_req_s": args.capacity}
    print(f"capacity: {args.clients} closed-loop clients for {args.capacity_s:g} s", file=sys.stderr)
    outcomes = await closed_loop(session, url, model, pool, args)
    capacity = capacity_from(outcomes, pool, args.capacity_skip_s, args.capacity_s)
    if capacity["capacity_req_s"] <= 0:
        raise SystemExit(f"superinfer bench soak: no capacity measured ({capacity})")
    return capacity


async def open_phase(session, url, model, pool, rate: float, duration_s: float, seed: int, args, watch, name: str):
    """Poisson arrivals at `rate` for `duration_s`, a seeded share hanging up."""
    items = soak_items(pool, rate, duration_s, seed) if duration_s > 0 else []
    print(f"{name}: {rate:.3f} req/s for {duration_s:g} s ({len(items)} requests)", file=sys.stderr, flush=True)
    hangups = plan_hangups(items, args.disconnect_frac, args.patience, seed)
    return await open_loop(session, url, model, items, hangups, args, watch)


async def soak(url: str, model: str, pool: list[WorkItem], args, pid: int | None, admin: str) -> dict:
    """Capacity, warm-up at the soak's load, idle (RSS baseline), soak, idle (the checks)."""
    url = url.rstrip("/") + "/v1/completions"
    watch = Watch(pid)
    watcher = asyncio.create_task(watch.run())
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        capacity = await measure_capacity(session, url, model, pool, args)
        rate = args.load * capacity["capacity_req_s"]
        warm = await open_phase(session, url, model, pool, rate, args.warmup_s, args.seed + 1, args, watch, "warm-up")
        before = await wait_idle(admin, args.idle_timeout)
        rss_start = rss_by_process(pid)
        second_half = time.perf_counter() + args.duration / 2
        outcomes = await open_phase(session, url, model, pool, rate, args.duration, args.seed, args, watch, "soak")
    after = await wait_idle(admin, args.idle_timeout)
    rss_end = rss_by_process(pid)
    watcher.cancel()
    live, leaked = idle_state(after)
    start_mb, end_mb = (sum(r.values()) if r else None for r in (rss_start, rss_end))
    # A leak keeps growing; an allocator's high-water mark levels off: the second half tells them apart.
    late = [mb for t, mb in watch.samples if t >= second_half]
    peaks = [v for v in (watch.peak_mb, start_mb, end_mb) if v is not None]
    result = {
        **capacity,
        "offered_req_s": rate,
        "duration_s": args.duration,
        **tally(outcomes),
        "warmup": {k: v for k, v in tally(warm).items() if not k.endswith("_ms")},
        "leaked_blocks": leaked,
        "live_requests_at_idle": live,
        "rss_start_mb": start_mb,
        "rss_end_mb": end_mb,
        "rss_peak_mb": max(peaks) if peaks else None,
        "rss_growth_pct": None if start_mb is None else 100.0 * (end_mb - start_mb) / start_mb,
        "rss_second_half_growth_pct": 100.0 * (late[-1] - late[0]) / late[0] if len(late) > 1 else None,
        "rss_start_by_process_mb": rss_start,
        "rss_end_by_process_mb": rss_end,
        "scheduler": scheduler_delta(before, after),
    }
    return {**result, "goals": goals(result)}


def sample_pool(args) -> list[WorkItem]:
    from shared.tokenizer import load_tokenizer
    from shared.modelfile import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    pool = sample_sharegpt(sharegpt_conversations(), args.num_prompts, tokenizer, args.seed)
    cap = args.max_output or None
    return [replace(i, output_tokens=min(i.output_tokens, cap or i.output_tokens)) for i in pool]


def server_flags(args, admin: str) -> list[str]:
    return [
        "--hbm-blocks", str(args.hbm_blocks), "--dram-gb", str(args.dram_gb), "--kv-prefault",
        "--max-waiting", str(args.max_waiting), "--policy", args.policy, "--admin-bind", admin,
    ]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from shared.config import DEFAULT_ADMIN_ADDR

    pool = sample_pool(args)
    largest = max(i.prompt_tokens + i.output_tokens for i in pool)
    if args.url is None and largest > args.hbm_blocks * BLOCK_SIZE:
        print(f"--hbm-blocks {args.hbm_blocks} cannot hold a {largest}-token request", file=sys.stderr)
        return 2
    server = None
    if args.url is None:
        admin = f"tcp://127.0.0.1:{free_port()}"
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="superinfer-soak-"))
        server = start_server(log_dir, *server_flags(args, admin))
        url, model, pid = server.base_url, server.model, server.proc.pid
        print(f"server log: {server.log_path}", file=sys.stderr)
    else:
        url, model, pid = args.url, first_model(args.url, None), args.server_pid
        admin = args.admin or DEFAULT_ADMIN_ADDR
    try:
        result = asyncio.run(soak(url, model, pool, args, pid, admin))
    finally:
        if server is not None:
            server.stop()
    result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)}
    print(format_result(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if all(result["goals"].values()) else 1


def num(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def format_result(r: dict) -> str:
    """The console table."""
    sched, w = r["scheduler"], r["warmup"]
    start, end = r["rss_start_by_process_mb"], r["rss_end_by_process_mb"]
    by_process = "  ".join(f"{k} {num(start.get(k))} -> {num(v)}" for k, v in end.items())
    lines = [
        f"load        {num(r['offered_req_s'], '.3f')} req/s = {r['config']['load']:g} x capacity "
        f"{num(r['capacity_req_s'], '.3f')} req/s, for {r['duration_s']:g} s",
        f"requests    sent {r['sent']}  accepted {r['accepted']}  completed {r['completed']}  "
        f"disconnected {r['disconnected']} ({r['disconnected_before_first_token']} before the first token)  "
        f"failed {r['failed']}  rejected {r['rejected']}",
        f"scheduler   finished {sched['finished']}  aborted {sched['aborted']}  "
        f"preemptions {sched['preemptions']}  rotations out {sched['rotations_out']} in {sched['rotations_in']}",
        f"warm-up     sent {w['sent']}  accepted {w['accepted']}  completed {w['completed']}  "
        f"disconnected {w['disconnected']}  failed {w['failed']}  rejected {w['rejected']}  (before the RSS baseline)",
        f"at idle     leaked blocks {r['leaked_blocks']}  live requests {r['live_requests_at_idle']}",
        f"rss MiB     start {num(r['rss_start_mb'])}  end {num(r['rss_end_mb'])}  "
        f"growth {num(r['rss_growth_pct'], '.2f')}% (second half of the soak "
        f"{num(r.get('rss_second_half_growth_pct'), '.2f')}%)  peak {num(r['rss_peak_mb'])}",
        f"rss by proc {by_process}",
        f"latency ms  TTFT p50 {num(r['ttft_p50_ms'])} p99 {num(r['ttft_p99_ms'])}  "
        f"TBT p50 {num(r['tbt_p50_ms'])} p99 {num(r['tbt_p99_ms'])}  (completed requests)",
        "goals       " + "  ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in r["goals"].items()),
    ]
    lines += [f"failure     {n} x {reason}" for reason, n in r["failures"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="superinfer bench soak", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
