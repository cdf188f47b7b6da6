"""`bench reproduce`: one command writes REPRODUCTION.md, the CSVs and the plots."""

from __future__ import annotations

import argparse
import csv
import shutil
from pathlib import Path

from bench.report import reproduction
from bench.report.rows import BASELINES, SYSTEMS
from bench.sim import reproduce


def row(policy: str, rate: float, ttft: float, tbt: float = 0.9) -> dict:
    return {"policy": policy, "rate": rate, "ttft_attainment": ttft, "tbt_attainment": tbt}


def test_lead_cell_names_the_largest_lead_and_the_worst_deficit():
    rows = [
        *(row(p, 4, 1.0) for p in SYSTEMS),
        row("lvf", 8, 0.9, tbt=0.85),
        row("fcfs", 8, 0.5, tbt=0.9),
        row("sf", 8, 0.6),
        row("wf", 8, 0.95),
        *(row(p, 8, 0.5) for p in SYSTEMS if p not in ("lvf", "fcfs", "sf", "wf")),
    ]
    assert reproduction.lead_cell(rows, ("fcfs",)) == "**+40.0** at 8 req/s (TBT 5.0 below)"
    assert reproduction.lead_cell(rows, ("wf",)) == "never ahead; -5.0 at 8 req/s"
    assert reproduction.lead_cell(rows, BASELINES) == "never ahead; -5.0 at 8 req/s"


def test_reproduce_writes_every_section_from_one_run(tmp_path):
    parser = argparse.ArgumentParser()
    reproduce.add_arguments(parser)
    out = tmp_path / "REPRODUCTION.md"
    args = parser.parse_args(
        ["--num-requests", "60", "--conversations", "20", "--rates", "4,40", "--out", str(out), "--results", str(tmp_path)]
    )
    assert reproduce.run(args) == 0
    md = out.read_text()
    sections = ("The paper's claims, checked", "Fig. 16 ", "Fig. 16 on Llama-3-8B", "Fig. 16 on Mixtral-8x7B",
                "Fig. 16 under more", "Fig. 1 ", "Fig. 17 ", "Table 1 ")  # fmt: skip
    for heading in sections:
        assert f"## {heading}" in md
    with (tmp_path / "fig16_pressure.csv").open() as f:
        pressure = list(csv.DictReader(f))
    with (tmp_path / "fig16.csv").open() as f:
        full = int(next(csv.DictReader(f))["num_hbm_blocks"])
    sizes = sorted({int(r["num_hbm_blocks"]) for r in pressure})
    assert sizes == sorted(round(full * s) for s in reproduce.PRESSURE)
    assert len(pressure) == len(sizes) * len(SYSTEMS) * 2  # every policy at both rates, per size
    for blocks in (full, *sizes):
        assert f"| {blocks} | " in md  # one row of leads per operating point
    assert (tmp_path / "fig16.png").stat().st_size > 0
    assert "On ShareGPT conversations, where memory pressure arises" in md
    assert "20 conversations per seed" in md
    with (tmp_path / "fig16_conv.csv").open() as f:
        conv = list(csv.DictReader(f))
    assert {float(r["rate"]) for r in conv} == set(reproduce.CONV_RATES)
    assert {(r["policy"], r["transfer_mode"]) for r in conv} == {
        *((p, "duplex") for p in SYSTEMS), ("sf", "vllm"), ("wf", "vllm")
    }
    assert all(float(r["completed"]) > 20 for r in conv)  # every turn of each conversation ran
    neo = [r for r in conv if r["policy"] == "neo"]
    assert neo and all(int(r["neo_host_blocks"]) > 0 and r["num_hbm_blocks"] == conv[0]["num_hbm_blocks"] for r in neo)
    assert "- **neo**: NEO's CPU offloading" in md
    with (tmp_path / "fig16_models.csv").open() as f:
        models = list(csv.DictReader(f))
    for key, factor in reproduce.MODEL_ROWS.items():  # each model at its own rates
        assert {float(r["rate"]) for r in models if r["model"] == reproduce.MODELS[key].name} == {4 * factor, 40 * factor}

    rows_only = tmp_path / "rows_only"  # the rows file and nothing else of the run
    rows_only.mkdir()
    shutil.copy(tmp_path / reproduction.ROWS_FILE, rows_only)
    assert reproduction.render_results(rows_only) == md
    again = tmp_path / "again.md"
    assert reproduce.run(parser.parse_args(["--from-rows", "--results", str(rows_only), "--out", str(again)])) == 0
    assert again.read_text() == md


def test_the_committed_page_is_rendered_from_the_committed_rows():
    """bench/REPRODUCTION.md is what its rows (and the simulator-vs-live runs on record) render
    to; after `bench simlive` records a run, `bench reproduce --from-rows` brings it up to date."""
    bench = Path(reproduce.__file__).resolve().parents[1]
    assert reproduction.render_results(bench / "results") == (bench / "REPRODUCTION.md").read_text()

