"""Block moves of the two-tier manager: growth, preemption (swap or recompute), swap-in
and eager mirroring. Reuse of freed blocks follows the rule in blocks.py."""

from __future__ import annotations

from collections.abc import Iterable

from .blocks import BlockPool
from .request import Request, Status, blocks_for
from .step import Step


class Memory:
    def __init__(self, num_hbm_blocks: int, num_dram_blocks: int, block_size: int, mirrors: bool):
        self.hbm = BlockPool(num_hbm_blocks, "hbm")
        self.dram = BlockPool(num_dram_blocks, "dram")
        self.block_size = block_size
        self.mirrors = mirrors  # keep DRAM copies of synced blocks (eager rotation)
        self.num_swapped_in = 0  # blocks
        self.num_swapped_out = 0
        self.num_mirrored = 0
        self.done_through = -1  # every step up to this one has reported its result

    # ------------------------------------------------------------ growth

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """HBM blocks `req` lacks to compute `num_new_tokens` more (RUNNING) or to be
        swapped in and compute them (ROTARY)."""
        total = blocks_for(req.num_computed_tokens + num_new_tokens, self.block_size)
        return total - len(req.hbm_blocks)

    def blocks_to_admit(self, req: Request, num_new_tokens: int, reserve_full: bool) -> int:
        """HBM blocks a paused request must find free to be admitted computing
        `num_new_tokens` now: those blocks, or with `reserve_full` those for every
        token it knows (the rest of its prompt too)."""
        return self.blocks_needed(req, req.num_schedulable() if reserve_full else num_new_tokens)

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
        """Drop every copy of `req`'s KV (finish, abort, recompute)."""
        self.free_hbm(req, req.hbm_blocks)
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
        once the plan is done. Call `can_swap_out` first."""
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
