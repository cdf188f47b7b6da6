"""CUDA backend of the transfer engine: a stream per direction, an event per completion.

Copy implementations of the batched modes (`copy_impl`):
    memcpy_batch  one `cudaMemcpyBatchAsync` per direction (CUDA runtime ≥ 12.8), through
                  ctypes on the runtime library torch itself loaded;
    per_block     one async copy per whole block (what `auto` falls back to);
    cupy          a CuPy raw kernel that gathers/scatters whole blocks with 16-byte loads
                  over mapped host memory (no copy engine involved).
The host pool is page-locked (see kv_pool), so every copy is a DMA that the host only queues.

Streams and events come from a torch.cuda-like module (`cuda`): torch.cuda itself, or, in the
CPU tests that check the ordering, a stand-in that records every stream and event call.
"""

from __future__ import annotations

import ctypes
import warnings

import torch

from services.worker.copies import DONE, IN, OUT, Done, Pairs, StallProbe, copy_blocks, copy_segments
from services.worker.kv_pool import KVPools

COPY_IMPLS = ("auto", "memcpy_batch", "per_block", "cupy")
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream


class EventDone(Done):
    """Completion of copies queued on a stream; holds what the copies read until they end."""

    def __init__(self, event, cuda, device: torch.device, keepalive: object = None):
        self.event = event
        self._cuda = cuda
        self._device = device
        self._keepalive = keepalive

    def wait(self) -> None:
        self.event.synchronize()

    def ready(self) -> bool:
        return self.event.query()

    def fence(self, stream=None) -> StallProbe:
        """`stream` (default: the device's current one) waits for the event on the device;
        the host goes on. The probe reads how long the stream waited, from two timing events
        around the wait: call it once the work queued after the fence has finished."""
        stream = stream if stream is not None else self._cuda.current_stream(self._device)
        before, after = self._cuda.Event(enable_timing=True), self._cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(self.event)
        after.record(stream)

        def stalled_s() -> float:
            after.synchronize()
            return before.elapsed_time(after) / 1000.0

        return stalled_s


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


def cudart_candidates() -> list[str]:
    """CUDA runtimes to try, in order: those already loaded in this process (torch's own
    first: the same library instance, so the same context), then the sonames by version."""
    try:
        with open("/proc/self/maps") as f:
            loaded = [line.split()[-1] for line in f if "libcudart.so" in line]
    except OSError:
        loaded = []
    return list(dict.fromkeys([*loaded, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]))


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
    def load(cls, candidates: list[str] | None = None) -> MemcpyBatch | None:
        """The first runtime among `candidates` that has the call (an older one loaded
        earlier in the process does not hide a newer one beside it), or None."""
        for name in cudart_candidates() if candidates is None else candidates:
            try:
                return cls(ctypes.CDLL(name))
            except (OSError, RuntimeError, AttributeError):
                continue
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


_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


def device_address(cupy, t: torch.Tensor, device_index: int) -> int:
    """The address kernels on the device use for `t`'s memory: its own for device memory; for
    page-locked host memory the mapped device pointer (cudaPointerGetAttributes), which equals
    the host pointer only where the device says it can use host pointers of registered memory."""
    if t.is_cuda:
        return t.data_ptr()
    runtime = cupy.cuda.runtime
    try:
        mapped = runtime.pointerGetAttributes(t.data_ptr()).devicePointer
    except runtime.CUDARuntimeError:
        mapped = 0
    if mapped:
        return mapped
    if runtime.deviceGetAttribute(_CAN_USE_HOST_POINTER, device_index):
        return t.data_ptr()
    raise RuntimeError(
        "the DRAM pool has no device address on this device (not page-locked and mapped, and "
        "the device cannot use host pointers of registered memory): the cupy copy cannot run"
    )


class CupyCopier:
    """Whole-block gather/scatter by the SMs: host memory is read or written through its
    mapped device address, so one launch moves every block of a direction.

    Built at worker start: the kernel is compiled for the pools' device then (a missing NVRTC
    fails there, not at the first swap), and each pool's device address is resolved once."""

    def __init__(self, pools: KVPools):
        import cupy

        block_bytes = pools.spec.block_bytes
        if block_bytes % 16:
            raise ValueError("the CuPy copy moves 16-byte vectors; block size is not a multiple")
        self._cupy = cupy
        self._device_index = pools.device.index
        self._vecs = block_bytes // 16
        self._chunks = max(1, min(65535, -(-self._vecs // (_THREADS * 4))))
        with cupy.cuda.Device(self._device_index):
            self._kernel = cupy.RawKernel(_KERNEL, "kv_block_copy")
            try:
                self._kernel.compile()
            except Exception as e:
                raise RuntimeError(f"the cupy copy kernel does not compile on {pools.device}: {e}") from e
            self._address = {id(t): device_address(cupy, t, self._device_index) for t in (pools.hbm, pools.dram)}
        self._device = pools.device

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, stream) -> torch.Tensor:
        import numpy as np

        ids = torch.tensor([s for s, _ in pairs] + [d for _, d in pairs], dtype=torch.int64).pin_memory()
        ids_dev = ids.to(self._device, non_blocking=True)  # on `stream`
        args = (np.uint64(self._address[id(src)]), np.uint64(self._address[id(dst)]), np.uint64(ids_dev.data_ptr()))
        with self._cupy.cuda.Device(self._device_index), self._cupy.cuda.ExternalStream(stream.cuda_stream):
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
    otherwise. Every completion is an event recorded after the direction's copies.

    Compute runs on the device's current stream. Copies started with `after_compute` wait,
    on the device, for an event recorded there when they are queued: the end of the compute
    queued so far (a step's swap-outs are queued before its own compute, so they wait for the
    step that wrote their blocks). Copies started without it (a later step's prefetched
    swap-ins) run beside the compute. No call here blocks the host."""

    def __init__(self, pools: KVPools, mode: str, copy_impl: str = "auto", cuda=torch.cuda):
        self.pools = pools
        self.device = pools.device
        self.mode = mode
        self._cuda = cuda
        self._batch = MemcpyBatch.load() if copy_impl in ("auto", "memcpy_batch") else None
        self._may_fall_back = copy_impl == "auto"
        if mode in ("batched", "duplex"):
            self.copy_impl = pick_copy_impl(copy_impl, self._batch)
        else:
            self.copy_impl = "per_segment" if mode == "naive" else "per_block"
        self._cupy = CupyCopier(pools) if self.copy_impl == "cupy" else None
        in_stream = cuda.Stream(self.device)
        self._streams = {IN: in_stream, OUT: cuda.Stream(self.device) if mode == "duplex" else in_stream}

    def start(self, direction: str, pairs: Pairs, deps: list[Done], after_compute: bool = True) -> Done:
        if not pairs:
            return DONE
        stream = self._streams[direction]
        if after_compute:
            computed = self._cuda.Event()
            computed.record(self._cuda.current_stream(self.device))
            stream.wait_event(computed)
        for dep in deps:
            if dep.event is not None:
                stream.wait_event(dep.event)
        src, dst = (self.pools.dram, self.pools.hbm) if direction == IN else (self.pools.hbm, self.pools.dram)
        with self._cuda.stream(stream):
            keepalive = self._copy(src, dst, pairs, stream)
            event = self._cuda.Event()
            event.record(stream)
        return EventDone(event, self._cuda, self.device, keepalive)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, stream) -> object:
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
