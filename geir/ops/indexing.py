"""Ops that index with run-time integers or make index sequences: gather, arange and cumsum."""

from __future__ import annotations

import math

import numpy as np

from geir.ir import Operation, Value
from geir.opdef import Attr, ShapeError, op
from geir.ops.numerics import broadcast_dims, normalize_axis, work
from geir.ops.core import literal_array
from geir.traits import DataMovement, StaticForm
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


@op("ge.index")
class Index(Operation, StaticForm):
    """`x[..., i0, i1, ...]`: advanced indexing of the dimensions from `axis` on by integer tensors that
    broadcast together (numpy's and torch's rule for adjacent index tensors; ONNX's GatherND). The result's
    shape is x[:axis] + the indices' broadcast shape + x[axis + n:]; negative indices count from the end."""

    OPERAND_NAMES = ("x", "indices+")
    TRAITS = (DataMovement,)
    axis = Attr(int, default=0)

    def infer(self, x: TensorType, *indices: TensorType) -> TensorType:
        for t in indices:
            require_indices(t)
        if not 0 <= self.axis <= x.rank - len(indices):
            raise ShapeError(f"{len(indices)} index tensor(s) from axis {self.axis} do not fit {x}")
        shape: tuple = ()
        for t in indices:
            shape = broadcast_dims(shape, t.shape)
        end = self.axis + len(indices)
        return TensorType(x.shape[:self.axis] + shape + x.shape[end:], x.dtype)

    def compute(self, x: np.ndarray, *indices: np.ndarray) -> np.ndarray:
        for k, arr in enumerate(indices):
            problem = index_problem(arr, x.shape[self.axis + k], self.axis + k)
            if problem is not None:
                raise IndexError(problem)
        return x[(slice(None),) * self.axis + tuple(indices)]

    def static_form(self, b) -> Value | None:
        """Constant indices: one gather of the indexed dimensions merged, at the flattened indices."""
        x = self.operands[0]
        arrays = [literal_array(v) for v in self.operands[1:]]
        end = self.axis + len(arrays)
        dims = x.type.shape[self.axis:end]
        if any(a is None for a in arrays) or any(d is None for d in dims):
            return None
        flat = flat_indices([np.asarray(a, dtype=np.int64) for a in arrays], dims, self.axis)
        shape = x.type.shape
        merged = x if len(dims) == 1 else b.create(
            "ge.reshape", [x], {"shape": [-1 if d is None else d for d in shape[:self.axis]] + [math.prod(dims)]
                                + [-1 if d is None else d for d in shape[end:]]}).result
        index = b.constant(flat, DType.i64)
        return b.create("ge.gather", [merged, index], {"axis": self.axis}).result


@op("ge.gather_elements")
class GatherElements(Operation):
    """torch.gather and ONNX's GatherElements: out[.., i, ..] = x[.., indices[.., i, ..], ..] along `axis`, every
    other coordinate taken as it is; `indices` has x's rank, no more elements than x on the other axes, and
    the result its shape. Negative indices count from the end."""

    OPERAND_NAMES = ("x", "indices")
    TRAITS = (DataMovement,)
    axis = Attr(int, default=0)

    def infer(self, x: TensorType, indices: TensorType) -> TensorType:
        require_indices(indices)
        if indices.rank != x.rank:
            raise ShapeError(f"gather_elements indices {indices} must have the rank of {x}")
        axis = normalize_axis(self.axis, x.rank)
        for d, (have, want) in enumerate(zip(x.shape, indices.shape)):
            if d != axis and have is not None and want is not None and want > have:
                raise ShapeError(f"indices have {want} elements along axis {d}, but the input only {have}")
        return TensorType(indices.shape, x.dtype)

    def compute(self, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
        axis = normalize_axis(self.axis, x.ndim)
        problem = index_problem(indices, x.shape[axis], axis)
        if problem is not None:
            raise IndexError(problem)
        grid = list(np.indices(indices.shape, sparse=True))
        grid[axis] = np.where(indices < 0, indices + x.shape[axis], indices)
        return x[tuple(grid)]


def flat_indices(arrays: list[np.ndarray], dims: tuple[int, ...], axis: int = 0) -> np.ndarray:
    """Index tensors for adjacent dimensions `dims` (from `axis`) as one index into those dimensions merged.

    Each index is checked against its own dimension (ShapeError naming it), so no out-of-range pair can
    land on another element; the indices broadcast together first.
    """
    try:
        index = np.broadcast_arrays(*arrays)
    except ValueError:
        raise ShapeError("the index tensors do not broadcast together") from None
    for k, (arr, d) in enumerate(zip(index, dims)):
        problem = index_problem(arr, d, axis + k)
        if problem is not None:
            raise ShapeError(problem)
    return np.ravel_multi_index(tuple(np.where(arr < 0, arr + d, arr) for arr, d in zip(index, dims)), dims)


def index_problem(indices: np.ndarray, dim: int, axis: int) -> str | None:
    """What is wrong with the first index outside [-dim, dim) (numpy's range for `np.take`), or None."""
    flat = np.asarray(indices).reshape(-1)
    bad = (flat < -dim) | (flat >= dim)
    if bad.any():
        return f"gather index {int(flat[np.argmax(bad)])} is out of range for axis {axis} of size {dim}"
    return None


def arange_length(start: float, limit: float, delta: float) -> int:
    """numpy's (and ONNX Range's) element count: ceil((limit - start) / delta), at least 0."""
    if all(isinstance(v, (int, np.integer)) for v in (start, limit, delta)):
        start, limit, delta = int(start), int(limit), int(delta)
        return max(-((start - limit) // delta), 0)  # exact for integers of any size
    return max(math.ceil((limit - start) / delta), 0)


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
        return arange_length(self.start, self.limit, self.delta)

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
