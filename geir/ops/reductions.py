"""Reductions and the ops built on them: reduce_*, softmax, layer_norm, rms_norm."""

from __future__ import annotations

import warnings

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops import numerics
from geir.ops.numerics import broadcast_dims, normalize_axis, require_float, work
from geir.traits import Normalization, RowWise
from geir.types import TensorType


class Reduce(Operation):
    """Reduce over `axes`, keeping them as size 1 when `keepdims`."""

    OPERAND_NAMES = ("x",)
    TRAITS = (RowWise,)
    axes = Attr("ints")
    keepdims = Attr(bool, default=False)
    # the row kernel's facts (geir/traits.py RowWise): one pass (reduce_mean: the sum, then the scale)
    ROW_PASSES = 1
    ROW_STAT_PASSES = None
    SEGMENT_STATISTIC = "sum"
    # whether the reduction has a value over no elements (a sum's 0, a mean's NaN); a max has none (numpy and torch
    # both refuse it)
    OVER_NOTHING = True

    @classmethod
    def row_axes(cls, attributes: dict, rank: int) -> tuple[int, ...]:
        return tuple(sorted(a % rank for a in attributes.get("axes", []))) if rank else ()

    def normalized_axes(self, rank: int) -> tuple[int, ...]:
        axes = tuple(normalize_axis(a, rank) for a in self.axes)
        if len(set(axes)) != len(axes):
            raise ShapeError(f"axes {self.axes} name the same axis twice")
        return axes

    def infer(self, x: TensorType) -> TensorType:
        axes = self.normalized_axes(x.rank)
        empty = [a for a in axes if x.shape[a] == 0]
        if empty and not self.OVER_NOTHING:
            raise ShapeError(f"axis {empty[0]} has no elements: {self.name} over nothing has no value")
        if self.keepdims:
            shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
        else:
            shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
        return TensorType(shape, x.dtype)

    def compute(self, x: np.ndarray) -> np.ndarray:
        axes = self.normalized_axes(x.ndim)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a mean over nothing is NaN, as numpy says, quietly
            return type(self).fn(work(x), axis=axes, keepdims=self.keepdims)


for _name, _fn, _passes in (("sum", np.sum, 1), ("max", np.max, 1), ("mean", np.mean, 2)):
    op(f"ge.reduce_{_name}")(
        type(f"Reduce{_name.capitalize()}", (Reduce,), {"fn": staticmethod(_fn), "__doc__": f"reduce_{_name} over axes",
                                                        "ROW_PASSES": _passes, "SEGMENT_STATISTIC": _name,
                                                        "OVER_NOTHING": _name != "max"})
    )


@op("ge.softmax")
class Softmax(Operation):
    """softmax along one axis."""

    OPERAND_NAMES = ("x",)
    TRAITS = (RowWise,)
    axis = Attr(int, default=-1)
    # per element: max, sub, exp, sum, div; the statistics pass of a segmented row: max, sub-exp, sum (online)
    ROW_PASSES = 5
    ROW_STAT_PASSES = 3
    SEGMENT_STATISTIC = "softmax"

    @classmethod
    def row_axes(cls, attributes: dict, rank: int) -> tuple[int, ...]:
        return (attributes.get("axis", -1) % rank,)

    def infer(self, x: TensorType) -> TensorType:
        require_float(x)
        normalize_axis(self.axis, x.rank)
        return TensorType(x.shape, x.dtype)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return numerics.softmax(work(x), self.axis)


def _check_affine(x: TensorType, param: TensorType, what: str) -> None:
    if param.dtype != x.dtype:
        raise ShapeError(f"{what} dtype {param.dtype} differs from the input's {x.dtype}")
    if broadcast_dims(x.shape, param.shape) != x.shape:
        raise ShapeError(f"{what} of type {param} does not broadcast to the input {x}")


@op("ge.layer_norm")
class LayerNorm(Operation):
    """(x - mean) / sqrt(var + epsilon) * gamma + beta, over the axes from `axis` to the last."""

    OPERAND_NAMES = ("x", "gamma", "beta")
    TRAITS = (RowWise, Normalization)
    axis = Attr(int, default=-1)
    epsilon = Attr(float, default=1e-5)
    # per element: sum, sub, square, sum, scale, mul gamma, add beta; statistics: the first four (Chan's merge)
    ROW_PASSES = 7
    ROW_STAT_PASSES = 4
    SEGMENT_STATISTIC = "mean_m2"

    @classmethod
    def row_axes(cls, attributes: dict, rank: int) -> tuple[int, ...]:
        return tuple(range(attributes.get("axis", -1) % rank, rank))

    def infer(self, x: TensorType, gamma: TensorType, beta: TensorType) -> TensorType:
        require_float(x)
        normalize_axis(self.axis, x.rank)
        _check_affine(x, gamma, "gamma")
        _check_affine(x, beta, "beta")
        return TensorType(x.shape, x.dtype)

    def compute(self, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
        x = work(x)
        axes = tuple(range(normalize_axis(self.axis, x.ndim), x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        var = np.square(x - mean).mean(axis=axes, keepdims=True)
        return (x - mean) / np.sqrt(var + self.epsilon) * work(gamma) + work(beta)


@op("ge.rms_norm")
class RmsNorm(Operation):
    """x / sqrt(mean(x^2) + epsilon) * gamma over the last axis."""

    OPERAND_NAMES = ("x", "gamma")
    TRAITS = (RowWise, Normalization)
    epsilon = Attr(float, default=1e-6)
    # per element: square, sum, scale, mul gamma; statistics: square and sum
    ROW_PASSES = 4
    ROW_STAT_PASSES = 2
    SEGMENT_STATISTIC = "sum_of_squares"

    @classmethod
    def row_axes(cls, attributes: dict, rank: int) -> tuple[int, ...]:
        return (rank - 1,)

    def infer(self, x: TensorType, gamma: TensorType) -> TensorType:
        require_float(x)
        if x.rank == 0:
            raise ShapeError("rms_norm needs an input of rank 1 or more")
        _check_affine(x, gamma, "gamma")
        return TensorType(x.shape, x.dtype)

    def compute(self, x: np.ndarray, gamma: np.ndarray) -> np.ndarray:
        x = work(x)
        ms = np.square(x).mean(axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.epsilon) * work(gamma)
