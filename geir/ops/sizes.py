"""Sizes known only at run time: ops that read shapes, and ops that take their sizes from tensors.

A dynamic-shape program keeps its size arithmetic in the graph, as `torch.export` and the ONNX
exporters write it: `ge.dim` and `ge.shape_of` read dimensions as small i64 tensors, ordinary ops
(ge.add, ge.concat, ge.slice, ...) compute with them, and the ops here that take sizes from tensors
(`ge.range`, `ge.dynamic_reshape`, `ge.dynamic_slice`, `ge.dynamic_broadcast`) infer `?` where a
size is not known yet and the exact dimension where it is: `partial_sizes` reads through the size
arithmetic, as ONNX's shape inference propagates data. When GE binds a shape signature, const-fold
evaluates the size arithmetic and each of these ops becomes its static form (`StaticForm`): a
ge.arange, ge.reshape, ge.slice or a broadcasting multiply. So one compile serves every length.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from geir.attributes import DenseAttr
from geir.ir import Operation, Value
from geir.opdef import Attr, ShapeError, op
from geir.ops.core import literal_array
from geir.ops.indexing import arange_length
from geir.ops.numerics import broadcast_dims, normalize_axis
from geir.traits import DataMovement, ShapeOnly, StaticForm, TakesSizes
from geir.types import Dim, DType, TensorType


@attrs.frozen(eq=False)
class SameDim:
    """A size equal to dimension `axis` of value `x`, whatever it turns out to be (`x` has `?` there)."""

    x: Value
    axis: int

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SameDim) and other.x is self.x and other.axis == self.axis

    def __hash__(self) -> int:
        return hash((id(self.x), self.axis))


# one element of a size tensor as far as it is known: a number, a named run-time dimension, or unknown
Size = int | SameDim | None


def dim_size(x: Value, axis: int) -> Size:
    """Dimension `axis` of `x`: its number when static, else the run-time dimension itself."""
    d = x.type.shape[axis] if x.type is not None else None
    return SameDim(x, axis) if d is None else d


def _malformed(op: Operation) -> bool:
    """Whether an op has the wrong operand count or a missing or ill-typed attribute (the verifier says which)."""
    from geir.verifier import structure_problem

    return structure_problem(op) is not None


# the most entries a tensor of sizes has: numpy's 64 dimensions (geir.verifier.MAX_RANK)
MAX_SIZES = 64
# the ops partial_sizes reads through to their first operand's elements
_THROUGH = ("ge.reshape", "ge.cast", "ge.slice", "ge.gather")


def partial_sizes(v: Value) -> list[Size] | None:
    """The elements of a 0-D or 1-D integer value as far as the graph tells them before it runs.

    Reads through constants, ge.dim and ge.shape_of (a static dimension is its number, a `?` one a
    SameDim), and through the ops that move such elements around: concat, static slices, reshapes to
    one dimension, gathers at constant indices and integer casts. None when not even the count is known.
    The values it reads through are settled with a stack, not by recursion: a chain of thousands of size ops
    is a graph's depth, not a limit.
    """
    done: dict[int, list[Size] | None] = {}
    stack = [v]
    while stack:
        u = stack[-1]
        if id(u) in done:
            stack.pop()
            continue
        todo = [w for w in _reads_sizes_of(u) if id(w) not in done]
        if todo:
            stack += todo
            continue
        done[id(u)] = _partial_sizes_step(u, done)
        stack.pop()
    return done[id(v)]


def _reads_sizes_of(v: Value) -> list[Value]:
    """The values whose partial sizes `v`'s own depend on (none where the step decides without them)."""
    t, producer = v.type, v.owner
    if (t is None or t.rank > 1 or not t.dtype.is_int or (t.num_elements or 0) > MAX_SIZES or producer is None
            or literal_array(v) is not None
            or any(u.type is None for u in producer.operands) or _malformed(producer)):
        return []
    if producer.name == "ge.concat":
        return list(producer.operands)
    if producer.name in _THROUGH and (producer.name not in ("ge.reshape", "ge.cast")
                                      or producer.operands[0].type.rank <= 1):
        return [producer.operands[0]]
    return []


