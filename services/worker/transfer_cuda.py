"""CUDA backend of the transfer engine: a stream per direction, an event per completion.

Copy implementations of the batched modes (`copy_impl`):
    memcpy_batch  one `cudaMemcpyBatchAsync` per direction (CUDA runtime ≥ 12.8), through
                  ctypes on the runtime library torch itself loaded;
    per_block     one async copy per whole block (what `auto` falls back to);
    cupy          a CuPy raw kernel that gathers/scatters whole blocks with 16-byte loads
                  over mapped host memory (no copy engine involved).
The host pool is page-locked (see kv_pool), so every copy is a DMA that the host only queues.
"""

from __future__ import annotations

import ctypes
import warnings

import torch

from services.worker.copies import DONE, IN, OUT, Done, Pairs, copy_blocks, copy_segments
from services.worker.kv_pool import KVPools

COPY_IMPLS = ("auto", "memcpy_batch", "per_block", "cupy")
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream


class EventDone(Done):
    """Completion of copies queued on a stream; holds what the copies read until they end."""

    def __init__(self, event: torch.cuda.Event, keepalive: object = None):
        self.event = event
        self._keepalive = keepalive

    def wait(self) -> None:
        self.event.synchronize()

    def ready(self) -> bool:
        return self.event.query()

    def fence(self, stream: torch.cuda.Stream | None = None) -> None:
        (stream if stream is not None else torch.cuda.current_stream()).wait_event(self.event)


# ---------------------------------------------------------------- cudaMemcpyBatchAsync


class _MemcpyAttributes(ctypes.Structure):
    """struct cudaMemcpyAttributes (CUDA 12.8+): access order, two cudaMemLocation hints, flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_type", ctypes.c_int),
        ("src_loc_id", ctypes.c_int),
        ("dst_loc_type", ctypes.c_int),
        ("dst_loc_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


def _find_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded (same library instance, so the same context)."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split()[-1] for line in f if "libcudart.so" in line]
    except OSError:
        paths = []
    for name in [*paths, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class MemcpyBatch:
    """`cudaMemcpyBatchAsync` with the signature of the runtime found: 12.8/12.9 take a
    `failIdx` out-parameter that 13.0 removed (calling the wrong one crashes)."""

    def __init__(self, lib: ctypes.CDLL):
        version = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.runtime_version = version.value
        if self.runtime_version < 12080 or not hasattr(lib, "cudaMemcpyBatchAsync"):
            raise RuntimeError(f"CUDA runtime {self.runtime_version} has no cudaMemcpyBatchAsync")
        self._has_fail_idx = self.runtime_version < 13000
        p, n = ctypes.c_void_p, ctypes.c_size_t
        self._fn = lib.cudaMemcpyBatchAsync
        self._fn.argtypes = [p, p, p, n, p, p, n] + ([p] if self._has_fail_idx else []) + [p]
        self._fn.restype = ctypes.c_int
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._lib = lib
        self._attrs = _MemcpyAttributes(src_access_order=_SRC_ACCESS_ORDER_STREAM)
        self._attr_idxs = (ctypes.c_size_t * 1)(0)

    @classmethod
    def load(cls) -> MemcpyBatch | None:
        lib = _find_cudart()
        try:
            return cls(lib) if lib is not None else None
        except (RuntimeError, AttributeError):
            return None

    def __call__(self, dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """dsts, srcs, sizes: host int64 tensors [count] of addresses and byte counts."""
        args = [dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), dsts.numel()]
        args += [ctypes.addressof(self._attrs), ctypes.addressof(self._attr_idxs), 1]
        fail_idx = ctypes.c_size_t(0)
        if self._has_fail_idx:
            args.append(ctypes.addressof(fail_idx))
        err = self._fn(*args, stream.cuda_stream)
        if err != 0:
            msg = self._lib.cudaGetErrorString(err).decode()
            raise RuntimeError(f"cudaMemcpyBatchAsync failed ({err}: {msg}) at copy {fail_idx.value}")


def block_addresses(pool: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Start address of each block: [len(ids)] int64 (a block is contiguous in this layout)."""
    block_bytes = pool[0].numel() * pool.element_size()
    return torch.tensor(ids, dtype=torch.int64) * block_bytes + pool.data_ptr()


# ---------------------------------------------------------------- CuPy gather/scatter kernel

_KERNEL = r"""
extern "C" __global__ void kv_block_copy(unsigned long long src_addr, unsigned long long dst_addr,
                                         unsigned long long ids_addr, long long num_pairs,
                                         long long vecs_per_block) {
  // ids: [2, num_pairs] (source ids, then destination ids); one grid row per block pair.
  const long long* ids = reinterpret_cast<const long long*>(ids_addr);
  const ulonglong2* src = reinterpret_cast<const ulonglong2*>(src_addr) + ids[blockIdx.x] * vecs_per_block;
  ulonglong2* dst = reinterpret_cast<ulonglong2*>(dst_addr) + ids[num_pairs + blockIdx.x] * vecs_per_block;
  for (long long i = (long long)blockIdx.y * blockDim.x + threadIdx.x; i < vecs_per_block;
       i += (long long)gridDim.y * blockDim.x) {
    dst[i] = src[i];
  }
}
"""
_THREADS = 256


