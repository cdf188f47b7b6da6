"""`bench serve`: SSE parsing, and whole runs against the live server (successes and the
failures it must count rather than crash on)."""

from __future__ import annotations

import argparse
import json
import re
import statistics

import pytest

from bench.live import serve
from bench.live.server import free_port
from shared.modelfile import default_model_path

REQUIRED_KEYS = {
    "completed", "failed", "ttft_attainment", "tbt_attainment", "tbt_request_attainment",
    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p90_ms", "tbt_p99_ms",
    "e2e_p50_ms", "output_tok_s", "goodput_rps", "duration_s",
    "tpot_mean_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
}  # fmt: skip
VLLM_KEYS = {
    "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
    "ttfts", "itls", "generated_texts", "errors",
    *(f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p99") for name in ("ttft", "tpot", "itl", "e2el")),
}  # fmt: skip


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_sse_lines():
    assert serve.parse_sse_line(b'data: {"choices": []}\n') == {"choices": []}
    assert serve.parse_sse_line(b"data:[DONE]") is serve.DONE
    assert serve.parse_sse_line(b": keep-alive") is None
    assert serve.parse_sse_line(b"") is None
    assert serve.parse_sse_line(b"data: not json") is None


def test_error_message_prefers_the_openai_error_field():
    assert serve.error_message('{"error": {"message": "too long", "type": "x"}}') == "too long"
    assert serve.error_message("Bad Gateway\n") == "Bad Gateway"


def test_live_run_writes_the_summary(server, tmp_path):
    out = tmp_path / "r.json"
    args = parse_args(
        "--base-url", server.base_url, "--model", server.model, "--dataset", "synthetic",
        "--num-requests", "6", "--rate", "20", "--seed", "3", "--input-len", "24",
        "--output-len", "12", "--length-spread", "0.3", "--json", str(out),
    )  # fmt: skip
    assert serve.run(args) == 0
    result = json.loads(out.read_text())
    assert REQUIRED_KEYS <= result.keys()
    assert (result["completed"], result["failed"]) == (6, 0)
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p90_ms"] <= result["ttft_p99_ms"]
    assert 0 < result["tbt_p50_ms"] <= result["tbt_p90_ms"] <= result["tbt_p99_ms"]
    assert result["e2e_p50_ms"] >= result["ttft_p50_ms"]
    assert 0 <= result["ttft_attainment"] <= 1 and 0 <= result["tbt_attainment"] <= 1
    assert result["output_tok_s"] > 0
    assert result["config"]["model"] == server.model and len(result["requests"]) == 6
    for r in result["requests"]:
        # the gateway honours ignore_eos: every request runs to its max_tokens
        assert 8 <= r["expected_output_tokens"] <= 16 and r["output_tokens"] == r["expected_output_tokens"]
        assert len(r["tbt_s"]) >= 1 and r["e2e_s"] >= r["ttft_s"] > 0
    assert result["output_len_match"] == 1.0
    # TPOT: one figure per request, (e2e − TTFT) / (tokens − 1), covering its gaps and the end
    tpots = [1000 * (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in result["requests"]]
    assert result["tpot_mean_ms"] == pytest.approx(statistics.fmean(tpots))
    assert result["tpot_p50_ms"] == pytest.approx(statistics.median(tpots))
    assert 0 < min(tpots) <= result["tpot_p50_ms"] <= result["tpot_p90_ms"] <= result["tpot_p99_ms"] <= max(tpots)
    for r, tpot in zip(result["requests"], tpots):
        assert 1000 * sum(r["tbt_s"]) <= tpot * (r["output_tokens"] - 1) + 1e-6
    # the tokenizer was the served model's, from /v1/models
    assert result["config"]["tokenizer_path"] == server.get_json("/v1/models")["data"][0]["root"]


def test_vllm_result_keys(server, tmp_path, capsys):
    out = tmp_path / "v.json"
    args = parse_args(
        "--base-url", server.base_url, "--dataset", "synthetic", "--num-requests", "4", "--rate", "20",
        "--input-len", "16", "--output-len", "6", "--length-dist", "fixed", "--result-format", "vllm",
        "--json", str(out),
    )  # fmt: skip
    assert serve.run(args) == 0
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    assert VLLM_KEYS <= result.keys()
    assert (result["completed"], result["failed"], len(result["itls"]), len(result["ttfts"])) == (4, 0, 4, 4)
    assert result["output_lens"] == [6] * 4 and result["total_output_tokens"] == 24
    assert result["total_input_tokens"] == sum(result["input_lens"]) and min(result["input_lens"]) >= 16
    assert result["errors"] == [""] * 4 and result["generated_texts"] is None  # records keep no text
    assert all(len(itl) == 5 for itl in result["itls"])
    assert result["request_throughput"] == pytest.approx(4 / result["duration"])
    total = result["total_input_tokens"] + result["total_output_tokens"]
    assert result["total_token_throughput"] == pytest.approx(total / result["duration"])
    assert result["median_ttft_ms"] == pytest.approx(1000 * statistics.median(result["ttfts"]))
    [ttft_p50] = re.findall(r"^ttft ms .* p50 ([\d.]+)", printed.out, re.M)
    assert result["median_ttft_ms"] == pytest.approx(float(ttft_p50), abs=0.051)  # the summary's, to 0.1 ms
    tpots = [(e2e - ttft) / 5 for e2e, ttft in zip(result["latencies"], result["ttfts"])]
    assert result["mean_tpot_ms"] == pytest.approx(1000 * statistics.fmean(tpots))
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"] and result[f"std_{name}_ms"] >= 0
    assert result["model_id"] == server.model and result["num_prompts"] == 4
    # no --tokenizer: the served model's root, with no word of a fallback
    assert result["tokenizer_id"] == server.get_json("/v1/models")["data"][0]["root"]
    assert "tokenizer: the bundled" not in printed.err


def test_an_explicit_tokenizer_wins(capsys):
    path = default_model_path()
    assert serve.tokenizer_path(str(path), f"http://127.0.0.1:{free_port()}", None, None) == path
    assert capsys.readouterr().err == ""  # the server is not asked


def test_rejected_requests_are_counted_with_their_reason(server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"prompt": "hello there", "output_tokens": 10**6}, {"prompt": "hi", "output_tokens": 2}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    args = parse_args("--base-url", server.base_url, "--dataset", str(trace), "--num-requests", "2", "--json", str(out))
    assert serve.run(args) == 0  # the model name came from /v1/models
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (1, 1)
    [(reason, count)] = result["failures"].items()
    assert reason.startswith("HTTP 400") and "maximum context length" in reason and count == 1


def test_unreachable_server_fails_every_request(tmp_path, capsys):
    url, out = f"http://127.0.0.1:{free_port()}", tmp_path / "r.json"
    args = parse_args(
        "--base-url", url, "--model", "m", "--dataset", "synthetic", "--num-requests", "3",
        "--input-len", "4", "--output-len", "2", "--json", str(out),
    )  # fmt: skip
    assert serve.run(args) == 1
    # no server to give its model's root: the bundled tokenizer, said once on stderr
    assert capsys.readouterr().err.count("tokenizer: the bundled model's (GET /v1/models failed") == 1
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["ttft_attainment"]) == (0, 3, 0.0)
    [reason] = result["failures"]
    assert reason.startswith("ClientConnectorError")
