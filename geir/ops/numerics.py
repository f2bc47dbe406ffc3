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
    """Numerically stable softmax; a row of all -inf gives NaN, as torch does, and an empty axis an empty result."""
    if x.shape[axis] == 0:
        return x.copy()
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
        if np.count_nonzero(small) * 16 <= small.size:
            # few subnormals (an attention output's): their slow conversions cost less than the patch's passes
            return a.astype(dt)
        out = np.where(small, np.float32(0), a).astype(dt)
        tiny = a[small]
        bits = np.rint(np.abs(tiny) * np.float32(2.0 ** 24)).astype(np.uint16)
        bits |= (tiny.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
        out.view(np.uint16)[small] = bits
        return out


# Veltkamp's splitter for f16's 11 significant bits: 2^(24 - 11) + 1
_F16_SPLITTER = np.float32(8193)
_F16_TINY = np.float32(2.0 ** -14)  # the smallest normal f16
_F16_INF_FROM = np.float32(65520)  # the halfway point past 65504, f16's largest finite: from here on inf


def round_in_f32(a: np.ndarray, dt: np.dtype, *, probabilities: bool = False, out: np.ndarray | None = None,
                 scratch: np.ndarray | None = None) -> np.ndarray:
    """float32 values rounded to `dt` (f16 or bf16) but kept as float32: `a.astype(dt).astype(f32)`, bit for bit.

    For operands the cube takes in half precision but numpy multiplies in f32; this runs on every
    probability tile of FlashAttention, so it avoids numpy's slow f16 conversions. f16 uses Veltkamp's
    split (y = 8193 a; a rounded = y - (y - a)), which in round-to-nearest-even f32 arithmetic gives
    the nearest 11-bit value with ties to even for every normal f16 (checked exhaustively over the
    f32s, test_numerics.py samples it); below 2^-14 an f16 is a multiple of 2^-24, which adding and
    removing 0.75 (whose ulp is 2^-24) rounds to. bf16 rounds the mantissa on the f32 bits.
    `probabilities` promises values in [0, 1] or NaN (FlashAttention's P): no overflow or sign to mind.
    `out` and `scratch` (f32 arrays of a's shape, optional) take the result and the temporary, so a caller that
    rounds a tile per step reuses two buffers instead of faulting in fresh pages each time. With `probabilities`
    and f16, `scratch` may be `a` itself: a is then consumed (overwritten), one tile less for the host's cache.
    """
    a = np.asarray(a, dtype=np.float32)
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # the subnormals are patched through a flat view
    name = np.dtype(dt).name
    if name == "float16":
        return _round_f16_in_f32(a, probabilities, out, scratch)
    if name != "bfloat16":
        return a.astype(dt).astype(np.float32)
    bits = a.view(np.uint32)
    r = np.right_shift(bits, np.uint32(16), out=None if out is None else out.view(np.uint32))
    r &= np.uint32(1)
    r += np.uint32((1 << 15) - 1)
    r += bits  # round half to even at the kept mantissa's last bit
    r &= np.uint32(0xFFFF0000)
    out = r.view(np.float32)
    with np.errstate(invalid="ignore"):
        has_nan = a.size and np.isnan(a.sum())  # one reduction; inf - inf only costs the slow check below
    if has_nan:
        out = np.where(np.isnan(a), a, out)  # the bit arithmetic could carry a NaN's payload into inf
    return out


def _round_f16_in_f32(a: np.ndarray, probabilities: bool, out: np.ndarray | None = None,
                      scratch: np.ndarray | None = None) -> np.ndarray:
    """`a.astype(float16).astype(float32)` in f32 arithmetic (see round_in_f32)."""
    with np.errstate(over="ignore", invalid="ignore"):
        # the subnormals first, from a as given (scratch may be a itself, consumed by the split below)
        if probabilities:
            # one reduction (NaN-blind, as the comparison is) decides whether any subnormal needs the patch
            small = np.less(a, _F16_TINY) if a.size and np.fmin.reduce(a, axis=None) < _F16_TINY else None
        else:
            small = np.abs(a) < _F16_TINY
        at = None if small is None else np.flatnonzero(small)  # (one pass: an any() first would be a second)
        sub = None
        if at is not None and at.size:
            # a gather of the few subnormals is cheaper than a masked copy over the whole tile
            flat = a.reshape(-1)
            sub = flat[at] + np.float32(0.75)
            sub -= np.float32(0.75)
            np.copysign(sub, flat[at], out=sub)  # a tiny negative that rounds to zero (or -0.0) is -0.0
        out = np.multiply(a, _F16_SPLITTER, out=out)
        t = np.subtract(out, a, out=scratch)
        out -= t  # a NaN stays NaN; an overflow or inf turns into NaN, put right below
        if sub is not None:
            out.reshape(-1)[at] = sub
        if not probabilities and out.size and not (np.fmax.reduce(a, axis=None) < _F16_INF_FROM
                                                   and np.fmin.reduce(a, axis=None) > -_F16_INF_FROM):
            out = np.where(np.abs(a) >= _F16_INF_FROM, np.copysign(np.float32(np.inf), a), out)
    return out
