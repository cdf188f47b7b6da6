"""Per-request sampling: greedy, temperature, min-p, top-k, top-p, each with its own seeded
generator.

Greedy rows share one argmax. The other rows are filtered together (temperature, then min-p,
top-k and top-p as vLLM applies them, on one sorted copy of their logits); only the final
draw is per row, with the request's own `torch.Generator`, reseeded for each draw from
(request seed, position).
A token therefore depends on its seed, its position and its logits only: not on which
requests shared the batch, nor on a preemption, recompute or resubmission before it.
"""

from __future__ import annotations

import secrets

import torch

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
        picked = (logits if len(greedy) == num_rows else logits[greedy]).argmax(dim=-1).tolist()
        for i, t in zip(greedy, picked):
            tokens[i] = t
    if random:
        rows = [params[i] for i in random]
        for i in random:
            generators[i].manual_seed(seeds[i])
        drawn = _sample_random(logits[random], rows, [generators[i] for i in random])
        for i, t in zip(random, drawn):
            tokens[i] = t
    return tokens


def _sample_random(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: [R, V] -> one drawn id per row."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temps[:, None]  # [R, V]
    if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        probs = torch.softmax(scaled, dim=-1)
        return [_draw(probs[i], generators[i]) for i in range(len(params))]
    # Stable descending sort: among equal logits the lower id comes first, as with argmax,
    # so top_k=1 picks exactly the greedy token.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [R, V] each
    sorted_logits = sorted_logits.masked_fill(_filtered(sorted_logits, params), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # [R, V], in sorted order
    return [int(order[i, _draw(probs[i], generators[i])]) for i in range(len(params))]


def _filtered(sorted_logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] bool: True where a sorted entry falls outside the row's min-p / top-k / top-p set.
    min-p compares with the most likely token of the whole distribution (vLLM's order)."""
    num_rows, vocab = sorted_logits.shape
    device = sorted_logits.device
    ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    ranks = torch.arange(vocab, device=device)[None, :]  # [1, V]
    outside = ranks >= ks[:, None]  # [R, V]
    min_ps = torch.tensor([p.min_p for p in params], dtype=sorted_logits.dtype, device=device)
    if bool((min_ps > 0).any()):
        full = torch.softmax(sorted_logits, dim=-1)  # sorted: column 0 is the most likely
        outside |= full < min_ps[:, None] * full[:, :1]
    # top_p >= 1 keeps everything (no float-rounding cut of the tail).
    top_ps = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
    probs = torch.softmax(sorted_logits.masked_fill(outside, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V]: probability of strictly better tokens
    # Keep a token while the better ones have not yet reached top_p; the best is always kept.
    return outside | ((mass_before >= top_ps[:, None].to(probs.dtype)) & (ranks > 0))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs: [V] -> one index drawn with the request's own generator."""
    return int(torch.multinomial(probs, 1, generator=generator))
