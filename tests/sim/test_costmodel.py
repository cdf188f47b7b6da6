"""The cost model: shapes, roofline step time, link curve and transfer modes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim.costmodel import (
    GB,
    MODELS,
    MODES,
    LinearCost,
    StepWork,
    check_pair,
    compute_time,
    ideal_time,
    load_hardware,
    num_kv_blocks,
    transfer_time,
)

GPUS = ("gh200", "h200-pcie")
KB, MB = 1 << 10, 1 << 20


def work(num_prefill: int = 0, num_decodes: int = 0, context: int = 0) -> StepWork:
    w = StepWork()
    if num_prefill:
        w.add(0, num_prefill, True)
    for _ in range(num_decodes):
        w.add(context, 1, True)
    return w


def test_param_counts_match_the_published_sizes():
    assert MODELS["qwen2.5-32b"].num_params / 1e9 == pytest.approx(32.8, abs=0.1)
    assert MODELS["llama3-8b"].num_params / 1e9 == pytest.approx(8.03, abs=0.05)
    assert MODELS["smollm2"].num_params / 1e6 == pytest.approx(134.5, abs=1)
    mix = MODELS["mixtral-8x7b"]
    assert mix.num_params / 1e9 == pytest.approx(46.7, abs=0.2)
    assert (mix.active_layer_params + mix.embed_params) / 1e9 == pytest.approx(12.9, abs=0.2)


def test_moe_reads_only_routed_experts():
    mix = MODELS["mixtral-8x7b"]
    assert mix.weights_read(1) < mix.weights_read(4) < mix.weights_read(256) <= mix.num_params
    assert mix.weights_read(1000) == pytest.approx(mix.num_params, rel=1e-3)
    dense = MODELS["llama3-8b"]
    assert dense.weights_read(1) == dense.num_params


@pytest.mark.parametrize("hw_name", GPUS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_step_time_is_monotone_in_tokens_and_context(hw_name, model):
    hw, m = load_hardware(hw_name), MODELS[model]
    assert compute_time(hw, m, StepWork()) == 0.0
    prefill = [compute_time(hw, m, work(num_prefill=n)) for n in (16, 256, 2048, 8192)]
    decode = [compute_time(hw, m, work(num_decodes=n, context=500)) for n in (1, 64, 512, 1024)]
    context = [compute_time(hw, m, work(num_decodes=64, context=c)) for c in (10, 1000, 4000, 16000)]
    for series in (prefill, decode, context):
        assert all(a <= b for a, b in zip(series, series[1:])), series
        assert series[0] < series[-1]
    assert prefill[0] >= hw.step_overhead_s


def test_roofline_regimes_on_gh200():
    """A small decode batch is bound by reading the weights; a long prefill by FLOPs."""
    hw, m = load_hardware("gh200"), MODELS["qwen2.5-32b"]
    weights_s = m.num_params * 2 / (hw.hbm_bw * hw.hbm_efficiency)
    assert compute_time(hw, m, work(num_decodes=8, context=100)) == pytest.approx(
        weights_s + hw.step_overhead_s, rel=0.02
    )
    flops_s = 2 * m.active_layer_params * 8192 / (hw.flops * hw.compute_efficiency)
    assert compute_time(hw, m, work(num_prefill=8192)) > flops_s


def test_linear_profile_prices_each_term():
    lin = LinearCost("smollm2", 0.01, 0.001, 0.002, 1e-5)
    cpu = replace(load_hardware("gh200"), linear=lin)
    w = work(num_prefill=100)
    w.add(50, 1, True)
    assert compute_time(cpu, MODELS["smollm2"], w) == pytest.approx(0.01 + 0.1 + 0.002 + 1e-5 * (100 + 51))
    with pytest.raises(ValueError):
        check_pair(cpu, "qwen2.5-32b")
    check_pair(cpu, "smollm2")


def test_segment_curve_endpoints_match_the_profiles():
    gh = load_hardware("gh200").link
    assert gh.rate(8 * MB) == pytest.approx(200 * GB)
    assert gh.rate(64 * MB) == pytest.approx(200 * GB)
    assert gh.rate(64 * KB) < 10 * GB and gh.rate(4 * KB) < gh.rate(64 * KB)
    assert gh.dram_gbs == 384
    pcie = load_hardware("h200-pcie").link
    assert pcie.rate(64 * MB) == pytest.approx(50 * GB)
    assert pcie.duplex_cap == pytest.approx(83 * GB)
    sizes = [2**k for k in range(10, 28)]
    assert all(gh.rate(a) <= gh.rate(b) for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("hw_name", GPUS)
@pytest.mark.parametrize("model", ["qwen2.5-32b", "llama3-8b", "mixtral-8x7b"])
@pytest.mark.parametrize("num_blocks", [1, 16, 2400])
def test_transfer_modes_order(hw_name, model, num_blocks):
    """naive > merged > batched >= duplex for the same blocks both ways."""
    hw, m = load_hardware(hw_name), MODELS[model]
    t = {mode: transfer_time(hw, m, mode, num_blocks, num_blocks, 16) for mode in MODES}
    assert t["naive"].total_s > t["merged"].total_s >= t["batched"].total_s >= t["duplex"].total_s
    if num_blocks > 1:
        assert t["merged"].total_s > t["batched"].total_s
    for x in t.values():
        assert 0 < x.in_s <= x.total_s


def test_table1_sixteen_gb_on_gh200():
    """8 GB in + 8 GB out: duplex within 15% of the ideal, naive at ~10 GB/s (paper: 46.8 ms
    vs 41.7 ms ideal; naive ~1556 ms)."""
    hw, m = load_hardware("gh200"), MODELS["qwen2.5-32b"]
    n = int(8e9 // m.kv_block_bytes(16, 2))
    nbytes = n * m.kv_block_bytes(16, 2)
    ideal = ideal_time(hw, nbytes, nbytes)
    assert ideal == pytest.approx(16e9 / 384e9, rel=0.01)
    duplex = transfer_time(hw, m, "duplex", n, n, 16).total_s
    assert ideal < duplex < 1.15 * ideal
    naive = transfer_time(hw, m, "naive", n, n, 16).total_s
    assert 1.2 < naive < 2.2


def test_duplex_one_direction_and_both():
    hw, m = load_hardware("h200-pcie"), MODELS["llama3-8b"]
    only_in = transfer_time(hw, m, "duplex", 1000, 0, 16)
    both = transfer_time(hw, m, "duplex", 1000, 1000, 16)
    assert only_in.in_s == only_in.total_s
    # Both ways share the 83 GB/s cap: slower than one way alone, faster than in series.
    assert only_in.total_s < both.total_s < 2 * only_in.total_s
    assert both.in_s <= both.total_s


def test_kv_pool_sizes():
    hw, m = load_hardware("gh200"), MODELS["qwen2.5-32b"]
    block = m.kv_block_bytes(16, 2)
    assert block == 4 * MB
    hbm, dram = num_kv_blocks(hw, m, 16)
    assert hbm == int((144e9 * 0.9 - m.num_params * 2) // block)
    assert dram == int(400e9 // block)  # the paper's KV share of the 480 GB Grace memory
    assert 14000 < hbm < 16000
    small = replace(hw, hbm_bytes=96e9)
    num_kv_blocks(small, MODELS["llama3-8b"], 16)
    with pytest.raises(ValueError):
        num_kv_blocks(small, MODELS["mixtral-8x7b"], 16)  # 93 GB of weights do not fit in 86 GB
