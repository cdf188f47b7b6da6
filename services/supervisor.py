"""`superinfer serve`: the three services as child processes of one supervisor.

The children talk over ipc:// sockets in a private runtime directory. Ctrl-C or SIGTERM
stops all of them within 5 s. A child that exits is restarted, at most MAX_RESTARTS times
in RESTART_WINDOW_S altogether: the scheduler holds a lost worker's requests and resumes
them on the new one; the gateway holds a lost scheduler's requests and resubmits them to
the new one (the worker starts afresh with every scheduler it connects to); a lost
gateway's clients are gone with their connections, and the scheduler aborts what they
left running once the gateway stays silent. A worker the scheduler has declared lost but
that still runs (hung) is killed after HUNG_KILL_S and restarted the same way; a worker that
was only frozen and runs again before then is reset by the scheduler instead. While the
scheduler or the gateway is itself stopped (SIGSTOP), the worker's readiness says nothing
about the worker and the watch waits. A child that keeps dying is reported and the rest are
shut down rather than left hanging. A restarted worker reads the float weights its predecessor
converted from the run directory (`SUPERINFER_WEIGHTS_CACHE`, services/worker/weights_cache.py),
so a restart costs its imports and the model's build, not the dequantization.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import deque

from services import flags
from shared import config
from shared.log import setup_logging

STOP_TIMEOUT_S = 4.0
MAX_RESTARTS = 5  # restarts ...
RESTART_WINDOW_S = 60.0  # ... per this window, then give up
HUNG_KILL_S = 5.0  # a running worker the scheduler has reported not ready this long is killed
PROBE_INTERVAL_S = 1.0


class RestartBudget:
    """At most `limit` restarts in any `window_s`: a crash loop ends in a report, not a spin."""

    def __init__(self, limit: int = MAX_RESTARTS, window_s: float = RESTART_WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        self.times: deque[float] = deque()

    def take(self, now: float) -> bool:
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


class HungWatch:
    """Decides when a running worker is hung: the scheduler reported it ready, then stopped
    (it lost it: a step result overdue) for `HUNG_KILL_S`. /health names the ready worker
    (`worker_id`), and the supervisor gives every worker it starts a new id, so the readiness
    of a worker that was just replaced is never taken for its successor's."""

    def __init__(self, worker_id: str = "") -> None:
        self.new_worker(worker_id)

    def new_worker(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.reset()

    def reset(self) -> None:
        """Conclude nothing until the worker is reported ready again."""
        self.seen_ready = False
        self.unready_since: float | None = None

    def observe(self, ready_ids: set[str] | None, now: float) -> None:
        """`ready_ids`: the workers /health reports ready; None when the gateway did not answer."""
        if ready_ids is None:  # nothing to conclude
            return
        if self.worker_id in ready_ids:
            self.seen_ready, self.unready_since = True, None
        elif self.seen_ready and self.unready_since is None:
            self.unready_since = now

    def hung(self, now: float, after_s: float = HUNG_KILL_S) -> bool:
        return self.unready_since is not None and now - self.unready_since > after_s


# Options that reach a child through its environment, never on a command line others can read.
SECRETS = {"api_key": config.API_KEY_ENV, "admin_token": config.ADMIN_TOKEN_ENV}


def child_argv(args: argparse.Namespace, add_group) -> list[str]:
    """Re-render the options that one service understands from the parsed `serve` args, by
    their first (our own) names; secrets are left out (`child_env`)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_group(probe)
    out: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest, None)
        if value is None or value == action.default or action.dest in SECRETS:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            out.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # a switch (store_true)
            out.append(action.option_strings[0])
        elif isinstance(value, list):  # nargs="+"
            out += [action.option_strings[0], *map(str, value)]
        else:
            out += [action.option_strings[0], str(value)]
    return out


def child_env(args: argparse.Namespace, add_group) -> dict[str, str] | None:
    """The child's environment: ours plus the secrets among its options; None (inherit ours)
    when it has none set."""
    probe = argparse.ArgumentParser(add_help=False)
    add_group(probe)
    dests = {a.dest for a in probe._actions}
    secrets = {env: getattr(args, d) for d, env in SECRETS.items() if d in dests and getattr(args, d, None)}
    return dict(os.environ, **secrets) if secrets else None


def serve(args: argparse.Namespace) -> int:
    log = setup_logging("supervisor", args.log_level)
    run_dir = tempfile.mkdtemp(prefix="superinfer-")
    sched_addr, worker_addr = config.ipc_addresses(run_dir)
    base = [sys.executable, "-m", "services.cli"]
    if args.log_level:
        base += ["--log-level", args.log_level]
    model = ["--model", args.model] if args.model else []
    commands = {
        "scheduler": base
        + ["scheduler", "--bind", sched_addr, "--worker-bind", worker_addr]
        + child_argv(args, flags.scheduler_args)
        + child_argv(args, flags.admin_args),
        "worker": base + ["worker", "--connect", worker_addr] + model + child_argv(args, flags.worker_args),
        "gateway": base
        + ["gateway", "--scheduler", sched_addr]
        + model
        + child_argv(args, flags.gateway_args),
    }
    stopping = False

    def request_stop(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    envs = {"scheduler": child_env(args, flags.admin_token_arg), "gateway": child_env(args, flags.gateway_args)}
    # A worker it restarts reads the float weights its predecessor converted (weights_cache.py).
    envs["worker"] = dict(os.environ, **{config.WEIGHTS_CACHE_ENV: os.path.join(run_dir, "weights")})
    watch = HungWatch()

    def spawn(name: str) -> subprocess.Popen:
        cmd = commands[name]
        if name == "worker":  # a new id per worker process, for the hung-worker watch
            watch.new_worker(uuid.uuid4().hex[:12])
            cmd = [*cmd, "--worker-id", watch.worker_id]
        return subprocess.Popen(cmd, env=envs.get(name))

    children = {name: spawn(name) for name in commands}
    log.info("started", pids={n: c.pid for n, c in children.items()}, run_dir=run_dir, admin=args.admin_bind)
    url = f"http://{args.host}:{args.port}"
    ready = False
    budget = RestartBudget()
    next_probe = 0.0
    rc = 0
    try:
        while not stopping:
            now = time.monotonic()
            dead = {n: c.returncode for n, c in children.items() if c.poll() is not None}
            fatal = {n: code for n, code in dead.items() if not budget.take(now)}
            if fatal:
                log.error("child exited; shutting down the others", exited=fatal, num_restarts=len(budget.times))
                rc = 1
                break
            for name in dead:
                log.warning("child exited; restarting it", child=name, returncode=dead[name])
                children[name] = spawn(name)
                watch.reset()  # whichever child it was: wait until the worker is ready again
            if now >= next_probe:
                next_probe = now + PROBE_INTERVAL_S
                health = _health(url)
                if not ready and health is not None and health[0]:
                    ready = True
                    log.info("ready", url=url)
                if any(is_stopped(children[n].pid) for n in ("scheduler", "gateway")):
                    watch.reset()  # the worker is not the one that stopped answering
                watch.observe(health[1] if health else None, now)
                if watch.hung(now):
                    log.error("worker hung (the scheduler lost it); killing it", pid=children["worker"].pid)
                    children["worker"].kill()
                    watch.reset()  # it is restarted on the next pass
            time.sleep(0.2)
    finally:
        _stop_all(children, log)
        shutil.rmtree(run_dir, ignore_errors=True)
    return rc


def _health(url: str) -> tuple[bool, set[str]] | None:
    """(healthy, the ids of the ready workers), or None when the gateway does not answer.
    /health lists only schedulers with a ready worker, so an answer with none means the
    worker is not ready (or the scheduler is gone, which the supervisor sees as an exit)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=0.5) as resp:
            body = json.loads(resp.read())
            status = resp.status
    except urllib.error.HTTPError as e:  # 503: answered, but nothing is ready
        try:
            body, status = json.loads(e.read()), e.code
        except ValueError:
            return None
    except (OSError, ValueError):
        return None
    schedulers = body.get("schedulers") or []
    return status == 200, {s.get("worker_id") for s in schedulers if s.get("worker_ready")}


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP, a debugger): state T or t."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _stop_all(children: dict[str, subprocess.Popen], log) -> None:
    """SIGTERM every child, wait a bounded time, then SIGKILL the stragglers."""
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for name, child in children.items():
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("child did not stop in time; killing", child=name)
            child.kill()
            child.wait()
    log.info("stopped", returncodes={n: c.returncode for n, c in children.items()})