class CupyCopier:
    """Whole-block gather/scatter by the SMs: host memory is read or written through its
    mapped (UVA) address, so one launch moves every block of a direction."""

    def __init__(self, block_bytes: int):
        import cupy

        if block_bytes % 16:
            raise ValueError("the CuPy copy moves 16-byte vectors; block size is not a multiple")
        self._cupy = cupy
        self._kernel = cupy.RawKernel(_KERNEL, "kv_block_copy")
        self._vecs = block_bytes // 16
        self._chunks = max(1, min(65535, -(-self._vecs // (_THREADS * 4))))

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, stream: torch.cuda.Stream) -> torch.Tensor:
        import numpy as np

        ids = torch.tensor([s for s, _ in pairs] + [d for _, d in pairs], dtype=torch.int64).pin_memory()
        ids_dev = ids.to(dst.device if dst.is_cuda else src.device, non_blocking=True)  # on `stream`
        args = (np.uint64(src.data_ptr()), np.uint64(dst.data_ptr()), np.uint64(ids_dev.data_ptr()))
        with self._cupy.cuda.ExternalStream(stream.cuda_stream):
            self._kernel((len(pairs), self._chunks), (_THREADS,), (*args, np.int64(len(pairs)), np.int64(self._vecs)))
        return ids_dev


# ---------------------------------------------------------------- the backend


def pick_copy_impl(copy_impl: str, batch: MemcpyBatch | None) -> str:
    if copy_impl not in COPY_IMPLS:
        raise ValueError(f"unknown copy implementation {copy_impl!r}; one of {', '.join(COPY_IMPLS)}")
    if copy_impl == "memcpy_batch" and batch is None:
        raise RuntimeError("cudaMemcpyBatchAsync is not available in this CUDA runtime (needs 12.8+)")
    if copy_impl == "auto":
        return "memcpy_batch" if batch is not None else "per_block"
    return copy_impl


class CudaBackend:
    """Two streams (one per direction) in duplex mode; one stream, so in then out in series,
    otherwise. Every completion is an event recorded after the direction's copies."""

    def __init__(self, pools: KVPools, mode: str, copy_impl: str = "auto"):
        self.pools = pools
        self.device = pools.device
        self.mode = mode
        self._batch = MemcpyBatch.load() if copy_impl in ("auto", "memcpy_batch") else None
        self._may_fall_back = copy_impl == "auto"
        if mode in ("batched", "duplex"):
            self.copy_impl = pick_copy_impl(copy_impl, self._batch)
        else:
            self.copy_impl = "per_segment" if mode == "naive" else "per_block"
        self._cupy = CupyCopier(pools.spec.block_bytes) if self.copy_impl == "cupy" else None
        in_stream = torch.cuda.Stream(self.device)
        self._streams = {IN: in_stream, OUT: torch.cuda.Stream(self.device) if mode == "duplex" else in_stream}

    def start(self, direction: str, pairs: Pairs, deps: list[Done], after_compute: bool = True) -> Done:
        if not pairs:
            return DONE
        stream = self._streams[direction]
        if after_compute:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for dep in deps:
            if dep.event is not None:
                stream.wait_event(dep.event)
        src, dst = (self.pools.dram, self.pools.hbm) if direction == IN else (self.pools.hbm, self.pools.dram)
        with torch.cuda.stream(stream):
            keepalive = self._copy(src, dst, pairs, stream)
            event = torch.cuda.Event()
            event.record(stream)
        return EventDone(event, keepalive)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, stream: torch.cuda.Stream) -> object:
        impl = self.copy_impl
        if impl == "per_segment":
            return copy_segments(src, dst, pairs, non_blocking=True)
        if impl == "per_block":
            return copy_blocks(src, dst, pairs, non_blocking=True)
        if impl == "cupy":
            return self._cupy(src, dst, pairs, stream)
        srcs = block_addresses(src, [s for s, _ in pairs])
        dsts = block_addresses(dst, [d for _, d in pairs])
        sizes = torch.full_like(srcs, self.pools.spec.block_bytes)
        try:
            self._batch(dsts, srcs, sizes, stream)
        except RuntimeError as e:
            if not self._may_fall_back:
                raise
            # Redoing every copy is safe: each is a whole block from an unchanged source.
            warnings.warn(f"{e}; copying one block at a time from now on", RuntimeWarning, stacklevel=2)
            self.copy_impl = "per_block"
            return copy_blocks(src, dst, pairs, non_blocking=True)
        return srcs, dsts, sizes

    def close(self) -> None:
        for stream in set(self._streams.values()):
            stream.synchronize()
