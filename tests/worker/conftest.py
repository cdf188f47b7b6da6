"""Worker fixtures: the bundled model, loaded once per session (dequantizing takes seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.model import transformers_model
from services.worker.model import LlamaModel
from services.worker.runner import ModelRunner, allocate_kv_pool
from services.worker.weights import load_weights
from shared.modelfile import ModelConfig, default_model_path, read_model_config
from shared.protocol import NewRequestData, SamplingParams

BLOCK_SIZE = 16

CHATS = [
    "What is the capital of France?",
    "Hi!",
    "Write a short poem about the sea, in four lines, with a rhyme in the second and fourth.",
    "Explain in detail why the sky is blue during the day and red at sunset. Mention "
    "Rayleigh scattering, the path length of sunlight through the atmosphere, and why "
    "clouds look white. Keep the answer suitable for a curious ten-year-old.",
]


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
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for c in CHATS
    ]
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts


@pytest.fixture
def make_runner(model, cfg):
    """A fresh runner over a fresh pool of `num_blocks` blocks."""

    def make(num_blocks: int = 256) -> ModelRunner:
        pool = allocate_kv_pool(cfg, num_blocks, BLOCK_SIZE, torch.float32, "cpu")
        return ModelRunner(model, cfg, pool, BLOCK_SIZE, "cpu")

    return make


def greedy(rid: str, prompt: list[int], **params) -> NewRequestData:
    return NewRequestData(rid, list(prompt), SamplingParams(max_tokens=1 << 20, temperature=0.0, **params))


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)
