"""The native CPU kernels' build: every csrc/*.c compiled with the machine's C compiler into one
shared library, cached under `$SUPERINFER_CACHE_DIR` (default ~/.cache/superinfer), keyed by the
sources, the flags, the compiler and this CPU's feature flags (`-march=native`). Standard library
only, so that the package's install (setup.py) and `superinfer kernels build` can run it where
torch is not yet importable; cpu_kernels.py loads what it builds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
# Every warning fails the build (a function without its declaration in kernels.h among them).
WARNINGS = ("-Wall", "-Wextra", "-Werror=implicit-function-declaration", "-Werror=missing-prototypes", "-Werror")


def build(name: str = "cpu_kernels") -> Path:
    """Path of the shared library built from every csrc/*.c for this machine (cached)."""
    sources = sorted(SOURCE_DIR.glob("*.c"))
    source = b"\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in sorted(SOURCE_DIR.glob("*.[ch]")))
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS + WARNINGS).encode(), version.encode(), _cpu_flags()]))
    cache = Path(os.environ.get("SUPERINFER_CACHE_DIR") or Path.home() / ".cache" / "superinfer") / "kernels"
    target = cache / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, *WARNINGS, "-I", str(SOURCE_DIR), "-o", str(built), *map(str, sources), "-lm"],
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
