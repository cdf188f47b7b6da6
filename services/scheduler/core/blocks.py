"""Block pools of the two KV tiers (HBM and DRAM) and the rule for reusing a block.

Ownership is kept on the requests (`Request.hbm_blocks`, `Request.dram_blocks`); a pool
knows how many requests hold each block (`ref`) and which of its blocks are free. Per-block
state is derived, not stored:

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

Prefix caching (HBM)
--------------------
A full HBM block whose tokens are all known may carry a hash (prefix.py: a chain over the
tokens of every block up to it). Requests whose prompts share those tokens share the block:
`ref[b]` counts the requests that list it. A block whose count drops to 0 keeps its hash
and stays *cached*: free for allocation (it counts in `num_free`), evicted least recently
freed first and only once no plain free block is left, and found again by its hash until
then (`revive`). The reuse rule holds for it as for any block: a cached block that an
in-flight step touches is taken by compute only, never as a swap-in target, until that step
reports; a block freed as a swap-out source (`defer`) stays out of every free list until its
step reports, even if a request revives it meanwhile and drops it again. Sharing only ever
*reads* a block (compute reads it; copies read it), so a shared block is never moved: a
request that lets go of one (finish, preemption, rotation) only lowers its count.

    block b:  ref[b] > 0            held by ref[b] requests (hash or not)
              ref[b] == 0, hashed   cached (evictable, LRU) or deferred
              ref[b] == 0, no hash  free, recent or deferred
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Free list of one tier, reference counts, and (HBM) the cache of hashed free blocks.
    LIFO reuse keeps recently used blocks hot."""

    def __init__(self, num_blocks: int, name: str) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks  # requests holding each block
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._recent: list[tuple[int, list[int]]] = []  # free, but an in-flight step touches them
        self.num_recent = 0
        self._deferred: list[tuple[int, list[int]]] = []  # (step id, blocks), step ids ascending
        self._deferred_until: dict[int, int] = {}  # deferred block -> the step it waits for
        self.num_deferred = 0  # deferred blocks no request has revived
        # Prefix cache: hash <-> block for full blocks, and the hashed blocks no request holds
        # (LRU first). `_busy`: cached blocks an in-flight step touches (block -> step id).
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.index: dict[bytes, int] = {}
        # Hashes someone watches (`watch`): hash -> {key: (the answer kept, its position)}.
        self._watched: dict[bytes, dict[object, tuple[dict[int, int], int]]] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._busy: dict[int, int] = {}
        self._busy_steps: list[tuple[int, list[int]]] = []
        # With `track_cached`: blocks that became cached, for the DRAM tier to drain (tier.py).
        self.track_cached = False
        self.newly_cached: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_recent + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks that keep their content for a later prefix hit."""
        return len(self._cached)

    @property
    def num_clean(self) -> int:
        """Free blocks no step in flight touches: the ones a swap-in may target."""
        return len(self._free) + len(self._cached) - len(self._busy)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """`n` free blocks, recent ones (rule 2) first: they suit compute, not copies;
        cached ones last, least recently freed first."""
        if n > self.num_free:
            raise RuntimeError(f"{self.name}: {n} blocks asked, {self.num_free} free")
        out = self._take_recent(min(n, self.num_recent))
        out += self._take_free(min(n - len(out), len(self._free)))
        out += self._evict(n - len(out), clean=False)
        self._hold(out)
        return out

    def allocate_clean(self, n: int) -> list[int]:
        """`n` free blocks that no step in flight touches (copy targets)."""
        if n > self.num_clean:
            raise RuntimeError(f"{self.name}: {n} clean blocks asked, {self.num_clean} free")
        out = self._take_free(min(n, len(self._free)))
        out += self._evict(n - len(out), clean=True)
        self._hold(out)
        return out

    def _hold(self, ids: list[int]) -> None:
        for b in ids:
            self.ref[b] = 1

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

    def _evict(self, n: int, clean: bool) -> list[int]:
        """`n` cached blocks, least recently freed first, their hashes forgotten; `clean`:
        none an in-flight step touches."""
        if n <= 0:
            return []
        cached, busy = self._cached, self._busy
        if clean and busy:
            out = list(itertools.islice((b for b in cached if b not in busy), n))
        else:
            out = list(itertools.islice(cached, n))
        for b in out:
            del cached[b]
            busy.pop(b, None)
        self.unhash_all(out)
        return out

    # ------------------------------------------------------------ the prefix cache

    def register(self, b: int, h: bytes) -> None:
        """Block `b` (held, full) holds the tokens whose chain hash is `h`. A second block
        with the same content stays anonymous (it is freed as a plain block)."""
        self.register_all([b], [h])

    def register_all(self, blocks: list[int], hashes: list[bytes]) -> None:
        """`register` each of `blocks` with its hash (a request's blocks, once they are full)."""
        hash_of, index, watched = self.hash_of, self.index, self._watched
        for b, h in zip(blocks, hashes):
            if hash_of[b] is None and h not in index:
                hash_of[b] = h
                index[h] = b
                if (watchers := watched.get(h)) is not None:
                    for found, i in watchers.values():
                        found[i] = b

    def unhash(self, b: int) -> None:
        self.unhash_all([b])

    def unhash_all(self, blocks: Iterable[int]) -> None:
        """Forget the hashes of `blocks` (those that have one)."""
        hash_of, index, watched = self.hash_of, self.index, self._watched
        for b in blocks:
            h = hash_of[b]
            if h is not None:
                del index[h]
                hash_of[b] = None
                if (watchers := watched.get(h)) is not None:
                    for found, i in watchers.values():
                        del found[i]

    def watch(self, key: object, hashes: list[bytes]) -> dict[int, int]:
        """Position -> block for those of `hashes` the index holds, kept up to date by every
        later change of the index until `unwatch(key, hashes)` (admission asks which blocks
        of every rotated-out request are still here, step after step)."""
        found: dict[int, int] = {}
        index, watched = self.index, self._watched
        for i, h in enumerate(hashes):
            if (b := index.get(h)) is not None:
                found[i] = b
            if (watchers := watched.get(h)) is None:
                watchers = watched[h] = {}
            watchers[key] = (found, i)
        return found

    def unwatch(self, key: object, hashes: list[bytes]) -> None:
        watched = self._watched
        for h in hashes:
            if (w := watched.get(h)) is not None:
                w.pop(key, None)
                if not w:
                    del watched[h]

    def lookup(self, h: bytes) -> int | None:
        return self.index.get(h)

    def is_cached(self, b: int) -> bool:
        """No request holds `b` and it is free for allocation (reviving it takes a free block)."""
        return b in self._cached

    def count_cached(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` are cached (admission counts this for every candidate)."""
        return sum(map(self._cached.__contains__, blocks))

    def count_cached_clean(self, blocks: Iterable[int]) -> tuple[int, int]:
        """(cached, clean) among `blocks`, in one pass (admission asks both of every rotary candidate)."""
        cached = list(filter(self._cached.__contains__, blocks))
        return len(cached), len(cached) - sum(map(self._busy.__contains__, cached))

    def is_clean(self, b: int) -> bool:
        """`b` is cached and no step in flight touches it (it counts in `num_clean`)."""
        return b in self._cached and b not in self._busy

    def revive(self, b: int) -> None:
        """Take one more reference on the hashed block `b` (held, cached or deferred)."""
        self.revive_all([b])

    def revive_all(self, blocks: Iterable[int]) -> None:
        """`revive` each of `blocks`."""
        ref, cached, busy = self.ref, self._cached, self._busy
        for b in blocks:
            if ref[b] == 0:
                if b in cached:
                    del cached[b]
                    busy.pop(b, None)
                else:
                    assert b in self._deferred_until, f"{self.name}: revived block {b} is neither cached nor deferred"
                    self.num_deferred -= 1
            ref[b] += 1

    # ------------------------------------------------------------ release

    def free(self, ids: list[int], busy_step: int | None = None) -> None:
        """Drop one reference on each block; one that no request holds any more becomes free
        (cached if hashed). `busy_step`: a step still in flight touches them (rule 2)."""
        plain: list[int] = []
        deferred_again: list[int] = []
        busy: list[int] = []
        ref, deferred_until, hash_of, cached = self.ref, self._deferred_until, self.hash_of, self._cached
        newly_cached = self.newly_cached if self.track_cached else None
        for b in reversed(ids):  # the tail of a sequence is evicted before its prefix
            ref[b] -= 1
            if ref[b] > 0:
                continue
            if b in deferred_until:  # revived while deferred: deferred again
                self.num_deferred += 1
                if busy_step is not None and busy_step > deferred_until[b]:
                    deferred_until[b] = busy_step
                    deferred_again.append(b)
                continue
            if hash_of[b] is not None:
                cached[b] = None
                if newly_cached is not None:
                    newly_cached.append(b)
                if busy_step is not None:
                    busy.append(b)
            else:
                plain.append(b)
        if busy:
            self._busy.update(dict.fromkeys(busy, busy_step))
        if deferred_again:
            _insert(self._deferred, busy_step, deferred_again)
        if busy:
            _insert(self._busy_steps, busy_step, busy)
        if busy_step is None:
            self._free.extend(plain)
        elif plain:
            plain.reverse()
            _insert(self._recent, busy_step, plain)
            self.num_recent += len(plain)

    def defer(self, ids: list[int], step_id: int) -> None:
        """Drop one reference on each; free those no request holds once the result of step
        `step_id` is in (rule 1 above). A shared block only loses the reference."""
        out: list[int] = []
        ref, deferred_until = self.ref, self._deferred_until
        for b in ids:
            ref[b] -= 1
            if ref[b] == 0:
                out.append(b)
                deferred_until[b] = step_id
        if out:
            _insert(self._deferred, step_id, out)
            self.num_deferred += len(out)

    def release_through(self, step_id: int) -> None:
        ref, deferred_until = self.ref, self._deferred_until
        while self._deferred and self._deferred[0][0] <= step_id:
            s, ids = self._deferred.pop(0)
            released: list[int] = []
            for b in ids:
                if deferred_until.get(b) != s:
                    continue  # deferred again by a later step
                del deferred_until[b]
                if ref[b] == 0:
                    self.num_deferred -= 1
                    ref[b] = 1
                    released.append(b)
            released.reverse()  # `free` walks its list from the end: freed in `ids` order
            self.free(released)
        while self._recent and self._recent[0][0] <= step_id:
            _, ids = self._recent.pop(0)
            self._free.extend(ids)
            self.num_recent -= len(ids)
        while self._busy_steps and self._busy_steps[0][0] <= step_id:
            s, ids = self._busy_steps.pop(0)
            busy = self._busy
            for b in ids:
                if busy.get(b) == s:
                    del busy[b]

    def trim_cached(self, max_cached: int) -> int:
        """Forget the least recently freed cached blocks (they become plain free blocks) until at
        most `max_cached` are left, none an in-flight step touches; returns how many."""
        out: list[int] = []
        for b in self._cached:
            if len(self._cached) - len(out) <= max_cached:
                break
            if b not in self._busy:
                out.append(b)
        for b in out:
            del self._cached[b]
            self.unhash(b)
        self._free.extend(out)
        return len(out)

    def free_ids(self) -> list[int]:
        """Blocks no request holds: free, recent, cached and deferred."""
        deferred = [b for b in self._deferred_until if self.ref[b] == 0]
        return self._free + [b for _, ids in self._recent for b in ids] + list(self._cached) + deferred


def _insert(lists: list[tuple[int, list[int]]], step_id: int, ids: list[int]) -> None:
    """Add `ids` under `step_id`, keeping step ids ascending."""
    i = bisect.bisect_right(lists, step_id, key=lambda e: e[0])
    if i and lists[i - 1][0] == step_id:
        lists[i - 1][1].extend(ids)
    else:
        lists.insert(i, (step_id, list(ids)))
