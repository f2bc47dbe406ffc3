"""Tiled numpy kernels that run on the simulated NPU, FlashAttention first; KERNELS maps op names to them."""

from geir.kernels.base import KERNELS, Kernel, KernelStats, LaunchContext, register_kernel
from geir.kernels import flash_attention  # noqa: F401,E402  (registers the kernel)
from geir.kernels import data_movement, matmul, vector  # noqa: F401,E402  (register the unfused kernels)
from geir.kernels import add_norm  # noqa: F401,E402  (registers the fused residual-add + norm kernel)

__all__ = ["KERNELS", "Kernel", "KernelStats", "LaunchContext", "register_kernel"]
