"""The options of each service, shared by `superinfer` (cli.py) and `superinfer serve`'s
supervisor, which re-renders them for its children. The scheduler's knobs are generated from
`SchedulerConfig`'s fields: their defaults and help are written there, once. vLLM's names
are accepted as aliases where the meaning is the same; the first name of an option is ours,
the one the supervisor passes on.
"""

from __future__ import annotations

import argparse
import os

from services.gateway.routing import DEFAULT_ROUTING, ROUTINGS
from services.scheduler.core import SchedulerConfig
from shared import config


# SchedulerConfig field -> vLLM's flag for the same knob.
VLLM_NAMES = {"max_batched_tokens": "--max-num-batched-tokens"}


def config_flags(g) -> None:
    """`--field-name` for every flag field of SchedulerConfig, typed and defaulted by the field
    (a bool as `--field-name`/`--no-field-name`)."""
    for f in SchedulerConfig.flag_fields():
        names = ["--" + f.name.replace("_", "-")] + ([VLLM_NAMES[f.name]] if f.name in VLLM_NAMES else [])
        if isinstance(f.default, bool) or f.metadata.get("type") is bool:
            kw = {k: v for k, v in f.metadata.items() if k != "type"}  # a bool whose default is None names it
            g.add_argument(*names, action=argparse.BooleanOptionalAction, default=f.default, **kw)
        else:  # a field whose default is None names its type
            kw = {"type": type(f.default), **f.metadata}
            g.add_argument(*names, default=f.default, **kw)


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or Hugging Face-style directory (config.json + safetensors); "
        "default: the bundled SmolLM2-135M-Instruct",
    )


def gateway_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway (HTTP API)")
    g.add_argument("--host", default=config.DEFAULT_HOST, help="address to bind (default %(default)s)")
    g.add_argument("--port", type=int, default=config.DEFAULT_PORT, help="HTTP port (default %(default)s)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize; better set "
        f"${config.API_KEY_ENV} (or ${config.VLLM_API_KEY_ENV}): a command line is visible to every local user",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name(s) in /v1/models and responses; requests must name one of them "
        "(default: the model's own name)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        default=None,
        help="how tools are written into chat prompts and tool calls read from the model's text "
        "(vLLM's names; default: the chat template's own format, hermes where it has none)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="makes the seeds of requests that give none reproducible: they are drawn in arrival "
        "order from a generator seeded with this (default: random)",
    )
    g.add_argument(
        "--failover-grace",
        type=float,
        default=config.DEFAULT_FAILOVER_GRACE_S,
        metavar="S",
        help="how long a request whose scheduler was lost waits for another one before it fails "
        "(default %(default)s)",
    )
    g.add_argument(
        "--routing",
        choices=ROUTINGS,
        default=DEFAULT_ROUTING,
        help="how a new request picks its scheduler: cache-aware (the lowest predicted TTFT, counting "
        "the prompt prefix each one holds in HBM or DRAM, among those with SLO headroom; a session, the "
        "`user` field or an x-session-id header, stays where it was while that one has headroom), "
        "headroom (the most SLO headroom), or round-robin (default %(default)s)",
    )


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the environment's (ours, then vLLM's); None when none is set."""
    return args.api_key or os.environ.get(config.API_KEY_ENV) or os.environ.get(config.VLLM_API_KEY_ENV) or None


def scheduler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler (RotaSched)")
    config_flags(g)
    g.add_argument(
        "--pipeline-depth",
        type=int,
        choices=config.PIPELINE_DEPTHS,
        default=None,
        help="plans in flight at the worker: 2 builds step t+1 while t computes, 1 waits for each result "
        "(default: 1 on a CPU worker, 2 on a GPU)",
    )
    g.add_argument("--step-trace", default=None, metavar="PATH", help="append one JSON line per step to PATH")
    g.add_argument(
        "--step-timeout",
        type=float,
        default=2.0,
        help="a step result later than max(this, 10 x median recent step, 2 x slowest recent step) "
        "means the worker is lost; its requests resume on the next worker (default %(default)s s)",
    )
    g.add_argument(
        "--worker-wait",
        type=float,
        default=config.DEFAULT_WORKER_WAIT_S,
        metavar="S",
        help="how long a request is held while no worker is ready (one restarting, say) before it "
        "fails with an error naming the lost worker (default %(default)s)",
    )


def admin_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler admin socket and metrics")
    g.add_argument(
        "--admin-bind",
        default=config.DEFAULT_ADMIN_ADDR,
        help="the scheduler's admin socket for `superinfer queues|top|stats|abort|drain`; "
        "'off' disables it (default %(default)s)",
    )
    g.add_argument(
        "--metrics-port", type=int, default=None, help="serve the scheduler's Prometheus /metrics on this port"
    )
    g.add_argument("--metrics-host", default=config.DEFAULT_HOST, help="its address (default %(default)s)")


def admin_token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin-token",
        default=None,
        help=f"token that abort/drain must present (or ${config.ADMIN_TOKEN_ENV}); without one they are refused",
    )


def worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker (model + DuplexKV)")
    g.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when available)")
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16", "gguf", "q8_0", "q4_0", "q4_1"],
        default="auto",
        help="weights (and KV cache, see --kv-cache-dtype): auto is bfloat16 on CUDA; on CPU gguf for a "
        "quantized GGUF where the int8 kernels run (AVX512-VNNI) and one rank holds the model, else float32; "
        "gguf serves a quantized GGUF's own format on CPU (its matrices kept packed, int8 activations, "
        "attention batch-invariant so that a recomputed token is the decoded one); q8_0/q4_0/q4_1 quantize "
        "the matrices at load (CPU; activations float32); bfloat16 on a CPU with AVX512-BF16: bfloat16 "
        "matrices, float32 activations (default %(default)s)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the KV cache's element type: auto is the weights' (bfloat16 for --dtype bfloat16 and the "
        "quantized ones, else float32); bfloat16 holds twice the tokens in the same memory and halves "
        "what a decode step reads of it, at a rounding of keys and values (default %(default)s)",
    )
    g.add_argument(
        "--hbm-blocks",
        type=int,
        default=None,
        help="KV blocks in the compute-device pool (default: from --hbm-fraction)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context window (prompt + output tokens) at most this; no more than the model's "
        "(default: the model's, or what the KV pool holds if less)",
    )
    g.add_argument(
        "--hbm-fraction",
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="when --hbm-blocks is not given: on GPU, the share of device memory in use once the "
        "KV pool is allocated, weights included (vLLM's meaning, though memory others hold on the "
        "device counts too); on CPU, the share of available RAM for the KV pool "
        "(default 0.9 on GPU, 0.25 on CPU)",
    )
    g.add_argument("--dram-gb", type=float, default=2.0, help="host-memory KV pool size in GiB (default %(default)s)")
    g.add_argument(
        "--kv-prefault",
        action="store_true",
        help="write the KV pools once at start so host memory is resident from the first request "
        "(seconds per GiB on a CPU; device and pinned memory always are)",
    )
    g.add_argument(
        "--require-native",
        action="store_true",
        help="on a CPU, refuse to start unless the native kernels (C, AVX-512) are built and load: without "
        "them every step runs on the torch path, 5-10x slower (a C compiler and `superinfer kernels build`)",
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
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="tensor-parallel ranks (torch.distributed: gloo on CPU, NCCL with one GPU per rank); "
        "must divide the model's KV heads (default %(default)s)",
    )
