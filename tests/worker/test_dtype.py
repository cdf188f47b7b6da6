"""`--dtype`: weights and KV in bfloat16 or float16 (CUDA's default is bfloat16; CPU stays
float32 unless asked), and the KV block size the scheduler is told follows the dtype."""

from __future__ import annotations

import argparse

import pytest
import torch

from services.flags import worker_args
from services.worker import cpu_quant
from services.worker.attention import build_metadata
from services.worker.model import LlamaModel
from services.worker.runner import ModelRunner, allocate_kv_pool
from services.worker.service import build_worker, resolve_dtype
from shared.config import kv_block_bytes

from .conftest import BLOCK_SIZE, blocks_for, generate_together, greedy

# bfloat16 keeps 8 significant bits: logits of this model (about 20-30 at the top) are held
# to 0.125 steps there, and rounding through 30 layers moves them by a few tenths (0.33-0.62
# measured on the four chat prompts). The bound leaves room for other CPUs' kernels.
LOGIT_ATOL = 1.0


@pytest.fixture(scope="module")
def bf16_model(cfg, weights) -> LlamaModel:
    return LlamaModel(cfg, weights, dtype=torch.bfloat16).eval()


def test_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert resolve_dtype("float32", torch.device("cuda", 0)) == torch.float32


def test_auto_serves_the_gguf_packed_on_cpu(model_path):
    """The bundled Q4_1 file: served as it is on a CPU with the int8 kernels (one rank; float32
    without them or under tensor parallelism), bfloat16 on CUDA; names of quantizations pass
    through; bfloat16 on CPU is bfloat16 matrices where the CPU has vdpbf16ps."""
    packed = "gguf" if cpu_quant.quant_fast() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu"), model_path) == packed
    assert resolve_dtype("auto", torch.device("cpu"), model_path, ranks=2) == torch.float32
    assert resolve_dtype("gguf", torch.device("cpu"), model_path) == "gguf"
    with pytest.raises(ValueError, match="quantized GGUF"):
        resolve_dtype("gguf", torch.device("cpu"))
    assert resolve_dtype("auto", torch.device("cuda", 0), model_path) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu"), model_path) == torch.float32
    assert resolve_dtype("q8_0", torch.device("cpu"), model_path) == "q8_0"
    want = "bf16" if cpu_quant.bf16_fast() else torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu"), model_path) == want


def last_logits(model: LlamaModel, cfg, prompt: list[int]) -> torch.Tensor:
    """[V] float32 logits of the prompt's last row, from a prefill over a fresh pool."""
    n = len(prompt)
    dtype = next(model.parameters()).dtype
    pool = allocate_kv_pool(cfg, blocks_for(n), BLOCK_SIZE, dtype, "cpu")
    meta = build_metadata([0], [n], [list(range(blocks_for(n)))], BLOCK_SIZE, "cpu")
    with torch.inference_mode():
        return model(torch.tensor(prompt), torch.arange(n), meta, pool, torch.tensor([n - 1]))[0]


def test_bfloat16_on_cpu_is_close_to_float32(model, bf16_model, cfg, chat_prompts):
    """Logits within LOGIT_ATOL on every chat prompt; on a prompt whose float32 top two are
    far apart ("Hi!": 2.5), the same greedy tokens, served through the runner (KV in bf16)."""
    for prompt in chat_prompts:
        ours, ref = last_logits(bf16_model, cfg, prompt), last_logits(model, cfg, prompt)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL, rtol=0)
    hi = chat_prompts[1]
    tokens = {}
    for name, m in (("float32", model), ("bfloat16", bf16_model)):
        dtype = next(m.parameters()).dtype
        runner = ModelRunner(m, cfg, allocate_kv_pool(cfg, 64, BLOCK_SIZE, dtype, "cpu"), BLOCK_SIZE, "cpu")
        tokens[name] = generate_together(runner, [greedy("hi", hi)], 16)[0]
    same = sum(a == b for a, b in zip(tokens["float32"], tokens["bfloat16"]))
    assert same >= 12, tokens  # 16 of 16 measured; bf16 rounding may flip a late near-tie


@pytest.mark.parametrize("kv_flag, kv_dtype", [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_worker_in_bfloat16_reports_its_kv_block_bytes(model_path, cfg, kv_flag, kv_dtype):
    """--dtype bfloat16 keeps its KV in bfloat16 unless --kv-cache-dtype says otherwise; the block
    bytes the scheduler sizes its pools by follow the KV's element size."""
    parser = argparse.ArgumentParser()
    worker_args(parser)
    args = parser.parse_args(
        ["--device", "cpu", "--dtype", "bfloat16", "--kv-cache-dtype", kv_flag, "--hbm-blocks", "8", "--dram-gb", "0.01"]
    )
    args.model, args.worker_id = str(model_path), "w"
    if kv_dtype == torch.float32 and not cpu_quant.bf16_fast():  # the model itself in bfloat16 here
        with pytest.raises(ValueError, match="--kv-cache-dtype float32 is wider than the model computes in"):
            build_worker(args, torch.device("cpu"))
        return
    runner, engine, ready = build_worker(args, torch.device("cpu"))
    try:
        if cpu_quant.bf16_fast():  # bfloat16 matrices on vdpbf16ps; activations float32
            assert runner.model.layers[0].qkv.quant.kind == runner.model.lm_head.quant.kind == "bf16"
        else:
            assert next(runner.model.parameters()).dtype == torch.bfloat16
        assert runner.kv_pool.dtype == engine.pools.dram.dtype == kv_dtype
        want = kv_block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, kv_dtype.itemsize)
        assert ready.block_bytes == engine.pools.spec.block_bytes == want
        assert ready.num_dram_blocks == int(0.01 * (1 << 30)) // want
    finally:
        engine.close()
