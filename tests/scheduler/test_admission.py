"""Admission bounds: `max_waiting` requests and `max_waiting_tokens` known tokens of the
requests not yet scheduled. The same rule refuses in the core and in the service while it
holds requests for a worker (one function, `SchedulerConfig.admission_refusal`)."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.scheduler.core import Overloaded, SchedulerConfig, Status
from shared.protocol import AddRequest, SamplingParams
from tests.reliability.rig import ToyWorker, run_rig, until

from .harness import Driver, add, make_core


@pytest.mark.parametrize(
    "cfg, num_waiting, num_waiting_tokens, num_tokens, refused",
    [
        (dict(), 1000, 10**6, 10**6, False),  # unbounded
        (dict(max_waiting=2), 1, 0, 5, False),
        (dict(max_waiting=2), 2, 0, 5, True),
        (dict(max_waiting_tokens=100), 1, 60, 40, False),  # exactly at the bound
        (dict(max_waiting_tokens=100), 1, 60, 41, True),
        (dict(max_waiting_tokens=100), 0, 0, 500, False),  # alone: admitted whatever its size
        (dict(max_waiting=5, max_waiting_tokens=100), 5, 10, 10, True),
        (dict(max_waiting=5, max_waiting_tokens=100), 4, 90, 11, True),
    ],
)
def test_admission_refusal(cfg, num_waiting, num_waiting_tokens, num_tokens, refused):
    why = SchedulerConfig(**cfg).admission_refusal(num_waiting, num_waiting_tokens, num_tokens)
    assert (why is not None) == refused, why


def test_the_refusal_names_the_bound_and_the_numbers():
    cfg = SchedulerConfig(max_waiting=3, max_waiting_tokens=100)
    why = cfg.admission_refusal(2, 90, 20)
    assert all(str(n) in why for n in (2, 90, 20, 110, 100)) and "tokens" in why, why
    why = cfg.admission_refusal(3, 0, 1)
    assert "3 requests" in why and "bound: 3" in why, why


def test_negative_bounds_are_rejected():
    with pytest.raises(ValueError, match="max_waiting_tokens"):
        SchedulerConfig(max_waiting_tokens=-1)


def test_waiting_tokens_bound_refuses_the_request_that_would_pass_it():
    core = make_core(max_waiting_tokens=100)
    add(core, "a", 60, 4)
    add(core, "b", 40, 4)  # 100: at the bound
    assert core.num_waiting_tokens == 100
    with pytest.raises(Overloaded, match="100 tokens"):
        add(core, "c", 1, 4)
    assert "c" not in core.requests and core.num_waiting_tokens == 100
    core.check_invariants()


def test_a_request_larger_than_the_bound_is_admitted_into_an_empty_queue():
    core = make_core(max_waiting_tokens=50)
    add(core, "big", 80, 4)
    with pytest.raises(Overloaded):
        add(core, "small", 1, 4)


def test_generated_tokens_of_a_resubmission_count():
    core = make_core(max_waiting_tokens=20)
    p = SamplingParams(max_tokens=30)
    core.add_request(AddRequest("r", [5] * 6, p, output_token_ids=[7] * 10), 0.0)
    assert core.num_waiting_tokens == 16
    with pytest.raises(Overloaded, match="16 tokens"):
        core.add_request(AddRequest("s", [5] * 5, p), 0.0)


def test_scheduled_requests_leave_the_bound_and_finished_ones_release_it():
    core = make_core(block_size=4, max_waiting_tokens=30)
    d = Driver(core)
    add(core, "a", 20, 3)
    with pytest.raises(Overloaded):
        add(core, "b", 20, 3)
    d.step()  # "a" runs: nothing waits
    assert core.num_waiting_tokens == 0
    add(core, "b", 20, 3)
    add(core, "c", 10, 3)
    assert core.num_waiting_tokens == 30
    assert core.abort_request("c", 0.0) is not None
    assert core.num_waiting_tokens == 20
    d.run()
    assert core.num_waiting_tokens == 0 and set(d.finish) == {"a", "b"}


def test_a_recomputed_request_waits_again_with_its_generated_tokens():
    core = make_core("fcfs", num_hbm=6, block_size=4)
    d = Driver(core)
    add(core, "old", 8, 12)
    add(core, "new", 8, 12)
    for _ in range(40):
        d.step()
        waiting = [r for r in core.requests.values() if r.status is Status.WAITING]
        if waiting and waiting[0].output_token_ids:
            assert core.num_waiting_tokens == waiting[0].num_tokens
            break
    else:
        raise AssertionError("no request was preempted for recompute after emitting tokens")
    d.run()
    assert core.num_waiting_tokens == 0


@pytest.mark.parametrize("policy", ["lvf", "fcfs"])
def test_random_arrivals_keep_the_bound_and_the_count(policy):
    """Under memory pressure (preemptions, recomputes, finishes, aborts), the waiting tokens
    never pass the bound by an admission, and the running count matches a recount (the
    invariant check after every step)."""
    rng = random.Random(7)
    bound = 120
    core = make_core(policy, num_hbm=24, num_dram=64, block_size=4, max_waiting_tokens=bound)
    d = Driver(core, seed=3, p_stop=0.05)
    num_refused = 0
    for i in range(300):
        if rng.random() < 0.5:
            before = core.num_waiting_tokens
            size = rng.randint(4, 40)
            try:
                add(core, f"r{i}", size, rng.randint(1, 16), now=d.now)
            except Overloaded:
                num_refused += 1
                assert before and before + size > bound
            else:
                assert not before or core.num_waiting_tokens <= bound
        if core.requests and rng.random() < 0.05:
            core.abort_request(rng.choice(sorted(core.requests)), d.now)
        d.step()
    d.run()
    assert num_refused > 0 and core.num_waiting_tokens == 0
    core.check_invariants()


# ---------------------------------------------------------------- the service, with a toy worker


def test_requests_held_for_a_worker_obey_the_token_bound(tmp_path):
    async def scenario(rig):
        for i, size in enumerate((30, 30, 5)):
            await rig.gateway.add(f"h{i}", [9] * size, 4)
        assert await until(lambda: "h2" in rig.gateway.errors)
        assert [h.req.request_id for h in rig.service.held] == ["h0", "h1"]
        err = rig.gateway.errors["h2"]
        assert err.type == "overloaded" and "60 tokens" in err.message and "64" in err.message, err
        worker = ToyWorker(rig.worker_addr)
        try:
            assert await until(lambda: {"h0", "h1"} <= set(rig.gateway.finished))
        finally:
            await worker.kill()
        assert set(rig.gateway.errors) == {"h2"}

    asyncio.run(run_rig(tmp_path, scenario, max_waiting_tokens=64))


def test_requests_resumed_after_a_worker_loss_are_never_refused(tmp_path):
    """Every live request is WAITING again on the fresh core, so their tokens together
    exceed the bound: resuming them must not count as admitting them."""
    rids = [f"r{i}" for i in range(4)]

    async def scenario(rig):
        first = ToyWorker(rig.worker_addr, step_s=0.02)
        for rid in rids:  # one at a time: each runs before the next arrives
            await rig.gateway.add(rid, [11] * 20, 24)
            assert await until(lambda: rid in rig.gateway.tokens)
        assert await until(lambda: rig.gateway.num_tokens() >= 16)
        await first.kill()
        assert await until(lambda: rig.service.core is None, timeout=5.0)
        second = ToyWorker(rig.worker_addr)
        try:
            assert await until(lambda: len(rig.gateway.finished) + len(rig.gateway.errors) == len(rids))
        finally:
            await second.kill()
        assert not rig.gateway.errors, rig.gateway.errors
        assert rig.gateway.finished == {rid: "length" for rid in rids}

    asyncio.run(run_rig(tmp_path, scenario, max_waiting_tokens=45, step_timeout_s=0.3))


def test_queued_counts_only_requests_a_step_left_out():
    """The load report's `num_queued`: a request that arrived since the last step has not
    had its chance yet; one the step could not fit (here: the 8-block pool) has."""
    core = make_core("fcfs", num_hbm=8)
    add(core, "a", 40, 4)  # 3 blocks
    add(core, "b", 40, 4)
    assert core.stats()["num_queued"] == 0  # both just arrived
    core.schedule(0.0)
    add(core, "c", 40, 4)  # a and b fit (6 blocks), c has not been planned yet
    assert (core.stats()["num_waiting"], core.stats()["num_queued"]) == (1, 0)
    core.schedule(0.1)  # c's 3 blocks do not fit in the 2 left
    assert (core.stats()["num_waiting"], core.stats()["num_queued"]) == (1, 1)
    core.abort_request("c", 0.2)
    assert core.stats()["num_queued"] == 0
