"""Fixtures shared across the suite: a live `superinfer serve` subprocess on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared.modelfile import default_model_path, read_model_config

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    model: str
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get_json(self, path: str) -> dict:
        import json

        with urllib.request.urlopen(self.base_url + path, timeout=5) as resp:
            return json.loads(resp.read())

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(tmp_dir: Path, *extra: str) -> Server:
    """Start `superinfer serve` and wait until /health answers 200."""
    port = free_port()
    log_path = tmp_dir / f"serve-{port}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "services.cli", "serve", "--port", str(port), *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, read_model_config(default_model_path()).name, log_path, args)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"serve not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """One shared server on the embedded default (bundled model, CPU)."""
    srv = start_server(tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()
