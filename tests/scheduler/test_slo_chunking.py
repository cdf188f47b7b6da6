"""SLO-aware chunking: while requests decode, a step's prefill tokens are capped so that the
step's compute time, as learnt from the worker's reports, stays within the TBT SLO."""

from __future__ import annotations

import pytest

from services.scheduler.core.steptime import MIN_PREFILL_CHUNK, SLO_SHARE, StepTimeModel
from shared.protocol import StepTimings

from .harness import SymbolicWorker, add, make_core

FIXED_S, PER_TOKEN_S = 0.03, 0.001  # the simulated worker: 30 ms a step + 1 ms a token


def test_fit_recovers_a_linear_step_time():
    model = StepTimeModel()
    for n in (1, 2, 3, 100, 200, 300, 4, 150, 5, 250):
        model.observe(n, FIXED_S + PER_TOKEN_S * n)
    a, b = model.fit()
    assert a == pytest.approx(FIXED_S) and b == pytest.approx(PER_TOKEN_S)
    # 90 ms of a 100 ms SLO: 60 tokens beyond the fixed part, 4 of them the decodes
    assert model.prefill_cap(4, 0.1, MIN_PREFILL_CHUNK) == int((SLO_SHARE * 0.1 - FIXED_S) / PER_TOKEN_S) - 4
    assert model.prefill_cap(100, 0.1, MIN_PREFILL_CHUNK) == MIN_PREFILL_CHUNK  # over the SLO anyway: still advance


def test_no_fit_without_enough_or_varied_steps():
    model = StepTimeModel()
    for _ in range(50):
        model.observe(8, 0.05)  # decode-only steps say nothing about the cost of a token
    assert model.fit() is None and model.prefill_cap(8, 0.1, MIN_PREFILL_CHUNK) is None
    few = StepTimeModel()
    for n in (1, 300, 2):
        few.observe(n, FIXED_S + PER_TOKEN_S * n)
    assert few.fit() is None


def run_step(core, worker, now):
    plan = core.schedule(now)
    result = worker.execute(plan)
    num_tokens = sum(s.num_new_tokens for s in plan.scheduled)
    result.timings = StepTimings(compute_s=FIXED_S + PER_TOKEN_S * num_tokens)
    core.update(result, now + result.timings.compute_s)
    core.check_invariants()
    return plan


def prompt_chunks(slo_chunking: bool, policy: str = "fcfs") -> list[int]:
    """Tokens per step of a 400-token prompt that arrives while one request decodes, after
    the core has seen prefills and decodes of other sizes."""
    core = make_core(policy, num_hbm=256, block_size=16, max_batched_tokens=512, slo_chunking=slo_chunking)
    worker = SymbolicWorker(256, 256, 16)
    now = 0.0
    for i, size in enumerate((300, 40, 200)):  # warm the model: prefills then decodes
        add(core, f"warm{i}", size, 3)
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


@pytest.mark.parametrize("policy", ["fcfs", "lvf"])
def test_prompt_is_chunked_within_the_tbt_slo_while_others_decode(policy):
    chunks = prompt_chunks(True, policy)
    cap = int((SLO_SHARE * 0.1 - FIXED_S) / PER_TOKEN_S) - 1  # one decode beside it
    assert max(chunks) == cap and sum(chunks) == 400
    assert all(FIXED_S + PER_TOKEN_S * (c + 1) <= 0.1 for c in chunks)  # every step within the SLO


def test_without_slo_chunking_the_prompt_takes_the_token_budget():
    assert prompt_chunks(False) == [400]


def test_a_prompt_alone_gets_the_whole_budget():
    """Nobody decodes: no gap to protect, so the fewest chunks (best TTFT)."""
    core = make_core(num_hbm=256, block_size=16, max_batched_tokens=512)
    worker = SymbolicWorker(256, 256, 16)
    for n in (1, 300, 2, 200, 3, 100, 4, 250, 5):
        core.step_time.observe(n, FIXED_S + PER_TOKEN_S * n)
    add(core, "alone", 450, 2)
    plan = run_step(core, worker, 0.0)
    assert [s.num_new_tokens for s in plan.scheduled] == [450]
