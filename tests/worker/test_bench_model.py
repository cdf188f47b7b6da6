"""`superinfer bench model` end to end, on a tiny checkpoint so that it takes seconds."""

from __future__ import annotations

import argparse
import json

from bench.micro import model as bench_model
from tests.worker.test_weights import tiny_checkpoint


def test_bench_model_prints_and_writes_every_figure(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "ckpt", "llama")
    parser = argparse.ArgumentParser()
    bench_model.add_arguments(parser)
    out = tmp_path / "results" / "model.json"
    args = parser.parse_args(
        ["--model", str(tmp_path / "ckpt"), "--json", str(out), "--prompt-len", "24", "--context-len", "8",
         "--decode-steps", "2", "--repeats", "1"]
    )
    assert bench_model.run(args) == 0
    results = json.loads(out.read_text())
    for key in ("prefill_tok_s", "decode_ms_b1", "decode_ms_b16"):
        assert results[key]["ours"] > 0 and results[key]["transformers"] > 0
        assert results["speedup"][key] > 0
    printed = capsys.readouterr().out
    assert "decode_ms_b16" in printed and "speedup" in printed
