"""The load score by which the gateway routes each new request (scheduler_client.py's
`pick`): a scheduler's SLO headroom from its latest load report and what was sent since."""

from __future__ import annotations

import math

from shared.protocol import AddRequest, SchedulerStats

DRAINING_SCORE = 1e9


def headroom_score(stats: SchedulerStats, num_unreported: int = 0, num_unreported_blocks: int = 0) -> float:
    """How close a scheduler is to missing its SLOs; lower means more headroom.

        score = queued + batch + memory
        queued = num_queued                                     requests the last step left out
        batch  = (num_running + num_unreported) / max_num_seqs  share of the step's batch
        memory = (used HBM blocks + num_unreported_blocks) / num_hbm_blocks

    A queued request means the scheduler had no room for it in its last step (it waits
    behind the token budget, the batch limit or HBM), so each one weighs as much as a full
    HBM pool: a new request goes where nothing waits first. A request that merely arrived
    since the last step is not queued: it has not had its chance yet. Among schedulers with nothing queued, the
    running batch (step time, hence TBT) and HBM use (how soon rotation starts) decide, so a
    smaller pool fills sooner and gets less. Requests this gateway sent since the last report
    ("unreported") count as running with their prompt's blocks, so a burst between two
    reports spreads out instead of piling onto one scheduler. Idle schedulers tie. A draining
    scheduler is picked only when every other one is gone (it then answers 503 itself).
    The batch limit and the block size are the scheduler's own, from its report; a report
    without them (0) leaves their terms out."""
    if stats.draining:
        return DRAINING_SCORE
    queued = stats.num_queued
    batch = (stats.num_running + num_unreported) / stats.max_num_seqs if stats.max_num_seqs else 0.0
    used = stats.num_hbm_blocks - stats.num_free_hbm_blocks + num_unreported_blocks
    return queued + batch + used / max(1, stats.num_hbm_blocks)


def num_blocks(req: AddRequest, block_size: int) -> int:
    """KV blocks of `block_size` tokens (the scheduler's, 0 when unknown: none) that a
    request needs at admission (its known tokens plus the next one)."""
    if not block_size:
        return 0
    return math.ceil((len(req.prompt_token_ids) + len(req.output_token_ids) + 1) / block_size)
