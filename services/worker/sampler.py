"""Per-request sampling: greedy, temperature, min-p, top-k, top-p, each with its own seeded
generator.

Greedy rows share one argmax. The other rows are tempered together, then filtered (min-p,
top-k and top-p as vLLM applies them) and drawn from, each from one float64 uniform of the
request's own `torch.Generator`, reseeded for each draw from (request seed, position). On CPU one
native call (csrc/sampling.c) filters and draws every such row; elsewhere the torch ops here do,
row by row, by the same algorithm: the same floors, the same uniform, the draw in id order over
the tokens the filters keep. A token therefore depends on its seed, its position and its logits
only: not on which requests shared the batch, on a preemption, recompute or resubmission
before it, nor on whether the kernels were built (up to the rounding of the weights' sums, a
draw within ~1e-7 of a boundary between two tokens).
"""

from __future__ import annotations

import secrets

import torch

from services.worker import cpu_kernels
from shared.protocol import SamplingParams

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd constant: spreads consecutive positions over the seed space


def request_seed(params: SamplingParams) -> int:
    """The request's base seed: `params.seed`, or a fresh random one when None."""
    return secrets.randbits(63) if params.seed is None else params.seed & _MASK63


def draw_seed(base_seed: int, position: int) -> int:
    """Seed of the draw that produces the token at `position` (a pure function)."""
    return (base_seed + _GOLDEN * (position + 1)) & _MASK63


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature <= 0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's generator; None for greedy requests, which never draw."""
    return None if is_greedy(params) else torch.Generator(device=device)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    seeds: list[int],
) -> list[int]:
    """One token id per row. logits: [S, V] float32; row i belongs to params[i] and, when it
    draws, reseeds generators[i] with seeds[i] (see `draw_seed`) first."""
    num_rows = logits.shape[0]
    tokens = [0] * num_rows
    greedy = [i for i in range(num_rows) if is_greedy(params[i])]
    random = [i for i in range(num_rows) if not is_greedy(params[i])]
    if greedy:  # all rows, the common case, without the copy a list index makes (~0.1 ms at 49K ids)
        rows = logits if len(greedy) == num_rows else logits[greedy]
        native = cpu_kernels.for_tensor(rows) if rows.is_contiguous() else None
        picked = native.argmax(rows) if native is not None else rows.argmax(dim=-1).tolist()
        for i, t in zip(greedy, picked):
            tokens[i] = t
    if random:
        for i in random:
            generators[i].manual_seed(seeds[i])
        rows = logits if len(random) == num_rows else logits[random]  # as for the greedy rows
        drawn = _sample_random(rows, [params[i] for i in random], [generators[i] for i in random])
        for i, t in zip(random, drawn):
            tokens[i] = t
    return tokens


def _sample_random(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: [R, V] -> one drawn id per row."""
    u = [float(torch.rand((), generator=g, dtype=torch.float64)) for g in generators]  # one per row, either path
    native = cpu_kernels.for_tensor(logits) if logits.is_contiguous() else None
    if native is not None:  # the same temperature, filters and draw, every row in one call (csrc/sampling.c)
        knobs = ([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params])
        return native.sample(logits, *knobs, [p.min_p for p in params], u)
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temps[:, None]  # [R, V]
    return [_sample_row(scaled[i], params[i], u[i]) for i in range(len(params))]


def _sample_row(scaled: torch.Tensor, p: SamplingParams, u: float) -> int:
    """scaled: [V], one tempered row -> the id drawn with the uniform u, in id order over the
    weights the filters left (as csrc/sampling.c draws)."""
    ids, weights = distribution(scaled, p)
    if ids is None:
        return _draw(weights.double(), u)
    row = torch.zeros(scaled.shape[0], dtype=torch.float64, device=scaled.device)  # [V]
    row[ids] = weights
    return _draw(row, u)


def distribution(scaled: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """What one tempered row [V] draws from after min-p, top-k and top-p, as vLLM applies them:
    (ids, weights), token ids[i] drawn in proportion to weights[i] (ids None: token i), zero
    where filtered out.

    min-p compares with the most likely token of the whole row. top-k keeps the k best in the
    order of a stable descending sort of the logits (among equal logits the lower id first, as
    with argmax, so top_k=1 picks exactly the greedy token); top-p then keeps the smallest
    prefix of that order whose probability, among what min-p and top-k left, reaches p (the
    best token always).

    Only the best tokens are sorted: those within a factor of the best that hold the top-k, or
    top-p's mass (`_FLOORS`), nearly always a few hundred. Sorting the whole row took 4 ms at
    49K ids, and torch's multinomial draw 1.3 ms, per row and step."""
    vocab = scaled.shape[0]
    top_k = p.top_k if 0 < p.top_k < vocab else 0
    below = scaled - scaled.max()
    weights = torch.exp(below).masked_fill(~(below >= UNDERFLOW), 0.0)  # the best token's is 1; NaN 0
    if p.min_p > 0.0:
        weights = weights.masked_fill(weights < p.min_p, 0.0)
    if not top_k and p.top_p >= 1.0:
        return None, weights
    total = float(weights.sum())
    for floor in _FLOORS:
        chosen = weights >= floor
        rest = float(weights.masked_fill(chosen, 0.0).sum())
        enough = int(chosen.sum()) >= top_k if top_k else total - rest >= p.top_p * total
        if enough or rest == 0.0:
            break
    ids = chosen.nonzero().squeeze(1)  # ascending, so the stable sort puts lower ids first among equals
    ids = ids[scaled[ids].sort(descending=True, stable=True).indices]
    w = weights[ids].double()
    if top_k:
        w[top_k:] = 0.0
        rest = 0.0
    if p.top_p < 1.0:
        probs = w / (float(w.sum()) + rest)
        mass_before = probs.cumsum(dim=0) - probs  # probability of the strictly better tokens
        w[1:] *= mass_before[1:] < p.top_p
    return ids, w


# Weights (relative to the best token's) above which tokens are sorted, tried in turn until
# they hold the top-k or top-p's mass: 1e-2 is 4.6 nats below the best; the last, any weight.
# csrc/sampling.c's FLOORS, as its UNDERFLOW: a token more than 87 nats below the best weighs 0.
_FLOORS = (1e-2, 1e-4, 1e-8, torch.finfo(torch.float32).tiny)
UNDERFLOW = -87.0


def _draw(weights: torch.Tensor, u: float) -> int:
    """weights: [V] float64 >= 0 -> the first id whose running sum exceeds u x the total (inverse
    CDF, in id order); a rounding edge at the very top gives the last id with weight, a row
    without weight id 0 (csrc/sampling.c's inverse_cdf)."""
    cdf = weights.cumsum(dim=0)
    if float(cdf[-1]) <= 0.0:
        return 0
    i = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(cdf) - 1)
    if float(weights[i]) == 0.0:
        i = int(weights.nonzero()[-1])
    return i
