"""Tensor parallelism for the worker: N ranks, each with its share of the heads and the MLP.

    scheduler ──Plan──▶ rank 0 ──broadcast(plan bytes)──▶ ranks 1..N-1
                          │ every rank: same drop/add, same block copies on its own pool
                          │ shard, same forward (all_reduce after o_proj and after down)
                          └─ rank 0 samples, broadcasts the token ids, replies

Sharding (Megatron-style, no communication inside a layer's attention or MLP):
- q/k/v rows of this rank's heads (column-parallel); o_proj columns (row-parallel), all_reduce.
- gate/up rows of this rank's slice of the MLP; down columns, all_reduce.
- embedding, norms and lm_head replicated.
Each rank's KV pools hold only its KV heads, `[num_blocks, num_layers, 2, block_size, KV/N, D]`,
so the scheduler's block ids mean the same block on every rank, and DuplexKV moves each rank's
shard with that rank's own engine.

Collectives run on the step thread only, in the same order on every rank: the plan broadcast,
2 all_reduces per layer, the token broadcast. `--tp 1` builds none of this.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing.connection
import os
import socket
import threading

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.modelfile import ModelConfig

MASTER_ADDR = "127.0.0.1"
# An idle server waits on the plan broadcast for as long as no request comes: no timeout that
# a quiet night could reach. A rank that dies closes its sockets, which fails the collective.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# Joining the group, and each all_reduce of a step: a rank silent this long fails the step.
STEP_TIMEOUT = datetime.timedelta(minutes=5)
STOP_TIMEOUT_S = 5.0
_STOP = -1  # plan length that tells ranks > 0 to leave their loop


# ---------------------------------------------------------------- sharding (pure)


def check_tp(cfg: ModelConfig, num_ranks: int) -> None:
    """Whole KV heads (and so whole GQA groups) and whole MLP rows on every rank."""
    for what, n in (("KV heads", cfg.num_kv_heads), ("heads", cfg.num_heads), ("MLP rows", cfg.intermediate_size)):
        if num_ranks < 1 or n % num_ranks:
            raise ValueError(f"--tp {num_ranks} does not divide the model's {n} {what}")


def shard_config(cfg: ModelConfig, num_ranks: int) -> ModelConfig:
    """The architecture one rank computes: its heads and MLP slice, the full hidden size."""
    check_tp(cfg, num_ranks)
    return msgspec.structs.replace(
        cfg,
        num_heads=cfg.num_heads // num_ranks,
        num_kv_heads=cfg.num_kv_heads // num_ranks,
        intermediate_size=cfg.intermediate_size // num_ranks,
    )


def _rows(w: torch.Tensor, rank: int, num_ranks: int) -> torch.Tensor:
    """w: [out, ...] -> [out / N, ...], this rank's contiguous slice."""
    n = w.shape[0] // num_ranks
    return w[rank * n : (rank + 1) * n].contiguous()


def _cols(w: torch.Tensor, rank: int, num_ranks: int) -> torch.Tensor:
    """w: [out, in] -> [out, in / N]"""
    n = w.shape[1] // num_ranks
    return w[:, rank * n : (rank + 1) * n].contiguous()


# HF weight-name suffix -> how it is cut. Rows of q/k/v are ordered head after head, so a
# contiguous row slice is a set of whole heads; query heads r*H/N.. group with KV heads r*KV/N...
_SPLIT = {
    "self_attn.q_proj.weight": _rows,
    "self_attn.k_proj.weight": _rows,
    "self_attn.v_proj.weight": _rows,
    "self_attn.q_proj.bias": _rows,
    "self_attn.k_proj.bias": _rows,
    "self_attn.v_proj.bias": _rows,
    "self_attn.o_proj.weight": _cols,
    "mlp.gate_proj.weight": _rows,
    "mlp.up_proj.weight": _rows,
    "mlp.down_proj.weight": _cols,
}


def shard_weights(weights: dict[str, torch.Tensor], rank: int, num_ranks: int) -> dict[str, torch.Tensor]:
    """This rank's weights, same HF names; replicated tensors are shared, not copied."""
    out = {}
    for name, w in weights.items():
        split = _SPLIT.get(name.split(".", 3)[-1]) if name.startswith("model.layers.") else None
        out[name] = w if split is None else split(w, rank, num_ranks)
    return out


# ---------------------------------------------------------------- the process group


