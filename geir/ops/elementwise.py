"""Elementwise ops: binary arithmetic, comparisons, select, unary math, gelu and cast."""

from __future__ import annotations

from typing import Callable

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.numerics import broadcast_dims, erf, require_float, same_dtype, work
from geir.traits import Elementwise, InPlaceCapable
from geir.types import DType, TensorType


class Binary(Operation):
    """`a OP b` with numpy broadcasting; both operands share one dtype."""

    OPERAND_NAMES = ("a", "b")
    TRAITS = (Elementwise, InPlaceCapable)
    VECTOR_PASSES = 1  # vector instructions per element (geir/traits.py Elementwise)
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray]

    def infer(self, a: TensorType, b: TensorType) -> TensorType:
        dtype = same_dtype(self.name, a, b)
        return TensorType(broadcast_dims(a.shape, b.shape), dtype)

    def compute(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return type(self).fn(work(a), work(b))


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division truncating toward zero, as C and the device do."""
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        q = np.floor_divide(a, b)
        fix = (q < 0) & (q * b != a)
        return q + fix
    return np.divide(a, b)


for _name, _fn in {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": _int_div,
    "max": np.maximum,
    "min": np.minimum,
    "pow": np.power,
}.items():
    op(f"ge.{_name}")(type(_name.capitalize(), (Binary,), {"fn": staticmethod(_fn), "__doc__": f"elementwise {_name}",
                                                           "VECTOR_PASSES": 3 if _name == "pow" else 1}))


class Compare(Binary):
    """`a CMP b` with broadcasting; the result is i1."""

    def infer(self, a: TensorType, b: TensorType) -> TensorType:
        return super().infer(a, b).with_dtype(DType.i1)


for _name, _fn in {"greater": np.greater, "less": np.less, "equal": np.equal}.items():
    op(f"ge.{_name}")(type(_name.capitalize(), (Compare,), {"fn": staticmethod(_fn), "__doc__": f"elementwise {_name}"}))


@op("ge.select")
class Select(Operation):
    """`np.where(cond, a, b)` with broadcasting of all three."""

    OPERAND_NAMES = ("cond", "a", "b")
    TRAITS = (Elementwise, InPlaceCapable)
    VECTOR_PASSES = 1  # vector instructions per element (geir/traits.py Elementwise)

    def infer(self, cond: TensorType, a: TensorType, b: TensorType) -> TensorType:
        if cond.dtype != DType.i1:
            raise ShapeError(f"condition must be an i1 tensor, not {cond}")
        dtype = same_dtype(self.name, a, b)
        return TensorType(broadcast_dims(cond.shape, broadcast_dims(a.shape, b.shape)), dtype)

    def compute(self, cond: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(cond, a, b)


class Unary(Operation):
    """`OP(x)` elementwise."""

    OPERAND_NAMES = ("x",)
    TRAITS = (Elementwise, InPlaceCapable)
    VECTOR_PASSES = 1  # vector instructions per element (geir/traits.py Elementwise)
    FLOAT_ONLY = True
    fn: Callable[[np.ndarray], np.ndarray]

    def infer(self, x: TensorType) -> TensorType:
        if self.FLOAT_ONLY:
            require_float(x)
        return TensorType(x.shape, x.dtype)

    def compute(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return type(self).fn(work(x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


_UNARY = {
    "exp": (np.exp, True),
    "log": (np.log, True),
    "sqrt": (np.sqrt, True),
    "rsqrt": (lambda x: 1 / np.sqrt(x), True),
    "neg": (np.negative, False),
    "abs": (np.abs, False),
    "tanh": (np.tanh, True),
    "sigmoid": (_sigmoid, True),
    "relu": (lambda x: np.maximum(x, 0).astype(x.dtype), False),
    "silu": (lambda x: x * _sigmoid(x), True),
    "erf": (erf, True),
    "sin": (np.sin, True),
    "cos": (np.cos, True),
}
# vector instructions per element where more than one: short exp/div or polynomial sequences; sin and cos, as
# Ascend C's math library computes them, a range reduction and a polynomial, counted as erf's
_UNARY_PASSES = {"rsqrt": 2, "tanh": 4, "sigmoid": 3, "silu": 4, "erf": 6, "sin": 6, "cos": 6}
for _name, (_fn, _float_only) in _UNARY.items():
    op(f"ge.{_name}")(
        type(_name.capitalize(), (Unary,), {"fn": staticmethod(_fn), "FLOAT_ONLY": _float_only, "__doc__": f"elementwise {_name}",
                                            "VECTOR_PASSES": _UNARY_PASSES.get(_name, 1)})
    )


class FloatTest(Operation):
    """A test of each float element; the result is i1 (never the size of its operand: not InPlaceCapable)."""

    OPERAND_NAMES = ("x",)
    TRAITS = (Elementwise,)
    VECTOR_PASSES = 1  # vector instructions per element (geir/traits.py Elementwise)
    fn: Callable[[np.ndarray], np.ndarray]

    def infer(self, x: TensorType) -> TensorType:
        require_float(x)
        return TensorType(x.shape, DType.i1)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return type(self).fn(work(x))


for _name, _fn in {"isinf": np.isinf, "isnan": np.isnan}.items():
    op(f"ge.{_name}")(type(_name.capitalize(), (FloatTest,), {"fn": staticmethod(_fn), "__doc__": f"elementwise {_name}, i1"}))


@op("ge.gelu")
class Gelu(Unary):
    """GELU, exact (`approximate = "none"`) or with the tanh approximation."""

    VECTOR_PASSES = 8

    approximate = Attr(str, default="none", choices=("none", "tanh"))

    def compute(self, x: np.ndarray) -> np.ndarray:
        x = work(x)
        if self.approximate == "tanh":
            return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi).astype(x.dtype) * (x + 0.044715 * x**3)))
        return 0.5 * x * (1 + erf(x / np.sqrt(2).astype(x.dtype)))


@op("ge.cast")
class Cast(Operation):
    """Convert elements to the dtype `to` (floats to ints truncate toward zero)."""

    OPERAND_NAMES = ("x",)
    TRAITS = (Elementwise, InPlaceCapable)
    VECTOR_PASSES = 1  # vector instructions per element (geir/traits.py Elementwise)
    to = Attr(DType)

    def infer(self, x: TensorType) -> TensorType:
        return TensorType(x.shape, self.to)

    def compute(self, x: np.ndarray) -> np.ndarray:
        if self.to.is_float and x.dtype.kind == "f" and x.dtype.itemsize == 8:
            return x  # the float64 reference keeps full precision through float casts
        with np.errstate(all="ignore"):
            return x.astype(self.to.np)
