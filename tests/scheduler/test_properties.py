"""Property-based runs of every policy: random arrivals, sampled tokens (some stop),
aborts, pipelined plans and clock jumps, with the invariants checked after every plan and
every result, and liveness once arrivals stop."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.scheduler.core import POLICIES, SchedulerConfig, SchedulerCore
from shared.protocol import SLO, AddRequest, SamplingParams

from .harness import STOP, Driver

configs = st.fixed_dictionaries(
    {
        "hbm_tokens": st.integers(80, 160),  # small enough that requests compete for HBM
        "dram_tokens": st.sampled_from([0, 32, 128, 2048]),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "max_batched_tokens": st.integers(4, 64),
        "max_num_seqs": st.integers(1, 16),
        "xfer_budget": st.integers(1, 40),
        "eager_rotation": st.booleans(),
        "tbt_slo": st.sampled_from([0.01, 0.1, 1.0]),
        "ttft_slo": st.sampled_from([0.05, 1.0]),
        "beta_b": st.sampled_from([0.0, 1.0]),
        "alpha": st.sampled_from([1.0, 3.0]),
    }
)

# (prompt tokens, max_tokens, tight per-request SLO)
requests = st.lists(st.tuples(st.integers(1, 48), st.integers(1, 32), st.booleans()), min_size=4, max_size=20)

ops = st.lists(
    st.one_of(
        st.just(("add",)),
        st.just(("step",)),
        st.just(("pipelined",)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("wait"), st.floats(0.0, 2.0)),
    ),
    min_size=1,
    max_size=60,
)


def build(policy: str, c: dict) -> SchedulerCore:
    cfg = SchedulerConfig(
        policy=policy,
        block_size=c["block_size"],
        max_batched_tokens=c["max_batched_tokens"],
        max_num_seqs=c["max_num_seqs"],
        xfer_budget=c["xfer_budget"],
        eager_rotation=c["eager_rotation"],
        tbt_slo=c["tbt_slo"],
        ttft_slo=c["ttft_slo"],
        beta_b=c["beta_b"],
        alpha=c["alpha"],
    )
    bs = c["block_size"]
    return SchedulerCore(cfg, c["hbm_tokens"] // bs, c["dram_tokens"] // bs, max_model_len=256)


def pipelined(d: Driver) -> None:
    """Plan t+1 before t's result, as the cross-iteration pipeline does."""
    core = d.core
    p0 = core.schedule(d.now)
    core.check_invariants()
    p1 = core.schedule(d.now)
    core.check_invariants()
    if p0 is not None and p1 is not None:
        # p1's copies run while p0's may still be in flight: no block p0 reads is overwritten.
        assert not {h for h, _ in p0.swap_out} & {h for _, h in p1.swap_in}, "swap-in over an in-flight swap-out"
        assert not {d for d, _ in p0.swap_in} & {d for _, d in p1.swap_out + p1.eager}, "DRAM source overwritten"
    for plan in (p0, p1):
        if plan is not None:
            result = d.worker.execute(plan)
            d.now += d.dt
            d.record(core.update(result, d.now))
            core.check_invariants()


def play(policy: str, c: dict, reqs: list, script: list, seed: int) -> None:
    """Half the requests arrive at once, the rest on "add" ops or after the script."""
    core = build(policy, c)
    d = Driver(core, seed=seed, p_stop=0.1, dt=0.01)
    added: list[str] = []
    max_tokens: dict[str, int] = {}
    todo = list(reqs)

    def arrive() -> None:
        prompt_len, mt, tight = todo.pop(0)
        rid = f"r{len(added)}"
        slo = SLO(ttft_s=0.02, tbt_s=0.005) if tight else None
        prompt = [3 + (7 * i) % 50 for i in range(prompt_len)]
        params = SamplingParams(max_tokens=mt, stop_token_ids=[STOP])
        core.add_request(AddRequest(rid, prompt, params, slo=slo), d.now)
        added.append(rid)
        max_tokens[rid] = mt

    for _ in range(len(reqs) // 2):
        arrive()
    for op in script:
        kind = op[0]
        if kind == "add" and todo:
            arrive()
        elif kind == "step":
            d.step()
        elif kind == "pipelined":
            pipelined(d)
        elif kind == "abort" and added:
            rid = added[op[1] % len(added)]
            out = core.abort_request(rid, d.now)
            if out is not None:
                d.record([out])
            core.check_invariants()
        elif kind == "wait":
            d.now += op[1]
    while todo:
        arrive()
    d.run(max_steps=4000)
    assert set(d.finish) == set(added)
    for rid, reason in d.finish.items():
        n = len(d.outputs.get(rid, []))
        assert n <= max_tokens[rid]
        if reason == "length":
            assert n == max_tokens[rid]
        elif reason == "stop":
            assert d.outputs[rid][-1] == STOP
    m = core.memory
    assert m.hbm.num_free == m.hbm.num_blocks and m.dram.num_free == m.dram.num_blocks
    assert not core.running and not core.requests


def _tight(max_batched_tokens: int, max_num_seqs: int, xfer_budget: int) -> dict:
    """A tiny HBM and no DRAM: every rotation is a recompute (livelock hunting ground)."""
    return {
        "hbm_tokens": 80, "dram_tokens": 0, "block_size": 1, "max_batched_tokens": max_batched_tokens,
        "max_num_seqs": max_num_seqs, "xfer_budget": xfer_budget, "eager_rotation": False,
        "tbt_slo": 0.01, "ttft_slo": 0.05, "beta_b": 0.0, "alpha": 1.0,
    }  # fmt: skip


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=configs, reqs=requests, script=ops, seed=st.integers(0, 2**16))
# Found livelocks: LVF evicting a request mid-prefill by recompute, again and again.
@example(
    c=_tight(21, 4, 24),
    reqs=[(16, 8, False), (23, 2, False), (24, 2, False), (23, 1, False)],
    script=[("add",)],
    seed=0,
)
@example(
    c=_tight(7, 3, 1),
    reqs=[(37, 1, False), (1, 10, True), (13, 4, True), (16, 1, False), (3, 2, True), (37, 1, False)],
    script=[("step",)],
    seed=0,
)
# Found: admitted without room. The victims LVF preempted held the candidate's cached prefix, whose
# blocks, freed, then had to be revived out of the free ones: its need was counted before.
@example(
    c={
        "hbm_tokens": 80, "dram_tokens": 0, "block_size": 8, "max_batched_tokens": 48, "max_num_seqs": 5,
        "xfer_budget": 6, "eager_rotation": False, "tbt_slo": 0.01, "ttft_slo": 0.05, "beta_b": 0.0, "alpha": 1.0,
    },  # fmt: skip
    reqs=[(31, 9, False), (32, 8, False), (1, 3, False), (43, 7, False), (7, 7, False)],
    script=[("add",)],
    seed=0,
)
def test_random_workloads_keep_invariants_and_finish(policy, c, reqs, script, seed):
    play(policy, c, reqs, script, seed)
