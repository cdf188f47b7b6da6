"""The runner under a scheduler's moves: preemption with recompute, chunked prefill, errors."""

from __future__ import annotations

import functools

import pytest
import torch

from services.worker.kv_pool import KVSpec
from services.worker.runner import ModelRunner, allocate_kv_pool, kv_block_shape
from shared.protocol import ScheduledRequest
from tests.worker.conftest import BLOCK_SIZE, blocks_for, generate_together, greedy

NUM_NEW = 20


class Blocks:
    """A tiny free list, enough to hand out fresh (never reused) blocks."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]


@pytest.mark.parametrize("which", ["float32", pytest.param("gguf", marks=pytest.mark.slow)])
def test_preempted_requests_recompute_to_identical_tokens(which, make_runner, chat_prompts, request):
    """r0 is preempted mid-decode and recomputed in two chunks alongside the others'
    decodes; r2 is preempted mid-prefill. Their old blocks are poisoned with NaN. Every
    request still produces exactly the tokens of an undisturbed run. The GGUF served as it is
    (int8 activations, its KV in bfloat16, as `--dtype auto` serves it): its attention is
    batch-invariant, so a recomputed token sees to the bit what its decode saw."""
    prompts = chat_prompts[1:4]
    if which == "gguf":
        gguf = request.getfixturevalue("gguf_model")
        make_runner = functools.partial(make_runner, of=gguf, kv=torch.bfloat16)
    want = generate_together(make_runner(), [greedy(f"r{i}", p) for i, p in enumerate(prompts)], NUM_NEW)

    runner = make_runner()
    blocks = Blocks(runner.kv_pool.shape[0])
    runner.add_requests([greedy(f"r{i}", p) for i, p in enumerate(prompts)])
    tables = {f"r{i}": blocks.take(blocks_for(len(p) + NUM_NEW)) for i, p in enumerate(prompts)}
    half = len(prompts[2]) // 2
    ids, _ = runner.execute(
        [
            ScheduledRequest("r0", 0, len(prompts[0]), block_table=tables["r0"]),
            ScheduledRequest("r1", 0, len(prompts[1]), block_table=tables["r1"]),
            ScheduledRequest("r2", 0, half, block_table=tables["r2"]),  # first chunk only
        ]
    )
    assert ids == ["r0", "r1"]
    # r2 preempted mid-prefill: recomputed from 0 in fresh blocks.
    _poison(runner, tables["r2"])
    released = list(tables["r2"])
    tables["r2"] = blocks.take(blocks_for(len(prompts[2]) + NUM_NEW))
    step = [ScheduledRequest("r2", 0, len(prompts[2]), block_table=tables["r2"])] + _decodes(runner, ["r0", "r1"])
    assert runner.execute(step)[0] == ["r2", "r0", "r1"]  # in the order scheduled
    for _ in range(5):
        runner.execute(_decodes(runner, ["r0", "r1", "r2"]))
    # r0 preempted mid-decode; r1, r2 go on without it for two steps.
    _poison(runner, tables["r0"])
    released += tables["r0"]
    for _ in range(2):
        runner.execute(_decodes(runner, ["r1", "r2"]))
    tables["r0"] = blocks.take(blocks_for(len(prompts[0]) + NUM_NEW))
    known = len(runner.token_ids("r0"))
    chunk = known - 9
    step = _decodes(runner, ["r1", "r2"]) + [ScheduledRequest("r0", 0, chunk, block_table=tables["r0"])]
    ids, _ = runner.execute(step)
    assert ids == ["r1", "r2"]  # r0's first chunk does not reach its last token: no sample
    ids, _ = runner.execute([ScheduledRequest("r0", chunk, known - chunk)] + _decodes(runner, ["r1", "r2"]))
    assert ids == ["r0", "r1", "r2"]
    while unfinished := [f"r{i}" for i, p in enumerate(prompts) if len(runner.token_ids(f"r{i}")) < len(p) + NUM_NEW]:
        runner.execute(_decodes(runner, unfinished))
    got = [runner.token_ids(f"r{i}")[len(p) :] for i, p in enumerate(prompts)]
    assert got == want
    assert torch.isnan(runner.kv_pool[released]).all(), "a replaced block table was still written"


def test_chunked_prefill_equals_one_shot(make_runner, chat_prompts):
    """The same prompt prefilled at once and in unaligned chunks: same K/V in the cache (to
    float rounding) and the same greedy continuation."""
    prompt = chat_prompts[3]
    n = len(prompt)
    table = list(range(blocks_for(n + 8)))
    one, chunked = make_runner(), make_runner()
    for runner in (one, chunked):
        runner.add_requests([greedy("a", prompt)])
    assert one.execute([ScheduledRequest("a", 0, n, block_table=table)])[0] == ["a"]
    cuts = [0, 7, 23, 48, n]
    for start, end in zip(cuts, cuts[1:]):
        table_once = table if start == 0 else None
        ids, _ = chunked.execute([ScheduledRequest("a", start, end - start, block_table=table_once)])
        assert ids == (["a"] if end == n else [])
    cached = slice(0, blocks_for(n))
    # Chunks of 7 and 16+ rows take different matmul kernels (csrc: float32 panels, AMX bf16x3,
    # ~1e-5 apart per product): after 30 layers a few K/V values are ~2e-4 apart.
    torch.testing.assert_close(chunked.kv_pool[cached], one.kv_pool[cached], atol=5e-4, rtol=1e-3)
    for runner in (one, chunked):
        for _ in range(8):
            runner.execute(_decodes(runner, ["a"]))
    assert chunked.token_ids("a") == one.token_ids("a")


def test_drop_forgets_and_ids_can_return(make_runner, chat_prompts):
    runner = make_runner(16)
    runner.add_requests([greedy("a", chat_prompts[1])])
    runner.execute([ScheduledRequest("a", 0, len(chat_prompts[1]), block_table=list(range(blocks_for(40))))])
    runner.drop(["a", "never-added"])
    assert "a" not in runner and runner.num_requests == 0
    runner.add_requests([greedy("a", chat_prompts[1])])
    assert runner.token_ids("a") == chat_prompts[1]


def test_bad_schedules_are_refused(make_runner):
    runner = make_runner(16)
    runner.add_requests([greedy("a", [1, 2, 3, 4, 5])])
    with pytest.raises(KeyError, match="unknown"):
        runner.execute([ScheduledRequest("b", 0, 1, block_table=[0])])
    with pytest.raises(ValueError, match="outside"):
        runner.execute([ScheduledRequest("a", 0, 6, block_table=[0])])
    with pytest.raises(ValueError, match="twice"):
        runner.execute([ScheduledRequest("a", 0, 2, block_table=[0]), ScheduledRequest("a", 2, 3)])
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute([ScheduledRequest("a", 0, 5, block_table=[])])
    with pytest.raises(ValueError, match="already known"):
        runner.add_requests([greedy("a", [1])])
    assert runner.execute([]) == ([], [])


def test_kv_block_sizing(cfg, model):
    assert kv_block_shape(cfg, 16) == (30, 2, 16, 3, 64)
    assert KVSpec.from_model(cfg, 16, torch.float32).block_bytes == 30 * 2 * 16 * 3 * 64 * 4
    assert KVSpec.from_model(cfg, 16, torch.bfloat16).block_bytes == 30 * 2 * 16 * 3 * 64 * 2
    wrong = allocate_kv_pool(cfg, 4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="kv_pool blocks"):
        ModelRunner(model, cfg, wrong, BLOCK_SIZE, "cpu")
    ModelRunner(model, cfg, allocate_kv_pool(cfg, 4, BLOCK_SIZE, torch.bfloat16, "cpu"), BLOCK_SIZE, "cpu")
    for wrong in (torch.int16, torch.float64):  # not a float; wider than the model computes
        with pytest.raises(ValueError, match="kv_pool is"):
            ModelRunner(model, cfg, allocate_kv_pool(cfg, 4, BLOCK_SIZE, wrong, "cpu"), BLOCK_SIZE, "cpu")


def _decodes(runner: ModelRunner, rids: list[str]) -> list[ScheduledRequest]:
    """One decode each: compute the last known token (blocks were allocated up front)."""
    return [ScheduledRequest(rid, len(runner.token_ids(rid)) - 1, 1) for rid in rids]


def _poison(runner: ModelRunner, block_ids: list[int]) -> None:
    """A preempted request's blocks go to others: make any stale read visible."""
    runner.kv_pool[block_ids] = float("nan")
