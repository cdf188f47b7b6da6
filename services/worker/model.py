"""Our Llama-family model (Llama 2/3, SmolLM, Qwen2): one batched forward per step.

A step's tokens from every scheduled request (prefill chunks and decodes mixed) are
flattened into one sequence of T rows; per-request structure lives only in the
`AttentionMetadata` that attention reads. Linear layers therefore see one [T, hidden]
matrix per layer, whatever the mix. q/k/v are one matmul (and one rope call for q and k),
gate/up another.

Under tensor parallelism (tp.py) each rank builds this model from its shard of the weights and
a config with its share of the heads and MLP rows; `all_reduce` then sums the partial outputs
of o_proj and down. With one rank it is None and the layers run no collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention import AttentionMetadata, paged_attention, write_kv
from shared.modelfile import ModelConfig


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Linear(nn.Module):
    """y = x @ W^T (+ b), x: [T, in]. Holds W once, in the layout its device multiplies fastest.

    CPU: packed once for oneDNN (as torch.compile's CPU freezing does). Against torch's
    default sgemm on the same float32 weights (AMD EPYC, one thread) it measured 2.2x faster
    at T >= 16 and within 10% at T = 1. Elsewhere, or where the build lacks the op: a
    contiguous [in, out] copy, which CPU GEMV also streams 10-25% faster than [out, in].
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.bias = None if bias is None else _param(bias)
        self.packed = _onednn_pack(weight) if weight.device.type == "cpu" else None
        # [in, out]; empty when packed (the packed copy is the only one kept).
        self.weight = _param(weight.new_empty(0) if self.packed is not None else weight.t().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]"""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] packed for oneDNN, or None where this torch build cannot."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        probe = torch.ops.mkldnn._linear_pointwise(weight.new_zeros(1, weight.shape[1]), packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return packed if probe.shape == (1, weight.shape[0]) else None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] rotation frequencies, computed as HF does so angles match exactly."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    return 1.0 / (cfg.rope_theta**exponents)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, 1, head_dim] for the half-split (`rotate_half`) rope layout."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] -> rotated copy, same shape."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


AllReduce = Callable[[torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, all_reduce: AllReduce | None = None
    ):
        """`w` holds this layer's HF-named tensors, already on the target device and dtype."""
        super().__init__()
        self.all_reduce = all_reduce
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        self.input_norm = _param(w[prefix + "input_layernorm.weight"])
        self.post_norm = _param(w[prefix + "post_attention_layernorm.weight"])
        # One matmul for q, k and v: [T, hidden] -> [T, (H + 2*KV) * D].
        bias = torch.cat([w[attn + p + "_proj.bias"] for p in "qkv"]) if cfg.attention_bias else None
        self.qkv = Linear(torch.cat([w[attn + p + "_proj.weight"] for p in "qkv"]), bias)
        self.o_proj = Linear(w[attn + "o_proj.weight"], None)  # [T, H * D] -> [T, hidden]
        # [T, hidden] -> [T, 2 * I]: gate columns, then up columns.
        self.gate_up = Linear(torch.cat([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]), None)
        self.down = Linear(w[mlp + "down_proj.weight"], None)  # [T, I] -> [T, hidden]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; writes this step's K/V into kv_layer."""
        h = F.rms_norm(x, x.shape[-1:], self.input_norm, self.eps)
        x = x + self._attention(h, cos, sin, kv_layer, meta)
        return x + self._mlp(F.rms_norm(x, x.shape[-1:], self.post_norm, self.eps))

    def _attention(self, h, cos, sin, kv_layer, meta) -> torch.Tensor:
        num_tokens = h.shape[0]
        num_qk = self.num_heads + self.num_kv_heads
        qkv = self.qkv(h)  # [T, (H + 2KV) * D]
        qk = apply_rope(qkv[:, : num_qk * self.head_dim].view(num_tokens, num_qk, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, D], [T, KV, D]
        v = qkv[:, num_qk * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(kv_layer, k, v, meta)
        out = paged_attention(q, k, v, kv_layer, meta)  # [T, H, D]
        return self._reduce(self.o_proj(out.view(num_tokens, -1)))  # [T, hidden]

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)  # [T, I] each
        return self._reduce(self.down(F.silu(gate, inplace=True).mul_(up)))  # [T, hidden]

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """partial: [T, hidden], this rank's share of the sum; the sum over ranks."""
        return partial if self.all_reduce is None else self.all_reduce(partial)


class LlamaModel(nn.Module):
    """Built straight from an HF-named weight dict (see weights.py); no random init, and not
    meant to be moved with `.to()` afterwards (CPU weights are packed for oneDNN)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        all_reduce: AllReduce | None = None,
    ):
        """Built for one device and dtype: the weight layouts depend on them. `all_reduce`
        (tensor parallelism only) sums a layer's partial outputs over the ranks."""
        super().__init__()
        self.cfg = cfg
        device = torch.device(device)
        on = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
        self.embed = _param(on["model.embed_tokens.weight"])  # [V, hidden]
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, on, f"model.layers.{i}.", all_reduce) for i in range(cfg.num_layers)
        )
        self.norm = _param(on["model.norm.weight"])
        head = on["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]  # [V, hidden]
        # On CPU a packed copy even when tied (~2x faster logits for the price of one more
        # [V, hidden] in host memory); on GPU a tied head reuses the embedding, no copy.
        self.lm_head = Linear(head, None) if device.type == "cpu" or not cfg.tie_embeddings else None
        # Not a buffer: `.to(dtype=bfloat16)` would round the frequencies; kept float32 per device.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

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
        cos, sin = rope_cos_sin(positions, self._rope_inv_freq(positions.device), x.dtype)  # [T, 1, D]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_pool[:, i], meta)
        h = F.rms_norm(x[sample_rows], x.shape[-1:], self.norm, self.cfg.rms_norm_eps)  # [S, hidden]
        logits = self.lm_head(h) if self.lm_head is not None else F.linear(h, self.embed)
        return logits.float()  # [S, V]

    def _rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.cfg).to(device)
        return self._inv_freq[device]
