"""Logprobs in OpenAI's response shapes, from the worker's token ids and `TokenLogprobs`.

    chat:        choices[].logprobs = {"content": [{token, logprob, bytes,
                                                    top_logprobs: [{token, logprob, bytes}] * k}]}
    completions: choices[].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}],
                                       text_offset}

As vLLM writes them: a token's string is that token decoded alone (special tokens kept), its
bytes that string's UTF-8; a completion's `top_logprobs` entry holds the k most likely tokens
and the sampled one; `text_offset` is where each token's string starts in the text, counting
the echoed prompt. The logprobs are the model's own distribution (services/worker/logits.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from services.gateway.api import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsList,
    TopLogprob,
)
from shared.protocol import TokenLogprobs

FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)


class ChatLogprobsView:
    def __init__(self, decode: Callable[[list[int]], str], top_k: int) -> None:
        self.token = lru_cache(maxsize=4096)(lambda t: decode([t]))
        self.top_k = top_k

    def render(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> ChatLogprobs:
        return ChatLogprobs(content=[self._entry(t, lp) for t, lp in zip(token_ids, logprobs)])

    def _entry(self, token_id: int, lp: TokenLogprobs) -> ChatTokenLogprob:
        text = self.token(token_id)
        top = [self._top(t, v) for t, v in zip(lp.top_ids[: self.top_k], lp.top_logprobs)]
        return ChatTokenLogprob(text, _finite(lp.logprob), list(text.encode()), top)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token(token_id)
        return TopLogprob(text, _finite(logprob), list(text.encode()))


class CompletionLogprobsView:
    """Keeps the running text offset: one view per request, rendering its tokens in order."""

    def __init__(self, decode: Callable[[list[int]], str], top_k: int) -> None:
        self.token = lru_cache(maxsize=4096)(lambda t: decode([t]))
        self.top_k = top_k
        self.offset = 0

    def render(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> CompletionLogprobs:
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for t, lp in zip(token_ids, logprobs):
            top = {self.token(i): _finite(v) for i, v in zip(lp.top_ids[: self.top_k], lp.top_logprobs)}
            top.setdefault(self.token(t), _finite(lp.logprob))
            self._add(out, t, _finite(lp.logprob), top)
        return out

    def render_prompt(self, prompt_ids: list[int], logprobs: list[TokenLogprobs]) -> CompletionLogprobs:
        """The echoed prompt: its first token has no logprob (nothing comes before it)."""
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        self._add(out, prompt_ids[0], None, None)
        rest = self.render(prompt_ids[1:], logprobs)
        return join([out, rest])

    def _add(self, out: CompletionLogprobs, token_id: int, logprob, top) -> None:
        text = self.token(token_id)
        out.text_offset.append(self.offset)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        self.offset += len(text)


def join(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=[o for p in parts for o in p.text_offset],
        token_logprobs=[v for p in parts for v in p.token_logprobs],
        tokens=[t for p in parts for t in p.tokens],
        top_logprobs=[d for p in parts for d in p.top_logprobs],
    )


class PromptLogprobsView:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, then a map of token id
    (a string, as JSON keys are) to {logprob, rank, decoded_token} holding the k most likely
    tokens (ranks 1..k) and the prompt's own token. Its rank is known when it is among the
    worker's top tokens; null otherwise."""

    def __init__(self, decode: Callable[[list[int]], str], top_k: int) -> None:
        self.token = lru_cache(maxsize=4096)(lambda t: decode([t]))
        self.top_k = top_k

    def render(self, prompt_ids: list[int], logprobs: list[TokenLogprobs]) -> PromptLogprobsList:
        out: PromptLogprobsList = [None]
        for token_id, lp in zip(prompt_ids[1:], logprobs):
            entry = {
                str(t): PromptLogprob(_finite(v), rank, self.token(t))
                for rank, (t, v) in enumerate(zip(lp.top_ids[: self.top_k], lp.top_logprobs), start=1)
            }
            if str(token_id) not in entry:
                rank = lp.top_ids.index(token_id) + 1 if token_id in lp.top_ids else None
                entry[str(token_id)] = PromptLogprob(_finite(lp.logprob), rank, self.token(token_id))
            out.append(entry)
        return out
