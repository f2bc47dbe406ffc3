"""Ops that index with run-time integers or make index sequences: gather, arange and cumsum."""

from __future__ import annotations

import math

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.numerics import normalize_axis, work
from geir.traits import DataMovement
from geir.types import DType, TensorType


def require_indices(t: TensorType, what: str = "indices") -> None:
    """Indices are integers (i8, i32 or i64): a float or boolean tensor is no index."""
    if not t.dtype.is_int:
        raise ShapeError(f"{what} must be an integer tensor (i8, i32 or i64), not {t}")


@op("ge.gather")
class Gather(Operation):
    """`np.take(table, indices, axis)`: the slices of `table` along `axis` that `indices` name (negative
    indices count from the end); the result's shape is table[:axis] + indices + table[axis + 1:]."""

    OPERAND_NAMES = ("table", "indices")
    TRAITS = (DataMovement,)
    axis = Attr(int, default=0)

    def infer(self, table: TensorType, indices: TensorType) -> TensorType:
        require_indices(indices)
        if table.rank == 0:
            raise ShapeError(f"gather needs a table of rank 1 or more, not {table}")
        axis = normalize_axis(self.axis, table.rank)
        return TensorType(table.shape[:axis] + indices.shape + table.shape[axis + 1:], table.dtype)

    def compute(self, table: np.ndarray, indices: np.ndarray) -> np.ndarray:
        axis = normalize_axis(self.axis, table.ndim)
        problem = index_problem(indices, table.shape[axis], axis)
        if problem is not None:
            raise IndexError(problem)
        return np.take(table, indices, axis=axis)


def index_problem(indices: np.ndarray, dim: int, axis: int) -> str | None:
    """What is wrong with the first index outside [-dim, dim) (numpy's range for `np.take`), or None."""
    flat = np.asarray(indices).reshape(-1)
    bad = (flat < -dim) | (flat >= dim)
    if bad.any():
        return f"gather index {int(flat[np.argmax(bad)])} is out of range for axis {axis} of size {dim}"
    return None


@op("ge.arange")
class Arange(Operation):
    """`start, start + delta, ...` up to but excluding `limit`, as numpy's arange: ceil((limit - start) / delta)
    elements, element i being start + i * delta computed in float64 (exactly, for integers) and stored in `dtype`."""

    OPERAND_NAMES = ()
    start = Attr(float, default=0)
    limit = Attr(float)
    delta = Attr(float, default=1)
    dtype = Attr(DType, default=DType.i64)

    def verify(self) -> str | None:
        if self.delta == 0:
            return "arange delta must not be 0"
        if self.dtype is DType.i1:
            return "arange makes numbers, not booleans: dtype i1 is not allowed"
        if not self.dtype.is_float and not all(isinstance(v, int) for v in (self.start, self.limit, self.delta)):
            return f"an {self.dtype} arange takes integer start, limit and delta"
        if not all(math.isfinite(v) for v in (self.start, self.limit, self.delta)):
            return "arange start, limit and delta must be finite"
        return None

    @property
    def length(self) -> int:
        """numpy's element count: ceil((limit - start) / delta), at least 0."""
        if all(isinstance(v, int) for v in (self.start, self.limit, self.delta)):
            return max(-((self.start - self.limit) // self.delta), 0)  # exact for integers of any size
        return max(math.ceil((self.limit - self.start) / self.delta), 0)

    def infer(self) -> TensorType:
        return TensorType((self.length,), self.dtype)

    def values(self, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of the sequence in their working precision (int64 or float64)."""
        i = np.arange(lo, hi, dtype=np.int64)
        if self.dtype.is_float:
            return np.float64(self.start) + i * np.float64(self.delta)
        return self.start + i * self.delta

    def compute(self) -> np.ndarray:
        return self.values(0, self.length).astype(self.dtype.np)


@op("ge.cumsum")
class Cumsum(Operation):
    """Running sums along `axis` (`np.cumsum`); `exclusive` leaves out each element's own term, `reverse`
    sums from the end (ONNX's CumSum). Floats accumulate in f32 at least, as the vector unit does."""

    OPERAND_NAMES = ("x",)
    axis = Attr(int)
    exclusive = Attr(bool, default=False)
    reverse = Attr(bool, default=False)

    def infer(self, x: TensorType) -> TensorType:
        if x.dtype is DType.i1:
            raise ShapeError(f"cumsum of booleans: cast {x} to an integer dtype first")
        if x.rank == 0:
            raise ShapeError("cumsum needs an input of rank 1 or more")
        normalize_axis(self.axis, x.rank)
        return TensorType(x.shape, x.dtype)

    def compute(self, x: np.ndarray) -> np.ndarray:
        axis = normalize_axis(self.axis, x.ndim)
        x = work(x)
        if self.reverse:
            x = np.flip(x, axis)
        out = np.cumsum(x, axis=axis, dtype=x.dtype)
        if self.exclusive:  # each sum without its own term: the inclusive sums shifted one along the axis
            shifted = np.zeros_like(out)
            body = [slice(None)] * out.ndim
            head = list(body)
            body[axis], head[axis] = slice(1, None), slice(None, -1)
            shifted[tuple(body)] = out[tuple(head)]
            out = shifted
        return np.flip(out, axis) if self.reverse else out
