"""`bench compare`: target parsing, the table, and whole runs: our own server started twice
on one port by the command (one at a time, stopped in between), and targets that cannot
start failing at once with their reason."""

from __future__ import annotations

import argparse
import json
import socket
import sys

import pytest

from bench.live import compare
from bench.live.server import free_port, group_members, port_open
from tests.bench.test_serve import REQUIRED_KEYS


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_target_syntax():
    t = compare.parse_target("vllm=http://127.0.0.1:8001/,smollm2,bash peer.sh serve a,b 8001")
    assert t == compare.Target("vllm", "http://127.0.0.1:8001", "smollm2", "bash peer.sh serve a,b 8001")
    assert compare.parse_target("ours=http://h:1") == compare.Target("ours", "http://h:1")
    assert compare.parse_target("ours=http://h:1,,cmd") == compare.Target("ours", "http://h:1", None, "cmd")
    for bad in ("http://h:1", "=http://h:1", "x=h:1,m"):
        with pytest.raises(argparse.ArgumentTypeError):
            compare.parse_target(bad)


def test_options_pick_workloads_and_levels():
    args = parse_args("--target", "a=http://h:1", "--workloads", "probe", "--streams", "1,2")
    assert (args.workloads, args.streams, args.rounds) == (["probe"], [1, 2], 2)
    assert (args.prompt_len, args.output_len, args.warmup) == (512, 128, 1)
    assert (args.num_requests, args.rate, args.seed, args.ttft_slo, args.tbt_slo) == (60, 1.0, 0, 5.0, 0.1)
    for bad in (["--workloads", "probe,nope"], ["--streams", "0"]):
        with pytest.raises(SystemExit):
            parse_args("--target", "a=http://h:1", *bad)


def test_table_sets_targets_side_by_side():
    cfg = vars(parse_args("--target", "a=http://h:1", "--streams", "8", "--num-requests", "60"))
    level = lambda itl, tok_s: {"ttft_p50_ms": 400.0, "tbt_p50_ms": itl, "tbt_p90_ms": itl, "output_tok_s": tok_s,
                                "prompt_tokens_usage": [512, 512], "output_tokens": [128, 128]}  # fmt: skip
    rated = lambda att: {"tbt_attainment": att, "completed": 60, "failed": 0, "e2e_p50_ms": 4900.0}
    targets = [
        {"name": "vllm", "error": None, "ready_s": 90.0, "probe": {"8": level(28.0, 167.0)}, "sharegpt": rated(0.992)},
        {"name": "ours", "error": None, "ready_s": 20.0, "probe": {"8": level(47.0, 106.0)}, "sharegpt": rated(0.37)},
    ]
    table = compare.markdown({"config": cfg, "targets": targets}).splitlines()
    assert table[0] == "| workload | metric | vllm | ours | ours vs vllm |"
    assert "| 8 streams, 512 → 128 tokens | TTFT p50 (ms) | 400.0 | 400.0 | 1.00× |" in table
    assert "|  | output tok/s | 167.0 | 106.0 | 0.63× |" in table
    assert "|  | prompt tokens (usage) | 512 | 512 |  |" in table
    assert "|  | TBT gaps ≤ 100 ms | 99.2% | 37.0% | -62.2 pts |" in table
    assert "| ShareGPT, 60 requests at 1 req/s, seed 0 | TTFT ≤ 5 s | — | — |  |" in table
    assert "|  | e2e p50 (s) | 4.90 | 4.90 | 1.00× |" in table
    assert "|  | completed / failed | 60 / 0 | 60 / 0 |  |" in table
    one = compare.markdown({"config": cfg, "targets": targets[:1]}).splitlines()
    assert one[0] == "| workload | metric | vllm |" and "|  | ITL p50 (ms) | 28.0 |" in one


def serve_command(port: int) -> str:
    return f"{sys.executable} -m services.cli serve --port {port} --admin-bind off"


