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
stream, swap-out and eager copies on the device->host stream, full duplex). So:

1. A block that a plan *reads* in a copy is not handed out again in that same plan:
   an HBM block that is the source of a swap-out and a DRAM block that is the source of a
   swap-in are released with `defer()` and become free when the plan is finished
   (`release_deferred()`), i.e. usable from the next plan on. Hence a swap-in never
   targets an HBM block whose swap-out is still in flight in the same step.
2. A block whose content is no longer needed (a finished, aborted or recompute-preempted
   request, or a synced HBM block that already has a DRAM mirror) is freed at once and may
   be a swap-in target or a compute target in the same plan. This is what eager rotation
   buys: a preempted request's mirrored blocks are reusable immediately and only its
   dirty last block is copied.
3. Across plans, the worker keeps per-block events: a copy that touches a block waits for
   the earlier plan's compute or copy that touched it (plans are applied in order). In
   particular, when plan t+1 is planned while t runs, a swap-in of t+1 may target a block
   that t's compute still reads (its previous owner was preempted or finished in t+1).
"""

from __future__ import annotations


class BlockPool:
    """Free list of one tier. LIFO reuse keeps recently used blocks hot."""

    def __init__(self, num_blocks: int, name: str) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._deferred: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_deferred(self) -> int:
        return len(self._deferred)

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

    def defer(self, ids: list[int]) -> None:
        """Free once the current plan is finished (rule 1 above)."""
        self._deferred.extend(ids)

    def release_deferred(self) -> None:
        if self._deferred:
            self._free.extend(self._deferred)
            self._deferred.clear()

    def free_ids(self) -> list[int]:
        return self._free + self._deferred
