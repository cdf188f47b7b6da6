"""`superinfer bench sched`: the time of one LVF scheduling step vs the number of live
requests, under memory pressure.

HBM holds a few dozen requests' KV; the rest wait or sit rotated out in DRAM, so every
step runs the LVF path (admission by VLT, displacement, eager mirrors). Only
`SchedulerCore.schedule` is timed; `update` feeds one token per sampling request, and a
finished request is replaced at once so the live count stays N. The clock advances 50 ms
per step, so waiting requests start to lag after beta_F * S_F and rotation sets in.

`median_ms`/`p99_ms` are wall time; `median_cpu_ms`/`p99_cpu_ms` are the thread's CPU time
for the same calls, which a busy machine does not inflate (a descheduled step shows up
in the wall p99 as one kernel tick, ~4 ms).

    superinfer bench sched --requests 100,1000,4000 --json bench/results/sched.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from services.scheduler.core import SchedulerConfig, SchedulerCore
from services.scheduler.core.step import sampling
from shared.protocol import AddRequest, SamplingParams, StepResult

STEP_S = 0.05  # virtual time per step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", default="1000", help="live requests, or a comma list (e.g. 100,1000,4000)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps (>= 50)")
    parser.add_argument("--warmup", type=int, default=200, help="steps before timing starts")
    parser.add_argument("--hbm-blocks", type=int, default=1024, help="HBM blocks (16 tokens each)")
    parser.add_argument("--policy", default="lvf", help="lvf | fcfs | sf | wf")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")


def _new_request(rng: random.Random, rid: int) -> AddRequest:
    prompt = [1] * rng.randint(64, 768)
    return AddRequest(str(rid), prompt, SamplingParams(max_tokens=rng.randint(32, 512), ignore_eos=True))


def measure(num_requests: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    cfg = SchedulerConfig(policy=args.policy)
    core = SchedulerCore(cfg, args.hbm_blocks, 64 * num_requests + 4096, max_model_len=4096)
    known: dict[str, int] = {}
    now, next_id = 0.0, 0
    for _ in range(num_requests):
        req = _new_request(rng, next_id)
        core.add_request(req, now)
        known[req.request_id] = len(req.prompt_token_ids)
        next_id += 1
    times, cpu_times, moved = [], [], []
    for i in range(args.warmup + args.steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        plan = core.schedule(now)
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if i >= args.warmup:
            times.append(elapsed)
            cpu_times.append(cpu)
            moved.append(len(plan.swap_in) + len(plan.swap_out) + len(plan.eager) if plan else 0)
        ids = [] if plan is None else sampling(plan, known.__getitem__)
        now += STEP_S
        for out in core.update(StepResult(plan.step_id if plan else -1, ids, [7] * len(ids)), now):
            known[out.request_id] += 1
            if out.finish_reason is not None:
                del known[out.request_id]
                req = _new_request(rng, next_id)
                core.add_request(req, now)
                known[req.request_id] = len(req.prompt_token_ids)
                next_id += 1
    core.check_invariants()
    stats = core.stats()
    return {
        "requests": num_requests,
        "median_ms": _ms(statistics.median(times)),
        "p99_ms": _ms(_p99(times)),
        "median_cpu_ms": _ms(statistics.median(cpu_times)),
        "p99_cpu_ms": _ms(_p99(cpu_times)),
        "steps": len(times),
        "policy": args.policy,
        "num_running": stats["num_running"],
        "num_rotary": stats["num_rotary"],
        "num_waiting": stats["num_waiting"],
        "blocks_moved_per_step": round(statistics.mean(moved), 1),
        "num_preemptions": stats["num_preemptions"],
    }


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def run(args: argparse.Namespace) -> int:
    if args.steps < 50:
        raise SystemExit("--steps must be >= 50")
    rows = []
    for n in (int(x) for x in str(args.requests).split(",") if x.strip()):
        row = measure(n, args)
        rows.append(row)
        print(
            f"requests {n:>6}: median {row['median_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms  "
            f"(cpu: median {row['median_cpu_ms']:.3f}, p99 {row['p99_cpu_ms']:.3f})  "
            f"(running {row['num_running']}, rotary {row['num_rotary']}, waiting {row['num_waiting']}, "
            f"{row['blocks_moved_per_step']} blocks moved/step)"
        )
    if args.json:
        result = rows[0] if len(rows) == 1 else rows
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"  wrote {args.json}")
    return 0
