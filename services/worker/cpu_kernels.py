"""Native CPU kernels (csrc/*.c, one file per kernel family, every exported function declared in
csrc/kernels.h), compiled with the machine's C compiler into one shared library by
kernel_build.py: when the package installs, by `superinfer kernels build`, else on first use.

The sources are plain C with OpenMP (no torch headers), so a build takes a few seconds; the
library is cached under `$SUPERINFER_CACHE_DIR` (default ~/.cache/superinfer). The kernels'
limits (head sizes, panel widths, tile shapes) come from the library (`kernel_limits`).
It links libgomp by soname, so inside a process that imported torch it runs on the OpenMP
runtime torch already loaded, with torch's thread count.

Where no compiler is found or the build fails, `kernels()` returns None and the callers keep
their torch path; `SUPERINFER_CPU_KERNELS=off` forces that path. Every kernel takes float32
CPU tensors (`applies` says whether a tensor qualifies), and the attention kernels read a KV pool
of float32 or bfloat16 (`applies_kv`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from collections.abc import Callable

import structlog
import torch

from services.worker.kernel_build import build

ENV_SWITCH = "SUPERINFER_CPU_KERNELS"
LIMITS = ("max_heads", "max_head_dim", "panel", "pf_keys", "pf_rows", "amx_n", "amx_k", "qblock")  # csrc/limits.c

log = structlog.get_logger("worker")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class CpuKernels:
    """The library's entry points, each a method taking tensors."""

    def __init__(self, lib: ctypes.CDLL):
        f, c_int = ctypes.c_float, ctypes.c_int
        self.lib = lib
        limits = (_i64 * len(LIMITS))()
        _bind(lib.kernel_limits, [_ptr, _i64], restype=_i64)(limits, len(LIMITS))
        # max_heads, max_head_dim, panel, pf_keys, pf_rows, amx_n, amx_k, qblock
        for name, value in zip(LIMITS, limits):
            setattr(self, name, value)
        self._attention = _bind(lib.paged_decode_attention_spans, [_ptr, _i64, _ptr, c_int, _i64, _i64, _ptr, _i64,
                                _ptr, _ptr] + [_i64] * 5 + [f, c_int, c_int], restype=c_int)  # fmt: skip
        # Absent where the compiler does not target AVX-512 (csrc: paged prefill attention).
        prefill = getattr(lib, "paged_prefill_attention_f32", None)
        self._prefill = prefill and _bind(prefill, [_ptr, _i64, _ptr, c_int, _i64, _i64, _ptr, _i64, _i64, _ptr]
                                          + [_i64] * 4 + [f, c_int, c_int], restype=c_int)  # fmt: skip
        # Over a bfloat16 pool its products on vdpbf16ps, where the compiler targets AVX512-BF16.
        self.prefill_bf16 = bool(prefill) and bool(lib.prefill_bf16_products())
        self._add_rms_norm = _bind(lib.add_rms_norm_f32, [_ptr, _ptr, _ptr, f, _ptr, _i64, _i64, c_int])
        self._rope = _bind(lib.rope_f32, [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, c_int])
        self._rope_angles = _bind(lib.rope_angles_f32, [_ptr, _i64, _ptr, _i64, _ptr, _ptr])
        self._silu_and_mul = _bind(lib.silu_and_mul_f32, [_ptr, _ptr, _i64, _i64, c_int])
        self._argmax = _bind(lib.argmax_rows_f32, [_ptr, _i64, _i64, _ptr])
        self._sample = _bind(lib.sample_rows_f32, [_ptr, _i64, _i64] + [_ptr] * 6, restype=c_int)
        self._write_kv = _bind(lib.write_kv_f32, [_ptr, _ptr, _i64, _ptr, c_int, _i64, _i64, _ptr, _ptr, _i64, _i64])
        self._copy_blocks = _bind(lib.copy_blocks, [_ptr, _ptr, _i64, _ptr, _ptr, _i64])
        self._read_words = _bind(lib.read_words, [_ptr, _i64, c_int], restype=ctypes.c_uint64)
        self._core_latency = _bind(lib.core_latency_ns, [c_int], restype=ctypes.c_double)
        # Absent where the compiler does not target AVX-512 (csrc: small-batch matmul).
        panels = getattr(lib, "linear_panels_f32", None)
        self._linear = panels and self.matmul("linear_panels_f32")
        # Absent where the compiler does not target AMX; unused where the OS refuses its state.
        amx = getattr(lib, "linear_amx_bf16x3", None)
        self._amx = None
        if amx is not None and lib.amx_enable():
            self._amx = self.matmul("linear_amx_bf16x3")
            self._pack_amx = _bind(lib.pack_bf16x3, [_ptr, _i64, _i64, _ptr])

    @functools.cache
    def matmul(self, name: str) -> Callable:
        """The library's matmul `name` (a linear_fn, csrc/kernels.h), for `_linear`."""
        c_int = ctypes.c_int
        return _bind(getattr(self.lib, name), [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, c_int], c_int)

    def address(self, name: str) -> int:
        """The address of the library's function `name`, for a native caller (csrc/decode_step.c)."""
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value

    @staticmethod
    def applies(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.dtype == torch.float32

    @staticmethod
    def applies_kv(t: torch.Tensor) -> bool:
        """A KV pool (or a view of one) the attention kernels read."""
        return t.device.type == "cpu" and t.dtype in KV_DTYPES

    # ------------------------------------------------------------ attention

    def supports_decode(self, q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
        """q: [R, H, D]; kv_layer: [N, 2, B, KV, D], a layer's strided view of the pool."""
        _, _, _, num_kv, head_dim = kv_layer.shape
        return (
            self.applies(q)
            and self.applies_kv(kv_layer)
            and q.stride(2) == 1
            and q.stride(1) == head_dim
            and kv_layer.stride()[2:] == (num_kv * head_dim, head_dim, 1)
            and q.shape[1] <= self.max_heads
            and head_dim <= self.max_head_dim
        )

    def decode_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor, context_lens: torch.Tensor,
        invariant: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Decode attention over the pool without gathering the context. q: [R, H, D];
        block_ids: [R, max_blocks] long; context_lens: [R] long (keys per row, the new
        token's included). Returns [R, H, D]. invariant: each row's result depends on its own
        query and keys alone, not on the other rows or the thread count (fixed spans)."""
        num_rows, num_heads, head_dim = q.shape
        _, _, block_size, num_kv, _ = kv_layer.shape
        out = torch.empty((num_rows, num_heads, head_dim), dtype=q.dtype)
        failed = self._attention(
            q.data_ptr(), q.stride(0),
            kv_layer.data_ptr(), is_bf16(kv_layer), kv_layer.stride(0), kv_layer.stride(1),
            block_ids.data_ptr(), block_ids.shape[1], context_lens.data_ptr(), out.data_ptr(),
            num_rows, num_heads, num_kv, head_dim, block_size,
            head_dim**-0.5, 0 if invariant else _threads(), _threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"no memory for the scratch of a {num_rows}-row decode attention")
        return out

    @property
    def has_prefill(self) -> bool:
        """Whether the prefill kernel was built (it needs AVX-512)."""
        return self._prefill is not None

    def supports_prefill(self, q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
        """As `supports_decode`, for `prefill_attention`: built here, a head size in steps of
        `pf_keys` and at most `pf_rows` query heads per KV head."""
        num_heads, num_kv = q.shape[1], kv_layer.shape[3]
        return (
            self.has_prefill
            and self.supports_decode(q, kv_layer)
            and q.shape[2] % self.pf_keys == 0
            and num_heads // num_kv <= self.pf_rows
        )

    def prefill_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor, num_cached: int,
        bf16_products: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """Causal attention of one prefill chunk over its request's keys in the pool (its own
        already written). q: [n, H, D], the queries of positions num_cached .. num_cached + n - 1;
        block_ids: [blocks] long, covering them. Returns [n, H, D]. Over a bfloat16 pool, where
        `prefill_bf16` and `bf16_products`, Q and the softmax's P are rounded to bfloat16 and both
        products run on vdpbf16ps (half the instructions, float32 sums, as a bfloat16 model
        computes them); otherwise in float32, the same to the bit over either pool."""
        q_len, num_heads, head_dim = q.shape
        _, _, block_size, num_kv, _ = kv_layer.shape
        out = torch.empty((q_len, num_heads, head_dim), dtype=q.dtype)
        failed = self._prefill(
            q.data_ptr(), q.stride(0),
            kv_layer.data_ptr(), is_bf16(kv_layer), kv_layer.stride(0), kv_layer.stride(1),
            block_ids.data_ptr(), num_cached, q_len, out.data_ptr(),
            num_heads, num_kv, head_dim, block_size,
            head_dim**-0.5, int(bf16_products), _threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"no memory for the tiles of a {q_len}-row prefill attention")
        return out

    # ------------------------------------------------------------ per-row ops

    def add_rms_norm_(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """x: [T, n] contiguous, += delta ([T, n] contiguous) in place; returns rms_norm(x) * weight."""
        out = torch.empty_like(x)
        d = 0 if delta is None else delta.data_ptr()
        self._add_rms_norm(x.data_ptr(), d, weight.data_ptr(), eps, out.data_ptr(), *x.shape, _threads())
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x: [T, heads, D], heads contiguous, rotated in place; cos, sin: [T, D / 2] contiguous."""
        num_rows, num_heads, head_dim = x.shape
        self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), num_rows, num_heads, head_dim, _threads())

    def rope_angles(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64, inv_freq: [D / 2] float32, both contiguous -> cos, sin: [T, D / 2]
        float32 of each position's angles (model.rope_cos_sin's, within an ulp; the fused decode
        step computes the same)."""
        cos = torch.empty(positions.shape[0], inv_freq.shape[0])
        sin = torch.empty_like(cos)
        self._rope_angles(positions.data_ptr(), positions.shape[0], inv_freq.data_ptr(), inv_freq.shape[0],
                          cos.data_ptr(), sin.data_ptr())  # fmt: skip
        return cos, sin

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2n] contiguous -> [T, n] = silu(gate) * up."""
        num_rows, width = gate_up.shape
        out = gate_up.new_empty((num_rows, width // 2))
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), num_rows, width // 2, _threads())
        return out

    # ------------------------------------------------------------ sampling

    def argmax(self, x: torch.Tensor) -> list[int]:
        """x: [T, n] contiguous -> each row's first index of its largest value (torch's argmax)."""
        out = (ctypes.c_int64 * x.shape[0])()  # not a tensor: see `sample`
        self._argmax(x.data_ptr(), *x.shape, ctypes.addressof(out))
        return list(out)

    def sample(
        self,
        logits: torch.Tensor,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        min_p: list[float],
        u: list[float],
    ) -> list[int]:
        """logits: [R, V] contiguous -> one drawn id per row: the row divided by its temperature
        (> 0, rounded to float32 as a float32 tensor of them would be), filtered by its top_k (0:
        none), top_p (>= 1: none) and min_p (0: none), drawn with its uniform u in [0, 1)
        (csrc/sampling.c)."""
        num_rows, vocab = logits.shape
        # ctypes arrays, not tensors: after a step has streamed the weights through the caches,
        # each torch op costs ~25 us, more than the kernel's work on a row.
        longs, doubles = ctypes.c_int64 * num_rows, ctypes.c_double * num_rows
        out = longs()
        temperature = (ctypes.c_float * num_rows)(*temperature)
        args = (temperature, longs(*top_k), doubles(*top_p), doubles(*min_p), doubles(*u), out)
        if self._sample(logits.data_ptr(), num_rows, vocab, *map(ctypes.addressof, args)):
            raise MemoryError("no memory for the sampler's scratch")
        return list(out)

    # ------------------------------------------------------------ small-batch matmul

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor | None:
        """weight [N, K] as the matmul kernel reads it: pairs of 16-column panels interleaved,
        [N / 32, K, 32], then an odd last panel [K, 16], flat; None where the kernel is not built
        or does not take this weight (N not a multiple of 16)."""
        if self._linear is None or not self.applies(weight) or weight.shape[0] % self.panel:
            return None
        num_out, num_in = weight.shape
        paired = num_out // (2 * self.panel) * 2 * self.panel
        pairs = weight[:paired].reshape(-1, 2 * self.panel, num_in).transpose(1, 2)
        return torch.cat([pairs.reshape(-1), weight[paired:].t().reshape(-1)])

    def linear(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] (rows contiguous) . W^T (+ bias) -> [M, N], W packed by `pack_panels`."""
        return _linear(self._linear, x, panels, panels.numel() // x.shape[1], bias)

    # ------------------------------------------------------------ prefill matmul (AMX, bf16x3)

    def pack_bf16x3(self, weight: torch.Tensor) -> torch.Tensor | None:
        """weight [N, K] as the AMX kernel reads it: [N / 16, K / 32, 2, 16, 32] bfloat16, each
        value's high and low bfloat16 parts (4 bytes a weight, as float32); None where the kernel
        is not built or usable here, or does not take this shape (N % 16, K % 32)."""
        if self._amx is None or not self.applies(weight) or weight.shape[0] % self.amx_n or weight.shape[1] % self.amx_k:
            return None
        num_out, num_in = weight.shape
        weight = weight.contiguous()
        n, k = self.amx_n, self.amx_k
        packed = torch.empty((num_out // n, num_in // k, 2, n, k), dtype=torch.bfloat16)
        self._pack_amx(weight.data_ptr(), num_out, num_in, packed.data_ptr())
        return packed

    def linear_bf16x3(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] (rows contiguous) . W^T (+ bias) -> [M, N] float32, W packed by `pack_bf16x3`."""
        return _linear(self._amx, x, packed, packed.shape[0] * self.amx_n, bias)

    # ------------------------------------------------------------ KV stores and copies

    def supports_write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta) -> bool:
        """k, v: [T, KV, D] with contiguous heads, rows equally far apart; kv_layer: [N, 2, B, KV,
        D], a layer's strided view of the pool; the slots as contiguous long tensors."""
        _, _, _, num_kv, head_dim = kv_layer.shape
        slots = (meta.slot_blocks, meta.slot_offsets)
        return (
            self.applies(k)
            and self.applies(v)
            and self.applies_kv(kv_layer)
            and k.stride() == v.stride()
            and k.stride()[1:] == (head_dim, 1)
            and kv_layer.stride()[2:] == (num_kv * head_dim, head_dim, 1)
            and all(t.dtype == torch.long and t.device.type == "cpu" and t.is_contiguous() for t in slots)
        )

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> None:
        """Row t of k and v into slot meta.slot_offsets[t] of block meta.slot_blocks[t], rounded
        to the pool's dtype as torch rounds (where `supports_write_kv` holds)."""
        num_rows, num_kv, head_dim = k.shape
        self._write_kv(
            k.data_ptr(), v.data_ptr(), k.stride(0), kv_layer.data_ptr(), is_bf16(kv_layer), kv_layer.stride(0),
            kv_layer.stride(1), meta.slot_blocks.data_ptr(), meta.slot_offsets.data_ptr(), num_rows, num_kv * head_dim,
        )  # fmt: skip

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
        """dst[d] = src[s] for each pair, whole blocks of two contiguous pools of one block
        shape, on the calling thread alone (any dtype); the GIL is released meanwhile."""
        num = len(src_ids)
        ids = (_i64 * (2 * num))(*src_ids, *dst_ids)
        block_bytes = src[0].numel() * src.element_size()
        self._copy_blocks(src.data_ptr(), dst.data_ptr(), block_bytes, ids, ctypes.addressof(ids) + 8 * num, num)

    # ------------------------------------------------------------ memory

    def read(self, t: torch.Tensor, threads: int | None = None) -> int:
        """One streaming read of `t`'s bytes (contiguous, 64-byte aligned, a multiple of 64 bytes)
        on `threads` threads (default torch's), each a contiguous share; returns the sum of its
        64-bit words (what the read computes, so that it is not optimised away)."""
        num_bytes = t.numel() * t.element_size()
        assert t.is_contiguous() and t.data_ptr() % 64 == 0 and num_bytes % 64 == 0
        return self._read_words(t.data_ptr(), num_bytes, threads or _threads())

    def core_latency_ns(self, rounds: int = 2000) -> float:
        """Nanoseconds a cache line takes from one core to another (two threads passing a counter;
        csrc/read.c): ~40 where the cores share a cache, ~170 where they do not. 0 on one core."""
        return self._core_latency(rounds)


