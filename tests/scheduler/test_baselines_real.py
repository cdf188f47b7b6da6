"""Each baseline's distinctive behaviour as the real system's code has it (the rules and
their sources: bench/report/baselines_table.py), on tiny hand-built cases."""

from __future__ import annotations

import functools

from bench.report import baselines_table
from bench.sim import costmodel, engine
from bench.sim.costmodel import MODELS, load_hardware
from services.scheduler.core import SchedulerConfig, SchedulerCore, baselines
from services.scheduler.core.ltr import PROMOTE_STEPS, STARVE_STEPS
from shared.protocol import AddRequest, SamplingParams

from .harness import STOP, Driver, add, make_core


def scheduled(plan) -> set[str]:
    return {s.request_id for s in plan.scheduled} if plan else set()


# ---------------------------------------------------------------- lightllm


def test_lightllm_admits_by_max_new_tokens_while_busy(monkeypatch):
    # 400 blocks of 4 (1600 tokens). Two requests of 8 + max_tokens 1500 whose first token
    # is a stop. Busy (the default router_token_ratio 0.0: always), each is expected to run
    # to its max_tokens: (9, 7 + 1499 + 6) each, a peak of 18 + 2 x 1512 over the pool: the
    # first is admitted, the second waits for it although both would fit many times over.
    core = make_core("lightllm", num_hbm=400, block_size=4, max_model_len=4096)
    d = Driver(core, p_stop=1.0)
    add(core, "a", 8, 1500, stop_token_ids=[STOP])
    add(core, "b", 8, 1500, stop_token_ids=[STOP])
    assert scheduled(d.step()) == {"a"}
    assert "b" in scheduled(d.step())  # a finished at its first token
    # 700 blocks (2800 tokens): busy, 18 + 2 x 1512 is still over; not busy (a ratio above
    # the pool's use) the estimate is router_max_new_token_len, 1024: 18 + 2 x 1036 fits.
    core = make_core("lightllm", num_hbm=700, block_size=4, max_model_len=4096)
    add(core, "a", 8, 1500)
    add(core, "b", 8, 1500)
    assert scheduled(Driver(core).step()) == {"a"}
    monkeypatch.setitem(baselines.BASELINE_STEPS, "lightllm", functools.partial(baselines.schedule_lightllm, token_ratio=0.5))
    core = make_core("lightllm", num_hbm=700, block_size=4, max_model_len=4096)
    add(core, "a", 8, 1500)
    add(core, "b", 8, 1500)
    assert scheduled(Driver(core).step()) == {"a", "b"}


def test_lightllm_never_pauses_at_its_default_ratio():
    core = make_core("lightllm", num_hbm=24, block_size=4)
    d = Driver(core, seed=3)
    for i in range(10):
        add(core, f"r{i}", 5 + i, 12)
    d.run()
    assert len(d.finish) == 10 and core.num_preemptions == 0


# ---------------------------------------------------------------- trtllm


def pressure(core: SchedulerCore) -> Driver:
    d = Driver(core, seed=2)
    for i in range(12):
        add(core, f"r{i}", 6 + i, 30)
    return d


def test_trtllm_guaranteed_no_evict_never_evicts_and_max_utilization_does():
    no_evict = make_core("trtllm", num_hbm=12, block_size=4)
    d = pressure(no_evict)
    d.run()
    assert no_evict.num_preemptions == 0 and len(d.finish) == 12
    max_util = make_core("trtllm-maxutil", num_hbm=12, block_size=4)
    d = pressure(max_util)
    d.run()
    assert max_util.num_preemptions > 0 and max_util.num_recomputes == max_util.num_preemptions
    assert len(d.finish) == 12


def test_trtllm_max_utilization_pauses_the_newest_started_request():
    # 6 blocks of 4: three requests of 4 tokens decode until the blocks run out; the
    # oldest's next block pauses the newest started one, never an older one.
    core = make_core("trtllm-maxutil", num_hbm=6, block_size=4)
    d = Driver(core)
    for rid in "abc":
        add(core, rid, 4, 12)
    first = None
    while first is None and core.has_unfinished():
        d.step()
        if core.last_step.preempted:
            first = [r.request_id for r in core.last_step.preempted]
    assert first == ["c"]
    d.run()
    assert set(d.finish) == {"a", "b", "c"}


def test_trtllm_reservation_subtracts_prefix_cache_hits():
    # 20 blocks of 4. "a" (a 32-token prompt, max_tokens 16) reserves 12 blocks, 8 of them
    # its prompt. "b" shares a's first 28 tokens (7 full blocks, in HBM while a runs):
    # its own reservation of 12 blocks less those 7 hits fits in the 8 left; without the
    # subtraction it would wait for a to finish.
    core = make_core("trtllm", num_hbm=20, block_size=4)
    d = Driver(core)
    prefix = list(range(100, 128))
    core.add_request(AddRequest("a", prefix + [1, 2, 3, 4], SamplingParams(max_tokens=16)), 0.0)
    d.step()
    d.step()
    core.add_request(AddRequest("b", prefix + [5, 6, 7, 8], SamplingParams(max_tokens=16)), d.now)
    assert baselines.blocks_to_reserve(core, core.requests["b"]) == 12 - 7
    assert "b" in scheduled(d.step()) and core.requests["b"].num_cached_tokens == 28


