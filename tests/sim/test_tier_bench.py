"""`superinfer bench tier` standalone: the four systems (LVF and vLLM V1, each with the DRAM tier
and HBM-only) on the reproduction's setting, one Markdown table with a row per rate."""

from __future__ import annotations

import argparse

from bench.report.tier import SYSTEMS, label
from bench.sim import tier


def test_bench_tier_writes_one_row_per_rate_with_every_system(tmp_path):
    parser = argparse.ArgumentParser()
    tier.add_arguments(parser)
    out = tmp_path / "tier.md"
    args = parser.parse_args(
        ["--conversations", "8", "--num-seeds", "1", "--jobs", "1", "--conv-rates", "2,4", "--think-time", "5",
         "--out", str(out)]  # fmt: skip
    )
    assert tier.run(args) == 0
    text = out.read_text()
    assert "next turn 5 s after the last one ends" in text and "30% of its HBM KV pool" in text
    header = next(line for line in text.splitlines() if line.startswith("| rate |"))
    assert all(label(p, t) in header for p, t in SYSTEMS)
    rows = [line for line in text.splitlines() if line.startswith(("| 2 |", "| 4 |"))]
    assert len(rows) == 2 and all(line.count("%") >= 8 for line in rows)  # TTFT / TBT for each system
    assert (tmp_path / "tier.json").exists()
