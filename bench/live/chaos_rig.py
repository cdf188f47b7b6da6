"""The servers `bench chaos` disturbs, and the faults it injects into them.

- `ServeRig`: one `superinfer serve` (its supervisor restarts what dies).
- `ReplicatedRig`: 2 scheduler/worker pairs and 2 gateways, each gateway connected to both
  schedulers through a TCP relay of ours on loopback (one per gateway and scheduler), and
  nothing restarting them but this rig, as an orchestrator (Kubernetes' restartPolicy) would;
  a restarted worker reads the float weights from a cache folder that outlives it (as a pod's
  volume outlives its container: `SUPERINFER_WEIGHTS_CACHE`, services/worker/weights_cache.py).

Faults, each on a process of the rig's choosing (the `target` says which):
- kill: SIGKILL;
- stop: SIGSTOP for `stop_s` (past the step deadline), then SIGCONT;
- raise_step / raise_request: SIGUSR1 / SIGUSR2 to a worker started with
  `SUPERINFER_FAULTS=signals`: its next step raises once (a re-run passes), or its next
  step's first request raises until it is failed alone;
- bad_plan: BAD_PLAN_SIGNAL to such a worker: the next plan it receives that schedules a
  request arrives with one id or length out of range (a block id past its pool, a negative
  position, a table wider than a context, a token past the vocabulary, a swap-in from past the
  DRAM pool, in turn), as a scheduler bug would send it; the step fails whole (WorkerError),
  and the scheduler resets the worker and recomputes its requests;
- cut: a gateway cut off from its scheduler for `cut_s`: under `serve` the gateway is frozen
  (SIGSTOP; its clients wait too), in the replicated rig the relay between one gateway and one
  scheduler closes its connections and refuses new ones (no network change outside this rig).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.live.server import REPO, children_of, free_port, start_server, wait_for
from bench.live.watch import PAGE_BYTES, role_of, tree_pids
from services.worker.faults import BAD_PLAN_SIGNAL, FAULTS_ENV
from shared.config import WEIGHTS_CACHE_ENV

ROLES = ("worker", "scheduler", "gateway")
WORKER_SIGNALS = {"raise_step": signal.SIGUSR1, "raise_request": signal.SIGUSR2, "bad_plan": BAD_PLAN_SIGNAL}


def role_pid(parent: int, role: str) -> int | None:
    """The child of `parent` that runs `services.cli <role>`."""
    for kid in children_of(parent):
        try:
            argv = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if role.encode() in argv:  # the subcommand: no flag is spelled as a bare role
            return kid
    return None


def rss_of_tree(pid: int) -> dict[str, float]:
    """MiB of each process of the tree under `pid`, keyed `role:pid`."""
    out = {}
    for p in tree_pids(pid):
        try:
            pages = int(Path(f"/proc/{p}/statm").read_text().split()[1])
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        out[f"{role_of(argv, p)}:{p}"] = pages * PAGE_BYTES / (1 << 20)
    return out


CATCH_WAIT_S = 120.0


def catches(pid: int | None, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc's SigCgt mask)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, TypeError):
        pass
    return False


def signal_pid(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


@dataclass
class Fault:
    kind: str
    target: str
    start_s: float  # from the chaos phase's start
    end_s: float = 0.0  # when it was over: the kill or signal itself, the SIGCONT, the reconnection
    done: bool = False
    note: str = ""


class Rig:
    urls: list[str]
    admins: list[str]

    def pick(self, kind: str, rng: random.Random) -> str:
        raise NotImplementedError

    def pid(self, target: str) -> int | None:
        raise NotImplementedError

    def rss(self) -> dict[str, float]:
        raise NotImplementedError

    async def inject(self, fault: Fault, t0: float, stop_s: float, cut_s: float) -> None:
        """Carry out `fault`; returns when it is over (after the SIGCONT or the reconnection)."""
        pid = self.pid(fault.target)
        if fault.kind == "kill":
            fault.note = "sent" if signal_pid(pid, signal.SIGKILL) else "no such process"
        elif fault.kind in WORKER_SIGNALS:
            sig = WORKER_SIGNALS[fault.kind]
            # A worker still starting (restarted by an earlier fault) has no handler yet: the
            # signal would kill it, which is the kill fault's job. Wait until it catches it.
            for _ in range(int(CATCH_WAIT_S / 0.5)):
                if catches(pid := self.pid(fault.target), sig):
                    break
                await asyncio.sleep(0.5)
            fault.note = "sent" if catches(pid, sig) and signal_pid(pid, sig) else "no worker catching it"
        elif fault.kind == "stop" or (fault.kind == "cut" and self.cut_by_freezing):
            fault.note = "sent" if signal_pid(pid, signal.SIGSTOP) else "no such process"
            await asyncio.sleep(stop_s if fault.kind == "stop" else cut_s)
            # The supervisor may have replaced a frozen worker meanwhile: the old pid is gone.
            signal_pid(pid, signal.SIGCONT)
        elif fault.kind == "cut":
            await self.cut(fault.target, cut_s)
            fault.note = "relay closed"
        fault.end_s = time.perf_counter() - t0
        fault.done = True

    cut_by_freezing = True

    async def cut(self, target: str, seconds: float) -> None:
        raise NotImplementedError

    async def tend(self) -> None:
        """Restart what died, where no supervisor does (runs for the whole chaos phase)."""

    def stop(self) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------- superinfer serve


class ServeRig(Rig):
    def __init__(self, log_dir: Path, flags: list[str]) -> None:
        self.admin = f"tcp://127.0.0.1:{free_port()}"
        os.environ[FAULTS_ENV] = "signals"
        try:
            self.server = start_server(log_dir, *flags, "--admin-bind", self.admin)
        finally:
            del os.environ[FAULTS_ENV]
        self.urls, self.admins = [self.server.base_url], [self.admin]
        self.log_path = self.server.log_path

    def pick(self, kind: str, rng: random.Random) -> str:
        if kind in WORKER_SIGNALS:
            return "worker"
        return "gateway" if kind == "cut" else rng.choice(ROLES)

    def pid(self, target: str) -> int | None:
        return role_pid(self.server.proc.pid, target)

    def rss(self) -> dict[str, float]:
        """MiB by process, keyed `role:pid` (a restarted child is another key)."""
        return rss_of_tree(self.server.proc.pid)

    def stop(self) -> None:
        for role in ROLES:  # nothing may stay frozen: SIGTERM must reach every child
            signal_pid(self.pid(role), signal.SIGCONT)
        self.server.stop()


# ---------------------------------------------------------------- 2 gateways, 2 schedulers, 2 workers


class Relay:
    """A TCP relay on loopback to `target_port`; `cut(s)` drops every connection through
    it and refuses new ones for `s` seconds (the peers see their connection close)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.blocked_until = 0.0
        self.conns: set[asyncio.StreamWriter] = set()
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self.blocked_until:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.conns |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        self.conns -= {writer, up_writer}

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError, asyncio.IncompleteReadError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()

    async def cut(self, seconds: float) -> None:
        self.blocked_until = time.monotonic() + seconds
        for w in list(self.conns):
            w.close()
        await asyncio.sleep(seconds)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self.conns):
            w.close()


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict | None = None
    proc: subprocess.Popen | None = None
    num_restarts: int = 0
    restarts: list[float] = field(default_factory=list)

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", *self.argv], cwd=REPO, stdout=log,
                                     stderr=subprocess.STDOUT, env=self.env)  # fmt: skip
        log.close()


