"""`bench compare`: target parsing, the table, and whole runs: our own server started twice
on one port by the command (one at a time, stopped in between), and targets that cannot
start failing at once with their reason."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import pytest

from prometheus_client import start_http_server

from bench.live import compare, pressure
from bench.live.serve import request_body
from bench.live.workload import WorkItem
from bench.live.server import free_port, group_members, port_open
from services.gateway.metrics import GatewayMetrics
from services.scheduler.metrics import SchedulerMetrics
from shared.modelfile import default_model_path
from shared.protocol import SchedulerStats
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
    rated = lambda att: {"tbt_attainment": att, "completed": 60, "failed": 0, "e2e_p50_ms": 4900.0,
                         "tbt_p50_ms": 25.0, "tpot_p50_ms": 30.0}  # fmt: skip
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
    tbt = table.index("|  | TBT p50 (ms) | 25.0 | 25.0 | 1.00× |")
    assert table[tbt + 1] == "|  | TPOT p50 (ms) | 30.0 | 30.0 | 1.00× |"
    assert "|  | completed / failed | 60 / 0 | 60 / 0 |  |" in table
    one = compare.markdown({"config": cfg, "targets": targets[:1]}).splitlines()
    assert one[0] == "| workload | metric | vllm |" and "|  | ITL p50 (ms) | 28.0 |" in one


def test_sampling_fields_go_into_every_request_and_the_config():
    args = parse_args("--target", "a=http://h:1", "--sampling", '{"temperature": 0.8, "top_p": 0.95}')
    body = request_body("m", WorkItem("hi", 1, 4, 0.0), True, compare.client_args(args).sampling)
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["stream"]) == (0.8, 0.95, 4, True)
    assert compare.run_config(args)["sampling"] == {"temperature": 0.8, "top_p": 0.95}
    assert request_body("m", WorkItem("hi", 1, 4, 0.0), True)["temperature"] == 0.0
    for bad in ("[0.8]", "temperature=0.8"):
        with pytest.raises(SystemExit):
            parse_args("--target", "a=http://h:1", "--sampling", bad)


def test_pressure_options_and_their_usage_errors(capsys):
    args = parse_args("--target", "a=http://h:1", "--workloads", "sharegpt", "--rates", "0.75,1,1.25",
                      "--burstiness", "1,0.5", "--metrics", "a=http://h:9100/metrics", "--restart-per-run")  # fmt: skip
    assert pressure.runs_of(args) == [(0.75, 1.0), (1.0, 1.0), (1.25, 1.0), (0.75, 0.5), (1.0, 0.5), (1.25, 0.5)]
    assert (args.metrics, args.restart_per_run) == ([("a", "http://h:9100/metrics")], True)
    cfg = compare.run_config(args)
    assert "rate" not in cfg and (cfg["rates"], cfg["burstiness"]) == ([0.75, 1.0, 1.25], [1.0, 0.5])
    classic = compare.run_config(parse_args("--target", "a=http://h:1", "--burstiness", "0.5"))
    assert classic["burstiness"] == 0.5 and not {"rates", "metrics", "restart_per_run"} & classic.keys()
    for bad in (["--rates", "1,0"], ["--burstiness", "x"], ["--metrics", "a"]):
        with pytest.raises(SystemExit):
            parse_args("--target", "a=http://h:1", *bad)
    usage = {
        ("--burstiness", "1,0.5"): "go with --rates",
        ("--rates", "1", "--workloads", "probe"): "add it to --workloads",
        ("--rates", "1", "--metrics", "b=http://h:2/metrics"): "--metrics for no target: b",
    }
    for argv, reason in usage.items():
        assert compare.run(parse_args("--target", "a=http://h:1", *argv)) == 2
        assert reason in capsys.readouterr().err


def serve_endpoint(registry) -> tuple[str, object]:
    port = free_port()
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return f"http://127.0.0.1:{port}/metrics", server


def test_counters_read_from_our_gateway_and_scheduler_endpoints():
    """The real registries, served: the gateway sums its schedulers' reports; the stall
    ratio needs the scheduler's own endpoint; an endpoint that does not answer adds nothing."""
    gateway, scheduler = GatewayMetrics(), SchedulerMetrics()
    report = lambda n: SchedulerStats(  # noqa: E731
        scheduler_id="s", model_name="m", max_model_len=2048, num_waiting=0, num_running=0, num_rotary=0,
        num_hbm_blocks=65, num_free_hbm_blocks=65, num_dram_blocks=0, num_free_dram_blocks=0,
        num_preemptions=n, num_recomputes=n, num_rotations_out=2 * n, num_blocks_swapped_in=3 * n,
    )  # fmt: skip
    gateway.render([report(1), report(2)])
    (gw_url, gw), (sched_url, sched) = serve_endpoint(gateway.registry), serve_endpoint(scheduler.registry)
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    try:
        before = pressure.scrape([gw_url, sched_url, dead])
        assert before == {"preemptions": 3, "recomputes": 3, "rotations_out": 6, "blocks_swapped_in": 9,
                          "stalls": 0, "steps": None}  # fmt: skip
        gateway.render([report(5), report(2)])
        for _ in range(4):
            scheduler.step_time.labels(phase="compute").observe(0.03)
        scheduler.stalls.inc()
        after = pressure.scrape([gw_url, sched_url, dead])
        assert pressure.counted(before, after) == {"preemptions": 4, "recomputes": 4, "rotations_out": 8,
                                                   "blocks_swapped_in": 12, "stall_ratio": 0.25}  # fmt: skip
        again = pressure.scrape([gw_url, sched_url])
        scheduler.step_time.labels(phase="compute").observe(0.03)
        assert pressure.counted(after, pressure.scrape([gw_url, sched_url]))["stall_ratio"] == 0.0
        assert pressure.counted(again, again)["stall_ratio"] is None  # no step: no ratio
        assert pressure.counted(before, pressure.scrape([dead]))["preemptions"] is None
        gw_only = pressure.scrape([gw_url])
        assert gw_only["stalls"] is None and pressure.counted(gw_only, gw_only)["preemptions"] == 0
        assert set(pressure.scrape([dead]).values()) == {None}
    finally:
        gw.shutdown()
        sched.shutdown()


