"""The worker service: executes the scheduler's Plans in order and reports sampled tokens.

It owns the weights, both KV pools and the transfer engine, and decides nothing. The
socket loop stays responsive while a step computes: steps run on the main thread (the one
that loaded the model), the sockets on an event loop in an `io` thread.

Every connection to a scheduler starts from nothing: when a handshake succeeds (the first
one, or a restarted scheduler's), the worker finishes the plans it already has, drops
every request it knows, and announces itself with `WorkerReady`. The scheduler's fresh
core counts all blocks free, so the KV pools need no clearing. A `ResetWorker` from the
scheduler does the same on the connection it has: the scheduler gave up on this worker's
state (a step overdue, say while the process was frozen, or a step whose copies raised), and
the worker comes back with no restart.

A step that raises costs only the requests that make it raise (executor.py); the fault
injection that tests it (faults.py) is off unless `SUPERINFER_FAULTS` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import queue
import signal
import threading
import time
import uuid
from pathlib import Path

import msgspec
import torch
import zmq
import zmq.asyncio

from services.worker import cpu_kernels, cpu_quant, tp, weights_cache
from services.worker.kv_pool import KVPools, KVSpec, num_dram_blocks, num_hbm_blocks
from services.worker.executor import StepExecutor
from services.worker.faults import FAULTS_ENV, Faults
from services.worker.faults import refusal as fault_refusal
from services.worker.grammar import GrammarCompiler
from services.worker.plan_check import Limits, PlanChecker, PlanError
from services.worker.runner import ModelRunner
from services.worker.tp import TPGroup
from services.worker.transfer import TransferEngine, measure_copy_gbps
from services.worker.weights import gguf_quantization
from shared import config, protocol as p, zmqsec
from shared.log import setup_logging
from shared.modelfile import ModelConfig, read_model_config, resolve_model_path

RESET = object()  # the step thread's marker: a (new) scheduler connected
SLOW_PATH = "every step runs on the torch path, 5-10x slower"
BUSY_EVERY_S = 1.0  # while a step computes, the socket thread says so this often (WorkerBusy)


class WorkerService:
    def __init__(
        self,
        connect: str,
        ready: p.WorkerReady,
        execute: StepExecutor,
        log,
        zmq_keys: str | None = None,
        check: PlanChecker | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.ready = ready
        self.execute = execute
        self.check = check  # every id and length of a plan, before any of it runs (plan_check.py)
        self.faults = faults or Faults()
        self.log = log
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, config.ZMQ_LINGER_MS)
        zmqsec.Curve(self.ctx, zmq_keys, log).secure_client(self.sock, connect)
        # Watched before connecting: the first handshake must not be missed.
        self.handshakes = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.connect(connect)
        self.stopping = False
        self.computing: int | None = None  # the step id the compute thread is on, if any

    def run(self) -> None:
        """Compute on this thread, sockets on an event loop in an `io` thread, until `stop()`.

        Compute stays on the thread that loaded the model, so the process has one OpenMP team:
        with a second one libgomp counts more threads than cores and stops spinning between
        parallel regions, and every region then waits for a wake-up (one-row decode on 2 cores
        measured 2x slower when its steps ran on another thread than the load)."""
        plans: queue.SimpleQueue = queue.SimpleQueue()
        loop = asyncio.new_event_loop()
        results: asyncio.Queue = asyncio.Queue()
        io = threading.Thread(target=loop.run_until_complete, args=(self._io(plans, results),), name="io")
        io.start()
        try:
            self._execute_in_order(plans, loop, results, io)
        finally:
            self.stop()
            io.join()
            loop.close()

    def stop(self) -> None:
        """Safe from a signal handler: the io loop sees it within its poll interval."""
        self.stopping = True

    async def _io(self, plans: queue.SimpleQueue, results: asyncio.Queue) -> None:
        """Receive plans as they come (the scheduler sends step t+1 while t computes) and
        hand them to the compute thread, which executes them in order and posts each result
        back to this loop. A successful handshake queues a reset behind the plans already
        received (they came first: a new connection follows the old one's close by the
        reconnect interval)."""
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.handshakes, zmq.POLLIN)
        self.log.info("worker up", hbm_blocks=self.ready.num_hbm_blocks, device=self.ready.device)
        sender = asyncio.create_task(self._send_results(results))
        busy_at = time.monotonic()
        while not self.stopping:
            events = dict(await poller.poll(100))
            if (step_id := self.computing) is not None and time.monotonic() - busy_at >= BUSY_EVERY_S:
                busy_at = time.monotonic()  # a slow step is not a lost worker: say so
                results.put_nowait(p.WorkerBusy(step_id))
            if self.sock in events:
                await self._receive_plans(plans)
            if self.handshakes in events:
                await self.handshakes.recv_multipart()
                self.log.info("scheduler connected; resetting")
                plans.put((RESET, time.perf_counter()))
        plans.put(None)
        sender.cancel()
        self.sock.disable_monitor()
        self.handshakes.close(linger=0)
        self.sock.close()
        self.ctx.term()

    async def _receive_plans(self, plans: queue.SimpleQueue) -> None:
        while True:
            try:
                payload = await self.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                plan = p.worker_msg_decoder.decode(payload)
            except msgspec.DecodeError as e:
                self.log.warning("undecodable plan", error=str(e))
                continue
            if isinstance(plan, p.ResetWorker):
                self.log.warning("scheduler asked for a reset", reason=plan.reason)
                plans.put((RESET, time.perf_counter()))
                continue
            plan = self.faults.corrupt(plan, self.ready)
            try:
                if self.check is not None:
                    self.check.check_ids(plan)
            except PlanError as e:  # answered in order by the compute thread; nothing of it runs
                plans.put((e, time.perf_counter()))
                continue
            plans.put((plan, time.perf_counter()))
            self.execute.try_prefetch(plan, self.log)

    def _execute_in_order(self, plans: queue.SimpleQueue, loop, results: asyncio.Queue, io: threading.Thread) -> None:
        """The compute loop: one plan after another, no event-loop hop between them."""
        idle_since = time.perf_counter()
        while True:
            try:
                item = plans.get(timeout=0.5)  # wakes now and then, so a signal handler runs
            except queue.Empty:
                if io.is_alive():
                    continue
                return
            if item is None:
                return
            plan, arrived = item
            if plan is RESET:
                self.execute(self.execute.reset_plan(), 0.0)
                loop.call_soon_threadsafe(results.put_nowait, self.ready)
                continue
            self.computing = plan.step_id
            try:
                if isinstance(plan, PlanError):
                    raise plan
                if self.check is not None:
                    self.check.check_tables(plan)
                reply = self.execute(plan, max(0.0, arrived - idle_since))
            except PlanError as e:  # the worker's state is untouched: it serves on
                self.log.error("bad plan", step_id=e.step_id, field=e.field, request_id=e.request_id, error=str(e))
                reply = p.WorkerError(e.step_id, str(e))
            except Exception as e:  # a failed step is reported, not fatal to the loop
                self.log.exception("step failed", step_id=plan.step_id)
                reply = p.WorkerError(plan.step_id, f"{type(e).__name__}: {e}")
            finally:
                self.computing = None
            loop.call_soon_threadsafe(results.put_nowait, reply)
            idle_since = time.perf_counter()

    async def _send_results(self, results: asyncio.Queue) -> None:
        while True:
            await self.sock.send(p.encode(await results.get()))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_missing(device: torch.device) -> str:
    """Why a worker on `device` runs without its native CPU kernels (no compiler, a failed build,
    no AVX-512, turned off); "" where they run, or on a GPU. Builds or loads them."""
    if device.type != "cpu":
        return ""
    ok, why = cpu_kernels.native_status()
    return why or ("" if ok else "unavailable")


def native_refusal(device_name: str) -> str | None:
    """`--require-native`'s message where the native kernels are missing, else None."""
    if not (why := native_missing(resolve_device(device_name))):
        return None
    return (
        f"--require-native: the native CPU kernels are not in use ({why}); without them {SLOW_PATH}. "
        "Install a C compiler and run `superinfer kernels build`, or start without --require-native"
    )


