"""A step that fails costs only what it must: the scheduler against a toy worker that fails
a request, fails a whole step, or freezes past the step deadline and thaws (SIGSTOP, SIGCONT).
Every other request completes with the tokens of an undisturbed run, none twice."""

from __future__ import annotations

import asyncio

from tests.reliability.rig import ToyWorker, run_rig, undisturbed, until
from tests.reliability.test_worker_loss import MAX_TOKENS, NUM_REQUESTS, add_all, assert_undisturbed, prompt


def assert_no_blocks_held(rig) -> None:
    core = rig.service.core
    core.check_invariants()
    assert not core.requests
    assert core.memory.hbm.num_free == core.memory.hbm.num_blocks


def test_a_request_the_worker_fails_ends_alone_with_the_fault(tmp_path):
    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr)
        worker.fail_requests.add("r3")
        try:
            await add_all(rig)
            gw = rig.gateway
            assert await until(lambda: len(gw.finished) == NUM_REQUESTS - 1 and "r3" in gw.errors)
            await asyncio.sleep(0.2)
            assert_no_blocks_held(rig)
        finally:
            await worker.kill()
        err = gw.errors["r3"]
        assert err.type == "internal_error" and "InjectedFault" in err.message, err
        assert set(gw.errors) == {"r3"} and "r3" not in gw.finished
        for i in range(NUM_REQUESTS):
            if i != 3:
                assert gw.tokens[f"r{i}"] == undisturbed(prompt(i), MAX_TOKENS), f"r{i}"
        assert rig.service.link.num_losses == 0 and worker.num_resets == 0

    asyncio.run(run_rig(tmp_path, scenario))


def test_a_failed_step_resets_the_same_worker_and_every_request_completes(tmp_path):
    """A WorkerError (a step whose copies raised): no restart, no handshake: the scheduler
    resets the worker it has, and resumes every request on it."""

    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr)
        worker.fail_step = 6
        try:
            await add_all(rig)
            assert await until(lambda: len(rig.gateway.finished) == NUM_REQUESTS)
            assert_no_blocks_held(rig)
        finally:
            await worker.kill()
        assert_undisturbed(rig)
        assert worker.num_resets == 1 and rig.service.link.num_losses == 1

    asyncio.run(run_rig(tmp_path, scenario))


def test_a_worker_frozen_past_the_deadline_is_reset_when_it_thaws_and_nothing_is_sent_twice(tmp_path):
    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr)
        try:
            await add_all(rig)
            assert await until(lambda: rig.gateway.num_tokens() >= NUM_REQUESTS * MAX_TOKENS // 4)
            worker.frozen.clear()  # SIGSTOP
            assert await until(lambda: rig.service.core is None, timeout=5.0), "frozen worker never declared lost"
            assert not rig.service.stats().worker_ready
            await asyncio.sleep(0.3)
            worker.frozen.set()  # SIGCONT: its late results come first, then the reset
            assert await until(lambda: len(rig.gateway.finished) == NUM_REQUESTS)
            assert_no_blocks_held(rig)
        finally:
            await worker.kill()
        assert_undisturbed(rig)  # a token sent twice would show here
        assert worker.num_resets == 1 and rig.service.link.num_losses == 1

    asyncio.run(run_rig(tmp_path, scenario, step_timeout_s=0.3))
