"""Random plans against references that never move.

A scheduler in miniature drives the real engine: requests fill blocks a few tokens a step,
synced blocks are mirrored to DRAM (eager rotation), preemption swaps out what is not
mirrored and frees the HBM blocks, resumption swaps everything back in, recompute drops it
all. It keeps the contract a scheduler keeps (a freed HBM block is reused only once the
out-copies reading it are reported done; compute waits for the swap-ins of the blocks it
touches) and nothing more: DRAM blocks are reused at once, so the engine's own ordering is
what keeps them right. Every request's KV must stay bit-exact to its reference.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pytest
import torch

from services.worker.kv_pool import KVSpec
from services.worker.transfer import MODES, Transfer, TransferEngine
from tests.worker.test_transfer import DEVICES, SMALL, bits, make_pools, random_bits

RUNNING, ROTARY, WAITING, FINISHED = "running", "rotary", "waiting", "finished"
PLANNED = object()  # stands for the transfer of the plan being built


@dataclass
class Req:
    ref: torch.Tensor  # [max_blocks, num_layers, 2, block_size, heads, dim], on the host, never moved
    num_tokens: int = 0
    state: str = WAITING
    hbm: list[int] = field(default_factory=list)  # block table while running
    dram: dict[int, int] = field(default_factory=dict)  # logical block -> DRAM block (mirrors, or all)


class Sim:
    def __init__(self, engine: TransferEngine, seed: int, num_requests: int, max_blocks: int, window: int):
        self.engine, self.pools = engine, engine.pools
        self.spec: KVSpec = self.pools.spec
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        shape = (max_blocks, *self.spec.block_shape)
        self.reqs = [Req(random_bits(shape, self.spec.dtype, gen)) for _ in range(num_requests)]
        self.max_tokens = max_blocks * self.spec.block_size
        # free lists are stacks: the block freed last is reused first, the riskiest order
        self.free_hbm = list(range(self.pools.num_hbm_blocks))
        self.free_dram = list(range(self.pools.num_dram_blocks))
        self.pending: set[int] = set()  # freed HBM blocks that an out-copy in flight still reads
        self.reading: dict[int, object] = {}  # HBM block -> last transfer reading it (out)
        self.in_writer: dict[int, object] = {}  # HBM block -> last transfer writing it (in)
        self.out_writer: dict[int, object] = {}  # DRAM block -> last transfer writing it (out)
        self.inflight: list[Transfer] = []
        self.window = window
        self.counts = dict.fromkeys(("swap_in", "swap_out", "eager", "recompute", "finished"), 0)

    # -------------------------------------------------------------- blocks

    def num_blocks(self, r: Req) -> int:
        return -(-r.num_tokens // self.spec.block_size)

    def alloc_hbm(self) -> int | None:
        waitable = sorted(b for b in self.pending if self.reading[b] is not PLANNED)
        if not self.free_hbm and waitable:  # wait for the report that frees one
            self.reading[self.rng.choice(waitable)].wait_out()
            self.reclaim()
        return self.free_hbm.pop() if self.free_hbm else None

    def free_hbm_block(self, b: int) -> None:
        reader = self.reading.get(b)
        busy = reader is PLANNED or (reader is not None and not reader.out_done())
        if busy:
            self.pending.add(b)
        else:
            self.free_hbm.append(b)

    def reclaim(self) -> None:
        for b in [b for b in self.pending if self.reading[b] is not PLANNED and self.reading[b].out_done()]:
            self.pending.discard(b)
            self.free_hbm.append(b)

    def wait_written(self, writers: dict[int, object], block: int, direction: str) -> None:
        t = writers.get(block)
        if t is not None:
            t.fence_in() if direction == "in" else t.wait_out()

    # -------------------------------------------------------------- compute

    def compute(self, r: Req) -> None:
        """Write 1..block_size new tokens' KV into the HBM pool, as the model would."""
        bs = self.spec.block_size
        n = min(self.rng.randint(1, bs), self.max_tokens - r.num_tokens)
        for pos in range(r.num_tokens, r.num_tokens + n):
            k, off = divmod(pos, bs)
            if k == len(r.hbm):
                b = self.alloc_hbm()
                if b is None:
                    return
                r.hbm.append(b)
            b = r.hbm[k]
            self.wait_written(self.in_writer, b, "in")
            # one token of every layer, K and V: [num_layers, 2, heads, dim]
            self.pools.hbm[b, :, :, off] = r.ref[k, :, :, off].to(self.pools.device)
            r.num_tokens = pos + 1

    # -------------------------------------------------------------- plan

    def plan_request(self, r: Req, swap_in: list, swap_out: list, eager: list) -> None:
        x = self.rng.random()
        if r.state == WAITING and self.free_hbm:
            r.state = RUNNING
        elif r.state == RUNNING and r.num_tokens == self.max_tokens:
            self.verify(r)
            self.drop(r, FINISHED)
            self.counts["finished"] += 1
        elif r.state == RUNNING and x < 0.25:
            self.preempt(r, swap_out)
        elif r.state in (RUNNING, ROTARY) and x > 0.97:
            self.drop(r, WAITING)
            self.counts["recompute"] += 1
        elif r.state == RUNNING:
            self.mirror(r, eager)
        elif r.state == ROTARY and x < 0.5:
            self.resume(r, swap_in)

    def preempt(self, r: Req, swap_out: list) -> None:
        """Move what is not mirrored yet (the dirty block, with eager rotation keeping up)."""
        for k, b in enumerate(r.hbm):
            if k not in r.dram:
                d = self.free_dram.pop()
                swap_out.append((b, d))
                r.dram[k] = d
                self.reading[b] = self.out_writer[d] = PLANNED
            self.free_hbm_block(b)
        r.hbm, r.state = [], ROTARY

    def mirror(self, r: Req, eager: list) -> None:
        """Eager rotation: copy synced (full) blocks to DRAM in the background."""
        for k in range(r.num_tokens // self.spec.block_size):
            if k not in r.dram and self.rng.random() < 0.6:
                d = self.free_dram.pop()
                eager.append((r.hbm[k], d))
                r.dram[k] = d
                self.reading[r.hbm[k]] = self.out_writer[d] = PLANNED

    def resume(self, r: Req, swap_in: list) -> None:
        n = self.num_blocks(r)
        if n > len(self.free_hbm):
            return
        for k in range(n):
            h = self.free_hbm.pop()
            swap_in.append((r.dram[k], h))
            r.hbm.append(h)
            self.in_writer[h] = PLANNED
        if r.num_tokens % self.spec.block_size:  # the dirty block will change: drop its copy now
            self.free_dram.append(r.dram.pop(n - 1))
        r.state = RUNNING

    def drop(self, r: Req, state: str) -> None:
        for b in r.hbm:
            self.free_hbm_block(b)
        self.free_dram.extend(r.dram.values())
        r.hbm, r.dram, r.num_tokens, r.state = [], {}, 0, state

    # -------------------------------------------------------------- step

    def step(self) -> None:
        self.reclaim()
        for r in self.rng.sample(self.reqs, len(self.reqs)):
            if r.state == RUNNING and self.rng.random() < 0.7 and r.num_tokens < self.max_tokens:
                self.compute(r)
        swap_in, swap_out, eager = [], [], []
        for r in self.rng.sample(self.reqs, len(self.reqs)):
            self.plan_request(r, swap_in, swap_out, eager)
        t = self.engine.submit(swap_in, swap_out, eager)
        for table in (self.reading, self.in_writer, self.out_writer):
            for b, v in table.items():
                if v is PLANNED:
                    table[b] = t
        for key, pairs in (("swap_in", swap_in), ("swap_out", swap_out), ("eager", eager)):
            self.counts[key] += len(pairs)
        self.inflight.append(t)
        self.random_waits()

    def random_waits(self) -> None:
        """Waits in random order, keeping up to `window` transfers in flight."""
        while self.inflight and (len(self.inflight) > self.window or self.rng.random() < 0.3):
            t = self.inflight.pop(self.rng.randrange(len(self.inflight)))
            self.rng.choice([t.wait_in, t.wait_out, t.wait, t.done, t.fence_in])()
        if self.rng.random() < 0.1:
            self.verify(self.rng.choice(self.reqs))

    # -------------------------------------------------------------- check

    def verify(self, r: Req) -> None:
        """Bit-exact against the reference: HBM while running (plus ready mirrors), DRAM while rotary."""
        bs = self.spec.block_size
        for k in range(self.num_blocks(r)):
            m = min(bs, r.num_tokens - k * bs)  # valid tokens of block k
            want = bits(r.ref[k, :, :, :m])
            if r.state == RUNNING:
                self.wait_written(self.in_writer, r.hbm[k], "in")
                assert torch.equal(bits(self.pools.hbm[r.hbm[k], :, :, :m]), want), f"HBM block {k}"
            if k in r.dram:
                self.wait_written(self.out_writer, r.dram[k], "out")
                assert torch.equal(bits(self.pools.dram[r.dram[k], :, :, :m]), want), f"DRAM block {k}"


def run_sim(engine: TransferEngine, seed: int, steps: int, num_requests: int, max_blocks: int, window: int) -> Sim:
    sim = Sim(engine, seed, num_requests, max_blocks, window)
    for _ in range(steps):
        sim.step()
    for r in sim.reqs:
        sim.verify(r)
    engine.close()
    return sim


def add_jitter(engine: TransferEngine, seed: int, max_ms: float) -> None:
    """Delay each copy a random while, so many submits are in flight and the two directions
    interleave differently every run (the real copies still do the work)."""
    rng = random.Random(seed)
    backend = engine._backend
    if engine.pools.is_cuda:
        real_cuda = backend._copy

        def slow_cuda(src, dst, pairs, stream):
            torch.cuda._sleep(int(rng.random() * max_ms * 1e6))  # ~1e6 cycles a millisecond
            return real_cuda(src, dst, pairs, stream)

        backend._copy = slow_cuda
    else:
        real_cpu = backend.copy

        def slow_cpu(src, dst, pairs, non_blocking=False):
            time.sleep(rng.random() * max_ms / 1e3)
            real_cpu(src, dst, pairs)

        backend.copy = slow_cpu


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_plans_keep_every_request_bit_exact(device, mode, seed):
    engine = TransferEngine(make_pools(SMALL, num_hbm=20, num_dram=96, device=device, seed=seed), mode)
    sim = run_sim(engine, seed, steps=150, num_requests=8, max_blocks=10, window=3)
    assert sim.counts["swap_in"] and sim.counts["swap_out"] and sim.counts["eager"]
    assert sim.counts["finished"] and sim.counts["recompute"]


MEDIUM = KVSpec(num_layers=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float16)  # 4 KiB blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(8))
def test_duplex_stress_many_in_flight_never_corrupts(device, seed):
    """Dropping any one of the engine's ordering rules fails about half of these seeds."""
    engine = TransferEngine(make_pools(MEDIUM, num_hbm=40, num_dram=160, device=device, seed=seed), "duplex")
    add_jitter(engine, seed, max_ms=2.0)
    sim = run_sim(engine, seed, steps=300, num_requests=12, max_blocks=12, window=8)
    assert sim.counts["swap_in"] > 100 and sim.counts["swap_out"] > 50 and sim.counts["eager"] > 50


def test_jitter_really_keeps_transfers_in_flight():
    """The stress test is only a stress test if submits overlap."""
    engine = TransferEngine(make_pools(MEDIUM, 8, 8, "cpu"), "duplex")
    add_jitter(engine, 0, max_ms=20.0)
    transfers = [engine.submit(swap_in=[(i, i)], swap_out=[(7 - i, 7 - i)]) for i in range(3)]
    assert engine.num_in_flight() >= 2
    for t in transfers:
        t.wait()
    engine.close()

