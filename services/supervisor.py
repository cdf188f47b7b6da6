"""`superinfer serve`: the three services as child processes of one supervisor.

The children talk over ipc:// sockets in a private runtime directory. Ctrl-C or SIGTERM
stops all of them within 5 s; a child that dies is reported and the rest are shut down
rather than left hanging.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from shared import config
from shared.log import setup_logging

STOP_TIMEOUT_S = 4.0


def child_argv(args: argparse.Namespace, add_group) -> list[str]:
    """Re-render the options that one service understands from the parsed `serve` args."""
    probe = argparse.ArgumentParser(add_help=False)
    add_group(probe)
    out: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        out += [action.option_strings[0], str(value)]
    return out


def serve(args: argparse.Namespace) -> int:
    from services import cli

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
        + child_argv(args, cli._scheduler_args)
        + child_argv(args, cli._admin_args),
        "worker": base + ["worker", "--connect", worker_addr] + model + child_argv(args, cli._worker_args),
        "gateway": base
        + ["gateway", "--scheduler", sched_addr]
        + model
        + child_argv(args, cli._gateway_args),
    }
    stopping = False

    def request_stop(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    # The admin token travels in the environment, not on a command line others can read.
    envs = {"scheduler": dict(os.environ, **{cli.admin_cli.TOKEN_ENV: args.admin_token})} if args.admin_token else {}
    children = {name: subprocess.Popen(cmd, env=envs.get(name)) for name, cmd in commands.items()}
    log.info("started", pids={n: c.pid for n, c in children.items()}, run_dir=run_dir, admin=args.admin_bind)
    url = f"http://{args.host}:{args.port}"
    ready = False
    rc = 0
    try:
        while not stopping:
            dead = {n: c.returncode for n, c in children.items() if c.poll() is not None}
            if dead:
                log.error("child exited; shutting down the others", exited=dead)
                rc = 1
                break
            if not ready and _healthy(url):
                ready = True
                log.info("ready", url=url)
            time.sleep(0.2)
    finally:
        _stop_all(children, log)
        shutil.rmtree(run_dir, ignore_errors=True)
    return rc


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=0.5) as resp:
            return resp.status == 200
    except OSError:
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

