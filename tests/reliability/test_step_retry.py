"""The worker's own answer to a step that raises (services/worker/executor.py), on the real
runner, model and transfer engine (a tiny random model on host pools): a step that raises
once is re-run from the same state, so tokens, block tables and KV are those of an undisturbed
run; a request that makes every step raise is failed alone and the others carry on."""

from __future__ import annotations

import pytest
import torch

from services.worker.executor import StepExecutor
from services.worker.faults import Faults, refusal
from services.worker.kv_pool import KVPools, KVSpec
from services.worker.model import LlamaModel
from services.worker.runner import ModelRunner
from services.worker.transfer import TransferEngine
from shared import protocol as p
from tests.worker.test_pipeline_order import BLOCK, CFG, tiny_weights

PROMPTS = {"a": [3, 9, 27, 17, 5], "b": [11, 2, 40, 33], "c": [7, 7, 1, 60, 23, 8]}
NUM_DECODES = 6


def executor(spec: str) -> StepExecutor:
    kv = KVSpec(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, BLOCK, torch.float32)
    pools = KVPools(kv, 12, 12, "cpu")
    engine = TransferEngine(pools, "duplex")
    runner = ModelRunner(LlamaModel(CFG, tiny_weights()).eval(), CFG, pools.hbm, BLOCK, "cpu")
    return StepExecutor(runner, engine, Faults(spec))


def plans() -> list[p.Plan]:
    """Prefill the three requests (one block each, request i in block i), then decode them."""
    greedy = p.SamplingParams(max_tokens=64, temperature=0.0)
    new = [p.NewRequestData(rid, prompt, greedy) for rid, prompt in PROMPTS.items()]
    first = [p.ScheduledRequest(rid, 0, len(q), new_block_ids=[i]) for i, (rid, q) in enumerate(PROMPTS.items())]
    out = [p.Plan(0, new_requests=new, scheduled=first)]
    for k in range(NUM_DECODES):
        out.append(p.Plan(k + 1, scheduled=[p.ScheduledRequest(rid, len(q) + k, 1) for rid, q in PROMPTS.items()]))
    return out


def run(spec: str, then: list[p.Plan] = ()) -> tuple[StepExecutor, list[p.StepResult]]:
    ex = executor(spec)
    try:
        return ex, [ex(plan, 0.0) for plan in [*plans(), *then]]
    finally:
        ex.engine.close()


def tokens_by_request(results: list[p.StepResult]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in results:
        for rid, t in zip(r.request_ids, r.token_ids):
            out.setdefault(rid, []).append(t)
    return out


def test_a_step_that_raises_once_is_rerun_with_nothing_appended_twice():
    ref_ex, reference = run("")
    ex, results = run("step=3")  # the 3rd plan (a decode) raises after its compute, once
    assert all(not r.failed for r in results)
    assert tokens_by_request(results) == tokens_by_request(reference)
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        known = ex.runner.token_ids(rid)
        assert known == ref_ex.runner.token_ids(rid) and len(known) == len(prompt) + NUM_DECODES + 1
        assert ex.runner._requests[rid].block_table == [i]
        written = len(known) - 1  # the last token's KV is written by the step that reads it
        assert torch.equal(ex.runner.kv_pool[i, :, :, :written], ref_ex.runner.kv_pool[i, :, :, :written])


def test_a_request_that_always_raises_is_failed_alone():
    _, reference = run("")
    ex, results = run("token=40")  # b's prompt holds token 40
    assert "b" in results[0].failed and "InjectedFault" in results[0].failed["b"]
    assert all("b" not in r.request_ids for r in results)
    got, want = tokens_by_request(results), tokens_by_request(reference)
    assert got["a"] == want["a"] and got["c"] == want["c"]
    assert "b" not in ex.runner and "b" in ex.failed  # its entries in later plans are skipped
    ex, _ = run("token=40", then=[p.Plan(NUM_DECODES + 1, drop=["b"])])
    assert not ex.failed and not ex.faults.victims  # a plan dropped it: forgotten


def test_a_new_request_that_cannot_be_added_is_failed_alone():
    ex = executor("")
    try:
        greedy = p.SamplingParams(max_tokens=8, temperature=0.0)
        ex(p.Plan(0, new_requests=[p.NewRequestData("a", [1, 2, 3], greedy)],
                  scheduled=[p.ScheduledRequest("a", 0, 3, new_block_ids=[0])]), 0.0)  # fmt: skip
        # This runner has no grammar compiler: adding a request with a grammar raises.
        bad = p.NewRequestData("g", [4, 5], p.SamplingParams(max_tokens=8, temperature=0.0, grammar='{"x": 1}'))
        fresh = p.NewRequestData("d", [4, 5], greedy)
        result = ex(p.Plan(1, new_requests=[bad, fresh], scheduled=[p.ScheduledRequest("a", 3, 1),
            p.ScheduledRequest("g", 0, 2, new_block_ids=[1]), p.ScheduledRequest("d", 0, 2, new_block_ids=[2])]), 0.0)  # fmt: skip
    finally:
        ex.engine.close()
    assert set(result.failed) == {"g"} and "GrammarCompiler" in result.failed["g"]
    assert result.request_ids == ["a", "d"]


@pytest.mark.parametrize(
    ("spec", "addrs", "keys", "refused"),
    [
        ("", ["tcp://10.1.2.3:5555"], None, False),  # no faults: nothing to refuse here
        ("step=3", ["ipc:///tmp/w.sock"], None, False),
        ("step=3", ["tcp://127.0.0.1:5555"], None, False),
        ("step=3", ["ipc:///tmp/w.sock"], "/etc/keys", True),  # CURVE: production
        ("step=3", ["tcp://10.1.2.3:5555"], None, True),  # a network endpoint: production
    ],
)
def test_fault_injection_is_refused_in_production(spec, addrs, keys, refused):
    assert (refusal(spec, addrs, keys) is not None) == refused


def test_an_unknown_fault_entry_is_an_error():
    with pytest.raises(ValueError, match="unknown entry"):
        Faults("stpe=3")
