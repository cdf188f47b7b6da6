"""The gateway weighs a scheduler by that scheduler's own setup, carried in its load report
(`SchedulerStats.max_num_seqs`, `.block_size`), not by defaults it would borrow."""

from __future__ import annotations

import asyncio

from services.gateway.headroom import headroom_score, num_blocks
from shared import protocol as p
from tests.reliability.rig import BLOCK_SIZE, ToyWorker, run_rig, until


def report(max_num_seqs: int, block_size: int, num_running: int = 0, num_free: int = 100) -> p.SchedulerStats:
    return p.SchedulerStats(
        "s", "m", 4096, 0, num_running, 0, 100, num_free, 100, 100, max_num_seqs=max_num_seqs, block_size=block_size
    )


def test_the_batch_term_is_a_share_of_the_schedulers_own_batch_limit():
    assert headroom_score(report(8, 16, num_running=4)) == 0.5
    assert headroom_score(report(64, 16, num_running=4)) == 4 / 64
    assert headroom_score(report(8, 16, num_running=4), num_unreported=4) == 1.0
    assert headroom_score(report(0, 0, num_running=4)) == 0.0  # not reported: left out


def test_unreported_requests_are_sized_in_the_schedulers_own_blocks():
    req = p.AddRequest("r", [1] * 31, p.SamplingParams(max_tokens=4), output_token_ids=[5])
    assert num_blocks(req, 16) == 3  # 31 + 1 known + the next one = 33 tokens
    assert num_blocks(req, 4) == 9
    assert num_blocks(req, 0) == 0  # no worker ready yet: nothing to size them by


def test_the_scheduler_reports_its_batch_limit_and_its_workers_block_size(tmp_path):
    async def scenario(rig):
        before = p.gateway_reply_decoder.decode(p.encode(rig.service.stats()))
        assert (before.max_num_seqs, before.block_size) == (7, 0)  # no worker yet
        worker = ToyWorker(rig.worker_addr)
        try:
            assert await until(lambda: rig.service.core is not None)
            ready = p.gateway_reply_decoder.decode(p.encode(rig.service.stats()))
        finally:
            await worker.kill()
        assert (ready.max_num_seqs, ready.block_size) == (7, BLOCK_SIZE)

    asyncio.run(run_rig(tmp_path, scenario, max_num_seqs=7))