def resolve_dtype(name: str, device: torch.device, path: Path | None = None, ranks: int = 1) -> torch.dtype | str:
    """`--dtype`. auto: bfloat16 on CUDA (a 32B model's weights and KV fit); on a CPU, a quantized
    GGUF as it is ("gguf", as llama.cpp serves the file) where the int8 kernels run vectorised
    (AVX512-VNNI or AVX2: cpu_quant.quant_fast) and one rank holds the whole model, else float32.
    "gguf": the file's Q8_0/Q4_0/Q4_1 matrices kept packed, int8 activations; their attention is
    batch-invariant, so a token recomputed after a preemption is the token decoded (model.py). A
    quantization's name (q8_0, q4_0, q4_1) quantizes the matrices at load, all else float32. bfloat16 on a CPU with AVX512-BF16 is
    "bf16": the matrices in bfloat16 (vdpbf16ps), activations float32; elsewhere the whole model
    in bfloat16. The KV: resolve_kv_dtype."""
    quantized = device.type == "cpu" and path is not None and bool(gguf_quantization(path))
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return "gguf" if quantized and ranks == 1 and cpu_quant.quant_fast() else torch.float32
    if name == "gguf":
        if not quantized:
            raise ValueError("--dtype gguf serves a quantized GGUF file's own format, on a CPU worker")
        return "gguf"
    if name == "bfloat16" and device.type == "cpu" and cpu_quant.bf16_fast():
        return "bf16"
    return DTYPES.get(name, name)


