"""How far ahead the scheduler plans, by the worker's device: on a CPU worker a request that
arrives while a step computes is in the very next step; on a GPU the next plan is already at
the worker (its swap-ins start beside the step), so the request waits one step more."""

from __future__ import annotations

import asyncio

import pytest

from tests.reliability.rig import ToyWorker, run_rig, until


@pytest.mark.parametrize(("device", "steps_later"), [("cpu", 1), ("cuda:0", 2)])
def test_a_request_arriving_mid_step_is_planned_for_the_next_step_on_a_cpu(tmp_path, device, steps_later):
    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr, step_s=0.2, device=device)
        try:
            await rig.gateway.add("early", [1, 2, 3], 12)
            assert await until(lambda: worker.num_steps >= 2)  # "early" decodes, one step after another
            await asyncio.sleep(0.05)  # inside the step the worker has just started
            computing = worker.computing
            await rig.gateway.add("late", [4, 5, 6], 2)
            assert await until(lambda: "late" in rig.gateway.finished)
            first = min(step for step, rids in worker.scheduled.items() if "late" in rids)
            assert first - computing == steps_later
            assert not rig.gateway.errors
        finally:
            await worker.kill()

    asyncio.run(run_rig(tmp_path, scenario))
