"""The `rt.` dialect: the task-stream programs that `lower` produces and the Runtime runs.

A program holds its device memory layout in its attributes; its values are device tensors at
fixed offsets. Copies and kernel launches go on numbered streams, ordered within a stream and
across streams by events (`rt.record` / `rt.wait`), as CANN's aclrt streams and events are.
"""

from __future__ import annotations

from geir.ir import Operation, Value
from geir.opdef import OPS, Attr, ShapeError, op
from geir.ops.core import Const
from geir.traits import Terminator
from geir.types import TensorType


class _Declared(Operation):
    """An rt op whose result types are the ones written (lowering chose them)."""

    def infer(self, *types: TensorType):
        return tuple(r.type for r in self.results)


@op("rt.h2d")
class HostToDevice(_Declared):
    """Copy a graph input from the host to device memory at `offset`."""

    OPERAND_NAMES = ("x",)
    offset = Attr(int)
    stream = Attr(int, default=0)


@op("rt.const")
class DeviceConst(_Declared):
    """A constant uploaded to device memory at `offset` when the program is loaded (not per run)."""

    value = Attr("dense")
    offset = Attr(int)

    def verify(self) -> str | None:
        return Const.verify(self)

    def compute(self, resources: dict | None = None):
        """The constant's array, as ge.const defines it."""
        return Const.compute(self, resources)


@op("rt.launch")
class Launch(_Declared):
    """Run `kernel` (a ge op name) with its attributes and tiling on the cores; results at `offsets`."""

    OPERAND_NAMES = ("x*",)
    NUM_RESULTS = None
    kernel = Attr(str)
    attrs = Attr(dict, default={})
    tiling = Attr(dict, default={})
    offsets = Attr("ints")
    stream = Attr(int, default=0)

    def verify(self) -> str | None:
        if self.kernel not in OPS or not self.kernel.startswith("ge."):
            return f"rt.launch of unknown kernel '{self.kernel}'"
        if len(self.offsets) != len(self.results):
            return f"rt.launch has {len(self.results)} results but {len(self.offsets)} offsets"
        return self._kernel_problem()

    def _kernel_problem(self) -> str | None:
        """Why the kernel's op does not accept these operands or give these results (its own checks and shape rule)."""
        from geir.builder import create_op, infer_result_types  # the builder sits beside the ops it builds

        types = [v.type for v in self.operands]
        if any(t is None for t in types):
            return None
        operands = [Value(t, v.name) for t, v in zip(types, self.operands)]
        try:
            kernel_op = create_op(self.kernel, operands, [r.type for r in self.results], dict(self.attrs), self.loc)
            why = kernel_op.verify()
            if why is not None:
                return f"{self.kernel}: {why}"
            inferred = infer_result_types(kernel_op, types)
        except ShapeError as e:  # its message names the kernel's op already
            return str(e)
        for i, (r, t) in enumerate(zip(self.results, inferred)):
            if r.type is not None and t is not None and (r.type.shape != t.shape or r.type.dtype != t.dtype):
                return f"{self.kernel} gives result {i} as {t}, but the launch declares {r.type}"
        return None


@op("rt.record")
class Record(_Declared):
    """Mark `event` as reached once everything queued on `stream` before it is done."""

    NUM_RESULTS = 0
    event = Attr(int)
    stream = Attr(int, default=0)


@op("rt.wait")
class Wait(_Declared):
    """Nothing queued on `stream` after this starts before `event` is recorded."""

    NUM_RESULTS = 0
    event = Attr(int)
    stream = Attr(int, default=0)


@op("rt.d2h")
class DeviceToHost(_Declared):
    """Copy a result from device memory back to the host."""

    OPERAND_NAMES = ("x",)
    stream = Attr(int, default=0)


@op("rt.return")
class RtReturn(Operation):
    """The program's results (host tensors)."""

    OPERAND_NAMES = ("x*",)
    NUM_RESULTS = 0
    TRAITS = (Terminator,)

    def infer(self, *types):
        return ()
