"""Tensor types: dtypes, dimensions (static or `?`) and storage formats."""

from __future__ import annotations

import enum
from functools import lru_cache

import attrs
import numpy as np


class DType(enum.Enum):
    """The element types of GEIR tensors, named as they are spelled in the IR."""

    f16 = "f16"
    bf16 = "bf16"
    f32 = "f32"
    f64 = "f64"  # no AI Core kernel takes it: GE places ops on f64 on the AI CPU engine
    i8 = "i8"
    i32 = "i32"
    i64 = "i64"
    i1 = "i1"

    def __str__(self) -> str:
        return self.value

    @property
    def np(self) -> np.dtype:
        """The numpy dtype that stores elements of this type."""
        if self is DType.bf16 and self not in _NUMPY:
            _load_bfloat16()
        return _NUMPY[self]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return 2 if self is DType.bf16 else _NUMPY[self].itemsize

    @property
    def is_float(self) -> bool:
        return self in (DType.f16, DType.bf16, DType.f32, DType.f64)

    @property
    def is_int(self) -> bool:
        return self in (DType.i8, DType.i32, DType.i64)

    @classmethod
    def from_numpy(cls, dtype: np.dtype) -> "DType":
        """The GEIR dtype for a numpy dtype (KeyError if there is none)."""
        if np.dtype(dtype).name == "bfloat16":
            return DType.bf16
        return _FROM_NUMPY[np.dtype(dtype)]


def _load_bfloat16() -> None:
    # ml_dtypes costs a noticeable part of every tool's start-up, so it loads on first use of bf16
    import ml_dtypes

    _NUMPY[DType.bf16] = np.dtype(ml_dtypes.bfloat16)


_NUMPY = {
    DType.f16: np.dtype(np.float16),
    DType.f32: np.dtype(np.float32),
    DType.f64: np.dtype(np.float64),
    DType.i8: np.dtype(np.int8),
    DType.i32: np.dtype(np.int32),
    DType.i64: np.dtype(np.int64),
    DType.i1: np.dtype(np.bool_),
}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items()}
DTYPES = {d.value: d for d in DType}
FORMATS = ("ND", "NZ")

# A dimension is an int, or None for `?` (known only at run time).
Dim = int | None

# Integers in the IR (dimensions, integer attributes, elements of dense literals) are 64-bit.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT64_DIGITS = len(str(INT64_MAX))


def int64(text: str, what: str, minimum: int = INT64_MIN) -> int:
    """The value of a decimal integer token, from `minimum` to INT64_MAX; ValueError naming `what` if not."""
    digits = text.lstrip("+-").lstrip("0")
    if len(digits) > INT64_DIGITS:
        # not int(text): Python refuses to convert more than 4300 digits, and none of these fit anyway
        raise ValueError(f"{what} has {len(digits)} digits; at most {INT64_DIGITS} fit in 64 bits")
    value = int(text)
    if not minimum <= value <= INT64_MAX:
        raise ValueError(f"{what} {text} does not fit in 64 bits (from {minimum} to {INT64_MAX})")
    return value


@attrs.frozen(cache_hash=True)
class TensorType:
    """`tensor<DIMS x DTYPE [, FORMAT]>`; shape entries are ints or None for `?`."""

    shape: tuple[Dim, ...]
    dtype: DType
    format: str = "ND"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return None not in self.shape

    @property
    def num_elements(self) -> int | None:
        """Element count, or None when some dimension is dynamic."""
        if not self.is_static:
            return None
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int | None:
        n = self.num_elements
        return None if n is None else n * self.dtype.itemsize

    def with_shape(self, shape: tuple[Dim, ...]) -> "TensorType":
        return TensorType(tuple(shape), self.dtype, self.format)

    def with_dtype(self, dtype: DType) -> "TensorType":
        return TensorType(self.shape, dtype, self.format)

    def __str__(self) -> str:
        return format_type(self)


@lru_cache(maxsize=4096)
def format_type(t: TensorType) -> str:
    """The canonical spelling of a tensor type."""
    dims = "".join(("?" if d is None else str(d)) + "x" for d in t.shape)
    fmt = "" if t.format == "ND" else f", {t.format}"
    return f"tensor<{dims}{t.dtype.value}{fmt}>"


class TypeSyntaxError(ValueError):
    """A malformed type; `offset` is the character offset of the problem within the type text."""

    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


@lru_cache(maxsize=4096)
def parse_type(text: str) -> TensorType:
    """Parse the text of one `tensor<...>` token (the lexer has already checked its outline)."""
    body = text[len("tensor<"):-1]
    base = len("tensor<")
    fmt = "ND"
    if "," in body:
        body, _, fmt_text = body.partition(",")
        fmt = fmt_text.strip()
        if fmt not in FORMATS:
            at = text.index(",") + 1 + (len(fmt_text) - len(fmt_text.lstrip()))
            raise TypeSyntaxError(f"unknown storage format '{fmt}' (expected ND or NZ)", at)
    body = body.rstrip()
    parts = body.split("x")
    # dtypes never contain an 'x', so the last part is the dtype and the rest are dims
    dtype_text = parts[-1]
    dtype_offset = base + len(body) - len(dtype_text)
    dtype = DTYPES.get(dtype_text)
    if dtype is None:
        raise TypeSyntaxError(f"unknown dtype '{dtype_text}' (expected one of {', '.join(DTYPES)})", dtype_offset)
    shape: list[Dim] = []
    offset = base
    for part in parts[:-1]:
        if part == "?":
            shape.append(None)
        elif part.isdigit() and part.isascii():
            try:
                shape.append(int64(part, "dimension", minimum=0))
            except ValueError as e:
                raise TypeSyntaxError(str(e), offset) from None
        else:
            raise TypeSyntaxError(f"bad dimension '{part}' (expected a non-negative integer or '?')", offset)
        offset += len(part) + 1
    return TensorType(tuple(shape), dtype, fmt)


def dims_compatible(a: Dim, b: Dim) -> bool:
    """Two dimensions can describe the same tensor: equal, or one is `?`."""
    return a is None or b is None or a == b


def types_compatible(a: TensorType, b: TensorType) -> bool:
    """Same dtype and rank, and each dimension compatible (`?` matches anything)."""
    return (
        a.dtype == b.dtype
        and len(a.shape) == len(b.shape)
        and all(dims_compatible(x, y) for x, y in zip(a.shape, b.shape))
    )