def _partial_sizes_step(v: Value, done: dict[int, list[Size] | None]) -> list[Size] | None:
    """partial_sizes of `v`, given those of the values it reads (in `done`, by id)."""
    t = v.type
    # more entries than any shape has are not sizes (the op that takes them says so)
    if t is None or t.rank > 1 or not t.dtype.is_int or (t.num_elements or 0) > MAX_SIZES:
        return None
    unknown = None if t.num_elements is None else [None] * t.num_elements
    array = literal_array(v)
    if array is not None:
        return [int(e) for e in array.reshape(-1)]
    producer = v.owner
    if producer is None:
        return unknown
    if any(u.type is None for u in producer.operands):  # types not inferred yet (a verifier's first walk)
        return unknown
    if _malformed(producer):  # its own error is reported at it (`ge.shape_of` without an operand)
        return unknown
    if producer.name == "ge.dim":
        x = producer.operands[0]
        return [dim_size(x, normalize_axis(producer.attr("axis"), x.type.rank))]
    if producer.name == "ge.shape_of":
        x = producer.operands[0]
        return [dim_size(x, i) for i in range(x.type.rank)]
    if producer.name == "ge.concat":
        parts = [done[id(p)] for p in producer.operands]
        return unknown if any(p is None for p in parts) else [e for p in parts for e in p]
    if producer.name in ("ge.reshape", "ge.cast") and producer.operands[0].type.rank <= 1:
        inner = done[id(producer.operands[0])]
        return inner if inner is not None and len(inner) == (t.num_elements or -1) else unknown
    if producer.name == "ge.slice":
        inner = done[id(producer.operands[0])]
        if inner is None:
            return unknown
        steps = producer.attr("steps")
        (s, e) = producer.attr("starts")[0], producer.attr("ends")[0]
        return inner[slice(s, e, steps[0] if steps else 1)]
    if producer.name == "ge.gather":
        inner = done[id(producer.operands[0])]
        at = literal_array(producer.operands[1])
        if inner is None or at is None or not all(-len(inner) <= int(i) < len(inner) for i in at.reshape(-1)):
            return unknown
        return [inner[int(i)] for i in at.reshape(-1)]
    return unknown


def data_source(v: Value) -> Value | None:
    """The graph argument whose elements (not its shape) a size value is computed from, else None: a size
    read by ge.dim or ge.shape_of, or made of constants, is known once the shapes are."""
    seen: set[int] = set()
    stack = [v]
    while stack:
        u = stack.pop()
        if id(u) in seen:
            continue
        seen.add(id(u))
        producer = u.owner
        if producer is None:
            return u
        if not producer.has_trait(ShapeOnly):
            stack.extend(producer.operands)
    return None


def known_ints(v: Value) -> list[int] | None:
    """The elements of a size tensor when every one is a known number, else None."""
    sizes = partial_sizes(v)
    if sizes is None or not all(isinstance(s, int) for s in sizes):
        return None
    return sizes


def _require_sizes(t: TensorType, what: str) -> None:
    """A tensor of sizes: 1-D integers of a static length."""
    if not t.dtype.is_int or t.rank != 1:
        raise ShapeError(f"{what} must be a 1-D integer tensor, not {t}")
    if t.shape[0] is None:
        raise ShapeError(f"{what} must have a static length (the result's rank), not {t}")
    if t.shape[0] > MAX_SIZES:
        raise ShapeError(f"{what} has {t.shape[0]} entries, but a tensor has at most {MAX_SIZES} dimensions")


def _attached(op: Operation) -> bool:
    """The op has its operands (an importer may infer types on a detached probe first: sizes are unknown then)."""
    return len(op.operands) == len(op.OPERAND_NAMES)


