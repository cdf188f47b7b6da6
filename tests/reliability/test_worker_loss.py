"""A lost worker costs a pause, not a request: the scheduler holds every live request and
resumes it on the next worker from the tokens already streamed, and the outputs are those
of an undisturbed run."""

from __future__ import annotations

import asyncio
import time

from services.scheduler.recovery import FIRST_STEP_TIMEOUT_S, step_deadline_s
from tests.reliability.rig import VOCAB_SIZE, ToyWorker, run_rig, undisturbed, until

NUM_REQUESTS = 8
MAX_TOKENS = 40


def prompt(i: int) -> list[int]:
    return [5 + i, 17, 29 + 3 * i, 41, 7 * i + 1, 2][: 3 + i % 4]


async def add_all(rig) -> None:
    for i in range(NUM_REQUESTS):
        await rig.gateway.add(f"r{i}", prompt(i), MAX_TOKENS)


def assert_undisturbed(rig) -> None:
    gw = rig.gateway
    assert not gw.errors, gw.errors
    assert gw.finished == {f"r{i}": "length" for i in range(NUM_REQUESTS)}
    for i in range(NUM_REQUESTS):
        assert gw.tokens[f"r{i}"] == undisturbed(prompt(i), MAX_TOKENS), f"r{i}"


async def finish_on_a_new_worker(rig) -> ToyWorker:
    """Start a replacement worker, wait until every request finished, check the outputs."""
    worker = ToyWorker(rig.worker_addr)
    try:
        assert await until(lambda: len(rig.gateway.finished) == NUM_REQUESTS), rig.gateway.finished
    finally:
        await worker.kill()
    assert_undisturbed(rig)
    return worker


def test_killed_worker_requests_resume_on_the_next_with_identical_outputs(tmp_path):
    async def scenario(rig):
        first = ToyWorker(rig.worker_addr)
        await add_all(rig)
        assert await until(lambda: rig.gateway.num_tokens() >= NUM_REQUESTS * MAX_TOKENS // 3)
        await first.kill()
        await asyncio.sleep(0.2)
        killed_at = len(rig.gateway.token_times)
        second = await finish_on_a_new_worker(rig)
        assert killed_at < NUM_REQUESTS * MAX_TOKENS  # the kill came mid-way
        assert rig.service.link.num_losses == 1
        assert second.num_steps > 0

    asyncio.run(run_rig(tmp_path, scenario))


def test_hung_worker_is_declared_lost_after_the_step_timeout(tmp_path):
    async def scenario(rig):
        first = ToyWorker(rig.worker_addr)
        await add_all(rig)
        assert await until(lambda: rig.gateway.num_tokens() >= NUM_REQUESTS * 5)
        first.hung = True
        t0 = time.monotonic()
        assert await until(lambda: rig.service.core is None, timeout=5.0), "hung worker never declared lost"
        detected_s = time.monotonic() - t0
        assert 0.25 < detected_s < 2.0, detected_s
        assert not rig.service.stats().worker_ready
        await first.kill()  # what the supervisor does to a worker the scheduler lost
        await finish_on_a_new_worker(rig)

    asyncio.run(run_rig(tmp_path, scenario, step_timeout_s=0.3))


def test_abort_while_held_reaches_its_gateway_and_is_not_resumed(tmp_path):
    async def scenario(rig):
        first = ToyWorker(rig.worker_addr)
        await add_all(rig)
        assert await until(lambda: rig.gateway.num_tokens() >= NUM_REQUESTS * 3)
        await first.kill()
        assert await until(lambda: rig.service.core is None, timeout=5.0)
        assert rig.service.abort("r0")
        second = ToyWorker(rig.worker_addr)
        try:
            assert await until(lambda: len(rig.gateway.finished) == NUM_REQUESTS)
        finally:
            await second.kill()
        assert rig.gateway.finished["r0"] == "abort"
        assert "r0" not in second.tokens and not rig.gateway.errors

    asyncio.run(run_rig(tmp_path, scenario, step_timeout_s=0.3))


def test_max_waiting_refuses_beyond_the_bound_as_overloaded(tmp_path):
    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr, step_s=0.05)
        try:
            assert await until(lambda: rig.service.core is not None)
            await add_all(rig)  # one tick: none is scheduled before the bound is hit
            assert await until(lambda: len(rig.gateway.finished) + len(rig.gateway.errors) == NUM_REQUESTS)
        finally:
            await worker.kill()
        errors = rig.gateway.errors
        assert errors and all(e.type == "overloaded" for e in errors.values()), errors
        assert len(rig.gateway.finished) >= 2
        for rid in rig.gateway.finished:
            i = int(rid[1:])
            assert rig.gateway.tokens[rid] == undisturbed(prompt(i), MAX_TOKENS)

    asyncio.run(run_rig(tmp_path, scenario, max_waiting=2, max_num_seqs=1))


def test_step_deadline_scales_with_recent_steps():
    decodes = [(0.01, 8)] * 10
    assert step_deadline_s([], 8, 2.0) == FIRST_STEP_TIMEOUT_S
    assert step_deadline_s(decodes, 8, 2.0) == 2.0  # fast steps: the base holds
    assert step_deadline_s([(0.5, 8)] * 10, 8, 2.0) == 5.0  # slow CPU: 10 x median
    assert step_deadline_s([(0.05, 8)] * 9 + [(3.0, 8)], 8, 2.0) == 6.0  # one slow step: 2 x slowest
    # A 512-token prefill after decodes of 8: 10 x 512 tokens x 1.25 ms.
    assert abs(step_deadline_s(decodes, 512, 2.0) - 6.4) < 1e-9


def test_prompt_ids_outside_the_vocabulary_are_refused_alone(tmp_path):
    async def scenario(rig):
        worker = ToyWorker(rig.worker_addr)
        try:
            await rig.gateway.add("bad", [5, VOCAB_SIZE + 7, 9], 4)
            await rig.gateway.add("good", [5, 6, 9], 4)
            assert await until(lambda: "bad" in rig.gateway.errors and "good" in rig.gateway.finished)
        finally:
            await worker.kill()
        err = rig.gateway.errors["bad"]
        assert err.type == "invalid_request_error" and "vocabulary" in err.message
        assert rig.gateway.tokens["good"] == undisturbed([5, 6, 9], 4)

    asyncio.run(run_rig(tmp_path, scenario))