def resolve_kv_dtype(name: str, weights: torch.dtype | str) -> torch.dtype:
    """`--kv-cache-dtype` for weights of `weights` (resolve_dtype's answer): auto follows them, as
    vLLM's does, with the packed ones ("bf16", the quantizations) at bfloat16 as llama.cpp keeps a
    quantized model's KV at 16 bits."""
    if name == "auto":
        return torch.bfloat16 if isinstance(weights, str) else weights
    kv = DTYPES[name]
    if isinstance(weights, torch.dtype) and kv.itemsize > weights.itemsize:
        # The runner computes attention in the weights' type: a wider KV would only be truncated.
        raise ValueError(
            f"--kv-cache-dtype {name} is wider than the model computes in ({weights}; on a CPU without "
            "AVX512-BF16, --dtype bfloat16 runs the whole model in bfloat16): use auto or bfloat16"
        )
    return kv


def max_model_len(cfg: ModelConfig, asked: int | None) -> int:
    """The context window: --max-model-len, which may shorten the model's but not extend it
    (positions it was not trained on), as vLLM refuses too."""
    if asked is None:
        return cfg.max_position
    if not 1 <= asked <= cfg.max_position:
        raise ValueError(f"--max-model-len {asked} is outside 1..{cfg.max_position}, the context window of {cfg.name}")
    return asked


def build_worker(
    args: argparse.Namespace, device: torch.device, group: TPGroup | None = None
) -> tuple[ModelRunner, TransferEngine, p.WorkerReady]:
    """Model, both KV pools, transfer engine and runner of one rank (the only one without
    `group`). Pool sizes are agreed over the group, so a block id means the same everywhere."""
    path = resolve_model_path(args.model)
    weights = resolve_dtype(args.dtype, device, path, 1 if group is None else group.num_ranks)
    model, cfg = weights_cache.load_model(path, device, weights, group=group)
    spec = KVSpec.from_model(cfg, args.block_size, dtype=resolve_kv_dtype(args.kv_cache_dtype, weights))
    num_ranks = 1 if group is None else group.num_ranks
    # Ranks on one host share its RAM: size host pools by the whole KV (all ranks' heads).
    whole = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads * num_ranks)
    num_hbm = num_hbm_blocks(spec if device.type == "cuda" else whole, device, args.hbm_blocks, args.hbm_fraction)
    num_dram = num_dram_blocks(whole, args.dram_gb)
    if group is not None:
        num_hbm, num_dram = group.min_int(num_hbm), group.min_int(num_dram)
    pools = KVPools(spec, num_hbm, num_dram, device, prefault=args.kv_prefault)
    engine = TransferEngine(pools, args.transfer_mode)
    missing = native_missing(device)  # the kernels built (or loaded) now, not during the first step
    runner = ModelRunner(model, cfg, pools.hbm, args.block_size, device, group, GrammarCompiler(path))
    ready = p.WorkerReady(
        model_name=cfg.name,
        num_hbm_blocks=pools.num_hbm_blocks,
        num_dram_blocks=pools.num_dram_blocks,
        block_size=args.block_size,
        max_model_len=min(max_model_len(cfg, args.max_model_len), pools.num_hbm_blocks * args.block_size),
        device=str(device) if group is None else f"{device} x{num_ranks}",
        block_bytes=spec.block_bytes * num_ranks,
        vocab_size=cfg.vocab_size,
        worker_id=args.worker_id or uuid.uuid4().hex[:12],
        copy_gbps=measure_copy_gbps(engine, spec.block_bytes),
        native_missing=missing,
    )
    return runner, engine, ready


