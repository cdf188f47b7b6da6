"""Tensor parallelism: the shards reassemble to the model, and `superinfer worker --tp 3` on CPU
(gloo) produces the greedy tokens of `--tp 1`, through preemption and a swap round trip."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from services.worker.tp import check_tp, shard_config, shard_weights
from shared import protocol as p
from tests.worker.conftest import blocks_for

REPO = Path(__file__).resolve().parents[2]
NUM_NEW = 32
NUM_HBM_BLOCKS = 96
STEP_TIMEOUT_MS = 60_000
START_TIMEOUT_MS = 180_000


def test_shards_reassemble_to_the_weights(weights, cfg):
    """Rows of q/k/v/gate/up and columns of o/down, rank after rank, are the whole tensors;
    what is replicated is the same tensor on every rank."""
    num_ranks = 3
    shards = [shard_weights(weights, r, num_ranks) for r in range(num_ranks)]
    layer = "model.layers.7."
    for name, dim in [
        ("self_attn.q_proj.weight", 0),
        ("self_attn.k_proj.weight", 0),
        ("self_attn.v_proj.weight", 0),
        ("mlp.gate_proj.weight", 0),
        ("mlp.up_proj.weight", 0),
        ("self_attn.o_proj.weight", 1),
        ("mlp.down_proj.weight", 1),
    ]:
        parts = [s[layer + name] for s in shards]
        assert all(part.shape[dim] * num_ranks == weights[layer + name].shape[dim] for part in parts)
        assert torch.equal(torch.cat(parts, dim=dim), weights[layer + name])
    for name in ("model.embed_tokens.weight", "model.norm.weight", layer + "input_layernorm.weight"):
        assert all(s[name] is weights[name] for s in shards)
    shard = shard_config(cfg, num_ranks)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (3, 1, cfg.intermediate_size // 3)
    assert shard.hidden_size == cfg.hidden_size


def test_tp_must_divide_the_kv_heads(cfg):
    check_tp(cfg, 3)
    with pytest.raises(ValueError, match="KV heads"):
        check_tp(cfg, 2)


class FakeScheduler:
    """The scheduler's side of the worker socket, driven step by step (one plan in flight)."""

    def __init__(self, addr: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.identity = b""
        self.step_id = 0

    def wait_ready(self) -> p.WorkerReady:
        ready = self._recv(START_TIMEOUT_MS)
        assert isinstance(ready, p.WorkerReady), ready
        return ready

    def step(self, **plan) -> p.StepResult:
        self.sock.send_multipart([self.identity, p.encode(p.Plan(self.step_id, **plan))])
        result = self._recv(STEP_TIMEOUT_MS)
        assert isinstance(result, p.StepResult) and result.step_id == self.step_id, result
        self.step_id += 1
        return result

    def _recv(self, timeout_ms: int):
        """The worker's next answer; the WorkerBusy it says every second of a long step are
        skipped, as the scheduler takes them (they only keep the step's deadline off)."""
        while True:
            assert self.sock.poll(timeout_ms), "the worker did not answer in time"
            self.identity, payload = self.sock.recv_multipart()
            reply = p.worker_reply_decoder.decode(payload)
            if not isinstance(reply, p.WorkerBusy):
                return reply

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def start_worker(tmp_path: Path, num_ranks: int) -> tuple[subprocess.Popen, FakeScheduler, Path]:
    addr = f"ipc://{tmp_path}/worker-tp{num_ranks}.sock"
    sched = FakeScheduler(addr)
    log_path = tmp_path / f"worker-tp{num_ranks}.log"
    argv = [sys.executable, "-m", "services.cli", "worker", "--connect", addr, "--device", "cpu"]
    argv += ["--tp", str(num_ranks), "--hbm-blocks", str(NUM_HBM_BLOCKS), "--dram-gb", "0.05"]
    argv += ["--dtype", "float32"]  # what auto serves under tensor parallelism; one rank would pack the GGUF
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, sched, log_path


def generate(sched: FakeScheduler, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy NUM_NEW tokens of every prompt, served together. r0 is preempted after 10
    tokens: its blocks go to DRAM, it sits out two steps, and comes back into other HBM
    blocks, so every rank's pool shard must make the round trip."""
    rids = [f"r{i}" for i in range(len(prompts))]
    known = {rid: list(prompt) for rid, prompt in zip(rids, prompts)}
    free = list(range(NUM_HBM_BLOCKS))
    tables = {rid: [free.pop() for _ in range(blocks_for(len(pr) + NUM_NEW))] for rid, pr in known.items()}
    params = p.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    new = [p.NewRequestData(rid, list(known[rid]), params) for rid in rids]
    scheduled = [p.ScheduledRequest(rid, 0, len(known[rid]), block_table=tables[rid]) for rid in rids]
    result = sched.step(new_requests=new, scheduled=scheduled)
    active = list(rids)
    while any(len(known[rid]) - len(pr) < NUM_NEW for rid, pr in zip(rids, prompts)):
        for rid, token in zip(result.request_ids, result.token_ids):
            known[rid].append(token)
        plan: dict = {}
        if len(known["r0"]) - len(prompts[0]) == 10 and "r0" in active:  # preempt r0 by swap
            used = tables["r0"][: blocks_for(len(known["r0"]) - 1)]
            plan["swap_out"] = [(h, d) for d, h in enumerate(used)]
            active.remove("r0")
            tables["r0"] = [free.pop() for _ in tables["r0"]]
            parked = len(used)
        elif "r0" not in active and sched.step_id % 3 == 0:  # back into other blocks
            plan["swap_in"] = [(d, tables["r0"][d]) for d in range(parked)]
            active.insert(0, "r0")
        done = [rid for rid in active if len(known[rid]) - len(prompts[int(rid[1:])]) >= NUM_NEW]
        active = [rid for rid in active if rid not in done]
        plan["scheduled"] = [
            p.ScheduledRequest(
                rid, len(known[rid]) - 1, 1, block_table=tables[rid] if "swap_in" in plan and rid == "r0" else None
            )
            for rid in active
        ]
        plan["drop"] = done
        result = sched.step(**plan)
    return [known[rid][len(pr) :] for rid, pr in zip(rids, prompts)]


def stop_worker(proc: subprocess.Popen, sched: FakeScheduler, log_path: Path) -> None:
    """SIGTERM: a clean stop (ranks told to leave) exits 0; one already gone is left as is."""
    running = proc.poll() is None
    proc.terminate()
    try:
        assert proc.wait(30) == 0 or not running, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sched.close()


def rank_pids(worker_pid: int) -> list[int]:
    """The worker's spawned rank processes (not multiprocessing's helper processes)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def lose_a_rank(proc: subprocess.Popen, sched: FakeScheduler, log_path: Path) -> None:
    """A rank killed under a serving worker: the next step fails and the worker exits 1
    (the scheduler then sees a lost worker), leaving no rank behind."""
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[0], signal.SIGKILL)
    sched.sock.send_multipart([sched.identity, p.encode(p.Plan(sched.step_id))])
    assert proc.wait(30) == 1, log_path.read_text()[-3000:]
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() and b"Z" not in _state(pid) for pid in ranks)


def _state(pid: int) -> bytes:
    return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[-1][:3]


@pytest.mark.slow
def test_tp3_worker_greedy_equals_tp1(tmp_path, chat_prompts):
    """Four chats together, 32 new tokens each, from a 3-rank worker and a 1-rank worker:
    identical token ids. Both start at once (loading dominates). Then one of the 3 ranks is
    killed: that worker exits 1 within seconds; the other stops cleanly."""
    workers = {n: start_worker(tmp_path, n) for n in (1, 3)}
    outputs = {}
    try:
        for n, (proc, sched, log_path) in workers.items():
            ready = sched.wait_ready()
            assert ready.num_hbm_blocks == NUM_HBM_BLOCKS
            outputs[n] = generate(sched, chat_prompts)
        assert workers[3][1].step_id == workers[1][1].step_id
        assert outputs[3] == outputs[1]
        assert all(len(tokens) == NUM_NEW for tokens in outputs[1])
        lose_a_rank(*workers[3])
    finally:
        for proc, sched, log_path in workers.values():
            stop_worker(proc, sched, log_path)
