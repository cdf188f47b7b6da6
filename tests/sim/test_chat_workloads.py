"""The simulator's chat workloads: a later turn of a conversation is sent a think time after
the turn before ends and its prompt extends that turn's prompt and output (so the prefix
cache serves it), and a shared system prompt is shared."""

from __future__ import annotations

import argparse
import json

from bench.live.workload import ChatSpec, WorkItem, draw_arrivals, first_turns
from bench.sim import engine, sweep
from bench.sim.costmodel import MODELS, load_hardware
from services.scheduler.core import SchedulerConfig


def conversations(num: int, turns: int, think_s: float) -> list[WorkItem]:
    items = []
    for c in range(num):
        history = 0
        for t in range(turns):
            prompt = history + 40 + 7 * t
            items.append(WorkItem("", prompt, 30 + c, 0.0, conversation=c, turn=t, think_s=think_s))
            history = prompt + 30 + c
    return draw_arrivals(items, 2.0, seed=0)


def simulate(items: list[WorkItem], caching: bool) -> engine.SimRun:
    cfg = SchedulerConfig(policy="lvf", enable_prefix_caching=caching)
    setup = engine.make_setup(load_hardware("gh200"), MODELS["qwen2.5-32b"], cfg, "duplex", hbm=400, dram=4000, check=True)
    return engine.simulate(items, setup)


def test_later_turns_follow_the_turn_before_and_hit_the_cache():
    items = conversations(4, 3, think_s=0.5)
    assert [it.arrival_s for it in items[:3]] == [items[0].arrival_s] * 3  # conversations arrive, not turns
    on, off = simulate(items, True), simulate(items, False)
    for run in (on, off):
        assert all(r.ok for r in run.records)
        for prev, (it, r) in zip(run.records, zip(items[1:], run.records[1:])):
            if it.turn:
                assert r.arrival_s >= prev.arrival_s + prev.e2e_s + 0.5 - 1e-9
    for it, r in zip(items, on.records):
        # a later turn finds at least its history's whole blocks but the last
        assert r.cached_tokens >= (0 if it.turn == 0 else (it.prompt_tokens - 47 - 7 * it.turn) // 16 * 16 - 16)
    assert all(r.cached_tokens == 0 for r in off.records)


def test_requests_with_one_system_prompt_share_it():
    items = draw_arrivals([WorkItem("", 300 + i, 20, 0.0, system=0, system_tokens=256) for i in range(6)], 4.0)
    run = simulate(items, True)
    assert all(r.cached_tokens == 256 for r in run.records[1:])



def test_a_sweep_of_n_conversations_runs_every_turn_of_each(tmp_path):
    """`bench sim --multi-turn --num-requests N` counts conversations: the first N, whole."""
    items = conversations(5, 3, think_s=0.5)
    assert first_turns(items, 2) == 6
    assert first_turns(items, 5) == first_turns(items, 9) == len(items)

    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    out = tmp_path / "rows.json"
    argv = "--multi-turn --num-requests 40 --rates 4 --policies lvf --hbm-blocks 2000 --json".split() + [str(out)]
    assert sweep.run(p.parse_args(argv)) == 0
    (row,) = json.loads(out.read_text())["rows"]
    turns = sweep.load_items("sharegpt", 40, 0, chat=ChatSpec(multi_turn=True))
    assert len({it.conversation for it in turns}) == 40
    assert row["completed"] == len(turns) > 40
