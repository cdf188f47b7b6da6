"""KV pool memory as an operator sees it: with `--kv-prefault`, host pools are resident
from the start (RSS does not grow as rotation first touches blocks); without, they cost
nothing until used."""

from __future__ import annotations

import os

import torch

from services.worker.kv_pool import KVPools, KVSpec

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32)  # 64 KiB blocks
NUM_BLOCKS = 1024  # 64 MiB per pool


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def grown_by(prefault: bool) -> tuple[int, int]:
    before = rss_bytes()
    with KVPools(SPEC, NUM_BLOCKS, NUM_BLOCKS, "cpu", prefault=prefault) as pools:
        grown = rss_bytes() - before
        pool_bytes = pools.hbm.nbytes + pools.dram.nbytes
    return grown, pool_bytes


def test_prefaulted_pools_are_resident_at_once():
    grown, pool_bytes = grown_by(prefault=True)
    assert grown >= 0.9 * pool_bytes, (grown, pool_bytes)


def test_pools_cost_nothing_until_used_without_prefault():
    grown, pool_bytes = grown_by(prefault=False)
    assert grown < 0.1 * pool_bytes, (grown, pool_bytes)
