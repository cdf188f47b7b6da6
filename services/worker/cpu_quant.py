"""Block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1) kept packed, and the native matmul that reads
them (csrc/quant_matmul.c, built with the other kernels by cpu_kernels.py); bfloat16 weights
(float32 activations) the same way (csrc/bf16_matmul.c, vdpbf16ps).

A `QuantWeight` is a [N, K] matrix as GGUF stores it: per output row, K / 32 blocks of a float16
scale (and, for Q4_1, a float16 minimum) and 32 quantized values. `pack` rewrites it once in the
kernel's panels of 16 output columns (layout in the csrc file); `linear` multiplies, on
AVX512-VNNI, on AVX2 (the same integer sums and the same bits), or on a portable C loop. The
activations are quantized to int8 per row and block of 32 inside the kernel, as llama.cpp's
quantized dot products do, so a product differs from the dequantize-then-matmul reference by
that rounding (~0.5% of the output's scale); `set_float_rows` sends steps of a few rows through
a float32 path instead (weights dequantized in registers, activations unrounded).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import numpy as np
import torch

from services.worker import cpu_kernels
from services.worker.host_memory import huge_page_host_tensor

FORMATS = ("q8_0", "q4_0", "q4_1")  # GGUF's, served as they are
WEIGHT_FORMATS = (*FORMATS, "bf16")  # bf16: raw is the [N, K] bfloat16 matrix itself
BLOCK = 32  # inputs per block, every format
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
LAYOUT = 64  # bytes of the line before a quantized pack's panels


def _ggml_type(kind: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[kind.upper()]


@dataclass
class QuantWeight:
    """raw: [N, K / 32 * block bytes] uint8, GGUF's blocks of each output row."""

    kind: str
    raw: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str) -> QuantWeight:
        """weight [N, K] float -> `kind` (K a multiple of 32), rounded as GGUF's own quantizer does."""
        from gguf import quants

        if kind == "bf16":
            return cls(kind, weight.detach().to(torch.bfloat16).contiguous(), tuple(weight.shape))
        w = weight.detach().float().contiguous().numpy()
        raw = quants.quantize(w, _ggml_type(kind))
        return cls(kind, torch.from_numpy(np.ascontiguousarray(raw)), tuple(weight.shape))

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        from gguf import quants

        if self.kind == "bf16":
            return self.raw.float()
        out = quants.dequantize(self.raw.numpy(), _ggml_type(self.kind))
        return torch.from_numpy(np.array(out, dtype=np.float32).reshape(self.shape))

    def rows(self, reorder) -> QuantWeight:
        """The same weight with its output rows reordered by `reorder` ([N, ...] -> [N, ...])."""
        return QuantWeight(self.kind, reorder(self.raw).contiguous(), self.shape)

    @property
    def nbytes(self) -> int:
        return self.raw.numel() * self.raw.element_size()


def cat(parts: list[QuantWeight]) -> QuantWeight:
    """Output rows of several weights of one format, one after another."""
    assert len({p.kind for p in parts}) == 1 and len({p.shape[1] for p in parts}) == 1
    raw = torch.cat([p.raw for p in parts])
    return QuantWeight(parts[0].kind, raw, (sum(p.shape[0] for p in parts), parts[0].shape[1]))


