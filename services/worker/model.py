"""Our Llama-family model (Llama 2/3, SmolLM, Qwen2): one batched forward per step.

A step's tokens from every scheduled request (prefill chunks and decodes mixed) are
flattened into one sequence of T rows; per-request structure lives only in the
`AttentionMetadata` that attention reads. Linear layers therefore see one [T, hidden]
matrix per layer, whatever the mix. q/k/v are one matmul, gate/up another.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention import AttentionMetadata, paged_attention, write_kv
from shared.modelfile import ModelConfig


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _in_out(w: torch.Tensor) -> torch.Tensor:
    """[out, in] (HF layout) -> contiguous [in, out]."""
    return w.t().contiguous()


def _matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, in] @ w: [in, out] (+ bias: [out])."""
    return x @ w if bias is None else torch.addmm(bias, x, w)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] rotation frequencies, computed as HF does so angles match exactly."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    return 1.0 / (cfg.rope_theta**exponents)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, 1, head_dim] for the half-split (`rotate_half`) rope layout."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] -> rotated copy, same shape."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, fuse_mlp: bool):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        self.input_norm = _param(w[prefix + "input_layernorm.weight"])
        self.post_norm = _param(w[prefix + "post_attention_layernorm.weight"])
        # Projections are stored [in, out] (HF's transpose): x @ w streams the weight in the
        # order CPU GEMV/GEMM reads it best (10-25% faster at batch 1-2, never slower).
        # [hidden, (H + 2*KV) * D]: one matmul for q, k and v.
        self.qkv_weight = _param(_in_out(torch.cat([w[attn + p + "_proj.weight"] for p in "qkv"])))
        self.qkv_bias = (
            _param(torch.cat([w[attn + p + "_proj.bias"] for p in "qkv"])) if cfg.attention_bias else None
        )
        self.o_weight = _param(_in_out(w[attn + "o_proj.weight"]))  # [H * D, hidden]
        # gate and up: [hidden, intermediate] each. Fused into one [hidden, 2 * intermediate]
        # matmul where launches cost (GPU); on CPU two contiguous weights measure faster.
        gate, up = _in_out(w[mlp + "gate_proj.weight"]), _in_out(w[mlp + "up_proj.weight"])
        self.gate_up_weight = _param(torch.cat([gate, up], dim=1)) if fuse_mlp else None
        self.gate_weight = None if fuse_mlp else _param(gate)
        self.up_weight = None if fuse_mlp else _param(up)
        self.down_weight = _param(_in_out(w[mlp + "down_proj.weight"]))  # [intermediate, hidden]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; writes this step's K/V into kv_layer."""
        x = x + self._attention(F.rms_norm(x, x.shape[-1:], self.input_norm, self.eps), cos, sin, kv_layer, meta)
        return x + self._mlp(F.rms_norm(x, x.shape[-1:], self.post_norm, self.eps))

    def _attention(self, h, cos, sin, kv_layer, meta) -> torch.Tensor:
        num_tokens = h.shape[0]
        num_qk = self.num_heads + self.num_kv_heads
        qkv = _matmul(h, self.qkv_weight, self.qkv_bias)  # [T, (H + 2KV) * D]
        qk = apply_rope(qkv[:, : num_qk * self.head_dim].view(num_tokens, num_qk, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, D], [T, KV, D]
        v = qkv[:, num_qk * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(kv_layer, k, v, meta)
        out = paged_attention(q, k, v, kv_layer, meta)  # [T, H, D]
        return out.view(num_tokens, -1) @ self.o_weight

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = (h @ self.gate_up_weight).chunk(2, dim=-1)  # [T, I] each
        else:
            gate, up = h @ self.gate_weight, h @ self.up_weight  # [T, I] each
        return F.silu(gate, inplace=True).mul_(up) @ self.down_weight  # [T, hidden]


class LlamaModel(nn.Module):
    """Built straight from an HF-named weight dict (see weights.py); no random init."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], fuse_mlp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.embed = _param(weights["model.embed_tokens.weight"])  # [V, hidden]
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, weights, f"model.layers.{i}.", fuse_mlp) for i in range(cfg.num_layers)
        )
        self.norm = _param(weights["model.norm.weight"])
        self.lm_head = self.embed if cfg.tie_embeddings else _param(weights["lm_head.weight"])
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: torch.Tensor,
        sample_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of the rows that sample.

        token_ids, positions: [T]; kv_pool: [num_blocks, num_layers, 2, block_size, KV, D];
        sample_rows: [S] row indices into T. Returns [S, vocab] float32.
        """
        x = F.embedding(token_ids, self.embed)  # [T, hidden]
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)  # [T, 1, D]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_pool[:, i], meta)
        h = F.rms_norm(x[sample_rows], x.shape[-1:], self.norm, self.cfg.rms_norm_eps)  # [S, hidden]
        return F.linear(h, self.lm_head).float()  # [S, V]
