"""What the scheduler tells gateways of its prefix cache: the blocks it gained and dropped in
HBM and DRAM since its previous load report (`protocol.CacheEvents`), so a gateway routes a
request to where its prefix lives (services/gateway/routing.py).

    pool.index (hash -> block) ──LoggedIndex notes each hash set or deleted──▶ changes
    changes vs what gateways were told ──▶ CacheEvents (<= MAX_CACHE_EVENTS), cache_seq + 1

The first report from a core swaps each pool's hash index for a `LoggedIndex`, a dict that
notes which hashes came and went (the pools only ever set and delete its items), so a report
costs O(changes), not O(cached blocks): a diff of the whole index took ~5 ms at 12k cached
blocks and ~250 ms at GH200 sizes (120k) on this machine. A hash that came and went between
two reports is not told at all. Changes past one report's budget wait for the next. A gateway
that missed a report (or is new) asks for a `snapshot`: the told sets, which the events
numbered up to `seq` describe. A new core (a restarted worker) starts empty: every block told
of the old one is dropped in the next reports.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from shared.protocol import MAX_CACHE_EVENTS, CacheEvents, SchedulerStats, block_key

# SchedulerStats fields taken as they are from the core's stats().
STATS_COUNTS = [f for f in SchedulerStats.__struct_fields__ if f.startswith("num_")]


def core_report(core) -> dict:
    """The load report's fields that a `SchedulerCore` knows (the live service and the
    simulator's replicas both report them): its counts, the prompt tokens waiting, and what
    the gateway's TTFT prediction needs (the step-time fit, the token budget, a block's copy
    time)."""
    counts = {**core.stats(), "num_queued_tokens": core.num_waiting_tokens}
    fit, cfg = core.step_time.fit(), core.cfg
    return {
        **{k: counts.get(k, 0) for k in STATS_COUNTS},
        "step_s": fit[0] if fit else 0.0,
        "prefill_s_per_token": fit[1] if fit else 0.0,
        "max_batched_tokens": cfg.max_batched_tokens,
        "block_copy_s": cfg.block_bytes / (cfg.copy_gbps * 1e9) if cfg.copy_gbps > 0 else 0.0,
        "max_num_seqs": cfg.max_num_seqs,
    }


class LoggedIndex(dict):
    """A pool's hash -> block index that notes, per hash, whether it is there after its last
    change (`changed`), until the report takes the note."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.changed: dict[bytes, bool] = dict.fromkeys(self, True)

    def __setitem__(self, h: bytes, b: int) -> None:
        super().__setitem__(h, b)
        self.changed[h] = True

    def __delitem__(self, h: bytes) -> None:
        super().__delitem__(h)
        self.changed[h] = False


class _Told:
    """One pool, as the gateways were told it."""

    def __init__(self) -> None:
        self.keys: dict[bytes, int] = {}  # hash -> block_key
        self.index: LoggedIndex | None = None  # the pool's index being watched

    def watch(self, pool) -> LoggedIndex:
        """`pool`'s index, logged; a pool new to us (a new core) first drops what was told."""
        if not isinstance(pool.index, LoggedIndex):
            pool.index = LoggedIndex(pool.index)
        if pool.index is not self.index:
            self.index = pool.index
            for h in self.keys:
                self.index.changed.setdefault(h, False)
        return self.index

    def changes(self, budget: list[int]) -> tuple[list[int], list[int]]:
        """Up to budget[0] (added, removed) keys taken from the index's notes."""
        added: list[int] = []
        removed: list[int] = []
        changed = self.index.changed
        for h in list(itertools.islice(changed, max(0, budget[0]))):
            there = changed.pop(h) and h in self.index
            if there and h not in self.keys:
                self.keys[h] = k = block_key(h)
                added.append(k)
            elif not there and h in self.keys:
                removed.append(self.keys.pop(h))
        budget[0] -= len(added) + len(removed)
        return added, removed


class CacheReport:
    def __init__(self, max_events: int = MAX_CACHE_EVENTS) -> None:
        self.max_events = max_events
        self.seq = 0  # reports that carried events so far
        self.hbm, self.dram = _Told(), _Told()
        self._empty: SimpleNamespace | None = None

    def core_events(self, core) -> CacheEvents | None:
        """The changes of `core`'s pools since the last call (None: none); `core` None (no
        worker): everything told is dropped."""
        if core is None:  # the same empty pools while no worker is ready
            core = self._empty = self._empty or _no_core()
        else:
            self._empty = None
        self.hbm.watch(core.memory.hbm)
        self.dram.watch(core.memory.dram)
        budget = [self.max_events]
        hbm_added, hbm_removed = self.hbm.changes(budget)
        dram_added, dram_removed = self.dram.changes(budget)
        if not (hbm_added or hbm_removed or dram_added or dram_removed):
            return None
        self.seq += 1
        return CacheEvents(hbm_added, hbm_removed, dram_added, dram_removed)

    def snapshot(self) -> CacheEvents:
        return CacheEvents(list(self.hbm.keys.values()), [], list(self.dram.keys.values()), [], snapshot=True)


def _no_core() -> SimpleNamespace:
    """What a scheduler without a worker reports: pools with nothing in them."""
    pool = lambda: SimpleNamespace(index=LoggedIndex())  # noqa: E731
    return SimpleNamespace(memory=SimpleNamespace(hbm=pool(), dram=pool()))