@pytest.mark.slow
def test_our_server_twice_on_one_port(tmp_path, capsys):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = parse_args(
        "--target", f"ours={url},,{serve_command(port)}", "--target", f"again={url},,{serve_command(port)}",
        "--streams", "1,2", "--rounds", "2", "--prompt-len", "40", "--output-len", "6",
        "--num-requests", "2", "--rate", "4", "--seed", "11",  # two short ShareGPT requests
        "--out-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    assert compare.run(args) == 0
    [json_path] = tmp_path.glob("compare_*.json")
    body = json.loads(json_path.read_text())
    assert [t["name"] for t in body["targets"]] == ["ours", "again"]
    for t in body["targets"]:
        assert t["error"] is None and t["model"] == "SmolLM2-135M-Instruct" and t["ready_s"] > 0
        assert t["stopped"]["group_gone"] and t["stopped"]["port_free"]
        assert not group_members(t["pgid"])
        for n in (1, 2):
            level = t["probe"][str(n)]
            assert (level["completed"], level["failed"]) == (2 * n, 0)
            assert level["prompt_tokens_usage"] == [40, 40] and level["output_tokens"] == [6, 6]
            assert level["tokens_per_chunk"] == 1.0 and level["output_tok_s"] > 0
            assert 0 < level["tbt_p50_ms"] <= level["tbt_p90_ms"] and len(level["round_output_tok_s"]) == 2
            for r in level["requests"]:
                assert r["usage_prompt_tokens"] == r["prompt_tokens"] == 40 and r["output_tokens"] == 6
                assert r["ttft_s"] > 0 and len(r["tbt_s"]) == r["output_tokens"] - 1
        rated = t["sharegpt"]
        assert REQUIRED_KEYS <= rated.keys() and (rated["completed"], rated["failed"]) == (2, 0)
        assert rated["output_len_match"] == 1.0 and rated["e2e_p50_ms"] >= rated["ttft_p50_ms"] > 0
    assert not port_open("127.0.0.1", port)
    table = json_path.with_suffix(".md").read_text()
    assert table.strip() in capsys.readouterr().out
    assert table.startswith("| workload | metric | ours | again | again vs ours |\n")
    rows = (
        "| server | time to ready (s) |", "| 2 streams, 40 → 6 tokens | TTFT p50 (ms) |", "|  | ITL p90 (ms) |",
        "| ShareGPT, 2 requests at 4 req/s, seed 11 | TTFT ≤ 5 s |", "|  | completed / failed | 2 / 0 | 2 / 0 |",
    )  # fmt: skip
    assert [row for row in rows if row not in table] == []


@pytest.mark.timeout(120)
def test_targets_that_cannot_start_fail_with_their_reason(tmp_path):
    taken, ports = socket.socket(), [free_port() for _ in range(3)]
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    url = lambda port: f"http://127.0.0.1:{port}"  # noqa: E731
    args = parse_args(
        "--target", f"dies={url(ports[0])},m,echo cannot load the model >&2; exit 3",
        "--target", f"hangs={url(ports[1])},m,sleep 600",
        "--target", f"taken={url(taken.getsockname()[1])},m,sleep 600",
        "--target", f"absent={url(ports[2])},m",
        "--workloads", "probe", "--streams", "1", "--rounds", "1", "--prompt-len", "8", "--output-len", "2",
        "--ready-timeout", "2", "--out-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    try:
        assert compare.run(args) == 1
    finally:
        taken.close()
    [json_path] = tmp_path.glob("compare_*.json")
    dies, hangs, taken_, absent = json.loads(json_path.read_text())["targets"]
    assert "exited with 3 before" in dies["error"] and "cannot load the model" in dies["error"]
    assert "not ready 2 s after the start" in hangs["error"]
    assert "is already taken" in taken_["error"] and "pgid" not in taken_
    assert "nothing ready at" in absent["error"]
    for t in (dies, hangs):
        assert t["stopped"]["group_gone"] and not group_members(t["pgid"]) and "probe" not in t
    table = json_path.with_suffix(".md").read_text()
    assert "**hangs** failed: http://127.0.0.1" in table and "|  | ITL p50 (ms) | — | — | — | — |" in table
