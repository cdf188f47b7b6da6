"""DuplexKV: the engine that moves KV blocks between the HBM and DRAM pools.

One interface for every mode and backend:

    t = engine.submit(swap_in=[(dram, hbm), ...], swap_out=[(hbm, dram), ...],
                      eager=[(hbm, dram), ...])
    t.fence_in()                    # before compute reads swapped-in blocks (CUDA: a stream
                                    # wait, the host goes on; CPU: blocks until they are in)
    t.wait_out() /  t.done()        # before the scheduler reuses blocks read by swap-outs

Swap-ins are the "in" direction (DRAM→HBM); swap-outs and eager mirrors of synced blocks are
the "out" direction (HBM→DRAM), one call for both. Modes, picked by name:

    naive    vLLM's path: one copy per (block, layer, K/V) segment; in, then out, in series
    merged   one copy per whole block; in, then out, in series
    batched  one call per direction; in, then out, in series
    duplex   batched, both directions at once (default)

Backends: CPU (a transfer thread per direction; torch releases the GIL inside a copy, so
copies overlap compute) and CUDA (`transfer_cuda`: a stream per direction, events).

Ordering rules the engine keeps across everything in flight:
- a swap-in never targets an HBM block that an unfinished out-copy still reads: that is a
  scheduler bug (eager rotation exists to make it unnecessary), so it raises `BlockConflict`;
- a swap-in of a DRAM block that an unfinished out-copy writes waits for that copy;
- an out-copy that reads an HBM block a swap-in writes, or writes a DRAM block a swap-in
  reads (a DRAM block freed and reused in the same step), waits for that swap-in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from services.worker import cpu_kernels
from services.worker.copies import DONE, IN, OUT, Done, Pairs, StallProbe, copy_blocks, copy_segments
from services.worker.kv_pool import KVPools

MODES = ("naive", "merged", "batched", "duplex")
DEFAULT_MODE = "duplex"


class BlockConflict(AssertionError):
    """A swap-in targets an HBM block whose copy to DRAM is still in flight."""


# ---------------------------------------------------------------- completions


class FutureDone(Done):
    """CPU: completion of a job on a transfer thread; errors surface on wait."""

    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> None:
        self.future.result()

    def ready(self) -> bool:
        return self.future.done()

    def fence(self, stream=None) -> StallProbe:
        t0 = time.perf_counter()
        self.wait()  # CPU compute runs on the host: blocking is the only fence
        stalled = time.perf_counter() - t0
        return lambda: stalled


class Transfer:
    """One step's copies, with completion per direction."""

    def __init__(self, in_pairs: Pairs, out_pairs: Pairs, in_done: Done, out_done: Done):
        self.in_hbm = frozenset(d for _, d in in_pairs)
        self.in_dram = frozenset(s for s, _ in in_pairs)
        self.out_hbm = frozenset(s for s, _ in out_pairs)
        self.out_dram = frozenset(d for _, d in out_pairs)
        self._in = in_done
        self._out = out_done

    def wait_in(self) -> None:
        self._in.wait()

    def wait_out(self) -> None:
        self._out.wait()

    def wait(self) -> None:
        self._in.wait()
        self._out.wait()

    def in_done(self) -> bool:
        return self._in.ready()

    def out_done(self) -> bool:
        return self._out.ready()

    def done(self) -> bool:
        return self._in.ready() and self._out.ready()

    @property
    def in_event(self):
        """CUDA: event recorded after the swap-ins (None when there are none, and on CPU)."""
        return self._in.event

    @property
    def out_event(self):
        return self._out.event

    def fence_in(self, stream=None) -> StallProbe:
        """Make work queued later on `stream` (CUDA; default: current) wait for the swap-ins
        without blocking the host. On CPU this blocks until they are done. Returns a probe
        of how long that work waited (read it after the work)."""
        return self._in.fence(stream)

    def fence_out(self, stream=None) -> StallProbe:
        return self._out.fence(stream)


# ---------------------------------------------------------------- validation and ordering


def validate_pairs(pairs: Pairs, num_src: int, num_dst: int, what: str) -> None:
    """Out-of-range ids would corrupt memory on the raw-pointer paths; two copies into one
    block have no defined winner inside a batch."""
    dsts = set()
    for s, d in pairs:
        if not (0 <= s < num_src and 0 <= d < num_dst):
            raise ValueError(f"{what}: block pair ({s}, {d}) out of range ({num_src}, {num_dst})")
        if d in dsts:
            raise ValueError(f"{what}: block {d} is the destination of two copies")
        dsts.add(d)


