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
   request, or a synced HBM block that already has a DRAM mirror) is freed at once, or,
   when a step still in flight computes on it or swaps it in, once that step has
   reported (`Memory.free_hbm`). So a plan's swap-ins never target a block the step
   computing before it touches, and the worker can start them during that step. This is
   what eager rotation buys: a preempted request's mirrored blocks are reusable at once
   (or one step later) and only its dirty last block is copied.
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
        self._deferred: list[tuple[int, list[int]]] = []  # (step id, blocks), step ids ascending
        self.num_deferred = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{self.name}: {n} blocks asked, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        return out

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))

    def defer(self, ids: list[int], step_id: int) -> None:
        """Free once the result of step `step_id` is in (rules 1 and 2 above)."""
        if not ids:
            return
        i = bisect.bisect_right(self._deferred, step_id, key=lambda e: e[0])
        if i and self._deferred[i - 1][0] == step_id:
            self._deferred[i - 1][1].extend(ids)
        else:
            self._deferred.insert(i, (step_id, list(ids)))
        self.num_deferred += len(ids)

    def release_through(self, step_id: int) -> None:
        while self._deferred and self._deferred[0][0] <= step_id:
            _, ids = self._deferred.pop(0)
            self._free.extend(ids)
            self.num_deferred -= len(ids)

    def free_ids(self) -> list[int]:
        return self._free + [b for _, ids in self._deferred for b in ids]
