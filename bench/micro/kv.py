"""`superinfer bench kv`: KV-block transfer bandwidth of each DuplexKV mode.

Moves the same volume (`--gib` each way: swap-ins DRAM→HBM and swap-outs HBM→DRAM of
scattered blocks) in every mode, and measures in the same run the ceiling those copies are
held to: on CPU one contiguous copy of the same bytes; on CUDA contiguous pinned copies, one
direction at a time and both at once. Bandwidths are 1e9 bytes/s, medians of `--reps` runs.

    python -m bench.micro.kv --json bench/results/kv_cpu.json --model smollm2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.report.rows import dig
from services.worker.kv_pool import MODEL_KV_SPECS, KVPools, KVSpec, blocks_in
from services.worker.transfer import MODES, TransferEngine

Pairs = list[tuple[int, int]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB moved in each direction (default 1)")
    parser.add_argument("--model", choices=sorted(MODEL_KV_SPECS), default="smollm2", help="KV block shape")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per figure (median quoted)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument(
        "--copy", default="auto", help="CUDA copy of batched/duplex: auto, memcpy_batch, per_block, cupy"
    )
    parser.add_argument("--seed", type=int, default=0)


def gbps(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / seconds / 1e9, 2)


def timed_once(fn, device: torch.device) -> float:
    """Wall seconds of `fn` (host queueing included), synchronized on both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


Figures = dict[str, Callable[[], object]]


def round_robin(figures: Figures, reps: int, device: torch.device) -> dict[str, list[float]]:
    """Run every figure once per round, `reps` rounds: load from other processes then falls
    on all figures alike instead of on whichever ran during a busy spell."""
    runs: dict[str, list[float]] = {name: [] for name in figures}
    for _ in range(reps):
        for name, fn in figures.items():
            runs[name].append(timed_once(fn, device))
    return runs


def scattered_pairs(num_blocks: int, seed: int) -> tuple[Pairs, Pairs]:
    """(swap_in, swap_out) over pools of 2n blocks, ids shuffled as after many rotations; the
    swap-ins target HBM blocks the swap-outs do not read."""
    gen = torch.Generator().manual_seed(seed)
    hbm = torch.randperm(2 * num_blocks, generator=gen).tolist()
    dram = torch.randperm(2 * num_blocks, generator=gen).tolist()
    n = num_blocks
    return list(zip(dram[:n], hbm[:n])), list(zip(hbm[n:], dram[n:]))


# ---------------------------------------------------------------- what is timed


def ceiling_figures(pools: KVPools, n: int) -> Figures:
    """CPU: one contiguous copy of the bytes both directions move together. CUDA: contiguous
    pinned copies of n blocks, each direction alone and both at once on two streams."""
    if not pools.is_cuda:
        src, dst = pools.hbm.view(-1), pools.dram.view(-1)
        return {"memcpy": lambda: dst.copy_(src)}
    h2d, d2h = torch.cuda.Stream(pools.device), torch.cuda.Stream(pools.device)

    def copy_in():
        with torch.cuda.stream(h2d):
            pools.hbm[:n].copy_(pools.dram[:n], non_blocking=True)

    def copy_out():
        with torch.cuda.stream(d2h):
            pools.dram[n : 2 * n].copy_(pools.hbm[n : 2 * n], non_blocking=True)

    return {"pinned_h2d": copy_in, "pinned_d2h": copy_out, "pinned_duplex": lambda: (copy_in(), copy_out())}


def mode_figures(engine: TransferEngine, pairs: tuple[Pairs, Pairs]) -> Figures:
    swap_in, swap_out = pairs
    figures = {engine.mode: lambda: engine.submit(swap_in, swap_out).wait()}
    if engine.pools.is_cuda:  # each direction alone
        figures[f"{engine.mode}.h2d"] = lambda: engine.submit(swap_in=swap_in).wait()
        figures[f"{engine.mode}.d2h"] = lambda: engine.submit(swap_out=swap_out).wait()
    return figures


def summarize(runs: dict[str, list[float]], engines: dict[str, TransferEngine], one_way: int) -> dict:
    """Medians into the report's keys; `effective_gbps` counts the bytes of both directions."""
    med = {name: statistics.median(r) for name, r in runs.items()}
    result: dict = {}
    if "memcpy" in med:
        result["memcpy_gbps"] = gbps(2 * one_way, med["memcpy"])
        result["memcpy_what"] = "one contiguous host copy of both directions' bytes"
    else:
        h2d, d2h = gbps(one_way, med["pinned_h2d"]), gbps(one_way, med["pinned_d2h"])
        result["pinned"] = {
            "what": "contiguous pinned copies, each direction alone and both at once",
            "h2d_gbps": h2d,
            "d2h_gbps": d2h,
            "one_way_gbps": max(h2d, d2h),
            "duplex_gbps": gbps(2 * one_way, med["pinned_duplex"]),
        }
        result["memcpy_gbps"] = result["pinned"]["duplex_gbps"]
        result["memcpy_what"] = "pinned copies, both directions at once"
    result["modes"] = {}
    for mode, engine in engines.items():
        m = {
            "copy_impl": engine.copy_impl,
            "effective_gbps": gbps(2 * one_way, med[mode]),
            "seconds": round(med[mode], 4),
            "runs_s": [round(r, 4) for r in runs[mode]],
        }
        for d in ("h2d", "d2h"):
            if f"{mode}.{d}" in med:
                m[f"{d}_gbps"] = gbps(one_way, med[f"{mode}.{d}"])
        result["modes"][mode] = m
    return result


