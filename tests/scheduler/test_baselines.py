"""The paper's baselines (core/baselines.py): each one's defining rule, and that each
serves a mixed workload to the end with the core's invariants holding."""

from __future__ import annotations

import random

import pytest

from services.scheduler.core import SchedulerConfig, SchedulerCore
from services.scheduler.core.baselines import lightllm_tokens, peak_tokens
from shared.protocol import SLO, AddRequest, SamplingParams

from .harness import STOP, Driver, add, make_core


def scheduled(plan) -> set[str]:
    return {s.request_id for s in plan.scheduled}


def add_slo(core, rid: str, prompt_len: int, max_tokens: int, now: float = 0.0, **slo) -> None:
    core.add_request(AddRequest(rid, [5] * prompt_len, SamplingParams(max_tokens=max_tokens), slo=SLO(**slo)), now)


@pytest.mark.parametrize("policy", ["trtllm", "trtllm-maxutil", "lightllm", "ltr", "edf"])
def test_serves_a_mixed_workload_to_the_end(policy):
    core = make_core(policy, num_hbm=40, block_size=4)
    d = Driver(core, seed=1, p_stop=0.05)
    rng = random.Random(1)
    for i in range(30):
        add(core, f"r{i}", rng.randint(1, 40), rng.randint(1, 60), stop_token_ids=[STOP])
    d.run()
    assert len(d.finish) == 30 and core.memory.hbm.num_free == 40
    if policy != "ltr":  # ltr swaps, as vllm-ltr does
        assert core.num_rotations_out == 0 and core.memory.num_swapped_out == 0  # recompute only


# ---------------------------------------------------------------- trtllm


def test_trtllm_reserves_prompt_plus_max_tokens():
    # 10 blocks of 4. Each request reserves 4 + 20 tokens = 6 blocks, although its prompt
    # needs one now: the second waits until the first is done, as FCFS would not.
    core = make_core("trtllm", num_hbm=10, block_size=4)
    d = Driver(core, p_stop=1.0)  # the first token is a stop: the cap is never reached
    add(core, "a", 4, 20, stop_token_ids=[STOP])
    add(core, "b", 4, 20, stop_token_ids=[STOP])
    assert scheduled(d.step()) == {"a"}
    assert "b" in scheduled(d.step())  # a finished at its first token, its reservation with it
    fcfs = make_core("fcfs", num_hbm=10, block_size=4)
    add(fcfs, "a", 4, 20)
    add(fcfs, "b", 4, 20)
    assert scheduled(Driver(fcfs).step()) == {"a", "b"}


def test_trtllm_never_preempts_under_pressure():
    core = make_core("trtllm", num_hbm=12, block_size=4)
    d = Driver(core, seed=2)
    for i in range(12):
        add(core, f"r{i}", 6 + i, 30)
    d.run()
    assert core.num_preemptions == 0 and len(d.finish) == 12
    fcfs = make_core("fcfs", num_hbm=12, block_size=4)
    for i in range(12):
        add(fcfs, f"r{i}", 6 + i, 30)
    Driver(fcfs, seed=2).run()
    assert fcfs.num_preemptions > 0  # the same load does preempt without the reservation


# ---------------------------------------------------------------- lightllm


def test_lightllm_peak_is_the_max_over_finishing_times():
    # longest to go first: (2 now, 20 left) peaks at 22 when it alone runs on; when the
    # (10, 5) one finishes both hold 12 + 2 × 5 = 22; two of (4, 10) peak at 8 + 2 × 10.
    assert peak_tokens([(10, 5), (2, 20)]) == 22
    assert peak_tokens([(4, 10), (4, 10)]) == 28
    assert peak_tokens([(30, 0), (1, 1)]) == 31 + 0


def test_lightllm_tokens_as_its_router_counts_them():
    core = make_core("lightllm", num_hbm=600, block_size=4, max_batched_tokens=512)
    add(core, "a", 4, 2000)
    req = core.requests["a"]
    # busy (its default): the rest of max_tokens; 4 + 1 held; one prefill chunk to run
    # lives 6 + 1 steps longer; + 6 of slack
    assert lightllm_tokens(req, True, 512) == (5, 7 + 2000 - 0 - 1 + 6)
    # not busy: max(1.1 x output so far, 1024), within max_tokens
    assert lightllm_tokens(req, False, 512) == (5, 7 + 1024 - 1 + 6)
    req.output_token_ids += [7] * 1000
    req.num_computed_tokens = req.num_known
    assert lightllm_tokens(req, False, 512) == (1005, 1100 - 1000 - 1 + 6)


