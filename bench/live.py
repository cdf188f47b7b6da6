"""Start `superinfer serve` as a subprocess on loopback and wait until it is healthy.

Shared by the live benchmarks and the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

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
        with urllib.request.urlopen(self.base_url + path, timeout=5) as resp:
            return json.loads(resp.read())

    def healthy(self) -> bool:
        """/health answers 200: the gateway is up and a scheduler with a ready worker too."""
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def scheduler_stats(self) -> dict:
        return self.get_json("/health")["schedulers"][0]

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def logged(self, text: str) -> bool:
        """Whether any service has logged `text` since the server started (the whole log:
        under load the line may be far from the tail)."""
        return text in self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(log_dir: Path, *extra: str) -> Server:
    """Start `superinfer serve --port <free> *extra` and wait until /health answers 200."""
    port = free_port()
    log_path = Path(log_dir) / f"serve-{port}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "services.cli", "serve", "--port", str(port), *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, read_model_config(default_model_path()).name, log_path, args)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}:\n{server.log_tail()}")
        if server.healthy():
            return server
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"serve not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


def children_of(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()
