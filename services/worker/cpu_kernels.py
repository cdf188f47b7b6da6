"""Native CPU kernels (csrc/*.c), compiled on first use with the machine's C compiler.

The source is plain C with OpenMP (no torch headers), so a build takes well under a second;
the shared library is cached under `$SUPERINFER_CACHE_DIR` (default ~/.cache/superinfer),
keyed by the source, the flags, the compiler and this CPU's feature flags (`-march=native`).
It links libgomp by soname, so inside a process that imported torch it runs on the OpenMP
runtime torch already loaded, with torch's thread count.

Where no compiler is found or the build fails, `paged_attention()` returns None and the
callers keep their torch path; `SUPERINFER_CPU_KERNELS=off` forces that path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
ENV_SWITCH = "SUPERINFER_CPU_KERNELS"

log = structlog.get_logger("worker")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class PagedAttention:
    """Decode attention over the block-first pool without gathering the context."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.paged_decode_attention_f32
        self._fn.restype = None
        self._fn.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        self._fn.argtypes += [_i64] * 5 + [ctypes.c_float, ctypes.c_int]
        limits = [_i64() for _ in range(3)]
        lib.paged_attention_limits(*(ctypes.byref(x) for x in limits))
        self.max_group, self.max_head_dim, self.max_block_size = (x.value for x in limits)

    def supports(self, q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
        """q: [R, H, D]; kv_layer: [N, 2, B, KV, D], a layer's strided view of the pool."""
        _, _, block_size, num_kv, head_dim = kv_layer.shape
        return (
            q.device.type == "cpu"
            and q.dtype == kv_layer.dtype == torch.float32
            and q.stride(2) == 1
            and q.stride(1) == head_dim
            and kv_layer.stride()[2:] == (num_kv * head_dim, head_dim, 1)
            and q.shape[1] // num_kv <= self.max_group
            and head_dim <= self.max_head_dim
            and block_size <= self.max_block_size
        )

    def decode(
        self, q: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor, context_lens: torch.Tensor
    ) -> torch.Tensor:
        """q: [R, H, D]; block_ids: [R, max_blocks] long; context_lens: [R] long (keys per
        row, the new token's included). Returns [R, H, D]."""
        num_rows, num_heads, head_dim = q.shape
        _, _, block_size, num_kv, _ = kv_layer.shape
        out = torch.empty((num_rows, num_heads, head_dim), dtype=q.dtype)
        self._fn(
            q.data_ptr(), q.stride(0),
            kv_layer.data_ptr(), kv_layer.stride(0), kv_layer.stride(1),
            block_ids.data_ptr(), block_ids.shape[1], context_lens.data_ptr(), out.data_ptr(),
            num_rows, num_heads, num_kv, head_dim, block_size,
            head_dim**-0.5, torch.get_num_threads(),
        )  # fmt: skip
        return out


@functools.cache
def paged_attention() -> PagedAttention | None:
    """The kernel, built or loaded once per process; None where it cannot be had."""
    if os.environ.get(ENV_SWITCH, "on").lower() in ("0", "off", "false", "no"):
        return None
    try:
        return PagedAttention(ctypes.CDLL(str(build("paged_attention"))))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("cpu paged-attention kernel unavailable; using the torch path", error=str(e)[-500:])
        return None


def build(name: str) -> Path:
    """Path of the shared library built from csrc/<name>.c for this machine (cached)."""
    source = (SOURCE_DIR / f"{name}.c").read_bytes()
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_flags()]))
    cache = Path(os.environ.get("SUPERINFER_CACHE_DIR") or Path.home() / ".cache" / "superinfer") / "kernels"
    target = cache / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(SOURCE_DIR / f"{name}.c"), "-lm"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr}")
        built.replace(target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


def _cpu_flags() -> bytes:
    """This CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return os.uname().machine.encode()
