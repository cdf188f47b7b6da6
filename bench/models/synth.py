"""`superinfer bench synth-model`: a model of a real architecture's shape with seeded random
weights and the bundled tokenizer, for speed and memory measurements at the sizes people serve.

Speed and memory do not depend on the weights' values, so a Llama-3.2-1B-shaped model with random
weights streams the same bytes per step as the real one. Written to `--out`:
- `{shape}.{F16,Q8_0,Q4_1}.gguf`: llama.cpp's layout (llama q/k rows permuted as its converter
  does, qwen2's left in order); the matrices in that type, the embedding in Q8_0 in the quantized
  files as the bundled SmolLM2 Q4_1 file has it, norms and biases F32; the bundled tokenizer's
  metadata and chat template copied;
- `{shape}-hf/` (its name the served model's): config.json, generation_config.json, the tokenizer
  (tokenizer.json, tokenizer_config.json) and bfloat16 safetensors in shards of ~1 GB with their
  index, as vLLM and transformers load them.
Every weight is drawn in float32 from a generator seeded by (`--seed`, its name), rounded to
bfloat16 once, and every file is written from that one value, so the HF folder and the F16 GGUF
hold the same model (F16 keeps bfloat16's 8 bits of mantissa; values below ~6e-5 lose some) and
the quantized GGUFs are that model quantized. One pass over the tensors writes every file.

Scales, so activations stay finite and the logits are neither flat nor one-hot through all
layers: q/k/v/gate/up ~ N(0, 1/hidden) (unit-variance outputs from the normed input), o_proj and
down ~ N(0, 1/fan_in), so each layer adds O(1) to the residual stream (it grows as sqrt(layers));
the embedding ~ N(0, (4/sqrt(hidden))^2), so the tied head's logits have a standard deviation of
~4 over the vocabulary and the embedding alone does not decide the next token; norms 1; Qwen2's
q/k/v biases ~ N(0, 0.1^2). Rope scaling (Llama-3.2's `llama3` one) is left out of both formats:
the GGUF form of it is a `rope_freqs` tensor that this project's GGUF loader refuses, and the two
formats must hold the same model; it costs nothing at decode.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.live.server import REPO

GGUF_TYPES = ("F16", "Q8_0", "Q4_1")
SHARD_BYTES = 1 << 30  # a safetensors shard holds whole tensors up to about this many bytes


@dataclass(frozen=True)
class Shape:
    """A published config's architecture (what decides the bytes and FLOPs of a step)."""

    arch: str  # "llama" or "qwen2": GGUF architecture and HF model_type
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    tied: bool
    qkv_bias: bool
    rope_theta: float
    rms_eps: float
    context: int


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, True, False, 500000.0, 1e-5, 131072),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, True, True, 1000000.0, 1e-6, 32768),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, True, False, 500000.0, 1e-5, 131072),
}
HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# HF name in a layer -> GGUF name in block i (weights.py reads them back through its own table).
GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


@dataclass(frozen=True)
class Tensor:
    hf: str  # HF name
    gguf: str  # GGUF name
    shape: tuple[int, ...]  # torch order: [out, in] for matrices
    std: float  # 0: a norm's ones