# (name, numerator, denominator, target), as key paths into the result
GOALS = [
    ("duplex_vs_memcpy", ("modes", "duplex", "effective_gbps"), ("memcpy_gbps",), 0.85),
    ("duplex_vs_naive", ("modes", "duplex", "effective_gbps"), ("modes", "naive", "effective_gbps"), 10.0),
    ("batched_h2d_vs_pinned", ("modes", "batched", "h2d_gbps"), ("pinned", "h2d_gbps"), 0.9),
    ("batched_d2h_vs_pinned", ("modes", "batched", "d2h_gbps"), ("pinned", "d2h_gbps"), 0.9),
    ("duplex_vs_one_direction", ("modes", "duplex", "effective_gbps"), ("pinned", "one_way_gbps"), 1.6),
]


def goals(result: dict) -> dict:
    """The issue's targets that this run has the figures for."""
    out = {}
    for name, num, den, target in GOALS:
        a, b = dig(result, num), dig(result, den)
        if a is not None and b:
            value = round(a / b, 3)
            out[name] = {"value": value, "target": target, "met": value >= target}
    return out


# ---------------------------------------------------------------- report


def print_table(result: dict) -> None:
    r = result
    print(f"\nKV transfer: {r['model']} blocks ({r['block_bytes']} B), {r['gib_each_way']} GiB each way, ", end="")
    print(f"{r['device']}, median of {r['reps']}")
    print(f"  memcpy limit      {result['memcpy_gbps']:8.2f} GB/s  ({result['memcpy_what']})")
    if "pinned" in result:
        p = result["pinned"]
        h2d, d2h, both = p["h2d_gbps"], p["d2h_gbps"], p["duplex_gbps"]
        print(f"  pinned            h2d {h2d:.2f}  d2h {d2h:.2f}  both {both:.2f} GB/s")
    print(f"  {'mode':<10} {'copy':<13} {'GB/s (both)':>11} {'seconds':>8} {'h2d':>8} {'d2h':>8}")
    for mode, m in result["modes"].items():
        h2d, d2h = m.get("h2d_gbps", ""), m.get("d2h_gbps", "")
        both, seconds = m["effective_gbps"], m["seconds"]
        print(f"  {mode:<10} {m['copy_impl']:<13} {both:>11.2f} {seconds:>8.3f} {h2d!s:>8} {d2h!s:>8}")
    for name, g in result["goals"].items():
        verdict = "met" if g["met"] else "NOT met"
        print(f"  goal {name:<26} {g['value']!s:>7} (target {g['target']})  {verdict}")


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    spec: KVSpec = MODEL_KV_SPECS[args.model]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        print(f"unknown mode(s) {bad}; choose from {MODES}", file=sys.stderr)
        return 2
    if device.type != "cuda" and args.copy != "auto":
        print(f"--copy {args.copy} is a CUDA copy implementation; this run is on {device}", file=sys.stderr)
        return 2
    n = max(64, blocks_in(spec, args.gib * (1 << 30)))
    pools = KVPools(spec, 2 * n, 2 * n, device)
    engines: dict[str, TransferEngine] = {}
    try:
        pools.hbm.fill_(1.0)  # touch every page before timing
        pools.dram.fill_(2.0)
        pairs = scattered_pairs(n, args.seed)
        figures = ceiling_figures(pools, n)
        for mode in modes:
            copy_impl = args.copy if mode in ("batched", "duplex") else "auto"
            engines[mode] = TransferEngine(pools, mode, copy_impl)
            engines[mode].submit(pairs[0][:64], pairs[1][:64]).wait()  # warm-up: threads, streams, kernels
            figures.update(mode_figures(engines[mode], pairs))
        runs = round_robin(figures, args.reps, device)
        result = {
            "bench": "kv",
            "model": args.model,
            "device": device_name(device),
            "torch": torch.__version__,
            "num_threads": torch.get_num_threads(),
            "reps": args.reps,
            "block_bytes": spec.block_bytes,
            "segment_bytes": spec.segment_bytes,
            "num_blocks_each_way": n,
            "gib_each_way": round(n * spec.block_bytes / (1 << 30), 3),
            "gbps_unit": "1e9 bytes/s",
            **summarize(runs, engines, n * spec.block_bytes),
        }
        result["goals"] = goals(result)
    finally:
        for engine in engines.values():
            engine.close()
        pools.close()
        del pools
        gc.collect()
    print_table(result)
    if args.json:
        write_json(args.json, result)
        print(f"  wrote {args.json}")
    return 0



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.micro.kv", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