def test_pressure_table_has_a_row_per_target_and_run():
    args = parse_args("--target", "vllm=http://h:1", "--target", "ours=http://h:2", "--workloads", "sharegpt",
                      "--rates", "1,1.25", "--burstiness", "1,0.5")  # fmt: skip
    run = lambda rate, b, preemptions, **counters: {  # noqa: E731
        "rate": rate, "burstiness": b, "ttft_attainment": 0.933, "tbt_attainment": 0.993,
        "tbt_request_attainment": 0.417, "output_tok_s": 159.5, "ttft_p50_ms": 180.0, "e2e_p50_ms": 5500.0,
        "completed": 60, "failed": 0,
        "counters": {"preemptions": preemptions, "recomputes": None, "rotations_out": None,
                     "blocks_swapped_in": None, "stall_ratio": None, **counters},
    }  # fmt: skip
    ours = dict(recomputes=0, rotations_out=2440, blocks_swapped_in=21220, stall_ratio=0.012)
    targets = [
        {"name": "vllm", "error": None, "runs": [run(r, b, 13) for b in (1, 0.5) for r in (1, 1.25)]},
        {"name": "ours", "error": "LaunchError: died\nlog tail", "runs": [run(1, 1, 2440, **ours)]},
    ]
    table = compare.markdown({"config": compare.run_config(args), "targets": targets})
    lines = table.splitlines()
    assert lines[0] == "ShareGPT, 60 requests, seed 0; counters read from each server's /metrics"
    assert lines[2] == (
        "| rate (req/s) | server | TTFT ≤ 5 s | TBT gaps ≤ 100 ms | requests meeting TBT on every gap "
        "| output tok/s | TTFT p50 (s) | e2e p50 (s) | preemptions | recomputes | rotations out "
        "| blocks swapped in | stall ratio | completed / failed |"
    )
    assert lines[4:12] == [
        "| 1 | vllm | 93.3% | 99.3% | 41.7% | 159.5 | 0.18 | 5.50 | 13 | n/a | n/a | n/a | n/a | 60 / 0 |",
        "| 1 | ours | 93.3% | 99.3% | 41.7% | 159.5 | 0.18 | 5.50 | 2,440 | 0 | 2,440 | 21,220 | 1.2% | 60 / 0 |",
        "| 1.25 | vllm | 93.3% | 99.3% | 41.7% | 159.5 | 0.18 | 5.50 | 13 | n/a | n/a | n/a | n/a | 60 / 0 |",
        "| 1.25 | ours | — | — | — | — | — | — | — | — | — | — | — | — |",
        "| 1, bursty 0.5 | vllm | 93.3% | 99.3% | 41.7% | 159.5 | 0.18 | 5.50 | 13 | n/a | n/a | n/a | n/a | 60 / 0 |",
        "| 1, bursty 0.5 | ours | — | — | — | — | — | — | — | — | — | — | — | — |",
        "| 1.25, bursty 0.5 | vllm | 93.3% | 99.3% | 41.7% | 159.5 | 0.18 | 5.50 | 13 | n/a | n/a | n/a | n/a | 60 / 0 |",
        "| 1.25, bursty 0.5 | ours | — | — | — | — | — | — | — | — | — | — | — | — |",
    ]
    assert lines[12:] == ["", "**ours** failed: LaunchError: died"]  # no side-by-side table: it has no rows


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
        assert rated["tpot_p50_ms"] > 0
    assert not port_open("127.0.0.1", port)
    assert body["tokenizer_path"] == str(default_model_path().resolve())  # the first target's served model
    table = json_path.with_suffix(".md").read_text()
    assert table.strip() in capsys.readouterr().out
    assert table.startswith("| workload | metric | ours | again | again vs ours |\n")
    rows = (
        "| server | time to ready (s) |", "| 2 streams, 40 → 6 tokens | TTFT p50 (ms) |", "|  | ITL p90 (ms) |",
        "| ShareGPT, 2 requests at 4 req/s, seed 11 | TTFT ≤ 5 s |", "|  | completed / failed | 2 / 0 | 2 / 0 |",
        "|  | TPOT p50 (ms) |",
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



@pytest.mark.slow
def test_pressure_rows_for_two_of_our_policies(tmp_path, capsys):
    """Two requests whose KV cannot both stay in a 12-block pool, at two rates, against our
    fcfs and lvf: a row per policy and rate, with the preemption counters read from /metrics
    (the scheduler's own endpoint, given for lvf only, adds the stall ratio)."""
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    pool = f"--block-size 32 --hbm-blocks 12 --metrics-port {metrics_port}"
    serve = f"OMP_NUM_THREADS=1 {serve_command(port)} {pool}"  # counters, not speed: one thread is enough
    args = parse_args(
        "--target", f"fcfs={url},,{serve} --policy fcfs",
        "--target", f"lvf={url},,{serve} --policy lvf",
        "--metrics", f"lvf=http://127.0.0.1:{metrics_port}/metrics",
        "--workloads", "sharegpt", "--rates", "4,8", "--num-requests", "2", "--seed", "7",  # 198+87, 130+117 tokens
        "--out-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    assert compare.run(args) == 0
    [json_path] = tmp_path.glob("compare_*.json")
    body = json.loads(json_path.read_text())
    assert (body["config"]["rates"], body["config"]["burstiness"]) == ([4.0, 8.0], [1.0])
    fcfs, lvf = body["targets"]
    for t in (fcfs, lvf):
        assert t["error"] is None and [(r["rate"], r["burstiness"]) for r in t["runs"]] == [(4.0, 1.0), (8.0, 1.0)]
        assert t["stopped"]["group_gone"] and "sharegpt" not in t
        for r in t["runs"]:
            assert REQUIRED_KEYS <= r.keys() and (r["completed"], r["failed"]) == (2, 0)
            counters = r["counters"]
            assert all(counters[k] >= 0 for k in ("preemptions", "recomputes", "rotations_out", "blocks_swapped_in"))
    assert sum(r["counters"]["preemptions"] for t in (fcfs, lvf) for r in t["runs"]) > 0
    assert all(r["counters"]["stall_ratio"] is None for r in fcfs["runs"])
    assert all(0 <= r["counters"]["stall_ratio"] <= 1 for r in lvf["runs"])
    table = json_path.with_suffix(".md").read_text()
    assert table.strip() in capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0] == "| workload | metric | fcfs | lvf | lvf vs fcfs |" and lines[2].startswith("| server | time to")
    assert "| rate (req/s) | server | TTFT ≤ 5 s | TBT gaps ≤ 100 ms | requests meeting TBT on every gap |" in table
    rows = [line.split(" | ") for line in lines if line.startswith(("| 4 |", "| 8 |"))]
    assert [row[:2] for row in rows] == [["| 4", "fcfs"], ["| 4", "lvf"], ["| 8", "fcfs"], ["| 8", "lvf"]]
    assert all(len(row) == 14 and row[-1] == "2 / 0 |" for row in rows)
    assert all(row[12] == "n/a" for row in rows[::2]) and all(row[12].endswith("%") for row in rows[1::2])
    assert all(row[8].replace(",", "").isdigit() for row in rows)  # preemptions


@pytest.mark.timeout(120)
def test_llama_server_shaped_peer(tmp_path):
    """A peer that streams as llama.cpp's `llama-server` does (503 while loading, a text-less
    chunk carrying only the finish reason, usage in a chunk of its own; the stand-in script
    beside this test): a token per chunk, its usage counts, its group stopped."""
    port = free_port()
    standin = f"{sys.executable} {Path(__file__).with_name('llama_server_standin.py')} {port} --load-s 1"
    args = parse_args(
        "--target", f"llama.cpp=http://127.0.0.1:{port},,{standin}", "--workloads", "probe",
        "--streams", "1,2", "--rounds", "1", "--prompt-len", "16", "--output-len", "5", "--warmup", "0",
        "--out-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    assert compare.run(args) == 0
    [t] = json.loads(next(tmp_path.glob("compare_*.json")).read_text())["targets"]
    assert t["error"] is None and t["model"] == "smollm2-q4_1" and t["ready_s"] >= 1
    for n in (1, 2):
        level = t["probe"][str(n)]
        assert (level["completed"], level["failed"]) == (n, 0)
        assert level["tokens_per_chunk"] == 1.0 and level["output_tokens"] == [5, 5]
        assert level["prompt_tokens_usage"] == [16, 16]
        for r in level["requests"]:
            assert len(r["tbt_s"]) == 4  # 5 tokens: no gap counted for the closing chunk
    assert t["stopped"]["group_gone"] and not group_members(t["pgid"])
