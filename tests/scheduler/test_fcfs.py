"""FCFS foundation: continuous batching, chunked prefill, recompute preemption, finishes,
aborts, validation and the pipelined (plan t+1 before result t) path."""

from __future__ import annotations

import pytest

from services.scheduler.core import Overloaded, SchedulerConfig
from shared.protocol import SLO, AddRequest, SamplingParams, StepResult

from .harness import STOP, Driver, SymbolicWorker, add, make_core


def entries(plan):
    return {s.request_id: s for s in plan.scheduled}


def test_batches_prefills_then_decodes_with_block_diffs():
    core = make_core(block_size=4)
    d = Driver(core)
    for i in range(3):
        add(core, f"r{i}", 10, 8)
    p0 = d.step()
    assert [n.request_id for n in p0.new_requests] == ["r0", "r1", "r2"]
    e = entries(p0)
    assert all(e[r].num_computed_tokens == 0 and e[r].num_new_tokens == 10 for r in e)
    assert all(len(e[r].new_block_ids) == 3 and e[r].block_table is None for r in e)
    p1 = d.step()
    assert p1.new_requests == []
    e = entries(p1)
    assert all(s.num_computed_tokens == 10 and s.num_new_tokens == 1 for s in e.values())
    assert all(s.new_block_ids == [] for s in e.values())  # 11 tokens still fit in 3 blocks
    d.step()  # computes token 12
    e = entries(d.step())  # computes token 13: a 4th block
    assert all(len(s.new_block_ids) == 1 for s in e.values())


def test_chunked_prefill_samples_only_at_the_end():
    core = make_core(block_size=4, max_batched_tokens=16)
    d = Driver(core)
    add(core, "a", 40, 4)
    chunks = []
    for _ in range(3):
        plan = d.step()
        chunks.append(entries(plan)["a"].num_new_tokens)
        assert ("a" in d.outputs) == (len(chunks) == 3)
    assert chunks == [16, 16, 8]


def test_decodes_go_first_and_prefill_takes_the_rest_of_the_budget():
    core = make_core(block_size=4, max_batched_tokens=16)
    d = Driver(core)
    add(core, "old", 8, 10)
    d.step()
    add(core, "new", 40, 4)
    e = entries(d.step())
    assert e["old"].num_new_tokens == 1
    assert e["new"].num_new_tokens == 15
    assert [s.request_id for s in d.plans[-1].scheduled][0] == "old"


def test_max_num_seqs_limits_a_step():
    core = make_core(block_size=4, max_num_seqs=2)
    d = Driver(core)
    for i in range(3):
        add(core, f"r{i}", 4, 2)
    assert set(entries(d.step())) == {"r0", "r1"}
    d.run()
    assert set(d.finish) == {"r0", "r1", "r2"}


@pytest.mark.parametrize("caching", [False, True])
def test_recompute_preempts_the_newest_and_keeps_its_tokens(caching):
    # 6 blocks of 4: two requests of 8 prompt tokens grow until one must go.
    core = make_core("fcfs", num_hbm=6, block_size=4, enable_prefix_caching=caching)
    d = Driver(core)
    add(core, "old", 8, 12)
    add(core, "new", 8, 12)
    restarted = None
    for _ in range(40):
        plan = d.step()
        if plan is None:
            continue
        e = entries(plan)
        if "new" in e and e["new"].block_table is not None:
            restarted = e["new"]
            assert "new" not in plan.drop
            break
    assert core.num_preemptions >= 1 and core.num_recomputes == core.num_preemptions
    assert restarted is not None
    # The restart recomputes prompt + the tokens it had generated (and samples one more),
    # from 0, or with prefix caching from its full blocks that stayed cached.
    num_cached = restarted.num_computed_tokens
    assert num_cached > 0 and num_cached % 4 == 0 if caching else num_cached == 0
    assert restarted.num_new_tokens == 8 + len(d.outputs["new"]) - 1 - num_cached
    d.run()
    assert d.finish == {"old": "length", "new": "length"}
    assert len(d.outputs["new"]) == 12 and core.memory.hbm.num_free == 6


def test_stop_token_and_ignore_eos_and_drop_frees_blocks():
    core = make_core(block_size=4)
    d = Driver(core, p_stop=1.0)  # every sampled token is STOP
    add(core, "stops", 5, 10, stop_token_ids=[STOP])
    add(core, "ignores", 5, 3, stop_token_ids=[STOP], ignore_eos=True)
    d.step()
    assert d.finish == {"stops": "stop"}
    nxt = d.step()
    assert nxt.drop == ["stops"]
    d.run()
    assert d.finish["ignores"] == "length" and d.outputs["ignores"] == [STOP] * 3
    assert core.memory.hbm.num_free == 64 and not core.has_unfinished()


def test_abort_frees_blocks_and_ignores_late_tokens():
    core = make_core(block_size=4)
    w = SymbolicWorker(64, 256, 4)
    add(core, "a", 10, 5)
    add(core, "b", 10, 5)
    plan = core.schedule(0.0)
    out = core.abort_request("a", 0.0)
    assert out.finish_reason == "abort" and out.token_ids == []
    assert core.abort_request("a", 0.0) is None and core.abort_request("zzz", 0.0) is None
    outs = core.update(w.execute(plan), 0.1)
    assert [o.request_id for o in outs] == ["b"]
    core.check_invariants()
    nxt = core.schedule(0.1)
    assert nxt.drop == ["a"] and "a" not in entries(nxt)
    assert core.memory.hbm.num_free == 64 - 3


