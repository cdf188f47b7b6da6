"""`superinfer bench calibrate`: measure this machine's worker and write the `cpu` profile.

The simulator prices a step on this machine with a linear model fitted to the REAL worker
(`ModelRunner` on the bundled SmolLM2, float32, as `superinfer serve` runs it on CPU):

    step_s = overhead + a · prefill tokens + b · decode tokens + c · KV tokens read

fitted by least squares over a few batch shapes (single prefills of several lengths,
decode batches of several sizes and context lengths). The link is measured on the real
`TransferEngine` in each mode (naive per-layer segments, merged blocks, one batched call,
duplex), which gives the rate at three segment sizes and the both-ways cap. Scheduling
cost per step is the real core's `schedule` + `update` + the Plan/StepResult codecs.

The pools are sized as the live service sizes them: HBM = a quarter of the RAM available
now, DRAM = `--dram-gb` (2 GiB, the service's default).

This times the runner with the machine to itself. Served, the same steps take longer (the
gateway, the scheduler and the load client share the cores): `bench simlive` fits the same
four terms on served steps instead and adds two live terms (the `cpu-live` profile,
bench/sim/costmodel.py); with `--micro` it runs this with `--keep min` (each shape's fastest
repetition) and reports the served steps' time over this model's price of them.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.sim.costmodel import GB, MODELS, PROFILE_DIR, StepWork
from services.scheduler.core import SchedulerConfig
from services.worker.kv_pool import DEFAULT_CPU_MEMORY_FRACTION, KVPools, KVSpec, available_ram_bytes
from services.worker.runner import ModelRunner, allocate_kv_pool, load_model
from services.worker.transfer import MODES, TransferEngine
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE
from shared.modelfile import resolve_model_path
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest

PREFILL_LENS = (32, 128, 320, 512)
DECODE_SHAPES = ((1, 64), (8, 64), (8, 480), (32, 64), (32, 240), (64, 112))  # (batch, context)
NUM_DECODE_STEPS = 6
XFER_BLOCKS = 64


# ---------------------------------------------------------------- compute


class Shapes:
    """Drives the runner through batch shapes with fresh requests; blocks come from a counter
    that restarts for every shape (requests are dropped between shapes)."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.gen = torch.Generator().manual_seed(seed)
        self.num = 0
        self.next_block = 0

    def _request(self, num_tokens: int) -> str:
        rid = f"c{self.num}"
        self.num += 1
        ids = torch.randint(10, 40000, (num_tokens,), generator=self.gen).tolist()
        self.runner.add_requests([NewRequestData(rid, ids, SamplingParams(max_tokens=1 << 20, temperature=0.0))])
        return rid

    def _blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def _reset(self, rids: list[str]) -> None:
        self.runner.drop(rids)
        self.next_block = 0

    def prefill(self, num_tokens: int) -> tuple[StepWork, float]:
        rid = self._request(num_tokens)
        step = [ScheduledRequest(rid, 0, num_tokens, block_table=self._blocks(-(-num_tokens // BLOCK_SIZE)))]
        seconds = _timed(self.runner, step)
        self._reset([rid])
        work = StepWork()
        work.add(0, num_tokens, True)
        return work, seconds

    def decodes(self, batch: int, context: int, num_steps: int) -> list[tuple[StepWork, float]]:
        """Decode steps of `batch` requests whose context starts at `context` tokens. The
        context is declared, not prefilled: a step's time depends on how many KV slots it
        reads, not on their values (the pool is zeroed), and prefilling would cost minutes."""
        rids = [self._request(context) for _ in range(batch)]
        tables = {r: self._blocks(-(-(context + num_steps) // BLOCK_SIZE)) for r in rids}
        out = []
        for i in range(num_steps):
            lens = {r: len(self.runner.token_ids(r)) for r in rids}
            step = [ScheduledRequest(r, lens[r] - 1, 1, block_table=tables[r] if i == 0 else None) for r in rids]
            seconds = _timed(self.runner, step)
            work = StepWork()
            for r in rids:
                work.add(lens[r] - 1, 1, True)
            out.append((work, seconds))
        self._reset(rids)
        return out


def _timed(runner: ModelRunner, step: list[ScheduledRequest]) -> float:
    t0 = time.perf_counter()
    runner.execute(step)
    return time.perf_counter() - t0


def measure_steps(runner: ModelRunner, reps: int, keep: str = "median") -> list[tuple[StepWork, float]]:
    """(work, seconds) per distinct step: each prefill length, and each step of each decode
    shape, measured `reps` times; the median (or the fastest: `keep="min"`) is kept, so a
    step slowed by another process on a shared machine does not bend the fit. The fastest
    is the machine's own speed even under heavy sharing, where a median still swings. A
    warm-up pass runs first, untimed."""
    shapes = Shapes(runner)
    shapes.prefill(64)
    shapes.decodes(4, 32, 2)
    runs: list[list[tuple[StepWork, float]]] = []
    for _ in range(reps):
        one = [shapes.prefill(n) for n in PREFILL_LENS]
        for batch, context in DECODE_SHAPES:
            one += shapes.decodes(batch, context, NUM_DECODE_STEPS)
        runs.append(one)
    pick = min if keep == "min" else statistics.median
    return [(same[0][0], pick(s for _, s in same)) for same in zip(*runs)]


def features(w: StepWork) -> list[float]:
    return [1.0, w.num_prefill_tokens, w.num_decode_tokens, w.num_kv_read]


def fit_linear(samples: list[tuple[StepWork, float]]) -> tuple[list[float], float]:
    """Non-negative least squares by elimination: a negative coefficient is pinned at 0 and
    the rest refitted (four unknowns, so this ends quickly). Returns (coefficients, R²)."""
    x = np.array([features(w) for w, _ in samples])  # [N, 4]
    y = np.array([s for _, s in samples])  # [N]
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[active] = np.clip(coef, 0.0, None)
    resid = y - x @ full
    r2 = 1.0 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum() or 1.0)
    return full.tolist(), r2


# ---------------------------------------------------------------- link


def measure_link(spec: KVSpec, reps: int) -> dict[str, float]:
    """Seconds per mode to move XFER_BLOCKS blocks each way (median of `reps`).

    One parallel region opens on this thread first: in a process whose first one opens on a
    transfer thread, the merged and batched copies ran ~100x slow here (1 s instead of 7 ms
    for 64 blocks each way), which the worker, warm from loading its model, never sees."""
    torch.ones(256, 256) @ torch.ones(256, 256)
    out = {}
    with KVPools(spec, 2 * XFER_BLOCKS, 2 * XFER_BLOCKS, "cpu") as pools:
        pools.hbm.normal_()
        pools.dram.normal_()
        pairs_in = [(i, XFER_BLOCKS + i) for i in range(XFER_BLOCKS)]  # dram i -> hbm 64+i
        pairs_out = [(i, XFER_BLOCKS + i) for i in range(XFER_BLOCKS)]  # hbm i -> dram 64+i
        for mode in MODES:
            with TransferEngine(pools, mode) as engine:
                engine.submit(pairs_in[:4], pairs_out[:4]).wait()  # warm-up
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    engine.submit(pairs_in, pairs_out).wait()
                    times.append(time.perf_counter() - t0)
            out[mode] = statistics.median(times)
    return out


def link_profile(spec: KVSpec, seconds: dict[str, float]) -> dict:
    """Rates per direction at the segment size of each serial mode; duplex gives the cap."""
    block = spec.block_bytes
    per_dir = XFER_BLOCKS * block
    rate = lambda mode: 2 * per_dir / seconds[mode] / GB  # noqa: E731  (serial: both directions in turn)
    curve = sorted([(spec.segment_bytes, rate("naive")), (block, rate("merged")), (per_dir, rate("batched"))])
    return {
        "curve": [[s, round(r, 3)] for s, r in curve],
        "dram_gbs": round(2 * per_dir / seconds["duplex"] / GB, 3),
        "duplex_efficiency": 1.0,
        "measured_ms": {m: round(s * 1e3, 3) for m, s in seconds.items()},
    }


# ---------------------------------------------------------------- scheduler


def measure_sched_ms(num_requests: int = 64, num_steps: int = 200) -> float:
    """Median per-step cost of the scheduler's side of a step on this machine: `schedule`,
    `update` and the msgpack round trips of the Plan and the StepResult."""
    from services.scheduler.core import SchedulerConfig, SchedulerCore
    from services.scheduler.core.step import sampling
    from shared import protocol as p

    core = SchedulerCore(SchedulerConfig(), 4096, 4096, 8192)
    for i in range(num_requests):
        core.add_request(
            p.AddRequest(str(i), [2 + i] + [1] * (99 + 7 * i), p.SamplingParams(max_tokens=200, ignore_eos=True)), 0.0
        )
    known = {str(i): 100 + 7 * i for i in range(num_requests)}
    times, now = [], 0.0
    for _ in range(num_steps):
        t0 = time.perf_counter()
        plan = p.worker_msg_decoder.decode(p.encode(core.schedule(now)))
        ids = sampling(plan, known.__getitem__)
        result = p.worker_reply_decoder.decode(p.encode(p.StepResult(plan.step_id, ids, [1] * len(ids))))
        now += 0.05
        for out in core.update(result, now):
            known[out.request_id] += 1
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------- command


def dump(profile: dict) -> str:
    """Indented JSON with each innermost list on one line (the curve stays readable)."""
    text = json.dumps(profile, indent=2)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice, as the worker)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every shape (default %(default)s)")
    p.add_argument(
        "--keep", choices=["median", "min"], default="median", help="which repetition of a shape to fit (default %(default)s)"
    )
    p.add_argument(
        "--dram-gb", type=float, default=2.0, help="DRAM pool of the live service, GiB (default %(default)s)"
    )
    p.add_argument("--out", type=Path, default=PROFILE_DIR / "cpu.json", help="profile to write (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, cfg = load_model(resolve_model_path(args.model), "cpu")
    if (cfg.num_layers, cfg.hidden_size) != (MODELS["smollm2"].num_layers, MODELS["smollm2"].hidden_size):
        raise SystemExit("calibrate prices the bundled SmolLM2 (the `smollm2` model shape)")
    num_blocks = max(b * -(-(c + NUM_DECODE_STEPS) // BLOCK_SIZE) for b, c in DECODE_SHAPES)
    runner = ModelRunner(
        model, cfg, allocate_kv_pool(cfg, num_blocks, BLOCK_SIZE, torch.float32, "cpu"), BLOCK_SIZE, "cpu"
    )
    samples = measure_steps(runner, args.reps, args.keep)
    coef, r2 = fit_linear(samples)
    spec = KVSpec.from_model(cfg, BLOCK_SIZE, torch.float32)
    link = link_profile(spec, measure_link(spec, args.reps))
    profile = {
        "name": "cpu",
        "notes": f"calibrated by `superinfer bench calibrate` on this machine (torch threads: {torch.get_num_threads()}), "
        f"{len(samples)} distinct steps ({args.keep} of {args.reps}), fit R^2 {r2:.3f}; the live CPU worker starts a step's copies after the previous step",
        "linear": {
            "model": "smollm2",
            "overhead_s": coef[0],
            "prefill_token_s": coef[1],
            "decode_token_s": coef[2],
            "kv_token_s": coef[3],
        },
        "fit_r2": round(r2, 4),
        "dtype_bytes": 4,
        "pipeline": False,
        "sched_ms": round(measure_sched_ms(), 4),
        "kv_hbm_gb": round(DEFAULT_CPU_MEMORY_FRACTION * available_ram_bytes() / GB, 3),
        "kv_dram_gb": round(args.dram_gb * (1 << 30) / GB, 3),
        "threads": torch.get_num_threads(),
        "link": link,
        "defaults": {
            "max_batched_tokens": SchedulerConfig.max_batched_tokens,
            "max_num_seqs": SchedulerConfig.max_num_seqs,
            "xfer_budget": SchedulerConfig().b_xfer,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(profile))
    lin = profile["linear"]
    print(
        f"step = {lin['overhead_s'] * 1e3:.2f} ms + {lin['prefill_token_s'] * 1e6:.1f} us/prefill token + "
        f"{lin['decode_token_s'] * 1e6:.1f} us/decode token + {lin['kv_token_s'] * 1e6:.3f} us/KV token read (R^2 {r2:.3f})"
    )
    print(
        f"link: {link['curve']} GB/s per direction, duplex {link['dram_gbs']} GB/s; sched {profile['sched_ms']} ms/step"
    )
    print(f"wrote {args.out} in {time.perf_counter() - t_start:.0f} s")
    return 0
