"""Device memory: one byte array for the program's regions; every tensor access is bounds-checked."""

from __future__ import annotations

import numpy as np

from geir.types import TensorType


class DeviceFault(RuntimeError):
    """An access the device would fault on: outside its memory, or misaligned."""


class DeviceMemory:
    """The device's global memory for one program: [inputs | constants | arena], as `lower` laid it out."""

    def __init__(self, size: int):
        # np.zeros maps pages lazily, so a large arena costs only what is touched
        self.size = size
        self.bytes = np.zeros(size, dtype=np.uint8)

    def view(self, offset: int, t: TensorType) -> np.ndarray:
        """The tensor of type `t` at `offset`, as an array over the device bytes (no copy)."""
        nbytes = t.nbytes
        if nbytes is None:
            raise DeviceFault(f"cannot address a tensor of dynamic type {t}")
        if offset < 0 or offset + nbytes > self.size:
            raise DeviceFault(f"access to {nbytes} bytes at offset {offset} is outside device memory of {self.size} bytes")
        if offset % t.dtype.itemsize:
            raise DeviceFault(f"offset {offset} is not aligned for {t.dtype}")
        return self.bytes[offset:offset + nbytes].view(t.dtype.np).reshape(t.shape)

    def write(self, offset: int, t: TensorType, array: np.ndarray) -> None:
        """Store `array` (cast to the type's dtype) as the tensor at `offset`."""
        self.view(offset, t)[...] = np.asarray(array).astype(t.dtype.np, copy=False)

    def read(self, offset: int, t: TensorType) -> np.ndarray:
        """A copy of the tensor at `offset` (later writes to the same bytes do not change it)."""
        return self.view(offset, t).copy()
