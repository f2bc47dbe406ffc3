"""Data-movement ops: transpose, reshape, concat, split, slice and trans_data."""

from __future__ import annotations

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.numerics import multiply_dims, normalize_axis
from geir.traits import DataMovement, ShapeView
from geir.types import Dim, TensorType


@op("ge.transpose")
class Transpose(Operation):
    """Permute axes: result axis i is input axis perm[i]."""

    OPERAND_NAMES = ("x",)
    TRAITS = (DataMovement,)
    perm = Attr("ints")

    def infer(self, x: TensorType) -> TensorType:
        if sorted(self.perm) != list(range(x.rank)):
            raise ShapeError(f"perm {self.perm} is not a permutation of the {x.rank} axes of {x}")
        return TensorType(tuple(x.shape[p] for p in self.perm), x.dtype)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.transpose(x, self.perm)


@op("ge.reshape")
class Reshape(Operation):
    """Same elements, new shape; one entry of `shape` may be -1 (inferred)."""

    OPERAND_NAMES = ("x",)
    TRAITS = (DataMovement, ShapeView)
    shape = Attr("ints")

    def verify(self) -> str | None:
        if sum(1 for d in self.shape if d == -1) > 1:
            return f"reshape shape {self.shape} has more than one -1"
        if any(d < -1 for d in self.shape):
            return f"reshape shape {self.shape} has a negative dimension other than -1"
        return None

    def infer(self, x: TensorType) -> TensorType:
        target = list(self.shape)
        total = x.num_elements
        known = multiply_dims([d for d in target if d != -1])
        if -1 in target:
            i = target.index(-1)
            if total is None:
                target[i] = None
            elif known == 0 or total % known:
                raise ShapeError(f"cannot reshape {x} into {self.shape}: {total} elements do not divide by {known}")
            else:
                target[i] = total // known
        elif total is not None and known != total:
            raise ShapeError(f"cannot reshape {x} ({total} elements) into {self.shape} ({known} elements)")
        return TensorType(tuple(target), x.dtype)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.reshape(x, self.shape)


@op("ge.concat")
class Concat(Operation):
    """Join tensors along `axis`; other dims must agree."""

    OPERAND_NAMES = ("x+",)
    TRAITS = (DataMovement,)
    axis = Attr(int)

    def infer(self, *xs: TensorType) -> TensorType:
        first = xs[0]
        axis = normalize_axis(self.axis, first.rank)
        total: Dim = 0
        for t in xs:
            if t.rank != first.rank or t.dtype != first.dtype:
                raise ShapeError(f"concat operands must share rank and dtype: {first} vs {t}")
            for i, (a, b) in enumerate(zip(first.shape, t.shape)):
                if i != axis and a is not None and b is not None and a != b:
                    raise ShapeError(f"concat operands differ in dimension {i}: {a} vs {b}")
            total = None if total is None or t.shape[axis] is None else total + t.shape[axis]
        shape = list(first.shape)
        shape[axis] = total
        return TensorType(tuple(shape), first.dtype)

    def compute(self, *xs: np.ndarray) -> np.ndarray:
        return np.concatenate(xs, axis=self.axis)


@op("ge.split")
class Split(Operation):
    """Cut a tensor along `axis` into pieces of `sizes`; one result per piece."""

    OPERAND_NAMES = ("x",)
    TRAITS = (DataMovement,)
    NUM_RESULTS = None
    axis = Attr(int)
    sizes = Attr("ints")

    def verify(self) -> str | None:
        if not self.sizes:
            return "split needs at least one size"
        if any(s < 0 for s in self.sizes):
            return f"split sizes {self.sizes} must not be negative"
        if len(self.results) != len(self.sizes):
            return f"split into {len(self.sizes)} pieces must have {len(self.sizes)} results, has {len(self.results)}"
        return None

    def infer(self, x: TensorType) -> tuple[TensorType, ...]:
        axis = normalize_axis(self.axis, x.rank)
        dim = x.shape[axis]
        if dim is not None and sum(self.sizes) != dim:
            raise ShapeError(f"split sizes {self.sizes} add up to {sum(self.sizes)}, not dimension {axis} = {dim}")
        return tuple(TensorType(x.shape[:axis] + (s,) + x.shape[axis + 1:], x.dtype) for s in self.sizes)

    def compute(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        cuts = np.cumsum(self.sizes)[:-1]
        return tuple(np.split(x, cuts, axis=self.axis))


@op("ge.slice")
class Slice(Operation):
    """`x[starts:ends:steps]` on the given axes (negative indices count from the end, clamped as in numpy; steps
    nonzero, 1 when absent: GPT-J's `x[..., ::2]`, ONNX Slice's steps, a negative step reading backwards as
    torch.flip)."""

    OPERAND_NAMES = ("x",)
    TRAITS = (DataMovement,)
    axes = Attr("ints")
    starts = Attr("ints")
    ends = Attr("ints")
    steps = Attr("ints", default=None)

    def verify(self) -> str | None:
        if not len(self.axes) == len(self.starts) == len(self.ends):
            return f"slice axes, starts and ends must have one entry each, got {len(self.axes)}, {len(self.starts)}, {len(self.ends)}"
        if self.steps is not None:
            if len(self.steps) != len(self.axes):
                return f"slice steps must have one entry per axis, got {len(self.steps)} for {len(self.axes)} axes"
            if 0 in self.steps:
                return f"slice steps must be nonzero, got {list(self.steps)}"
        return None

    def _steps(self) -> list[int]:
        return list(self.steps) if self.steps is not None else [1] * len(self.axes)

    def infer(self, x: TensorType) -> TensorType:
        shape = list(x.shape)
        seen: set[int] = set()
        for a, s, e, st in zip(self.axes, self.starts, self.ends, self._steps()):
            axis = normalize_axis(a, x.rank)
            if axis in seen:
                raise ShapeError(f"slice names axis {a} twice")
            seen.add(axis)
            dim = x.shape[axis]
            shape[axis] = None if dim is None else len(range(*slice(s, e, st).indices(dim)))
        return TensorType(tuple(shape), x.dtype)

    def compute(self, x: np.ndarray) -> np.ndarray:
        index = [slice(None)] * x.ndim
        for a, s, e, st in zip(self.axes, self.starts, self.ends, self._steps()):
            index[a] = slice(s, e, st)
        return x[tuple(index)]


@op("ge.trans_data")
class TransData(Operation):
    """Change the storage format (ND <-> NZ); the values are unchanged."""

    OPERAND_NAMES = ("x",)
    TRAITS = (DataMovement,)
    dst_format = Attr(str, choices=("ND", "NZ"))

    def infer(self, x: TensorType) -> TensorType:
        return TensorType(x.shape, x.dtype, self.dst_format)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return x
