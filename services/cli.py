"""`superinfer` command line: serve, start one service, inspect a scheduler, or benchmark.

    superinfer serve                      # gateway + scheduler + worker on this machine
    superinfer gateway|scheduler|worker   # one service, tcp:// addresses
    superinfer queues|top|stats           # what the scheduler is doing (admin socket)
    superinfer abort ID | drain [--undo]  # operator commands (admin token)
    superinfer keys DIR                   # CURVE keys for --zmq-keys (tcp:// off loopback)
    superinfer bench model|kv|sched ...   # benchmarks (print numbers, write JSON)
"""

from __future__ import annotations

import argparse
import importlib
import sys

from services import admin_cli
from shared import config, zmqsec

# name -> module with add_arguments(parser) and run(args) -> int
BENCHMARKS = {
    "model": ("bench.micro.model", "our worker vs transformers: prefill tok/s, decode step ms"),
    "kv": ("bench.micro.kv", "DuplexKV transfer modes vs the machine's memcpy limit"),
    "sched": ("bench.micro.sched", "time of one LVF scheduling step vs live requests"),
    "serve": ("bench.live.serve", "load generator against an OpenAI-compatible server: SLO attainment"),
    "compare": ("bench.live.compare", "the same workloads against several servers in turn (ours, vLLM...), side by side"),
    "policies": ("bench.live.policies", "lvf vs fcfs vs sf vs wf on the live server under overload"),
    "soak": ("bench.live.soak", "overload soak with disconnects: nothing lost, no leaked blocks, flat RSS"),
    "sim": ("bench.sim.sweep", "discrete-event simulator: the scheduler core with a cost-model worker"),
    "calibrate": ("bench.sim.calibrate", "measure this machine's worker and write the `cpu` profile"),
    "simlive": ("bench.sim.simlive", "the simulator vs the live server on one ShareGPT trace, calibrated in the same run"),
    "reproduce": ("bench.sim.reproduce", "regenerate bench/REPRODUCTION.md from simulator runs"),
}


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or Hugging Face-style directory (config.json + safetensors); "
        "default: the bundled SmolLM2-135M-Instruct",
    )


def _gateway_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway (HTTP API)")
    g.add_argument("--host", default=config.DEFAULT_HOST, help="address to bind (default %(default)s)")
    g.add_argument("--port", type=int, default=config.DEFAULT_PORT, help="HTTP port (default %(default)s)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument(
        "--failover-grace",
        type=float,
        default=config.DEFAULT_FAILOVER_GRACE_S,
        metavar="S",
        help="how long a request whose scheduler was lost waits for another one before it fails "
        "(default %(default)s)",
    )


def _scheduler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler (RotaSched)")
    g.add_argument(
        "--policy",
        choices=["lvf", "fcfs", "sf", "wf"],
        default="lvf",
        help="lvf: Largest-VLT-First rotation (SuperInfer); fcfs: FCFS with recompute preemption; "
        "sf: swapped-first with swap preemption; wf: waiting-first with swap preemption",
    )
    g.add_argument("--ttft-slo", type=float, default=5.0, help="TTFT SLO S_F in seconds (default %(default)s)")
    g.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO S_B in seconds (default %(default)s)")
    g.add_argument("--alpha", type=float, default=3.0, help="VLT weight of rotary requests (default %(default)s)")
    g.add_argument("--beta-f", type=float, default=0.5, help="TTFT slack share before VLT grows (default %(default)s)")
    g.add_argument("--beta-b", type=float, default=0.0, help="TBT slack share before VLT grows (default %(default)s)")
    g.add_argument(
        "--xfer-budget",
        type=int,
        default=2400,
        help="B_xfer: KV blocks that may be rotated per step (default %(default)s)",
    )
    g.add_argument(
        "--max-batched-tokens",
        type=int,
        default=config.DEFAULT_MAX_BATCHED_TOKENS,
        help="chunked-prefill token budget per step, decodes first (default %(default)s)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=config.DEFAULT_MAX_NUM_SEQS, help="requests per step at most"
    )
    g.add_argument(
        "--pipeline-depth",
        type=int,
        choices=[1, 2],
        default=2,
        help="plans in flight at the worker: 2 builds step t+1 while t computes (default), 1 waits",
    )
    g.add_argument("--step-trace", default=None, metavar="PATH", help="append one JSON line per step to PATH")
    g.add_argument(
        "--max-waiting",
        type=int,
        default=0,
        help="requests waiting for their first schedule at most; beyond it new ones get 429 (0 = unbounded)",
    )
    g.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=0,
        help="known tokens (prompt + generated) of the waiting requests at most; a new request that would "
        "pass it gets 429, unless none is waiting (0 = unbounded)",
    )
    g.add_argument(
        "--step-timeout",
        type=float,
        default=2.0,
        help="a step result later than max(this, 10 x median recent step, 2 x slowest recent step) "
        "means the worker is lost; its requests resume on the next worker (default %(default)s s)",
    )


