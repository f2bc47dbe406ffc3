"""Device memory: one byte array for the program's regions; every tensor access is bounds-checked."""

from __future__ import annotations

import os

import numpy as np

from geir.diagnostics import Diagnostic
from geir.ir import Graph
from geir.kernels.base import no_bytes
# the chip's fault, defined with the chip so kernels raise it too; the Runtime imports it from here
from geir.target_npu.sim import DeviceFault
from geir.types import TensorType


class DeviceMemory:
    """The device's global memory for one program: [inputs | constants | arena], as `lower` laid it out."""

    def __init__(self, size: int, backed: bool = True):
        # np.zeros maps pages lazily, so a large arena costs only what is touched; unbacked (a timing-only
        # run, which reads and writes no value) there are no bytes at all and every view is an array of the
        # tensor's shape holding none (zero strides)
        self.size = size
        self.bytes = np.zeros(size if backed else 0, dtype=np.uint8)
        self.backed = backed

    def view(self, offset: int, t: TensorType) -> np.ndarray:
        """The tensor of type `t` at `offset`, as an array over the device bytes (no copy)."""
        nbytes = t.nbytes
        if nbytes is None:
            raise DeviceFault(f"cannot address a tensor of dynamic type {t}")
        if offset < 0 or offset + nbytes > self.size:
            raise DeviceFault(f"access to {nbytes} bytes at offset {offset} is outside device memory of {self.size} bytes")
        if offset % t.dtype.itemsize:
            raise DeviceFault(f"offset {offset} is not aligned for {t.dtype}")
        if not self.backed:  # timing only: the shape, no bytes (a 60 GB KV pool holds none on the host)
            return no_bytes(t.shape, t.dtype.np)
        return self.bytes[offset:offset + nbytes].view(t.dtype.np).reshape(t.shape)

    def write(self, offset: int, t: TensorType, array: np.ndarray) -> None:
        """Store `array` (cast to the type's dtype) as the tensor at `offset`."""
        self.view(offset, t)[...] = np.asarray(array).astype(t.dtype.np, copy=False)

    def read(self, offset: int, t: TensorType) -> np.ndarray:
        """A copy of the tensor at `offset` (later writes to the same bytes do not change it)."""
        return self.view(offset, t).copy()


class DeviceTensor:
    """A tensor that stays in device memory between runs (a KV cache): a result a run kept there, passed to a
    later run as a resident input. The host never holds its values; `read` is an explicit look at them."""

    def __init__(self, t: TensorType, storage: np.ndarray):
        # a view of the device bytes of the run that wrote it (no copy): they outlive that run through it
        self.type = t
        self._storage = storage

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape (a plan-cache signature reads it, as it reads a host array's)."""
        return tuple(self.type.shape)

    @property
    def nbytes(self) -> int:
        """The bytes it holds on the device."""
        return self.type.nbytes

    def place(self, memory: DeviceMemory, offset: int) -> None:
        """Bind its bytes at `offset` of a later run's device memory (where that program's plan put the input).

        The simulator gives each run a memory of its own, so binding moves the bytes inside the simulated
        device; nothing crosses the host link and nothing is on the timeline."""
        memory.write(offset, self.type, self._storage)

    def read(self) -> np.ndarray:
        """A host copy of its values (a look from outside the model: no run does this)."""
        return np.array(self._storage, copy=True)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.type})"


def stand_in(t: TensorType) -> np.ndarray:
    """An array with a tensor type's shape and dtype and no memory (zero strides): an input a timing-only run
    takes only the shape of."""
    return no_bytes(t.shape, t.dtype.np)


def host_bytes_available() -> int | None:
    """Memory the host can still give this process (Linux MemAvailable; else physical memory), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_layout(program: Graph) -> dict[str, int] | None:
    """The byte sizes an rt.program's `memory = {inputs, constants, arena}` gives, or None where it gives none."""
    memory = program.attributes.get("memory")
    if not isinstance(memory, dict):
        return None
    sizes = {part: memory.get(part) for part in ("inputs", "constants", "arena")}
    if any(type(n) is not int or n < 0 for n in sizes.values()):
        return None
    return sizes


def host_memory_problem(graph: Graph, available: int | None = None, timing_only: bool = False) -> Diagnostic | None:
    """An error at the largest tensor when simulating a run of `graph` cannot fit in host memory, before
    anything is allocated: the inputs live on the host and again in the simulated device's memory with the
    constants (for a lowered program: its inputs, constants and arena). A timing-only run copies and stores
    nothing, but each kernel still makes its operands and results as arrays of their full shape."""
    available = host_bytes_available() if available is None else available
    if available is None:
        return None
    consts = [r for op in graph.ops if op.name in ("ge.const", "rt.const") for r in op.results]
    if timing_only:
        values = list(graph.args) + [r for op in graph.ops for r in op.results]
        sized = [(v.type.nbytes, v) for v in values if v.type is not None and v.type.nbytes]
        if not sized:
            return None
        needed, largest = max(sized, key=lambda s: s[0])
        if needed <= available:
            return None
        return Diagnostic("error", f"a timing-only run of this graph needs at least {needed} bytes of host memory "
                          f"(each kernel makes its operands and results as arrays of their full shape), but "
                          f"{available} are available; %{largest.name} alone holds {needed} bytes", largest.loc)
    sizes = [(v.type.nbytes or 0, v) for v in list(graph.args) + consts if v.type is not None]
    if not sizes:
        return None
    inputs = sum(a.type.nbytes or 0 for a in graph.args if a.type is not None)
    constants = sum(n for n, v in sizes) - inputs
    layout = memory_layout(graph) if graph.kind == "rt.program" else None
    # without a layout the Runtime refuses the program; a ge.graph's arena is planned later (at least this)
    device = sum(layout.values()) if layout else inputs + constants
    needed = inputs + device
    if needed <= available:
        return None
    _, largest = max(sizes, key=lambda s: s[0])
    what = f"the inputs on the host, {device} for the simulated device's memory"
    return Diagnostic("error", f"simulating this run needs at least {needed} bytes of host memory ({inputs} for "
                      f"{what}), but {available} are available; %{largest.name} alone holds {largest.type.nbytes} "
                      f"bytes", largest.loc)
