"""The worker service: executes the scheduler's Plans in order and reports sampled tokens.

It owns the weights, both KV pools and the transfer engine, and decides nothing. The
socket loop stays responsive while a step computes: the step runs on one executor thread.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import signal
import time

import msgspec
import torch
import zmq
import zmq.asyncio

from services.worker.kv_pool import KVPools, KVSpec, num_dram_blocks, num_hbm_blocks
from services.worker.runner import ModelRunner, load_model
from services.worker.transfer import TransferEngine
from shared import config, protocol as p
from shared.log import setup_logging
from shared.modelfile import resolve_model_path


class StepExecutor:
    """One Plan → one StepResult: transfers first, then the batched forward."""

    def __init__(self, runner: ModelRunner, engine) -> None:
        self.runner = runner
        self.engine = engine

    def __call__(self, plan: p.Plan) -> p.StepResult:
        t0 = time.perf_counter()
        self.runner.add_requests(plan.new_requests)
        # Swap-outs read HBM blocks this step may reuse, so both directions finish before
        # compute writes anything.
        transfer = self.engine.submit(plan.swap_in, plan.swap_out, plan.eager)
        transfer.wait_in()
        transfer.wait_out()
        t1 = time.perf_counter()
        self.runner.drop(plan.drop)
        ids, tokens = self.runner.execute(plan.scheduled)
        t2 = time.perf_counter()
        return p.StepResult(
            plan.step_id,
            ids,
            tokens,
            p.StepTimings(transfer_s=t1 - t0, compute_s=t2 - t1, stall_s=t1 - t0),
        )


class WorkerService:
    def __init__(self, connect: str, ready: p.WorkerReady, execute: StepExecutor, log) -> None:
        self.ready = ready
        self.execute = execute
        self.log = log
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, config.ZMQ_LINGER_MS)
        self.sock.connect(connect)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="step")
        self.stopping = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        await self.sock.send(p.encode(self.ready))
        self.log.info("worker up", hbm_blocks=self.ready.num_hbm_blocks, device=self.ready.device)
        while not self.stopping:
            if not await self.sock.poll(100, zmq.POLLIN):
                continue
            payload = await self.sock.recv()
            try:
                plan = p.worker_msg_decoder.decode(payload)
            except msgspec.DecodeError as e:
                self.log.warning("undecodable plan", error=str(e))
                continue
            try:
                reply = await loop.run_in_executor(self.pool, self.execute, plan)
            except Exception as e:  # a failed step is reported, not fatal to the loop
                self.log.exception("step failed", step_id=plan.step_id)
                reply = p.WorkerError(plan.step_id, f"{type(e).__name__}: {e}")
            await self.sock.send(p.encode(reply))
        self.sock.close()
        self.ctx.term()
        self.pool.shutdown(wait=False)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def run(args: argparse.Namespace) -> int:
    log = setup_logging("worker", args.log_level)
    device = resolve_device(args.device)
    path = resolve_model_path(args.model)
    t0 = time.perf_counter()
    model, cfg = load_model(path, device)
    spec = KVSpec.from_model(cfg, args.block_size, dtype=next(model.parameters()).dtype)
    pools = KVPools(
        spec,
        num_hbm_blocks(spec, device, args.hbm_blocks, args.hbm_fraction),
        num_dram_blocks(spec, args.dram_gb),
        device,
    )
    engine = TransferEngine(pools, args.transfer_mode)
    runner = ModelRunner(model, cfg, pools.hbm, args.block_size, device)
    log.info("model loaded", model=cfg.name, seconds=round(time.perf_counter() - t0, 2))
    ready = p.WorkerReady(
        model_name=cfg.name,
        num_hbm_blocks=pools.num_hbm_blocks,
        num_dram_blocks=pools.num_dram_blocks,
        block_size=args.block_size,
        max_model_len=min(cfg.max_position, pools.num_hbm_blocks * args.block_size),
        device=str(device),
    )
    service = WorkerService(args.connect, ready, StepExecutor(runner, engine), log)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(service, "stopping", True))
        await service.run()

    try:
        asyncio.run(main())
    finally:
        engine.close()
    log.info("worker stopped")
    return 0