def test_abort_before_it_ever_ran_sends_no_drop():
    core = make_core()
    add(core, "a", 10, 5)
    assert core.abort_request("a", 0.0).finish_reason == "abort"
    assert core.schedule(0.0) is None and not core.has_unfinished()


def test_validation():
    core = make_core(num_hbm=4, block_size=16, max_model_len=100, max_waiting=2)
    p = SamplingParams(max_tokens=10)
    with pytest.raises(ValueError, match="context window"):
        core.add_request(AddRequest("x", [1] * 95, p), 0.0)
    with pytest.raises(ValueError, match="KV-cache"):
        core.add_request(AddRequest("x", [1] * 60, p), 0.0)
    with pytest.raises(ValueError, match="empty"):
        core.add_request(AddRequest("x", [], p), 0.0)
    core.add_request(AddRequest("a", [1] * 10, p), 0.0)
    with pytest.raises(ValueError, match="already"):
        core.add_request(AddRequest("a", [1] * 10, p), 0.0)
    core.add_request(AddRequest("b", [1] * 10, p), 0.0)
    with pytest.raises(Overloaded):
        core.add_request(AddRequest("c", [1] * 10, p), 0.0)
    with pytest.raises(ValueError):
        SchedulerConfig(policy="nope")


def test_resubmission_carries_its_outputs():
    core = make_core(block_size=4)
    d = Driver(core)
    core.add_request(AddRequest("r", [5] * 6, SamplingParams(max_tokens=5), output_token_ids=[7, 8]), 0.0)
    plan = d.step()
    assert plan.new_requests[0].output_token_ids == [7, 8]
    assert entries(plan)["r"].num_new_tokens == 8
    d.run()
    assert len(d.outputs["r"]) == 3 and d.finish["r"] == "length"


def test_slo_override_is_stored():
    core = make_core()
    core.add_request(AddRequest("r", [1] * 4, SamplingParams(max_tokens=2), slo=SLO(ttft_s=1.0)), 0.0)
    r = core.requests["r"]
    assert (r.ttft_slo, r.tbt_slo) == (1.0, core.cfg.tbt_slo)


def test_pipelined_plan_assumes_one_token_per_decode():
    core = make_core(block_size=4)
    w = SymbolicWorker(64, 256, 4, p_stop=0.0)
    add(core, "a", 6, 3)
    p0 = core.schedule(0.0)
    p1 = core.schedule(0.0)  # built before p0's result
    assert entries(p1)["a"].num_computed_tokens == 6 and entries(p1)["a"].num_new_tokens == 1
    r0, r1 = w.execute(p0), w.execute(p1)
    assert len(core.update(r0, 0.1)) == 1
    core.check_invariants()
    p2 = core.schedule(0.1)
    outs = core.update(r1, 0.2)
    assert outs[0].finish_reason is None
    r2 = w.execute(p2)
    assert core.update(r2, 0.3)[0].finish_reason == "length"
    core.check_invariants()
    assert core.schedule(0.3).drop == ["a"]


def test_pipelined_finish_leaves_a_stale_entry_that_is_dropped_later():
    core = make_core(block_size=4)
    add(core, "a", 6, 5, stop_token_ids=[STOP])
    p0 = core.schedule(0.0)
    p1 = core.schedule(0.0)
    outs = core.update(StepResult(step_id=p0.step_id, request_ids=["a"], token_ids=[STOP]), 0.1)
    assert outs[0].finish_reason == "stop"
    # p1's sample for "a" arrives after it finished: ignored.
    assert core.update(StepResult(step_id=p1.step_id, request_ids=["a"], token_ids=[9]), 0.2) == []
    core.check_invariants()
    assert core.schedule(0.2).drop == ["a"]


def test_everything_finishes_under_pressure_for_every_policy():
    for policy in ("fcfs", "sf", "wf", "lvf"):
        core = make_core(policy, num_hbm=16, num_dram=64, block_size=4, max_batched_tokens=32)
        d = Driver(core, p_stop=0.05)
        for i in range(10):
            add(core, f"r{i}", 10 + i, 20, stop_token_ids=[STOP])
        d.run()
        assert len(d.finish) == 10, policy
        assert core.memory.hbm.num_free == 16 and core.memory.dram.num_free == 64, policy


def test_admission_reserves_room_for_the_whole_prompt():
    """A prompt whose first chunk fits but whole does not waits instead of being admitted
    for one chunk and preempted (recomputed) when it cannot grow into the next."""

    def run(reserve):
        core = make_core("fcfs", num_hbm=10, block_size=4, max_batched_tokens=16, reserve_full_prompt=reserve)
        d = Driver(core)
        add(core, "old", 8, 12)
        d.step()
        add(core, "long", 36, 2, now=d.now)  # 9 blocks + 1 to sample; old holds 3-5
        plan = d.step()
        admitted = "long" in entries(plan)
        d.run()
        assert set(d.finish) == {"old", "long"}
        return admitted, core.num_preemptions

    assert run(reserve=True) == (False, 0)
    admitted, num_preemptions = run(reserve=False)
    assert admitted and num_preemptions >= 1


def test_no_preemption_while_every_running_request_fits():
    """Growth preempts only when the next tokens of the running requests do not fit."""
    core = make_core("fcfs", num_hbm=12, block_size=4, max_batched_tokens=16)
    d = Driver(core)
    for i in range(6):
        add(core, f"r{i}", 6 + 3 * i, 6)
    num_checked = 0
    while core.has_unfinished():
        free = core.memory.hbm.num_free
        need = sum(core.memory.blocks_needed(r, r.num_schedulable()) for r in core.running.values())
        d.step()
        if need <= free:
            assert core.last_step.num_preempted == 0
            num_checked += 1
    assert num_checked > 10 and len(d.finish) == 6
