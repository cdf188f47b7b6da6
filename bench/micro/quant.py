"""`superinfer bench quant`: what each weight precision costs in accuracy and what it buys in speed.

For every precision the worker serves on CPU (`--dtype`: float32, bfloat16 -- bfloat16 matrices
on AVX512-BF16 --, the GGUF's own quantization kept packed, and q8_0 / q4_0 / q4_1 quantized at
load), the same model file:

- greedy agreement with float32: `--prompts` chat prompts (the first human turns of ShareGPT
  conversations, chat-templated, cut at `--prompt-tokens`), `--tokens` greedy tokens each,
  generated in one batch; the share of tokens equal to float32's at the same position up to
  the first difference (a prompt counts in full only if it never diverges), and the share of
  prompts whose whole continuation is float32's;
- perplexity on a fixed text: the first `--ppl-tokens` tokens of the first ShareGPT answers,
  joined, scored in one prefill (next-token cross-entropy, exp of the mean);
- one-stream decode ITL: the median of `--steps` decode steps of one request at a
  `--context`-token context, with the bytes of weights a step reads (every layer matrix and
  the head, in the layout the worker holds), and the memory-bandwidth limit for those bytes:
  the time of one read of that many bytes, measured here in turns with the steps (a
  `--read-gb` GB buffer in huge pages, as the weights lie, read once a round by the kernels'
  streaming read and summed once by torch, on as many threads as the steps: the faster of the
  two medians) — the ITL no kernel could beat. ITL / limit pairs each step with its own
  round's read (the median of step / limit that round): the read here switches between ~33 and
  ~60 GB/s within seconds, and a run's median read may belong to other steps than its median
  step. Each round also times a cache line's trip between the two cores (~40 ns where they
  share a cache, ~170 where they do not: the host places them), and the ratio is given per
  placement and read too. Beside it the limit for the weights and the `--context` tokens of KV a step's attention
  reads too (K and V of every layer: ~24 MB at 512 tokens in float32, a quarter of the GGUF's
  packed weights; half that in bfloat16).

Each precision keeps its KV as the worker does by default (`--kv-cache-dtype auto`: bfloat16
beside the 16-bit and quantized matrices, float32 beside float32); `NAME:KV` (`gguf:float32`)
measures a precision with the KV in another dtype, beside the default in the same run.

The CPU may be shared: the precisions' ITLs are measured in turns, one step each, so a noisy
neighbour slows all alike; compare them as ratios of this run. Writes JSON (`--json`).

    superinfer bench quant --json bench/results/quant_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from services.worker import cpu_kernels
from services.worker.attention import build_metadata
from services.worker.host_memory import huge_page_host_tensor
from services.worker.model import LlamaModel, Linear
from services.worker.runner import ModelRunner, allocate_kv_pool, load_model
from services.worker.service import resolve_kv_dtype
from services.worker.weights import gguf_quantization
from shared.config import kv_block_bytes
from shared.modelfile import resolve_model_path
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest

BLOCK = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: the bundled model)")
    p.add_argument("--precisions", default="float32,bf16,gguf,q8_0,q4_0,q4_1",
                   help="comma-separated: float32; bf16 (bfloat16 matrices, float32 activations: what --dtype "
                   "bfloat16 serves on AVX512-BF16); bfloat16 (the whole model, torch ops); gguf (the file's "
                   "own quantization, kept packed); q8_0, q4_0, q4_1 (quantized at load); NAME:KV (gguf:float32) "
                   "with the KV in that dtype instead of the worker's default for NAME")  # fmt: skip
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompts cut to at most this many tokens")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--context", type=int, default=512, help="context of the timed decode steps")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per precision")
    p.add_argument("--read-gb", type=float, default=1.0, help="buffer read to time the memory bandwidth")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    names = [n.strip() for n in args.precisions.split(",") if n.strip()]
    if gguf_quantization(path) is None:
        names = [n for n in names if n.split(":")[0] != "gguf"]
    prompts, text = chat_prompts(path, args), fixed_text(path, args.ppl_tokens)
    results: dict = {"model": str(path), "threads": torch.get_num_threads(), "precisions": {}}
    reference, models = None, {}
    for name in names:  # each measured as soon as it is loaded
        t0 = time.perf_counter()
        weights, _, kv_name = name.partition(":")
        dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32 if weights == "float32" else weights
        kv = resolve_kv_dtype(kv_name or "auto", dtype)
        model, cfg = load_model(path, "cpu", dtype)
        models[name] = (model, cfg, kv)
        tokens = generate(model, cfg, prompts, args.tokens, kv)
        reference = reference or tokens
        out = results["precisions"][name] = {
            "kv_dtype": str(kv).removeprefix("torch."),
            "weight_bytes_per_step": step_weight_bytes(model),
            "perplexity": perplexity(model, cfg, text, kv),
            **agreement(tokens, reference),
        }
        print(f"{name}: agreement {out['token_agreement']:.3f}, ppl {out['perplexity']:.3f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    steps, round_gbps, round_ns, gbps, torch_gbps = decode_itl(models, cfg, args.context, args.steps, args.read_gb)
    results["read_gbps"], results["torch_sum_gbps"] = gbps, torch_gbps
    results["read_gbps_range"] = [min(round_gbps), max(round_gbps)]
    results["core_latency_ns_range"] = [min(round_ns), max(round_ns)]
    for name, out in results["precisions"].items():
        kv_bytes = kv_block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.context, models[name][2].itemsize)
        out["itl_ms"] = 1e3 * statistics.median(steps[name])
        out["kv_bytes_per_step"] = kv_bytes
        for key, num_bytes in (("", out["weight_bytes_per_step"]), ("_with_kv", out["weight_bytes_per_step"] + kv_bytes)):
            out["bandwidth_limit_ms" if not key else "limit_with_kv_ms"] = num_bytes / (gbps * 1e9) * 1e3
            out["itl_over_limit" + key] = over_limit(zip(steps[name], round_gbps), num_bytes)
        out["itl_over_limit_by_state"] = {
            state: over_limit(pairs, out["weight_bytes_per_step"])
            for state, pairs in by_state(steps[name], round_gbps, round_ns).items()
        }
    print(markdown(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


# ---------------------------------------------------------------- inputs


def chat_prompts(path: Path, args) -> list[list[int]]:
    from bench.live.workload import sharegpt_conversations
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    out = []
    for human, _ in sharegpt_conversations():
        ids = tok.encode_chat([{"role": "user", "content": human[:2000]}])
        if 8 <= len(ids) <= args.prompt_tokens:
            out.append(ids)
        if len(out) == args.prompts:
            return out
    return out


def fixed_text(path: Path, num_tokens: int) -> list[int]:
    from bench.live.workload import sharegpt_conversations
    from shared.tokenizer import load_tokenizer

    tok, ids = load_tokenizer(path), []
    for _, answer in sharegpt_conversations():
        ids += tok.encode(answer + "\n\n", add_special_tokens=False)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    return ids


# ---------------------------------------------------------------- accuracy


def generate(model: LlamaModel, cfg, prompts: list[list[int]], num_new: int, kv: torch.dtype) -> list[list[int]]:
    """Greedy continuations of every prompt, all in one batch (prefill, then a step per token),
    the KV in `kv`."""
    per = -(-(max(map(len, prompts)) + num_new) // BLOCK)
    runner = ModelRunner(model, cfg, allocate_kv_pool(cfg, per * len(prompts), BLOCK, kv, "cpu"), BLOCK, "cpu")
    rids = [str(i) for i in range(len(prompts))]
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0)
    runner.add_requests([NewRequestData(r, list(p), params) for r, p in zip(rids, prompts)])
    tables = {r: list(range(i * per, (i + 1) * per)) for i, r in enumerate(rids)}
    runner.execute([ScheduledRequest(r, 0, len(p), block_table=tables[r]) for r, p in zip(rids, prompts)])
    for _ in range(num_new - 1):
        runner.execute([ScheduledRequest(r, len(runner.token_ids(r)) - 1, 1) for r in rids])
    return [runner.token_ids(r)[len(p) :] for r, p in zip(rids, prompts)]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Tokens equal to the reference's up to each prompt's first difference, and whole matches."""
    same = 0
    for ours, ref in zip(tokens, reference):
        same += next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
    total = sum(map(len, reference))
    identical = sum(a == b for a, b in zip(tokens, reference))
    return {"token_agreement": same / total, "identical_prompts": identical / len(reference)}