def test_lightllm_admits_by_predicted_peak():
    # 12 blocks of 4. Two requests of 4 + 20 each hold 4 + 1 and expect 7 + 19 + 6 to come:
    # together they peak at 10 + 2 x 32 tokens, over the 40 that 12 blocks hold (a block of
    # slack each), so the second waits, however short their outputs turn out; two of 4 + 2
    # peak at 10 + 2 x 14 and both run.
    core = make_core("lightllm", num_hbm=12, block_size=4)
    d = Driver(core)
    add(core, "a", 4, 20)
    add(core, "b", 4, 20)
    assert scheduled(d.step()) == {"a"}
    small = make_core("lightllm", num_hbm=12, block_size=4)
    add(small, "a", 4, 2)
    add(small, "b", 4, 2)
    assert scheduled(Driver(small).step()) == {"a", "b"}


# ---------------------------------------------------------------- ltr


def ltr_core(predicted: dict[str, float], num_hbm: int = 64, **kw) -> SchedulerCore:
    cfg = SchedulerConfig(policy="ltr", block_size=4, **kw)
    return SchedulerCore(cfg, num_hbm, 64, 2048, predictor=lambda r: predicted[r.request_id])


def test_ltr_runs_the_shortest_predicted_first():
    core = ltr_core({"a": 50, "b": 5, "c": 20}, max_num_seqs=1, ttft_slo=100.0)
    d = Driver(core)
    for rid in "abc":
        add(core, rid, 4, 3)
    order = []
    while core.has_unfinished():
        plan = d.step()
        for rid in scheduled(plan) if plan else ():
            if rid not in order:
                order.append(rid)
    assert order == ["b", "c", "a"]


def test_ltr_preempts_a_longer_running_request_for_a_shorter_one():
    # 7 blocks of 4: the long request holds 5 of them; a short one arrives needing 3. The
    # long one is swapped out (vllm-ltr preempts by swap) and the short one runs once its
    # blocks are back from the copy, before the long one returns.
    core = ltr_core({"long": 100, "short": 1}, num_hbm=7, ttft_slo=100.0)
    d = Driver(core)
    add(core, "long", 18, 6)
    d.step()
    d.step()
    add(core, "short", 10, 2, now=d.now)
    plan = d.step()
    assert "long" not in scheduled(plan) and len(plan.swap_out) == 5
    assert [r.request_id for r in core.last_step.preempted] == ["long"] and core.num_recomputes == 0
    order = []
    while core.has_unfinished():
        plan = d.step()
        order += [rid for rid in scheduled(plan) if rid not in order] if plan else []
    assert order[0] == "short" and set(d.finish) == {"long", "short"}


# ---------------------------------------------------------------- edf


def test_edf_admits_the_earliest_ttft_deadline_first():
    core = make_core("edf", max_num_seqs=1, block_size=4)
    d = Driver(core)
    add_slo(core, "late", 4, 2, ttft_s=10.0)
    add_slo(core, "soon", 4, 2, ttft_s=1.0)
    assert scheduled(d.step()) == {"soon"}


def test_edf_preempts_the_latest_next_token_deadline():
    # 6 blocks of 4: two decodes grow until one must go. FCFS would preempt the newer
    # arrival; EDF preempts the one whose next token is due last (TBT SLO 1 s vs 50 ms).
    core = make_core("edf", num_hbm=6, block_size=4)
    d = Driver(core)
    add_slo(core, "relaxed", 8, 12, tbt_s=1.0)
    add_slo(core, "tight", 8, 12, tbt_s=0.05)
    first = None
    while first is None and core.has_unfinished():
        d.step()
        if core.last_step.preempted:
            first = core.last_step.preempted[0].request_id
    assert first == "relaxed"
    d.run()
    assert set(d.finish) == {"relaxed", "tight"}
