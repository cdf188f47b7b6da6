"""setuptools' build (pyproject.toml holds the package's metadata), plus the native CPU kernels
compiled into the kernel cache as the package installs (services/worker/kernel_build.py, standard
library only, loaded by its path: torch may not be importable yet), so that the first `superinfer
serve` finds them built. Where they cannot be built (no compiler) the install goes on with a
warning, and `superinfer kernels build` or the first start builds them."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNEL_BUILD = Path(__file__).resolve().parent / "services" / "worker" / "kernel_build.py"


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        try:
            spec = importlib.util.spec_from_file_location("superinfer_kernel_build", KERNEL_BUILD)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            print(f"superinfer: native cpu kernels in {module.build()}")
        except Exception as e:  # noqa: BLE001 -- whatever the reason, the install goes on
            print(f"WARNING: superinfer's native cpu kernels were not built ({str(e)[-300:]}); the worker builds them "
                  "at its first start, or runs 5-10x slower on torch where it cannot")  # fmt: skip


setup(cmdclass={"build_py": BuildWithKernels})