@torch.inference_mode()
def perplexity(model: LlamaModel, cfg, ids: list[int], kv: torch.dtype) -> float:
    n = len(ids)
    pool = allocate_kv_pool(cfg, -(-n // BLOCK), BLOCK, kv, "cpu")
    meta = build_metadata([0], [n], [list(range(-(-n // BLOCK)))], BLOCK, "cpu")
    logits = model(torch.tensor(ids), torch.arange(n), meta, pool, torch.arange(n - 1))  # [n - 1, V]
    return math.exp(F.cross_entropy(logits.float(), torch.tensor(ids[1:])).item())


# ---------------------------------------------------------------- speed


def step_weight_bytes(model: LlamaModel) -> int:
    """Bytes of the matrices one decode step reads, as the model holds them (the fastest layout
    a one-row step uses; the embedding is a lookup of one row and not counted)."""
    total = 0
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        if m.quant is not None:
            total += m.quant.nbytes
            continue
        w = m.panels if m.panels is not None else m.weight if m.weight is not None else m.tiles
        total += w.numel() * w.element_size()
    return total


@torch.inference_mode()
def decode_itl(models: dict, cfg, context: int, steps: int, read_gb: float):
    """Seconds of each one-request decode step at `context` tokens per precision, the GB/s of each
    round's read of a `read_gb` GB buffer (far larger than the caches, in huge pages as the
    weights are: the faster of the kernels' streaming read and torch's sum that round), each
    round's core-to-core latency (ns; 0 without the kernels), and the median GB/s of each of the
    two reads. Measured in turns, a step of each precision and the
    reads each round, so that a step and the read beside it see the same machine: the read here
    switches between ~33 and ~60 GB/s within seconds (docs/benchmarks.md)."""
    blocks = -(-(context + steps + 1) // BLOCK)
    state = {}
    for name, (model, _, kv) in models.items():
        pool = allocate_kv_pool(cfg, blocks, BLOCK, kv, "cpu")
        ids = torch.randint(100, cfg.vocab_size - 100, (context,), generator=torch.Generator().manual_seed(0))
        meta = build_metadata([0], [context], [list(range(blocks))], BLOCK, "cpu")
        model(ids, torch.arange(context), meta, pool, torch.tensor([context - 1]))
        state[name] = (model, pool, [])
    buf = huge_page_host_tensor((int(read_gb * 1e9) // 64 * 16,), torch.float32).fill_(1.0)
    native = cpu_kernels.kernels()
    read = (lambda: native.read(buf)) if native is not None else buf.sum  # torch's twice without kernels
    reads, sums, round_ns = [], [], []
    table = list(range(blocks))
    for i in range(steps + 2):
        for name, (model, pool, times) in state.items():
            pos = context + i
            t = time.perf_counter()
            model.decode(pool, [7], [pos], [table], [0])  # as the runner steps decodes
            if i >= 2:  # two warm-up rounds
                times.append(time.perf_counter() - t)
        for f, out in ((read, reads), (buf.sum, sums)):
            t = time.perf_counter()
            f()
            if i >= 2:
                out.append(time.perf_counter() - t)
        if i >= 2:
            round_ns.append(native.core_latency_ns() if native is not None else 0.0)
    num_bytes = buf.numel() * 4
    round_gbps = [num_bytes / min(r, s) / 1e9 for r, s in zip(reads, sums)]
    native_gbps, torch_gbps = (num_bytes / statistics.median(r) / 1e9 for r in (reads, sums))
    times = {name: times for name, (_, _, times) in state.items()}
    return times, round_gbps, round_ns, max(native_gbps, torch_gbps), torch_gbps


def over_limit(pairs, num_bytes: int) -> float:
    """The median over (step seconds, read GB/s) pairs of each step over the limit at its own
    round's read: the time of reading `num_bytes` at that speed."""
    return statistics.median(t * g * 1e9 / num_bytes for t, g in pairs)


NEAR_NS = 100  # core-to-core latency below which the two cores share a cache


def by_state(times: list[float], round_gbps: list[float], round_ns: list[float]) -> dict[str, list[tuple[float, float]]]:
    """(step, read) pairs by the rounds' state: where the rounds saw both placements of the cores
    (sharing a cache or not, by the latency of a line between them), each placement's apart; and
    within each, where its reads' range is wide enough (1.3x) to hold two states, those below its
    midpoint and those at or above it. Keyed by placement and the reads' range ("cores apart, 58-66
    GB/s"); a group of fewer than 5 rounds is left out; {} where the run saw one state."""
    places: dict[str, list[tuple[float, float]]] = {}
    for t, g, ns in zip(times, round_gbps, round_ns):
        places.setdefault("cores apart" if ns >= NEAR_NS else "cores sharing a cache", []).append((t, g))
    states = {}
    for place, pairs in places.items():
        low, high = min(g for _, g in pairs), max(g for _, g in pairs)
        mid = (low + high) / 2 if high >= 1.3 * low else 0.0
        for side in ([p for p in pairs if p[1] < mid], [p for p in pairs if p[1] >= mid]):
            if len(side) >= 5:
                states[f"{place}, {min(g for _, g in side):.0f}-{max(g for _, g in side):.0f} GB/s"] = side
    return {} if [len(side) for side in states.values()] == [len(times)] else states


def markdown(results: dict) -> str:
    lines = [
        f"memory read: {results['read_gbps']:.1f} GB/s (torch's sum: {results['torch_sum_gbps']:.1f}; rounds "
        f"{results['read_gbps_range'][0]:.0f}-{results['read_gbps_range'][1]:.0f}), "
        f"{results['threads']} threads, a cache line between cores in {results['core_latency_ns_range'][0]:.0f}-"
        f"{results['core_latency_ns_range'][1]:.0f} ns",
        "| precision | KV | weights read per step (MB) | 1-stream ITL (ms) | bandwidth limit (ms) | ITL / limit "
        "| limit with the KV (ms) | ITL / that | greedy agreement | identical prompts | perplexity |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results["precisions"].items():
        lines.append(
            f"| {name.partition(':')[0]} | {r['kv_dtype']} | {r['weight_bytes_per_step'] / 1e6:.0f} | {r['itl_ms']:.2f} | {r['bandwidth_limit_ms']:.2f} | "
            f"{r['itl_over_limit']:.2f} | {r['limit_with_kv_ms']:.2f} | {r['itl_over_limit_with_kv']:.2f} | "
            f"{100 * r['token_agreement']:.1f}% | {100 * r['identical_prompts']:.0f}% | "
            f"{r['perplexity']:.3f} |"
        )
    states = {s for r in results["precisions"].values() for s in r.get("itl_over_limit_by_state", {})}
    for state in sorted(states):
        ratios = ", ".join(
            f"{name.partition(':')[0]} {r['itl_over_limit_by_state'][state]:.2f}"
            for name, r in results["precisions"].items()
            if state in r.get("itl_over_limit_by_state", {})
        )
        lines.append(f"ITL / limit in the rounds with the {state}: {ratios}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="superinfer bench quant", description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
