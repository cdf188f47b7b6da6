"""Block pools of the two KV tiers (HBM and DRAM) and the rule for reusing a block.

Ownership is kept on the requests (`Request.hbm_blocks`, `Request.dram_blocks`); a pool
only knows which of its blocks are free. Per-block state is derived, not stored:

    RUNNING request, block i:  live copy in HBM;
                               synced  iff (i + 1) * block_size <= num_computed_tokens;
                               mirrored iff i < len(dram_blocks) (a DRAM copy exists).
    ROTARY request, block i:   live copy in DRAM (all of its KV); nothing in HBM.

Mirrors are always a prefix of the block table because blocks fill in order.

Reuse rule (the only place it is written down)
----------------------------------------------
The worker applies a plan's copies and compute concurrently (swap-in on the host->device
stream, swap-out and eager copies on the device->host stream, full duplex), and with the
cross-iteration pipeline it starts plan t+1's copies while plan t still runs. So:

1. A block that a plan *reads* in a copy is not handed out again until that plan's
   result has come back (`update`): an HBM block that is the source of a swap-out and a
   DRAM block that is the source of a swap-in are released with `defer(ids, step_id)`
   and become free in `release_through(step_id)`. Hence a swap-in never targets an HBM
   block whose swap-out is still in flight, neither in the same step nor in a plan
   built while that step runs. (The worker reports a step only once its copies are done.)
2. A block whose content is no longer needed (a finished, aborted or recompute-preempted
   request, or a synced HBM block that already has a DRAM mirror) is free at once. If a
   step still in flight computes on it or swaps it in, it is "recent" until that step
   has reported (`Memory.free_hbm`): compute may take it at once (steps compute in
   order), but a swap-in never targets it (`Memory.can_swap_in`: the request comes back
   a step later instead), so the worker can always start a plan's swap-ins while the
   step before it computes. This is what
   eager rotation buys: a preempted request's mirrored blocks are reusable at once and
   only its dirty last block is copied.
3. Plans are applied in order. What remains for the worker: a plan's swap-outs and
   eager copies may read blocks that the step before it is still writing (so they start
   only once that step's compute is done), and a DRAM block freed under rule 2 may be
   written by a plan while an earlier copy into it still runs (the transfer engine
   orders copies that share a block).
"""

from __future__ import annotations

import bisect


class BlockPool:
    """Free list of one tier. LIFO reuse keeps recently used blocks hot."""

    def __init__(self, num_blocks: int, name: str) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._recent: list[tuple[int, list[int]]] = []  # free, but an in-flight step touches them
        self.num_recent = 0
        self._deferred: list[tuple[int, list[int]]] = []  # (step id, blocks), step ids ascending
        self.num_deferred = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_recent

    @property
    def num_clean(self) -> int:
        """Free blocks no step in flight touches: the ones a swap-in may target."""
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """`n` free blocks, recent ones (rule 2) first: they suit compute, not copies."""
        if n > self.num_free:
            raise RuntimeError(f"{self.name}: {n} blocks asked, {self.num_free} free")
        recent = self._take_recent(min(n, self.num_recent))
        return recent + self._take_free(n - len(recent))

    def allocate_clean(self, n: int) -> list[int]:
        """`n` free blocks that no step in flight touches (copy targets)."""
        if n > len(self._free):
            raise RuntimeError(f"{self.name}: {n} clean blocks asked, {len(self._free)} free")
        return self._take_free(n)

    def _take_free(self, n: int) -> list[int]:
        if n <= 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        return out

    def _take_recent(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            step_id, ids = self._recent[-1]
            k = min(n - len(out), len(ids))
            out += ids[len(ids) - k :]
            del ids[len(ids) - k :]
            if not ids:
                self._recent.pop()
        self.num_recent -= len(out)
        return out

    def free(self, ids: list[int], busy_step: int | None = None) -> None:
        """Return blocks; `busy_step`: a step still in flight touches them (rule 2)."""
        if busy_step is None:
            self._free.extend(reversed(ids))
        elif ids:
            _insert(self._recent, busy_step, ids)
            self.num_recent += len(ids)

    def defer(self, ids: list[int], step_id: int) -> None:
        """Free once the result of step `step_id` is in (rule 1 above)."""
        if ids:
            _insert(self._deferred, step_id, ids)
            self.num_deferred += len(ids)

    def release_through(self, step_id: int) -> None:
        while self._deferred and self._deferred[0][0] <= step_id:
            _, ids = self._deferred.pop(0)
            self._free.extend(ids)
            self.num_deferred -= len(ids)
        while self._recent and self._recent[0][0] <= step_id:
            _, ids = self._recent.pop(0)
            self._free.extend(ids)
            self.num_recent -= len(ids)

    def free_ids(self) -> list[int]:
        return self._free + [b for lst in (self._recent, self._deferred) for _, ids in lst for b in ids]


def _insert(lists: list[tuple[int, list[int]]], step_id: int, ids: list[int]) -> None:
    """Add `ids` under `step_id`, keeping step ids ascending."""
    i = bisect.bisect_right(lists, step_id, key=lambda e: e[0])
    if i and lists[i - 1][0] == step_id:
        lists[i - 1][1].extend(ids)
    else:
        lists.insert(i, (step_id, list(ids)))