@dataclass
class PackedQuant:
    """A weight in the kernel's panels (csrc/quant_matmul.c has the layout): N / 16 panels of
    `panel_bytes` each (bf16: data, bfloat16, is the panels). The quantized formats' data is the
    line that says where the panels lie, then the panels: all of them (`pack`), or where the
    weight is cut per thread (`thread_major`), the first thread's part, the others' further on.
    gated: an MLP's gate and up rows packed for linear_bf16_gated (silu(gate) * up, N / 2 columns)."""

    kind: str
    data: torch.Tensor
    num_out: int
    num_in: int
    gated: bool = False
    panel_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the matrix, what a step reads of it."""
        return self.num_out // 16 * self.panel_bytes if self.kind in FORMATS else self.data.numel() * 2


def pack(weight: QuantWeight, gated: bool = False) -> PackedQuant | None:
    """`weight` in the native kernel's layout; None where the kernels are not built or N % 16.
    gated: `weight` is an MLP's gate rows then its up rows ([2I, K]), packed for the matmul that
    returns silu(gate) * up (bf16 only, I a multiple of 16; None elsewhere)."""
    native = cpu_kernels.kernels()
    num_out, num_in = weight.shape
    if native is None or num_out % native.panel or num_in % BLOCK:
        return None
    if gated and (weight.kind != "bf16" or num_out % (2 * native.panel)):
        return None
    if weight.kind == "bf16":
        if not bf16_fast():
            return None
        data = torch.empty(num_out * num_in, dtype=torch.bfloat16)
        fn = native.lib.pack_bf16_panels
        fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        dense = weight.dequantize()  # held until the call returns
        if gated:
            dense = pair_gate_up(dense)
        fn(dense.data_ptr(), num_out, num_in, data.data_ptr())
        return PackedQuant("bf16", data, num_out, num_in, gated)
    panels, blocks = num_out // 16, num_in // BLOCK
    blk = weight.raw.numpy().reshape(num_out, blocks, _BLOCK_BYTES[weight.kind])
    d = blk[..., 0:2].copy().view(np.float16)[..., 0]  # [N, blocks]
    if weight.kind == "q4_1":
        qs = blk[..., 4:20]
    elif weight.kind == "q4_0":
        qs = blk[..., 2:18]
    else:
        qs = (blk[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    # qs [N, blocks, 16 or 32] -> [panel, block, vector i, column c, r]: byte 4i + r of column c
    groups = qs.shape[-1] // 4
    q = qs.reshape(panels, 16, blocks, groups, 4).transpose(0, 2, 3, 1, 4).reshape(panels, blocks, -1)
    ds = np.ascontiguousarray(d.reshape(panels, 16, blocks).transpose(0, 2, 1)).view(np.uint8)  # [P, B, 32]
    if weight.kind == "q4_1":  # each block's q, then its 16 d and 16 m
        m = blk[..., 2:4].copy().view(np.float16)[..., 0]
        ms = np.ascontiguousarray(m.reshape(panels, 16, blocks).transpose(0, 2, 1)).view(np.uint8)
        data = np.concatenate([q, ds, ms], axis=-1).reshape(-1)
    else:  # blocks in pairs: both blocks' 16 d, then their q (m = -2^(bits-1) d, computed)
        odd = blocks % 2
        if odd:  # the last block: its d, 32 bytes of padding (a zero block's d), its q
            q, ds = (np.concatenate([a, np.zeros_like(a[:, :1])], axis=1) for a in (q, ds))
        pairs = np.concatenate([ds.reshape(panels, -1, 64), q.reshape(panels, -1, 2 * q.shape[-1])], axis=-1)
        data = pairs.reshape(panels, -1)[:, : pairs[0].size - odd * q.shape[-1]].reshape(-1)
    data = np.concatenate([_layout(panels, 0), data])
    return PackedQuant(weight.kind, torch.from_numpy(data), num_out, num_in, panel_bytes=(data.size - LAYOUT) // panels)


def thread_major(packs: list[PackedQuant], parts: int) -> list[PackedQuant]:
    """The quantized `packs` (from `pack`) in one huge-page region, each cut in `parts` parts of
    ceil(panels / parts) panels, and part t of each laid right after part t of the one before.
    A step's matmuls on `parts` threads each give thread t its part (csrc/quant_matmul.c,
    `thread_panels`), so every thread reads one stream from the step's first matrix to its last,
    where split by matrix each thread started a stream anew at every matrix; on any other thread
    count the result is the same to the bit. The region is `parts` equal runs, each part given the
    room of the longest (a matrix of few panels a thread takes up to a panel a thread more); a
    pack's data is its room in the first run (its layout line and its first part)."""
    pers = [-(-(p.num_out // 16) // parts) for p in packs]  # panels per part
    rooms = [LAYOUT + per * p.panel_bytes for p, per in zip(packs, pers)]
    run = sum(rooms)  # bytes from one thread's run to the next
    region = huge_page_host_tensor((parts * run,), torch.uint8)
    placed, at = [], 0
    for p, per, room in zip(packs, pers, rooms):
        panels, size = p.num_out // 16, p.panel_bytes
        assert p.kind in FORMATS and int(p.data[:8].view(torch.int64)) == panels, "takes packs from pack(), uncut"
        for t in range(parts):
            first, last = min(t * per, panels), min((t + 1) * per, panels)
            start = t * run + at + LAYOUT
            region[start : start + (last - first) * size] = p.data[LAYOUT + first * size : LAYOUT + last * size]
        region[at : at + LAYOUT] = torch.from_numpy(_layout(per, run))
        placed.append(replace(p, data=region[at : at + room]))
        at += room
    return placed


def _layout(part_panels: int, part_stride: int) -> np.ndarray:
    """The line before a pack's panels (csrc/quant_matmul.c, `panel_at`): panels per part, and the
    bytes from one part's first panel to the next part's."""
    line = np.zeros(LAYOUT // 8, dtype=np.int64)
    line[:2] = part_panels, part_stride
    return line.view(np.uint8)


def pair_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows (a weight's, or a bias's elements) in a gated pack's order: 16 gate rows,
    the same 16 up rows, the next 16 gate rows, ...: each pair of panels one of each."""
    panel = cpu_kernels.kernels().panel
    return t.view(2, -1, panel, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


QUANT_PATHS = ("portable", "avx2", "vnni")  # csrc/quant_matmul.c's paths, slowest first


def quant_path() -> str:
    """The path the quantized matmul runs here: "vnni" (AVX512-VNNI), "avx2" (AVX2 with FMA and
    F16C), "portable" (a slow C loop), or "" without the kernels."""
    native = cpu_kernels.kernels()
    return QUANT_PATHS[native.lib.quant_matmul_path(-1)] if native is not None else ""


def quant_fast() -> bool:
    """Whether the quantized matmul runs vectorised here (AVX512-VNNI or AVX2), not on the slow
    portable loop."""
    return quant_path() not in ("", "portable")


def limit_path(most: str) -> str:
    """Run no path faster than `most` (one of QUANT_PATHS; "vnni": the fastest the CPU has) from
    now on, for tests; returns the path that runs."""
    return QUANT_PATHS[cpu_kernels.kernels().lib.quant_matmul_path(QUANT_PATHS.index(most))]


def bf16_fast() -> bool:
    """Whether the bfloat16 matmul runs on AVX512-BF16 here (else it is not used)."""
    native = cpu_kernels.kernels()
    return native is not None and bool(native.lib.bf16_matmul_path(0))


_KERNELS = {"q4_1": "linear_q4", "q4_0": "linear_q4_0", "q8_0": "linear_q8", "bf16": "linear_bf16"}


def kernel_name(packed: PackedQuant) -> str:
    """The library's matmul for `packed`."""
    return _KERNELS[packed.kind] + ("_gated" if packed.gated else "")


def linear(x: torch.Tensor, packed: PackedQuant, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous) . W^T (+ bias) -> [M, N] float32; gated: [M, N / 2] = silu(gate) * up."""
    out_cols = packed.num_out // 2 if packed.gated else packed.num_out
    kernel = cpu_kernels.kernels().matmul(kernel_name(packed))
    return cpu_kernels._linear(kernel, x, packed.data, packed.num_out, bias, out_cols)


def set_float_rows(rows: int) -> int:
    """Steps of at most `rows` rows (up to 4) multiply with the weights dequantized to float32 in
    registers and the activations as they are (AVX512-VBMI), instead of int8 dot products, where
    the VNNI path runs; returns the limit in force (0 where the CPU lacks VBMI)."""
    return int(cpu_kernels.kernels().lib.quant_matmul_dequant_rows(int(rows)))


def use_portable(on: bool) -> bool:
    """Force (or stop forcing) the portable C loop; returns whether a vectorised path (AVX512-VNNI
    or AVX2) runs."""
    return limit_path("portable" if on else "vnni") != "portable"
