"""Logs for people and for collectors: console lines on a terminal, JSON lines otherwise, and
`--log-format` to force either. Checked on real terminals (a pty) and real pipes, in-process
and through `superinfer scheduler` started as a process."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from shared.log import LOG_FORMAT_ENV, resolve_format, setup_logging

# A non-loopback address without keys: the scheduler logs one error and exits at once.
REFUSED = ["scheduler", "--bind", "tcp://0.0.0.0:5599"]


@pytest.fixture
def terminal():
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as stream:
        yield leader, stream
    os.close(leader)


@pytest.fixture
def pipe():
    r, w = os.pipe()
    with os.fdopen(w, "w") as stream:
        yield r, stream
    os.close(r)


@pytest.fixture(autouse=True)
def no_format_env(monkeypatch):
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)


def test_auto_is_console_on_a_terminal_and_json_elsewhere(terminal, pipe):
    assert resolve_format(None, terminal[1]) == "console"
    assert resolve_format("auto", terminal[1]) == "console"
    assert resolve_format(None, pipe[1]) == "json"
    assert resolve_format(None, object()) == "json"  # a stream that cannot tell


def test_a_format_given_wins_over_the_stream(terminal, pipe, monkeypatch):
    assert resolve_format("json", terminal[1]) == "json"
    assert resolve_format("console", pipe[1]) == "console"
    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    assert resolve_format(None, terminal[1]) == "json"
    assert resolve_format("console", terminal[1]) == "console"  # the argument before the environment
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        resolve_format("xml", pipe[1])


def _read(fd: int) -> str:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # a pty's leader reads EIO once the follower is closed
            break
        if not chunk:
            break
        out += chunk
    return out.decode()


def test_the_events_are_rendered_as_chosen(tmp_path):
    with open(tmp_path / "json.log", "w") as f:
        setup_logging("tester", "info", None, f).info("hello", request_id="r1")
    line = json.loads((tmp_path / "json.log").read_text())
    assert line["event"] == "hello" and line["service"] == "tester" and line["request_id"] == "r1"
    assert line["level"] == "info"
    with open(tmp_path / "console.log", "w") as f:
        setup_logging("tester", "info", "console", f).warning("hello", request_id="r1")
    text = (tmp_path / "console.log").read_text()
    assert "hello" in text and "request_id=r1" in text and "service=tester" in text and "warn" in text
    with pytest.raises(ValueError):
        json.loads(text)
    with open(tmp_path / "filtered.log", "w") as f:
        setup_logging("tester", "warning", "json", f).info("quiet")
    assert (tmp_path / "filtered.log").read_text() == ""


def _scheduler(*argv: str, stderr_tty: bool) -> str:
    """What `superinfer ... scheduler` (refusing to start) writes to its stderr."""
    env = {k: v for k, v in os.environ.items() if k not in (LOG_FORMAT_ENV, "NO_COLOR")}
    cmd = [sys.executable, "-m", "services.cli", *argv, *REFUSED]
    if not stderr_tty:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        return proc.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, env={**env, "NO_COLOR": "1"}, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    try:
        text = _read(leader)
    finally:
        os.close(leader)
    proc.wait(timeout=60)
    return text


def test_a_service_logs_console_lines_on_a_terminal_json_in_a_pipe_and_as_told():
    console = _scheduler(stderr_tty=True)
    assert "refusing to start" in console and "[error" in console and not console.lstrip().startswith("{")
    piped = _scheduler(stderr_tty=False)
    assert json.loads(piped.splitlines()[0])["event"] == "refusing to start"
    forced = _scheduler("--log-format", "json", stderr_tty=True)
    assert json.loads(forced.splitlines()[0])["event"] == "refusing to start"
    forced = _scheduler("--log-format", "console", stderr_tty=False)
    assert "[error" in forced and "refusing to start" in forced
