"""A restarted worker reads the float weights its predecessor converted (weights_cache.py):
the same tensors as a conversion from the GGUF file, a damaged entry converted again."""

from __future__ import annotations

import time

import torch

from services.worker.weights_cache import cache_path, cached_weights
from shared.modelfile import read_model_config, resolve_model_path


def test_the_cache_gives_the_converted_weights_back_faster_and_survives_damage(tmp_path):
    path = resolve_model_path(None)
    cfg = read_model_config(path)
    t0 = time.perf_counter()
    converted = cached_weights(path, cfg, tmp_path)  # converts, writes the entry
    convert_s = time.perf_counter() - t0
    entry = cache_path(tmp_path, path)
    assert entry.exists() and not list(tmp_path.glob("*.tmp"))
    t0 = time.perf_counter()
    cached = cached_weights(path, cfg, tmp_path)
    read_s = time.perf_counter() - t0
    assert cached.keys() == converted.keys()
    for name, w in converted.items():
        assert cached[name].dtype == w.dtype and torch.equal(cached[name], w), name
    assert read_s < convert_s, (read_s, convert_s)
    entry.write_bytes(b"not a safetensors file")
    again = cached_weights(path, cfg, tmp_path)  # converted again, the entry rewritten
    assert torch.equal(again["model.norm.weight"], converted["model.norm.weight"])
    assert cached_weights(path, cfg, tmp_path).keys() == converted.keys()