def rank_main(rank: int, num_ranks: int, port: int, args: argparse.Namespace) -> None:
    """A tensor-parallel rank > 0 (tp.py spawns it): build its shard, then execute every plan
    rank 0 broadcasts, until stopped."""
    log = setup_logging("worker", args.log_level).bind(tp_rank=rank)
    tp.set_rank_threads(num_ranks)
    device = tp.rank_device(resolve_device(args.device), rank)
    group = tp.init_group(rank, num_ranks, port, device)
    runner, engine, _ = build_worker(args, device, group)
    execute = StepExecutor(runner, engine)
    log.info("tp rank up", num_ranks=num_ranks)
    try:
        while (payload := group.recv_plan()) is not None:
            plan = p.worker_msg_decoder.decode(payload)
            try:
                execute(plan, 0.0)
            except Exception:  # rank 0 fails the same step the same way and reports it
                log.exception("step failed", step_id=plan.step_id)
    finally:
        engine.close()
        torch.distributed.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    log = setup_logging("worker", args.log_level)
    if reason := zmqsec.refusal([args.connect], args.zmq_keys, zmqsec.CLIENT):
        log.error("refusing to start", reason=reason)  # before the model loads: seconds, not minutes
        return 2
    try:
        max_model_len(read_model_config(resolve_model_path(args.model)), args.max_model_len)
        faults = Faults.from_env()
    except ValueError as e:
        log.error("refusing to start", reason=str(e))
        return 2
    if reason := fault_refusal(os.environ.get(FAULTS_ENV, ""), [args.connect], args.zmq_keys):
        log.error("refusing to start", reason=reason)
        return 2
    if faults.enabled:
        log.warning("fault injection is on", spec=os.environ.get(FAULTS_ENV))
    if args.require_native and (refusal := native_refusal(args.device)):
        log.error("refusing to start", reason=refusal)
        return 2
    device = resolve_device(args.device)
    num_ranks = args.tp
    t0 = time.perf_counter()
    group, ranks = None, []
    if num_ranks > 1:
        tp.check_tp(read_model_config(resolve_model_path(args.model)), num_ranks)
        tp.set_rank_threads(num_ranks)
        port = tp.free_port()
        ranks = tp.spawn_ranks(rank_main, args, num_ranks, port)
        device = tp.rank_device(device, 0)
        group = tp.init_group(0, num_ranks, port, device)
    try:
        runner, engine, ready = build_worker(args, device, group)
        log.info("model loaded", model=ready.model_name, tp=num_ranks, seconds=round(time.perf_counter() - t0, 2))
        if ready.native_missing:
            log.warning(f"native CPU kernels not in use: {SLOW_PATH}", reason=ready.native_missing)
        execute = StepExecutor(runner, engine, faults)
        if group is not None:
            execute = tp.DriverExecutor(execute, group, ranks)
        check = PlanChecker(Limits.of(ready), runner.extent)
        service = WorkerService(args.connect, ready, execute, log, args.zmq_keys, check, faults)
        # What startup built (torch, the model, the kernels) lives until exit: out of the
        # collector's sight it costs no full collection mid-step and no seconds at exit.
        gc.collect()
        gc.freeze()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: service.stop())
        try:
            service.run()
        finally:
            if group is not None:
                execute.close()
            engine.close()
    finally:
        if ranks:
            tp.stop_ranks(ranks)
    if group is not None and execute.lost:
        log.error("worker stopped: tensor-parallel ranks exited", ranks=execute.lost)
        return 1
    log.info("worker stopped")
    return 0
