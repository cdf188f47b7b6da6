"""The model sizes people serve (bench/models/synth.py: Llama-3.2-1B, Qwen2.5-1.5B, Llama-3.2-3B
shapes, seeded random weights, two layers here): the writer's GGUFs and HF folder load as the
server loads them, and at every shape the fused native decode step, the layer-by-layer step, the
prefill and transformers' torch implementation give the same greedy tokens, in float32, bfloat16
and the GGUF quantizations. The shapes cover GQA ratios 4 and 6 and head dims 64 and 128."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.live.server import REPO
from bench.micro.model import transformers_model
from bench.models import synth
from services.worker import cpu_kernels, cpu_quant
from services.worker.attention import build_metadata
from services.worker.model import LlamaModel
from services.worker.runner import ModelRunner, allocate_kv_pool
from services.worker.service import build_worker
from services.flags import worker_args
from services.worker.weights import expected_names, gguf_quantization, load_weights, unpermute_rope_rows
from shared.modelfile import read_model_config

from .conftest import BLOCK_SIZE, generate_together, greedy

LAYERS = 2
NEW_TOKENS = 8
PROMPT = [1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # 16 ids
# file -> what the worker serves it as (load_weights' quant): packed quantized, float32, bfloat16.
FORMATS = {"Q4_1": "gguf", "Q8_0": "gguf", "F16": None, "hf": "bf16"}


def test_the_shapes_cover_gqa_ratios_4_and_6_and_head_dims_64_and_128():
    shapes = synth.SHAPES.values()
    assert {s.heads // s.kv_heads for s in shapes} >= {4, 6}
    assert {s.head_dim for s in shapes} == {64, 128}
    assert synth.SHAPES["qwen2.5-1.5b"].qkv_bias and synth.SHAPES["qwen2.5-1.5b"].arch == "qwen2"


@pytest.mark.parametrize("shape", sorted(synth.SHAPES))
def test_config_and_tensor_plan_are_what_the_loader_expects(shape, tmp_path):
    s = synth.SHAPES[shape]
    (tmp_path / "config.json").write_text(json.dumps(synth.hf_config(shape, s, 49152, 1, 2)))
    cfg = read_model_config(tmp_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim
    )  # fmt: skip
    assert (cfg.intermediate_size, cfg.attention_bias, cfg.tie_embeddings, cfg.rope_theta) == (
        s.mlp, s.qkv_bias, s.tied, s.rope_theta
    )  # fmt: skip
    plan = synth.tensors(s, 49152)
    assert {t.hf for t in plan} == expected_names(cfg)
    shapes = {t.hf: t.shape for t in plan}
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (s.kv_heads * s.head_dim, s.hidden)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (s.hidden, s.mlp)


def test_rope_row_permutation_is_the_loaders_inverse():
    w = torch.arange(8 * 64 * 3, dtype=torch.float32).reshape(8 * 64, 3)
    permuted = synth.permute_rope_rows(w, 8)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rope_rows(permuted, 8), w)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_quantizer_writes_the_bytes_of_ggufs_own(kind):
    """The writer's torch quantizer against gguf.quants (llama.cpp's reference rounding), with an
    all-zero block and a constant one."""
    from gguf import GGMLQuantizationType, quants

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    x[0, :32], x[1, :32] = 0.0, 0.5
    want = quants.quantize(x.numpy(), GGMLQuantizationType[kind])
    assert np.array_equal(synth.quantize(x, kind).numpy(), want)
    assert np.array_equal(synth.encode(x, GGMLQuantizationType[kind]), want)


# ---------------------------------------------------------------- written models (slow)


@pytest.fixture(scope="module")
def written():
    """shape -> {"Q4_1": path, "Q8_0": path, "F16": path, "hf": path}, each shape written once and
    kept under bench/results/models/test/ for the next run, keyed by the writer's own source (a
    change to it writes them again): ~1-3 min a shape on two idle cores."""
    key = hashlib.sha256(Path(synth.__file__).read_bytes()).hexdigest()[:12]
    done: dict[str, dict] = {}

    def get(shape: str) -> dict:
        if shape not in done:
            out = REPO / "bench" / "results" / "models" / "test" / f"{shape}-{LAYERS}l-{key}"
            stamp = out / "written.json"
            if not stamp.is_file():
                shutil.rmtree(out, ignore_errors=True)
                paths = synth.synthesize(shape, out, layers=LAYERS)
                stamp.write_text(json.dumps({**paths["gguf"], "hf": paths["hf"]}))
            done[shape] = json.loads(stamp.read_text())
        return done[shape]

    return get


def _path(written, shape, fmt) -> Path:
    return Path(written(shape)[fmt])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first run writes the models
@pytest.mark.parametrize("shape", sorted(synth.SHAPES))
def test_every_file_describes_the_shape_and_holds_the_same_model(shape, written):
    """Config from each file; the F16 GGUF's weights are the HF folder's bfloat16 ones (q/k rows
    back in HF order), the quantized ones that model within their rounding."""
    s = synth.SHAPES[shape]
    reference = None
    for fmt in ("hf", "F16", "Q8_0", "Q4_1"):
        path = _path(written, shape, fmt)
        cfg = read_model_config(path)
        assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size) == (
            LAYERS, s.heads, s.kv_heads, s.head_dim, s.hidden
        )  # fmt: skip
        assert (cfg.vocab_size, cfg.attention_bias, cfg.tie_embeddings) == (49152, s.qkv_bias, s.tied)
        assert gguf_quantization(path) == {"Q8_0": "q8_0", "Q4_1": "q4_1"}.get(fmt)
        weights = load_weights(path, cfg)
        if reference is None:
            reference = weights
            continue
        tolerance = {"F16": 1e-3, "Q8_0": 0.02, "Q4_1": 0.2}[fmt]  # of each matrix's norm
        for name, want in reference.items():
            got = weights[name]
            assert torch.isfinite(got).all(), name
            assert (got - want).norm() <= tolerance * want.norm(), (fmt, name)


def _worker_args(path, dtype: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_args(parser)
    args = parser.parse_args(["--device", "cpu", "--dtype", dtype, "--hbm-blocks", "16", "--dram-gb", "0.01"])
    args.model, args.worker_id = str(path), "w"
    return args


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first run writes the models
@pytest.mark.parametrize("fmt, dtype", [("Q4_1", "auto"), ("Q8_0", "auto"), ("F16", "auto"), ("hf", "bfloat16")])
def test_the_worker_loads_each_file_as_the_server_does(fmt, dtype, written):
    """build_worker, what `superinfer worker`/`serve` runs: the quantized GGUFs served packed."""
    path = _path(written, "llama-3.2-1b", fmt)
    runner, engine, ready = build_worker(_worker_args(path, dtype), torch.device("cpu"))
    try:
        assert ready.vocab_size == 49152 and len(runner.model.layers) == LAYERS
        packed = runner.model.layers[0].qkv.quant
        if fmt.startswith("Q") and cpu_quant.quant_fast():
            assert packed is not None and packed.kind == fmt.lower()
        if fmt == "hf" and cpu_quant.bf16_fast():
            assert packed is not None and packed.kind == "bf16"
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first run writes the models
def test_a_wrong_head_dim_is_refused_at_load(written, tmp_path):
    """A config whose head_dim does not match the tensors fails at load with the shapes, not at
    the first forward with garbage."""
    src = _path(written, "llama-3.2-1b", "hf")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "head_dim": 128}))
    with pytest.raises(ValueError, match="q/k shapes"):
        load_weights(bad, read_model_config(bad))


def _generate(model, cfg, fused: bool) -> list[int]:
    """Greedy tokens through ModelRunner: one prefill step, then decode steps, fused or layer by layer."""
    pool = allocate_kv_pool(cfg, 8, BLOCK_SIZE, torch.float32, "cpu")
    model.fused_decode = fused
    try:
        return generate_together(ModelRunner(model, cfg, pool, BLOCK_SIZE, "cpu"), [greedy("r", PROMPT)], NEW_TOKENS)[0]
    finally:
        model.fused_decode = True


def _prefill_logits(model, cfg, ids: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Logits [len(rows), V] of the given rows of one prefill of `ids`."""
    blocks = -(-len(ids) // BLOCK_SIZE)
    pool = allocate_kv_pool(cfg, blocks, BLOCK_SIZE, torch.float32, "cpu")
    meta = build_metadata([0], [len(ids)], [list(range(blocks))], BLOCK_SIZE, "cpu")
    return model(torch.tensor(ids), torch.arange(len(ids)), meta, pool, rows)


def _by_prefill(model, cfg, tokens: list[int]) -> list[int]:
    """Each of `tokens` recomputed in one prefill of the prompt and the tokens before the last."""
    rows = torch.arange(len(PROMPT) - 1, len(PROMPT) + len(tokens) - 1)
    return _prefill_logits(model, cfg, PROMPT + tokens[:-1], rows).argmax(dim=1).tolist()


def _by_transformers(cfg, weights, tokens: list[int]) -> list[int]:
    """transformers' torch implementation of the architecture, float32, the same weights."""
    hf = transformers_model(cfg, weights)
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=len(tokens), do_sample=False, min_new_tokens=len(tokens),
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first run writes the models
@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler for the native kernels")
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", sorted(synth.SHAPES))
def test_every_path_gives_the_same_greedy_tokens(shape, fmt, written):
    """The fused native decode step = the layers op by op = a prefill recomputing each token; in
    float32 and bfloat16 also = transformers on the same weights. The logits are finite and not
    degenerate."""
    quant = FORMATS[fmt]
    if quant == "bf16" and not cpu_quant.bf16_fast():
        quant = None  # no AVX512-BF16: its bfloat16 values in float32, as load_weights leaves them
    path = _path(written, shape, fmt)
    cfg = read_model_config(path)
    weights = load_weights(path, cfg, quant)
    model = LlamaModel(cfg, weights).eval()
    with torch.inference_mode():
        fused = _generate(model, cfg, fused=True)
        layers = _generate(model, cfg, fused=False)
        assert fused == layers, (fused, layers)
        assert _by_prefill(model, cfg, fused) == fused
    # Not degenerate: finite, neither flat nor one-hot, and the next token depends on the prompt
    # (a random model may well repeat one token once it is picked: tied embeddings favour it).
    with torch.inference_mode():
        prompts = [PROMPT, PROMPT[::-1], PROMPT[:7]]
        last = torch.stack([_prefill_logits(model, cfg, p, torch.tensor([len(p) - 1]))[0] for p in prompts])
    assert torch.isfinite(last).all()
    assert 1.0 < last.std(dim=1).min() and last.std(dim=1).max() < 16.0, last.std(dim=1)
    assert last.softmax(dim=1).max() < 0.9
    assert len(set(last.argmax(dim=1).tolist())) > 1
    if quant in (None, "bf16"):  # bfloat16's matrices are bfloat16 values; float32 holds them exactly
        floats = {n: (w.dequantize() if isinstance(w, cpu_quant.QuantWeight) else w) for n, w in weights.items()}
        assert _by_transformers(cfg, floats, fused) == fused
