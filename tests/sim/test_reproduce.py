"""`bench reproduce`: the artifact's regime, equal knobs for every policy, the guard ablation,
a verdict per claim from the five words, and a page rendered from the rows in git alone."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.report import reproduction
from bench.report.reproduction import CIRCULAR, FAILS, HOLDS, OURS, UNTESTED, VERDICTS
from bench.sim import repro_ctx, reproduce


def row(policy: str, rate: float, ttft: float, tbt: float = 0.9, preempt: int = 10, **kw) -> dict:
    return {
        "policy": policy, "rate": rate, "ttft_attainment": ttft, "tbt_attainment": tbt, "num_preemptions": preempt,
        "throughput_tok_s": 1000.0, "knobs": "off", "model": "Qwen2.5-32B", "dataset": "sharegpt", **kw,
    }  # fmt: skip


def fig16(paper: float, ours: float, preempt: int = 10) -> dict:
    """Two rates; at the top one every baseline at 50% TTFT, the SuperInfer policies as given."""
    base = ("fcfs", "trtllm", "lightllm", "ltr", "neo")
    rows = [row(p, 5, 1.0, preempt=0) for p in (*base, "lvf-paper", "lvf", "superinfer-artifact")]
    rows += [row(p, 20, 0.5, preempt=preempt) for p in base]
    rows += [row("lvf-paper", 20, paper, preempt=preempt), row("superinfer-artifact", 20, paper, preempt=preempt)]
    return {"fig16": rows + [row("lvf", 20, ours, preempt=preempt)]}


def ttft_verdict(res: dict) -> str:
    return next(c for c in reproduction.fig16_claims(res) if "TTFT attainment" in c[0])[3]


def test_ttft_verdicts_from_the_five_words():
    assert ttft_verdict(fig16(0.95, 0.95)) == HOLDS
    assert ttft_verdict(fig16(0.52, 0.95)) == OURS  # +2 points is no lead; +45 is
    assert ttft_verdict(fig16(0.5, 0.5)) == FAILS
    assert ttft_verdict(fig16(0.95, 0.95, preempt=0)) == UNTESTED  # no pressure: not tested, not "fails"
    text = next(c for c in reproduction.fig16_claims(fig16(0.95, 0.6)) if "TTFT" in c[0])[2]
    assert "up to +45.0 (over vllm-v1 at 20)" in text  # as the paper states it: the largest gap


def test_a_lead_within_the_spread_is_no_lead():
    res = fig16(0.58, 0.58)
    for r in res["fig16"]:
        r["ttft_attainment_spread"] = 0.05
    assert ttft_verdict(res) == FAILS  # +8 points, spread 5: 3 beyond it


def test_equal_knobs_give_every_policy_the_same_agnostic_settings(tmp_path):
    ctx = repro_ctx.Ctx(tiny_args(tmp_path))
    for knobs in (reproduce.KNOBS_OFF, reproduce.KNOBS_ON):
        for p in reproduce.systems("qwen2.5-32b"):
            cfg = reproduce.equal_setup(ctx, p, knobs, "qwen2.5-32b").cfg
            assert (cfg.admit_watermark, bool(cfg.slo_chunking)) == (knobs["admit_watermark"], knobs["slo_chunking"]), p
    paper_on = reproduce.equal_setup(ctx, "lvf-paper", reproduce.KNOBS_ON, "qwen2.5-32b").cfg
    assert paper_on.min_residency_s == 0 and not paper_on.rotary_yields  # LVF's own guards stay off
    assert "neo" not in reproduce.systems("mixtral-8x7b")


def test_the_ablation_is_one_at_a_time_and_leave_one_out(tmp_path):
    setups = dict(reproduce.ablation_setups(repro_ctx.Ctx(tiny_args(tmp_path))))
    on = lambda s: {g for g, v in reproduce.GUARDS.items() if getattr(s.cfg, g) == v}  # noqa: E731
    guards = set(reproduce.GUARDS)
    assert on(setups["lvf-paper (none)"]) == set() and on(setups["lvf (all four)"]) == guards
    for g in guards:
        assert on(setups[f"lvf-paper + {g}"]) == {g}
        assert on(setups[f"lvf − {g}"]) == guards - {g}


def test_default_rates_are_the_artifacts_lowest_and_two_highest():
    assert reproduce.rates_of("qwen2.5-32b", "sharegpt", False) == (5, 18, 20)
    assert reproduce.rates_of("qwen2.5-32b", "lmsys", False) == (10, 35, 40)
    assert reproduce.rates_of("llama3-8b", "lmsys", True) == (50, 60, 68, 75, 88, 100)


def tiny_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    reproduce.add_arguments(parser)
    return parser.parse_args(
        ["--num-seeds", "1", "--jobs", "2", "--out", str(tmp_path / "REPRODUCTION.md"), "--results", str(tmp_path),
         "--rows", str(tmp_path / "rows.json"), *extra]  # fmt: skip
    )


@pytest.mark.slow
def test_reproduce_writes_the_page_from_the_rows_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(repro_ctx, "DURATION_S", 3.0)
    monkeypatch.setattr(reproduce, "DURATION_S", 3.0)
    monkeypatch.setattr(reproduce, "KNOB_SWEEPS", {k: v[::2] for k, v in reproduce.KNOB_SWEEPS.items()})
    args = tiny_args(tmp_path)
    assert reproduce.run(args) == 0
    md = args.out.read_text()
    for heading in ("## Claims and verdicts", "## Setting, and every deviation", "## Pressured results", "## Ablations"):
        assert heading in md
    for fig in ("Fig. 1:", "Fig. 16:", "Fig. 17:", "Fig. 18:", "Fig. 19:", "Fig. 20:", "Fig. 21:", "Fig. 22:", "Fig. 23:"):
        claim = next(line for line in md.splitlines() if line.startswith(f"| {fig}"))
        assert claim.rstrip(" |").rsplit("| ", 1)[1].startswith(VERDICTS[:4] + (CIRCULAR, "not tested"))
    assert (tmp_path / "figures" / "fig16_qwen2532b_sharegpt.png").stat().st_size > 0
    record = json.loads(args.rows.read_text())
    assert {r["policy"] for r in record["fig16"]} >= set(reproduce.systems("qwen2.5-32b"))
    assert reproduction.render(record) == md


def test_the_committed_page_is_rendered_from_the_committed_rows():
    page = Path(reproduce.__file__).resolve().parents[1] / "REPRODUCTION.md"
    assert reproduction.render_file(reproduction.ROWS) == page.read_text()
