"""SLO-aware chunking (lvf, `slo_chunking`): while requests decode, a step's prefill tokens are
capped so that the step's compute time, as learnt from the worker's reports, stays within the
TBT SLO, as long as the prompts' TTFT slack can pay for it."""

from __future__ import annotations

import pytest

from services.scheduler.core.steptime import MIN_PREFILL_CHUNK, SLO_SHARE, StepTimeModel
from shared.protocol import StepTimings

from .harness import SymbolicWorker, add, make_core

FIXED_S, PER_TOKEN_S = 0.03, 0.001  # the simulated worker: 30 ms a step + 1 ms a token
CAP = int((SLO_SHARE * 0.1 - FIXED_S) / PER_TOKEN_S) - 1  # beside one decode, within 90 ms of a 100 ms SLO


def test_fit_recovers_a_linear_step_time():
    model = StepTimeModel()
    for n in (1, 2, 3, 100, 200, 300, 4, 150, 5, 250):
        model.observe(n, FIXED_S + PER_TOKEN_S * n)
    a, b = model.fit()
    assert a == pytest.approx(FIXED_S) and b == pytest.approx(PER_TOKEN_S)
    assert model.prefill_cap(1, 0.1) == CAP
    assert model.prefill_cap(100, 0.1) == MIN_PREFILL_CHUNK  # over the SLO anyway: still advance


def test_no_fit_without_enough_or_varied_steps():
    model = StepTimeModel()
    for _ in range(50):
        model.observe(8, 0.05)  # decode-only steps say nothing about the cost of a token
    assert model.fit() is None and model.prefill_cap(8, 0.1) is None
    few = StepTimeModel()
    for n in (1, 300, 2):
        few.observe(n, FIXED_S + PER_TOKEN_S * n)
    assert few.fit() is None


def run_step(core, worker, now):
    plan = core.schedule(now)
    result = worker.execute(plan)
    result.timings = StepTimings(compute_s=FIXED_S + PER_TOKEN_S * sum(s.num_new_tokens for s in plan.scheduled))
    core.update(result, now + result.timings.compute_s)
    core.check_invariants()
    return plan


def prompt_chunks(policy: str = "lvf", **cfg) -> list[int]:
    """Tokens per step of a 400-token prompt that arrives while one request decodes, after
    the core has seen prefills and decodes of other sizes."""
    core = make_core(policy, num_hbm=256, block_size=16, max_batched_tokens=512, **cfg)
    worker = SymbolicWorker(256, 256, 16)
    now = 0.0
    for i, size in enumerate((300, 40, 200)):  # the step-time model learns from these
        add(core, f"warm{i}", size, 3, now=now)
        for _ in range(4):
            run_step(core, worker, now)
            now += 0.1
    add(core, "decoding", 20, 60, now=now)
    for _ in range(3):
        run_step(core, worker, now)
        now += 0.1
    add(core, "long", 400, 2, now=now)
    chunks = []
    while sum(chunks) < 400:
        plan = run_step(core, worker, now)
        now += 0.1
        chunks += [s.num_new_tokens for s in plan.scheduled if s.request_id == "long"]
        assert any(s.request_id == "decoding" for s in plan.scheduled), "the decode must not wait"
    return chunks


def test_a_prompt_is_chunked_within_the_tbt_slo_while_others_decode():
    chunks = prompt_chunks(slo_chunking=True)
    assert max(chunks) == CAP and sum(chunks) == 400
    assert all(FIXED_S + PER_TOKEN_S * (c + 1) <= 0.1 for c in chunks)  # every step within the SLO


def test_without_slo_chunking_the_prompt_takes_the_token_budget():
    assert prompt_chunks(slo_chunking=False) == [400]
    assert prompt_chunks("lvf-paper", slo_chunking=True) == [400]  # the paper's LVF has no cap


@pytest.mark.parametrize("policy", ["fcfs", "wf"])
def test_the_cap_is_policy_agnostic_when_asked_and_off_by_default_for_baselines(policy):
    chunks = prompt_chunks(policy, slo_chunking=True)
    assert max(chunks) == CAP and sum(chunks) == 400
    assert prompt_chunks(policy) == [400]  # the baselines' default: no cap


def test_the_cap_lifts_when_the_prompts_slack_cannot_pay_for_it():
    """At the capped rate the 400 tokens need 7 steps of ~90 ms; a TTFT SLO of 1 s leaves the
    prompt 0.5 s before it lags (beta_F = 0.5): the step takes it whole."""
    assert prompt_chunks(slo_chunking=True, ttft_slo=1.0) == [400]
    assert len(prompt_chunks(slo_chunking=True, ttft_slo=2.0)) == 7


def test_a_prompt_alone_gets_the_whole_budget():
    """Nobody decodes: no gap to protect, so the fewest chunks (best TTFT)."""
    core = make_core("lvf", num_hbm=256, block_size=16, max_batched_tokens=512, slo_chunking=True)
    for n in (1, 300, 2, 200, 3, 100, 4, 250, 5):
        core.step_time.observe(n, FIXED_S + PER_TOKEN_S * n)
    add(core, "alone", 450, 2)
    plan = run_step(core, SymbolicWorker(256, 256, 16), 0.0)
    assert [s.num_new_tokens for s in plan.scheduled] == [450]


def test_the_worker_device_decides_the_default():
    from services.scheduler.core import SchedulerConfig

    assert SchedulerConfig().for_device(on_cpu=False).slo_chunking is True
    assert SchedulerConfig().for_device(on_cpu=True).slo_chunking is False
    assert SchedulerConfig(slo_chunking=True).for_device(on_cpu=True).slo_chunking is True