class ReplicatedRig(Rig):
    """Started inside the bench's event loop (the relays live there): `await rig.start()`."""

    cut_by_freezing = False

    def __init__(self, log_dir: Path, worker_flags: list[str], scheduler_flags: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cache = str(log_dir / "weights-cache")
        self.children: dict[str, Child] = {}
        self.relays: dict[str, Relay] = {}
        self.admins, self.urls = [], []
        sched_ports = []
        for i in (0, 1):
            port, worker_port, admin = free_port(), free_port(), f"tcp://127.0.0.1:{free_port()}"
            sched_ports.append(port)
            self.admins.append(admin)
            self.children[f"scheduler{i}"] = Child(f"scheduler{i}", [
                "scheduler", "--bind", f"tcp://127.0.0.1:{port}", "--worker-bind", f"tcp://127.0.0.1:{worker_port}",
                "--admin-bind", admin, *scheduler_flags], log_dir / f"scheduler{i}.log", env)  # fmt: skip
            self.children[f"worker{i}"] = Child(f"worker{i}", [
                "worker", "--connect", f"tcp://127.0.0.1:{worker_port}", "--device", "cpu", *worker_flags,
            ], log_dir / f"worker{i}.log", dict(env, **{FAULTS_ENV: "signals", WEIGHTS_CACHE_ENV: cache}))  # fmt: skip
        for g in (0, 1):
            relays = [Relay(p) for p in sched_ports]
            for s, relay in enumerate(relays):
                self.relays[f"gateway{g}->scheduler{s}"] = relay
            http = free_port()
            self.urls.append(f"http://127.0.0.1:{http}")
            flags = [f for r in relays for f in ("--scheduler", f"tcp://127.0.0.1:{r.port}")]
            self.children[f"gateway{g}"] = Child(f"gateway{g}", [
                "gateway", "--host", "127.0.0.1", "--port", str(http), *flags], log_dir / f"gateway{g}.log", env)  # fmt: skip
        self.log_path = log_dir

    async def start(self, timeout_s: float = 300.0) -> None:
        for relay in self.relays.values():
            await relay.start()
        for child in self.children.values():
            child.start()
        from bench.live.server import answers_ready

        def ready() -> bool:
            return all(answers_ready(u) for u in self.urls)

        if not await asyncio.to_thread(wait_for, ready, timeout_s):
            self.stop()
            raise RuntimeError(f"the replicated rig was not ready after {timeout_s:g}s; logs in {self.log_path}")

    def pick(self, kind: str, rng: random.Random) -> str:
        i = rng.choice((0, 1))
        if kind in WORKER_SIGNALS:
            return f"worker{i}"
        if kind == "cut":
            return f"gateway{i}->scheduler{rng.choice((0, 1))}"
        return f"{rng.choice(ROLES)}{i}"

    def pid(self, target: str) -> int | None:
        child = self.children.get(target)
        return child.proc.pid if child and child.proc and child.proc.poll() is None else None

    async def cut(self, target: str, seconds: float) -> None:
        await self.relays[target].cut(seconds)

    async def tend(self) -> None:
        while True:
            for child in self.children.values():
                if child.proc is not None and child.proc.poll() is not None:
                    child.num_restarts += 1
                    child.start()
            await asyncio.sleep(0.5)

    def rss(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is None:
                out |= {f"{child.name}/{k}": v for k, v in rss_of_tree(child.proc.pid).items()}
        return out

    def stop(self) -> None:
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is None:
                signal_pid(child.proc.pid, signal.SIGCONT)
                child.proc.terminate()
        for child in self.children.values():
            if child.proc is not None:
                try:
                    child.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
        for relay in self.relays.values():
            relay.close()
