"""`superinfer` command line: serve, start one service, inspect a scheduler, or benchmark.

    superinfer serve                      # gateway + scheduler + worker on this machine
    superinfer gateway|scheduler|worker   # one service, tcp:// addresses
    superinfer queues|top|stats           # what the scheduler is doing (admin socket)
    superinfer abort ID | drain [--undo]  # operator commands (admin token)
    superinfer keys DIR                   # CURVE keys for --zmq-keys (tcp:// off loopback)
    superinfer docs config                # regenerate docs/configuration.md from the flags
    superinfer kernels build              # compile the native CPU kernels into the cache (install, image build)
    superinfer bench model|matmul|quant|kv|sched|grammar ...   # benchmarks (print numbers, write JSON)
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

from services import admin_cli, config_docs, flags
from shared import config, log, zmqsec

# `superinfer bench NAME` -> module with add_arguments(parser) and run(args) -> int. The one
# door from the CLI up to bench/, opened by name only when a benchmark runs, so that no other
# command imports torch for it (tests/test_layers.py holds both).
BENCHMARKS = {
    "model": ("bench.micro.model", "our worker vs transformers: prefill tok/s, decode step ms"),
    "prefill": ("bench.micro.prefill", "one prefill step of the worker's model: ms, and where they go (matmuls, attention, norms)"),
    "matmul": ("bench.micro.matmul", "the worker's CPU matmul layouts (panels, oneDNN, [in, out]): ms by rows"),
    "quant": ("bench.micro.quant", "each weight precision (fp32, bf16, GGUF quants): greedy agreement, perplexity, ITL"),
    "kv": ("bench.micro.kv", "DuplexKV transfer modes vs the machine's memcpy limit"),
    "sched": ("bench.micro.sched", "time of one LVF scheduling step vs live requests"),
    "grammar": ("bench.micro.grammar", "llguidance vs xgrammar vs outlines-core: schema compile ms, mask ms per step"),
    "serve": ("bench.live.serve", "load generator against an OpenAI-compatible server: SLO attainment"),
    "compare": ("bench.live.compare", "the same workloads against several servers in turn (ours, vLLM...), side by side"),
    "policies": ("bench.live.policies", "lvf vs fcfs vs sf vs wf on the live server under overload"),
    "soak": ("bench.live.soak", "overload soak with disconnects: nothing lost, no leaked blocks, flat RSS"),
    "chaos": ("bench.live.chaos", "load past capacity while services are killed, frozen, failed and cut off"),
    "sim": ("bench.sim.sweep", "discrete-event simulator: the scheduler core with a cost-model worker"),
    "calibrate": ("bench.sim.calibrate", "measure this machine's worker and write the `cpu` profile"),
    "simlive": ("bench.sim.simlive", "the simulator vs the live server on one ShareGPT trace, calibrated in the same run"),
    "reproduce": ("bench.sim.reproduce", "regenerate bench/REPRODUCTION.md from simulator runs"),
    "replicas": ("bench.sim.replicas", "N replicas behind one gateway in the simulator: cache-aware, headroom, round-robin routing"),
    "replicas-live": ("bench.live.replicas", "two scheduler+worker pairs behind one gateway on this machine: the routings live"),
    "tier": ("bench.sim.tier", "the DRAM prefix-cache tier in the simulator: LVF + tier vs vLLM V1 + host tier"),
    "synth-model": ("bench.models.synth", "a real model's shape, seeded random weights: GGUF F16/Q8_0/Q4_1, HF bf16"),
    "summary": ("bench.summary", "copy a run's figures into bench/summary.json and render docs/results.md"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="superinfer", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error")
    parser.add_argument(
        "--log-format",
        choices=log.LOG_FORMATS,
        default=os.environ.get(log.LOG_FORMAT_ENV, "auto"),
        help="console: readable lines; json: one JSON object per line; auto: console on a terminal, "
        f"JSON otherwise (default %(default)s, or ${log.LOG_FORMAT_ENV})",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="start gateway, scheduler and worker on this machine (ipc:// sockets)")
    flags.model_args(p)
    flags.gateway_args(p)
    flags.scheduler_args(p)
    flags.admin_args(p)
    flags.admin_token_arg(p)
    flags.worker_args(p)

    p = sub.add_parser("gateway", help="start the HTTP gateway alone")
    flags.model_args(p)
    flags.gateway_args(p)
    p.add_argument(
        "--scheduler",
        action="append",
        default=None,
        help=f"scheduler address, repeatable (default {config.DEFAULT_SCHEDULER_ADDR})",
    )
    zmqsec.add_keys_arg(p)

    p = sub.add_parser("scheduler", help="start the scheduler alone")
    flags.scheduler_args(p)
    flags.admin_args(p)
    flags.admin_token_arg(p)
    p.add_argument("--bind", default=config.DEFAULT_SCHEDULER_ADDR, help="address gateways connect to")
    p.add_argument("--worker-bind", default=config.DEFAULT_WORKER_ADDR, help="address the worker connects to")
    zmqsec.add_keys_arg(p)

    p = sub.add_parser("worker", help="start the model worker alone")
    flags.model_args(p)
    flags.worker_args(p)
    p.add_argument("--connect", default=config.DEFAULT_WORKER_ADDR, help="the scheduler's worker address")
    p.add_argument(
        "--worker-id", default=None, help="this worker's name in the scheduler's load reports (default: random)"
    )
    zmqsec.add_keys_arg(p)

    admin_cli.add_commands(sub)
    docs = sub.add_parser("docs", help="regenerate the docs generated from the code")
    docs = docs.add_subparsers(dest="docs", required=True, metavar="PAGE")
    p = docs.add_parser("config", help="docs/configuration.md: every flag of every service, with its default")
    p.add_argument("--output", default=str(config_docs.DEFAULT_PATH), help="where to write it; - for stdout")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page differs from the flags")
    zmqsec.add_keys_command(sub)
    kernels = sub.add_parser("kernels", help="the native CPU kernels")
    kernels = kernels.add_subparsers(dest="kernels", required=True, metavar="ACTION")
    kernels.add_parser("build", help="compile them for this machine into the kernel cache now (exit 1 where that fails)")

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
    os.environ[log.LOG_FORMAT_ENV] = args.log_format  # this process's services and serve's children
    if args.command == "serve":
        if args.require_native and (refusal := _native_refusal(args.device)):
            print(f"superinfer serve: refusing to start: {refusal}", file=sys.stderr)
            return 2
        from services.supervisor import serve

        return serve(args)
    if args.command == "gateway":
        from services.gateway.server import run

        addrs = args.scheduler or [config.DEFAULT_SCHEDULER_ADDR]
        return run(
            args.host,
            args.port,
            addrs,
            args.model,
            flags.api_key(args),
            args.zmq_keys,
            args.failover_grace,
            args.routing,
            served_model_names=args.served_model_name,
            seed=args.seed,
            tool_call_parser=args.tool_call_parser,
        )
    if args.command == "scheduler":
        from services.scheduler.main import run

        return run(args)
    if args.command == "worker":
        _bind_compute_threads(args.tp)
        from services.worker.service import run

        return run(args)
    if args.command in admin_cli.COMMANDS:
        return admin_cli.run(args)
    if args.command == "keys":
        return zmqsec.run_keys(args)
    if args.command == "docs":
        return _write_config_docs(args)
    if args.command == "kernels":
        return _build_kernels()
    parser.error(f"unknown command {args.command}")
    return 2


def _native_refusal(device: str) -> str | None:
    from services.worker.service import native_refusal  # torch: only with --require-native

    return native_refusal(device)


def _bind_compute_threads(num_ranks: int) -> None:
    """Each of the worker's OpenMP threads stays on its own core, as vLLM's CPU worker binds
    them: a step's threads keep their caches when the gateway and scheduler wake beside them
    (8 and 16 streams: 2-16% more tokens/s in an A/B on 2 cores). OpenMP reads these once,
    when torch loads it, so they are set before; an operator's own OMP_* settings win, and
    tensor-parallel ranks (processes sharing the cores) are left unbound."""
    if num_ranks == 1:
        os.environ.setdefault("OMP_PROC_BIND", "close")
        os.environ.setdefault("OMP_PLACES", "cores")


def _build_kernels() -> int:
    """`superinfer kernels build`: the library a first `serve` would compile, built (or found) in
    the cache ($SUPERINFER_CACHE_DIR), so that no pod waits for the compiler at its first request."""
    from services.worker import kernel_build

    try:
        path = kernel_build.build()
    except (OSError, subprocess.SubprocessError) as e:
        print(f"native cpu kernels not built: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _write_config_docs(args: argparse.Namespace) -> int:
    text = config_docs.render(build_parser)
    if args.output == "-":
        sys.stdout.write(text)
    elif args.check:
        path = Path(args.output)
        if not path.exists() or path.read_text() != text:
            print(f"{path} differs from the flags; regenerate it: {config_docs.REGENERATE}", file=sys.stderr)
            return 1
    else:
        config_docs.write(text, Path(args.output))
        print(f"wrote {args.output}")
    return 0


def _run_bench(name: str, argv: list[str]) -> int:
    module_name, help_text = BENCHMARKS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"superinfer bench {name}", description=help_text)
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
