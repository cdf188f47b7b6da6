"""The reproduction's shared setting and its runs (`bench reproduce`, `bench tier`): Qwen2.5-32B
on the calibrated gh200, SLOs 5 s / 100 ms, every run once per seed, rows averaged over the
seeds.

The figures ask for their rows through `Ctx.run`. A whole reproduction asks twice: first with
`planning` on, which only collects the jobs (the figures' rows are then empty), then, after
`execute` has run all of them in one pool of processes, the longest first, for the rows. One
pool for everything keeps both cores busy to the end, where a pool per figure leaves one idle
while the figure's last run finishes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import replace
from pathlib import Path

from bench.live import workload
from bench.live.workload import ChatSpec, SyntheticSpec
from bench.report.metrics import RequestRecord
from bench.report.rows import mean_rows
from bench.sim import engine, sweep
from bench.sim.costmodel import MODELS, load_hardware
from services.scheduler.core import SchedulerConfig

HERE = Path(__file__).resolve().parents[1]  # bench/
SLOS = (5.0, 0.1)  # TTFT, TBT (s)
# ShareGPT's single first turns (the paper's workload) on the calibrated gh200: its compute
# saturates near 7 req/s (~1.4 k output tok/s), the top rate is past it.
RATES = (2, 4, 6, 8, 12)
MAX_TOKENS = 0  # the clients ask each output's own length with ignore_eos, as the paper's harness does
# The paper's harness (AE_AIO_0309_v1.py): Poisson arrivals for 120 s at these rates (req/s).
DURATION_S = 120.0
ARTIFACT_RATES = {
    ("qwen2.5-32b", "sharegpt"): (5, 10, 13, 15, 18, 20),
    ("mixtral-8x7b", "sharegpt"): (5, 10, 13, 15, 18, 20),
    ("qwen2.5-32b", "lmsys"): (10, 20, 25, 30, 35, 40),
    ("mixtral-8x7b", "lmsys"): (10, 20, 25, 30, 35, 40),
    ("llama3-8b", "sharegpt"): (35, 40, 45, 50, 55, 60),
    ("llama3-8b", "lmsys"): (50, 60, 68, 75, 88, 100),
}
POOL_SLACK = 1.15  # a seed's pool holds this many times rate x 120 s requests (a Poisson count runs over)
# ShareGPT conversations turn by turn, each turn's prompt the whole history (their real lengths, up
# to a 32k context): on the paper's 144 GB the KV-cache fills before the GPU's compute does, where
# ShareGPT's single first turns never fill it (700 a seed at 4-8 conversations/s do).
CONVERSATIONS = 700
CHAT = ChatSpec(multi_turn=True)
# LMSYS-Chat-1M's length mix as a synthetic workload: its published means (Zheng et al., 2023,
# arXiv 2309.11998, Table 1: 69.5 prompt and 214.5 response tokens per turn); lognormal lengths
# with sigma 1 (the spread is ours: the data set does not ship with us).
LMSYS = SyntheticSpec(input_len=70, output_len=215, dist="lognormal", spread=1.0)
# The calibration's own runs: ShareGPT long enough for the batch to reach its steady size.
CALIBRATION_REQUESTS = 1000
# What tells one run of the reproduction from another (all share the model and hardware): a
# row's key is its workload and these fields; a job's, the same fields of its setup.
ROW_KEY = ("rate", "policy", "transfer_mode", "xfer_budget", "alpha", "beta_f", "beta_b", "admit_watermark",
           "min_residency_s", "rotary_yields", "slo_chunking", "enable_prefix_caching", "kv_offloading_size",
           "num_hbm_blocks")  # fmt: skip
WORKLOADS = ("sharegpt", "lmsys", "conversations", "calibration", "a-sharegpt", "a-lmsys")  # a-: 120-s traces


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=500, help="ShareGPT requests per run (default %(default)s)")
    p.add_argument(
        "--conversations", type=int, default=CONVERSATIONS, help="ShareGPT conversations per run (default %(default)s)"
    )
    p.add_argument("--rates", type=sweep._floats, default=list(RATES), help="requests/s (default 2,4,6,8,12)")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--num-seeds", type=int, default=3, help="seeds per run, from --seed (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="the clients' max_tokens cap (default %(default)s)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: the CPUs, %(default)s)")
    p.add_argument("--out", type=Path, default=HERE / "REPRODUCTION.md")
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument(
        "--rerun",
        type=sweep._strs,
        default=None,
        help="run only these policies again, the other rows taken from the last run's full rows in --results "
        "(after a policy's code changed)",
    )
    p.add_argument(
        "--from-rows",
        action="store_true",
        help="run nothing: rewrite --out from the rows in --results (after `bench simlive` recorded a run)",
    )


class Ctx:
    """The shared setting; `run` gives each job's row, `setup` builds a job's setup."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.hw = load_hardware("gh200")
        self.model = MODELS["qwen2.5-32b"]
        self.pool_rate = {"a-sharegpt": 20.0, "a-lmsys": 40.0}  # the top rate each 120-s pool serves
        self.seeds = list(range(args.seed, args.seed + args.num_seeds))
        self.num_runs = 0
        self.planning = False  # collect the jobs `run` is asked for; run them in `execute`
        self._planned: dict[str, tuple[str, sweep.Job]] = {}
        self._rows: dict[str, dict] = {}  # rows by job key
        self._items: dict[str, dict[int, list]] = {}
        self.cache: dict[str, dict] = {}  # "job key|seed" -> that run's row
        self.cache_path: Path | None = None
        self.num_missing = 0  # runs left out at the deadline
        self.runs_cpu_s = 0.0  # CPU time of the runs this invocation's workers ran (their rows' cpu_s)
        self._attempted: set[str] = set()
        self.deadline: float | None = None  # perf_counter time after which pending runs are dropped

    @property
    def items(self) -> list:
        """The first seed's ShareGPT requests."""
        return self.items_for("sharegpt")[self.args.seed]

    def items_for(self, wl: str) -> dict[int, list]:
        """Each seed's work items of workload `wl` (WORKLOADS), loaded on first use."""
        if wl not in self._items:
            a = self.args
            load = {
                "sharegpt": lambda s: sweep.load_items("sharegpt", a.num_requests, s, vllm_filter=True),
                "lmsys": lambda s: sweep.load_items("synthetic", a.num_requests, s, synthetic=LMSYS),
                "conversations": lambda s: sweep.load_items("sharegpt-long", a.conversations, s, chat=CHAT),
                "calibration": lambda s: sweep.load_items("sharegpt", CALIBRATION_REQUESTS, s, vllm_filter=True),
                "a-sharegpt": lambda s: sweep.load_items("sharegpt", self.pool_size(wl), s),
                "a-lmsys": lambda s: sweep.load_items("synthetic", self.pool_size(wl), s, synthetic=LMSYS),
            }[wl]
            self._items[wl] = {s: load(s) for s in self.seeds}
        return self._items[wl]

    def pool_size(self, wl: str) -> int:
        return math.ceil(POOL_SLACK * self.pool_rate[wl] * DURATION_S)

    def conversations(self) -> dict[int, list]:
        return self.items_for("conversations")

    def lmsys(self) -> dict[int, list]:
        return self.items_for("lmsys")

    def setup(
        self, policy: str, mode: str = "duplex", hw=None, hbm: int | None = None, model=None, **knobs
    ) -> engine.SimSetup:
        d = self.hw.defaults
        cfg = SchedulerConfig(
            policy="fcfs" if policy == "neo" else policy,  # NEO offloads under vLLM V1's scheduling
            max_batched_tokens=d["max_batched_tokens"],
            max_num_seqs=d["max_num_seqs"],
            xfer_budget=knobs.pop("xfer_budget", d["xfer_budget"]),
            ttft_slo=SLOS[0],
            tbt_slo=SLOS[1],
            **knobs,
        )
        # Each step takes the scheduling time our core's schedule() measured for it (not the
        # paper's 7.6 ms); it overlaps compute, so it costs only where it is longer.
        return engine.make_setup(
            hw or self.hw,
            model or self.model,
            cfg,
            mode,
            hbm=hbm,
            sched_time="measured",
            max_tokens=self.args.max_tokens,
            neo=policy == "neo",
        )

    def run(self, jobs: list[sweep.Job], wl: str = "sharegpt") -> list[dict]:
        """One row per job on workload `wl`: its mean over the seeds, with the spreads
        (rows.mean_rows). A job run before (the same workload, rate and setup in another figure)
        is not run again. While `planning`, the jobs are only collected and the rows are empty."""
        new = {k: j for j in jobs if (k := job_key(wl, j)) not in self._rows and k not in self._attempted}
        if self.planning:
            self._planned.update({k: (wl, j) for k, j in new.items()})
            return [{} for _ in jobs]
        if new:
            self._execute([(wl, k, j) for k, j in new.items()])
        return [self._rows.get(job_key(wl, j)) for j in jobs]

    def execute(self) -> None:
        """Run every job collected while planning, all in one pool."""
        planned, self._planned, self.planning = self._planned, {}, False
        self._execute([(wl, k, j) for k, (wl, j) in planned.items()])

    def _execute(self, jobs: list[tuple[str, str, sweep.Job]]) -> None:
        """Run `jobs` once per seed, in the order given (the figures' priority), each run's row
        appended to the cache file as it completes (`--resume` starts from it); runs still
        pending at the deadline are dropped, and a job's row is the mean over the seeds that
        ran (its `seeds` says how many)."""
        t0 = time.perf_counter()
        todo, wanted = [], {}
        self._attempted.update(key for _, key, _ in jobs)
        for n, (wl, key, job) in enumerate(jobs):
            for k, (seed, items) in enumerate(list(self.items_for(wl).items())[: job.seeds or None]):
                wanted.setdefault(key, []).append(seed)
                if f"{key}|{seed}" in self.cache:
                    continue
                bare = [replace(it, prompt="") for it in items]  # the text is not simulated; keep pickles small
                timed = workload.draw_arrivals(bare, job.rate, 1.0, seed)
                if wl.startswith("a-"):  # the harness's 120-s Poisson trace
                    timed = [it for it in timed if it.arrival_s < DURATION_S]
                # every job's first seed, then the all-seed jobs' second, the one-seed jobs, the rest
                todo.append((k + 1.5 * bool(job.seeds), n, f"{key}|{seed}", (timed, job.setup, job.rate, *SLOS)))
        todo = [(tag, a) for *_, tag, a in sorted(todo, key=lambda t: t[:2])]
        self.num_runs += len(todo)
        left = lambda: None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())  # noqa: E731
        if self.args.jobs <= 1:
            for tag, a in todo:
                if left() == 0.0:
                    break
                self._done(tag, sweep.run_one(*a))
        elif todo:
            pool = ProcessPoolExecutor(self.args.jobs)
            futures = {pool.submit(sweep.run_one, *a): tag for tag, a in todo}
            try:
                for f in as_completed(futures, timeout=left()):
                    row = f.result()
                    self.runs_cpu_s += row.get("cpu_s", 0.0)
                    self._done(futures[f], row)
            except FuturesTimeout:
                print("  deadline: the runs still pending are left out", file=sys.stderr)
            pool.shutdown(wait=False, cancel_futures=True)
        for key, seeds in wanted.items():  # mean_rows takes one list of rows per seed
            rows = [self.cache[t] for s in seeds if (t := f"{key}|{s}") in self.cache]
            self.num_missing += len(seeds) - len(rows)
            if rows:
                self._rows[key] = mean_rows([[r] for r in rows])[0]
        took = time.perf_counter() - t0
        print(f"  {len(jobs)} jobs, {len(todo)} runs in {took:.0f} s", file=sys.stderr)

    def _done(self, tag: str, row: dict) -> None:
        self.cache[tag] = row
        if self.cache_path is not None:
            with self.cache_path.open("a") as f:
                f.write(json.dumps({"tag": tag, "row": row}) + "\n")

    def load_cache(self, path: Path, resume: bool) -> None:
        """Runs completed before (`resume`: read them from `path`); new ones are appended."""
        self.cache_path = path
        if resume and path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    e = json.loads(line)
                    self.cache[e["tag"]] = e["row"]
        elif path.is_file():
            path.unlink()

    def records(self, setups: list[engine.SimSetup], rate: float) -> list[list[RequestRecord]]:
        """Each setup's requests in one run on the first seed's conversations (the CDFs of
        Fig. 1), the runs side by side."""
        bare = [replace(it, prompt="") for it in self.conversations()[self.args.seed]]
        items = workload.draw_arrivals(bare, rate, 1.0, self.args.seed)
        self.num_runs += len(setups)
        with ProcessPoolExecutor(max(1, min(self.args.jobs, len(setups)))) as pool:
            return list(pool.map(simulated_records, [items] * len(setups), setups))


def _cost(wl: str, job: sweep.Job) -> float:
    """A run's relative cost, for ordering: the conversations' runs and LVF's scans of its
    paused requests are the long ones."""
    lvf = job.setup.cfg.policy in ("lvf", "lvf-paper")
    return (10.0 if wl == "conversations" else 1.0) * (3.0 if lvf else 1.0) * job.rate


def row_key(wl: str, row: dict) -> str:
    return repr((wl, *(row.get(k) for k in ROW_KEY), row.get("model")))


def job_key(wl: str, job: sweep.Job) -> str:
    cfg, setup = job.setup.cfg, job.setup
    fields = {k: getattr(cfg, k) for k in ROW_KEY[3:-1]}
    policy = "neo" if setup.neo_host_blocks else cfg.policy
    row = {"rate": job.rate, "policy": policy, "transfer_mode": setup.transfer_mode, **fields}
    key = row_key(wl, {**row, "num_hbm_blocks": setup.num_hbm_blocks, "model": setup.model.name})
    return key + f"/{job.seeds}" if job.seeds else key


def simulated_records(items: list, setup: engine.SimSetup) -> list[RequestRecord]:
    return engine.simulate(items, setup).records