@op("ge.dim")
class DimOf(Operation):
    """Dimension `axis` of `x` as a rank-0 i64 tensor (torch's sym_size): known when the shape is bound."""

    OPERAND_NAMES = ("x",)
    TRAITS = (ShapeOnly,)
    axis = Attr(int)

    def infer(self, x: TensorType) -> TensorType:
        normalize_axis(self.axis, x.rank)
        return TensorType((), DType.i64)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.array(x.shape[normalize_axis(self.axis, x.ndim)], dtype=np.int64)


@op("ge.shape_of")
class ShapeOf(Operation):
    """The shape of `x` as a 1-D i64 tensor (ONNX's Shape): known when the shape is bound."""

    OPERAND_NAMES = ("x",)
    TRAITS = (ShapeOnly,)

    def infer(self, x: TensorType) -> TensorType:
        return TensorType((x.rank,), DType.i64)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.array(x.shape, dtype=np.int64)


@op("ge.range")
class Range(Operation, StaticForm):
    """ONNX's Range: `start, start + delta, ...` below `limit`, from rank-0 tensors (torch's arange(S) of a
    run-time S); its length is known once the three are."""

    OPERAND_NAMES = ("start", "limit", "delta")
    TRAITS = (TakesSizes,)
    SIZE_OPERANDS = (0, 1, 2)

    def _bounds(self) -> list | None:
        if not _attached(self):
            return None
        values = [literal_array(v) for v in self.operands]
        if any(a is None for a in values):
            return None
        return [a.item() for a in values]

    def infer(self, start: TensorType, limit: TensorType, delta: TensorType) -> TensorType:
        for name, t in zip(self.OPERAND_NAMES, (start, limit, delta)):
            if t.rank != 0:
                raise ShapeError(f"range {name} must be a rank-0 tensor, not {t}")
            if t.dtype != start.dtype:
                raise ShapeError(f"range operands differ in dtype: {start.dtype} vs {t.dtype}")
        if start.dtype is DType.i1:
            raise ShapeError("range makes numbers, not booleans")
        delta_value = literal_array(self.operands[2]) if _attached(self) else None
        if delta_value is not None and delta_value.item() == 0:
            raise ShapeError("range delta must not be 0")
        bounds = self._bounds()
        if bounds is not None and not all(math.isfinite(v) for v in bounds):
            raise ShapeError(f"range bounds must be finite, not {bounds}")
        return TensorType((None if bounds is None else arange_length(*bounds),), start.dtype)

    def compute(self, start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> np.ndarray:
        if delta.item() == 0:
            raise ValueError("range delta must not be 0")
        n = arange_length(start.item(), limit.item(), delta.item())
        return (start.astype(np.float64 if start.dtype.kind == "f" else np.int64)
                + np.arange(n) * delta.item()).astype(start.dtype)

    def static_form(self, b: Any) -> Value | None:
        bounds = self._bounds()
        if bounds is None:
            return None
        dtype = self.result.type.dtype
        cast = float if dtype.is_float else int
        start, limit, delta = (cast(v) for v in bounds)
        return b.create("ge.arange", [], {"start": start, "limit": limit, "delta": delta, "dtype": dtype}).result


def _resolved_shape(x: tuple, sizes: list, allowzero: bool) -> list[Size]:
    """A reshape target with ONNX's 0 (copy the input's dimension) resolved; -1 stays."""
    out = list(sizes)
    for i, s in enumerate(out):
        if s == 0 and not allowzero:
            if i >= len(x):
                raise ShapeError(f"reshape entry {i} is 0 (copy the input's dimension), but the input has rank {len(x)}")
            out[i] = x[i]
    return out


def _inferred_entry(x_dims: list[Size], target: list[Size]) -> Size:
    """The dimension a reshape's -1 stands for: the input's elements over the others', run-time factors
    named on both sides cancelling; None when it is not known before the run."""
    num = list(x_dims)
    den = [s for s in target if s != -1]
    for s in list(den):
        if isinstance(s, SameDim) and s in num:
            num.remove(s)
            den.remove(s)
    if any(not isinstance(s, int) for s in num + den):
        return None
    n, d = math.prod(num), math.prod(den)
    if d == 0 or n % d:
        raise ShapeError(f"cannot reshape {n} elements into a shape with {d} elements per -1 step")
    return n // d


@op("ge.dynamic_reshape")
class DynamicReshape(Operation, StaticForm):
    """`x` reshaped to the sizes in tensor `shape` (ONNX's Reshape): -1 is inferred, and 0 copies the
    input's dimension unless `allowzero`."""

    OPERAND_NAMES = ("x", "shape")
    TRAITS = (DataMovement, TakesSizes)
    SIZE_OPERANDS = (1,)
    allowzero = Attr(bool, default=False)

    def target(self, x_type: TensorType, shape_type: TensorType) -> list[Size]:
        """The result's dimensions as far as they are known before the run (-1 resolved where it can be)."""
        x = self.operands[0]
        x_dims = [SameDim(x, i) if d is None else d for i, d in enumerate(x_type.shape)]
        sizes = partial_sizes(self.operands[1]) or [None] * shape_type.shape[0]
        out = _resolved_shape(tuple(x_dims), sizes, self.allowzero)
        if sum(1 for s in out if s == -1) > 1:
            raise ShapeError(f"reshape shape has more than one -1: {out}")
        if any(isinstance(s, int) and s < -1 for s in out):
            raise ShapeError(f"reshape shape has a negative dimension other than -1: {out}")
        if -1 in out:
            out[out.index(-1)] = _inferred_entry(x_dims, out)
        elif all(isinstance(s, int) for s in out) and x_type.num_elements is not None \
                and math.prod(out) != x_type.num_elements:
            raise ShapeError(f"cannot reshape {x_type} ({x_type.num_elements} elements) into {out}")
        return out

    def infer(self, x: TensorType, shape: TensorType) -> TensorType:
        _require_sizes(shape, "the reshape's shape")
        if not _attached(self):
            return TensorType((None,) * shape.shape[0], x.dtype)
        dims = [s if isinstance(s, int) else None for s in self.target(x, shape)]
        return TensorType(tuple(dims), x.dtype)

    def compute(self, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
        target = [int(s) for s in _resolved_shape(x.shape, [int(s) for s in shape], self.allowzero)]
        return np.reshape(x, target)

    def static_form(self, b: Any) -> Value | None:
        dims = self.result.type.shape
        if any(d is None for d in dims):
            return None
        return b.create("ge.reshape", [self.operands[0]], {"shape": list(dims)}).result


@op("ge.dynamic_slice")
class DynamicSlice(Operation, StaticForm):
    """`x[starts:ends]` on `axes` with starts and ends from 1-D tensors (ONNX's Slice at step 1; torch's
    slice to a run-time size): negative entries count from the end, and both are clamped."""

    OPERAND_NAMES = ("x", "starts", "ends")
    TRAITS = (DataMovement, TakesSizes)
    SIZE_OPERANDS = (1, 2)
    axes = Attr("ints")

    def bounds(self) -> tuple[list[Size], list[Size]]:
        if not _attached(self):
            return [None] * len(self.axes), [None] * len(self.axes)
        starts = partial_sizes(self.operands[1]) or [None] * len(self.axes)
        ends = partial_sizes(self.operands[2]) or [None] * len(self.axes)
        return starts, ends

    def infer(self, x: TensorType, starts: TensorType, ends: TensorType) -> TensorType:
        _require_sizes(starts, "the slice's starts")
        _require_sizes(ends, "the slice's ends")
        if not starts.shape[0] == ends.shape[0] == len(self.axes):
            raise ShapeError(f"slice axes, starts and ends must have one entry each, got {len(self.axes)}, "
                             f"{starts.shape[0]}, {ends.shape[0]}")
        shape = list(x.shape)
        seen: set[int] = set()
        for a, s, e in zip(self.axes, *self.bounds()):
            axis = normalize_axis(a, x.rank)
            if axis in seen:
                raise ShapeError(f"slice names axis {a} twice")
            seen.add(axis)
            dim = x.shape[axis]
            if isinstance(e, SameDim) and _attached(self) and e == SameDim(self.operands[0], axis) and s == 0:
                continue  # x[0:dim(x)] keeps the whole axis, whatever its size
            known = dim is not None and isinstance(s, int) and isinstance(e, int)
            shape[axis] = len(range(*slice(s, e).indices(dim))) if known else None
        return TensorType(tuple(shape), x.dtype)

    def compute(self, x: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        index = [slice(None)] * x.ndim
        for a, s, e in zip(self.axes, starts.reshape(-1), ends.reshape(-1)):
            index[normalize_axis(a, x.ndim)] = slice(int(s), int(e))
        return x[tuple(index)]

    def static_form(self, b: Any) -> Value | None:
        starts, ends = (known_ints(v) for v in self.operands[1:])
        if starts is None or ends is None or not self.operands[0].type.is_static:
            return None
        # ge.slice clamps as numpy does; ONNX's very large ends (INT64_MAX) clamp the same way
        return b.create("ge.slice", [self.operands[0]], {"axes": list(self.axes), "starts": starts,
                                                         "ends": ends}).result


@op("ge.dynamic_broadcast")
class DynamicBroadcast(Operation, StaticForm):
    """`x` broadcast with the sizes in tensor `shape` (ONNX's Expand, numpy's rule both ways; torch's expand
    to a run-time size)."""

    OPERAND_NAMES = ("x", "shape")
    TRAITS = (DataMovement, TakesSizes)
    SIZE_OPERANDS = (1,)

    def infer(self, x: TensorType, shape: TensorType) -> TensorType:
        _require_sizes(shape, "the broadcast's shape")
        sizes = (partial_sizes(self.operands[1]) if _attached(self) else None) or [None] * shape.shape[0]
        n = max(x.rank, len(sizes))
        xs = (1,) * (n - x.rank) + tuple(x.shape)
        ss = [1] * (n - len(sizes)) + list(sizes)
        out: list[Dim] = []
        for i, (xd, s) in enumerate(zip(xs, ss)):
            if isinstance(s, int):
                if s < 0:
                    raise ShapeError(f"broadcast size {s} is negative")
                out.extend(broadcast_dims((xd,), (s,)))
            elif isinstance(s, SameDim) and s.x is self.operands[0] and s.axis == i - (n - x.rank):
                out.append(xd)  # broadcasting an axis to its own size keeps it
            else:
                out.append(xd if xd not in (None, 1) else None)
        return TensorType(tuple(out), x.dtype)

    def compute(self, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
        target = np.broadcast_shapes(x.shape, tuple(int(s) for s in shape))
        return np.broadcast_to(x, target).copy()

    def static_form(self, b: Any) -> Value | None:
        x, t = self.operands[0], self.result.type
        if not t.is_static or not x.type.is_static:
            return None
        if x.type.shape == t.shape:
            return x
        # GEIR has no broadcast op: a splat of the result's shape broadcasts x exactly (ones, or select for i1)
        if t.dtype is DType.i1:
            true = b.constant(DenseAttr(np.array(True)), TensorType(t.shape, DType.i1))
            false = b.constant(DenseAttr(np.array(False)), TensorType(t.shape, DType.i1))
            return b.create("ge.select", [x, true, false]).result
        ones = b.constant(DenseAttr(np.array(1, dtype=t.dtype.np)), TensorType(t.shape, t.dtype))
        return b.create("ge.mul", [x, ones]).result
