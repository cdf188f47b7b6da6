"""`superinfer bench chaos`: load past capacity while processes are killed, frozen, made to
fail a step and cut off from each other, and check that nothing accepted is lost.

1. Start the server (chaos_rig.py): `superinfer serve`, or 2 gateways, 2 schedulers and 2
   workers (`--setup replicated`), the workers with `SUPERINFER_FAULTS=signals`.
2. Reference and capacity: every prompt of the pool once, greedy, `--clients` at a time; the
   texts are the undisturbed outputs, completed requests per second the capacity.
3. Chaos: Poisson arrivals at `--load` x capacity for `--duration` s, round-robin over the
   gateways, while a fault comes every `--every` s (uniform in [lo, hi]): its kind in turn
   (kill, stop, raise, cut, bad_plan, each kind once per round, in a seeded order, or those of
   `--kinds`; raise alternates a step that raises once and a request that raises until it is
   failed; bad_plan makes the worker receive a plan with an id or length out of range, which
   fails that step), on a seeded random target.
4. Every request ends as refused (429/503 before any token, or no gateway listening: never
   accepted), completed (every token, [DONE]) or failed (with the reason the client got);
   completed ones are compared with the reference text ("identical"). A request whose
   connection is cut after it was accepted (its gateway killed: no server keeps a TCP stream
   alive through its process's death) is retried from scratch as an OpenAI client retries a
   connection error (`--client-retries`, backoff 0.5 s doubling to 8 s), on the next gateway;
   it counts as accepted once, and completed ones that needed a retry are shown apart.
5. Time to recover, per fault, from its end (the kill, the SIGCONT, the reconnection), over
   the streams it stalled (open at its start, or sent before `--stall-s` after its end, and
   silent across it for over `--stall-s`):
   until the first of them flows again (the service is back: the headline p50/max), and until
   the last does. A stream counts for the fault that stalled it only up to the next fault's
   start: one still silent then (or failed) leaves the fault "unrecovered" (counted as
   infinitely slow in the p50/max, never dropped), and is the next fault's. 0 when it
   stalled none.
6. At idle, each scheduler's admin socket: live requests and KV blocks still in use (leaked),
   both must be 0; RSS of all server processes at the end within 5% of the start (after the
   reference phase, at idle).

    superinfer bench chaos --duration 600 --json bench/results/chaos_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import aiohttp

from bench.live import server
from bench.live.chaos_rig import Fault, ReplicatedRig, Rig, ServeRig
from bench.live.serve import request_body, send
from bench.live.chaos_verdict import Sent, classify, completed, goals, is_cut, refused, tally
from bench.live.soak import chunk_times, num
from bench.live.watch import idle_state, wait_idle
from bench.live.workload import WorkItem, arrival_times, sample_sharegpt, sharegpt_conversations
from bench.report.metrics import RequestRecord

KINDS = ("kill", "stop", "raise", "cut", "bad_plan")
RETRY_DELAY_S, MAX_RETRY_DELAY_S = 0.5, 8.0  # the OpenAI client's backoff


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setup", choices=["serve", "replicated"], default="serve")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load under faults (default %(default)s)")
    p.add_argument("--load", type=float, default=1.5, help="offered load, x capacity (default %(default)s)")
    p.add_argument("--capacity", type=float, default=None, help="req/s: use this, not the reference phase's")
    p.add_argument("--every", type=float, nargs=2, default=(30.0, 60.0), metavar=("LO", "HI"),
                   help="seconds between faults, uniform (default 30 60)")  # fmt: skip
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="faults to inject (default: all)")
    p.add_argument("--stop-s", type=float, default=8.0, help="how long a SIGSTOP lasts (default %(default)s)")
    p.add_argument("--cut-s", type=float, default=8.0, help="how long a gateway is cut off (default %(default)s)")
    p.add_argument("--stall-s", type=float, default=2.0, help="a stream silent this long was stalled by a fault")
    p.add_argument("--client-retries", type=int, default=5,
                   help="retries of a request whose connection was cut (default %(default)s)")  # fmt: skip
    p.add_argument("--clients", type=int, default=8, help="reference phase concurrency (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=32, help="ShareGPT prompts, cycled (default %(default)s)")
    p.add_argument("--max-prompt", type=int, default=256, help="longest prompt kept, tokens (default %(default)s)")
    p.add_argument("--max-output", type=int, default=48, help="output tokens per request (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-timeout", type=float, default=300.0, help="s for open requests to end after the load")
    p.add_argument("--idle-timeout", type=float, default=60.0)
    p.add_argument("--hbm-blocks", type=int, default=256)
    p.add_argument("--dram-gb", type=float, default=0.25)
    p.add_argument("--max-waiting", type=int, default=16)
    p.add_argument("--dtype", default=None, help="the worker's --dtype (default: its own)")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="s for the server to get ready (a busy host)")
    p.add_argument("--json", type=Path, default=None, help="default bench/results/chaos_<setup>.json")


# ---------------------------------------------------------------- the load


def retry_delay_s(num_retries: int, rng: random.Random) -> float:
    """Before retry number `num_retries` + 1, as the OpenAI client waits (with its jitter)."""
    return min(RETRY_DELAY_S * 2.0**num_retries, MAX_RETRY_DELAY_S) * (1.0 - 0.25 * rng.random())


async def one(session, urls: list[str], k: int, model: str, item: WorkItem, t0: float, texts: list[str],
              retries: int = 0) -> Sent:  # fmt: skip
    """Send `item` at its arrival time to gateway `k`; a connection cut under it is retried
    from scratch on the next gateway (texts of a cut attempt dropped)."""
    await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.perf_counter()))
    body, rng = request_body(model, item, True), random.Random(f"{k}-{item.arrival_s}")
    record = await send(session, urls[k % len(urls)] + "/v1/completions", body, item, t0, texts)
    first_start_s, num_retries = record.start_s, 0
    while num_retries < retries and not completed(record) and (num_retries or is_cut(record)):
        if not (is_cut(record) or refused(record)):
            break  # the server answered it (an error it reports): no client retries that
        await asyncio.sleep(retry_delay_s(num_retries, rng))
        num_retries += 1
        texts.clear()
        record = await send(session, urls[(k + num_retries) % len(urls)] + "/v1/completions", body, item, t0, texts)
    return Sent(record, num_retries, first_start_s, time.perf_counter() - t0)


async def reference_phase(session, rig: Rig, model: str, pool: list[WorkItem], clients: int) -> tuple[list[str], float]:
    """Each prompt once, `clients` at a time: (texts by pool index, completed req/s)."""
    texts: list[list[str]] = [[] for _ in pool]
    records: list[RequestRecord | None] = [None] * len(pool)
    todo = iter(range(len(pool)))
    t0 = time.perf_counter()

    async def client(c: int) -> None:
        for i in todo:
            item = replace(pool[i], arrival_s=0.0)
            records[i] = (await one(session, rig.urls, c, model, item, t0, texts[i])).record

    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed = time.perf_counter() - t0
    bad = [(i, r.error) for i, r in enumerate(records) if classify(r) != "completed"]
    if bad:
        raise SystemExit(f"superinfer bench chaos: the undisturbed reference run failed: {bad[:3]}")
    return ["".join(t) for t in texts], len(pool) / elapsed


async def fault_schedule(rig: Rig, args, t0: float, faults: list[Fault]) -> None:
    rng = random.Random(f"chaos-{args.seed}")
    at, order, num_raises = 0.0, [], 0
    running: list[asyncio.Task] = []
    while True:
        at += rng.uniform(*args.every)
        if at >= args.duration:
            break
        if not order:
            order = rng.sample(list(args.kinds), len(args.kinds))
        kind = order.pop()
        if kind == "raise":
            kind, num_raises = ("raise_step", "raise_request")[num_raises % 2], num_raises + 1
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        fault = Fault(kind, rig.pick(kind, rng), time.perf_counter() - t0)
        faults.append(fault)
        print(f"{fault.start_s:7.1f} s: fault {kind} on {fault.target}", file=sys.stderr, flush=True)
        running.append(asyncio.create_task(rig.inject(fault, t0, args.stop_s, args.cut_s)))
    await asyncio.gather(*running)


async def chaos_phase(session, rig: Rig, model: str, pool: list[WorkItem], rate: float, args):
    n = max(1, int(rate * args.duration * 1.5) + 16)
    times = [t for t in arrival_times(n, rate, seed=args.seed) if t < args.duration]
    items = [replace(pool[i % len(pool)], arrival_s=t) for i, t in enumerate(times)]
    texts: list[list[str]] = [[] for _ in items]
    faults: list[Fault] = []
    t0 = time.perf_counter()
    print(f"chaos: {rate:.3f} req/s for {args.duration:g} s ({len(items)} requests)", file=sys.stderr, flush=True)
    tasks = [asyncio.create_task(one(session, rig.urls, i, model, it, t0, texts[i], args.client_retries))
             for i, it in enumerate(items)]  # fmt: skip
    tender = asyncio.create_task(rig.tend())
    await fault_schedule(rig, args, t0, faults)
    done, pending = await asyncio.wait(tasks, timeout=max(1.0, t0 + args.duration - time.perf_counter())
                                       + args.drain_timeout)  # fmt: skip
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    end_s = time.perf_counter() - t0
    sent = [task.result() if task in done else Sent(
        RequestRecord(False, prompt_tokens=item.prompt_tokens, arrival_s=item.arrival_s,
                      expected_output_tokens=item.output_tokens, error="still open after the drain timeout"),
        first_start_s=item.arrival_s, end_s=end_s) for task, item in zip(tasks, items, strict=True)]  # fmt: skip
    await asyncio.sleep(5.0)  # a last restart settles before the idle checks
    tender.cancel()
    return items, sent, ["".join(t) for t in texts], faults, end_s


async def idle_checks(rig: Rig, timeout_s: float) -> tuple[int, int]:
    live = leaked = 0
    for addr in rig.admins:
        reply = await wait_idle(addr, timeout_s)
        n, used = idle_state(reply)
        live, leaked = live + n, leaked + used
    return live, leaked


async def chaos(rig: Rig, model: str, pool: list[WorkItem], args) -> dict:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        print(f"reference: {len(pool)} prompts, {args.clients} at a time", file=sys.stderr, flush=True)
        reference, measured = await reference_phase(session, rig, model, pool, args.clients)
        capacity = args.capacity or measured
        await idle_checks(rig, args.idle_timeout)
        rss_start = rig.rss()
        items, sent, texts, faults, end_s = await chaos_phase(session, rig, model, pool, args.load * capacity, args)
    live, leaked = await idle_checks(rig, args.idle_timeout)
    rss_end = rig.rss()
    # A process restarted by a fault is a new process: memory is compared over those that lived through.
    kept = rss_start.keys() & rss_end.keys()
    start_mb, end_mb = sum(rss_start[k] for k in kept), sum(rss_end[k] for k in kept)
    pool_index = [i % len(pool) for i in range(len(items))]
    result = {
        "setup": args.setup,
        "capacity_req_s": capacity,
        "measured_capacity_req_s": measured,
        "offered_req_s": args.load * capacity,
        "duration_s": args.duration,
        **tally(items, sent, texts, reference, pool_index, faults, args.stall_s, end_s),
        # Each request as the client saw it: first sent, ended, retries, its last attempt's chunks (s).
        "timeline": [[round(s.first_start_s, 2), round(s.end_s, 2), s.num_retries,
                      [round(t, 2) for t in chunk_times(s.record)]] for s in sent],  # fmt: skip
        "leaked_blocks": leaked,
        "live_requests_at_idle": live,
        "rss_start_mb": start_mb,
        "rss_end_mb": end_mb,
        "rss_growth_pct": 100.0 * (end_mb - start_mb) / start_mb if start_mb else None,
        "rss_processes_restarted": sorted(rss_start.keys() - kept),
        "rss_start_by_process_mb": rss_start,
        "rss_end_by_process_mb": rss_end,
    }
    return {**result, "goals": goals(result)}


def sample_pool(args) -> list[WorkItem]:
    from shared.modelfile import resolve_model_path
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(None))
    pool = sample_sharegpt(sharegpt_conversations(), args.num_prompts * 8, tokenizer, args.seed)
    short = [replace(i, output_tokens=args.max_output) for i in pool if i.prompt_tokens <= args.max_prompt]
    return short[: args.num_prompts]


def run(args: argparse.Namespace) -> int:
    from shared.modelfile import default_model_path, read_model_config

    pool = sample_pool(args)
    model = read_model_config(default_model_path()).name
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix=f"superinfer-chaos-{args.setup}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}", file=sys.stderr)
    worker = ["--hbm-blocks", str(args.hbm_blocks), "--dram-gb", str(args.dram_gb), "--kv-prefault"]
    worker += ["--dtype", args.dtype] if args.dtype else []
    sched = ["--max-waiting", str(args.max_waiting)]

    server.STARTUP_TIMEOUT_S = args.startup_timeout

    async def main() -> dict:
        if args.setup == "serve":
            rig = await asyncio.to_thread(ServeRig, log_dir, worker + sched)
        else:
            rig = ReplicatedRig(log_dir, worker, sched)
            await rig.start(args.startup_timeout)
        try:
            return await chaos(rig, model, pool, args)
        finally:
            await asyncio.to_thread(rig.stop)

    result = asyncio.run(main())
    result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)}
    print(format_result(result))
    path = args.json or Path(f"bench/results/chaos_{args.setup}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return 0 if all(result["goals"].values()) else 1


def format_result(r: dict) -> str:
    """The console table."""
    acc = max(1, r["accepted"])
    lines = [
        f"setup       {r['setup']}: {num(r['offered_req_s'], '.3f')} req/s = {r['config']['load']:g} x capacity "
        f"{num(r['capacity_req_s'], '.3f')} req/s, for {r['duration_s']:g} s",
        "faults      " + "  ".join(f"{k} {n}" for k, n in sorted(r["faults_by_kind"].items())),
        f"requests    sent {r['sent']}  accepted {r['accepted']}  completed {r['completed']} "
        f"({100.0 * r['completed'] / acc:.1f}%; {r['completed_after_client_retry']} of them after a client retry: "
        f"their gateway was killed)  failed {r['failed']}  refused {r['refused']}",
        f"identical   {r['identical']} of {r['completed']} completed (greedy, vs the undisturbed run)",
        f"recovery s  first stalled stream flowing again: p50 {num(r['recovery_p50_s'], '.2f')}  "
        f"max {num(r['recovery_max_s'], '.2f')}  (n/a: unrecovered before the next fault; {r['faults_unrecovered']} "
        f"faults);  all of them: p50 {num(r['recovery_all_p50_s'], '.2f')}  max {num(r['recovery_all_max_s'], '.2f')}",
        "  by fault  " + "  ".join(f"{k} {num(v['first_s'], '.1f')}/{num(v['all_s'], '.1f')} ({v['stalled']} stalled)"
                                   for k, v in r["recovery"].items()),  # fmt: skip
        f"at idle     leaked blocks {r['leaked_blocks']}  live requests {r['live_requests_at_idle']}",
        f"rss MiB     start {num(r['rss_start_mb'])}  end {num(r['rss_end_mb'])}  growth {num(r['rss_growth_pct'], '.2f')}% "
        f"(processes that lived through; restarted: {', '.join(r['rss_processes_restarted']) or 'none'})",
        "goals       " + "  ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in r["goals"].items()),
    ]
    lines += [f"failed      {n} x {why}" for why, n in r["failures"].items()]
    lines += [f"refused     {n} x {why}" for why, n in r["refusals"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="superinfer bench chaos", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