def tensors(s: Shape, vocab: int) -> list[Tensor]:
    """Every tensor of the model, in the order the files hold them."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [Tensor("model.embed_tokens.weight", "token_embd.weight", (vocab, s.hidden), 4 / s.hidden**0.5)]
    for i in range(s.layers):
        layer = [
            ("input_layernorm.weight", (s.hidden,), 0.0),
            ("self_attn.q_proj.weight", (q, s.hidden), s.hidden**-0.5),
            ("self_attn.k_proj.weight", (kv, s.hidden), s.hidden**-0.5),
            ("self_attn.v_proj.weight", (kv, s.hidden), s.hidden**-0.5),
        ]
        if s.qkv_bias:
            layer += [("self_attn.q_proj.bias", (q,), 0.1), ("self_attn.k_proj.bias", (kv,), 0.1)]
            layer += [("self_attn.v_proj.bias", (kv,), 0.1)]
        layer += [
            ("self_attn.o_proj.weight", (s.hidden, q), q**-0.5),
            ("post_attention_layernorm.weight", (s.hidden,), 0.0),
            ("mlp.gate_proj.weight", (s.mlp, s.hidden), s.hidden**-0.5),
            ("mlp.up_proj.weight", (s.mlp, s.hidden), s.hidden**-0.5),
            ("mlp.down_proj.weight", (s.hidden, s.mlp), s.mlp**-0.5),
        ]
        out += [Tensor(f"model.layers.{i}.{n}", f"blk.{i}.{GGUF_LAYER[n]}", shape, std) for n, shape, std in layer]
    out.append(Tensor("model.norm.weight", "output_norm.weight", (s.hidden,), 0.0))
    if not s.tied:
        out.append(Tensor("lm_head.weight", "output.weight", (vocab, s.hidden), 4 / s.hidden**0.5))
    return out


def draw(t: Tensor, seed: int) -> torch.Tensor:
    """The tensor's value, bfloat16: the same for the same (seed, name), whatever else is drawn."""
    if t.std == 0.0:
        return torch.ones(t.shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(t.hf.encode()))
    return (torch.randn(t.shape, generator=gen) * t.std).to(torch.bfloat16)


