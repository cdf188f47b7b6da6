"""What the scheduler tells gateways of its prefix cache: the blocks it gained and dropped in
HBM and DRAM since its previous load report (`protocol.CacheEvents`), so a gateway routes a
request to where its prefix lives (services/gateway/routing.py).

    core's pools (hash -> block) ──diff against what was told──▶ CacheEvents (<= MAX_CACHE_EVENTS)
                                                                  cache_seq + 1 on every report

It diffs each pool's hash index against the set it last reported, so it needs no hook in the
core: a set difference per pool and report, O(cached blocks) in C, and `block_key` only for what
changed. What does not fit in one report's budget is left out of the told set and so shows up
in the next diff. A gateway that missed a report (or is new) asks for a `snapshot`: the told
sets, which the events numbered up to `seq` describe. A new core (a restarted worker) is simply
a pool with nothing in it: its first diff drops everything.
"""

from __future__ import annotations

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


class CacheReport:
    def __init__(self, max_events: int = MAX_CACHE_EVENTS) -> None:
        self.max_events = max_events
        self.seq = 0  # reports that carried events so far
        self.hbm: dict[bytes, int] = {}  # hash -> block_key, as the gateways were told
        self.dram: dict[bytes, int] = {}

    def core_events(self, core) -> CacheEvents | None:
        """`events` of a core's two pools (None: no core; everything it held is dropped)."""
        m = core.memory if core is not None else None
        return self.events(m and m.hbm.index, m and m.dram.index)

    def events(self, hbm_index: dict[bytes, int] | None, dram_index: dict[bytes, int] | None) -> CacheEvents | None:
        """The changes since the last call (None when there are none); `*_index`: the pools'
        hash -> block maps (None: no core)."""
        budget = [self.max_events]
        hbm_added, hbm_removed = _diff(self.hbm, hbm_index or {}, budget)
        dram_added, dram_removed = _diff(self.dram, dram_index or {}, budget)
        if not (hbm_added or hbm_removed or dram_added or dram_removed):
            return None
        self.seq += 1
        return CacheEvents(hbm_added, hbm_removed, dram_added, dram_removed)

    def snapshot(self) -> CacheEvents:
        return CacheEvents(list(self.hbm.values()), [], list(self.dram.values()), [], snapshot=True)


def _diff(told: dict[bytes, int], now: dict[bytes, int], budget: list[int]) -> tuple[list[int], list[int]]:
    """Update `told` towards `now` by at most budget[0] changes (drops first: a gateway then
    never prefers a replica for a block it lost); (added, removed) keys."""
    removed: list[int] = []
    for h in told.keys() - now.keys():
        if budget[0] <= 0:
            break
        removed.append(told.pop(h))
        budget[0] -= 1
    added: list[int] = []
    for h in now.keys() - told.keys():
        if budget[0] <= 0:
            break
        told[h] = k = block_key(h)
        added.append(k)
        budget[0] -= 1
    return added, removed
