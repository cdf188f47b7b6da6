"""LVF's guards against a carousel of rotations (lvf.py): the minimum residency for
displacement by a paused request that has emitted tokens, and such a request, when it
cannot be placed, not holding back the requests behind it. Plus the paper's rule that
only running requests with VLT < 0 are preempted."""

from __future__ import annotations

import pytest

from services.scheduler.core import SchedulerConfig, Status
from shared.protocol import SLO, AddRequest, SamplingParams

from .harness import Driver, add, make_core


def rotated_out(**kw):
    """4 HBM blocks of 16 tokens. a and b (17-token prompts) hold 2 each; c, late for its
    first token at t=0.3, displaces a (the longest-running). Returns the driver at t=0.3."""
    core = make_core("lvf", num_hbm=4, num_dram=32, block_size=16, min_residency_s=0.5, admit_watermark=0.0, **kw)
    d = Driver(core, dt=0.05)
    add(core, "a", 17, 40, now=0.0)
    d.now = 0.0
    d.step()
    add(core, "b", 17, 40, now=0.1)
    d.now = 0.1
    d.step()
    core.add_request(AddRequest("c", [1] * 4, SamplingParams(max_tokens=40), slo=SLO(ttft_s=0.1)), 0.2)
    d.now = 0.3
    d.step()
    assert [r.request_id for r in core.last_step.preempted] == ["a"], "a request late for its first token displaces"
    assert core.requests["a"].status is Status.ROTARY
    return d


def test_min_residency_protects_requests_from_paused_decodes():
    d = rotated_out()
    core = d.core
    a, b, c = (core.requests[r] for r in "abc")
    while d.now < b.run_start + 0.5 - 1e-9:  # b put on the GPU at 0.1, c at 0.3
        d.step()
        assert a.status is Status.ROTARY and not core.last_step.preempted, d.now
    for _ in range(3):
        d.step()
        if a.status is Status.RUNNING:
            break
    assert a.status is Status.RUNNING
    assert [r.request_id for r in core.last_step.preempted] == ["b"]  # past its residency; c is not
    assert c.status is Status.RUNNING
    d.run()
    assert len(d.finish) == 3


def test_without_min_residency_a_paused_decode_displaces_at_once():
    d = rotated_out()
    d.core.cfg.min_residency_s = 0.0
    d.step()
    assert d.core.requests["a"].status is Status.RUNNING
    assert [r.request_id for r in d.core.last_step.preempted] == ["b"]


def test_held_back_decode_lets_arrivals_pass():
    for yields in (True, False):
        d = rotated_out(rotary_yields=yields)
        core = d.core
        d.step()  # the copies of a's swap-out are done: one block free
        add(core, "d", 8, 2, now=d.now)  # fits in that block; ranks below a (VLT 3 x its lag)
        plan = d.step()
        assert core.requests["a"].status is Status.ROTARY
        assert ("d" in {s.request_id for s in plan.scheduled}) == yields, yields
        d.run()
        assert len(d.finish) == 4


def test_only_running_requests_with_negative_vlt_are_preempted():
    """A request put on the GPU in this step (VLT 0) is never preempted in it, whatever
    the guards."""
    for residency in (0.0, 2.0):
        core = make_core("lvf", num_hbm=12, num_dram=200, block_size=4, tbt_slo=0.02, min_residency_s=residency)
        d = Driver(core, dt=0.02)
        for i in range(10):
            slo = SLO(ttft_s=0.05 * (1 + i % 3))
            core.add_request(AddRequest(f"r{i}", [3] * (5 + i), SamplingParams(max_tokens=14), slo=slo), 0.01 * i)
        while core.has_unfinished():
            d.step()
            step = core.last_step
            assert all(r.run_start < step.now for r in step.preempted), step.step_id
        assert core.num_rotations_out > 0 and len(d.finish) == 10


@pytest.mark.parametrize("policy", ["lvf", "fcfs", "wf"])
def test_admissions_leave_room_for_the_running_requests_to_grow(policy):
    """8 HBM blocks of 4 tokens; a (2 blocks) decodes; b (6 blocks) and c arrive. Filling HBM
    to the last block admits b, and a's next block then preempts somebody; with a quarter of
    HBM kept free while others run, b waits and nobody is preempted. The watermark is
    policy-agnostic: vLLM V1's FCFS and waiting-first get it the same way."""
    for watermark in (0.0, 0.25):
        core = make_core(policy, num_hbm=8, num_dram=64, block_size=4, admit_watermark=watermark)
        d = Driver(core, dt=0.01)
        add(core, "a", 7, 12, now=0.0)
        d.step()
        add(core, "b", 21, 4, now=d.now)
        add(core, "c", 3, 4, now=d.now)
        admitted, preempted = [], []
        while "a" in core.requests:
            d.step()
            admitted += [r.request_id for r in core.last_step.admitted]
            preempted += [r.request_id for r in core.last_step.preempted]
        assert ("b" in admitted) == (watermark == 0), (watermark, admitted)
        assert bool(preempted) == (watermark == 0), (watermark, preempted)
        d.run()
        assert len(d.finish) == 3


def test_only_lvf_has_guards_by_default_and_lvf_paper_has_none():
    lvf, paper, fcfs = (SchedulerConfig(policy=p).for_device(on_cpu=False) for p in ("lvf", "lvf-paper", "fcfs"))
    assert (lvf.admit_watermark, lvf.min_residency_s, lvf.rotary_yields, lvf.slo_chunking) == (0.25, 16.0, True, True)
    assert (paper.admit_watermark, paper.min_residency_s, paper.rotary_yields, paper.slo_chunking) == (0, 0, False, False)
    assert (fcfs.admit_watermark, fcfs.slo_chunking) == (0.0, False)
    forced = SchedulerConfig(policy="lvf-paper", admit_watermark=0.25, min_residency_s=16.0, slo_chunking=True)
    assert forced.for_device(on_cpu=False) == paper  # the paper's LVF whatever the guards' flags say


def test_lvf_paper_plans_as_lvf_with_every_guard_off():
    """The same arrivals under lvf-paper and under lvf with the four guards switched off give
    the same steps (admissions, preemptions); lvf's defaults give other ones."""
    def trace(policy, **kw):
        core = make_core(policy, num_hbm=12, num_dram=200, block_size=4, tbt_slo=0.02, **kw)
        d = Driver(core, dt=0.01)
        for i in range(10):
            core.add_request(AddRequest(f"r{i}", [3] * (5 + i), SamplingParams(max_tokens=14)), 0.01 * i)
        steps = []
        while core.has_unfinished():
            d.step()
            step = core.last_step
            steps.append(([r.request_id for r in step.admitted], [r.request_id for r in step.preempted]))
        return steps

    off = dict(admit_watermark=0.0, min_residency_s=0.0, rotary_yields=False, slo_chunking=False)
    paper = trace("lvf-paper")
    assert paper == trace("lvf", **off)
    assert any(p for _, p in paper), "the case must rotate"
    assert paper != trace("lvf")
