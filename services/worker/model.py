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

import dataclasses
import math

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker import cpu_kernels, cpu_quant, fused_decode
from services.worker.attention import AttentionMetadata, build_metadata, paged_attention, write_kv
from services.worker.host_memory import huge_page_copies
from shared.modelfile import ModelConfig


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Linear(nn.Module):
    """y = x @ W^T (+ b), x: [T, in]. Holds W in the layouts its device multiplies fastest.

    CPU float32, where the native kernels are built (cpu_kernels.py):
    - AVX-512: W in panels of 16 output columns, streamed once per step, for decode steps of a
      few rows (up to `PANEL_MAX_ROWS`, or below `TILES_MIN_ROWS` where AMX tiles are held);
    - AMX: W split into high and low bfloat16 parts in the tile unit's layout (bf16x3, float32
      accuracy less a few bits, csrc) for steps of `TILES_MIN_ROWS` rows and more: prefill
      chunks and wide decode steps;
    - larger steps elsewhere: a copy packed once for oneDNN (as torch.compile's CPU freezing does).
    Without the kernels: a contiguous [in, out] copy, which GEMV streams 10-25% faster than
    [out, in], up to `GEMV_MAX_ROWS` rows, oneDNN above. Measured on this project's 2-core x86
    machine (AVX-512, AMX), the 120 layer matmuls of SmolLM2-135M, float32, 2 threads, ms per
    step, panels / bf16x3 / oneDNN / [in, out] (`superinfer bench matmul`,
    bench/results/matmul_cpu.json): 1 row 20.9 / 22.2 / 28.0 / 19.0, 8 rows 23.8 / 23.8 / 35.3 /
    41.5, 16 rows 34.5 / 26.8 / 44.1 / 52.1, 64 rows 75.9 / 50.3 / 92.1 / 91.0, 512 rows
    540.1 / 319.8 / 507.7 / 506.4. Since the panels' pairs were interleaved (one stream a tile),
    on a machine without AMX, panels / oneDNN / [in, out]: 1 row 14.9 / 24.4 / 27.9, 8 rows
    15.2 / 23.1 / 53.1, 64 rows 73.9 / 80.9 / 123.0 (bench/results/matmul_cpu_pairs.json). The
    price is a second copy of every weight in host memory.

    `gated`: W is an MLP's gate rows then its up rows ([2I, in]) and the layer returns
    silu(gate) * up, [T, I]: in the bfloat16 matmul's last step where that kernel runs (the
    [T, 2I] product never stored), after the product elsewhere.
    """

    PANEL_MAX_ROWS = 128
    TILES_MIN_ROWS = 16
    GEMV_MAX_ROWS = 2

    def __init__(self, weight: torch.Tensor | cpu_quant.QuantWeight, bias: torch.Tensor | None, gated: bool = False):
        super().__init__()
        self.out_features = weight.shape[0]  # W: [out, in]
        self.bias = None if bias is None else _param(bias)
        self.gated = gated
        self.quant = None
        if isinstance(weight, cpu_quant.QuantWeight):
            self.quant = (gated and cpu_quant.pack(weight, gated=True)) or cpu_quant.pack(weight)
            if self.quant is not None and self.quant.gated and bias is not None:
                self.bias = _param(cpu_quant.pair_gate_up(bias))
            if self.quant is not None:
                self.register_buffer("quant_data", self.quant.data)  # counted with the model's buffers
                self.tiles = self.packed = self.panels = self.weight = None
                self._bands = [(math.inf, "quant")]
                return
            weight = weight.dequantize()
        tiles = _tiles_pack(weight)
        self.tiles = None if tiles is None else _param(tiles)
        self.packed = _onednn_pack(weight) if weight.device.type == "cpu" and tiles is None else None
        panels = _panel_pack(weight)
        self.panels = None if panels is None else _param(panels)
        # [in, out]: wherever the panels do not replace it.
        self.weight = _param(weight.t().contiguous()) if panels is None else None
        # Which layout multiplies how many rows, chosen once, here: (up to how many rows, the layout's
        # attribute), in order; the choice changes only at the thresholds.
        bounds = (self.GEMV_MAX_ROWS, self.TILES_MIN_ROWS - 1, self.PANEL_MAX_ROWS, math.inf)
        self._bands = [(rows, self._choose(rows)) for rows in bounds]

    def _choose(self, rows: float) -> str:
        if self.tiles is not None and (rows >= self.TILES_MIN_ROWS or self.panels is None):
            return "tiles"
        if self.panels is not None and (rows <= self.PANEL_MAX_ROWS or self.packed is None):
            return "panels"
        if self.packed is not None and (rows > self.GEMV_MAX_ROWS or self.weight is None):
            return "packed"
        return "weight"

    def _layout(self, rows: int) -> str:
        return next(name for most, name in self._bands if rows <= most)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] ([T, out / 2] where gated)."""
        if self.quant is not None and self.quant.gated:
            return cpu_quant.linear(x, self.quant, self.bias)
        y = self._product(x)
        return silu_and_mul(y) if self.gated else y

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        layout = self._layout(x.shape[0])
        if layout == "quant":
            return cpu_quant.linear(x, self.quant, self.bias)
        if layout == "tiles":
            return cpu_kernels.kernels().linear_bf16x3(x, self.tiles, self.bias)
        if layout == "panels":
            return cpu_kernels.kernels().linear(x, self.panels, self.bias)
        if layout == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)

    def streamed(self) -> list[str]:
        """Names of the attributes holding what a step streams: the packed quantized data, the
        panels, the AMX tiles, the [in, out] copy (not oneDNN's copy: large prefills only)."""
        if self.quant is not None:
            return ["quant_data"]
        return [name for name in ("tiles", "panels", "weight") if getattr(self, name) is not None]

    def replace_streamed(self, name: str, t: torch.Tensor) -> None:
        """Holds `t`, a copy of what `name` (from `streamed`) holds, in its place."""
        if name == "quant_data":
            self.quant = dataclasses.replace(self.quant, data=t)
            self.quant_data = t
        else:
            setattr(self, name, _param(t))

    def native(self, rows: int) -> tuple[int, int, int, int] | None:
        """The native matmul `forward` runs for `rows` rows, for a native caller (fused_decode.py):
        (kernel address, flags: fused_decode.GATED where it writes silu(gate) * up, TEAM where it
        can run as one of its caller's team of threads; weight address, bias address or 0); None
        where `forward` runs a torch op."""
        bias = 0 if self.bias is None else self.bias.data_ptr()
        layout = self._layout(rows)
        if layout == "quant":
            flags = fused_decode.TEAM | (fused_decode.GATED if self.quant.gated else 0)
            name, weight = cpu_quant.kernel_name(self.quant), self.quant.data
        elif layout in ("tiles", "panels"):
            name, flags = ("linear_amx_bf16x3", 0) if layout == "tiles" else ("linear_panels_f32", fused_decode.TEAM)
            weight = getattr(self, layout)
        else:
            return None
        return cpu_kernels.kernels().address(name), flags, weight.data_ptr(), bias


def _panel_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] in the native matmul's panels, or None where that kernel does not apply."""
    native = cpu_kernels.for_tensor(weight)
    return None if native is None else native.pack_panels(weight)


