"""SLO metrics from hand-made records, checked against numbers worked out by hand."""

from __future__ import annotations

import pytest

from bench.report.metrics import RequestRecord, format_summary, plot_cdfs, summarize

TTFT_SLO, TBT_SLO = 5.0, 0.1


def done(ttft_s, tbt_s, e2e_s, num_out, num_prompt, num_expected) -> RequestRecord:
    return RequestRecord(True, ttft_s, tbt_s, e2e_s, num_out, num_prompt, num_expected)


def hand_records() -> list[RequestRecord]:
    return [
        done(0.5, [0.05, 0.1, 0.2], 0.85, 4, 10, 4),  # meets TTFT; one gap of three misses TBT
        done(6.0, [0.01], 6.01, 2, 20, 2),  # misses TTFT; its one gap meets TBT
        done(1.0, [], 1.0, 1, 30, 3),  # one chunk, no gap: meets both
        RequestRecord(False, error="HTTP 400: too long"),
        RequestRecord(False, ttft_s=0.1, tbt_s=[0.01], error="stream ended without [DONE]"),
    ]


def test_attainment_counts_failures_against_the_slo():
    s = summarize(hand_records(), TTFT_SLO, TBT_SLO, duration_s=10.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 3, 2)
    assert s["failures"] == {"HTTP 400: too long": 1, "stream ended without [DONE]": 1}
    assert s["ttft_attainment"] == pytest.approx(2 / 5)  # 0.5 s and 1.0 s
    assert s["tbt_attainment"] == pytest.approx(3 / 4)  # gaps of completed requests; 0.1 ≤ 0.1 counts
    assert s["tbt_request_attainment"] == pytest.approx(2 / 5)  # the 6 s one and the one-chunk one
    assert s["slo_attainment"] == pytest.approx(1 / 5)
    assert s["goodput_rps"] == pytest.approx(0.1)
    assert s["request_rps"] == pytest.approx(0.3)
    assert s["output_tok_s"] == pytest.approx(0.7)
    assert s["input_tok_s"] == pytest.approx(6.0)
    assert s["output_len_match"] == pytest.approx(2 / 3)


def test_percentiles_interpolate_linearly_in_ms():
    s = summarize(hand_records(), TTFT_SLO, TBT_SLO, duration_s=10.0)
    # TTFT of completed requests, sorted: 500, 1000, 6000 ms
    assert s["ttft_p50_ms"] == pytest.approx(1000.0)
    assert s["ttft_p90_ms"] == pytest.approx(1000 + 0.8 * 5000)
    assert s["ttft_p99_ms"] == pytest.approx(1000 + 0.98 * 5000)
    assert s["ttft_mean_ms"] == pytest.approx(2500.0)
    # gaps, sorted: 10, 50, 100, 200 ms
    assert s["tbt_p50_ms"] == pytest.approx(75.0)
    assert s["tbt_p99_ms"] == pytest.approx(100 + 0.97 * 100)
    assert s["e2e_p50_ms"] == pytest.approx(1000.0)


def test_tpot_is_one_figure_per_request_of_two_tokens_or_more():
    s = summarize(hand_records(), TTFT_SLO, TBT_SLO, duration_s=10.0)
    # (e2e − TTFT) / (n − 1): (0.85 − 0.5) / 3 and (6.01 − 6.0) / 1; one token or a failure has none
    first, second = 350.0 / 3, 10.0
    assert s["tpot_mean_ms"] == pytest.approx((first + second) / 2)
    assert s["tpot_p50_ms"] == pytest.approx((first + second) / 2)
    assert s["tpot_p90_ms"] == pytest.approx(second + 0.9 * (first - second))
    assert s["tpot_p99_ms"] == pytest.approx(second + 0.99 * (first - second))
    lines = format_summary(s).splitlines()
    tbt = next(i for i, line in enumerate(lines) if line.startswith("tbt ms"))
    assert lines[tbt + 1].startswith("tpot ms       mean 63.3  p50 63.3  p90 106.0  p99 115.6")


def test_nothing_to_count_is_none():
    s = summarize([RequestRecord(False, error="boom")], TTFT_SLO, TBT_SLO, duration_s=0.0)
    assert s["ttft_attainment"] == 0.0 and s["tbt_attainment"] is None
    assert s["ttft_p50_ms"] is None and s["goodput_rps"] is None and s["tpot_p50_ms"] is None
    assert summarize([], TTFT_SLO, TBT_SLO, 1.0)["ttft_attainment"] is None
    assert "1 × boom" in format_summary(s)


def test_cdf_plots_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plot_cdfs(hand_records(), TTFT_SLO, TBT_SLO, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["tbt_cdf.png", "ttft_cdf.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
