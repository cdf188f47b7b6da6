"""The step driver the service, the simulator and the replay share: the pipeline depth, results
applied to the oldest plan only, every depth running requests to their end."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.scheduler.driver import Driver
from shared.protocol import StepResult

from .harness import SymbolicWorker, add, make_core


@dataclass
class Sent:
    step_id: int
    result: StepResult


def driven(depth: int, p_stop: float = 0.1) -> tuple[Driver[Sent], SymbolicWorker]:
    core = make_core("lvf", num_hbm=24, num_dram=128, block_size=4)
    worker = SymbolicWorker(24, 128, 4, seed=3, p_stop=p_stop)
    driver = Driver(core, lambda plan, step, schedule_s: Sent(plan.step_id, worker.execute(plan)), depth)
    for i in range(8):
        add(core, f"r{i}", 5 + 3 * i, 12, now=0.01 * i)
    return driver, worker


def run_all(driver: Driver[Sent]) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    now = 0.1
    while driver.core.has_unfinished():
        driver.step(now)
        assert len(driver.in_flight) <= driver.depth
        now += 0.01
        _, outs = driver.result(driver.in_flight[0].result, now)
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.token_ids)
        driver.core.check_invariants()
    return outputs


def test_keeps_depth_plans_in_flight_and_applies_results_oldest_first():
    driver, _ = driven(depth=2)
    assert driver.step(0.1) is False  # stopped with the pipeline full
    assert [s.step_id for s in driver.in_flight] == [0, 1]
    newer = driver.in_flight[1]
    assert driver.result(newer.result, 0.2) is None  # not the oldest plan's: nothing applied
    assert len(driver.in_flight) == 2
    sent, _ = driver.result(driver.in_flight[0].result, 0.2)
    assert sent.step_id == 0 and [s.step_id for s in driver.in_flight] == [1]


def test_says_when_there_is_nothing_to_plan():
    core = make_core()
    driver = Driver(core, lambda plan, step, schedule_s: Sent(plan.step_id, StepResult(plan.step_id, [], [])), 2)
    assert driver.step(0.0) is True and not driver.in_flight


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_every_depth_runs_every_request_to_its_end(depth):
    """Planning ahead under memory pressure: the symbolic worker checks every plan reads
    intact KV, the invariants hold after every result, and each request gets all its tokens."""
    driver, _ = driven(depth=depth, p_stop=0.0)
    outputs = run_all(driver)
    assert sorted(outputs) == [f"r{i}" for i in range(8)] and all(len(t) == 12 for t in outputs.values())
    assert driver.core.num_preemptions > 0
