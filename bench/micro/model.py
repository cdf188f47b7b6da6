"""`superinfer bench model`: our worker's model runner vs transformers, same weights, same run.

Three points: prefill tokens/s for one long prompt, and decode step time at batch 1 and
batch 16. Ours and transformers alternate within every repetition, so a noisy machine
slows both alike; each figure is the median over repetitions (decode: over all steps of
all repetitions).

What is timed on the transformers side:
- prefill: `generate(max_new_tokens=1)` (prefill + the first greedy token), as ours
  (one `execute` that prefills and samples the first token);
- decode: its forward with its own KV cache (`DynamicCache`) plus the argmax, one call per
  step: the model's step without `generate`'s per-step bookkeeping, the stricter baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.model import LlamaModel
from services.worker.runner import ModelRunner, allocate_kv_pool
from services.worker.weights import load_weights
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE
from shared.modelfile import ModelConfig, read_model_config, resolve_model_path
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest


def transformers_model(cfg: ModelConfig, weights: dict[str, torch.Tensor]):
    """transformers' own implementation of the architecture, holding exactly `weights`."""
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
    )
    with _skip_random_init():
        if cfg.attention_bias:  # Qwen2: biases on q/k/v only (Llama's flag would add one to o_proj)
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    state = dict(weights)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def _skip_random_init():
    """transformers' `no_init_weights` (its module moved between versions): every weight is
    overwritten by load_state_dict, so random init would only cost seconds."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length")
    parser.add_argument("--context-len", type=int, default=128, help="prompt length before decode steps")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (steadier on a shared machine, CPU only)",
    )


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    cfg = read_model_config(path)
    weights = load_weights(path, cfg)
    device = torch.device(args.device)
    ours = LlamaModel(cfg, weights, device=device).eval()
    theirs = transformers_model(cfg, weights).to(device)
    gen = torch.Generator().manual_seed(0)
    timer = Timer(device, time.process_time if args.clock == "cpu" else time.perf_counter)
    results = {
        "prefill_tok_s": _prefill(ours, theirs, cfg, timer, args, gen),
        "decode_ms_b1": _decode(ours, theirs, cfg, timer, args, gen, batch=1),
        "decode_ms_b16": _decode(ours, theirs, cfg, timer, args, gen, batch=16),
    }
    results["speedup"] = speedups(results)
    results["setup"] = _setup(cfg, device, args)
    print(format_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def speedups(results: dict) -> dict[str, float]:
    """>1 means ours is faster: a throughput ratio for prefill, a time ratio for decode."""
    p, d1, d16 = results["prefill_tok_s"], results["decode_ms_b1"], results["decode_ms_b16"]
    return {
        "prefill_tok_s": p["ours"] / p["transformers"],
        "decode_ms_b1": d1["transformers"] / d1["ours"],
        "decode_ms_b16": d16["transformers"] / d16["ours"],
    }


def format_table(results: dict) -> str:
    rows = [f"{'metric':<16}{'ours':>12}{'transformers':>14}{'speedup':>9}"]
    for key in ("prefill_tok_s", "decode_ms_b1", "decode_ms_b16"):
        r = results[key]
        rows.append(f"{key:<16}{r['ours']:>12.1f}{r['transformers']:>14.1f}{results['speedup'][key]:>8.2f}x")
    return "\n".join(rows)


# ---------------------------------------------------------------- measurements


@dataclass
class Timer:
    device: torch.device
    clock: Callable[[], float]

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.clock()

    def time(self, fn) -> float:
        t0 = self.now()
        fn()
        return self.now() - t0


def _prefill(ours, theirs, cfg, timer: Timer, args, gen) -> dict[str, float]:
    device = timer.device
    prompt = _random_prompt(cfg, args.prompt_len, gen)
    runner = _runner(ours, cfg, device, num_tokens=args.prompt_len + 1, batch=1)
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)  # explicit: a random prompt may hold the pad id
    ours_s, theirs_s = [], []
    for rep in range(args.repeats + 1):  # the first repetition warms up
        rid = f"p{rep}"
        runner.add_requests([_greedy_request(rid, prompt)])
        step = [ScheduledRequest(rid, 0, len(prompt), block_table=_table(0, len(prompt) + 1))]
        t_ours = timer.time(lambda: runner.execute(step))
        runner.drop([rid])
        with torch.inference_mode():
            t_theirs = timer.time(
                lambda: theirs.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
            )
        if rep:
            ours_s.append(t_ours)
            theirs_s.append(t_theirs)
    n = len(prompt)
    return {"ours": n / statistics.median(ours_s), "transformers": n / statistics.median(theirs_s)}


def _decode(ours, theirs, cfg, timer: Timer, args, gen, batch: int) -> dict[str, float]:
    from transformers import DynamicCache

    device = timer.device
    prompts = [_random_prompt(cfg, args.context_len, gen) for _ in range(batch)]
    max_len = args.context_len + args.decode_steps + 1
    runner = _runner(ours, cfg, device, num_tokens=max_len, batch=batch)
    blocks_per_req = -(-max_len // BLOCK_SIZE)
    ours_ms, theirs_ms = [], []
    for rep in range(args.repeats + 1):
        rids = [f"d{rep}-{i}" for i in range(batch)]
        runner.add_requests([_greedy_request(rid, p) for rid, p in zip(rids, prompts)])
        runner.execute(
            [
                ScheduledRequest(rid, 0, len(p), block_table=_table(i * blocks_per_req, max_len))
                for i, (rid, p) in enumerate(zip(rids, prompts))
            ]
        )
        with torch.inference_mode():
            cache = {_cache_kwarg(theirs): DynamicCache()}
            out = theirs(torch.tensor(prompts, device=device), use_cache=True, **cache)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        for _ in range(args.decode_steps):
            n = len(runner.token_ids(rids[0]))
            step = [ScheduledRequest(rid, n - 1, 1) for rid in rids]
            t_ours = timer.time(lambda: runner.execute(step))
            with torch.inference_mode():
                t0 = timer.now()
                out = theirs(next_ids, use_cache=True, **cache)
                next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
                t_theirs = timer.now() - t0
            if rep:
                ours_ms.append(t_ours * 1e3)
                theirs_ms.append(t_theirs * 1e3)
        runner.drop(rids)
    return {"ours": statistics.median(ours_ms), "transformers": statistics.median(theirs_ms)}


def _cache_kwarg(model) -> str:
    """The KV-cache argument's name: `cache` in recent transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _runner(model, cfg, device, num_tokens: int, batch: int) -> ModelRunner:
    num_blocks = batch * -(-num_tokens // BLOCK_SIZE)
    pool = allocate_kv_pool(cfg, num_blocks, BLOCK_SIZE, torch.float32, device)
    return ModelRunner(model, cfg, pool, BLOCK_SIZE, device)


def _table(first_block: int, num_tokens: int) -> list[int]:
    return list(range(first_block, first_block + -(-num_tokens // BLOCK_SIZE)))


def _greedy_request(rid: str, prompt: list[int]) -> NewRequestData:
    return NewRequestData(rid, prompt, SamplingParams(max_tokens=1 << 20, temperature=0.0))


def _random_prompt(cfg: ModelConfig, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()


def _setup(cfg: ModelConfig, device: torch.device, args) -> dict:
    import transformers

    return {
        "model": cfg.name,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "context_len": args.context_len,
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "clock": args.clock,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
