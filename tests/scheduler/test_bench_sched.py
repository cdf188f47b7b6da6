"""`superinfer bench sched` runs end to end and writes the documented JSON keys."""

from __future__ import annotations

import argparse
import json

from bench.micro import sched


def test_bench_sched_writes_rows(tmp_path):
    parser = argparse.ArgumentParser()
    sched.add_arguments(parser)
    out = tmp_path / "sched.json"
    argv = ["--requests", "50,200", "--steps", "50", "--warmup", "20", "--hbm-blocks", "256", "--json", str(out)]
    args = parser.parse_args(argv)
    assert sched.run(args) == 0
    rows = json.loads(out.read_text())
    assert [r["requests"] for r in rows] == [50, 200]
    for r in rows:
        assert 0 < r["median_ms"] <= r["p99_ms"] and r["steps"] == 50
        assert r["num_running"] + r["num_rotary"] + r["num_waiting"] == r["requests"]
    args = parser.parse_args(["--requests", "30", "--steps", "50", "--warmup", "0", "--json", str(out)])
    sched.run(args)
    assert set(json.loads(out.read_text())) >= {"requests", "median_ms", "p99_ms"}
