"""Worker fixtures: the bundled model, loaded once per session (dequantizing takes seconds)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bench.micro.model import transformers_model
from services.worker.model import LlamaModel
from services.worker.runner import ModelRunner, allocate_kv_pool
from services.worker.weights import load_weights
from shared.modelfile import ModelConfig, default_model_path, read_model_config
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest

BLOCK_SIZE = 16

CHATS = [
    "What is the capital of France?",
    "Hi!",
    "Write a short poem about the sea, in four lines, with a rhyme in the second and fourth.",
    "Explain in detail why the sky is blue during the day and red at sunset. Mention "
    "Rayleigh scattering, the path length of sunlight through the atmosphere, and why "
    "clouds look white. Keep the answer suitable for a curious ten-year-old.",
]


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op thread: when the cores are shared (CI runners, parallel jobs), an OpenMP
    team waiting on a descheduled thread turns a 0.3 ms small-batch matmul into ~20 ms."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def cfg(model_path) -> ModelConfig:
    return read_model_config(model_path)


@pytest.fixture(scope="session")
def weights(model_path, cfg) -> dict[str, torch.Tensor]:
    return load_weights(model_path, cfg)


@pytest.fixture(scope="session")
def model(cfg, weights) -> LlamaModel:
    return LlamaModel(cfg, weights).eval()


@pytest.fixture(scope="session")
def hf_model(cfg, weights):
    return transformers_model(cfg, weights)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    """The CHATS as chat-formatted token ids (the GGUF's own template), all of different lengths."""
    prompts = []
    for chat in CHATS:
        messages = [{"role": "user", "content": chat}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompts.append(list(encoded["input_ids"]))
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts


@pytest.fixture(scope="session")
def gguf_model(model_path, cfg):
    """The bundled GGUF served as it is: its matrices packed, int8 activations."""
    model = LlamaModel(cfg, load_weights(model_path, cfg, "gguf")).eval()
    assert model.layers[0].qkv.quant is not None
    return model


@pytest.fixture
def make_runner(model, cfg):
    """A fresh runner over a fresh pool of `num_blocks` blocks (of `kv`), of `of` or the float32 model."""

    def make(num_blocks: int = 256, of: LlamaModel | None = None, kv: torch.dtype = torch.float32) -> ModelRunner:
        pool = allocate_kv_pool(cfg, num_blocks, BLOCK_SIZE, kv, "cpu")
        return ModelRunner(of or model, cfg, pool, BLOCK_SIZE, "cpu")

    return make


def greedy(rid: str, prompt: list[int], **params) -> NewRequestData:
    return NewRequestData(rid, list(prompt), SamplingParams(max_tokens=1 << 20, temperature=0.0, **params))


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def generate_together(runner, requests: list[NewRequestData], num_new: int, seed: int = 0) -> list[list[int]]:
    """New tokens of all requests served in one batch: one step prefills them all, then
    every step decodes them all. Blocks come from a shuffled free list and are appended as
    each request grows, so block tables are scattered and grow through `new_block_ids`."""
    free = list(range(runner.kv_pool.shape[0]))
    random.Random(seed).shuffle(free)
    rids = [r.request_id for r in requests]
    runner.add_requests(requests)
    tables = {r.request_id: [free.pop() for _ in range(blocks_for(len(r.prompt_token_ids)))] for r in requests}
    first = [
        ScheduledRequest(r.request_id, 0, len(r.prompt_token_ids), block_table=tables[r.request_id]) for r in requests
    ]
    assert runner.execute(first)[0] == rids
    for _ in range(num_new - 1):
        step = []
        for rid in rids:
            n = len(runner.token_ids(rid))  # the last sampled token is not in the cache yet
            new = [free.pop()] if blocks_for(n) > len(tables[rid]) else []
            tables[rid] += new
            step.append(ScheduledRequest(rid, n - 1, 1, new_block_ids=new))
        assert runner.execute(step)[0] == rids
    return [runner.token_ids(r.request_id)[len(r.prompt_token_ids) :] for r in requests]
