"""The pure parts: a request's timeline, the last-minute window, rows from a core, the
token check, and the CLI's sorting and rendering."""

from __future__ import annotations

import json

import pytest

from services import admin_cli
from services.scheduler.admin import authorize, request_rows
from services.scheduler.metrics import FinishSample, StepSample, Timeline, Window
from shared import protocol as p
from tests.scheduler.harness import Driver, add, make_core


def test_timeline_charges_each_state_and_counts_gaps():
    tl = Timeline(arrival=10.0, ttft_slo=1.0, tbt_slo=0.1, num_prompt_tokens=5, since=10.0)
    tl.move("running", 10.5)
    tl.token(10.8)  # TTFT 0.8: met
    tl.token(10.85)  # gap 0.05: met
    tl.move("rotary", 11.0)
    tl.move("running", 11.4)
    tl.token(11.5)  # gap 0.65: missed
    tl.spent["transfer_wait"] += 0.02
    a = tl.attribution(12.0)
    assert (a.waiting_s, a.rotary_s, a.running_s) == pytest.approx((0.5, 0.4, 0.5 + 0.6))
    assert a.transfer_wait_s == pytest.approx(0.02) and a.num_preemptions == 1
    assert tl.ttft_met and (tl.num_gaps, tl.num_gaps_met) == (2, 1) and tl.max_gap_s == pytest.approx(0.65)
    assert tl.attribution(13.0).running_s == pytest.approx(2.1)  # the open interval grows


def test_window_keeps_the_last_minute():
    w = Window(started=0.0)
    w.add_step(StepSample(1.0, 0.001, 0.010, 0.100, True, 8, 2))  # falls out of the window
    for t in (70.0, 80.0):
        w.add_step(StepSample(t, 0.003, 0.020, 0.200, t == 80.0, 4, 1))
    w.add_finish(FinishSample(75.0, True, 10, 9))
    w.add_finish(FinishSample(79.0, False, 5, 5))
    s = w.summary(now=90.0, block_bytes=1000)
    assert s.span_s == 60.0 and s.num_steps == 2
    assert (s.schedule_s, s.transfer_s, s.compute_s) == pytest.approx((0.003, 0.020, 0.200))
    assert s.stall_ratio == 0.5 and s.rotations_per_s == pytest.approx(2 / 60)
    assert s.transfer_bytes_per_s == pytest.approx(8 * 1000 / 60)
    assert (s.ttft_attainment, s.tbt_attainment, s.slo_attainment) == pytest.approx((0.5, 14 / 15, 0.0))
    empty = Window(started=0.0).summary(now=5.0, block_bytes=0)
    assert empty.span_s == 5.0 and empty.stall_ratio is None and empty.transfer_bytes_per_s is None


def test_token_is_required_for_commands():
    assert authorize(None, "x").type == "permission_denied"
    assert authorize("secret", "").type == "permission_denied"
    assert authorize("secret", "secret") is None


def test_rows_follow_the_vlt_definitions():
    core = make_core("lvf", num_hbm=8, num_dram=64, block_size=4, ttft_slo=1.0, tbt_slo=0.1)
    for i in range(4):
        add(core, f"r{i}", prompt_len=6, max_tokens=20)
    driver = Driver(core, dt=0.05)
    states = set()
    for _ in range(40):
        driver.step()
        now = driver.now
        for row in request_rows(core, {}, now):
            req = core.requests[row.request_id]
            states.add(row.state)
            assert row.age_s == pytest.approx(now - req.arrival)
            if row.state == "running":
                assert row.vlt == pytest.approx(-(now - req.run_start)) and row.num_hbm_blocks > 0
            elif row.state == "rotary":
                lag = now - req.last_token_time - core.cfg.beta_b * req.tbt_slo
                assert row.vlt == pytest.approx(core.cfg.alpha * max(0.0, lag)) and row.num_hbm_blocks == 0
                assert row.tbt_slack_s == pytest.approx(req.tbt_slo - (now - req.last_token_time))
            else:
                assert row.vlt == pytest.approx(max(0.0, now - req.arrival - core.cfg.beta_f * req.ttft_slo))
                assert row.ttft_slack_s == pytest.approx(req.ttft_slo - row.age_s)
    assert {"running", "rotary"} <= states


