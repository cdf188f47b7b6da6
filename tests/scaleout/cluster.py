"""Scheduler/worker pairs and gateways as separate processes on loopback tcp://, the way
`superinfer scheduler|worker|gateway` run on separate hosts; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.live.server import REPO, free_port


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: no goodbye to its peers, as in a crash."""
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def log_events(self, event: str) -> list[dict]:
        """The JSON log lines (services log JSON when not on a terminal) of one event."""
        events = []
        for line in self.log_lines():
            if line.startswith("{") and f'"{event}"' in line:
                record = json.loads(line)
                if record.get("event") == event:
                    events.append(record)
        return events


def spawn(log_dir: Path, name: str, *args: str) -> Proc:
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    return Proc(name, popen, log_path)


@dataclass
class Pair:
    """One scheduler and its worker; `addr` is where gateways connect."""

    scheduler: Proc
    worker: Proc
    addr: str
    trace_path: Path

    def kill(self) -> None:
        self.worker.kill()
        self.scheduler.kill()

    def stop(self) -> None:
        self.worker.stop()
        self.scheduler.stop()

    def num_tokens(self) -> int:
        """Tokens this pair sampled, from its scheduler's step trace."""
        if not self.trace_path.exists():
            return 0
        return sum(json.loads(line)["num_tokens"] for line in self.trace_path.read_text().splitlines() if line)


def start_pair(log_dir: Path, name: str, *worker_args: str) -> Pair:
    addr, worker_addr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    trace = log_dir / f"{name}-steps.jsonl"
    scheduler = spawn(
        log_dir, f"{name}-scheduler", "scheduler", "--bind", addr, "--worker-bind", worker_addr,
        "--step-trace", str(trace),
    )
    worker = spawn(log_dir, f"{name}-worker", "worker", "--connect", worker_addr, "--device", "cpu", *worker_args)
    return Pair(scheduler, worker, addr, trace)


def start_gateway(log_dir: Path, addrs: list[str], *extra: str) -> tuple[Proc, str]:
    port = free_port()
    flags = [f for addr in addrs for f in ("--scheduler", addr)]
    proc = spawn(log_dir, "gateway", "gateway", "--host", "127.0.0.1", "--port", str(port), *flags, *extra)
    return proc, f"http://127.0.0.1:{port}"


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def health(base_url: str) -> dict:
    try:
        return get_json(base_url + "/health", timeout=2)[1]
    except OSError:
        return {}


def wait_until(predicate, timeout: float, procs: list[Proc] = (), interval: float = 0.2) -> bool:
    """Poll until `predicate()`; give up at the deadline or as soon as a process has died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        dead = [p for p in procs if not p.alive()]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited:\n" + "\n".join(dead[0].log_lines()[-40:]))
        time.sleep(interval)
    return predicate()
