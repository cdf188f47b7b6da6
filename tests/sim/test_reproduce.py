"""`bench reproduce`: one command writes REPRODUCTION.md, the CSVs and the plots; both LVFs
everywhere, the guard ablation, the claims in the paper's words."""

from __future__ import annotations

import argparse
import csv
import re
import shutil
from pathlib import Path

import pytest

from bench.report import discussion, reproduction
from bench.report.rows import BASELINES, SYSTEMS
from bench.report.tables import flat
from bench.sim import reproduce


def row(policy: str, rate: float, ttft: float, tbt: float = 0.9, **kw) -> dict:
    return {"policy": policy, "rate": rate, "ttft_attainment": ttft, "tbt_attainment": tbt, "transfer_mode": "duplex", **kw}


def rows_where(paper_ttft: float, lvf_ttft: float, ltr_tbt: float = 0.9) -> list[dict]:
    """Two rates; at the top one vllm-v1 and every baseline at 50% TTFT, the LVFs as given."""
    rows = [row(p, 2, 1.0) for p in SYSTEMS]
    rows += [row(p, 8, 0.5) for p in BASELINES if p != "ltr"] + [row("ltr", 8, 0.6, tbt=ltr_tbt)]
    return rows + [row("lvf-paper", 8, paper_ttft), row("lvf", 8, lvf_ttft)]


def test_a_claim_holds_for_the_papers_lvf_or_only_with_our_additions():
    table, ok = discussion.claim_rows({"w": (rows_where(0.55, 0.95), "req/s")})
    assert not ok[("ttft", "w", "lvf-paper")] and ok[("ttft", "w", "lvf")]  # +5 points is not a lead; +45 is
    assert any("largest lead +45.0 (spread 0.0) over" in line and "| 8 req/s" in line or "at 8 req/s" in line for line in table)
    text = "\n".join(discussion.verdicts(ok, ["w"]))
    assert "on w **holds only with our additions**" in text
    _, ok = discussion.claim_rows({"w": (rows_where(0.95, 0.95), "req/s")})
    assert "on w **holds**" in "\n".join(discussion.verdicts(ok, ["w"])).split("\n")[0]
    _, ok = discussion.claim_rows({"w": (rows_where(0.5, 0.5), "req/s")})
    assert "on w **does not hold**" in "\n".join(discussion.verdicts(ok, ["w"])).split("\n")[0]


def test_ltr_claim_needs_the_best_ttft_and_a_severe_tbt_cost():
    rows = rows_where(0.5, 0.5, ltr_tbt=0.6)  # ltr 60% TTFT: the best; TBT 30 points below lvf's
    assert discussion.ltr_check(rows, "lvf")[:2] == (True, True)
    assert discussion.ltr_check(rows_where(0.7, 0.5, ltr_tbt=0.6), "lvf")[0] is False  # lvf-paper's TTFT is better
    assert discussion.ltr_check(rows_where(0.5, 0.5, ltr_tbt=0.85), "lvf")[1] is False  # 5 points is not severe


def test_a_sweep_within_the_spread_is_flat():
    assert flat([row("lvf", 6, 0.90, alpha=a, ttft_attainment_spread=0.02) for a in (1, 3)])
    assert not flat([row("lvf", 6, 0.90, alpha=1), row("lvf", 6, 0.80, alpha=3)])


def tiny_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    reproduce.add_arguments(parser)
    return parser.parse_args(
        ["--num-requests", "40", "--conversations", "12", "--rates", "4,40", "--num-seeds", "1", "--jobs", "1",
         "--out", str(tmp_path / "REPRODUCTION.md"), "--results", str(tmp_path), *extra]  # fmt: skip
    )


def test_the_ablation_adds_each_guard_alone_to_lvf_paper_and_the_agnostic_ones_to_the_baselines(tmp_path):
    ctx = reproduce.Ctx(tiny_args(tmp_path))
    setups = dict(reproduce.ablation_setups(ctx, conv=True))
    guards = tuple(reproduce.GUARDS)
    on = lambda s: {g for g in guards if getattr(s.cfg, g) == reproduce.GUARDS[g]}  # noqa: E731
    assert setups["lvf-paper"].cfg.policy == "lvf-paper" and on(setups["lvf-paper"]) == set()
    for g in guards:
        assert on(setups[f"lvf-paper + {g}"]) == {g}
    assert on(setups["lvf (all four)"]) == set(guards)
    agnostic = lambda s: on(s) & set(reproduce.AGNOSTIC)  # noqa: E731  (the others act under LVF only)
    for p in ("vllm-v1", "wf"):
        assert agnostic(setups[p]) == set()
        for g in reproduce.AGNOSTIC:
            assert agnostic(setups[f"{p} + {g}"]) == {g}
    assert all(s.cfg.enable_prefix_caching for s in setups.values())


@pytest.mark.slow
def test_reproduce_writes_every_section_from_one_run(tmp_path, monkeypatch):
    monkeypatch.setattr(reproduce, "CONV_RATES", (2, 8))
    monkeypatch.setattr(reproduce, "LMSYS_RATES", (4,))
    monkeypatch.setattr(reproduce, "KNOB_SWEEPS", {k: v[:2] for k, v in reproduce.KNOB_SWEEPS.items()})
    args = tiny_args(tmp_path)
    assert reproduce.run(args) == 0
    md = args.out.read_text()
    sections = ("The paper's claims, in its words", "The paper's operating point", "The guard ablation",
                "Fig. 16 — the paper's workload", "Fig. 16 — LMSYS", "Fig. 16 — ShareGPT conversations",
                "Fig. 1 ", "Fig. 17 ", "Figs. 18–21", "Table 1 ", "The DRAM prefix-cache tier")  # fmt: skip
    for heading in sections:
        assert f"## {heading}" in md
    for key in ("fig16", "fig16_lmsys", "fig16_conv"):
        with (tmp_path / f"{key}.csv").open() as f:
            assert {r["policy"] for r in csv.DictReader(f)} >= {"lvf", "lvf-paper", *BASELINES}
    with (tmp_path / "ablation_conv.csv").open() as f:
        abl = list(csv.DictReader(f))
    assert [r["variant"] for r in abl] == [label for label, _ in reproduce.ablation_setups(reproduce.Ctx(args), True)]
    assert "| ShareGPT, 1000 requests | 12 | lvf-paper |" in md  # the calibration's own runs
    assert "| lvf-paper + admit_watermark |" in md and "| vllm-v1 + slo_chunking |" in md
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", md)  # every plot the page shows is beside it
    assert "figures/fig16.png" in images and all((tmp_path / i).stat().st_size > 0 for i in images)

    rows_only = tmp_path / "rows_only"  # the rows file and nothing else of the run
    rows_only.mkdir()
    shutil.copy(tmp_path / reproduction.ROWS_FILE, rows_only)
    assert reproduction.render_results(rows_only) == md


def test_the_committed_page_is_rendered_from_the_rows_on_disk():
    """bench/REPRODUCTION.md is what its rows (and the simulator-vs-live runs on record) render
    to; after `bench simlive` records a run, `bench reproduce --from-rows` brings it up to date.
    bench/results/ is not in git: without the rows of a run on this machine there is nothing to check."""
    bench = Path(reproduce.__file__).resolve().parents[1]
    if not (bench / "results" / reproduction.ROWS_FILE).exists():
        pytest.skip("no reproduction rows on this machine (bench/results/ is not in git)")
    assert reproduction.render_results(bench / "results") == (bench / "REPRODUCTION.md").read_text()
