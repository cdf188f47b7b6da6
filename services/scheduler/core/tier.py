"""The DRAM pool as a second prefix-cache level (DESIGN.md, "The DRAM pool as a second cache
level"), on with `kv_offloading_size` > 0 and prefix caching.

    HBM prefix cache ──offload: eager copies in the step's spare B_xfer──▶ DRAM tier
          ▲                                                   (LRU, <= kv_offloading_size)
          └──── load: swap-ins in B_xfer ◀── a waiting request's hash chain continues in DRAM

Keep what leaves HBM (`offload`). A hashed HBM block that no request holds any more (a
finished or recompute-preempted request's) is copied to DRAM in the step's spare copy budget,
after the policy's own copies, as eager rotation mirrors blocks; a block whose content DRAM
holds already (a mirror, a rotated-out copy, an earlier offload) is not copied twice. The copy
reads the HBM block, so the block is held for the step (revived, then deferred: rule 1 of
blocks.py); it comes back cached, and prefix hits find it meanwhile. Copying cached blocks
before they are evicted is what keeps the evicted ones: an eviction hands its block to a
compute that writes it in the same step, too late for a copy.

DRAM keeps at most `kv_offloading_size` GiB of cached blocks, the least recently freed out
first (`BlockPool.trim_cached`). Rotated requests always win space over them: a swap-out's or
a mirror's allocation takes a cached DRAM block when no plain one is free (blocks.py), and an
offload uses only free or cached blocks.

Load or recompute (`plan_loads`, once per waiting request and step; memory.match_tiers and
attach_prefix apply it). A DRAM block comes back as a swap-in into a clean HBM block (one no
step in flight touches), counted in B_xfer like a rotary request's, duplex with the step's
swap-outs; its DRAM copy stays cached. With `tier_loads` "all" (vLLM's offloading connector:
no SLO in it) every hit the step's budget holds is loaded, the rest recomputed. With "slo"
(LVF's decision):
- recompute them all when copying a block takes longer than computing it (copy time from the
  worker's measured bandwidth, prefill time per token from the step-time model fitted on the
  worker's reports);
- load them all when the step's budget (B_xfer left, clean HBM blocks) holds them;
- else, under lvf, wait for a later step, whose whole budget holds them, when the request's
  TTFT slack (TBT slack, once it has emitted) covers a step more and its prefill (lvf's
  admission passes over a request; the FCFS family's would hold everyone behind it);
- else split: load the head the budget holds now, recompute the tail.
"""

from __future__ import annotations

from collections import OrderedDict

from .config import SchedulerConfig
from .memory import Memory
from .request import Request
from .step import Step

GIB = 1 << 30


def num_tier_blocks(cfg: SchedulerConfig, num_dram_blocks: int) -> int:
    """Cached DRAM blocks the tier keeps at most: `kv_offloading_size` GiB in blocks (the whole
    pool while the block's size in bytes is unknown); 0 when the tier is off."""
    if cfg.tier_mode is None:
        return 0
    if not cfg.block_bytes:
        return num_dram_blocks
    return min(num_dram_blocks, int(cfg.kv_offloading_size * GIB // cfg.block_bytes))


def plan_loads(
    cfg: SchedulerConfig, memory: Memory, fit: tuple[float, float] | None, step: Step, req: Request,
    chain: list[tuple[int, bool]],
) -> int | None:
    """DRAM blocks of `req`'s cached prefix `chain` ((block, in DRAM) per block) to load this
    step, the rest recomputed; None: none now, a later step loads them (module doc). `fit`:
    the step-time model's (seconds, seconds per token), None while it has none."""
    hbm = memory.hbm
    num_dram = sum(1 for _, in_dram in chain if in_dram)
    num_clean = hbm.num_clean - sum(1 for b, in_dram in chain if not in_dram and hbm.is_clean(b))
    room = max(0, min(step.moves_left, num_clean))
    if cfg.tier_mode != "slo":
        return min(num_dram, room)
    copy_s = cfg.block_bytes / (cfg.copy_gbps * 1e9) if cfg.copy_gbps > 0 else 0.0
    if fit is not None and copy_s >= fit[1] * cfg.block_size:
        return 0  # computing a block is faster than copying it in
    if num_dram <= room:
        return num_dram
    if cfg.policy == "lvf" and num_dram <= min(cfg.b_xfer, hbm.num_blocks):
        if _slack_covers_a_step(cfg, fit, step.now, req, len(chain), num_dram * copy_s):
            return None
    return room


def _slack_covers_a_step(
    cfg: SchedulerConfig, fit: tuple[float, float] | None, now: float, req: Request, num_hit: int, copy_s: float
) -> bool:
    """Whether `req`, waiting one step more and then loading `num_hit` blocks' worth of prefix
    (`copy_s` of copies), still computes the rest of its prompt before its deadline."""
    deadline = req.last_token_time + req.tbt_slo if req.has_emitted else req.arrival + req.ttft_slo
    num_rest = max(0, req.num_known - num_hit * cfg.block_size)
    if fit is None:
        step_s, prefill_s = cfg.tbt_slo, 0.0
    else:
        a, b = fit
        step_s = a + b * cfg.max_batched_tokens
        prefill_s = b * num_rest + a * -(-num_rest // cfg.max_batched_tokens)
    return now + step_s + copy_s + prefill_s <= deadline


class Offloader:
    """Copies cached HBM blocks that DRAM lacks to DRAM, oldest first, in a step's spare copy
    budget, and keeps the cached DRAM blocks within the tier's size."""

    def __init__(self, memory: Memory) -> None:
        self.memory = memory
        self.pending: OrderedDict[int, None] = OrderedDict()  # HBM blocks cached since, oldest first

    def __call__(self, step: Step) -> None:
        m = self.memory
        hbm, dram = m.hbm, m.dram
        for b in hbm.newly_cached:
            self.pending[b] = None
            self.pending.move_to_end(b)
        hbm.newly_cached.clear()
        settled: list[int] = []
        num_copied = 0
        for b in self.pending:
            h = hbm.hash_of[b]
            if h is None or not hbm.is_cached(b) or dram.lookup(h) is not None:
                settled.append(b)  # evicted or held again (it comes back when freed), or in DRAM already
                continue
            if step.moves_left <= 0 or not dram.can_allocate(1) or num_copied >= m.num_tier_blocks:
                break
            hbm.revive(b)  # held while the copy reads it
            d = dram.allocate(1)[0]
            dram.register(d, h)
            dram.free([d])  # cached at once: no request holds it (copies that share it are ordered, blocks.py rule 3)
            step.eager.append((b, d))
            hbm.defer([b], step.step_id)
            step.moves_left -= 1
            m.num_offloaded += 1
            num_copied += 1
            settled.append(b)
        for b in settled:
            del self.pending[b]
        dram.trim_cached(m.num_tier_blocks)
