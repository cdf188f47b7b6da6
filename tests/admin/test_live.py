"""The operator's view of the live services (bundled model, CPU) under load that forces
rotation: `superinfer queues/stats/top/abort/drain` against the scheduler's admin socket,
the scheduler's /metrics, attribution in a response, and request ids through the logs."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.live.server import REPO, Server, free_port, start_server, wait_for

pytestmark = pytest.mark.slow
TOKEN = "live-token"
HBM_BLOCKS = 9  # ~13 prompt + 40 output tokens = 4 blocks of 16: about two requests fit
ALPHA, BETA_F, TTFT_SLO = 3.0, 0.5, 0.5


@dataclass
class Live:
    server: Server
    admin: str
    metrics_port: int

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERINFER_ADMIN")}
        cmd = [sys.executable, "-m", "services.cli", *args, "--admin", self.admin]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    def queues(self, *args: str) -> list[dict]:
        r = self.cli("queues", "--json", *args)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def scrape(self) -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        # vLLM's model_name label on every series (then left out of the keys below)
        assert {s.labels.get("model_name") for s in samples} == {self.server.model}, text[-2000:]
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for s in samples
        }

    def complete(self, prompt: str, max_tokens: int, **extra) -> tuple[int, dict]:
        body = {"model": self.server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body.update(ignore_eos=True, **extra)
        req = urllib.request.Request(
            self.server.base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


def in_background(live: Live, prompts: list[str], max_tokens: int, **extra) -> tuple[list, list[threading.Thread]]:
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = live.complete(prompts[i], max_tokens, **extra)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return results, threads


def poem(i: int) -> str:
    return f"Write a short poem about topic number {i}. Use simple words."


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Live:
    admin, metrics_port = f"tcp://127.0.0.1:{free_port()}", free_port()
    server = start_server(
        tmp_path_factory.mktemp("admin"),
        "--hbm-blocks", str(HBM_BLOCKS), "--ttft-slo", str(TTFT_SLO), "--tbt-slo", "0.05",
        "--admin-bind", admin, "--admin-token", TOKEN, "--metrics-port", str(metrics_port),
    )
    yield Live(server, admin, metrics_port)
    server.stop()


def check_policy(rows: list[dict]) -> None:
    """States, blocks and VLTs as RotaSched defines them (beta_B = 0), all at one `now`. A
    request waiting for its first token (never ran, or rotated out before it) lags by its
    age past the TTFT slack; one that has emitted tokens, by α × the time since the last."""
    assert sum(r["num_hbm_blocks"] for r in rows) <= HBM_BLOCKS
    for r in rows:
        first_token_lag = r["age_s"] - BETA_F * TTFT_SLO  # no clamp: negative within the slack
        if r["state"] == "running":
            assert -r["age_s"] <= r["vlt"] <= 0.0 and r["num_hbm_blocks"] > 0, r
        elif r["state"] == "rotary":
            assert r["num_hbm_blocks"] == 0 and r["num_dram_blocks"] > 0, r
            if r["since_last_token_s"] is None:
                assert r["vlt"] == pytest.approx(first_token_lag), r
            else:
                assert r["vlt"] == pytest.approx(ALPHA * r["since_last_token_s"]), r
        else:
            assert r["state"] == "waiting" and r["num_hbm_blocks"] == 0, r
            assert r["vlt"] == pytest.approx(first_token_lag), r
    vlts = [r["vlt"] for r in rows]
    assert vlts == sorted(vlts, reverse=True)  # default --sort vlt: the LVF order


def test_queues_metrics_attribution_under_rotation(live):
    before = live.scrape()
    results, threads = in_background(live, [poem(i) for i in range(7)], 40)
    attributed, more = in_background(live, [poem(99)], 40, superinfer={"attribution": True})
    threads += more

    rotating: list[dict] = []

    def snapshot_with_rotation() -> bool:
        rows = live.queues()
        check_policy(rows)
        if {"rotary", "running"} <= {r["state"] for r in rows}:
            rotating[:] = rows
        return bool(rotating)

    wait_for(snapshot_with_rotation, timeout=60)
    for t in threads:
        t.join(timeout=240)
    assert rotating, "no snapshot showed a rotary request"
    only = live.queues("--state", "rotary", "--sort", "age")
    assert all(r["state"] == "rotary" for r in only)

    status, body = attributed[0]
    assert status == 200, body
    times = body["superinfer"]["attribution"]
    assert times["running_s"] > 0 and set(times) >= {"waiting_s", "rotary_s", "transfer_wait_s"}
    assert all(r is not None and r[0] == 200 for r in results), results

    after = live.scrape()
    grew = lambda name, labels=(): after[(name, labels)] > before.get((name, labels), 0.0)  # noqa: E731
    assert grew("superinfer:scheduler_steps_total")
    assert grew("superinfer:rotations_total", (("direction", "out"),))
    assert grew("superinfer:kv_blocks_moved_total", (("kind", "swap_in"),))
    assert grew("superinfer:step_time_seconds_count", (("phase", "compute"),))
    assert grew("superinfer:kv_transfer_seconds_total")
    assert grew("superinfer:vlt_at_admission_seconds_count")
    slo = lambda m, a: m.get(("superinfer:slo_requests_total", (("attained", a), ("slo", "all"))), 0.0)  # noqa: E731
    assert sum(slo(after, a) - slo(before, a) for a in ("yes", "no")) == 8
    assert ("superinfer:kv_cache_usage_perc", (("tier", "hbm"),)) in after

    gateway = urllib.request.urlopen(live.server.base_url + "/metrics", timeout=5).read().decode()
    assert "superinfer:request_queue_time_seconds_count" in gateway

    # The gateway's request id is the scheduler's: both final log lines carry it.
    rid = body["id"]
    lines = [json.loads(l) for l in live.server.log_path.read_text().splitlines() if rid in l and l.startswith("{")]
    finals = {l["service"] for l in lines if l.get("event") == "request_finished" and l.get("request_id") == rid}
    assert finals == {"gateway", "scheduler"}, lines


def test_top_renders_under_a_pty_and_exits_on_ctrl_c(live):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 150, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    cmd = [sys.executable, "-m", "services.cli", "top", "--admin", live.admin, "--interval", "0.3"]
    # Ctrl-C as a user's shell delivers it to its foreground job: SIGINT at its default. A suite started
    # in the background by a non-interactive shell (as scripts and CI runners do) has it ignored, and
    # a child inherits that, so it is put back here.
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(slave)
    # The requests start once top has drawn its first screen: started before, they can all finish
    # while a cold `top` still imports, and it then never shows a row.
    threads: list[threading.Thread] = []

    def start_requests() -> None:
        threads.extend(in_background(live, [poem(i) for i in range(3)], 64)[1])

    out = read_pty(master, proc, b"cmpl-", first=(b"superinfer top", start_requests))
    os.close(master)
    for t in threads:
        t.join(timeout=120)
    assert proc.returncode in (0, 130), out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert "superinfer top" in out and "kv blocks" in out and "STATE" in out and "cmpl-" in out, out[-2000:]
    assert "\x1b[?1049h" in out and out.rstrip().endswith("\x1b[?1049l"), repr(out[-200:])


def read_pty(master: int, proc: subprocess.Popen, shown: bytes, timeout: float = 60.0, first=None) -> str:
    """Everything the program writes; SIGINT (what Ctrl-C sends) a second after it has shown
    `shown` (a cold start, importing and compiling, can take seconds), or at `timeout`.
    `first`: (bytes, callable), called once when the program has shown those bytes."""
    chunks: list[bytes] = []
    start = time.monotonic()
    shown_at, signalled = None, False
    while time.monotonic() - start < timeout + 10:
        now = time.monotonic()
        if first is not None and first[0] in b"".join(chunks):
            first[1]()
            first = None
        if shown_at is None and (shown in b"".join(chunks) or now - start > timeout):
            shown_at = now
        if not signalled and shown_at is not None and now - shown_at > 1.0:
            proc.send_signal(signal.SIGINT)
            signalled = True
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif signalled and proc.poll() is not None:
            break
    proc.wait(timeout=10)
    return b"".join(chunks).decode(errors="replace")


def test_abort_and_drain(live):
    results, threads = in_background(live, [poem(i) for i in range(3)], 100)
    listed = []

    def all_three_listed() -> bool:
        listed[:] = live.queues()
        return len(listed) == 3

    assert wait_for(all_three_listed, timeout=30)
    # The victim: the one furthest from its end (two 113-token requests do not fit the pool at
    # once, so it waits behind the others), aborted at once: a fast machine finishes the rest
    # within a few of these commands' cold starts, so all three come from the one listing that
    # showed them.
    rows = sorted(listed, key=lambda row: row["num_output_tokens"])
    victim, others = rows[0]["request_id"], {row["request_id"] for row in rows[1:]}
    r = live.cli("abort", victim, "--admin-token", TOKEN)
    assert r.returncode == 0 and victim in r.stdout, r
    assert victim not in {row["request_id"] for row in live.queues()}
    r = live.cli("abort", victim)
    assert r.returncode == 1 and "permission_denied" in r.stderr, r  # the token is checked first

    assert live.cli("drain").returncode == 1
    r = live.cli("drain", "--admin-token", TOKEN)
    assert r.returncode == 0 and "draining" in r.stdout, r
    status, body = live.complete("Hello", 4)
    assert status == 503, body
    assert json.loads(live.cli("stats", "--json").stdout)["draining"]

    r = live.cli("drain", "--admin-token", TOKEN, "--wait", timeout=240)
    assert r.returncode == 0 and "drained" in r.stdout, r
    for t in threads:
        t.join(timeout=60)
    # The two others finish whole, whether the drain found them still decoding (they run on)
    # or a fast machine had finished them before it began.
    finished = {b["id"]: b for status, b in results if status == 200}
    assert set(finished) == others, (others, results)
    assert all(b["usage"]["completion_tokens"] == 100 for b in finished.values()), results
    assert [res[0] for res in results].count(500) == 1  # the aborted one

    assert live.cli("drain", "--undo", "--admin-token", TOKEN).returncode == 0
    status, body = live.complete("Hello", 4)
    assert status == 200, body
    assert "superinfer" not in body  # attribution only when asked


def test_streamed_attribution_rides_on_the_final_chunk(live):
    body = {
        "model": live.server.model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "superinfer": {"attribution": True},
    }
    req = urllib.request.Request(
        live.server.base_url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length", chunks
    assert finals[0]["superinfer"]["attribution"]["running_s"] > 0
    assert all("superinfer" not in c for c in chunks if c is not finals[0])