def row(rid: str, state: str, vlt: float, **kw) -> p.RequestRow:
    fields = dict(
        age_s=1.0, since_last_token_s=None, ttft_slack_s=0.5, tbt_slack_s=None, num_prompt_tokens=10,
        num_output_tokens=2, num_hbm_blocks=1, num_dram_blocks=0, times=p.Attribution(running_s=0.25),
    )
    return p.RequestRow(rid, state, vlt, **{**fields, **kw})


def test_select_rows_filters_and_sorts():
    rows = [row("b", "running", -0.5), row("a", "rotary", 2.0), row("c", "waiting", 2.0), row("d", "rotary", 0.0)]
    assert [r.request_id for r in admin_cli.select_rows(rows, None, "vlt")] == ["a", "c", "d", "b"]
    assert [r.request_id for r in admin_cli.select_rows(rows, ["rotary"], "id")] == ["a", "d"]
    assert [r.state for r in admin_cli.select_rows(rows, None, "state")] == ["waiting", "running", "rotary", "rotary"]
    slack = [row("x", "running", 0, ttft_slack_s=None), row("y", "running", 0, ttft_slack_s=-1.0)]
    assert [r.request_id for r in admin_cli.select_rows(slack, None, "ttft_slack")] == ["y", "x"]


def test_table_and_json_rendering():
    rows = [row("cmpl-" + "f" * 32, "running", -0.25, since_last_token_s=0.01, tbt_slack_s=0.04)]
    lines = admin_cli.table(rows, width=100)
    assert len(lines) == 2 and all(len(line) <= 100 for line in lines)
    assert lines[1].startswith("cmpl-fffffff") and "f" * 32 not in lines[1]  # the id gives way
    assert lines[0].startswith("ID") and "-250ms" in lines[1] and "40ms" in lines[1]
    assert admin_cli.table(rows)[1].startswith("cmpl-" + "f" * 32)  # no width: ids whole
    as_json = json.loads(json.dumps(admin_cli.as_dict(rows)))
    assert as_json[0]["times"]["running_s"] == 0.25 and as_json[0]["state"] == "running"
    assert admin_cli.secs(None) == "-" and admin_cli.secs(2.5) == "2.50s" and admin_cli.secs(0.0421) == "42ms"


def test_summary_and_top_frame_fit_the_terminal():
    stats = p.SchedulerStats("sched-1", "toy", 256, 3, 2, 4, 10, 1, 100, 40, num_preemptions=7, num_rotations_out=5)
    window = p.WindowStats(60.0, 100, 0.001, 0.002, 0.05, 0.1, 1.5, 12.0, 2.4e9, 9, 0.9, 0.8, 0.7)
    reply = p.StatsReply(stats, window, "lvf", 5.0, 0.1, 42.0, draining=True, num_steps=100, num_finished=9)
    text = "\n".join(admin_cli.summary(reply))
    parts = ("DRAINING", "hbm 9/10 (90.0%)", "dram 60/100", "preemptions 7", "2.40 GB/s", "stalls 10.0%")
    for part in (*parts, "both 70.0% of 9"):
        assert part in text, part
    rows = [row(f"r{i}", "running", -i) for i in range(50)]
    frame = admin_cli.top_frame(reply, rows, "tcp://x", columns=60, lines=20)
    assert len(frame) <= 20 and all(len(line) <= 60 for line in frame)
    assert frame[-1].startswith("... ") and "more" in frame[-1]


def test_stats_says_when_the_worker_runs_without_its_native_kernels():
    why = "no C compiler (cc or gcc) on PATH"
    stats = p.SchedulerStats("sched-1", "toy", 256, 0, 0, 0, 10, 10, 100, 100, native_missing=why)
    reply = p.StatsReply(stats, p.WindowStats(60.0), "lvf", 5.0, 0.1, 42.0)
    lines = admin_cli.summary(reply)
    assert f"kernels    NOT NATIVE ({why}): every step runs on the torch path, 5-10x slower" in lines
    stats.native_missing = ""
    assert "kernels    native (or a GPU worker)" in admin_cli.summary(reply)
    stats.worker_ready = False
    assert "kernels    - (no worker)" in admin_cli.summary(reply)
