"""superinfer-artifact (services/scheduler/core/artifact.py), the authors' released scheduler,
on a tiny hand-built case: 16 HBM blocks of 16 tokens, B_xfer (the artifact's proactive swap
budget) 8. a, b and c (33-token prompts, 3 blocks each) are put on the GPU at t = 0, 0.1, 0.2;
d (150 tokens, 10 blocks) arrives at 0.25: HBM can no longer hold everything, and 7 blocks are
free, fewer than the budget. Invariants are checked after every step (the harness)."""

from __future__ import annotations

from services.scheduler.core import Status
from services.scheduler.core.artifact import host_use

from .harness import Driver, add, make_core


def started(num_dram: int = 64, extra: tuple[tuple[float, str, int], ...] = ()) -> Driver:
    """The driver at t = 0.3, a, b, c running and d (and `extra`: (arrival, id, prompt)) waiting."""
    core = make_core(
        "superinfer-artifact", num_hbm=16, num_dram=num_dram, block_size=16, xfer_budget=8, enable_prefix_caching=False
    )
    d = Driver(core, dt=0.1)
    for t, rid in ((0.0, "a"), (0.1, "b"), (0.2, "c")):
        add(core, rid, 33, 60, now=t)
        d.now = t
        d.step()
    assert list(core.running) == ["a", "b", "c"] and core.memory.hbm.num_free == 7
    add(core, "d", 150, 60, now=0.25)
    for t, rid, n in extra:
        add(core, rid, n, 60, now=t)
    d.now = 0.3
    return d


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def test_keeps_the_budget_free_by_swapping_out_the_longest_running_decodes():
    d = started()
    d.step()
    step, core = d.core.last_step, d.core
    # Free blocks (7) < budget (8): decodes go, the longest on the GPU first, while what they free
    # stays under the budget: a (3), b (3 -> 6); c would make 9. Not budget - free (1 block: a alone).
    assert ids(step.preempted) == ["a", "b"]
    assert core.requests["a"].status is Status.ROTARY and core.requests["b"].status is Status.ROTARY
    assert len(step.swap_out) == 6 and ids(step.scheduled) == ["c"]


def test_no_proactive_swap_while_everything_fits():
    d = started()
    d.core.abort_request("d", 0.26)
    d.step()
    assert not d.core.last_step.preempted and ids(d.core.last_step.scheduled) == ["a", "b", "c"]


def test_admits_the_longest_waiting_first_new_and_swapped_out_alike():
    d = started()
    d.step()  # a, b swapped out at 0.3
    d.step()
    # d has waited since 0.25, a and b since 0.3: d goes first, though it arrived last;
    # then a (3 blocks: 13 of 13 free); b does not fit.
    assert ids(d.core.last_step.admitted) == ["d", "a"]
    d.step()
    # t = 0.5, 0 free: c (on the GPU since 0.2) goes; d and a since 0.4, d admitted first, and
    # d's 10 blocks would reach the budget: the scan ends there (a, behind it, stays).
    assert ids(d.core.last_step.preempted) == ["c"]
    d.step()
    # b has waited since 0.3, c since 0.5: b first (3 blocks free: b fits, c does not).
    assert ids(d.core.last_step.admitted) == ["b"]
    d.run()
    assert sorted(d.finish) == ["a", "b", "c", "d"]


def test_admission_stops_at_the_first_request_that_does_not_fit():
    d = started(extra=((0.27, "e", 17),))
    d.step()
    # 7 blocks free in this step (a's and b's are still being copied out): d (10) does not fit,
    # and e (2 blocks), behind it, is not admitted either.
    assert ids(d.core.last_step.admitted) == []
    assert d.core.requests["e"].status is Status.WAITING
    d.step()
    assert ids(d.core.last_step.admitted) == ["d", "e"]


def test_new_requests_wait_while_host_use_is_above_09():
    d = started(num_dram=8)  # host use (16 + DRAM in use) / 24: 0.67 empty, 0.92 with a and b out
    d.step()
    assert ids(d.core.last_step.preempted) == ["a", "b"]
    assert host_use(d.core.memory) > 0.9
    d.step()
    # d waited longest but is new: passed over; the swapped-out a and b come back.
    assert ids(d.core.last_step.admitted) == ["a", "b"]
    d.run()
    assert sorted(d.finish) == ["a", "b", "c", "d"]


def test_without_dram_new_requests_are_not_held_back_for_good():
    """Host use (16 + 0) / 16 = 1: the artifact cannot start so; here nothing is swapped out and
    new requests are admitted (a running request short of blocks is recomputed)."""
    core = make_core("superinfer-artifact", num_hbm=16, num_dram=0, block_size=16, xfer_budget=8)
    d = Driver(core, dt=0.1)
    for i in range(6):
        add(core, f"r{i}", 33, 60, now=0.0)
    d.run()
    assert len(d.finish) == 6 and core.num_rotations_out == 0


def test_a_prompt_still_prefilling_is_not_swapped_out_early():
    """a decodes from t=0; p's 100-token prompt is admitted at 0.1 for a 31-token chunk (the
    32-token budget less a's decode); d arrives. At 0.2, 11 blocks free < the budget of 12:
    a goes; p, still prefilling, is passed over though its 2 blocks would stay within the budget."""
    core = make_core(
        "superinfer-artifact", num_hbm=16, num_dram=64, block_size=16, xfer_budget=12, max_batched_tokens=32,
        enable_prefix_caching=False,
    )
    d = Driver(core, dt=0.1)
    add(core, "a", 33, 60, now=0.0)
    d.step()
    add(core, "p", 100, 20, now=0.1)
    d.step()
    assert core.requests["p"].num_computed_tokens == 31 and core.memory.hbm.num_free == 11
    add(core, "d", 150, 20, now=0.15)
    d.step()
    assert ids(core.last_step.preempted) == ["a"]
    assert core.requests["p"].status is Status.RUNNING
    d.run()
    assert sorted(d.finish) == ["a", "d", "p"]
