"""`superinfer bench prefill` end to end, on a tiny checkpoint so that it takes seconds."""

from __future__ import annotations

import argparse
import json

from bench.micro import prefill
from tests.worker.test_weights import tiny_checkpoint


def test_bench_prefill_splits_the_step_into_its_parts(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "ckpt", "llama")
    parser = argparse.ArgumentParser()
    prefill.add_arguments(parser)
    out = tmp_path / "prefill.json"
    args = parser.parse_args(["--model", str(tmp_path / "ckpt"), "--prompt-len", "40", "--repeats", "2", "--json", str(out)])
    assert prefill.run(args) == 0
    results = json.loads(out.read_text())
    parts = results["parts_ms"]
    for name in ("paged_attention", "write_kv", "rope", "add_rms_norm", "rest"):
        assert name in parts
    assert any(name.startswith("gate_up (") for name in parts)
    assert all(ms >= 0 for ms in parts.values()) and results["step_ms"] > 0
    assert "paged_attention" in capsys.readouterr().out
    assert prefill.model_module.Linear.forward.__name__ == "forward"  # the seams put back
