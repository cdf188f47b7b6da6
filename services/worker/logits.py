"""What happens to a step's logits between the model and the draw, for the requests that ask.

- Log probabilities are those of the model's own distribution, as vLLM returns them by
  default (`logprobs_mode="raw_logprobs"`): log_softmax of the logits the model produced,
  taken before any processor, penalty, temperature or top-k/top-p. Greedy's token is
  therefore always the top-1 alternative.
- The processors run in vLLM's order, on the logits the sampler then draws from: min_tokens
  (stop tokens masked) and logit_bias first, then the repetition, frequency and presence
  penalties (vLLM's semantics: repetition over prompt and output, the other two over the
  output only).

None of this runs for a row whose request asks for nothing (`wants_processing` false and
`params.logprobs` None): a step where no request asks costs what it did before.
"""

from __future__ import annotations

import torch

from shared.protocol import SamplingParams, TokenLogprobs


def wants_processing(params: SamplingParams) -> bool:
    return bool(
        params.min_tokens > 0
        or params.logit_bias
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def process_row(row: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt: int) -> None:
    """In place. row: [V] logits of a request whose known tokens are `token_ids` (the first
    `num_prompt` of them its prompt)."""
    vocab = row.shape[0]
    num_output = len(token_ids) - num_prompt
    if num_output < params.min_tokens and not params.ignore_eos:
        row[[t for t in params.stop_token_ids if t < vocab]] = float("-inf")
    if params.logit_bias:
        ids = [t for t in params.logit_bias if 0 <= t < vocab]
        row[ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=row.dtype, device=row.device)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[torch.tensor(token_ids, dtype=torch.long, device=row.device)] = True
        penalised = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        row.copy_(torch.where(seen, penalised, row))
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and num_output > 0:
        outputs = torch.tensor(token_ids[num_prompt:], dtype=torch.long, device=row.device)
        counts = torch.bincount(outputs, minlength=vocab).to(row.dtype)  # [V]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """logits: [R, V] -> [R, V] float32 log probabilities (a new tensor: later in-place
    processing of `logits` does not reach it)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """logprobs: [R, V]; row i scores token_ids[i] and lists its ks[i] most likely tokens."""
    num_rows = logprobs.shape[0]
    rows = torch.arange(num_rows, device=logprobs.device)
    chosen = logprobs[rows, torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)].tolist()
    k_max = max(ks, default=0)
    if k_max == 0:
        return [TokenLogprobs(lp) for lp in chosen]
    top_values, top_ids = logprobs.topk(k_max, dim=-1)  # [R, k_max] each, most likely first
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(chosen[i], top_ids[i][: ks[i]], top_values[i][: ks[i]]) for i in range(num_rows)
    ]
