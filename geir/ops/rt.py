"""The `rt.` dialect: the task-stream programs that `lower` produces and the Runtime runs.

A program holds its device memory layout in its attributes; its values are device tensors at
fixed offsets. Copies and kernel launches go on numbered streams, ordered within a stream and
across streams by events (`rt.record` / `rt.wait`), as CANN's aclrt streams and events are.
"""

from __future__ import annotations

from geir.ir import Operation
from geir.opdef import Attr, OPS, op, operand_count_error
from geir.ops.core import Const
from geir.traits import Terminator
from geir.types import TensorType

# The engines a launch runs on: the AI cores (a tiled kernel) or the AI CPU (the op's numpy semantics on
# the device's ARM cores), as GE places each op
ENGINES = ("aicore", "aicpu")


# the rt ops whose results live in device memory (a copy out, a launch, an rt.return reads them there)
ON_DEVICE = ("rt.h2d", "rt.const", "rt.launch")


class _Declared(Operation):
    """An rt op whose result types are the ones written (lowering chose them)."""

    def infer(self, *types: TensorType):
        return tuple(r.type for r in self.results)


def _dynamic_result(op: Operation) -> str | None:
    """Why a result of an rt op cannot be placed: its type has a `?` (the device memory's offsets are fixed)."""
    for r in op.results:
        if r.type is not None and not r.type.is_static:
            return (f"{op.name} result %{r.name} is {r.type}: an rt.program holds static shapes only (the "
                    f"session lowers a ge.graph once per shape; give the ge.graph to run other shapes)")
    return None


def _not_on_device(op: Operation) -> str | None:
    """Why an operand of an op that reads device memory is not there: it is a host value."""
    for v in op.operands:
        if v.owner is None or v.owner.name not in ON_DEVICE:
            what = "a program argument" if v.owner is None else f"the result of {v.owner.name}"
            return (f"{op.name} reads %{v.name} from the device, but it is {what}, a host value "
                    f"(device values come from {', '.join(ON_DEVICE)})")
    return None


class _Copy(_Declared):
    """A copy between host and device: its result is its operand's type (the Runtime copies it as is)."""

    def infer(self, *types: TensorType):
        return types


@op("rt.h2d")
class HostToDevice(_Copy):
    """Copy a graph input from the host to device memory at `offset`."""

    OPERAND_NAMES = ("x",)
    offset = Attr(int)
    stream = Attr(int, default=0)

    def verify(self) -> str | None:
        x = self.operands[0]
        if x.owner is not None:
            return (f"rt.h2d copies a program argument to the device, but %{x.name} is the result of "
                    f"{x.owner.name}")
        return _dynamic_result(self)


@op("rt.const")
class DeviceConst(_Declared):
    """A constant uploaded to device memory at `offset` when the program is loaded (not per run)."""

    value = Attr("dense")
    offset = Attr(int)

    def verify(self) -> str | None:
        return Const.verify(self) or _dynamic_result(self)

    def compute(self, resources: dict | None = None):
        """The constant's array, as ge.const defines it."""
        return Const.compute(self, resources)


@op("rt.launch")
class Launch(_Declared):
    """Run `kernel` (a ge op name) with its attributes and tiling on `engine`; results at `offsets`."""

    OPERAND_NAMES = ("x*",)
    NUM_RESULTS = None
    kernel = Attr(str)
    engine = Attr(str, default="aicore")
    attrs = Attr(dict, default={})
    tiling = Attr(dict, default={})
    offsets = Attr("ints")
    stream = Attr(int, default=0)

    def verify(self) -> str | None:
        if self.kernel not in OPS or not self.kernel.startswith("ge."):
            return f"rt.launch of unknown kernel '{self.kernel}'"
        why = _not_on_device(self) or _dynamic_result(self)
        if why is not None:
            return why
        if len(self.offsets) != len(self.results):
            return f"rt.launch has {len(self.results)} results but {len(self.offsets)} offsets"
        if self.engine not in ENGINES:
            return f"rt.launch engine '{self.engine}' is not one of {', '.join(ENGINES)}"
        if self.engine == "aicpu" and self.tiling:
            return f"rt.launch of {self.kernel} on the AI CPU takes no tiling (tilings are for AI Core kernels)"
        # the kernel op's own checks, as its graph op passed them before `lower`: the Runtime runs it as one
        kernel = self.kernel_op()
        count = operand_count_error(type(kernel), len(self.operands))
        if count is not None:
            return f"rt.launch of {self.kernel}: {self.kernel} {count}"
        want = kernel.NUM_RESULTS
        if want is not None and want != len(self.results):
            return f"rt.launch of {self.kernel} has {len(self.results)} results; {self.kernel} produces {want}"
        for key, spec in kernel.ATTRS.items():
            why = spec.check(kernel.attributes[key]) if key in kernel.attributes else (
                f"needs attribute '{key}'" if spec.required else None)
            if why is not None:
                return f"rt.launch of {self.kernel}: {why}"
        unknown = [key for key in kernel.attributes if key not in kernel.ATTRS]
        if unknown:
            return f"rt.launch of {self.kernel}: unknown attribute '{unknown[0]}' in attrs"
        why = kernel.verify()
        return f"rt.launch of {self.kernel}: {why}" if why is not None else None

    def infer(self, *types: TensorType):
        """The results the kernel's own shape rule gives: a launch must declare those (the Runtime stores them)."""
        return self.kernel_op().infer(*types)

    def kernel_op(self) -> Operation:
        """The kernel's op on the launch's operands and results, with its attributes (for its checks; unplaced)."""
        return OPS[self.kernel](self.kernel, list(self.operands), list(self.results), dict(self.attrs), self.loc, None)


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
class DeviceToHost(_Copy):
    """Copy a result from device memory back to the host."""

    OPERAND_NAMES = ("x",)
    stream = Attr(int, default=0)

    def verify(self) -> str | None:
        return _not_on_device(self) or _dynamic_result(self)


@op("rt.return")
class RtReturn(Operation):
    """The program's results (host tensors)."""

    OPERAND_NAMES = ("x*",)
    NUM_RESULTS = 0
    TRAITS = (Terminator,)

    def verify(self) -> str | None:
        for v in self.operands:
            if v.owner is not None and v.owner.name != "rt.d2h":
                return (f"rt.return gives %{v.name}, the result of {v.owner.name}, which is on the device: "
                        f"copy it to the host with rt.d2h first")
        return None

    def infer(self, *types):
        return ()
