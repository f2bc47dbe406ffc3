"""Attribute values that are not plain Python values: dense literals and weight-archive references.

Plain attributes are Python values: int, float, bool, str, DType, list and dict (nested freely).
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from geir.types import DType, TensorType

# numpy takes arrays of up to 64 dimensions, but its multi-operand iterator only 32 (comparing an array of
# more with one of its own elements raises), so an array held in a literal has at most 32; a splat, one
# value, initialises a tensor of any rank
MAX_LITERAL_RANK = 32


class NestedList(list):
    """A list literal from the parser that remembers how deeply it nests (to refuse absurd depth)."""

    depth: int = 1


class NestedDict(dict):
    """A dictionary literal from the parser that remembers how deeply it nests, lists included."""

    depth: int = 1


@attrs.frozen(eq=False)
class DenseAttr:
    """`dense<...>`: a constant array; `values` holds the literal, a 0-d array when it is a splat."""

    values: np.ndarray

    @property
    def is_splat(self) -> bool:
        return self.values.ndim == 0

    def splat_value(self) -> float | int | bool | None:
        """The single value of a splat (or of an array whose elements are all equal), else None."""
        v = self.values.reshape(-1)
        if v.size == 0:
            return None
        first = v[0]
        if not np.all(v == first):
            return None
        return first.item()

    def to_array(self, type: TensorType) -> np.ndarray:
        """The constant as an array of its result type (splats broadcast to the shape)."""
        arr = self.values
        if arr.dtype != type.dtype.np:
            arr = arr.astype(type.dtype.np)
        if arr.ndim == 0 and type.shape != ():
            arr = np.broadcast_to(arr, type.shape)
        elif arr.size == 0 and arr.shape != type.shape:
            arr = arr.reshape(type.shape)  # `dense<[]>` stands for any empty tensor
        return arr

    def check_against(self, type: TensorType) -> str | None:
        """Why this literal cannot be a value of `type`, or None when it can."""
        if self.values.ndim > MAX_LITERAL_RANK:
            return (f"a dense literal of rank {self.values.ndim}: at most {MAX_LITERAL_RANK} dimensions "
                    f"(a splat takes any)")
        kind = self.values.dtype.kind
        if type.dtype == DType.i1 and kind not in "bi":
            return f"a {_KIND_WORDS[kind]} literal cannot initialise {type}"
        if type.dtype.is_int and kind not in "iub":
            return f"a {_KIND_WORDS[kind]} literal cannot initialise {type}"
        if kind == "b" and type.dtype != DType.i1:
            return f"a boolean literal cannot initialise {type}"
        if kind in "iu" and self.values.size and not type.dtype.is_float:
            # the element type must hold every integer: no silent wrap-around when it is stored
            lo, hi = (0, 1) if type.dtype == DType.i1 else (np.iinfo(type.dtype.np).min, np.iinfo(type.dtype.np).max)
            bad = self.values[(self.values < lo) | (self.values > hi)]
            if bad.size:
                return f"integer {bad.flat[0]} is out of range for {type.dtype} (from {lo} to {hi})"
        if kind in "iuf" and self.values.size and type.dtype.is_float:
            # a finite value the element type cannot hold would become an infinity: no silent change
            with np.errstate(over="ignore", invalid="ignore"):
                stored = self.values.astype(type.dtype.np)
            lost = np.isfinite(self.values) & ~np.isfinite(stored.astype(np.float64))
            if lost.any():
                top = float(np.finfo(type.dtype.np).max)
                return f"{self.values[lost].flat[0].item()!r} is out of range for {type.dtype} (largest finite {top:g})"
        if not type.is_static:
            what = "a splat" if self.values.ndim == 0 else f"a dense literal of shape {_shape_text(self.values.shape)}"
            return f"{what} needs a static result type, not {type}"
        if self.values.ndim == 0:
            return None
        if self.values.size == 0 and type.num_elements == 0:
            return None  # `[]` is the only way to write an empty tensor of rank 2 or more
        if tuple(self.values.shape) != type.shape:
            return f"dense literal has shape {_shape_text(self.values.shape)} but the result type is {type}"
        return None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DenseAttr)
            and self.values.dtype == other.values.dtype
            and self.values.shape == other.values.shape
            and np.array_equal(self.values, other.values, equal_nan=self.values.dtype.kind == "f")
        )

    def __hash__(self) -> int:
        return hash((self.values.dtype.str, self.values.shape, self.values.tobytes()))


_KIND_WORDS = {"f": "floating-point", "i": "integer", "u": "integer", "b": "boolean", "V": "floating-point"}


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]" if shape else "[] (a scalar)"


@attrs.frozen
class DenseResourceAttr:
    """`dense_resource<"key">`: array `key` of the weights archive."""

    key: str


def literal_to_array(literal: object) -> np.ndarray:
    """Turn a parsed dense literal (scalars and rectangular nested lists) into a numpy array.

    Raises ValueError with a readable reason when the nesting is ragged or deeper than
    MAX_LITERAL_RANK, or the values are not numbers or mix kinds. Integers are the parser's,
    already checked to fit in 64 bits at their tokens.
    """
    shape: list[int] = []
    level = [literal]
    # one nesting level at a time, not recursively: any depth is refused cleanly
    while any(isinstance(x, list) for x in level):
        if not all(isinstance(x, list) for x in level) or len({len(x) for x in level}) > 1:
            raise ValueError("dense literal is ragged: its rows have different shapes")
        if len(shape) == MAX_LITERAL_RANK:
            raise ValueError(f"dense literal nests more than {MAX_LITERAL_RANK} deep; a literal has at most "
                             f"{MAX_LITERAL_RANK} dimensions")
        shape.append(len(level[0]))
        level = [y for x in level for y in x]
    if not all(isinstance(x, (int, float)) for x in level):  # bool is an int
        raise ValueError("a dense literal holds numbers, true/false, or nested lists of them")
    if any(isinstance(x, bool) for x in level):
        if not all(isinstance(x, bool) for x in level):
            raise ValueError("dense literal mixes booleans and numbers")
        dtype = np.bool_
    elif any(isinstance(x, float) for x in level):
        dtype = np.float64
    else:
        dtype = np.int64
    return np.array(level, dtype=dtype).reshape(shape)


def format_float(v: float) -> str:
    """Shortest text that reads back as the same float, always with a '.' or exponent."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    s = repr(float(v))
    if "e" not in s and "." not in s:
        s += ".0"
    return s
