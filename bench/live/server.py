"""Start `superinfer serve` as a subprocess on loopback and wait until it is healthy; or
any server from a shell command line (`launch`), in its own process group.

Shared by the live benchmarks and the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.modelfile import default_model_path, read_model_config

REPO = Path(__file__).resolve().parents[2]
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


def process_table() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        out.append((int(stat.parent.name), state, int(ppid), int(pgrp)))
    return out


def children_of(pid: int) -> list[int]:
    """Process ids whose parent is `pid`."""
    return [p for p, _, ppid, _ in process_table() if ppid == pid]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    return [p for p, state, _, pgrp in process_table() if pgrp == pgid and state != "Z"]


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


# ---------------------------------------------------------------- any server, from a start command


class LaunchError(RuntimeError):
    """A start command that died, never got ready, or found its port taken."""


def answers_ready(base_url: str) -> bool:
    """GET /health answers 200; on a server without /health (404), GET /v1/models does."""
    for path in ("/health", "/v1/models"):
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + path, timeout=2) as resp:
                return resp.status == 200
        except urllib.error.HTTPError as e:
            if e.code != 404:
                return False
        except OSError:
            return False
    return False


@dataclass
class Launched:
    """A server started by a shell command line in its own process group (a new session),
    so that stopping it reaches every process it started, however deep."""

    proc: subprocess.Popen
    base_url: str
    host: str
    port: int
    log_path: Path
    started: float  # time.monotonic() at the start
    ready_s: float | None = None  # from the start to the first ready answer

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float) -> float:
        """Seconds from the start until `base_url` answered ready. Raises LaunchError, with
        the log's tail, if the command exits first or `timeout` s pass from the start."""
        while time.monotonic() - self.started < timeout:
            if answers_ready(self.base_url):
                self.ready_s = time.monotonic() - self.started
                return self.ready_s
            if self.proc.poll() is not None:
                raise LaunchError(f"the start command exited with {self.proc.returncode} before {self.base_url} "
                                  f"was ready; log {self.log_path}:\n{self.log_tail()}")  # fmt: skip
            time.sleep(0.25)
        raise LaunchError(f"{self.base_url} not ready {timeout:g} s after the start; log {self.log_path}:\n"
                          f"{self.log_tail()}")  # fmt: skip

    def stop(self, timeout: float = 30.0) -> dict:
        """SIGTERM to the group, SIGKILL to what is left after `timeout`, then wait (as long
        again) for the port to be free. Returns what it saw, for the record."""
        t0 = time.monotonic()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                pass
            if wait_for(lambda: self.proc.poll() is not None and not group_members(self.pgid), timeout):
                break
        port_free = wait_for(lambda: not port_open(self.host, self.port), timeout)
        gone = self.proc.poll() is not None and not group_members(self.pgid)
        return {"stop_s": time.monotonic() - t0, "group_gone": gone, "port_free": port_free}


def launch(command: str, base_url: str, log_path: Path) -> Launched:
    """Run `command` (a shell line), its output to `log_path`; raises LaunchError if
    something already listens on `base_url`'s port (it would be measured instead)."""
    url = urllib.parse.urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or (443 if url.scheme == "https" else 80)
    if port_open(host, port):
        raise LaunchError(f"{host}:{port} is already taken; stop what listens there or give another port")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, shell=True, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Launched(proc, base_url, host, port, log_path, time.monotonic())
