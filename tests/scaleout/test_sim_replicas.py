"""`bench replicas` (bench/sim/replicas.py): replicas of the simulated gh200 behind the gateway's
own Router, fed the replicas' load reports and cache events."""

from __future__ import annotations

from bench.live.workload import WorkItem
from bench.sim.replicas import fit_context, make_setup, simulate


def conversations(num: int, num_turns: int = 3) -> list[WorkItem]:
    """`num` conversations, 0.2 s apart, each turn adding 600 tokens and answering 40 (think
    times differ, so the turns of different conversations interleave)."""
    items = []
    for c in range(num):
        prompt = 0
        for t in range(num_turns):
            prompt += 600 + (40 if t else 0)
            items.append(WorkItem("", prompt, 40, 0.2 * c, conversation=c, turn=t, think_s=0.3 + (0.37 * c) % 1))
    return items


def test_cache_aware_routing_sends_later_turns_to_their_history():
    setup, items = make_setup(0.3, 0.0), conversations(12)
    by = {r: simulate(items, setup, 4, r) for r in ("cache-aware", "round-robin")}
    aware, rr = by["cache-aware"], by["round-robin"]
    assert aware["completed"] == rr["completed"] == len(items)
    # Later turns hold 600 of their first turn's tokens and more: cache-aware finds nearly all.
    num_prompt = sum(it.prompt_tokens for it in items)
    best = sum(items[i - 1].prompt_tokens + 39 for i, it in enumerate(items) if it.turn) // 16 * 16 / num_prompt
    assert aware["cached_token_share"] >= 0.9 * best, (aware["cached_token_share"], best)
    assert rr["cached_token_share"] < 0.5 * aware["cached_token_share"]
    assert aware["index_events_per_s"] > 0 and aware["index_peak_entries"] > 0


def test_a_conversation_is_cut_at_its_first_turn_past_the_context_window():
    # Turns of 600, 1240, 1880 prompt tokens (+40 out): a 1,500-token window keeps two turns of
    # each conversation, as a server answering the third with a 400 would; the count says so.
    items = conversations(3)
    kept, num_cut = fit_context(items, 1500)
    assert [(it.conversation, it.turn) for it in kept] == [(c, t) for c in range(3) for t in range(2)]
    assert num_cut == 3
    assert fit_context(items, 10_000) == (items, 0)