class TPGroup:
    """This rank's view of the group: the all_reduce the model calls, and the broadcasts
    that keep ranks > 0 executing exactly what rank 0 executes."""

    def __init__(self, rank: int, num_ranks: int, control: dist.ProcessGroup):
        self.rank = rank
        self.num_ranks = num_ranks
        # gloo, no timeout an idle server could reach: host-side messages (plans, token ids)
        # whatever the compute backend
        self.control = control

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the partial outputs in place; x: [T, hidden]."""
        dist.all_reduce(x)
        return x

    def send_plan(self, payload: bytes) -> None:
        """Rank 0: a Plan's msgpack bytes to every other rank."""
        self._broadcast_bytes(payload)

    def recv_plan(self) -> bytes | None:
        """Ranks > 0: the next Plan's bytes; None when rank 0 stops the group."""
        return self._broadcast_bytes(None)

    def send_stop(self) -> None:
        dist.broadcast(torch.tensor([_STOP], dtype=torch.int64), 0, group=self.control)

    def broadcast_tokens(self, tokens: list[int] | None, num_tokens: int) -> list[int]:
        """Rank 0's sampled token ids on every rank (`tokens` is None on ranks > 0)."""
        if num_tokens == 0:
            return []
        t = torch.tensor(tokens, dtype=torch.int64) if self.is_driver else torch.empty(num_tokens, dtype=torch.int64)
        dist.broadcast(t, 0, group=self.control)
        return t.tolist()

    def _broadcast_bytes(self, payload: bytes | None) -> bytes | None:
        length = torch.tensor([_STOP if payload is None else len(payload)], dtype=torch.int64)
        dist.broadcast(length, 0, group=self.control)
        num_bytes = int(length.item())
        if num_bytes == _STOP:
            return None
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(num_bytes, dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.control)
        return payload if payload is not None else data.numpy().tobytes()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (pool sizes must agree)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def free_port() -> int:
    with socket.socket() as s:
        s.bind((MASTER_ADDR, 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank; on CPU every rank computes on the host."""
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def init_group(rank: int, num_ranks: int, port: int, device: torch.device) -> TPGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{MASTER_ADDR}:{port}",
        rank=rank,
        world_size=num_ranks,
        timeout=STEP_TIMEOUT,
    )
    return TPGroup(rank, num_ranks, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))


def set_rank_threads(num_ranks: int) -> None:
    """Ranks on one host share its cores: an oversubscribed OpenMP team stalls every matmul."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_ranks))


# ---------------------------------------------------------------- ranks > 0


def spawn_ranks(rank_main, args: argparse.Namespace, num_ranks: int, port: int) -> list[mp.process.BaseProcess]:
    """Ranks 1..N-1 as child processes of the worker (rank 0), each running
    `rank_main(rank, num_ranks, port, args)` (the worker service's)."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, num_ranks):
        proc = ctx.Process(target=rank_main, args=(rank, num_ranks, port, args), name=f"tp-rank-{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def stop_ranks(procs: list[mp.process.BaseProcess]) -> None:
    """Wait for ranks told to stop (`DriverExecutor.close`); terminate any that hang."""
    for proc in procs:
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_TIMEOUT_S)
    if dist.is_initialized():
        dist.destroy_process_group()


class DriverExecutor:
    """Rank 0's step: the plan goes to every rank, then runs here (the ranks run it too).

    Wraps the worker's `StepExecutor`; `close` stops the ranks between two steps, never in
    the middle of one (a half-done step would leave a rank waiting in an all_reduce). A rank
    that dies takes the worker with it: the step thread ends (SystemExit), the service loop
    stops, and the scheduler sees a lost worker rather than a stream of failed steps."""

    def __init__(self, inner, group: TPGroup, ranks: list[mp.process.BaseProcess]) -> None:
        self.inner = inner
        self.group = group
        self.ranks = ranks
        self.lost: list[str] = []  # names of ranks that died under a step
        self._lock = threading.Lock()
        self._closed = False

    def try_prefetch(self, plan, log) -> None:
        self.inner.try_prefetch(plan, log)

    def reset_plan(self):
        return self.inner.reset_plan()

    def __call__(self, plan, plan_wait_s: float):
        from shared.protocol import encode

        with self._lock:
            if self._closed:
                raise RuntimeError("tensor-parallel ranks are stopped")
            try:
                self.group.send_plan(encode(plan))
                return self.inner(plan, plan_wait_s)
            except RuntimeError as e:  # what a collective with a dead peer raises
                self.lost = _dead_ranks(self.ranks)
                if not self.lost:
                    raise
                self._closed = True
                raise SystemExit(f"tensor-parallel ranks {self.lost} exited") from e

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        if not self._lock.acquire(timeout=timeout_s):
            return  # a step hangs: stop_ranks terminates the ranks
        try:
            if not self._closed:
                self._closed = True
                self.group.send_stop()
        except Exception:
            pass  # a rank is already gone; stop_ranks covers the rest
        finally:
            self._lock.release()


def _dead_ranks(ranks: list[mp.process.BaseProcess], grace_s: float = 2.0) -> list[str]:
    """Ranks that have exited, giving a dying one `grace_s` to be reaped."""
    multiprocessing.connection.wait([proc.sentinel for proc in ranks], timeout=grace_s)
    return [proc.name for proc in ranks if not proc.is_alive()]
