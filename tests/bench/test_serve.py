"""`bench serve`: SSE parsing, and whole runs against the live server (successes and the
failures it must count rather than crash on)."""

from __future__ import annotations

import argparse
import json

from bench.live import serve
from bench.live.server import free_port

REQUIRED_KEYS = {
    "completed", "failed", "ttft_attainment", "tbt_attainment", "tbt_request_attainment",
    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p90_ms", "tbt_p99_ms",
    "e2e_p50_ms", "output_tok_s", "goodput_rps", "duration_s",
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


def test_unreachable_server_fails_every_request(tmp_path):
    url, out = f"http://127.0.0.1:{free_port()}", tmp_path / "r.json"
    args = parse_args(
        "--base-url", url, "--model", "m", "--dataset", "synthetic", "--num-requests", "3",
        "--input-len", "4", "--output-len", "2", "--json", str(out),
    )  # fmt: skip
    assert serve.run(args) == 1
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["ttft_attainment"]) == (0, 3, 0.0)
    [reason] = result["failures"]
    assert reason.startswith("ClientConnectorError")
