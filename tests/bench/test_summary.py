"""The committed benchmark summary: docs/results.md is exactly what its rows render to."""

import json
from pathlib import Path

import pytest

from bench import summary


def test_committed_page_is_rendered_from_the_committed_rows():
    rows = summary.load(summary.SUMMARY_JSON)
    assert rows["entries"], "bench/summary.json has no runs"
    assert summary.render(rows) == summary.RESULTS_MD.read_text(), (
        "docs/results.md differs from its rows: run `superinfer bench summary` and commit both files"
    )


def test_add_keeps_the_tables_and_drops_per_request_lists(tmp_path):
    run = {"prefill_tok_s": {"ours": 1500.0, "transformers": 600.0},
           "decode_ms_b1": {"ours": 20.0, "transformers": 40.0},
           "decode_ms_b16": {"ours": 30.0, "transformers": 90.0},
           "speedup": {"prefill_tok_s": 2.5, "decode_ms_b1": 2.0, "decode_ms_b16": 3.0},
           "samples_ms": list(range(100))}
    path = tmp_path / "model_cpu.json"
    path.write_text(json.dumps(run))
    rows = summary.add({"entries": []}, "model", path, "The model", "superinfer bench model", None, ["model"], "abc1234")
    (entry,) = rows["entries"]
    assert entry["kind"] == "model" and entry["body"]["samples_ms"] is None
    page = summary.render(rows)
    assert "| decode step, batch 16 (ms) | 30.0 | 90.0 | 3.00× |" in page
    assert "at `abc1234`" in page
    # adding the same name again replaces the entry in place
    assert len(summary.add(rows, "model", path, "Again", None, None)["entries"]) == 1


def test_the_page_shows_only_each_comparisons_current_run(tmp_path):
    def run(ours: float) -> Path:
        path = tmp_path / f"model_{ours}.json"
        path.write_text(json.dumps({"prefill_tok_s": {"ours": ours, "transformers": 600.0},
                                    "decode_ms_b1": {"ours": 20.0, "transformers": 40.0},
                                    "decode_ms_b16": {"ours": 30.0, "transformers": 90.0},
                                    "speedup": {"prefill_tok_s": ours / 600, "decode_ms_b1": 2.0, "decode_ms_b16": 3.0}}))
        return path

    rows = summary.add({"entries": []}, "old", run(1111.0), "Old run", None, None, ["model"])
    rows = summary.add(rows, "other", run(2222.0), "Other comparison", None, None, ["model-1b"])
    rows = summary.add(rows, "new", run(3333.0), "New run", None, None, ["model"])
    page = summary.render(rows)
    assert "New run" in page and "3333.0" in page and "Other comparison" in page
    assert "Old run" not in page and "1111.0" not in page
    assert [e["name"] for e in rows["entries"]] == ["old", "other", "new"]  # history kept
    assert "* new" in summary.history(rows) and "  old" in summary.history(rows)
    # one run current for two comparisons is shown once
    rows["current"]["model-1b"] = "new"
    assert summary.render(rows).count("New run") == 1
    # dropping a current run leaves its comparison without one
    assert summary.drop(rows, "new")["current"] == {}
    with pytest.raises(ValueError, match="not in the summary"):
        summary.render({"current": {"model": "gone"}, "entries": []})


def test_a_file_of_unknown_shape_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"something": 1}))
    with pytest.raises(ValueError, match="not a result file"):
        summary.add({"entries": []}, "x", path, "X", None, None)


def test_routing_runs_render_simulated_and_live(tmp_path):
    row = {"routing": "cache-aware", "cached_token_share": 0.474, "ttft_p50_ms": 64.0, "ttft_p90_ms": 346.0,
           "ttft_attainment": 1.0, "tbt_attainment": 0.996}
    sim = tmp_path / "replicas.json"
    sim.write_text(json.dumps({"rows": [{**row, "replicas": 8, "rate_per_replica": 8.0, "index_peak_mib": 0.6,
                                         "index_events_per_s": 506.0}]}))
    live = tmp_path / "replicas_live.json"
    live.write_text(json.dumps({"rows": [{**row, "rate": 0.3}]}))
    rows = summary.add({"entries": []}, "sim", sim, "Simulated", None, None, ["routing-sim"])
    rows = summary.add(rows, "live", live, "Live", None, None, ["routing-live"])
    page = summary.render(rows)
    assert "| 8 | 8 | cache-aware | 47.4% | 64 / 346 ms | 100.0% | 99.6% | 0.6 MiB, 506/s |" in page
    assert "| 0.3 | cache-aware | 47.4% | 64 / 346 ms | 100.0% | 99.6% |" in page