def _admin_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler admin socket and metrics")
    g.add_argument(
        "--admin-bind",
        default=admin_cli.DEFAULT_ADMIN_ADDR,
        help="the scheduler's admin socket for `superinfer queues|top|stats|abort|drain`; "
        "'off' disables it (default %(default)s)",
    )
    g.add_argument(
        "--metrics-port", type=int, default=None, help="serve the scheduler's Prometheus /metrics on this port"
    )
    g.add_argument("--metrics-host", default=config.DEFAULT_HOST, help="its address (default %(default)s)")


def _admin_token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin-token",
        default=None,
        help=f"token that abort/drain must present (or ${admin_cli.TOKEN_ENV}); without one they are refused",
    )


def _worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker (model + DuplexKV)")
    g.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when available)")
    g.add_argument(
        "--hbm-blocks",
        type=int,
        default=None,
        help="KV blocks in the compute-device pool (default: from --hbm-fraction)",
    )
    g.add_argument(
        "--hbm-fraction",
        type=float,
        default=None,
        help="share of memory for the KV pool when --hbm-blocks is not given "
        "(default 0.9 of device memory on GPU, 0.25 of available RAM on CPU)",
    )
    g.add_argument("--dram-gb", type=float, default=2.0, help="host-memory KV pool size in GiB (default %(default)s)")
    g.add_argument(
        "--kv-prefault",
        action="store_true",
        help="write the KV pools once at start so host memory is resident from the first request "
        "(seconds per GiB on a CPU; device and pinned memory always are)",
    )
    g.add_argument(
        "--block-size", type=int, default=config.DEFAULT_BLOCK_SIZE, help="tokens per KV block (default %(default)s)"
    )
    g.add_argument(
        "--transfer-mode",
        choices=["naive", "merged", "batched", "duplex"],
        default="duplex",
        help="KV transfer engine mode: naive (per-layer copies, serial), merged (per block), "
        "batched (one call per direction), duplex (both directions at once; default)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (torch.distributed: gloo on CPU, NCCL with one GPU per rank); "
        "must divide the model's KV heads (default %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="superinfer", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="start gateway, scheduler and worker on this machine (ipc:// sockets)")
    _model_args(p)
    _gateway_args(p)
    _scheduler_args(p)
    _admin_args(p)
    _admin_token_arg(p)
    _worker_args(p)

    p = sub.add_parser("gateway", help="start the HTTP gateway alone")
    _model_args(p)
    _gateway_args(p)
    p.add_argument(
        "--scheduler",
        action="append",
        default=None,
        help=f"scheduler address, repeatable (default {config.DEFAULT_SCHEDULER_ADDR})",
    )
    zmqsec.add_keys_arg(p)

    p = sub.add_parser("scheduler", help="start the scheduler alone")
    _scheduler_args(p)
    _admin_args(p)
    _admin_token_arg(p)
    p.add_argument("--bind", default=config.DEFAULT_SCHEDULER_ADDR, help="address gateways connect to")
    p.add_argument("--worker-bind", default=config.DEFAULT_WORKER_ADDR, help="address the worker connects to")
    zmqsec.add_keys_arg(p)

    p = sub.add_parser("worker", help="start the model worker alone")
    _model_args(p)
    _worker_args(p)
    p.add_argument("--connect", default=config.DEFAULT_WORKER_ADDR, help="the scheduler's worker address")
    p.add_argument(
        "--worker-id", default=None, help="this worker's name in the scheduler's load reports (default: random)"
    )
    zmqsec.add_keys_arg(p)

    admin_cli.add_commands(sub)
    zmqsec.add_keys_command(sub)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (module, help_text) in BENCHMARKS.items():
        bp = bench.add_parser(name, help=help_text)
        bp.set_defaults(bench_module=module)
        # Arguments are added lazily in main(): importing torch for --help of `serve` is slow.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        return _run_bench(argv[1], argv[2:])
    args = parser.parse_args(argv)
    if args.command == "serve":
        from services.supervisor import serve

        return serve(args)
    if args.command == "gateway":
        from services.gateway.server import run

        addrs = args.scheduler or [config.DEFAULT_SCHEDULER_ADDR]
        return run(args.host, args.port, addrs, args.model, args.api_key, args.zmq_keys, args.failover_grace)
    if args.command == "scheduler":
        from services.scheduler.service import run

        return run(args)
    if args.command == "worker":
        from services.worker.service import run

        return run(args)
    if args.command in admin_cli.COMMANDS:
        return admin_cli.run(args)
    if args.command == "keys":
        return zmqsec.run_keys(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _run_bench(name: str, argv: list[str]) -> int:
    module_name, help_text = BENCHMARKS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"superinfer bench {name}", description=help_text)
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
