"""`bench calibrate`: the fit, the link profile, and its shapes on the real runner."""

from __future__ import annotations

import json
import random

import pytest
import torch

from bench.sim import calibrate
from bench.sim.costmodel import StepWork, hardware_from_dict
from services.worker.kv_pool import KVSpec


def sample(num_prefill: int, decodes: list[int]) -> StepWork:
    w = StepWork()
    if num_prefill:
        w.add(0, num_prefill, True)
    for ctx in decodes:
        w.add(ctx, 1, True)
    return w


def test_fit_recovers_known_costs_from_noisy_steps():
    rng = random.Random(0)
    truth = [0.02, 3e-3, 5e-3, 1e-5]
    works = [sample(n, []) for n in (32, 128, 320, 512)] + [
        sample(0, [c] * b) for b, c in ((1, 64), (8, 480), (32, 64), (32, 240), (64, 112))
    ]
    samples = [
        (w, sum(t * f for t, f in zip(truth, calibrate.features(w))) * rng.uniform(0.97, 1.03)) for w in works * 3
    ]
    coef, r2 = calibrate.fit_linear(samples)
    assert r2 > 0.98
    for got, want in zip(coef[:3], truth[:3]):
        assert got == pytest.approx(want, rel=0.15)


def test_fit_never_returns_negative_costs():
    """A term the data cannot support is pinned at zero, not made negative."""
    works = [sample(n, []) for n in (32, 128, 512)] + [sample(0, [64] * b) for b in (1, 8, 32)]
    samples = [(w, 0.05 + 0.002 * w.num_tokens) for w in works]
    coef, _ = calibrate.fit_linear(samples)
    assert all(c >= 0 for c in coef)


def test_link_profile_from_mode_timings():
    spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    per_dir = calibrate.XFER_BLOCKS * spec.block_bytes
    link = calibrate.link_profile(spec, {"naive": 0.2, "merged": 0.02, "batched": 0.01, "duplex": 0.008})
    sizes = [s for s, _ in link["curve"]]
    assert sizes == [spec.segment_bytes, spec.block_bytes, per_dir]
    assert link["curve"][-1][1] == pytest.approx(2 * per_dir / 0.01 / 1e9, rel=1e-3)
    assert link["dram_gbs"] == pytest.approx(2 * per_dir / 0.008 / 1e9, rel=1e-3)
    profile = {
        "name": "t",
        "link": link,
        "linear": {
            "model": "smollm2",
            "overhead_s": 0.01,
            "prefill_token_s": 0.001,
            "decode_token_s": 0.001,
            "kv_token_s": 0.0,
        },
    }
    hw = hardware_from_dict(json.loads(calibrate.dump(profile)))
    assert hw.link.rate(spec.block_bytes) == pytest.approx(2 * per_dir / 0.02, rel=1e-3)


def test_scheduler_cost_is_measured():
    assert 0 < calibrate.measure_sched_ms(num_requests=8, num_steps=20) < 100


@pytest.mark.slow  # loads the bundled model (~5 s alone, more on a busy machine)
def test_shapes_drive_the_real_runner():
    from services.worker.runner import ModelRunner, allocate_kv_pool, load_model
    from shared.modelfile import default_model_path

    model, cfg = load_model(default_model_path(), "cpu")
    runner = ModelRunner(model, cfg, allocate_kv_pool(cfg, 16, 16, torch.float32, "cpu"), 16, "cpu")
    shapes = calibrate.Shapes(runner)
    work, seconds = shapes.prefill(20)
    assert (work.num_prefill_tokens, work.num_kv_read, seconds > 0) == (20, 20, True)
    steps = shapes.decodes(batch=3, context=30, num_steps=2)
    assert [w.num_decode_tokens for w, _ in steps] == [3, 3]
    assert [w.num_kv_read for w, _ in steps] == [3 * 30, 3 * 31]
    assert runner.num_requests == 0  # every shape drops its requests
