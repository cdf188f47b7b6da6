"""The model served with packed weights (the GGUF's own Q4_1, and bfloat16 matrices on
vdpbf16ps) against float32: close logits, the same greedy answer where float32's is clear."""

from __future__ import annotations

import pytest
import torch

from services.worker import cpu_kernels, cpu_quant
from services.worker.model import LlamaModel
from services.worker.runner import ModelRunner, allocate_kv_pool
from services.worker.weights import load_weights

from .conftest import BLOCK_SIZE, generate_together, greedy
from .test_dtype import last_logits

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler for the native kernels"),
]

# Logits of this model are ~20-30 at the top. Q4_1 weights are float32's own (the file's), so
# only the int8 rounding of the activations moves them: 0.4-0.6 measured on the chat prompts.
# bfloat16 matrices round the weights too (8 bits), with the residual stream kept float32.
LOGIT_ATOL = {"gguf": 1.5, "bf16": 1.5}


@pytest.fixture(scope="module", params=["gguf", "bf16"])
def packed_model(request, model_path, cfg):
    if request.param == "bf16" and not cpu_quant.bf16_fast():
        pytest.skip("this CPU has no AVX512-BF16")
    model = LlamaModel(cfg, load_weights(model_path, cfg, request.param)).eval()
    assert model.layers[0].gate_up.quant is not None and model.lm_head.quant is not None
    return request.param, model


def test_packed_model_is_close_to_float32(packed_model, model, cfg, chat_prompts):
    name, packed = packed_model
    for prompt in chat_prompts:
        ours, ref = last_logits(packed, cfg, prompt), last_logits(model, cfg, prompt)
        torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL[name], rtol=0)


def test_packed_model_answers_like_float32(packed_model, model, cfg, chat_prompts):
    """"Hi!" (float32's top two 2.5 apart): 16 greedy tokens through the runner, KV float32."""
    _, packed = packed_model
    tokens = []
    for m in (model, packed):
        runner = ModelRunner(m, cfg, allocate_kv_pool(cfg, 64, BLOCK_SIZE, torch.float32, "cpu"), BLOCK_SIZE, "cpu")
        tokens.append(generate_together(runner, [greedy("hi", chat_prompts[1])], 16)[0])
    same = sum(a == b for a, b in zip(*tokens))
    assert same >= 12, tokens
