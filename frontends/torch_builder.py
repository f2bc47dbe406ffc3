"""Building a GEIR graph for the PyTorch importer: geir.builder's Builder with torch's dtypes, names and errors.

Each op is created with its result type inferred by the op's own shape rule, so a mapping mistake
surfaces at the aten node that caused it (as a TorchImportError naming the node), never later
inside a pass.
"""

from __future__ import annotations

import os
import re
from typing import Any

import attrs
import numpy as np
import torch

from geir.attributes import DenseAttr
from geir.builder import Builder
from geir.diagnostics import UNKNOWN, Location
from geir.ir import Graph, Operation, Value
from geir.opdef import ShapeError
from geir.types import Dim, DType, TensorType

# torch dtypes GEIR can hold, and their GEIR names
_DTYPES = {
    torch.float32: DType.f32,
    torch.float16: DType.f16,
    torch.bfloat16: DType.bf16,
    torch.int64: DType.i64,
    torch.int32: DType.i32,
    torch.int8: DType.i8,
    torch.bool: DType.i1,
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}

# Constants with more elements than this go to the weights mapping as dense_resource; smaller ones
# (scales, epsilons, biases of tiny layers, masks the importer computed) stay dense literals.
LITERAL_LIMIT = 16
# Constants the importer computes itself (folded masks and the like) stay literals up to this size, so
# fusion rules that read constant values (a causal mask) still see them.
COMPUTED_LITERAL_LIMIT = 1 << 16


class TorchImportError(Exception):
    """A PyTorch program GEIR cannot represent; the message names the aten op and the fx node."""


def node_description(node: Any) -> str:
    """`aten.foo.default` at node 'foo_1' (file.py:12), for error messages."""
    target = node.target
    what = str(target) if node.op == "call_function" else node.op
    where = source_location(node)
    at = f" ({where.file}:{where.line})" if where is not UNKNOWN else ""
    return f"{what} at node '{node.name}'{at}"


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = os.path.dirname(torch.__file__)


def source_location(node: Any) -> Location:
    """Where the user's Python code produced this node: the innermost frame outside torch itself."""
    trace = node.meta.get("stack_trace") if hasattr(node, "meta") else None
    frames = _FRAME.findall(trace or "")
    if not frames:
        return UNKNOWN
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    file, line = (user or frames)[-1]
    return Location(file, int(line), 1)


def dims_of(shape: Any) -> tuple[Dim, ...]:
    """A torch shape as GEIR dims: ints, None where the size is symbolic (a dynamic-shape export)."""
    return tuple(d if isinstance(d, int) else _static_size(d) for d in shape)


def _static_size(d: Any) -> Dim:
    try:
        n = d.node.maybe_as_int()
    except AttributeError:
        return None
    return None if n is None else int(n)


def geir_dtype(dtype: torch.dtype, what: str) -> DType:
    """The GEIR dtype of a torch dtype; TorchImportError when GEIR has none."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in _DTYPES)
        raise TorchImportError(f"{what} has dtype {str(dtype).removeprefix('torch.')}, which GEIR does not "
                               f"have (it takes {supported})") from None


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a GEIR dtype."""
    return _TORCH_DTYPES[dtype]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as a numpy array of the matching GEIR dtype (bf16 through ml_dtypes)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(DType.bf16.np)
    return t.contiguous().numpy()


def is_broadcast(t: torch.Tensor) -> bool:
    """Whether `t` is one element broadcast (many elements, every stride zero), as a timing-only weight is."""
    return t.numel() > 1 and all(s == 0 for s in t.stride())


def from_numpy(a: np.ndarray, dtype: DType) -> torch.Tensor:
    """A numpy array (as the Runtime returns it) as a torch tensor of the GEIR dtype."""
    a = np.asarray(a)
    # np.array(order="C"), not np.ascontiguousarray: that one makes a 0-d result (x.sum()) 1-D
    if dtype is DType.bf16:
        return torch.from_numpy(np.array(a, dtype=np.float32, order="C")).to(torch.bfloat16)
    return torch.from_numpy(np.array(a, dtype=dtype.np, order="C", copy=None))