def permute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's llama converter's q/k row order (each head's halves interleaved); the inverse
    of services.worker.weights.unpermute_rope_rows."""
    # w: [num_heads * head_dim, ...] -> the same, rows of each head reordered (2, pair) -> (pair, 2)
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- GGUF


def gguf_encoding(t: Tensor, kind: str):
    """The GGML type of `t` in a `kind` file."""
    from gguf import GGMLQuantizationType as Q

    if len(t.shape) == 1:
        return Q.F32
    if kind == "F16":
        return Q.F16
    return Q.Q8_0 if t.gguf in ("token_embd.weight", "output.weight") else Q[kind]


def gguf_bytes(shape: tuple[int, ...], qtype) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def encode(value: torch.Tensor, qtype) -> np.ndarray:
    """float32 `value` [rows, cols] (or [cols]) as `qtype` stores it."""
    from gguf import GGMLQuantizationType as Q

    if qtype == Q.F32:
        return value.numpy()
    if qtype == Q.F16:
        return value.half().numpy()
    rows = max(1, (1 << 20) // value.shape[-1])  # ~4 MB of float32 a chunk: its temporaries stay in cache
    return torch.cat([quantize(value[i : i + rows], qtype.name) for i in range(0, value.shape[0], rows)]).numpy()


def quantize(value: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 [rows, cols] -> GGUF's blocks of `kind` (Q8_0 or Q4_1), [rows, cols / 32 * block bytes]
    uint8: the bytes of `gguf.quants.quantize` (llama.cpp's reference rounding), whose numpy code
    takes ~7 (Q8_0) and ~16 (Q4_1) M values/s on one core; these torch ops run on every thread."""
    rows = value.shape[0]
    b = value.reshape(-1, 32)  # one block of 32 values a row
    if kind == "Q8_0":
        d = b.abs().amax(1, keepdim=True) / 127
        x = b * torch.where(d == 0, 0.0, 1 / d)
        q = (x.sign() * (x.abs() + 0.5).floor()).to(torch.int8).view(torch.uint8)  # roundf: half away from 0
        blocks = [d.half().view(torch.uint8), q]  # [n, 2 + 32]
    elif kind == "Q4_1":
        lo, hi = b.amin(1, keepdim=True), b.amax(1, keepdim=True)
        d = (hi - lo) / 15
        q = ((b - lo) * torch.where(d == 0, 0.0, 1 / d) + 0.5).trunc().to(torch.uint8).clamp(0, 15)
        blocks = [d.half().view(torch.uint8), lo.half().view(torch.uint8), q[:, :16] | (q[:, 16:] << 4)]  # [n, 20]
    else:
        raise ValueError(f"no quantizer for {kind}")
    return torch.cat(blocks, 1).reshape(rows, -1)


def open_gguf(path: Path, kind: str, name: str, s: Shape, plan: list[Tensor], tokenizer_fields: dict):
    """A GGUFWriter with the header, metadata and tensor infos written; the data follows."""
    import gguf

    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(name)
    w.add_type("model")
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.mlp)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(s.head_dim)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(len(tokenizer_fields["tokenizer.ggml.tokens"]))
    w.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[kind])  # fmt: skip
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    f = tokenizer_fields
    w.add_tokenizer_model(f["tokenizer.ggml.model"])
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(list(f["tokenizer.ggml.tokens"]))
    w.add_token_types(list(f["tokenizer.ggml.token_type"]))
    w.add_token_merges(list(f["tokenizer.ggml.merges"]))
    for key, add in [("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unknown", w.add_unk_token_id),
                     ("padding", w.add_pad_token_id)]:  # fmt: skip
        if f.get(f"tokenizer.ggml.{key}_token_id") is not None:
            add(int(f[f"tokenizer.ggml.{key}_token_id"]))
    w.add_add_bos_token(bool(f.get("tokenizer.ggml.add_bos_token", False)))
    w.add_add_space_prefix(bool(f.get("tokenizer.ggml.add_space_prefix", False)))
    if f.get("tokenizer.chat_template"):
        w.add_chat_template(f["tokenizer.chat_template"])
    for t in plan:
        qtype = gguf_encoding(t, kind)
        dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
        w.add_tensor_info(t.gguf, t.shape, dtype, gguf_bytes(t.shape, qtype), raw_dtype=qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    return w


def bundled_tokenizer_fields() -> dict:
    from shared.modelfile import default_model_path, gguf_header

    return {k: v for k, v in gguf_header(default_model_path()).fields.items() if k.startswith("tokenizer.")}


# ---------------------------------------------------------------- Hugging Face folder


def hf_config(name: str, s: Shape, vocab: int, bos: int | None, eos: int | None) -> dict:
    cfg = {
        "architectures": [HF_CLASS[s.arch]],
        "model_type": s.arch,
        "hidden_size": s.hidden,
        "intermediate_size": s.mlp,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.context,
        "rms_norm_eps": s.rms_eps,
        "rope_theta": s.rope_theta,
        "tie_word_embeddings": s.tied,
        "vocab_size": vocab,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "_name_or_path": name,
    }
    if s.arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        cfg.update(use_sliding_window=False, sliding_window=s.context, max_window_layers=s.layers)
    return cfg


def write_hf_tokenizer(out: Path) -> None:
    """The bundled GGUF's tokenizer as transformers converts it: tokenizer.json, tokenizer_config.json
    (with the chat template), special_tokens_map.json."""
    from transformers import AutoTokenizer

    from shared.modelfile import default_model_path

    src = default_model_path()
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(out))


class Shards:
    """bfloat16 tensors into model-0000i-of-0000n.safetensors of about SHARD_BYTES, and the index."""

    def __init__(self, out: Path):
        self.out, self.parts, self.current, self.size = out, [], {}, 0

    def add(self, name: str, value: torch.Tensor) -> None:
        nbytes = value.numel() * value.element_size()
        if self.current and self.size + nbytes > SHARD_BYTES:
            self._flush()
        self.current[name] = value.contiguous()
        self.size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = self.out / f"part-{len(self.parts)}.safetensors"
        save_file(self.current, str(tmp), metadata={"format": "pt"})
        self.parts.append((tmp, list(self.current), self.size))
        self.current, self.size = {}, 0

    def close(self) -> None:
        if self.current:
            self._flush()
        n, weight_map = len(self.parts), {}
        for i, (tmp, names, _) in enumerate(self.parts):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
            tmp.rename(self.out / final)
            weight_map.update({name: final for name in names})
        if n > 1:
            total = sum(size for *_, size in self.parts)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


# ---------------------------------------------------------------- the whole model