def dependencies(in_pairs: Pairs, out_pairs: Pairs, live: Iterable[Transfer]) -> tuple[list[Done], list[Done], bool]:
    """(what the swap-ins wait for, what the out-copies wait for, whether the out-copies wait
    for this submit's swap-ins). Raises BlockConflict on a swap-in into a block being read."""
    in_hbm, in_dram = {d for _, d in in_pairs}, {s for s, _ in in_pairs}
    out_hbm, out_dram = {s for s, _ in out_pairs}, {d for _, d in out_pairs}
    clash = in_hbm & out_hbm
    in_deps: list[Done] = []
    out_deps: list[Done] = []
    for t in live:
        if not t.out_done():
            clash |= in_hbm & t.out_hbm
            if in_dram & t.out_dram:
                in_deps.append(t._out)
        if not t.in_done() and (out_hbm & t.in_hbm or out_dram & t.in_dram):
            out_deps.append(t._in)
    if clash:
        raise BlockConflict(f"swap-in into HBM blocks whose copy to DRAM is in flight: {sorted(clash)[:8]}")
    return in_deps, out_deps, bool(out_dram & in_dram)


# ---------------------------------------------------------------- CPU batched copy


def block_rows(pool: torch.Tensor) -> torch.Tensor:
    """The pool as [num_blocks, row] of the widest element that divides a block (16 bytes):
    fewer, wider elements make index copies run at memcpy speed, and a block of a small model
    stays under torch's parallel grain, so one copy runs on its own thread without handoffs."""
    rows = pool.view(pool.shape[0], math.prod(pool.shape[1:]))
    if (rows.shape[1] * rows.element_size()) % 16 == 0:
        return rows.view(torch.uint8).view(torch.complex128)
    return rows


def _run_start(ids: Sequence[int]) -> int | None:
    """First id when `ids` is one ascending run (a, a+1, ...), else None."""
    first = ids[0]
    return first if all(b == first + i for i, b in enumerate(ids)) else None


class BatchedCopier:
    """One call per direction on CPU: the native block copier (cpu_kernels.py: a memcpy per
    block, no OpenMP team on the transfer thread) where it is built; else an index copy when
    one side is a run of consecutive blocks, else one `_foreach_copy_` over block views (a
    single pass, no staging buffer)."""

    def __init__(self, pools: KVPools):
        self._rows = {id(p): block_rows(p) for p in (pools.hbm, pools.dram)}
        self._blocks = {k: r.unbind(0) for k, r in self._rows.items()}
        self._native = cpu_kernels.kernels()

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, non_blocking: bool = False) -> None:
        src_ids = [s for s, _ in pairs]
        dst_ids = [d for _, d in pairs]
        if self._native is not None:
            return self._native.copy_blocks(src, dst, src_ids, dst_ids)
        src_rows, dst_rows = self._rows[id(src)], self._rows[id(dst)]
        if (d0 := _run_start(dst_ids)) is not None:
            # dst_rows[d0 : d0+n] = src_rows[src_ids]: [n, row]
            torch.index_select(src_rows, 0, torch.tensor(src_ids), out=dst_rows[d0 : d0 + len(pairs)])
        elif (s0 := _run_start(src_ids)) is not None:
            dst_rows.index_copy_(0, torch.tensor(dst_ids), src_rows[s0 : s0 + len(pairs)])
        else:
            src_blocks, dst_blocks = self._blocks[id(src)], self._blocks[id(dst)]
            torch._foreach_copy_([dst_blocks[d] for d in dst_ids], [src_blocks[s] for s in src_ids])


class CpuBackend:
    """Copies on transfer threads: one per direction in duplex mode, one shared (so the two
    directions run in series, in submission order) otherwise."""

    def __init__(self, pools: KVPools, mode: str):
        self.pools = pools
        self.copy = {"naive": copy_segments, "merged": copy_blocks}.get(mode) or BatchedCopier(pools)
        self.copy_impl = {"naive": "per_segment", "merged": "per_block"}.get(mode, "index")
        self._queues = {IN: ThreadPoolExecutor(1, thread_name_prefix="kv-in")}
        self._queues[OUT] = ThreadPoolExecutor(1, thread_name_prefix="kv-out") if mode == "duplex" else self._queues[IN]

    def start(self, direction: str, pairs: Pairs, deps: list[Done], after_compute: bool = True) -> Done:
        if not pairs:
            return DONE
        src, dst = (self.pools.dram, self.pools.hbm) if direction == IN else (self.pools.hbm, self.pools.dram)
        return FutureDone(self._queues[direction].submit(self._job, src, dst, pairs, deps))

    def _job(self, src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, deps: list[Done]) -> None:
        for dep in deps:
            dep.wait()
        self.copy(src, dst, pairs)

    def close(self) -> None:
        for q in set(self._queues.values()):
            q.shutdown(wait=True)


