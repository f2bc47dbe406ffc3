"""Tiled numpy kernels that run on the simulated NPU, FlashAttention first (issue 4)."""
