"""Decode steps through the whole model in one native call (fused_decode.py) against the same
model op by op: the same logits and the same pool, to the bit, for packed and float32 weights."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker import cpu_kernels, cpu_quant, fused_decode
from services.worker.attention import build_metadata
from services.worker.model import LlamaModel
from services.worker.runner import allocate_kv_pool
from services.worker.weights import load_weights

from .conftest import BLOCK_SIZE, blocks_for

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler for the native kernels")


def _steps(
    model, cfg, contexts: list[int], num_steps: int, fused: bool, run_threads: int | None = None, kv=torch.float32
):
    """Prefill each request alone, then `num_steps` decode steps of all of them together, over
    scattered block tables, the pool of dtype `kv`. Returns (logits of every decode step
    [steps, R, V], the pool)."""
    num_blocks = sum(blocks_for(c + num_steps) for c in contexts)
    free = list(range(num_blocks))
    random.Random(len(contexts)).shuffle(free)
    tables = [[free.pop() for _ in range(blocks_for(c + num_steps))] for c in contexts]
    pool = allocate_kv_pool(cfg, num_blocks, BLOCK_SIZE, kv, "cpu")
    gen = torch.Generator().manual_seed(0)
    logits = []
    model.fused_decode = fused
    model._decode_threads = fused_decode.ThreadChoice(fixed=run_threads)
    try:
        with torch.inference_mode():
            for c, table in zip(contexts, tables):
                ids = torch.randint(0, cfg.vocab_size, (c,), generator=gen)
                model(ids, torch.arange(c), build_metadata([0], [c], [table], BLOCK_SIZE, "cpu"), pool, torch.tensor([c - 1]))
            for step in range(num_steps):
                positions = [c + step for c in contexts]
                meta = build_metadata(positions, [1] * len(contexts), tables, BLOCK_SIZE, "cpu")
                ids = torch.randint(0, cfg.vocab_size, (len(contexts),), generator=gen)
                logits.append(model(ids, torch.tensor(positions), meta, pool, torch.arange(len(contexts))))
    finally:
        model.fused_decode = True
        model._decode_threads = fused_decode.ThreadChoice()
    return torch.stack(logits), pool


@pytest.fixture(scope="module")
def bf16_model(model_path, cfg):
    if not cpu_quant.bf16_fast():
        pytest.skip("this CPU has no AVX512-BF16 (bfloat16 matrices are not served here)")
    model = LlamaModel(cfg, load_weights(model_path, cfg, "bf16")).eval()
    assert model.layers[0].gate_up.quant.gated  # silu(gate) * up inside the matmul
    return model


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gguf", "float32", "gguf, bfloat16 KV", "bf16, bfloat16 KV"])
@pytest.mark.parametrize(
    "contexts, threads",
    [([37], 1), ([5, 130, 9], 2), ([5, 130, 9], 3), ([3 + 2 * i for i in range(17)], 1)],
    ids=["1", "3", "3 on 3 threads", "17"],
)
def test_fused_decode_is_bit_identical(which, contexts, threads, gguf_model, model, cfg, request):
    """17 rows: float32's matmuls take the AMX tiles where the CPU has them, panels below 16.
    Two threads split the matmuls' panels and the attention's spans as layer by layer does; three
    (more than the two the quantized weights are cut for) share the rotary two ways and store the
    keys and values on the third. The fused steps run on that many threads (pinned: ThreadChoice
    would try one thread first). A
    bfloat16 pool: the fused step rounds its K/V into it as torch's write does. bfloat16
    matrices: gate and up's matmul writes silu(gate) * up in both."""
    weights = which.split(",")[0]
    m = {"float32": model, "gguf": gguf_model}.get(weights) or request.getfixturevalue("bf16_model")
    kv = torch.bfloat16 if "bfloat16" in which else torch.float32
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused_logits, fused_pool = _steps(m, cfg, contexts, 3, fused=True, run_threads=threads, kv=kv)
        ref_logits, ref_pool = _steps(m, cfg, contexts, 3, fused=False, kv=kv)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(fused_logits, ref_logits)
    assert torch.equal(fused_pool, ref_pool)


@pytest.mark.slow
def test_fused_decode_on_one_thread_matches_two(gguf_model, cfg):
    """A step run on one thread with the attention's spans cut for two (ThreadChoice's other
    count) gives what two threads give layer by layer: the choice changes only the time."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one_logits, one_pool = _steps(gguf_model, cfg, [300, 7], 3, fused=True, run_threads=1)
        ref_logits, ref_pool = _steps(gguf_model, cfg, [300, 7], 3, fused=False)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one_logits, ref_logits)
    assert torch.equal(one_pool, ref_pool)


def test_thread_choice_takes_the_faster_count_and_still_tries_the_other():
    choice = fused_decode.ThreadChoice()
    assert choice.pick(8, 2) == 2  # more rows than MAX_ROWS: torch's count
    picks = []
    for _ in range(60):
        n = choice.pick(1, 2)
        picks.append(n)
        choice.record(1, n, 0.005 if n == 1 else 0.009)
    assert picks[:6] == [1, 1, 1, 2, 2, 2]  # each count measured first
    assert picks[6:].count(1) > 40 and 2 in picks[6:]  # one thread was faster; two still tried now and then
    assert fused_decode.ThreadChoice(fixed=1).pick(1, 2) == 1


def test_fused_decode_declines_prefill_and_mixed_steps(gguf_model, cfg):
    """A step with a prefill chunk is left to the layers: nothing written, None returned."""
    pool = allocate_kv_pool(cfg, 8, BLOCK_SIZE, torch.float32, "cpu")
    for num_new in ([5], [1, 5]):
        tables = [[i] for i in range(len(num_new))]
        meta = build_metadata([3] * len(num_new), num_new, tables, BLOCK_SIZE, "cpu")
        rows = sum(num_new)
        ids, positions = torch.full((rows,), 7), torch.arange(rows) + 3
        assert fused_decode.run(gguf_model, ids, positions, meta, pool, torch.tensor([rows - 1])) is None
        assert not pool.any()


def test_fused_decode_refuses_a_token_id_past_the_vocabulary(gguf_model, cfg):
    """An id the embedding has no row for fails the step as the forward's lookup does (IndexError),
    before anything is written."""
    pool = allocate_kv_pool(cfg, 8, BLOCK_SIZE, torch.float32, "cpu")
    meta = build_metadata([3, 3], [1, 1], [[0], [1]], BLOCK_SIZE, "cpu")
    for bad in (cfg.vocab_size, -1):
        with pytest.raises(IndexError):
            fused_decode.run(gguf_model, torch.tensor([7, bad]), torch.tensor([3, 3]), meta, pool, torch.arange(2))
        assert not pool.any()
    logits = fused_decode.run(gguf_model, torch.tensor([7, 8]), torch.tensor([3, 3]), meta, pool, torch.arange(2))
    assert logits.shape == (2, cfg.vocab_size) and pool.any()
