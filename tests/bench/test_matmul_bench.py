"""`superinfer bench matmul` times every layout the worker's Linear can hold, after checking
each computes the same product, and writes what it printed."""

from __future__ import annotations

import json

import torch

from services.cli import main
from services.worker import model


def test_every_layout_is_timed_at_every_row_count(tmp_path, capsys):
    out = tmp_path / "matmul.json"
    assert main(["bench", "matmul", "--rows", "1,13", "--layers", "1", "--reps", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    layouts = {"onednn", "in_out"} | ({"panels"} if model._panel_pack(torch.eye(16)) is not None else set())
    assert layouts <= set(result["ms_per_step"])
    for by_rows in result["ms_per_step"].values():
        assert set(by_rows) == {"1", "13"} and all(ms > 0 for ms in by_rows.values())
    assert result["setup"]["shapes_out_in"][0] == [576 + 2 * 192, 576]  # SmolLM2-135M's q/k/v
    printed = capsys.readouterr().out
    assert all(name in printed for name in result["ms_per_step"])
