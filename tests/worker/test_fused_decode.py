"""Decode steps through the whole model in one native call (fused_decode.py, chosen by
LlamaModel.decode) against the same model op by op: the same logits and the same pool, to the bit,
for packed and float32 weights."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker import cpu_kernels, cpu_quant, fused_decode
from services.worker.attention import build_metadata
from services.worker.model import LlamaModel
from services.worker.runner import ModelRunner, allocate_kv_pool
from services.worker.weights import load_weights
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest

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
                ids = torch.randint(0, cfg.vocab_size, (len(contexts),), generator=gen).tolist()
                out, _ = model.decode(pool, ids, positions, tables, list(range(len(contexts))))
                logits.append(out.clone())  # the fused step's buffer is the next step's
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
    assert picks[6:].count(1) > 50 and 2 in picks[6:]  # one thread was faster; two still tried now and then
    assert fused_decode.ThreadChoice(fixed=1).pick(1, 2) == 1


def test_thread_choice_tries_a_losing_count_less_often_and_follows_a_change():
    """Tries of the slower count thin out while it keeps losing (every 10th step, then twice as far
    apart each time, to every 160th), and the choice still moves when the other count becomes the
    faster one."""
    choice = fused_decode.ThreadChoice()
    fast = 1

    def steps(num: int) -> list[int]:
        picks = []
        for _ in range(num):
            n = choice.pick(1, 2)
            picks.append(n)
            choice.record(1, n, 0.003 if n == fast else 0.0045)
        return picks

    first = steps(1000)
    assert 5 <= first[6:].count(2) <= 12  # tries 10, 20, 40, 80, then 160 steps apart (99 at every 10th)
    assert 2 in first[-200:]  # still tried
    fast = 2
    after = steps(400)
    assert after[250:].count(1) <= 3  # two threads chosen, one tried now and then


@pytest.mark.parametrize(
    "token_ids, positions, tables, sample_rows",
    [
        ([7, -1], [3, 3], [[0], [1]], [0, 1]),  # a token id past either end of the vocabulary
        ([7, 49152], [3, 3], [[0], [1]], [0, 1]),
        ([7, 8], [3, -1], [[0], [1]], [0, 1]),  # a negative position
        ([7, 8], [3, 3], [[0], [8]], [0, 1]),  # a block id past the pool's 8
        ([7, 8], [3, BLOCK_SIZE], [[0], [1, -2]], [0, 1]),  # a negative one in the context
        ([7, 8], [3, 3], [[0], [1]], [0, 2]),  # a sample row past the step's
    ],
    ids=["id -1", "id past", "position", "block past", "block negative", "sample row"],
)
def test_fused_decode_refuses_an_index_out_of_range(gguf_model, cfg, token_ids, positions, tables, sample_rows):
    """Every index the native step reads is checked before anything is written: the step raises
    IndexError, the pool is untouched, and the next good step runs."""
    assert cfg.vocab_size == 49152
    pool = allocate_kv_pool(cfg, 8, BLOCK_SIZE, torch.float32, "cpu")
    fused = fused_decode.for_pool(gguf_model, pool)
    with pytest.raises(IndexError):
        fused.run(token_ids, positions, tables, sample_rows, pick=True)
    assert not pool.any()
    logits, picked = fused.run([7, 8], [3, 3], [[0], [1]], [0, 1], pick=True)
    assert logits.shape == (2, cfg.vocab_size) and pool.any()


def _served(model, cfg, prompts: list[list[int]], params: list[SamplingParams], fused: bool):
    """Each prompt prefilled alone, then decode steps of all together through ModelRunner, the
    last prompt held back to join them a token at a time (its next-to-last token a single-token
    row that does not sample). Returns (every step's StepTokens, whether the fused step applied)."""
    per = [blocks_for(len(p) + 8) for p in prompts]
    free = list(range(sum(per)))
    random.Random(1).shuffle(free)
    pool = allocate_kv_pool(cfg, sum(per), BLOCK_SIZE, torch.float32, "cpu")
    runner = ModelRunner(model, cfg, pool, BLOCK_SIZE, "cpu")
    ids = [str(i) for i in range(len(prompts))]
    runner.add_requests([NewRequestData(r, p, s) for r, p, s in zip(ids, prompts, params)])
    tables = {r: [free.pop() for _ in range(n)] for r, n in zip(ids, per)}
    *early, late = ids
    model.fused_decode = fused
    try:
        steps = [
            runner.execute_step([ScheduledRequest(r, 0, len(p), block_table=tables[r])]) for r, p in zip(early, prompts)
        ]
        last = len(prompts[-1])
        steps.append(runner.execute_step([ScheduledRequest(late, 0, last - 2, block_table=tables[late])]))
        for step in range(4):
            decodes = [ScheduledRequest(r, len(runner.token_ids(r)) - 1, 1) for r in early]
            if step < 2:  # the held-back prompt's last two tokens, one a step
                decodes.append(ScheduledRequest(late, last - 2 + step, 1))
            else:
                decodes.append(ScheduledRequest(late, len(runner.token_ids(late)) - 1, 1))
            steps.append(runner.execute_step(decodes))
    finally:
        model.fused_decode = True
    return steps, fused_decode.for_pool(model, pool) is not None


def test_runner_decode_steps_from_lists_match_the_layers(gguf_model, cfg, chat_prompts):
    """The runner's steps of decodes through the fused step (its lists packed into one array,
    the logits in a buffer kept across steps, greedy tokens picked in the native call) give the
    tokens and logprobs the model gives layer by layer: greedy rows, a seeded sampled row, a greedy
    row asking for logprobs (its tokens then come from the sampler), and a single-token prompt row
    that does not sample beside them."""
    params = [
        SamplingParams(max_tokens=64, temperature=0.0),
        SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_tokens=64, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=64, temperature=0.0),
    ]
    fused, used = _served(gguf_model, cfg, chat_prompts, params, fused=True)
    layers, _ = _served(gguf_model, cfg, chat_prompts, params, fused=False)
    assert used
    assert [(s.request_ids, s.token_ids) for s in fused] == [(s.request_ids, s.token_ids) for s in layers]
    assert [s.logprobs for s in fused] == [s.logprobs for s in layers]
    assert fused[-4].request_ids == ["0", "1", "2"]  # the prompt's next-to-last token sampled nothing
    greedy_only = [SamplingParams(max_tokens=64, temperature=0.0)] * 4
    fused, _ = _served(gguf_model, cfg, chat_prompts, greedy_only, fused=True)
    layers, _ = _served(gguf_model, cfg, chat_prompts, greedy_only, fused=False)
    assert [s.token_ids for s in fused] == [s.token_ids for s in layers]


def test_runner_decode_step_refuses_a_block_table_too_short(gguf_model, cfg):
    """A decode whose block table cannot hold its position fails as the metadata path does
    (ValueError), with nothing written."""
    pool = allocate_kv_pool(cfg, 4, BLOCK_SIZE, torch.float32, "cpu")
    decodes = fused_decode.for_pool(gguf_model, pool)
    with pytest.raises(ValueError, match="cannot hold"):
        decodes.run([7, 8], [3, BLOCK_SIZE], [[0], [1]], [0, 1], pick=True)
    assert not pool.any()
    logits, picked = decodes.run([7, 8], [3, BLOCK_SIZE], [[0], [1, 2]], [0, 1], pick=True)
    assert logits.shape == (2, cfg.vocab_size) and picked == logits.argmax(dim=1).tolist()
