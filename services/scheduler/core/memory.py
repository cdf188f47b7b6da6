"""Block moves of the two-tier manager: growth, prefix-cache hits, preemption (swap or
recompute), swap-in and eager mirroring. Reuse of freed blocks follows the rule in blocks.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from .blocks import BlockPool
from .prefix import extend_hashes, root_hash
from .request import Request, Status, blocks_for
from .step import Step


class Memory:
    def __init__(
        self, num_hbm_blocks: int, num_dram_blocks: int, block_size: int, mirrors: bool,
        caching: bool = False, salt: str = "", num_tier_blocks: int = 0,
    ):
        self.hbm = BlockPool(num_hbm_blocks, "hbm")
        self.dram = BlockPool(num_dram_blocks, "dram")
        self.block_size = block_size
        self.mirrors = mirrors  # keep DRAM copies of synced blocks (eager rotation)
        self.num_swapped_in = 0  # blocks
        self.num_swapped_out = 0
        self.num_mirrored = 0
        self.num_swap_in_reused = 0  # blocks a swap-in found in HBM by content, not copied
        self.num_dram_shared = 0  # blocks a swap-out or mirror found in DRAM by content, not copied
        self.done_through = -1  # every step up to this one has reported its result
        self.caching = caching  # share full HBM blocks by content (prefix caching)
        self.root = root_hash(salt)
        self.num_prefix_queries = 0  # prompt tokens looked up in the cache at admission
        self.num_prefix_hits = 0  # ... and found there
        # Rotary request id -> cached HBM blocks its swap-in would take back, as of its last
        # `blocks_to_admit`: preempting victims in between may turn blocks they held into
        # cached ones, which then cost a free block more than that count said.
        self._num_revived: dict[str, int] = {}
        # Rotary request id -> (its full blocks' hashes, hbm_reuse's answer), the answer kept up
        # to date by the HBM pool as long as the request is rotated out (BlockPool.watch).
        self._reuse: dict[str, tuple[list[bytes], dict[int, int]]] = {}
        # The DRAM tier (tier.py): cached DRAM blocks kept at most (0: off), what a waiting
        # request's prefix found there loads this step (decided once per request and step by
        # `_planner`), and its counters (tokens).
        self.num_tier_blocks = num_tier_blocks if caching else 0
        self.hbm.track_cached = self.num_tier_blocks > 0
        self._step: Step | None = None
        self._planner: Callable[[Request, list[tuple[int, bool]]], int | None] = lambda req, chain: 0
        self._loads: dict[str, int | None] = {}
        self.num_tier_queries = 0  # prompt tokens looked up in DRAM (past the HBM hits)
        self.num_tier_hits = 0  # ... found there and loaded
        self.num_tier_loaded = 0  # blocks loaded from DRAM for prefix hits
        self.num_offloaded = 0  # blocks copied to DRAM as they left HBM

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
        if req.status is Status.ROTARY:
            reused = self.hbm_reuse(req).values()
            num_new = req.num_schedulable() if reserve_full else num_new_tokens
            num_revived = self._num_revived[req.request_id] = self._num_revived_of(reused)
            return blocks_for(req.num_computed_tokens + num_new, self.block_size) - len(reused) + num_revived
        hits = self.match_tiers(req)
        if not hits:
            return self.blocks_needed(req, req.num_schedulable() if reserve_full else num_new_tokens)
        num_hit = len(hits) * self.block_size
        num_tokens = req.num_known if reserve_full else num_hit + min(num_new_tokens, req.num_known - num_hit)
        return self._blocks_with_hits([b for b, in_dram in hits if not in_dram], num_tokens)

    def _blocks_with_hits(self, hits: list[int], num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size) - len(hits) + self._num_revived_of(hits)

    def _num_revived_of(self, hits: Iterable[int]) -> int:
        """Cached blocks among `hits`: taking one back takes a free block."""
        return self.hbm.count_cached(hits)

    # ------------------------------------------------------------ prefix cache

    def match_prefix(self, req: Request) -> list[int]:
        """The HBM blocks of a waiting request's cached prefix (`match_tiers`): shared, not copied."""
        return [b for b, in_dram in self.match_tiers(req) if not in_dram]

    def match_tiers(self, req: Request) -> list[tuple[int, bool]]:
        """Blocks holding the longest cached prefix of a waiting request's tokens, in whole
        blocks and short of its last token (that one is computed, for its logits), each as
        (block, in DRAM): by the hash chain in HBM and, with the DRAM tier, then in DRAM, up
        to the DRAM blocks it loads this step (`tier_loads`: the rest is recomputed)."""
        limit = (self.tier_loads(req) or 0) if self.num_tier_blocks else 0
        return self._chain(req, limit)

    def _chain(self, req: Request, max_dram: float) -> list[tuple[int, bool]]:
        # A request that scores its prompt (echo, prompt_logprobs) computes all of it.
        if not self.caching or req.status is not Status.WAITING or req.params.prompt_logprobs is not None:
            return []
        num_max = (req.num_tokens - 1) // self.block_size
        if num_max <= 0:
            return []
        self._hash(req, num_max)
        hits: list[tuple[int, bool]] = []
        num_dram, writing = 0, None
        for h in req.block_hashes[:num_max]:
            b = self.hbm.lookup(h)
            if b is not None:
                hits.append((b, False))
                continue
            if num_dram >= max_dram:
                break
            d = self.dram.lookup(h)
            if writing is None:  # DRAM blocks this step copies into: not readable in it
                step = self._step
                writing = {x for _, x in step.swap_out} | {x for _, x in step.eager} if step else set()
            if d is None or d in writing:
                break
            hits.append((d, True))
            num_dram += 1
        return hits

    def begin_step(self, step: Step, planner: Callable[[Request, list[tuple[int, bool]]], int | None]) -> None:
        """A new step is being built; `planner(req, chain)` decides how many of the DRAM blocks
        in a waiting request's chain it loads (None: none, it waits for a later step)."""
        self._step = step
        self._planner = planner
        self._loads.clear()

    def tier_loads(self, req: Request) -> int | None:
        """DRAM blocks of `req`'s cached prefix this step loads (0 without the tier); None: it
        waits for a later step, whose copy budget loads them all within its TTFT slack."""
        rid = req.request_id
        if rid not in self._loads:
            chain = self._chain(req, float("inf")) if self.num_tier_blocks else []
            self._loads[rid] = self._planner(req, chain) if any(d for _, d in chain) else 0
        return self._loads[rid]

    def attach_prefix(self, req: Request, num_new_tokens: int, step: Step) -> int:
        """Start a waiting request at its cached prefix: its HBM blocks shared, its DRAM blocks
        loaded into clean HBM blocks by this step's swap-ins (the DRAM copies stay cached);
        returns the tokens it then computes of the `num_new_tokens` the policy gave it.
        Room was checked by `blocks_to_admit`; hits are dropped from the tail if not."""
        if not self.caching:
            return num_new_tokens
        hits = self.match_tiers(req)
        num_hit = 0
        while hits:
            num_hit = len(hits) * self.block_size
            num_tokens = num_hit + min(num_new_tokens, req.num_known - num_hit)
            shared = [b for b, in_dram in hits if not in_dram]
            if self.hbm.can_allocate(self._blocks_with_hits(shared, num_tokens)) and self._can_load(hits, step):
                break
            hits.pop()
            num_hit = 0
        for b, in_dram in hits:
            (self.dram if in_dram else self.hbm).revive(b)  # before allocating: allocation may evict cached blocks
        loads = [d for d, in_dram in hits if in_dram]
        dst = iter(self.hbm.allocate_clean(len(loads)))
        blocks = [next(dst) if in_dram else b for b, in_dram in hits]
        for i, (b, in_dram) in enumerate(hits):
            if in_dram:
                step.swap_in.append((b, blocks[i]))
                self.hbm.register(blocks[i], req.block_hashes[i])  # compute reads it after the swap-ins
        self.dram.defer(loads, step.step_id)
        step.moves_left -= len(loads)
        if loads:
            req.swap_in_step = step.step_id
        num_hbm_hit = (len(hits) - len(loads)) * self.block_size
        req.hbm_blocks = blocks
        req.num_hashed_blocks = len(hits)
        req.num_computed_tokens = num_hit
        self.num_prefix_queries += req.num_tokens
        self.num_prefix_hits += num_hbm_hit
        if self.num_tier_blocks:
            self.num_tier_queries += req.num_tokens - num_hbm_hit
            self.num_tier_hits += len(loads) * self.block_size
            self.num_tier_loaded += len(loads)
        if not req.has_emitted:
            req.num_cached_tokens = num_hit
            req.num_dram_cached_tokens = len(loads) * self.block_size
        return min(num_new_tokens, req.num_known - num_hit)

    def _can_load(self, hits: list[tuple[int, bool]], step: Step) -> bool:
        """The DRAM blocks among `hits` fit in the step's copy budget and in clean HBM blocks
        (those the HBM hits take back aside)."""
        num_load = sum(1 for _, in_dram in hits if in_dram)
        if not num_load:
            return True
        num_clean = self.hbm.num_clean - sum(1 for b, in_dram in hits if not in_dram and self.hbm.is_clean(b))
        return num_load <= min(step.moves_left, num_clean)

    def register_all(self, reqs: Iterable[Request]) -> None:
        """`register` each of `reqs` (every running request, at the start of each step); most
        have no new full block, which the test inlined here tells without a call."""
        if not self.caching:
            return
        bs = self.block_size
        for req in reqs:
            if req.num_computed_tokens >= (req.num_hashed_blocks + 1) * bs:
                self.register(req)

    def register(self, req: Request) -> None:
        """Name `req`'s full HBM blocks of known tokens in the cache. Call it only for KV
        planned in steps before the one being built (a step must not read a block that
        the same step writes): at the start of a step, and when a request lets go of
        its blocks (it is not scheduled in the step that preempts it)."""
        if not self.caching or req.num_computed_tokens < (req.num_hashed_blocks + 1) * self.block_size:
            return  # no new full block (the cheap test: every step asks this of each running request)
        num_full = min(req.num_computed_tokens, req.num_tokens, len(req.hbm_blocks) * self.block_size)
        num_full //= self.block_size
        if num_full <= req.num_hashed_blocks:
            return
        self._hash(req, num_full)
        first = req.num_hashed_blocks
        self.hbm.register_all(req.hbm_blocks[first:num_full], req.block_hashes[first:num_full])
        req.num_hashed_blocks = num_full

    def _hash(self, req: Request, num_blocks: int) -> None:
        if len(req.block_hashes) < num_blocks:
            extend_hashes(req.block_hashes, self.root, req.token_all(), self.block_size, num_blocks)

    def _num_full(self, req: Request, num_tokens: int) -> int:
        """Blocks among the first `num_tokens` positions whose tokens are all known (so
        nameable by content); 0 without caching. Hashes them."""
        if not self.caching:
            return 0
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        self._hash(req, num_full)
        return num_full

    def hbm_reuse(self, req: Request) -> Mapping[int, int]:
        """A rotary request's full blocks whose content is still in HBM (held by another
        request, cached, or being copied out): block index -> HBM block. Its swap-in takes
        them by reference instead of copying them. Admission asks this of every rotated-out
        request in every step: the HBM pool keeps the answer up to date."""
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size if self.caching else 0
        memo = self._reuse.get(req.request_id)
        if memo is not None and len(memo[0]) == num_full:
            return memo[1]  # (its hashes were computed when the memo was made)
        self._num_full(req, req.num_computed_tokens)  # hashes them
        self._forget_reuse(req)
        hashes = req.block_hashes[:num_full]
        self._reuse[req.request_id] = (hashes, self.hbm.watch(req.request_id, hashes))
        return self._reuse[req.request_id][1]

    def _forget_reuse(self, req: Request) -> None:
        if (memo := self._reuse.pop(req.request_id, None)) is not None:
            self.hbm.unwatch(req.request_id, memo[0])

    def _dram_shared(self, req: Request, start: int, num_tokens: int) -> dict[int, int]:
        """Full blocks from `start` among `req`'s first `num_tokens` KV positions whose content
        a DRAM block already holds (another request's mirror or rotated-out copy, or
        cached): block index -> DRAM block."""
        hashes, lookup = req.block_hashes, self.dram.index.get  # `self.dram.lookup`
        shared: dict[int, int] = {}
        for i in range(start, self._num_full(req, num_tokens)):
            d = lookup(hashes[i])
            if d is not None:
                shared[i] = d
        return shared

    def num_swap_in_copies(self, req: Request) -> int:
        """Blocks a rotary request's swap-in copies (those not found in HBM), or a waiting one's
        prefix loads from DRAM: its share of B_xfer."""
        if req.status is Status.WAITING:
            return (self.tier_loads(req) or 0) if self.num_tier_blocks else 0
        return len(req.dram_blocks) - len(self.hbm_reuse(req))

    def num_swap_out_copies(self, req: Request) -> int:
        """Blocks a running request's swap-out copies: those neither mirrored nor found in DRAM."""
        return self._swap_out_need(req)[0]

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        need = self.blocks_needed(req, num_new_tokens)
        if need <= 0:  # most decodes: their last block has room
            return True
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
        self._num_revived.pop(req.request_id, None)
        self._forget_reuse(req)
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
        num_copy, need = self._swap_out_need(req)
        if num_copy > step.moves_left:
            return False
        if not self.dram.can_allocate(need):
            self.reclaim_mirrors(need, running, step)
            num_copy, need = self._swap_out_need(req)  # a reclaimed mirror may be one it shares
        return self.dram.can_allocate(need)

    def _swap_out_need(self, req: Request) -> tuple[int, int]:
        """(blocks `req`'s swap-out copies, free DRAM blocks it takes): reviving a cached
        DRAM block it shares takes a free one."""
        num_blocks, num_mirrored = len(req.hbm_blocks), len(req.dram_blocks)
        shared = self._dram_shared(req, num_mirrored, req.num_computed_tokens)
        num_copy = num_blocks - num_mirrored - len(shared)
        return num_copy, num_copy + self.dram.count_cached(shared.values())

    def preempt_swap(self, req: Request, step: Step) -> None:
        """Move `req` to DRAM: mirrored blocks are freed now, the rest is copied and freed
        once the plan is done (a block another request holds only loses a reference: it
        is copied, never moved or freed). A full block whose content DRAM already holds
        is not copied: `req` shares that DRAM block. Call `can_swap_out` first."""
        self.register(req)
        req.num_hashed_blocks = 0
        hbm_blocks, num_mirrored = req.hbm_blocks, len(req.dram_blocks)
        shared = self._dram_shared(req, num_mirrored, req.num_computed_tokens)
        self.dram.revive_all(shared.values())
        copied = [i for i in range(num_mirrored, len(hbm_blocks)) if i not in shared]
        dst = self.dram.allocate(len(copied))
        num_full = self._num_full(req, req.num_computed_tokens)
        for i, d in zip(copied, dst):
            if i < num_full:
                self.dram.register(d, req.block_hashes[i])
        src = [hbm_blocks[i] for i in copied]
        step.swap_out += zip(src, dst)
        step.moves_left -= len(src)
        self.num_swapped_out += len(src)
        self.num_dram_shared += len(shared)
        self.free_hbm(req, hbm_blocks[:num_mirrored] + [hbm_blocks[i] for i in shared])
        self.hbm.defer(src, step.step_id)
        by_index = dict(zip(copied, dst)) | shared
        req.dram_blocks += [by_index[i] for i in range(num_mirrored, len(hbm_blocks))]
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
        """Room (`num_blocks` HBM blocks in all, from `blocks_to_admit`) and copy budget for
        `req`'s swap-in, its copies landing on clean blocks (not on the cached blocks it
        takes back by content)."""
        reused = self.hbm_reuse(req).values()
        num_copy = len(req.dram_blocks) - len(reused)
        if num_copy > moves_left:
            return False
        num_cached, num_clean_reused = self.hbm.count_cached_clean(reused)
        num_blocks += num_cached - self._num_revived.get(req.request_id, 0)
        return self.hbm.num_clean - num_clean_reused >= num_copy and self.hbm.can_allocate(num_blocks)

    def swap_in(self, req: Request, step: Step) -> None:
        """Bring a ROTARY request's KV back to HBM. Full blocks whose content is still in
        HBM are taken by reference; only the others are copied. Synced DRAM blocks stay as
        mirrors when eager rotation is on; the others are freed once the plan is done (it
        reads them)."""
        src = req.dram_blocks
        reused = self.hbm_reuse(req)
        self._forget_reuse(req)  # `reused` stays as it is now
        self._num_revived.pop(req.request_id, None)
        self.hbm.revive_all(reused.values())  # before allocating: allocation may evict cached blocks
        copied = [i for i in range(len(src)) if i not in reused]
        dst = self.hbm.allocate_clean(len(copied))
        step.swap_in += [(src[i], b) for i, b in zip(copied, dst)]
        step.moves_left -= len(dst)
        self.num_swapped_in += len(dst)
        self.num_swap_in_reused += len(reused)
        num_keep = req.num_computed_tokens // self.block_size if self.mirrors else 0
        self.dram.defer(src[num_keep:], step.step_id)
        by_index = dict(zip(copied, dst)) | reused
        req.dram_blocks = src[:num_keep]
        req.hbm_blocks = [by_index[i] for i in range(len(src))]
        req.num_hashed_blocks = 0
        req.table_reset = True
        req.status = Status.RUNNING
        req.swap_in_step = step.step_id

    # ------------------------------------------------------------ eager rotation

    def mirror(self, running: Iterable[Request], step: Step) -> None:
        """Copy synced, unmirrored HBM blocks of running requests to DRAM within the step's
        spare copy budget; a block whose content DRAM already holds (another request's
        mirror of a shared block) is taken by reference, not copied again. A block counts
        as synced only if a plan before this one filled it (this plan's compute runs after
        its copies); a request swapped in by this plan is skipped (its HBM blocks are being
        written)."""
        dram, block_size, step_id = self.dram, self.block_size, step.step_id
        for req in running:
            if req.swap_in_step == step_id:
                continue
            done = req.num_computed_tokens
            if req.scheduled_step == step_id:  # `step.is_scheduled(req)`
                done -= req.step_new_tokens
            num_synced = done // block_size
            i = len(req.dram_blocks)
            if num_synced <= i:
                continue
            shared = self._dram_shared(req, i, done)
            for d in shared.values():
                dram.revive(d)  # before allocating: allocation may evict cached blocks
            num_full = min(len(req.block_hashes), num_synced)
            for i in range(i, num_synced):  # mirrors stay a prefix of the block table
                d = shared.pop(i, None)
                if d is not None:
                    self.num_dram_shared += 1
                elif step.moves_left > 0 and dram.num_free > 0:
                    d = dram.allocate(1)[0]
                    if i < num_full:
                        dram.register(d, req.block_hashes[i])
                    step.eager.append((req.hbm_blocks[i], d))
                    step.moves_left -= 1
                    self.num_mirrored += 1
                else:
                    break
                req.dram_blocks.append(d)
            dram.free(list(shared.values()))  # found past the first block it could not mirror

    def step_done(self, step_id: int) -> None:
        """The result of `step_id` is in: its copies and compute are finished."""
        self.done_through = max(self.done_through, step_id)
        self.hbm.release_through(step_id)
        self.dram.release_through(step_id)
