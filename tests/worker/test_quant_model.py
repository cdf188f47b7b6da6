"""The model served with packed weights (the GGUF's own Q4_1, and bfloat16 matrices on
vdpbf16ps) against float32: close logits, the same greedy answer where float32's is clear."""

from __future__ import annotations

import pytest
import torch

from services.worker import cpu_kernels, cpu_quant
from services.worker.attention import build_metadata
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


def test_gguf_logits_are_the_same_bits_however_a_token_is_computed(gguf_model, cfg, chat_prompts):
    """int8 activations turn float differences into different tokens, so the GGUF served as it
    is must not have any: a token's logits are the same bits computed in one prefill, in a
    later chunk, decoded alone, or decoded beside another request (whose context changes how
    the attention splits its work). This is what makes a token recomputed after a preemption
    the token that was decoded (test_runner.py). 280 tokens: the later ones' attention spans
    more than one work item (csrc/decode_attention.c, SPAN_FIXED_KEYS), merged in key order."""
    prompt, other = sum(reversed(chat_prompts), []) + chat_prompts[-1], chat_prompts[0]
    assert len(prompt) > 256
    n, half = len(prompt), len(prompt) // 2
    table = list(range(-(-n // BLOCK_SIZE)))
    other_table = list(range(len(table), len(table) + -(-(len(other) + n) // BLOCK_SIZE)))
    pool = allocate_kv_pool(cfg, len(table) + len(other_table), BLOCK_SIZE, torch.bfloat16, "cpu")

    def run(rows, pos, q_lens, cached, tables, sample):
        meta = build_metadata(cached, q_lens, tables, BLOCK_SIZE, "cpu")
        return gguf_model(torch.tensor(rows), torch.tensor(pos), meta, pool, torch.tensor(sample))

    with torch.inference_mode():
        whole = run(prompt, list(range(n)), [n], [0], [table], list(range(n)))  # [n, V]
        chunks = run(prompt[half:], list(range(half, n)), [n - half], [half], [table], list(range(n - half)))
        alone = [run([prompt[i]], [i], [1], [i], [table], [0])[0] for i in range(half, n)]
        run(other, list(range(len(other))), [len(other)], [0], [other_table], [0])
        beside = []
        for i in range(half, n):  # the other request decodes in the same steps, its context growing
            j = len(other) + i - half
            beside.append(run([prompt[i], other[-1]], [i, j], [1, 1], [i, j], [table, other_table], [0, 1])[0])
    assert torch.equal(chunks, whole[half:])
    assert torch.equal(torch.stack(alone), whole[half:])
    assert torch.equal(torch.stack(beside), whole[half:])
