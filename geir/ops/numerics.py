"""Shared helpers for op shape rules and numpy semantics."""

from __future__ import annotations

import math

import numpy as np

from geir.opdef import ShapeError
from geir.types import Dim, DType, TensorType

_F32 = np.dtype(np.float32)
_HALF = ("float16", "bfloat16")


def work(x: np.ndarray) -> np.ndarray:
    """The array in the precision arithmetic runs at: f16 and bf16 compute in f32, as the vector unit does."""
    if x.dtype.name in _HALF:
        return x.astype(_F32)
    return x


def broadcast_dims(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """numpy broadcasting of two shapes where None is `?`; raises ShapeError when they clash."""
    out: list[Dim] = []
    n = max(len(a), len(b))
    pa = (1,) * (n - len(a)) + tuple(a)
    pb = (1,) * (n - len(b)) + tuple(b)
    for i, (x, y) in enumerate(zip(pa, pb)):
        if x == 1:
            out.append(y)
        elif y == 1:
            out.append(x)
        elif x is None:
            out.append(y)
        elif y is None or x == y:
            out.append(x)
        else:
            raise ShapeError(
                f"shapes {shape_text(a)} and {shape_text(b)} do not broadcast: dimension {i - n} is {x} vs {y}"
            )
    return tuple(out)


def shape_text(shape: tuple[Dim, ...]) -> str:
    """A shape as the IR spells its dims: `8x?x64`, or `scalar`."""
    return "x".join("?" if d is None else str(d) for d in shape) or "scalar"


def same_dtype(op_name: str, *types: TensorType) -> DType:
    """The common dtype of some operands; raises ShapeError when they differ."""
    first = types[0].dtype
    for t in types[1:]:
        if t.dtype != first:
            raise ShapeError(f"operand dtypes differ: {first} vs {t.dtype}")
    return first


def require_float(t: TensorType, what: str = "operand") -> None:
    if not t.dtype.is_float:
        raise ShapeError(f"{what} must be a floating-point tensor, not {t}")


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """axis in [-rank, rank) made non-negative; raises ShapeError when out of range."""
    if not -rank <= axis < rank:
        raise ShapeError(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank


def multiply_dims(dims: list[Dim]) -> Dim:
    n = 1
    for d in dims:
        if d is None:
            return None
        n *= d
    return n


_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, exact to double precision (math.erf elementwise)."""
    return np.asarray(_erf(x)).astype(x.dtype) if x.size else x.copy()  # a 0-d input gives a Python float


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Numerically stable softmax; a row of all -inf gives NaN, as torch does."""
    m = np.max(x, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - m)
        return e / np.sum(e, axis=axis, keepdims=True)


def round_to(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    """`a.astype(dt)` as `run_op` rounds results, bit for bit.

    numpy converts f32 to f16 subnormals on a slow scalar path (about 20x slower than normal values);
    probabilities and other small results are full of them, so those are rounded here directly:
    below 2^-14 an f16 is a multiple of 2^-24, so its bits are round-half-even(|x| * 2^24) with the sign.
    """
    a = np.asarray(a)
    dt = np.dtype(dt)
    if a.dtype == dt:
        return a
    with np.errstate(all="ignore"):
        if a.dtype != np.float32 or dt != np.float16:
            return a.astype(dt)
        small = np.abs(a) < np.float32(2.0 ** -14)
        if not small.any():
            return a.astype(dt)
        out = np.where(small, np.float32(0), a).astype(dt)
        tiny = a[small]
        bits = np.rint(np.abs(tiny) * np.float32(2.0 ** 24)).astype(np.uint16)
        bits |= (tiny.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
        out.view(np.uint16)[small] = bits
        return out


def round_in_f32(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    """float32 values rounded to `dt` (f16 or bf16) but kept as float32: `a.astype(dt).astype(f32)`, bit for bit.

    For operands the cube takes in half precision but numpy multiplies in f32: integer arithmetic on
    the f32 bits rounds the mantissa to nearest-even without two slow dtype conversions. This runs
    on every probability tile of FlashAttention, so it works in place where it can.
    """
    a = np.asarray(a, dtype=np.float32)
    name = np.dtype(dt).name
    if name not in ("float16", "bfloat16"):
        return a.astype(dt).astype(np.float32)
    bits = a.view(np.uint32)
    shift, keep = (16, np.uint32(0xFFFF0000)) if name == "bfloat16" else (13, np.uint32(0xFFFFE000))
    r = bits >> shift
    r &= np.uint32(1)
    r += np.uint32((1 << (shift - 1)) - 1)
    r += bits  # round half to even at the kept mantissa's last bit
    r &= keep
    out = r.view(np.float32)
    if name == "float16":
        # below 2^-14 an f16 is a multiple of 2^-24: adding 0.75 (whose ulp is 2^-24) rounds to it
        small = (bits & np.uint32(0x7FFFFFFF)) < np.uint32(0x38800000)
        if small.any():
            sub = a + np.float32(0.75)
            sub -= np.float32(0.75)
            np.copysign(sub, a, out=sub)  # a tiny negative that rounds to zero is -0.0
            np.copyto(out, sub, where=small)
        with np.errstate(invalid="ignore"):
            # past 65504 an f16 is infinite (fmax/fmin skip NaNs, which are handled below)
            if out.size and (np.fmax.reduce(out, axis=None) > 65504 or np.fmin.reduce(out, axis=None) < -65504):
                out = np.where(np.abs(out) > np.float32(65504), np.copysign(np.float32(np.inf), a), out)
    with np.errstate(invalid="ignore"):
        has_nan = a.size and np.isnan(a.sum())  # one reduction; inf - inf only costs the slow check below
    if has_nan:
        out = np.where(np.isnan(a), a, out)
    return out