def synthesize(
    shape: str, out: Path, layers: int | None = None, seed: int = 0, gguf_types=GGUF_TYPES, hf: bool = True
) -> dict:
    """Writes the model's files under `out`; returns {"gguf": {type: path}, "hf": path or None}."""
    s = SHAPES[shape]
    if layers is not None:
        s = Shape(**{**s.__dict__, "layers": layers})
    name = shape if layers is None else f"{shape}-{layers}l"
    out.mkdir(parents=True, exist_ok=True)
    tok = bundled_tokenizer_fields()
    vocab = len(tok["tokenizer.ggml.tokens"])
    plan = tensors(s, vocab)
    paths = {kind: out / f"{name}.{kind}.gguf" for kind in gguf_types}
    writers = {kind: open_gguf(p, kind, name, s, plan, tok) for kind, p in paths.items()}
    hf_dir = out / f"{name}-hf" if hf else None
    shards = None
    if hf_dir is not None:
        hf_dir.mkdir(exist_ok=True)
        bos, eos = tok.get("tokenizer.ggml.bos_token_id"), tok.get("tokenizer.ggml.eos_token_id")
        cfg = hf_config(name, s, vocab, bos, eos)
        (hf_dir / "config.json").write_text(json.dumps(cfg, indent=1))
        gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
        (hf_dir / "generation_config.json").write_text(json.dumps(gen, indent=1))
        write_hf_tokenizer(hf_dir)
        shards = Shards(hf_dir)
    heads = {"attn_q.": s.heads, "attn_k.": s.kv_heads}
    for t in plan:
        value = draw(t, seed)  # bfloat16, torch order
        if shards is not None:
            shards.add(t.hf, value)
        f32 = value.float()
        if s.arch == "llama":  # only llama.cpp's llama converter permutes (qwen2 uses NEOX rope)
            for part, num in heads.items():
                if f".{part}" in t.gguf:
                    f32 = permute_rope_rows(f32, num)
        for kind, w in writers.items():
            w.write_tensor_data(encode(f32, gguf_encoding(t, kind)))
    for w in writers.values():
        w.close()
    if shards is not None:
        shards.close()
    return {"gguf": {k: str(p) for k, p in paths.items()}, "hf": None if hf_dir is None else str(hf_dir)}


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the published config whose shape is built")
    p.add_argument(
        "--out", type=Path, default=None,
        help="folder to write (default bench/results/models/SHAPE, or SHAPE-Nl with --layers)",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (tests)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (default %(default)s)")
    p.add_argument(
        "--gguf", default=",".join(GGUF_TYPES),
        help=f"GGUF types to write, comma-separated, of {','.join(GGUF_TYPES)} (default all; '' none)",
    )  # fmt: skip
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face folder")


def run(args: argparse.Namespace) -> int:
    kinds = [k.strip().upper() for k in args.gguf.split(",") if k.strip()]
    if bad := [k for k in kinds if k not in GGUF_TYPES]:
        print(f"bench synth-model: unknown GGUF type(s) {bad}; choose from {', '.join(GGUF_TYPES)}", file=sys.stderr)
        return 2
    if args.layers is not None and args.layers < 1:
        print("bench synth-model: --layers must be at least 1", file=sys.stderr)
        return 2
    name = args.shape if args.layers is None else f"{args.shape}-{args.layers}l"
    out = args.out or REPO / "bench" / "results" / "models" / name
    start = time.perf_counter()
    written = synthesize(args.shape, out, args.layers, args.seed, kinds, not args.no_hf)
    for kind, path in written["gguf"].items():
        print(f"{kind:5s} {path} ({Path(path).stat().st_size / 1e9:.2f} GB)")
    if written["hf"]:
        size = sum(f.stat().st_size for f in Path(written["hf"]).glob("*.safetensors"))
        print(f"HF    {written['hf']} ({size / 1e9:.2f} GB of bfloat16 safetensors)")
    print(f"wrote {name} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="superinfer bench synth-model", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
