"""`superinfer bench replicas-live`: two scheduler+worker pairs over tcp behind one gateway on
this machine (each worker on a core of its own, one thread), ShareGPT conversations turn by
turn (`bench compare --multi-turn`'s workload: each turn's prompt the whole history), once per
routing (`--routing` of the gateway) and load, each run on freshly started pairs (empty caches).

Per run: prompt tokens served from cache (the servers' `usage.prompt_tokens_details`), TTFT
p50/p90 and attainment, TBT attainment — `bench serve`'s figures, from `bench serve`'s client.
Writes bench/results/replicas_live_<timestamp>.json. Its timings are only comparable inside
one run: run it with nothing else on the machine.

    superinfer bench replicas-live --rates 0.1,0.4 --conversations 12 --max-turns 4 --worker-args "--block-size 32 --hbm-blocks 64"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from bench.live.serve import client_args, replay
from bench.live.server import REPO, free_port
from bench.live.workload import ChatSpec, load_workload
from bench.report.metrics import summarize
from services.gateway.routing import ROUTINGS
from services.scheduler.core import SchedulerConfig
from shared.config import WEIGHTS_CACHE_ENV
from shared.modelfile import resolve_model_path
from shared.tokenizer import load_tokenizer

HERE = Path(__file__).resolve().parents[1]  # bench/
READY_TIMEOUT_S = 180.0


def spawn(log_dir: Path, name: str, args: list[str], env: dict | None = None, cpu: int | None = None) -> subprocess.Popen:
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    with open(log_dir / f"{name}.log", "ab") as log:
        return subprocess.Popen(
            [*pin, sys.executable, "-m", "services.cli", *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
        )  # fmt: skip


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return {}


class Cluster:
    """Two pairs and a gateway with `routing`; `stop()` ends them all."""

    def __init__(self, log_dir: Path, routing: str, weights_cache: str, scheduler_args: list[str],
                 worker_args: list[str]) -> None:  # fmt: skip
        self.procs: list[subprocess.Popen] = []
        addrs = []
        for i in range(2):
            addr, worker_addr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            self.procs.append(spawn(log_dir, f"{routing}-scheduler{i}", [
                "scheduler", "--bind", addr, "--worker-bind", worker_addr, "--admin-bind", "off", *scheduler_args]))
            # One core and one compute thread per worker.
            self.procs.append(spawn(log_dir, f"{routing}-worker{i}", ["worker", "--connect", worker_addr, "--device", "cpu", *worker_args],
                                    {"OMP_NUM_THREADS": "1", WEIGHTS_CACHE_ENV: weights_cache}, cpu=i % (os.cpu_count() or 1)))
            addrs.append(addr)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        flags = [f for a in addrs for f in ("--scheduler", a)]
        self.procs.append(spawn(log_dir, f"{routing}-gateway", ["gateway", "--port", str(port), "--routing", routing, *flags]))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(health(self.url).get("schedulers", [])) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.stop()
                raise RuntimeError(f"the cluster did not come up (logs in {log_dir})")
            time.sleep(0.5)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def one_run(items, routing: str, args, log_dir: Path, weights_cache: str) -> dict:
    cluster = Cluster(log_dir, routing, weights_cache, args.scheduler_args, args.worker_args)
    try:
        schedulers = health(cluster.url)["schedulers"]
        records, duration = asyncio.run(replay(cluster.url, schedulers[0]["model_name"], items, client_args(600.0)))
        after = health(cluster.url).get("schedulers", [])
    finally:
        cluster.stop()
    s = summarize(records, args.ttft_slo, args.tbt_slo, duration)
    ok = [r for r in records if r.ok]
    num_prompt = sum(r.prompt_tokens for r in ok)
    num_cached = sum(r.cached_tokens or 0 for r in ok)
    return {
        "routing": routing,
        "num_requests": s["num_requests"],
        "completed": s["completed"],
        "prompt_tokens": num_prompt,
        "cached_prompt_tokens": num_cached,
        "cached_token_share": num_cached / num_prompt if num_prompt else None,
        "ttft_p50_ms": s["ttft_p50_ms"],
        "ttft_p90_ms": s["ttft_p90_ms"],
        "ttft_attainment": s["ttft_attainment"],
        "tbt_attainment": s["tbt_attainment"],
        "output_tok_s": s["output_tok_s"],
        "duration_s": duration,
        # Each scheduler's prefix cache: prompt tokens looked up, found in HBM, found in its DRAM tier.
        "per_scheduler": [[st.get(k) for k in ("num_prefix_queries", "num_prefix_hits", "num_tier_hits")] for st in after],
    }


def run(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(resolve_model_path(None))
    chat = ChatSpec(multi_turn=True, max_turns=args.max_turns, think_s=args.think_time)
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="si-replicas-"))
    weights_cache = str(log_dir / "weights")
    print(f"logs in {log_dir}", flush=True)
    for rate in args.rates:
        items = load_workload("sharegpt", args.conversations, rate, tokenizer, seed=args.seed, chat=chat)
        if args.max_output:  # shorter replies: more turns fit a short run on two cores
            items = [replace(it, output_tokens=min(it.output_tokens, args.max_output)) for it in items]
        for routing in args.routing:
            t0 = time.perf_counter()
            row = {"rate": rate, **one_run(items, routing, args, log_dir, weights_cache), "wall_s": time.perf_counter() - t0}
            rows.append(row)
            print(
                f"{rate:g} conv/s  {routing:12s} cached {row['cached_prompt_tokens']:6d}/{row['prompt_tokens']:6d} "
                f"({row['cached_token_share'] or 0:.1%})  TTFT p50 {row['ttft_p50_ms']:6.0f} p90 {row['ttft_p90_ms']:6.0f} ms "
                f"att {row['ttft_attainment']:.1%}  TBT att {row['tbt_attainment']:.1%}  "
                f"done {row['completed']}/{row['num_requests']}  [{row['wall_s']:.0f} s]",
                flush=True,
            )
    out = args.out_dir / f"replicas_live_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    setting = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out.write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", type=_floats, default=[0.1, 0.3], help="conversations/s (default 0.1,0.3)")
    p.add_argument("--conversations", type=int, default=24, help="conversations per run (default %(default)s)")
    p.add_argument("--max-turns", type=int, default=3, help="turns per conversation at most (default %(default)s)")
    p.add_argument("--max-output", type=int, default=64, help="output tokens per turn at most; 0: the data set's (default %(default)s)")
    p.add_argument("--think-time", type=float, default=1.0, help="seconds between a turn's end and the next (default %(default)s)")
    p.add_argument("--routing", type=lambda s: s.split(","), default=["headroom", "round-robin", "cache-aware"],
                   help=f"routings, each in a run of its own (default all: {','.join(ROUTINGS)})")
    p.add_argument("--ttft-slo", type=float, default=SchedulerConfig.ttft_slo)
    p.add_argument("--tbt-slo", type=float, default=SchedulerConfig.tbt_slo)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduler-args", type=lambda s: s.split(), default=[], help="extra flags for both schedulers")
    p.add_argument("--worker-args", type=lambda s: s.split(), default=[],
                   help="extra flags for both workers, e.g. a small KV pool: '--block-size 32 --hbm-blocks 64'")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.live.replicas", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
