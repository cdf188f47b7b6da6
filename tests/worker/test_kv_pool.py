"""KV pool memory as an operator sees it: with `--kv-prefault`, host pools are resident
from the start, so RSS does not grow as rotation first touches blocks. Residency is read
page by page from the kernel (mincore)."""

from __future__ import annotations

import ctypes
import os

import pytest
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


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                if inside:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and ":" in head:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def test_cpu_pools_may_take_transparent_huge_pages():
    """Where the kernel gives huge pages on request (THP "madvise", the common setting) both
    pools of a CPU worker ask for them: attention's block-scattered reads then walk no 4 KB
    page tables. Eligibility is the kernel's word for the pool's mapping."""
    mode = _thp_mode()
    if mode == "never":
        pytest.skip("transparent huge pages are off on this kernel")
    with KVPools(SPEC, NUM_BLOCKS, NUM_BLOCKS, "cpu") as pools:
        for pool in (pools.hbm, pools.dram):
            assert pool.data_ptr() % (2 << 20) == 0
            assert _mapping_of(pool.data_ptr()).get("THPeligible") == "1", mode