@attrs.frozen
class RunTimeSize:
    """A size known only at run time (a SymInt of a dynamic-shape export): the rank-0 i64 value computing it."""

    value: Value


class GraphBuilder(Builder):
    """geir.builder's Builder for the PyTorch importer: torch's value names, the weights, TorchImportError.

    Ops are created with their result types inferred by their own shape rule, so a mapping mistake
    is reported at the fx node being converted.
    """

    # fx node names become value names; only identifier characters are kept
    NAME_CHARS = re.compile(r"[^A-Za-z0-9_]")

    def __init__(self, name: str = "main") -> None:
        super().__init__(Graph(name, [], []))
        self.weights: dict[str, np.ndarray] = {}
        self.node: Any = None  # the fx node being converted, for error messages; self.loc is where it came from

    def error(self, message: str) -> TorchImportError:
        """A TorchImportError about the node being converted."""
        if self.node is None:
            return TorchImportError(message)
        return TorchImportError(f"{node_description(self.node)}: {message}")

    def emit(self, name: str, operands: list[Value], attributes: dict[str, Any] | None = None,
             hint: str | None = None) -> Operation:
        """Append op `name` with its result type(s) from the op's shape rule."""
        hint = hint or (self.node.name if self.node is not None else name.split(".")[-1])
        try:
            op = self.create(name, operands, attributes, hint=hint)
        except ShapeError as e:
            raise self.error(str(e)) from None
        why = op.verify()
        if why:
            raise self.error(f"{name}: {why}")
        return op

    def value(self, name: str, operands: list[Value], attributes: dict[str, Any] | None = None,
              hint: str | None = None) -> Value:
        """The single result of a newly emitted op."""
        return self.emit(name, operands, attributes, hint).result

    def const(self, array: np.ndarray, dtype: DType, hint: str = "c", key: str | None = None,
              limit: int = LITERAL_LIMIT) -> Value:
        """A constant: a dense literal when small, else `dense_resource<key>` with the array in `weights`."""
        array = np.asarray(array)
        t = TensorType(tuple(int(d) for d in array.shape), dtype)
        if array.size <= limit or _is_splat(array):
            values = array if array.size <= limit else array.reshape(-1)[:1].reshape(())
            return self.constant(DenseAttr(_literal_values(values, dtype)), t, name=hint)
        key = self._resource_key(key or hint)
        self.weights[key] = np.array(array, dtype=dtype.np, order="C")  # np.array keeps rank 0
        return self.resource(key, t, name=hint)

    def broadcast_resource(self, array: np.ndarray, dtype: DType, hint: str, key: str) -> Value:
        """`dense_resource<key>` holding `array` as it is (a zero-stride broadcast: one element's bytes, not a copy)."""
        key = self._resource_key(key)
        self.weights[key] = array
        return self.resource(key, TensorType(tuple(int(d) for d in array.shape), dtype), name=hint)

    def scalar(self, value: float | bool, dtype: DType, hint: str = "c") -> Value:
        """A rank-0 constant of `dtype`."""
        return self.const(np.array(value, dtype=np.float64 if dtype.is_float else dtype.np), dtype, hint)

    def cast(self, v: Value, dtype: DType) -> Value:
        """`v` converted to `dtype` (itself when it already is)."""
        if v.type.dtype is dtype:
            return v
        return self.value("ge.cast", [v], {"to": dtype}, hint=f"{v.name}_{dtype.value}")

    def _resource_key(self, hint: str) -> str:
        key, i = hint, 1
        while key in self.weights:
            key = f"{hint}_{i}"
            i += 1
        return key


def _is_splat(array: np.ndarray) -> bool:
    if array.size == 0:
        return False
    flat = array.reshape(-1)
    if flat.dtype.kind == "f" or flat.dtype.name == "bfloat16":
        bits = flat.view(f"u{flat.dtype.itemsize}")
        return bool(np.all(bits == bits[0]))
    return bool(np.all(flat == flat[0]))


def _literal_values(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Literal elements as the parser holds them: float64, int64 or bool (exact for every GEIR dtype)."""
    kind = np.float64 if dtype.is_float else np.bool_ if dtype is DType.i1 else np.int64
    return np.array(values, dtype=kind, order="C")  # np.ascontiguousarray would make a scalar 1-D

