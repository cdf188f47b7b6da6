"""The two KV-cache pools, HBM and DRAM, in the block-first layout.

One pool tensor per tier; one block is one contiguous region across all layers, so moving a
block between tiers is one copy, not `num_layers × 2` (vLLM's layer-first layout):

    pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

    block 0  ┌────────────┬────────────┬────────────┬─────┬──────────────────┐
             │ L0 K       │ L0 V       │ L1 K       │ ... │ L(num_layers-1) V│  one region,
             │[bs, H, D]  │[bs, H, D]  │[bs, H, D]  │     │ [bs, H, D]       │  block_bytes long
    block 1  ├────────────┼────────────┼────────────┼─────┼──────────────────┤
     ...     └────────────┴────────────┴────────────┴─────┴──────────────────┘
    attention reads layer l's keys as the strided view pool[:, l, 0]: [num_blocks, bs, H, D]

The HBM pool lives on the compute device (on CPU it is a second host tensor); the DRAM pool
lives in host memory, page-locked when the device is CUDA so copies run as DMA. Torch's
pinned allocator rounds each allocation up to a power of two and caches it, so a large pool
is allocated as plain host memory and registered with the CUDA runtime instead. Unpinned host
pools (a CPU worker's both) ask the kernel for transparent huge pages (host_memory.py).

Nothing here decides which block holds what: the scheduler owns the block tables.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.host_memory import aligned_host_tensor, huge_page_host_tensor
from shared.config import DEFAULT_BLOCK_SIZE, kv_block_bytes, kv_segment_bytes

if TYPE_CHECKING:  # the pools need only the model's shape; keep msgspec out of this import
    from shared.modelfile import ModelConfig

# Largest DRAM pool allocated through torch's pinned allocator; above it, register instead.
PIN_DIRECT_MAX_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_FRACTION = 0.9  # of the device's memory, in use by this process in total
DEFAULT_CPU_MEMORY_FRACTION = 0.25  # of the RAM available now (DRAM pool and model share it)
_PAGE = 4096
_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped


@dataclass(frozen=True)
class KVSpec:
    """Shape and dtype of one KV block; everything sizing and copying needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: torch.dtype = torch.float16

    @classmethod
    def from_model(
        cls, cfg: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.float16
    ) -> KVSpec:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """[num_layers, 2, block_size, num_kv_heads, head_dim]"""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def segment_bytes(self) -> int:
        """Bytes of one layer's K (or V) of one block: the unit vLLM's layout copies."""
        return kv_segment_bytes(self.num_kv_heads, self.head_dim, self.block_size, self.dtype.itemsize)

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype.itemsize)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)


# Block shapes of the models the benchmarks quote (fp16 KV, block_size 16).
MODEL_KV_SPECS: dict[str, KVSpec] = {
    "smollm2": KVSpec(num_layers=30, num_kv_heads=3, head_dim=64),
    "llama3-8b": KVSpec(num_layers=32, num_kv_heads=8, head_dim=128),
    "qwen2.5-32b": KVSpec(num_layers=64, num_kv_heads=8, head_dim=128),
}


# ---------------------------------------------------------------- sizing


def blocks_in(spec: KVSpec, num_bytes: float) -> int:
    return max(0, int(num_bytes // spec.block_bytes))


def num_dram_blocks(spec: KVSpec, dram_gb: float) -> int:
    """Blocks of the DRAM pool from `--dram-gb` (GiB, like vLLM's --swap-space)."""
    return blocks_in(spec, dram_gb * (1 << 30))


def num_hbm_blocks(
    spec: KVSpec,
    device: torch.device | str,
    hbm_blocks: int | None = None,
    memory_fraction: float | None = None,
) -> int:
    """Blocks of the HBM pool: `--hbm-blocks` when given, else what fits in a memory fraction.

    On CUDA the fraction is of the device's total memory, minus what is already in use (so
    size the pool after the weights are loaded); on CPU it is of the RAM available now.
    """
    if hbm_blocks is not None:
        return hbm_blocks
    device = torch.device(device)
    if device.type == "cuda":
        fraction = DEFAULT_GPU_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        free, total = torch.cuda.mem_get_info(device)
        return blocks_in(spec, fraction * total - (total - free))
    fraction = DEFAULT_CPU_MEMORY_FRACTION if memory_fraction is None else memory_fraction
    return blocks_in(spec, fraction * available_ram_bytes())


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (free pages alone undercount reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- host memory


def _cuda_host_register(t: torch.Tensor) -> None:
    num_bytes = t.numel() * t.element_size()
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), num_bytes, _HOST_REGISTER_PORTABLE_MAPPED)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")
    except (AttributeError, TypeError):  # torch without the binding: CuPy has one
        import cupy

        cupy.cuda.runtime.hostRegister(t.data_ptr(), num_bytes, _HOST_REGISTER_PORTABLE_MAPPED)


def _cuda_host_unregister(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except (AttributeError, TypeError):
        import cupy

        cupy.cuda.runtime.hostUnregister(t.data_ptr())


def alloc_host_pool(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, bool]:
    """(tensor, registered): page-locked when `pin`; `registered` says it must be unregistered."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if not pin:
        return huge_page_host_tensor(shape, dtype), False
    if num_bytes <= PIN_DIRECT_MAX_BYTES:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True), False
        except RuntimeError:
            pass  # the pinned allocator refused: register plain memory instead
    t = aligned_host_tensor(shape, dtype, _PAGE)  # what cudaHostRegister wants
    _cuda_host_register(t)
    return t, True


# ---------------------------------------------------------------- the pools


class KVPools:
    """The HBM pool (on `device`) and the DRAM pool (host), same block-first layout.

    The model runner reads and writes `hbm` in place; the transfer engine copies whole blocks
    between the two. Call `close()` (or use as a context manager) to give the memory back.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_hbm_blocks: int,
        num_dram_blocks: int,
        device: torch.device | str = "cpu",
        prefault: bool = False,
    ):
        """`prefault`: write both pools once now, so that host memory is resident from the
        start (as device and pinned memory always are): no page faults while serving, a
        shortfall shows at start, and RSS is flat from the first request."""
        self.spec = spec
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # hbm, dram: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        shape = spec.pool_shape(num_hbm_blocks)
        if self.device.type == "cpu":
            self.hbm = huge_page_host_tensor(shape, spec.dtype)
        else:
            self.hbm = torch.empty(shape, dtype=spec.dtype, device=self.device)
        self.dram, self._registered = alloc_host_pool(
            spec.pool_shape(num_dram_blocks), spec.dtype, pin=self.device.type == "cuda"
        )
        if prefault:
            self.hbm.zero_()
            self.dram.zero_()

    @property
    def num_hbm_blocks(self) -> int:
        return self.hbm.shape[0]

    @property
    def num_dram_blocks(self) -> int:
        return self.dram.shape[0]

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer in the HBM pool, each [num_blocks, block_size, num_kv_heads, head_dim]
        (strided views: writes land in the pool)."""
        return self.hbm[:, layer, 0], self.hbm[:, layer, 1]

    def close(self) -> None:
        if self._registered:
            torch.cuda.synchronize(self.device)
            _cuda_host_unregister(self.dram)
            self._registered = False
        self.hbm = self.dram = torch.empty(0)

    def __enter__(self) -> KVPools:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