# ---------------------------------------------------------------- the engine


class TransferEngine:
    """Submits each step's block copies to a backend and keeps the ordering rules above.
    One thread submits (the worker loop); completions may be awaited from any thread."""

    def __init__(self, pools: KVPools, mode: str = DEFAULT_MODE, copy_impl: str = "auto", cuda=None):
        """`cuda`: the torch.cuda-like module the CUDA backend takes streams and events from
        (default torch.cuda when the pools are on a CUDA device); given with host pools, the
        CUDA backend's ordering runs over them, as the CPU tests of that ordering do."""
        if mode not in MODES:
            raise ValueError(f"unknown transfer mode {mode!r}; one of {', '.join(MODES)}")
        self.pools = pools
        self.mode = mode
        if pools.is_cuda or cuda is not None:
            from services.worker.transfer_cuda import CudaBackend

            self._backend = CudaBackend(pools, mode, copy_impl, cuda or torch.cuda)
        elif copy_impl in ("auto", "index"):
            self._backend = CpuBackend(pools, mode)
        else:
            raise ValueError(f"copy implementation {copy_impl!r} needs a CUDA device")
        self.copy_impl: str = self._backend.copy_impl
        self._live: list[Transfer] = []
        self._closed = False

    def submit(
        self,
        swap_in: Pairs = (),
        swap_out: Pairs = (),
        eager: Pairs = (),
        *,
        after_compute: bool = True,
    ) -> Transfer:
        """Start one step's copies: swap_in (dram, hbm), swap_out and eager (hbm, dram).

        `after_compute` (CUDA): the copies wait, on the device, for the compute queued so far
        on the current stream, which may still write blocks being swapped out or read blocks
        being reused. Without it they start at once, beside that compute: for swap-ins whose
        blocks the compute in flight does not touch (a later step's, prefetched).
        """
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        in_pairs, out_pairs = list(swap_in), list(swap_out) + list(eager)
        validate_pairs(in_pairs, self.pools.num_dram_blocks, self.pools.num_hbm_blocks, "swap_in")
        validate_pairs(out_pairs, self.pools.num_hbm_blocks, self.pools.num_dram_blocks, "swap_out+eager")
        self._live = [t for t in self._live if not t.done()]
        in_deps, out_deps, out_after_in = dependencies(in_pairs, out_pairs, self._live)
        in_done = self._backend.start(IN, in_pairs, in_deps, after_compute)
        if out_after_in:
            out_deps.append(in_done)
        out_done = self._backend.start(OUT, out_pairs, out_deps, after_compute)
        transfer = Transfer(in_pairs, out_pairs, in_done, out_done)
        if in_pairs or out_pairs:
            self._live.append(transfer)
        return transfer

    def num_in_flight(self) -> int:
        self._live = [t for t in self._live if not t.done()]
        return len(self._live)

    def close(self) -> None:
        """Finish what is in flight and stop the transfer threads/streams."""
        if self._closed:
            return
        self._closed = True
        try:
            for t in self._live:
                t.wait()
        finally:
            self._live.clear()
            self._backend.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def measure_copy_gbps(engine: TransferEngine, block_bytes: int, num_blocks: int = 64, repeats: int = 3) -> float:
    """This machine's DRAM->HBM copy bandwidth in GB/s, measured through the engine itself at
    start: one batch of up to `num_blocks` blocks, the best of `repeats` after a warm-up. The
    scheduler prices a prefix load from the DRAM tier by it, and B_xfer left at its default
    comes from it. Run it before the first plan: it writes HBM blocks no request holds yet.
    0 when a pool is empty."""
    pools = engine.pools
    n = min(num_blocks, pools.num_hbm_blocks, pools.num_dram_blocks)
    if n == 0 or block_bytes <= 0:
        return 0.0
    pairs = [(i, i) for i in range(n)]
    best = math.inf
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        engine.submit(swap_in=pairs, after_compute=False).wait_in()
        if i:  # the first one warms the path (page faults, threads)
            best = min(best, time.perf_counter() - t0)
    return n * block_bytes / best / 1e9 if best > 0 else 0.0
