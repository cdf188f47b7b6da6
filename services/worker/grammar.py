"""Structured output on the worker: one llguidance matcher per constrained request.

A request whose `SamplingParams.grammar` is set gets a `Constraint`. In each step that samples
it, the tokens its grammar allows next become a mask applied to its logits row before anything
reads the row (logprobs, processors, the draw), so logprobs are those of the constrained
distribution, as vLLM reports them; after the draw the matcher consumes the token. Once the
grammar is complete llguidance allows only the stop tokens (the llguidance tokenizer is built
with the model's stop tokens as its EOS), and the scheduler ends the request on the one drawn:
finish_reason "stop". max_tokens ends it first as "length".

The state of a matcher is a function of the tokens it consumed: a request added with outputs
already generated (a failover to another worker) replays them, and rotation or a recompute
keeps the runner's request, matcher included.

Mask time per step, bundled SmolLM2 tokenizer (49152 tokens), one CPU core, greedy runs of
a {name: string, age: integer} schema and of json_object: llguidance's `compute_bitmask`
0.01 ms median, 0.07 ms p99; with unpacking the bits and masking the row (`mask_rows`)
0.15 ms median (a decode step of the model on the same core: tens of ms).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import llguidance
import structlog
import torch

log = structlog.get_logger()
_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit j of a mask word is token 32 * word + j


class Constraint:
    """One request's grammar: what it allows next, and the tokens it consumed."""

    def __init__(self, matcher: llguidance.LLMatcher, request_id: str, vocab_size: int) -> None:
        self.matcher = matcher
        self.request_id = request_id
        self.vocab_size = vocab_size  # the tokenizer's; the model's logits may have more rows

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """row: [W] int32, contiguous, on the CPU: the allowed tokens as bits."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def advance(self, token: int) -> None:
        """The token was drawn: the matcher consumes it. A token the grammar refused (only
        possible when the matcher already failed) leaves it in its error state, in which it
        allows only the stop tokens: the request ends at the next draw."""
        if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
            log.warning("grammar_failed", request_id=self.request_id, error=self.matcher.get_error())


class GrammarCompiler:
    """Builds the constraints of one model's requests. The llguidance tokenizer (about 2 s:
    the model file's tokenizer is read) is built on the first constrained request."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = Path(model_path)

    @cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        # The one reader of tokenizers from model files, the gateway's too.
        from shared.tokenizer import load_tokenizer

        tok = load_tokenizer(self.model_path)
        return llguidance.LLTokenizer(tok.backend_json(), eos_token=tok.stop_token_ids)

    def constraint(self, grammar: str, request_id: str, output_token_ids: list[int]) -> Constraint:
        """A matcher for `grammar` (which the gateway validated) that has consumed the
        outputs already generated."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        c = Constraint(matcher, request_id, self.tokenizer.vocab_size)
        if c.matcher.is_error():
            log.warning("grammar_invalid", request_id=request_id, error=c.matcher.get_error())
        for t in output_token_ids:
            c.advance(t)
        return c


def mask_rows(logits: torch.Tensor, rows: list[int], constraints: list[Constraint]) -> None:
    """In place. logits: [S, V]; row rows[i] keeps only the tokens constraints[i] allows
    (-inf elsewhere, rows past the tokenizer's vocabulary included). The masks are computed
    on the CPU while the device may still be computing `logits`."""
    vocab = logits.shape[1]
    words = (constraints[0].vocab_size + 31) // 32  # one tokenizer for all
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)  # [R, W]
    for i, c in enumerate(constraints):
        c.fill_bitmask(bitmask[i])
    allowed = ((bitmask[:, :, None] >> _SHIFTS) & 1).flatten(1).bool()  # [R, 32 W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab]  # [R, V]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