def test_reserving_baselines_are_sent_each_requests_output_length():
    hw, model = load_hardware("gh200"), MODELS["qwen2.5-32b"]
    for policy in baselines.CLIENT_SENDS_OUTPUT_LEN:
        assert engine.make_setup(hw, model, SchedulerConfig(policy=policy), "duplex", max_tokens=2048).max_tokens == 0
    assert engine.make_setup(hw, model, SchedulerConfig(policy="fcfs"), "duplex", max_tokens=2048).max_tokens == 2048


# ---------------------------------------------------------------- ltr


def test_ltr_starvation_guard_promotes_after_its_idle_steps():
    # A 4-token step budget and a short request ranked first arriving every step, each a
    # 4-token prompt: the long one gets no token until it has waited STARVE_STEPS steps,
    # then runs PROMOTE_STEPS scheduled steps on top, then waits behind the short ones again.
    num_steps = STARVE_STEPS + 40
    predicted = {"long": 1000.0, **{f"s{i}": 1.0 for i in range(num_steps)}}
    cfg = SchedulerConfig(policy="ltr", block_size=4, max_batched_tokens=4, max_num_seqs=8)
    core = SchedulerCore(cfg, 256, 256, 2048, predictor=lambda r: predicted[r.request_id])
    d = Driver(core)
    add(core, "long", 4, 40)
    runs: list[int] = []
    for n in range(num_steps):
        add(core, f"s{n}", 4, 1, now=d.now)
        if "long" in scheduled(d.step()):
            runs.append(n)
    assert runs and STARVE_STEPS <= runs[0] <= STARVE_STEPS + 2
    assert runs == list(range(runs[0], runs[0] + PROMOTE_STEPS))


def test_ltr_ranks_running_requests_too():
    # Three running decodes and a 4-token budget shared with a paused short prompt ranked
    # first: the short one's prefill takes the budget before the lowest-ranked decode.
    predicted = {"x": 50.0, "y": 60.0, "z": 70.0, "short": 1.0}
    cfg = SchedulerConfig(policy="ltr", block_size=4, max_batched_tokens=4)
    core = SchedulerCore(cfg, 64, 64, 2048, predictor=lambda r: predicted[r.request_id])
    d = Driver(core)
    for rid in "xyz":
        add(core, rid, 1, 20)
    for _ in range(3):
        d.step()
    add(core, "short", 2, 3, now=d.now)
    plan = d.step()
    assert scheduled(plan) == {"short", "x", "y"}


# ---------------------------------------------------------------- neo


def test_neo_charges_the_prompt_kv_copy_to_the_host():
    assert costmodel.neo_prompt_copy_blocks(1000, 0.0, 16) == 0  # all of it fits in HBM
    assert costmodel.neo_prompt_copy_blocks(1000, 0.5, 16) == 32  # half of 1000 tokens, in blocks
    assert costmodel.neo_host_share(150, 100) == 50 / 150
    # In a run: NEO copies prompt KV out, where vLLM V1 on the same HBM copies nothing.
    hw, model = load_hardware("gh200"), MODELS["qwen2.5-32b"]
    items = [engine.WorkItem("", 3000, 200, 0.05 * i) for i in range(40)]
    cfg = SchedulerConfig(policy="fcfs")
    neo = engine.simulate(items, engine.make_setup(hw, model, cfg, "duplex", hbm=2000, neo=True))
    fcfs = engine.simulate(items, engine.make_setup(hw, model, cfg, "duplex", hbm=2000))
    assert sum(fcfs.xfer_ms) == 0 and sum(neo.xfer_ms) > 0


def test_neo_has_no_row_on_moe_models():
    assert costmodel.neo_applicable(MODELS["qwen2.5-32b"]) and not costmodel.neo_applicable(MODELS["mixtral-8x7b"])
    try:
        engine.make_setup(load_hardware("gh200"), MODELS["mixtral-8x7b"], SchedulerConfig(policy="fcfs"), "duplex", neo=True)
    except ValueError as e:
        assert "MoE" in str(e)
    else:
        raise AssertionError("NEO ran an MoE model")


def test_baselines_table_renders_every_policy_with_its_source():
    md = baselines_table.markdown()
    for b in baselines_table.BASELINES:
        assert f"**{b.policy}**" in md
        if b.source:
            assert b.source.commit[:12] in md and b.source.paths[0] in md
    assert md.count("\n") == len(baselines_table.BASELINES) + 2
