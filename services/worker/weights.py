"""Loading weights into Hugging Face Llama naming, float32, from GGUF or safetensors.

Both formats end up as one `dict[str, Tensor]` keyed like `LlamaForCausalLM.state_dict()`
(`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`, ...), so the
model has one loading path and tests can feed the same dict to transformers.

With `quant`, the matrices come as `QuantWeight`s instead (cpu_quant.py), kept packed:
"gguf" keeps the file's own Q8_0 / Q4_0 / Q4_1 tensors as they are (others dequantized);
"q8_0", "q4_0" or "q4_1" quantizes every matrix to that format (one already in it is kept);
"bf16" rounds every matrix to bfloat16 (served by vdpbf16ps, activations float32).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch

from services.worker import cpu_quant
from services.worker.cpu_quant import QuantWeight
from shared.modelfile import ModelConfig, gguf_header, is_gguf

Weight = torch.Tensor | QuantWeight
QUANT_CHOICES = ("gguf", *cpu_quant.WEIGHT_FORMATS)

# GGUF tensor name -> HF name; `{i}` is the layer index.
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def load_weights(path: Path, cfg: ModelConfig, quant: str | None = None) -> dict[str, Weight]:
    """All weights of the model at `path` (a .gguf file or an HF directory), float32, or with
    `quant` (one of QUANT_CHOICES) its matrices quantized."""
    if quant is not None and quant not in QUANT_CHOICES:
        raise ValueError(f"quantization {quant!r} is not one of {QUANT_CHOICES}")
    weights = _load_gguf(path, cfg, quant) if is_gguf(path) else _load_safetensors(path)
    if quant in cpu_quant.WEIGHT_FORMATS:
        for name, w in weights.items():
            if _is_matrix(name) and not (isinstance(w, QuantWeight) and w.kind == quant):
                w = w.dequantize() if isinstance(w, QuantWeight) else w
                weights[name] = QuantWeight.quantize(w, quant)
    check_weights(weights, cfg)
    return weights


def gguf_quantization(path: Path) -> str | None:
    """The format of the GGUF's layer matrices where it is one served packed (cpu_quant.FORMATS),
    else None (a float GGUF, another quantization, or not a GGUF)."""
    if not is_gguf(path):
        return None
    kinds = {kind for name, kind in gguf_header(path).tensor_types.items() if name.endswith("ffn_down.weight")}
    return kinds.pop() if len(kinds) == 1 and kinds <= set(cpu_quant.FORMATS) else None


def _is_matrix(name: str) -> bool:
    """A weight multiplied by the activations (the embedding too: it is the tied head)."""
    return name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight")


def expected_names(cfg: ModelConfig) -> set[str]:
    """The HF names a complete Llama/Qwen2 checkpoint of this shape holds."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_embeddings:
        names.add("lm_head.weight")
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if cfg.attention_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    for i in range(cfg.num_layers):
        names.update(f"model.layers.{i}.{n}" for n in per_layer)
    return names


def check_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Fail at load, with the names, rather than at the first forward."""
    missing = expected_names(cfg) - weights.keys()
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:4]}")
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    k = weights["model.layers.0.self_attn.k_proj.weight"]
    want_q = (cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    want_k = (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
    if tuple(q.shape) != want_q or tuple(k.shape) != want_k:
        raise ValueError(f"q/k shapes {tuple(q.shape)}/{tuple(k.shape)} != {want_q}/{want_k}")


# ---------------------------------------------------------------- GGUF


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a GGUF tensor; None for tensors we do not use (e.g. `rope_freqs`)."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _GGUF_BLOCK.fullmatch(name)
    if m is None or m.group(2) not in _GGUF_LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}"


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Its converter reorders each head's rows from HF's half-split rope layout
    (rows [x0..x31, y0..y31]) to GGML's interleaved one ([x0, y0, x1, y1, ...]);
    our rope is HF's `rotate_half`, so put the rows back.
    """
    # w: [num_heads * head_dim, ...] with rows per head ordered (pair, 2)
    rows = w.shape[0]
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(path: Path, cfg: ModelConfig, quant: str | None = None) -> dict[str, Weight]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _gguf_architecture(reader)
    out: dict[str, Weight] = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        # GGUF lists dims fastest-first; torch wants them the other way round.
        shape = tuple(int(d) for d in reversed(t.shape))
        kind = t.tensor_type.name.lower()
        w: Weight
        if quant is not None and kind in cpu_quant.FORMATS and len(shape) == 2:
            w = QuantWeight(kind, torch.from_numpy(np.array(t.data, dtype=np.uint8)), shape)  # own copy
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(np.array(data.reshape(shape), dtype=np.float32))  # own, writable copy
        # Only llama.cpp's *llama* converter permutes q/k; qwen2 keeps HF order (NEOX rope).
        # The permutation moves whole rows, so a quantized matrix's blocks move with them.
        heads = {".q_proj.": cfg.num_heads, ".k_proj.": cfg.num_kv_heads}
        for part, num in heads.items():
            if arch == "llama" and part in name:
                unpermute = functools.partial(unpermute_rope_rows, num_heads=num)
                w = w.rows(unpermute) if isinstance(w, QuantWeight) else unpermute(w)
        out[name] = w if isinstance(w, QuantWeight) else w.contiguous()
    return out


def _gguf_architecture(reader) -> str:
    field = reader.fields["general.architecture"]
    return str(field.contents())


# ---------------------------------------------------------------- safetensors


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, w in load_file(str(f)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # buffers saved by some exporters; recomputed from rope_theta
            out[name] = w.to(torch.float32)
    return out
