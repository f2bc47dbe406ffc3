"""Tiled numpy kernels that run on the simulated NPU; KERNELS maps op names to them.

`load_all()` registers the built-in kernels; KERNELS calls it on its first lookup, so importing this package
registers nothing and no caller depends on which kernel module was imported first.
"""

from __future__ import annotations

import importlib

from geir.kernels.base import KERNELS, Kernel, KernelStats, LaunchContext, register_kernel

# the modules that declare the built-in kernels (each registers its kernels with register_kernel when imported)
KERNEL_MODULES = ("flash_attention", "data_movement", "matmul", "vector", "glu", "rotary", "add_norm", "grouped_matmul",
                  "paged_attention")


def load_all() -> None:
    """Register every built-in kernel (importing a module twice registers nothing twice)."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"geir.kernels.{name}")


__all__ = ["KERNELS", "Kernel", "KernelStats", "LaunchContext", "load_all", "register_kernel"]
