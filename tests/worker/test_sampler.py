"""Sampling: the filters on synthetic logits, and seeded runs through the real runner."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys

import torch

import pytest

from bench.live.server import REPO
from services.worker import cpu_kernels, sampler
from services.worker.sampler import distribution, draw_seed, make_generator, request_seed, sample
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest
from tests.worker.conftest import blocks_for, generate_together, greedy


@pytest.fixture(params=["native", "torch"])
def draw_path(request, monkeypatch):
    """Sampled rows drawn by the CPU kernel (csrc/sampling.c), or by the torch path every other
    device takes."""
    if request.param == "torch":
        monkeypatch.setattr(sampler.cpu_kernels, "for_tensor", lambda t: None)
    elif cpu_kernels.kernels() is None:
        pytest.skip("no native kernels here")


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=16, **kw)


def draws(logits_row: list[float], p: SamplingParams, num: int = 300) -> set[int]:
    """The distinct tokens drawn from one row over `num` seeds."""
    logits = torch.tensor([logits_row])
    gen = make_generator(p, torch.device("cpu"))
    return {sample(logits, [p], [gen], [seed])[0] for seed in range(num)}


PROBS = [0.5, 0.3, 0.15, 0.05]
LOG_PROBS = [math.log(x) for x in PROBS]


def test_greedy_and_random_rows_in_one_batch(draw_path):
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    ps = [params(temperature=0.0), params(temperature=1.0, top_k=1), params(temperature=0.0)]
    gens = [make_generator(p, torch.device("cpu")) for p in ps]
    assert gens[0] is None and gens[1] is not None
    assert sample(logits, ps, gens, [0, 1, 2]) == [1, 0, 2]


def test_greedy_picks_torchs_argmax_ties_nan_and_all_minus_inf_included():
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(49152, generator=gen) for _ in range(3)]
    rows[1][[100, 40000]] = 50.0  # a tie: the lower id
    rows[2][[5, 7]] = float("nan")  # NaN counts as the largest: the first one
    rows += [torch.full((49152,), float("-inf")), torch.tensor([float("inf"), 1.0, float("inf")])]
    for row in rows:
        p = params(temperature=0.0)
        assert sample(row[None], [p], [None], [0]) == [int(row.argmax())]
    batch = torch.stack(rows[:4])
    assert sample(batch, [params(temperature=0.0)] * 4, [None] * 4, [0] * 4) == batch.argmax(dim=-1).tolist()


def test_top_k_keeps_the_k_best(draw_path):
    assert draws(LOG_PROBS, params(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(LOG_PROBS, params(temperature=1.0, top_k=1)) == {0}
    assert draws(LOG_PROBS, params(temperature=1.0)) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_p(draw_path):
    assert draws(LOG_PROBS, params(temperature=1.0, top_p=0.5)) == {0}
    assert draws(LOG_PROBS, params(temperature=1.0, top_p=0.6)) == {0, 1}
    assert draws(LOG_PROBS, params(temperature=1.0, top_p=0.9)) == {0, 1, 2}
    assert draws(LOG_PROBS, params(temperature=1.0, top_p=0.0)) == {0}  # the best always survives
    assert draws(LOG_PROBS, params(temperature=1.0, top_k=3, top_p=0.99)) == {0, 1, 2}


def test_min_p_drops_tokens_less_likely_than_a_share_of_the_best(draw_path):
    """vLLM's min_p: relative to the most likely token of the whole (tempered) distribution,
    before top-k / top-p."""
    assert draws(LOG_PROBS, params(temperature=1.0, min_p=0.5)) == {0, 1}  # 0.3 >= 0.25, 0.15 < 0.25
    assert draws(LOG_PROBS, params(temperature=1.0, min_p=0.2)) == {0, 1, 2}  # 0.05 < 0.1
    assert draws(LOG_PROBS, params(temperature=1.0, min_p=1.0)) == {0}
    assert draws(LOG_PROBS, params(temperature=1.0, min_p=0.2, top_k=2)) == {0, 1}
    # A hotter temperature flattens the distribution first: 0.15 and 0.05 come within 0.2 of the best.
    assert draws(LOG_PROBS, params(temperature=10.0, min_p=0.2)) == {0, 1, 2, 3}


def reference_distribution(row: torch.Tensor, p: SamplingParams) -> dict[int, float]:
    """The filters applied plainly over the whole row, in vLLM's order: min-p against the best
    token, top-k of the order by logit (lower id first among equals), then top-p's smallest
    prefix of what is left that reaches p; token -> probability."""
    probs = torch.softmax(row.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: (-row[i].item(), i))
    best = max(probs)
    kept = [i for i in order[: p.top_k if p.top_k > 0 else None] if probs[i] >= p.min_p * best]
    total = sum(probs[i] for i in kept)
    out, mass = {}, 0.0
    for i in kept:
        if out and mass >= p.top_p:
            break
        out[i] = probs[i] / total
        mass += probs[i] / total
    return {i: q / sum(out.values()) for i, q in out.items()}


def drawable(row: torch.Tensor, p: SamplingParams) -> dict[int, float]:
    ids, probs = distribution(row, p)
    ids = range(len(probs)) if ids is None else ids.tolist()
    total = probs.sum().item()  # drawn in proportion: min-p's cut is not renormalized
    return {i: q / total for i, q in zip(ids, probs.tolist()) if q > 0}


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(0, 1.0, 0.0), (0, 1.0, 0.05), (50, 1.0, 0.0), (0, 0.9, 0.0), (40, 0.95, 0.02), (0, 0.8, 0.01), (1, 1.0, 0.0)],
)
@pytest.mark.parametrize("spread", [4.0, 0.05])  # peaked, and so flat that top-p reaches past 2000 tokens
def test_distribution_over_a_large_vocabulary_is_the_whole_row_sort(top_k, top_p, min_p, spread):
    """Only the best tokens are sorted; the set and the probabilities are those of the plain
    filters over all 5000 ids (flat rows make top-p's set outgrow the first sorted tokens)."""
    row = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * spread
    row[[7, 8, 9]] = row.max()  # a three-way tie for the best
    p = params(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    got, want = drawable(row, p), reference_distribution(row, p)
    assert got.keys() == want.keys()
    assert max(abs(got[i] - want[i]) for i in want) < 1e-6


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(0, 1.0, 0.0), (0, 1.0, 0.05), (50, 1.0, 0.0), (0, 0.9, 0.0), (40, 0.95, 0.02), (0, 0.8, 0.01), (1, 1.0, 0.0)],
)
@pytest.mark.parametrize("spread", [4.0, 1.0, 0.05])
def test_native_draws_follow_the_whole_row_distribution(top_k, top_p, min_p, spread):
    """The CPU kernel's draws (csrc/sampling.c) at 1000 evenly spaced uniforms: only tokens the
    filters keep, each as often as its probability says (an inverse CDF at stratified uniforms
    gives each token its share to within 2 draws). The flatter rows hold thousands of candidates,
    which the kernel buckets by logit, sorting only the bucket where the cut falls."""
    native = cpu_kernels.kernels()
    if native is None:
        pytest.skip("no native kernels here")
    row = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * spread
    row[[7, 8, 9]] = row.max()
    p = params(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    want, num = reference_distribution(row, p), 1000
    # the logits at half the scale, drawn at temperature 0.5: the kernel divides them back
    drawn = native.sample((row * 0.5).repeat(num, 1), [0.5] * num, [top_k] * num, [top_p] * num, [min_p] * num,
                          [(j + 0.5) / num for j in range(num)])  # fmt: skip
    counts = collections.Counter(drawn)
    assert counts.keys() <= want.keys()
    assert all(abs(counts[t] / num - q) <= 2 / num for t, q in want.items())


def test_native_draws_stay_in_range_on_rows_without_weight():
    native = cpu_kernels.kernels()
    if native is None:
        pytest.skip("no native kernels here")
    rows = torch.stack([torch.full((300,), float("-inf")), torch.full((300,), float("nan"))])
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9)):
        assert all(0 <= t < 300 for t in native.sample(rows, [1.0] * 2, [top_k] * 2, [top_p] * 2, [0.0] * 2, [0.3] * 2))


