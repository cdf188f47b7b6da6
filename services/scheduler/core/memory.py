"""Block moves of the two-tier manager: growth, prefix-cache hits, preemption (swap or
recompute), swap-in and eager mirroring. Reuse of freed blocks follows the rule in blocks.py."""

from __future__ import annotations

from collections.abc import Iterable

from .blocks import BlockPool
from .prefix import extend_hashes, root_hash
from .request import Request, Status, blocks_for
from .step import Step


class Memory:
    def __init__(
        self, num_hbm_blocks: int, num_dram_blocks: int, block_size: int, mirrors: bool,
        caching: bool = False, salt: str = "",
    ):
        self.hbm = BlockPool(num_hbm_blocks, "hbm")
        self.dram = BlockPool(num_dram_blocks, "dram")
        self.block_size = block_size
        self.mirrors = mirrors  # keep DRAM copies of synced blocks (eager rotation)
        self.num_swapped_in = 0  # blocks
        self.num_swapped_out = 0
        self.num_mirrored = 0
        self.done_through = -1  # every step up to this one has reported its result
        self.caching = caching  # share full HBM blocks by content (prefix caching)
        self.root = root_hash(salt)
        self.num_prefix_queries = 0  # prompt tokens looked up in the cache at admission
        self.num_prefix_hits = 0  # ... and found there

    # ------------------------------------------------------------ growth

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """HBM blocks `req` lacks to compute `num_new_tokens` more (RUNNING) or to be
        swapped in and compute them (ROTARY)."""
        total = blocks_for(req.num_computed_tokens + num_new_tokens, self.block_size)
        return total - len(req.hbm_blocks)

    def blocks_to_admit(self, req: Request, num_new_tokens: int, reserve_full: bool) -> int:
        """HBM blocks a paused request must find free to be admitted computing
        `num_new_tokens` now: those blocks, or with `reserve_full` those for every
        token it knows (the rest of its prompt too). A waiting request's prefix found in
        the cache needs no new block, but reviving a cached one takes a free block."""
        hits = self.match_prefix(req)
        if not hits:
            return self.blocks_needed(req, req.num_schedulable() if reserve_full else num_new_tokens)
        num_hit = len(hits) * self.block_size
        num_tokens = req.num_known if reserve_full else num_hit + min(num_new_tokens, req.num_known - num_hit)
        return self._blocks_with_hits(hits, num_tokens)

    def _blocks_with_hits(self, hits: list[int], num_tokens: int) -> int:
        num_revived = sum(1 for b in hits if self.hbm.is_cached(b))
        return blocks_for(num_tokens, self.block_size) - len(hits) + num_revived

    # ------------------------------------------------------------ prefix cache

    def match_prefix(self, req: Request) -> list[int]:
        """HBM blocks holding the longest cached prefix of a waiting request's tokens, in
        whole blocks and short of its last token (that one is computed, for its logits)."""
        if not self.caching or req.status is not Status.WAITING:
            return []
        num_max = (req.num_tokens - 1) // self.block_size
        if num_max <= 0:
            return []
        self._hash(req, num_max)
        hits: list[int] = []
        for h in req.block_hashes[:num_max]:
            b = self.hbm.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def attach_prefix(self, req: Request, num_new_tokens: int) -> int:
        """Start a waiting request at its cached prefix (its first HBM blocks, shared);
        returns the tokens it then computes of the `num_new_tokens` the policy gave it.
        Room was checked by `blocks_to_admit`; hits are dropped from the tail if not."""
        if not self.caching:
            return num_new_tokens
        hits = self.match_prefix(req)
        num_hit = 0
        while hits:
            num_hit = len(hits) * self.block_size
            num_tokens = num_hit + min(num_new_tokens, req.num_known - num_hit)
            if self.hbm.can_allocate(self._blocks_with_hits(hits, num_tokens)):
                break
            hits.pop()
            num_hit = 0
        for b in hits:
            self.hbm.revive(b)
        req.hbm_blocks = hits
        req.num_hashed_blocks = len(hits)
        req.num_computed_tokens = num_hit
        self.num_prefix_queries += req.num_tokens
        self.num_prefix_hits += num_hit
        if not req.has_emitted:
            req.num_cached_tokens = num_hit
        return min(num_new_tokens, req.num_known - num_hit)

    def register(self, req: Request) -> None:
        """Name `req`'s full HBM blocks of known tokens in the cache. Call it only for KV
        planned in steps before the one being built (a step must not read a block that
        the same step writes): at the start of a step, and when a request lets go of
        its blocks (it is not scheduled in the step that preempts it)."""
        if not self.caching:
            return
        num_full = min(req.num_computed_tokens, req.num_tokens, len(req.hbm_blocks) * self.block_size)
        num_full //= self.block_size
        if num_full <= req.num_hashed_blocks:
            return
        self._hash(req, num_full)
        for i in range(req.num_hashed_blocks, num_full):
            self.hbm.register(req.hbm_blocks[i], req.block_hashes[i])
        req.num_hashed_blocks = num_full

    def _hash(self, req: Request, num_blocks: int) -> None:
        if len(req.block_hashes) < num_blocks:
            extend_hashes(req.block_hashes, self.root, req.token_all(), self.block_size, num_blocks)

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        need = self.blocks_needed(req, num_new_tokens)
        if not self.hbm.can_allocate(need):
            return False
        req.hbm_blocks += self.hbm.allocate(need)
        return True

    # ------------------------------------------------------------ release

    def free_hbm(self, req: Request, ids: list[int]) -> None:
        """Free HBM blocks whose content `req` no longer needs; "recent" while a step in
        flight still computes on them or swaps them in (rule 2 in blocks.py)."""
        busy_step = max(req.scheduled_step, req.swap_in_step)
        self.hbm.free(ids, busy_step if busy_step > self.done_through else None)

    def release_all(self, req: Request) -> None:
        """Drop every copy of `req`'s KV (finish, abort, recompute); its full HBM blocks
        stay cached for a later hit."""
        self.register(req)
        self.free_hbm(req, req.hbm_blocks)
        req.num_hashed_blocks = 0
        self.dram.free(req.dram_blocks)
        req.hbm_blocks = []
        req.dram_blocks = []
        req.num_sent_blocks = 0
        req.table_reset = True

    def preempt_recompute(self, req: Request) -> None:
        self.release_all(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING

    def can_swap_out(self, req: Request, step: Step, running: Iterable[Request]) -> bool:
        num_copy = len(req.hbm_blocks) - len(req.dram_blocks)
        if num_copy > step.moves_left:
            return False
        if not self.dram.can_allocate(num_copy):
            self.reclaim_mirrors(num_copy, running, step)
        return self.dram.can_allocate(num_copy)

    def preempt_swap(self, req: Request, step: Step) -> None:
        """Move `req` to DRAM: mirrored blocks are freed now, the rest is copied and freed
        once the plan is done (a block another request holds only loses a reference: it
        is copied, never moved or freed). Call `can_swap_out` first."""
        self.register(req)
        req.num_hashed_blocks = 0
        num_mirrored = len(req.dram_blocks)
        src = req.hbm_blocks[num_mirrored:]
        dst = self.dram.allocate(len(src))
        step.swap_out += zip(src, dst)
        step.moves_left -= len(src)
        self.num_swapped_out += len(src)
        self.free_hbm(req, req.hbm_blocks[:num_mirrored])
        self.hbm.defer(src, step.step_id)
        req.dram_blocks += dst
        req.hbm_blocks = []
        req.num_sent_blocks = 0
        req.table_reset = True
        req.status = Status.ROTARY

    def reclaim_mirrors(self, num_blocks: int, running: Iterable[Request], step: Step) -> None:
        """Free DRAM mirrors of running requests (they are only copies) until
        `num_blocks` DRAM blocks are free. Mirrors of a request swapped in this step are
        kept: this plan reads them."""
        for req in running:
            if self.dram.num_free >= num_blocks:
                return
            if not req.dram_blocks or req.swap_in_step == step.step_id:
                continue
            num_drop = min(len(req.dram_blocks), num_blocks - self.dram.num_free)
            self.dram.free(req.dram_blocks[-num_drop:])
            del req.dram_blocks[-num_drop:]

    # ------------------------------------------------------------ swap-in

    def can_swap_in(self, req: Request, num_blocks: int, moves_left: int) -> bool:
        """Room (`num_blocks` HBM blocks in all, `blocks_to_admit`) and copy budget for
        `req`'s swap-in, its copies landing on clean blocks."""
        num_copy = len(req.dram_blocks)
        return num_copy <= moves_left and self.hbm.num_clean >= num_copy and self.hbm.can_allocate(num_blocks)

    def swap_in(self, req: Request, step: Step) -> None:
        """Bring a ROTARY request's KV back to HBM. Synced DRAM blocks stay as mirrors when
        eager rotation is on; the others are freed once the plan is done (it reads them)."""
        src = req.dram_blocks
        dst = self.hbm.allocate_clean(len(src))
        step.swap_in += zip(src, dst)
        step.moves_left -= len(src)
        self.num_swapped_in += len(src)
        num_keep = req.num_computed_tokens // self.block_size if self.mirrors else 0
        self.dram.defer(src[num_keep:], step.step_id)
        req.dram_blocks = src[:num_keep]
        req.hbm_blocks = dst
        req.num_hashed_blocks = 0
        req.table_reset = True
        req.status = Status.RUNNING
        req.swap_in_step = step.step_id

    # ------------------------------------------------------------ eager rotation

    def mirror(self, running: Iterable[Request], step: Step) -> None:
        """Copy synced, unmirrored HBM blocks of running requests to DRAM within the step's
        spare copy budget. A block counts as synced only if a plan before this one filled
        it (this plan's compute runs after its copies); a request swapped in by this plan
        is skipped (its HBM blocks are being written)."""
        for req in running:
            if step.moves_left <= 0 or self.dram.num_free == 0:
                return
            if req.swap_in_step == step.step_id:
                continue
            done = req.num_computed_tokens
            if step.is_scheduled(req):
                done -= req.step_new_tokens
            num_synced = done // self.block_size
            num_copy = min(num_synced - len(req.dram_blocks), step.moves_left, self.dram.num_free)
            if num_copy <= 0:
                continue
            src = req.hbm_blocks[len(req.dram_blocks) : len(req.dram_blocks) + num_copy]
            dst = self.dram.allocate(num_copy)
            step.eager += zip(src, dst)
            step.moves_left -= num_copy
            self.num_mirrored += num_copy
            req.dram_blocks += dst

    def step_done(self, step_id: int) -> None:
        """The result of `step_id` is in: its copies and compute are finished."""
        self.done_through = max(self.done_through, step_id)
        self.hbm.release_through(step_id)
        self.dram.release_through(step_id)
