"""A worker without its native kernels is loud: `--require-native` refuses to start (worker and
serve) with the reason and the slowdown; without the flag the worker warns at start-up, says why
in `WorkerReady` (the scheduler passes it on to `superinfer stats` and the gateway's metric), and
serves. `SUPERINFER_CPU_KERNELS=off` stands in for a machine with no compiler."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import zmq
import zmq.asyncio

from bench.live.server import REPO
from services.gateway.metrics import GatewayMetrics
from services.worker.cpu_kernels import ENV_SWITCH
from shared import protocol as p

OFF = f"turned off by {ENV_SWITCH}"


def superinfer(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "--log-level", "warning", *argv],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("command", [["worker", "--connect", "ipc:///tmp/nowhere.sock"], ["serve", "--port", "0"]])
def test_require_native_refuses_to_start_without_the_kernels(command):
    done = superinfer(*command, "--device", "cpu", "--require-native", env={ENV_SWITCH: "off"})
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "--require-native" in done.stderr and OFF in done.stderr and "5-10x slower" in done.stderr


def test_metric_says_which_scheduler_runs_without_the_kernels():
    stats = [p.SchedulerStats(f"s{i}", "toy", 256, 0, 0, 0, 10, 10, 100, 100, native_missing=why)
             for i, why in enumerate(["", OFF])]  # fmt: skip
    text = GatewayMetrics().render(stats).decode()
    assert 'superinfer:native_kernels{reason="",scheduler_id="s0"} 1.0' in text
    assert f'superinfer:native_kernels{{reason="{OFF}",scheduler_id="s1"}} 0.0' in text


@pytest.mark.slow
def test_a_worker_without_the_kernels_warns_says_why_and_serves(tmp_path):
    async def scenario() -> tuple[p.WorkerReady, p.WorkerReply, bytes]:
        addr = f"ipc://{tmp_path}/worker.sock"
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addr)
        args = ["-m", "services.cli", "--log-level", "warning", "worker", "--connect", addr, "--device", "cpu",
                "--hbm-blocks", "16", "--dram-gb", "0.01"]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, cwd=REPO, env={**os.environ, ENV_SWITCH: "off"}, stderr=subprocess.PIPE
        )
        try:
            ready = p.worker_reply_decoder.decode(await asyncio.wait_for(sock.recv(), 240))
            plan = p.Plan(1, [p.NewRequestData("r", [1, 2, 3], p.SamplingParams(1, temperature=0.0))],
                          [p.ScheduledRequest("r", 0, 3, [0])])  # fmt: skip
            await sock.send(p.encode(plan))
            result = p.worker_reply_decoder.decode(await asyncio.wait_for(sock.recv(), 120))
            while isinstance(result, p.WorkerBusy):
                result = p.worker_reply_decoder.decode(await asyncio.wait_for(sock.recv(), 120))
        finally:
            proc.terminate()
            _, err = await proc.communicate()
            sock.close()
            ctx.term()
        return ready, result, err

    ready, result, err = asyncio.run(scenario())
    assert isinstance(ready, p.WorkerReady) and ready.native_missing == OFF
    assert isinstance(result, p.StepResult) and result.request_ids == ["r"]
    assert b"native CPU kernels not in use: every step runs on the torch path, 5-10x slower" in err
    assert OFF.encode() in err