def test_distribution_of_a_constrained_row_keeps_to_the_allowed_tokens():
    row = torch.full((5000,), float("-inf"))
    row[[3, 40, 41]] = torch.tensor([1.0, 2.0, 0.5])
    for p in (params(temperature=1.0, top_p=0.9), params(temperature=1.0, top_k=300), params(temperature=1.0)):
        assert drawable(row, p).keys() <= {3, 40, 41}
        assert 40 in drawable(row, p)


def test_low_temperature_is_nearly_greedy_and_high_spreads(draw_path):
    assert draws(LOG_PROBS, params(temperature=0.01)) == {0}
    flat = draws([0.0, 0.1, 0.2, 0.3], params(temperature=100.0))
    assert flat == {0, 1, 2, 3}


def test_ties_under_top_k_1_pick_the_lowest_id_like_argmax(draw_path):
    row = [1.0, 4.0, 4.0, 0.0]
    assert draws(row, params(temperature=0.7, top_k=1), num=20) == {1}


def test_a_draw_depends_on_seed_and_position_only(draw_path):
    """Same seed -> same token whether alone or in a batch with other rows."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=gen)
    p = params(temperature=1.0, top_p=0.95)
    gens = [make_generator(p, torch.device("cpu")) for _ in range(4)]
    seeds = [draw_seed(7, 100 + i) for i in range(4)]
    together = sample(logits, [p] * 4, gens, seeds)
    alone = [sample(logits[i : i + 1], [p], [gens[i]], [seeds[i]])[0] for i in range(4)]
    assert together == alone
    assert len({draw_seed(7, pos) for pos in range(1000)}) == 1000
    assert request_seed(params(seed=42)) == 42
    assert request_seed(params()) != request_seed(params())


def test_rows_with_different_filters_draw_in_one_batch_as_alone(draw_path):
    """Each row's draw is its own: filtered and drawn beside rows with other settings (some
    sorted, some not) it gives the token it gives alone, and one its filters allow."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 3000, generator=gen) * torch.tensor([[3.0], [3.0], [0.05], [3.0], [1.0], [3.0]])
    ps = [
        params(temperature=0.8, top_p=0.9),
        params(temperature=1.0),
        params(temperature=1.0, top_p=0.8),  # flat: top-p reaches past the first sorted tokens
        params(temperature=0.7, top_k=5),
        params(temperature=1.2, min_p=0.1, top_p=0.95),
        params(temperature=1.0, min_p=0.2),
    ]
    gens = [make_generator(p, torch.device("cpu")) for p in ps]
    for pos in range(20):
        seeds = [draw_seed(11 + i, pos) for i in range(6)]
        together = sample(logits, ps, gens, seeds)
        alone = [sample(logits[i : i + 1], [ps[i]], [gens[i]], [seeds[i]])[0] for i in range(6)]
        assert together == alone
        for i, t in enumerate(together):
            assert t in drawable(logits[i] / ps[i].temperature, ps[i])


