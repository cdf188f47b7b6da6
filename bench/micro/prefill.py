"""`superinfer bench prefill`: one prefill step of the worker's model, ms, and where they go.

The model is built as the worker builds it for `--dtype` (auto: a quantized GGUF served packed
where the quantized matmul runs vectorised; float32: every matrix dequantized), over a KV pool of
the type the worker would give it, and one `--prompt-len` prompt is prefilled through the model
runner (`ModelRunner.execute`, the step a served request's first token comes from), `--repeats`
times after a warm-up. Each figure is the median over repetitions.

The breakdown times each call of the model's seams (model.py's imports of them): every Linear by
matrix and layout, attention (write_kv apart), rope, the norms; "rest" is the step less their sum
(embedding, rope angles, metadata, sampling, Python). Timing a call adds a clock read either side
of it, ~1 us, some 300 of them a step.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from services.worker import model as model_module
from services.worker import weights_cache
from services.worker.runner import ModelRunner, allocate_kv_pool
from services.worker.service import resolve_dtype, resolve_kv_dtype
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE
from shared.modelfile import resolve_model_path
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest

SEAMS = ("paged_attention", "write_kv", "rope_", "add_rms_norm_")  # model.py's names, timed per call
MATRICES = ("qkv", "o_proj", "gate_up", "down")  # DecoderLayer's Linear attributes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    parser.add_argument("--dtype", default="auto", help="the worker's --dtype: auto, float32, gguf, ... (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    device = torch.device("cpu")
    weights = resolve_dtype(args.dtype, device, path)
    model, cfg = weights_cache.load_model(path, device, weights)
    num_tokens = args.prompt_len
    table = list(range(-(-(num_tokens + 1) // BLOCK_SIZE)))
    pool = allocate_kv_pool(cfg, len(table), BLOCK_SIZE, resolve_kv_dtype("auto", weights), device)
    runner = ModelRunner(model, cfg, pool, BLOCK_SIZE, device)
    prompt = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    steps: list[float] = []
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for rep in range(args.repeats + 1):  # the first repetition warms up
        rid = f"p{rep}"
        runner.add_requests([NewRequestData(rid, prompt, SamplingParams(max_tokens=1 << 20, temperature=0.0))])
        with timed_seams(model) as spent:
            t0 = time.perf_counter()
            runner.execute([ScheduledRequest(rid, 0, num_tokens, block_table=table)])
            step = time.perf_counter() - t0
        runner.drop([rid])
        if rep:
            steps.append(step * 1e3)
            spent["rest"] = step - sum(spent.values())
            for name, s in spent.items():
                parts[name].append(s * 1e3)
    results = {
        "step_ms": statistics.median(steps),
        "parts_ms": {name: statistics.median(ms) for name, ms in sorted(parts.items(), key=lambda kv: -sum(kv[1]))},
        "setup": {"model": cfg.name, "dtype": str(weights), "kv": str(pool.dtype), "threads": torch.get_num_threads(),
                  "prompt_len": num_tokens, "repeats": args.repeats},
    }  # fmt: skip
    print(format_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def format_table(results: dict) -> str:
    setup = results["setup"]
    step = results["step_ms"]
    rows = [f"{setup['model']}, {setup['prompt_len']}-token prefill, weights {setup['dtype']}, KV {setup['kv']}, "
            f"{setup['threads']} threads: {step:.1f} ms (median of {setup['repeats']})"]  # fmt: skip
    rows += [f"  {name:<28}{ms:9.1f} ms {100 * ms / step:5.1f}%" for name, ms in results["parts_ms"].items()]
    return "\n".join(rows)


@contextlib.contextmanager
def timed_seams(model: model_module.LlamaModel):
    """Yields a dict that fills, while open, with the seconds spent in each of the model's seams
    and in each Linear (by matrix and layout: "gate_up (q4_1)", "qkv (packed)")."""
    spent: dict[str, float] = collections.defaultdict(float)
    names = {id(getattr(layer, m)): m for layer in model.layers for m in MATRICES}
    names[id(model.lm_head)] = "lm_head"
    seams = {name: getattr(model_module, name) for name in SEAMS}
    linear_forward = model_module.Linear.forward

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name.rstrip("_")] += time.perf_counter() - t0
            return out

        return call

    def linear(self, x):
        layout = self.quant.kind if self.quant is not None else self._layout(x.shape[0])
        return timed(f"{names.get(id(self), 'linear')} ({layout})", linear_forward)(self, x)

    for name, fn in seams.items():
        setattr(model_module, name, timed(name, fn))
    model_module.Linear.forward = linear
    try:
        yield spent
    finally:
        for name, fn in seams.items():
            setattr(model_module, name, fn)
        model_module.Linear.forward = linear_forward