def _linear(
    kernel, x: torch.Tensor, packed: torch.Tensor, num_out: int, bias: torch.Tensor | None, out_cols: int | None = None
) -> torch.Tensor:
    """y = x . W^T (+ bias) through a native matmul taking (x, ldx, W, bias, y, ldy, M, N, K,
    threads), on torch's thread count; a kernel that returns nonzero could not allocate its
    scratch. y has `out_cols` columns where the kernel writes fewer than W's N rows (default N)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, num_in = x.shape
    y = x.new_empty((num_rows, out_cols or num_out))
    b = 0 if bias is None else bias.data_ptr()
    failed = kernel(
        x.data_ptr(), x.stride(0), packed.data_ptr(), b, y.data_ptr(), y.shape[1],
        num_rows, num_out, num_in, _threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"no memory for the scratch of a [{num_rows}, {num_in}] matmul input")
    return y


KV_DTYPES = (torch.float32, torch.bfloat16)  # the pools the attention kernels read


def is_bf16(kv: torch.Tensor) -> int:
    """The kernels' flag for a KV pool's element type: 1 for bfloat16, 0 for float32."""
    return int(kv.dtype == torch.bfloat16)


def _bind(fn, argtypes: list, restype=None) -> Callable:
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def _threads() -> int:
    return torch.get_num_threads()


_unavailable: list[str] = []  # why `kernels()` returned None, once it has


@functools.cache
def kernels() -> CpuKernels | None:
    """The kernels, built or loaded once per process; None where they cannot be had."""
    if os.environ.get(ENV_SWITCH, "on").lower() in ("0", "off", "false", "no"):
        _unavailable.append(f"turned off by {ENV_SWITCH}")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(build())))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        _unavailable.append(f"build failed: {str(e)[-500:]}")
        log.warning("native cpu kernels unavailable; using the torch path", error=str(e)[-500:])
        return None


def native_status() -> tuple[bool, str]:
    """Whether the native CPU kernels are available here, and why not: (True, "") where they are
    built with every kernel; (True, a note) where built without some (no AVX-512: float32 matmuls
    and prefill attention run in torch, the quantized ones natively); (False, the reason: turned
    off, no compiler, a failed build) where not at all, every step then in torch (5-10x slower).
    Builds or loads the kernels on its first call."""
    native = kernels()
    if native is None:
        return False, _unavailable[-1] if _unavailable else "unavailable"
    if native._linear is None:
        return True, "built without AVX-512 (this CPU or compiler lacks it): float32 matmuls run in torch"
    return True, ""


def for_tensor(t: torch.Tensor) -> CpuKernels | None:
    """The kernels when `t` is a float32 CPU tensor and they could be built, else None."""
    return kernels() if CpuKernels.applies(t) else None