def test_seeded_generation_is_reproducible(make_runner, chat_prompts):
    """Through the runner: a seeded request yields the same tokens again, next to other
    requests or alone; another seed yields others; top_k=1 yields the greedy tokens."""
    prompt = chat_prompts[0]

    def seeded(rid: str, seed: int, **kw) -> NewRequestData:
        params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=seed, **kw)
        return NewRequestData(rid, prompt, params)

    alone = generate_together(make_runner(), [seeded("s", 1234)], 12)[0]
    neighbours = [greedy("g", chat_prompts[2]), seeded("s", 1234), seeded("t", 99)]
    crowded = generate_together(make_runner(), neighbours, 12)
    assert crowded[1] == alone
    assert crowded[2] != alone
    top1 = generate_together(make_runner(), [seeded("k", 5, top_k=1), greedy("g", prompt)], 12)
    assert top1[0] == top1[1]


def test_seeded_request_recomputed_after_preemption_draws_the_same(make_runner, chat_prompts):
    prompt = chat_prompts[1]
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    want = generate_together(make_runner(), [NewRequestData("s", prompt, p)], 10)[0]

    runner = make_runner()
    runner.add_requests([NewRequestData("s", prompt, p)])
    runner.execute([ScheduledRequest("s", 0, len(prompt), block_table=[0, 1, 2])])
    for _ in range(4):
        runner.execute([ScheduledRequest("s", len(runner.token_ids("s")) - 1, 1)])
    known = len(runner.token_ids("s"))
    table = list(range(10, 10 + blocks_for(len(prompt) + 10)))
    runner.execute([ScheduledRequest("s", 0, known, block_table=table)])  # recompute, then draw
    while len(runner.token_ids("s")) < len(prompt) + 10:
        runner.execute([ScheduledRequest("s", len(runner.token_ids("s")) - 1, 1)])
    assert runner.token_ids("s")[len(prompt) :] == want


def grid_tokens() -> list[int]:
    """Seeded draws over rows peaked to flat (a flat row's top-p reaches past 512 candidates, the
    native sampler's bucketed path) and a grid of temperature, top-k, top-p and min-p: the same
    list wherever it runs, with or without the native kernels."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for spread in (6.0, 2.0, 0.3, 0.02):
        rows = torch.randn(8, 8192, generator=gen) * spread  # [8, V]: one row per seed
        rows[:, [11, 12]] = rows.max()  # a tie for the best
        for temperature in (0.3, 0.8, 1.0, 1.7):
            for top_k, top_p, min_p in ((0, 1.0, 0.0), (0, 0.95, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.1), (1, 1.0, 0.0),
                                        (20, 1.0, 0.0), (300, 0.9, 0.02), (0, 0.99, 0.0)):  # fmt: skip
                p = params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
                seeds = [draw_seed(request_seed(params(seed=s)), 40) for s in range(8)]
                gens = [make_generator(p, torch.device("cpu")) for _ in seeds]
                out += sample(rows.clone(), [p] * len(seeds), gens, seeds)
    return out


@pytest.mark.slow
def test_seeded_draws_are_the_same_with_and_without_the_native_kernels():
    """The torch path, in a process where the kernels are off (as on a machine with no compiler),
    draws the native sampler's tokens for every seed and setting."""
    if cpu_kernels.kernels() is None:
        pytest.skip("no native kernels here")
    code = "import json; from tests.worker.test_sampler import grid_tokens; print(json.dumps(grid_tokens()))"
    env = {**os.environ, cpu_kernels.ENV_SWITCH: "off"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    without = json.loads(done.stdout.splitlines()[-1])
    native = grid_tokens()
    assert len(native) == len(without) == 4 * 4 * 8 * 8
    differ = [i for i, (a, b) in enumerate(zip(native, without)) if a != b]
    assert not differ, f"{len(differ)} of {len(native)} draws differ, the first at {differ[:5]}"