def _tiles_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] in the AMX matmul's bf16x3 tiles, or None where that kernel does not apply."""
    native = cpu_kernels.for_tensor(weight)
    return None if native is None else native.pack_bf16x3(weight)


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
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the original context / low_freq_factor are stretched by
    # `factor`, those shorter than original / high_freq_factor are kept, and the band between
    # is a blend of the two by where the wavelength falls in it.
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, head_dim / 2], the angles of each position (half-split rope layout: the
    same angle turns element i and element i + head_dim / 2)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


# ---------------------------------------------------------------- per-row ops
# Each is one native call on CPU float32 (cpu_kernels.py), else the eager torch ops.


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden], the residual stream: x += delta in place; returns rms_norm(x) * weight."""
    native = cpu_kernels.for_tensor(x)
    if native is not None and x.is_contiguous() and (delta is None or delta.is_contiguous()):
        return native.add_rms_norm_(x, delta, weight, eps)
    if delta is not None:
        x.add_(delta)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x: [T, heads, D] with contiguous heads, rotated in place; cos, sin: [T, D / 2]."""
    native = cpu_kernels.for_tensor(x)
    if native is not None and x.stride()[1:] == (x.shape[2], 1) and cos.is_contiguous() and sin.is_contiguous():
        return native.rope_(x, cos, sin)
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    x1, x2 = x[..., :half], x[..., half:]
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I], gate columns then up columns -> [T, I] = silu(gate) * up."""
    native = cpu_kernels.for_tensor(gate_up)
    if native is not None and gate_up.is_contiguous():
        return native.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate, inplace=True).mul_(up)


AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _cat(parts: list) -> torch.Tensor | cpu_quant.QuantWeight:
    """Output rows of several weights, one after another: packed where all share a format."""
    if all(isinstance(p, cpu_quant.QuantWeight) for p in parts) and len({p.kind for p in parts}) == 1:
        return cpu_quant.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, cpu_quant.QuantWeight) else p for p in parts])


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
        self.qkv = Linear(_cat([w[attn + p + "_proj.weight"] for p in "qkv"]), bias)
        self.o_proj = Linear(w[attn + "o_proj.weight"], None)  # [T, H * D] -> [T, hidden]
        # [T, hidden] -> [T, I] = silu(gate) * up, from one matmul of the gate rows then the up rows.
        self.gate_up = Linear(_cat([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]), None, gated=True)
        self.down = Linear(w[mlp + "down_proj.weight"], None)  # [T, I] -> [T, hidden]
        # Matmuls that round their activations to int8 (cpu_quant.py) turn float differences into
        # different tokens: their attention is batch-invariant (attention.paged_attention), so
        # that a token recomputed after a preemption is the token decoded.
        matmuls = (self.qkv, self.o_proj, self.gate_up, self.down)
        self.batch_invariant = any(m.quant is not None and m.quant.kind in cpu_quant.FORMATS for m in matmuls)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: [T, hidden], the residual stream, updated in place and returned; writes this
        step's K/V into kv_layer."""
        h = add_rms_norm_(x, None, self.input_norm, self.eps)
        h = add_rms_norm_(x, self._attention(h, cos, sin, kv_layer, meta), self.post_norm, self.eps)
        return x.add_(self._mlp(h))

    def _attention(self, h, cos, sin, kv_layer, meta) -> torch.Tensor:
        num_tokens = h.shape[0]
        num_qk = self.num_heads + self.num_kv_heads
        qkv = self.qkv(h)  # [T, (H + 2KV) * D]
        qk = qkv[:, : num_qk * self.head_dim].view(num_tokens, num_qk, self.head_dim)
        rope_(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, D], [T, KV, D]
        v = qkv[:, num_qk * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(kv_layer, k, v, meta)
        out = paged_attention(q, k, v, kv_layer, meta, self.batch_invariant)  # [T, H, D]
        return self._reduce(self.o_proj(out.view(num_tokens, -1)))  # [T, hidden]

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.down(self.gate_up(h)))  # [T, hidden]

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
        # Quantized matrices (cpu_quant.QuantWeight) stay packed on a CPU with the kernels;
        # elsewhere they are dequantized to `dtype` like any float weight.
        quant_here = device.type == "cpu" and dtype == torch.float32 and cpu_kernels.kernels() is not None
        on = {
            name: t if quant_here and isinstance(t, cpu_quant.QuantWeight) else _float(t).to(device=device, dtype=dtype)
            for name, t in weights.items()
        }
        self.embed = _param(_float(on["model.embed_tokens.weight"]))  # [V, hidden], float for the lookup
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
        if device.type == "cpu":  # the matrices a step streams in huge pages (host_memory.py)
            linears = [m for m in self.modules() if isinstance(m, Linear)]
            # The quantized ones cut per thread, each thread's parts end to end (cpu_quant.thread_major).
            quant = [m for m in linears if m.quant is not None and m.quant.kind in cpu_quant.FORMATS]
            for m, placed in zip(quant, cpu_quant.thread_major([m.quant for m in quant], torch.get_num_threads())):
                m.replace_streamed("quant_data", placed.data)
            held = [(m, name) for m in linears if m not in quant for name in m.streamed()]
            copies = huge_page_copies([getattr(m, name).data for m, name in held])
            for (m, name), copy in zip(held, copies):
                m.replace_streamed(name, copy)
        # `decode` through csrc/decode_step.c where it qualifies (the same result to the bit; off:
        # layer by layer, as tests compare).
        self.fused_decode = True

    def decode(
        self,
        kv_pool: torch.Tensor,
        token_ids: list[int],
        positions: list[int],
        tables: list[list[int]],
        sample_rows: list[int],
        pick: bool = False,
    ) -> tuple[torch.Tensor, list[int] | None]:
        """A step of single-token rows (row i: token_ids[i] at positions[i] of a request whose
        block table is tables[i]), the one place that chooses how one runs: in one native call
        where it applies (fused_decode.py), else op by op (`forward`), the same bits either way.
        Returns (logits [S, vocab] of `sample_rows`, which the next step may overwrite; where `pick`
        and the native call ran, each row's argmax, else None)."""
        fused = fused_decode.for_pool(self, kv_pool) if self.fused_decode else None
        out = fused.run(token_ids, positions, tables, sample_rows, pick) if fused is not None else None
        if out is not None:
            return out
        device, block_size = kv_pool.device, kv_pool.shape[3]
        meta = build_metadata(positions, [1] * len(positions), tables, block_size, device)
        ids, pos, rows = (torch.tensor(v, dtype=torch.long).to(device) for v in (token_ids, positions, sample_rows))
        with torch.inference_mode():
            logits = self(ids, pos, meta, kv_pool, rows)
        return logits.clone(), None  # not an inference tensor: the sampler processes rows in place

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
        cos, sin = self._rope(positions, x.dtype)  # [T, D/2]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_pool[:, i], meta)
        h = add_rms_norm_(x[sample_rows], None, self.norm, self.cfg.rms_norm_eps)  # [S, hidden]
        logits = self.lm_head(h) if self.lm_head is not None else F.linear(h, self.embed)
        return logits.float()  # [S, V]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, head_dim / 2] of each position, in `dtype`. On CPU with the native kernels
        from glibc's cosf and sinf, as the fused decode step takes them (the same bits either way)."""
        inv_freq = self._rope_inv_freq(positions.device)
        native = cpu_kernels.for_tensor(inv_freq)
        if native is None or positions.dtype != torch.long or not positions.is_contiguous():
            return rope_cos_sin(positions, inv_freq, dtype)
        cos, sin = native.rope_angles(positions, inv_freq)
        return cos.to(dtype), sin.to(dtype)

    def _rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.cfg).to(device)
        return self._inv_freq[device]


def _float(t: torch.Tensor | cpu_quant.QuantWeight) -> torch.Tensor:
    return t.dequantize() if isinstance(t, cpu_quant.QuantWeight) else t
