"""`superinfer bench matmul`: the weight layouts of the worker's CPU matmuls, side by side.

A step multiplies every layer's [rows, in] activations by its four weights (q/k/v, o, gate/up,
down). This times those matmuls for the model's shapes (random float32 weights of the real
sizes, so the bytes read per step are the model's) at each row count, in every layout the
worker's `Linear` can hold (services/worker/model.py):

- `panels`: the native kernel's 16-column panels (AVX-512 machines only);
- `bf16x3`: the native AMX kernel's split bfloat16 tiles (machines with AMX only);
- `onednn`: the copy packed once for oneDNN;
- `in_out`: a contiguous [in, out] copy multiplied by torch (MKL's GEMM/GEMV);
- `q8_0`, `q4_1`: the weights quantized and kept packed (csrc/quant_matmul.c: int8 activations,
  AVX512-VNNI where present); `bf16`: bfloat16 weights on vdpbf16ps (AVX512-BF16 machines only);
  `torch_bf16`: the same bfloat16 weights through torch's own GEMM (oneDNN), as vLLM's CPU build
  runs a bfloat16 model.
  These are checked against the dequantized weights' product (they round the activations).

The layouts alternate within every repetition, so a machine whose speed drifts slows them
alike; each figure is the median of `--reps` repetitions, ms per step (all layers). Every
layout's product is checked against torch's on the first layer first.

    superinfer bench matmul --json bench/results/matmul_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from services.worker import cpu_kernels, cpu_quant
from services.worker.model import _onednn_pack
from shared.modelfile import read_model_config, resolve_model_path

DEFAULT_ROWS = "1,2,4,8,12,16,32,64,128,256,512"


def layer_shapes(model: str | None) -> tuple[list[tuple[int, int]], int]:
    """([out, in] of one layer's four matmuls, number of layers) of the model."""
    cfg = read_model_config(resolve_model_path(model))
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = [
        (qkv, cfg.hidden_size),
        (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
        (2 * cfg.intermediate_size, cfg.hidden_size),
        (cfg.hidden_size, cfg.intermediate_size),
    ]
    return shapes, cfg.num_layers


def layouts(weights: list[torch.Tensor]) -> dict[str, Callable[[list[torch.Tensor]], None]]:
    """name -> a function multiplying each activation by its weight, in that layout."""
    out: dict[str, Callable[[list[torch.Tensor]], None]] = {}
    native = cpu_kernels.kernels()
    panels = [native.pack_panels(w) for w in weights] if native is not None else []
    if panels and all(p is not None for p in panels):
        out["panels"] = lambda xs: [native.linear(x, p, None) for x, p in zip(xs, panels)]
    tiles = [native.pack_bf16x3(w) for w in weights] if native is not None else []
    if tiles and all(t is not None for t in tiles):
        out["bf16x3"] = lambda xs: [native.linear_bf16x3(x, t, None) for x, t in zip(xs, tiles)]
    packed = [_onednn_pack(w) for w in weights]
    if all(p is not None for p in packed):
        linear = torch.ops.mkldnn._linear_pointwise
        out["onednn"] = lambda xs: [linear(x, p, None, "none", [], "") for x, p in zip(xs, packed)]
    in_out = [w.t().contiguous() for w in weights]
    out["in_out"] = lambda xs: [x @ w for x, w in zip(xs, in_out)]
    return out


def quant_layouts(weights: list[torch.Tensor]) -> dict[str, tuple[Callable, list[torch.Tensor]]]:
    """name -> (the packed weights' matmuls, the dequantized weights they stand for)."""
    out = {}
    for kind in ("q8_0", "q4_1", "bf16"):
        quantized = [cpu_quant.QuantWeight.quantize(w, kind) for w in weights]
        packed = [cpu_quant.pack(q) for q in quantized]
        if all(p is not None for p in packed):
            fn = lambda xs, packed=packed: [cpu_quant.linear(x, p, None) for x, p in zip(xs, packed)]  # noqa: E731
            out[kind] = (fn, [q.dequantize() for q in quantized[:4]])
    # torch's own bfloat16 GEMM (oneDNN on CPUs with AVX512-BF16): what a bfloat16 model's
    # matmuls cost in vLLM's CPU build, beside our bf16 kernel. Its activations are bfloat16 there
    # already, so they are converted once per set of inputs, outside the timing.
    bf16 = [w.bfloat16() for w in weights]
    held: list = [None, None]  # the last float inputs and their bfloat16 copies

    def torch_bf16(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        if held[0] is not xs:
            held[:] = [xs, [x.bfloat16() for x in xs]]
        return [torch.nn.functional.linear(x, w) for x, w in zip(held[1], bf16)]

    out["torch_bf16"] = (torch_bf16, [w.float() for w in bf16[:4]])
    return out


def check(first_layer: list[torch.Tensor], shapes: list[tuple[int, int]]) -> None:
    """Every layout computes x @ W^T (one layer's weights, 5 rows)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, k, generator=gen) for _, k in shapes]
    want = [x @ w.T for x, w in zip(xs, first_layer)]
    for name, fn in layouts(first_layer).items():
        for got, ref in zip(fn(xs), want):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    for name, (fn, dequantized) in quant_layouts(first_layer).items():
        for got, x, w in zip(fn(xs), xs, dequantized):
            ref = x @ w.T
            assert (got - ref).abs().max() <= 0.025 * ref.abs().max(), name  # int8 / bf16 activations


def run(args: argparse.Namespace) -> int:
    shapes, num_layers = layer_shapes(args.model)
    num_layers = args.layers or num_layers
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(shape, generator=gen) * 0.02 for _ in range(num_layers) for shape in shapes]
    check(weights[: len(shapes)], shapes)
    fns = layouts(weights) | {name: fn for name, (fn, _) in quant_layouts(weights).items()}
    rows_list = [int(r) for r in args.rows.split(",")]
    ms: dict[str, dict[int, float]] = {name: {} for name in fns}
    for rows in rows_list:
        xs = [torch.randn(rows, k, generator=gen) for _ in range(num_layers) for _, k in shapes]
        times: dict[str, list[float]] = {name: [] for name in fns}
        for rep in range(args.reps + 1):  # the first is a warm-up
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(xs)
                if rep:
                    times[name].append(time.perf_counter() - t0)
        for name in fns:
            ms[name][rows] = statistics.median(times[name]) * 1e3
    result = {
        "setup": {
            "shapes_out_in": shapes,
            "num_layers": num_layers,
            "threads": torch.get_num_threads(),
            "reps": args.reps,
            "torch": torch.__version__,
        },
        "ms_per_step": {name: {str(r): round(v, 3) for r, v in by_rows.items()} for name, by_rows in ms.items()},
    }
    print(format_table(ms, rows_list))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def format_table(ms: dict[str, dict[int, float]], rows_list: list[int]) -> str:
    names = list(ms)
    lines = [f"{'rows':>6}" + "".join(f"{n:>11}" for n in names) + "   ms per step, all layers"]
    for rows in rows_list:
        lines.append(f"{rows:>6}" + "".join(f"{ms[n][rows]:>11.1f}" for n in names))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF or HF directory whose shapes to use (default: bundled)")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma list of row counts (default {DEFAULT_ROWS})")
    parser.add_argument("--layers", type=int, default=None, help="layers to time (default: the model's)")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per row count (median quoted)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
