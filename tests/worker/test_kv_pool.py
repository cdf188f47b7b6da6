"""KV pool memory as an operator sees it: with `--kv-prefault`, host pools are resident
from the start, so RSS does not grow as rotation first touches blocks. Residency is read
page by page from the kernel (mincore)."""

from __future__ import annotations

import ctypes
import os

import torch

from services.worker.kv_pool import KVPools, KVSpec

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32)  # 128 KiB blocks
NUM_BLOCKS = 512  # 64 MiB per pool
PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)


def resident_share(t: torch.Tensor) -> float:
    """Share of the tensor's whole pages that are in RAM now."""
    start = -(-t.data_ptr() // PAGE) * PAGE
    num_pages = (t.data_ptr() + t.nbytes - start) // PAGE
    vec = (ctypes.c_ubyte * num_pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(num_pages * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) / num_pages


def test_prefaulted_pools_are_resident_at_once():
    with KVPools(SPEC, NUM_BLOCKS, NUM_BLOCKS, "cpu", prefault=True) as pools:
        assert resident_share(pools.hbm) == 1.0
        assert resident_share(pools.dram) == 1.0
