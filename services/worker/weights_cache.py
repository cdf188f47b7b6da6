"""A worker restart that skips the dequantization: the model's float weights, once converted
from the GGUF file, are kept in a cache folder and read back from it by the next worker.

`superinfer serve` sets `SUPERINFER_WEIGHTS_CACHE` to its private run folder for its worker,
so a worker it restarts (killed, hung) loads in a fraction of the time: on a 2-core host the
dequantization is ~60% of a model load (7 of 11 s for SmolLM2-135M), and on a busy host a
restart that outlasts the failover bounds is a failed request. The cache lives as long as that
folder (the supervisor removes it when it stops); an entry is keyed by the model file's path,
size and modification time, and written whole or not at all (a temporary file renamed).
Only float weights (`--dtype` float32/bfloat16/float16, no tensor parallelism) are cached:
the quantized formats keep the file's own blocks and load fast already.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import structlog
import torch

from services.worker import runner
from services.worker.model import LlamaModel
from services.worker.tp import TPGroup
from services.worker.weights import load_weights
from shared.config import WEIGHTS_CACHE_ENV
from shared.modelfile import ModelConfig, read_model_config

log = structlog.get_logger()


def cache_path(folder: Path, model_path: Path) -> Path:
    """The entry of `model_path` (a file or an HF folder) in `folder`."""
    st = model_path.stat()
    key = f"{model_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return folder / f"weights-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def cached_weights(model_path: Path, cfg: ModelConfig, folder: Path | None) -> dict[str, torch.Tensor]:
    """The float32 weights of `model_path`: from the cache in `folder` when an entry is there,
    else converted from the file (and, with a `folder`, written there for the next worker)."""
    from safetensors.torch import load_file, save_file

    if folder is None:
        return load_weights(model_path, cfg)
    entry = cache_path(folder, model_path)
    if entry.exists():
        try:
            weights = load_file(str(entry))
            log.info("weights read from the cache", path=str(entry))
            return weights
        except Exception as e:  # a damaged entry costs a conversion, not the worker
            log.warning("weights cache entry unreadable; converting the file", path=str(entry), error=str(e))
    weights = load_weights(model_path, cfg)
    tmp = entry.with_suffix(f".{os.getpid()}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
        os.replace(tmp, entry)
    except OSError as e:  # a full disk: the next worker converts too
        log.warning("weights cache not written", path=str(entry), error=str(e))
        tmp.unlink(missing_ok=True)
    return weights


def cache_folder() -> Path | None:
    folder = os.environ.get(WEIGHTS_CACHE_ENV)
    return Path(folder) if folder else None


def load_model(path: Path, device: torch.device, dtype: torch.dtype | str, group: TPGroup | None = None):
    """runner.load_model, with the float weights from the cache when `SUPERINFER_WEIGHTS_CACHE`
    names one (and the model is float and whole, not a tensor-parallel shard)."""
    folder = cache_folder()
    if folder is None or group is not None or not isinstance(dtype, torch.dtype):
        return runner.load_model(path, device, dtype, group=group)
    cfg = read_model_config(Path(path))
    return LlamaModel(cfg, cached_weights(Path(path), cfg, folder), device=device, dtype=dtype).eval(), cfg
