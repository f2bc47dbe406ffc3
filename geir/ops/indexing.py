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


def indexed_type(x: TensorType, indices: tuple[TensorType, ...], axis: int) -> TensorType:
    """The type of x[..., i0, i1, ...] with the index tensors on the dimensions from `axis` on."""
    for t in indices:
        require_indices(t)
    if not 0 <= axis <= x.rank - len(indices):
        raise ShapeError(f"{len(indices)} index tensor(s) from axis {axis} do not fit {x}")
    shape: tuple = ()
    for t in indices:
        shape = broadcast_dims(shape, t.shape)
    return TensorType(x.shape[:axis] + shape + x.shape[axis + len(indices):], x.dtype)


def check_element_indices(x: TensorType, indices: TensorType, axis: int) -> None:
    """Indices of gather_elements and scatter_elements: integers of x's rank, no longer than x off the axis."""
    require_indices(indices)
    if indices.rank != x.rank:
        raise ShapeError(f"indices {indices} must have the rank of {x}")
    axis = normalize_axis(axis, x.rank)
    for d, (have, want) in enumerate(zip(x.shape, indices.shape)):
        if d != axis and have is not None and want is not None and want > have:
            raise ShapeError(f"indices have {want} elements along axis {d}, but the input only {have}")


@op("ge.index")
class Index(Operation, StaticForm):
    """`x[..., i0, i1, ...]`: advanced indexing of the dimensions from `axis` on by integer tensors that
    broadcast together (numpy's and torch's rule for adjacent index tensors; ONNX's GatherND). The result's
    shape is x[:axis] + the indices' broadcast shape + x[axis + n:]; negative indices count from the end."""

    OPERAND_NAMES = ("x", "indices+")
    TRAITS = (DataMovement,)
    axis = Attr(int, default=0)

    def infer(self, x: TensorType, *indices: TensorType) -> TensorType:
        return indexed_type(x, indices, self.axis)

    def compute(self, x: np.ndarray, *indices: np.ndarray) -> np.ndarray:
        return x[checked_positions(x.shape, indices, self.axis)]

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
        check_element_indices(x, indices, self.axis)
        return TensorType(indices.shape, x.dtype)

    def compute(self, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
        return x[element_coordinates(x.shape, indices, self.axis)]


@op("ge.index_put")
class IndexPut(Operation):
    """`x` with `x[..., i0, i1, ...] = values` (the elements ge.index with the same indices reads), or `+=`
    with `accumulate` (every duplicate index adds, as np.add.at): torch's index_put and index_copy, ONNX's
    ScatterND. `values` broadcasts to the indexed shape; a duplicate index without accumulate keeps the
    last value written, as numpy does (torch leaves it undefined)."""

    OPERAND_NAMES = ("x", "values", "indices+")
    TRAITS = (DataMovement,)
    axis = Attr(int, default=0)
    accumulate = Attr(bool, default=False)
    # the result takes x's memory (x is donated: a KV pool written at a step's slots, as torch's index_copy_ and
    # ScatterUpdate's in-place form): the values are the same, only the indexed slabs move
    in_place = Attr(bool, default=False)

    def infer(self, x: TensorType, values: TensorType, *indices: TensorType) -> TensorType:
        indexed = indexed_type(x, indices, self.axis)
        if values.dtype != x.dtype:
            raise ShapeError(f"index_put values {values} must have the dtype of {x}")
        # a run-time size of the values may stand where the indexed shape knows its size (a batch-1 gear binds the
        # index tensor's length, the values' reshape keeps its `?`): the run checks it
        fits = len(values.shape) <= len(indexed.shape) and all(
            v == 1 or v is None or d is None or v == d for v, d in zip(reversed(values.shape), reversed(indexed.shape)))
        if not fits:
            raise ShapeError(f"index_put values {values} do not broadcast to the indexed shape {indexed}")
        return TensorType(x.shape, x.dtype)

    def compute(self, x: np.ndarray, values: np.ndarray, *indices: np.ndarray) -> np.ndarray:
        out = x.copy()
        at = checked_positions(x.shape, indices, self.axis)
        if self.accumulate:
            np.add.at(out, at, values)
        else:
            out[at] = values
        return out


@op("ge.index_put_pair")
class IndexPutPair(Operation):
    """Two ge.index_puts at the same positions in one launch: `x` with x[..., i] = x_values and `y` with
    y[..., i] = y_values along `axis` (one index tensor, no accumulation), as ATB's ReshapeAndCache writes a step's
    K and V into their caches together (vLLM-Ascend's `_npu_reshape_and_cache`). Each result is ge.index_put's."""

    OPERAND_NAMES = ("x", "y", "x_values", "y_values", "indices")
    TRAITS = (DataMovement,)
    NUM_RESULTS = 2
    axis = Attr(int, default=0)
    in_place = Attr(bool, default=False)  # both results take their operand's memory (ge.index_put's in_place)

    def _one(self) -> IndexPut:
        """The one-tensor update whose semantics each half has."""
        from geir.builder import create_op  # the builder imports the op registry, which imports this module

        return create_op("ge.index_put", [], [], {"axis": self.axis})

    def infer(self, x: TensorType, y: TensorType, x_values: TensorType, y_values: TensorType,
              indices: TensorType) -> tuple[TensorType, TensorType]:
        one = self._one()
        a = normalize_axis(self.axis, x.rank) if x.rank else 0
        if x.rank != y.rank or (x.rank and None not in (x.shape[a], y.shape[a]) and x.shape[a] != y.shape[a]):
            raise ShapeError(f"{x} and {y} differ in rank or along axis {self.axis}, where one index tensor writes both")
        return one.infer(x, x_values, indices), one.infer(y, y_values, indices)

    def compute(self, x: np.ndarray, y: np.ndarray, x_values: np.ndarray, y_values: np.ndarray,
                indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        one = self._one()
        return one.compute(x, x_values, indices), one.compute(y, y_values, indices)


@op("ge.scatter_elements")
class ScatterElements(Operation):
    """`x` with out[.., indices[.., i, ..], ..] = updates[.., i, ..] along `axis`, every other coordinate taken
    as it is (torch's scatter, ONNX's ScatterElements); `reduction` "add" sums into the element instead.
    `indices` and `updates` have one shape, of x's rank; negative indices count from the end."""

    OPERAND_NAMES = ("x", "indices", "updates")
    TRAITS = (DataMovement,)
    axis = Attr(int, default=0)
    reduction = Attr(str, default="none", choices=("none", "add"))

    def infer(self, x: TensorType, indices: TensorType, updates: TensorType) -> TensorType:
        check_element_indices(x, indices, self.axis)
        if updates.dtype != x.dtype or updates.rank != indices.rank or any(
                a is not None and b is not None and a != b for a, b in zip(updates.shape, indices.shape)):
            raise ShapeError(f"scatter updates {updates} must have the indices' shape {indices} and the dtype of {x}")
        return TensorType(x.shape, x.dtype)

    def compute(self, x: np.ndarray, indices: np.ndarray, updates: np.ndarray) -> np.ndarray:
        at = element_coordinates(x.shape, indices, self.axis)
        out = x.copy()
        if self.reduction == "add":
            np.add.at(out, at, updates)
        else:
            out[at] = updates
        return out


def checked_positions(shape: tuple, indices: tuple[np.ndarray, ...], axis: int) -> tuple:
    """numpy's index of x[..., i0, i1, ...] with the index tensors on the dimensions from `axis` on, each
    checked against its own dimension (IndexError naming the first out of range)."""
    for k, arr in enumerate(indices):
        problem = index_problem(arr, shape[axis + k], axis + k, "")
        if problem is not None:
            raise IndexError(problem)
    return (slice(None),) * axis + tuple(indices)


def element_coordinates(shape: tuple, indices: np.ndarray, axis: int) -> tuple:
    """The coordinates gather_elements reads and scatter_elements writes: `indices` (checked, negatives
    from the end) along `axis`, every other coordinate the element's own."""
    axis = normalize_axis(axis, len(shape))
    problem = index_problem(indices, shape[axis], axis)
    if problem is not None:
        raise IndexError(problem)
    grid = list(np.indices(indices.shape, sparse=True))
    grid[axis] = np.where(indices < 0, indices + shape[axis], indices)
    return tuple(grid)


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


def index_problem(indices: np.ndarray, dim: int, axis: int, what: str = "gather") -> str | None:
    """What is wrong with the first index outside [-dim, dim) (numpy's range for `np.take`), or None."""
    flat = np.asarray(indices).reshape(-1)
    bad = (flat < -dim) | (flat >= dim)
    if bad.any():
        return f"{what} index".lstrip() + f" {int(flat[np.argmax(bad)])} is out of range for axis {axis} of size {dim}"
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


@op("ge.topk")
class TopK(Operation):
    """The `k` largest (or smallest) values along `axis` and their indices (i64), as torch.topk and ONNX TopK:
    every MoE router's expert choice. Sorted when asked; ties keep the lower index first."""

    OPERAND_NAMES = ("x",)
    NUM_RESULTS = 2
    k = Attr(int)
    axis = Attr(int, default=-1)
    largest = Attr(bool, default=True)
    sorted = Attr(bool, default=True)

    def verify(self) -> str | None:
        if self.k < 0:
            return f"topk k must not be negative, got {self.k}"
        return None

    def infer(self, x: TensorType) -> tuple[TensorType, TensorType]:
        axis = normalize_axis(self.axis, x.rank)
        dim = x.shape[axis]
        if dim is not None and self.k > dim:
            raise ShapeError(f"topk k = {self.k} exceeds dimension {axis} = {dim}")
        shape = x.shape[:axis] + (self.k,) + x.shape[axis + 1:]
        return TensorType(shape, x.dtype), TensorType(shape, DType.i64)

    def compute(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        axis = normalize_axis(self.axis, x.ndim)
        order = stable_order(x, axis, descending=self.largest)  # NaN first when largest, last otherwise
        index = np.take(order, np.arange(self.k), axis=axis)
        if not self.sorted:  # any order is allowed: the index order, as torch's CPU kernel leaves it
            index = np.sort(index, axis=axis)
        return np.take_along_axis(x, index, axis=axis), index.astype(np.int64)


def stable_order(x: np.ndarray, axis: int, descending: bool) -> np.ndarray:
    """The indices that sort `x` along `axis`, equals in index order (NaN above every number, as torch orders it)."""
    if descending:  # a stable ascending sort of the reversed axis, read backwards: no negation, no overflow
        n = x.shape[axis]
        return (n - 1) - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
    return np.argsort(x, axis=axis, kind="stable")


@op("ge.sort")
class Sort(Operation):
    """Every element along `axis` in order and where it came from (i64), equals in index order (a stable sort),
    as torch.sort: unlike ge.topk it takes a run-time dimension (an MoE layer's token-expert pairs by expert)."""

    OPERAND_NAMES = ("x",)
    NUM_RESULTS = 2
    axis = Attr(int, default=-1)
    descending = Attr(bool, default=False)

    def infer(self, x: TensorType) -> tuple[TensorType, TensorType]:
        normalize_axis(self.axis, x.rank)
        return TensorType(x.shape, x.dtype), TensorType(x.shape, DType.i64)

    def compute(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = stable_order(x, normalize_axis(self.axis, x.ndim), self.descending)
        return np.take_along_axis(x, order, axis=normalize_axis(self.axis, x.ndim)), order.astype(np.int64)


@op("ge.histc")
class Histc(Operation):
    """torch.histc: counts of the elements in `bins` equal-width bins over [min, max] (the last bin closed,
    elements outside ignored), in the input's dtype: an MoE layer's tokens per expert."""

    OPERAND_NAMES = ("x",)
    bins = Attr(int)
    min = Attr(float)
    max = Attr(float)

    def verify(self) -> str | None:
        if self.bins < 1:
            return f"histc needs at least one bin, got {self.bins}"
        if not (math.isfinite(self.min) and math.isfinite(self.max) and self.min < self.max):
            return f"histc needs finite min < max, got [{self.min}, {self.max}]"
        return None

    def infer(self, x: TensorType) -> TensorType:
        if not x.dtype.is_float:
            raise ShapeError(f"histc counts floating-point elements (torch's CPU kernel), not {x}")
        return TensorType((self.bins,), x.dtype)

    def compute(self, x: np.ndarray) -> np.ndarray:
        v = x.astype(np.float64).ravel()
        inside = v[(v >= self.min) & (v <= self.max)]
        # torch's bin: floor((v - min) * bins / (max - min)), the maximum itself in the last bin
        pos = np.minimum(((inside - self.min) * self.bins / (self.max - self.min)).astype(np.int64), self.bins - 1)
        return np.bincount(pos, minlength=self.bins).astype(x.dtype)
