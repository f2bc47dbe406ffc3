"""How each aten op of an exported PyTorch program becomes GEIR ops.

A converter takes the builder, the fx node and the node's arguments by their schema names (tensors
already GEIR values, everything else plain Python), and returns the GEIR value(s) standing for the
node's result(s). CONVERTERS maps an aten overload packet name (`aten.linear`) to its converter;
an op without one is a TorchImportError naming it.

The mapping keeps the shapes GE's fusion rules look for: `aten.linear` is a matmul with
`transpose_b` plus a bias add (`fuse` makes it a `ge.fused_matmul`), `aten.matmul` is one
`ge.matmul` with batch broadcasting (not torch's expand/bmm/view decomposition), a transpose stays a
`ge.transpose`, and `scaled_dot_product_attention` is `ge.flash_attention` directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from geir.frontends.torch_builder import GraphBuilder, RunTimeSize, dims_of, geir_dtype
from geir.ops.core import literal_array
from geir.attributes import DenseResourceAttr
from geir.ir import Value
from geir.opdef import ShapeError
from geir.ops.indexing import flat_indices
from geir.ops.numerics import normalize_axis
from geir.passes.fusion.attention import constant_mask_meaning
from geir.types import Dim, DType, TensorType


Converter = Callable[[GraphBuilder, Any, dict[str, Any]], Any]
CONVERTERS: dict[str, Converter] = {}


def converts(*names: str) -> Callable[[Converter], Converter]:
    """Register a converter for the aten overload packets `names` (`aten.add`, ...)."""

    def register(fn: Converter) -> Converter:
        for name in names:
            CONVERTERS[name] = fn
        return fn

    return register


# --- what torch says about a node's result ------------------------------------------------------------

def result_meta(node: Any, i: int | None = None) -> Any:
    """The fake tensor torch traced for the node's result (result `i` of a multi-result node)."""
    val = node.meta.get("val")
    return val[i] if i is not None else val


def result_type(b: GraphBuilder, node: Any, i: int | None = None) -> TensorType:
    """The GEIR type of the node's result as torch traced it."""
    val = result_meta(node, i)
    return TensorType(dims_of(val.shape), geir_dtype(val.dtype, f"the result of node '{node.name}'"))


def result_dtype(b: GraphBuilder, node: Any) -> DType:
    return result_type(b, node).dtype


def operand(b: GraphBuilder, x: Any, dtype: DType, hint: str = "c") -> Value:
    """A tensor operand in `dtype`: a value cast when needed, or a Python number as a scalar constant."""
    if isinstance(x, Value):
        return b.cast(x, dtype)
    if isinstance(x, RunTimeSize):  # a size known at run time, as a rank-0 operand
        return b.cast(x.value, dtype)
    if isinstance(x, (bool, int, float)):
        return b.scalar(x, dtype, hint)
    raise b.error(f"expected a tensor or a number, got {type(x).__name__}")


def _input(a: dict) -> Any:
    """The op's main operand (`self` in the aten schema, `input` once fx normalises it)."""
    return a["input"] if "input" in a else a["self"]


def tensor(b: GraphBuilder, x: Any, what: str) -> Value:
    """`x` when it is a tensor value; an error naming `what` otherwise."""
    if not isinstance(x, Value):
        raise b.error(f"{what} must be a tensor, got {type(x).__name__}")
    return x


def _axis(b: GraphBuilder, dim: int, rank: int) -> int:
    try:
        return normalize_axis(dim, rank)
    except Exception:  # noqa: BLE001 - ShapeError or IndexError from a bad dim
        raise b.error(f"dimension {dim} is out of range for rank {rank}") from None


# --- elementwise ------------------------------------------------------------------------------------

def _binary(b: GraphBuilder, node: Any, name: str, x: Any, y: Any, dtype: DType) -> Value:
    return b.value(name, [operand(b, x, dtype), operand(b, y, dtype)])


@converts("aten.add", "aten.sub")
def _add_sub(b: GraphBuilder, node: Any, a: dict) -> Value:
    dtype = result_dtype(b, node)
    other = a["other"]
    alpha = a.get("alpha", 1)
    if alpha != 1:
        other = other * alpha if not isinstance(other, Value) else b.value("ge.mul", [
            operand(b, other, dtype), b.scalar(alpha, dtype, "alpha")], hint=f"{node.name}_alpha")
    name = "ge.add" if str(node.target.overloadpacket) == "aten.add" else "ge.sub"
    return _binary(b, node, name, _input(a), other, dtype)


@converts("aten.rsub")
def _rsub(b: GraphBuilder, node: Any, a: dict) -> Value:
    dtype = result_dtype(b, node)
    x = operand(b, _input(a), dtype)
    if a.get("alpha", 1) != 1:
        x = b.value("ge.mul", [x, b.scalar(a["alpha"], dtype, "alpha")], hint=f"{node.name}_alpha")
    return b.value("ge.sub", [operand(b, a["other"], dtype), x])


_SIMPLE_BINARY = {"aten.mul": "ge.mul", "aten.maximum": "ge.max", "aten.minimum": "ge.min", "aten.pow": "ge.pow"}


@converts(*_SIMPLE_BINARY)
def _simple_binary(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = _input(a)
    y = a["other"] if "other" in a else a["exponent"]
    return _binary(b, node, _SIMPLE_BINARY[str(node.target.overloadpacket)], x, y, result_dtype(b, node))


@converts("aten.min", "aten.max")
def _min_max(b: GraphBuilder, node: Any, a: dict) -> Value:
    # only the elementwise overload (min.other); torch.min over a dimension returns values and indices
    if node.target._overloadname != "other":
        raise b.error("min/max over dimensions is not supported (GEIR maps the elementwise min.other and max.other, "
                      "and amax)")
    name = "ge.min" if str(node.target.overloadpacket) == "aten.min" else "ge.max"
    return _binary(b, node, name, _input(a), a["other"], result_dtype(b, node))


@converts("aten.div")
def _div(b: GraphBuilder, node: Any, a: dict) -> Value:
    dtype = result_dtype(b, node)
    mode = a.get("rounding_mode")
    if mode is not None and not (mode == "trunc" and not dtype.is_float):
        raise b.error(f"division with rounding_mode='{mode}' on {dtype} is not supported (GEIR's ge.div is true "
                      f"division for floats and truncating for integers)")
    return _binary(b, node, "ge.div", _input(a), a["other"], dtype)


def _compare_dtype(b: GraphBuilder, node: Any) -> DType:
    """The dtype torch compares in (its type promotion of the two operands)."""
    args = list(node.args[:2]) + [node.kwargs.get("other")] * (2 - len(node.args[:2]))
    metas = [arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg for arg in args]
    return geir_dtype(torch.result_type(*metas), f"the operands of node '{node.name}'")


# torch comparison -> (GEIR op, negate its result): a >= b is not (a < b)
_COMPARISONS = {
    "aten.gt": ("ge.greater", False), "aten.lt": ("ge.less", False), "aten.eq": ("ge.equal", False),
    "aten.ne": ("ge.equal", True), "aten.ge": ("ge.less", True), "aten.le": ("ge.greater", True),
}


@converts(*_COMPARISONS)
def _compare(b: GraphBuilder, node: Any, a: dict) -> Value:
    name, negate = _COMPARISONS[str(node.target.overloadpacket)]
    x, y = _input(a), a["other"]
    dtype = _compare_dtype(b, node)
    v = b.value(name, [operand(b, x, dtype), operand(b, y, dtype)], hint=f"{node.name}_not" if negate else None)
    return logical_not(b, v, node.name) if negate else v


_UNARY = {
    "aten.relu": "ge.relu", "aten.silu": "ge.silu", "aten.sigmoid": "ge.sigmoid", "aten.tanh": "ge.tanh",
    "aten.exp": "ge.exp", "aten.log": "ge.log", "aten.sqrt": "ge.sqrt", "aten.rsqrt": "ge.rsqrt",
    "aten.neg": "ge.neg", "aten.abs": "ge.abs", "aten.erf": "ge.erf", "aten.sin": "ge.sin", "aten.cos": "ge.cos",
}


@converts(*_UNARY)
def _unary(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = operand(b, tensor(b, _input(a), "the input"), result_dtype(b, node))
    return b.value(_UNARY[str(node.target.overloadpacket)], [x])


@converts("aten.isinf", "aten.isnan")
def _float_test(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    if not x.type.dtype.is_float:  # an integer is never infinite nor NaN
        t = result_type(b, node)
        if not t.is_static:
            raise b.error(f"{node.target.overloadpacket} of an integer tensor of run-time shape {x.type}")
        return _splat(b, False, t, node.name)
    return b.value("ge." + str(node.target.overloadpacket).removeprefix("aten."), [x])


@converts("aten.gelu")
def _gelu(b: GraphBuilder, node: Any, a: dict) -> Value:
    approximate = a.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise b.error(f"gelu approximate='{approximate}' is not supported (GEIR takes 'none' or 'tanh')")
    return b.value("ge.gelu", [tensor(b, _input(a), "the input")], {"approximate": approximate})


@converts("aten.reciprocal")
def _reciprocal(b: GraphBuilder, node: Any, a: dict) -> Value:
    dtype = result_dtype(b, node)
    return b.value("ge.div", [b.scalar(1.0, dtype, "one"), operand(b, _input(a), dtype)])


@converts("aten.square")
def _square(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = operand(b, _input(a), result_dtype(b, node))
    return b.value("ge.mul", [x, x])


@converts("aten.where")
def _where(b: GraphBuilder, node: Any, a: dict) -> Value:
    dtype = result_dtype(b, node)
    cond = tensor(b, a["condition"], "the condition")
    return b.value("ge.select", [b.cast(cond, DType.i1), operand(b, _input(a), dtype),
                                 operand(b, a["other"], dtype)])


@converts("aten.masked_fill")
def _masked_fill(b: GraphBuilder, node: Any, a: dict) -> Value:
    # select(keep, x, fill) with keep = not mask: the spelling the attention fusion reads (true = keep)
    dtype = result_dtype(b, node)
    keep = logical_not(b, b.cast(tensor(b, a["mask"], "the mask"), DType.i1), f"{node.name}_keep")
    return b.value("ge.select", [keep, operand(b, _input(a), dtype), operand(b, a["value"], dtype, "fill")])


def logical_not(b: GraphBuilder, v: Value, hint: str) -> Value:
    """Not `v` (i1): a new literal when `v` is one, else select(v, false, true) (GEIR has no `not`)."""
    values = literal_array(v)
    if values is not None:
        return b.const(np.logical_not(values), DType.i1, hint, limit=values.size)
    return b.value("ge.select", [v, b.scalar(False, DType.i1, "false"), b.scalar(True, DType.i1, "true")], hint=hint)


@converts("aten.bitwise_not", "aten.logical_not")
def _not(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    if x.type.dtype is not DType.i1 and str(node.target.overloadpacket) == "aten.bitwise_not":
        raise b.error(f"bitwise not of {x.type.dtype} is not supported (only of booleans)")
    return logical_not(b, b.cast(x, DType.i1), node.name)


@converts("aten.__and__", "aten.bitwise_and", "aten.logical_and", "aten.__or__", "aten.bitwise_or", "aten.logical_or")
def _and_or(b: GraphBuilder, node: Any, a: dict) -> Value:
    # booleans only (HF's mask code combines masks so): a and b = select(a, b, false), a or b = select(a, true, b)
    name = str(node.target.overloadpacket)
    x, y = (tensor(b, v, "an operand") for v in list(a.values())[:2])
    if name.startswith("aten.bitwise") or name.startswith("aten.__"):
        if x.type.dtype is not DType.i1 or y.type.dtype is not DType.i1:
            raise b.error(f"bitwise {'and' if 'and' in name else 'or'} of {x.type.dtype} and {y.type.dtype} is not "
                          f"supported (only of booleans)")
    x, y = b.cast(x, DType.i1), b.cast(y, DType.i1)
    if "and" in name:
        return b.value("ge.select", [x, y, b.scalar(False, DType.i1, "false")])
    return b.value("ge.select", [x, b.scalar(True, DType.i1, "true"), y])


@converts("aten.clamp", "aten.clip", "aten.clamp_min", "aten.clamp_max")
def _clamp(b: GraphBuilder, node: Any, a: dict) -> Value:
    # bounds are numbers or tensors (T5 clamps f16 activations to a bound it computes): max(x, lo), then min(., hi)
    t = result_type(b, node)
    x = operand(b, tensor(b, _input(a), "the input"), t.dtype)
    name = str(node.target.overloadpacket)
    lo = a.get("min") if name != "aten.clamp_max" else None
    hi = a.get("max") if name != "aten.clamp_min" else None
    if name == "aten.clamp_min":
        lo = list(a.values())[1]
    if name == "aten.clamp_max":
        hi = list(a.values())[1]
    if lo is not None:
        x = b.value("ge.max", [x, operand(b, lo, t.dtype, "min")])
    if hi is not None:
        x = b.value("ge.min", [x, operand(b, hi, t.dtype, "max")])
    return x


@converts("aten.any")
def _any(b: GraphBuilder, node: Any, a: dict) -> Value:
    # any(x) over dims: the max of x as 0/1, compared with 0 (GEIR reduces numbers, not booleans)
    x = tensor(b, _input(a), "the input")
    dims = a.get("dim")
    axes = list(range(x.type.rank)) if dims is None else sorted(
        {_axis(b, d, x.type.rank) for d in ([dims] if isinstance(dims, int) else dims)})
    ones = b.cast(b.cast(x, DType.i1), DType.f32)
    if axes:
        ones = b.value("ge.reduce_max", [ones], {"axes": axes, "keepdims": bool(a.get("keepdim"))})
    return b.value("ge.greater", [ones, b.scalar(0.0, DType.f32, "zero")])


@converts("aten._to_copy", "aten.to", "aten.type_as")
def _to(b: GraphBuilder, node: Any, a: dict) -> Value:
    return b.cast(tensor(b, _input(a), "the input"), result_dtype(b, node))


@converts("aten.clone", "aten.contiguous", "aten.alias", "aten.detach", "aten.lift_fresh_copy", "aten.lift_fresh")
def _identity(b: GraphBuilder, node: Any, a: dict) -> Value:
    return tensor(b, _input(a), "the input")


@converts("aten.dropout", "aten.feature_dropout")
def _dropout(b: GraphBuilder, node: Any, a: dict) -> Value:
    if a.get("train") and a.get("p", 0.0) > 0:
        raise b.error(f"dropout with p={a['p']} in training mode; export the module in eval mode "
                      f"(module.eval()) to import it")
    return tensor(b, _input(a), "the input")


_FILLS = {"aten.zeros_like": 0, "aten.ones_like": 1, "aten.new_zeros": 0, "aten.new_ones": 1, "aten.new_empty": 0,
          "aten.zeros": 0, "aten.ones": 1, "aten.empty": 0}


@converts("aten.full_like", "aten.zeros_like", "aten.ones_like")
def _full_like(b: GraphBuilder, node: Any, a: dict) -> Value:
    t = result_type(b, node)
    fill = _FILLS.get(str(node.target.overloadpacket), a.get("fill_value"))
    if t.is_static:
        return _splat(b, fill, t, node.name)
    x = tensor(b, _input(a), "the input")
    return _filled(b, fill, t, b.value("ge.shape_of", [x], hint=f"{node.name}_shape"))


# new_* read only their input's dtype and device; full/zeros/ones get here only with a run-time size
# (with known sizes they are evaluated at import); empty is filled with zeros, one of the values it may hold
@converts("aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.new_empty", "aten.full", "aten.zeros", "aten.ones",
          "aten.empty")
def _new_filled(b: GraphBuilder, node: Any, a: dict) -> Value:
    t = result_type(b, node)
    fill = _FILLS.get(str(node.target.overloadpacket), a.get("fill_value"))
    if t.is_static:
        return _splat(b, fill, t, node.name)
    return _filled(b, fill, t, size_tensor(b, list(a["size"])))


def _filled(b: GraphBuilder, fill: Any, t: TensorType, shape: Value) -> Value:
    """A tensor of type `t` (with run-time dims) whose elements are all `fill`: a scalar broadcast to `shape`."""
    scalar = b.scalar(fill, t.dtype, "fill")
    return b.value("ge.dynamic_broadcast", [scalar, shape])


def _splat(b: GraphBuilder, fill: Any, t: TensorType, hint: str) -> Value:
    """A constant of type `t` whose elements are all `fill` (printed as one splat)."""
    return b.const(np.full(t.shape, fill, dtype=np.float64 if t.dtype.is_float else t.dtype.np), t.dtype, hint)


# --- matmul and linear --------------------------------------------------------------------------------

def matmul(b: GraphBuilder, x: Value, y: Value, hint: str, transpose_b: bool = False) -> Value:
    """numpy matmul of two values, 1-D operands included (GEIR's ge.matmul takes rank 2 and more)."""
    vector_x, vector_y = x.type.rank == 1, y.type.rank == 1
    if vector_x:
        x = reshape_to(b, x, (1,) + x.type.shape, hint=f"{hint}_row")
    if vector_y:
        y = reshape_to(b, y, y.type.shape + (1,), hint=f"{hint}_col")
        transpose_b = False
    attrs = {"transpose_b": True} if transpose_b else {}
    out = b.value("ge.matmul", [x, y], attrs, hint=hint if not (vector_x or vector_y) else f"{hint}_mm")
    if vector_x or vector_y:
        shape = list(out.type.shape)
        if vector_y:
            shape.pop(-1)
        if vector_x:
            shape.pop(-2 if not vector_y else -1)
        out = reshape_to(b, out, tuple(shape), hint=hint)
    return out


@converts("aten.matmul", "aten.mm", "aten.bmm")
def _matmul(b: GraphBuilder, node: Any, a: dict) -> Value:
    dtype = result_dtype(b, node)
    x = operand(b, tensor(b, _input(a), "the left operand"), dtype)
    y = operand(b, tensor(b, a["other"] if "other" in a else a["mat2"], "the right operand"), dtype)
    return matmul(b, x, y, node.name)


@converts("aten.linear")
def _linear(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    w = tensor(b, a["weight"], "the weight")
    bias = a.get("bias")
    if w.type.rank != 2:
        raise b.error(f"linear weight must be 2-D [out, in], got {w.type}")
    if x.type.rank == 1:
        out = matmul(b, w, x, f"{node.name}_mm" if bias is not None else node.name)
    else:
        out = matmul(b, x, w, f"{node.name}_mm" if bias is not None else node.name, transpose_b=True)
    if bias is not None:
        out = b.value("ge.add", [out, tensor(b, bias, "the bias")])
    return out


@converts("aten.addmm")
def _addmm(b: GraphBuilder, node: Any, a: dict) -> Value:
    dtype = result_dtype(b, node)
    out = matmul(b, operand(b, a["mat1"], dtype), operand(b, a["mat2"], dtype), f"{node.name}_mm")
    if a.get("alpha", 1) != 1:
        out = b.value("ge.mul", [out, b.scalar(a["alpha"], dtype, "alpha")], hint=f"{node.name}_alpha")
    bias = operand(b, _input(a), dtype)
    if a.get("beta", 1) != 1:
        bias = b.value("ge.mul", [bias, b.scalar(a["beta"], dtype, "beta")], hint=f"{node.name}_beta")
    return b.value("ge.add", [out, bias])


@converts("aten.baddbmm")
def _baddbmm(b: GraphBuilder, node: Any, a: dict) -> Value:
    """beta * input + alpha * (batch1 @ batch2): Bloom's ALiBi scores (the bias input), a batched matmul and two
    scalings, as addmm."""
    dtype = result_dtype(b, node)
    out = matmul(b, operand(b, a["batch1"], dtype), operand(b, a["batch2"], dtype), f"{node.name}_mm")
    if a.get("alpha", 1) != 1:
        out = b.value("ge.mul", [out, b.scalar(a["alpha"], dtype, "alpha")], hint=f"{node.name}_alpha")
    if a.get("beta", 1) == 0:  # torch ignores the input then (even its NaNs)
        return out
    bias = operand(b, _input(a), dtype)
    if a.get("beta", 1) != 1:
        bias = b.value("ge.mul", [bias, b.scalar(a["beta"], dtype, "beta")], hint=f"{node.name}_beta")
    return b.value("ge.add", [out, bias], hint=node.name)


def _broadcast_to(b: GraphBuilder, x: Value, t: TensorType, hint: str) -> Value:
    """`x` cast to t's dtype and broadcast to t's (static) shape: GEIR has no broadcast op, so a multiply by a
    splat of ones (a select for i1) does it exactly."""
    x = b.cast(x, t.dtype)
    if x.type.shape == t.shape:
        return x
    if None in t.shape:
        raise b.error(f"broadcasting to {t} with a run-time dimension is not supported here")
    if t.dtype is DType.i1:
        return b.value("ge.select", [x, _splat(b, True, t, "true"), _splat(b, False, t, "false")], hint=hint)
    return b.value("ge.mul", [x, _splat(b, 1, t, f"{hint}_ones")], hint=hint)


@converts("aten.copy")
def _copy(b: GraphBuilder, node: Any, a: dict) -> Value:
    """copy(self, src): src in self's dtype and shape (what a slice assignment writes before the scatter)."""
    return _broadcast_to(b, tensor(b, a["src"], "the source"), result_type(b, node), node.name)


@converts("aten.fill")
def _fill(b: GraphBuilder, node: Any, a: dict) -> Value:
    """fill(self, value): the value in self's shape and dtype (`x[:, 0] = 3`)."""
    t = result_type(b, node)
    value = a["value"]
    if isinstance(value, Value):
        return _broadcast_to(b, value, t, node.name)
    return _splat(b, value, t, node.name)


def _scatter_slice(b: GraphBuilder, node: Any, x: Value, src: Value, axis: int, start: int, end: int) -> Value:
    """x with x[start:end] along `axis` replaced by src: the pieces before and after, concatenated around it."""
    dim = x.type.shape[axis]
    if dim is None:
        raise b.error("a slice assignment along a run-time dimension is not supported")
    start, end, _ = slice(start, end).indices(dim)
    pieces = ([_slice(b, x, axis, 0, start)] if start > 0 else []) + [b.cast(src, x.type.dtype)] + \
        ([_slice(b, x, axis, end, dim)] if end < dim else [])
    return pieces[0] if len(pieces) == 1 else b.value("ge.concat", pieces, {"axis": axis}, hint=node.name)


@converts("aten.slice_scatter")
def _slice_scatter(b: GraphBuilder, node: Any, a: dict) -> Value:
    """slice_scatter(input, src, dim, start, end, step): BART's shift_tokens_right writes x[:, 1:] this way."""
    x, src = tensor(b, _input(a), "the input"), tensor(b, a["src"], "the source")
    if a.get("step", 1) != 1:
        raise b.error(f"a slice assignment with step {a['step']} is not supported (step 1 is)")
    axis = _axis(b, a.get("dim", 0), x.type.rank)
    start = 0 if a.get("start") is None else a["start"]
    end = (1 << 62) if a.get("end") is None else a["end"]
    if not isinstance(start, int) or not isinstance(end, int):
        raise b.error("a slice assignment with bounds computed at run time is not supported")
    return _scatter_slice(b, node, x, src, axis, start, end)


@converts("aten.select_scatter")
def _select_scatter(b: GraphBuilder, node: Any, a: dict) -> Value:
    """select_scatter(input, src, dim, index): `x[:, i] = v`, the row src placed at `index`."""
    x, src = tensor(b, _input(a), "the input"), tensor(b, a["src"], "the source")
    axis = _axis(b, a["dim"], x.type.rank)
    dim = x.type.shape[axis]
    index = a["index"]
    if dim is None and index < 0:
        raise b.error("assigning from the end of a run-time dimension is not supported")
    index = index % dim if dim is not None else index
    row = reshape_to(b, src, src.type.shape[:axis] + (1,) + src.type.shape[axis:], hint=f"{node.name}_row")
    return _scatter_slice(b, node, x, row, axis, index, index + 1)


@converts("aten.topk")
def _topk(b: GraphBuilder, node: Any, a: dict) -> tuple:
    """The k largest (or smallest) values and their indices: one ge.topk (the AI CPU runs it: no AI Core kernel)."""
    x = tensor(b, _input(a), "the input")
    k = a.get("k")
    if not isinstance(k, int):
        raise b.error("topk with a k computed at run time is not supported (a k known at export is)")
    axis = _axis(b, a.get("dim", -1), x.type.rank)
    return tuple(b.emit("ge.topk", [x], {"k": k, "axis": axis, "largest": bool(a.get("largest", True)),
                                         "sorted": bool(a.get("sorted", True))}, hint=node.name).results)


@converts("aten.sort", "aten.argsort")
def _sort(b: GraphBuilder, node: Any, a: dict) -> Any:
    """A sort along `dim` is ge.topk of every element (k = the dimension, sorted; equals keep their index order,
    so stable or not the result is a stable sort's): an MoE layer's tokens ordered by expert."""
    x = tensor(b, _input(a), "the input")
    axis = _axis(b, a.get("dim", -1), x.type.rank)
    if x.type.shape[axis] is None:  # ge.topk takes a k known at export; ge.sort takes any length
        values, indices = b.emit("ge.sort", [x], {"axis": axis, "descending": bool(a.get("descending", False))},
                                 hint=node.name).results
    else:
        values, indices = b.emit("ge.topk", [x], {"k": x.type.shape[axis], "axis": axis,
                                                  "largest": bool(a.get("descending", False))}, hint=node.name).results
    return indices if str(node.target.overloadpacket) == "aten.argsort" else (values, indices)


@converts("aten.repeat_interleave")
def _repeat_interleave(b: GraphBuilder, node: Any, a: dict) -> Value:
    """Each element repeated `repeats` times along `dim` (a count known at export): a unit axis after `dim`,
    broadcast to the count, merged back into `dim` (grouped-query K/V heads repeated for their query heads)."""
    x = tensor(b, _input(a), "the input")
    repeats = a.get("repeats")
    if not isinstance(repeats, int) or isinstance(repeats, bool):
        raise b.error("repeat_interleave with a tensor of repeats is not supported (a count known at export is)")
    if a.get("dim") is None:
        x = reshape_to(b, x, (x.type.num_elements,), hint=f"{node.name}_flat")
    axis = _axis(b, a.get("dim", 0) or 0, x.type.rank)
    shape = x.type.shape
    if shape[axis] is None:
        raise b.error("repeat_interleave along a run-time dimension is not supported")
    unit = reshape_to(b, x, shape[:axis + 1] + (1,) + shape[axis + 1:], hint=f"{node.name}_unit")
    # ones of 1 on every axis but the new one broadcast only that axis, so the other axes may be run-time
    # sizes (GPT-J's sin and cos over the sequence): they keep the input's own size
    grow = TensorType((1,) * (axis + 1) + (repeats,) + (1,) * (len(shape) - axis - 1), x.type.dtype)
    if x.type.dtype is DType.i1:
        wide = b.value("ge.select", [unit, _splat(b, True, grow, "true"), _splat(b, False, grow, "false")],
                       hint=f"{node.name}_wide")
    else:
        wide = b.value("ge.mul", [unit, _splat(b, 1, grow, f"{node.name}_ones")], hint=f"{node.name}_wide")
    return reshape_to(b, wide, shape[:axis] + (shape[axis] * repeats,) + shape[axis + 1:], hint=node.name)


# --- convolution --------------------------------------------------------------------------------------

def _pair(v: Any, what: str) -> list[int]:
    """A 2-D convolution's stride, padding or dilation as two ints (torch accepts one for both)."""
    v = [v] if isinstance(v, int) else list(v)
    if len(v) == 1:
        v = v * 2
    if len(v) != 2 or not all(isinstance(d, int) for d in v):
        raise TypeError(f"{what} {v}")
    return [int(d) for d in v]


@converts("aten.conv1d")
def _conv1d(b: GraphBuilder, node: Any, a: dict) -> Value:
    """1-D convolution (Whisper's front end) as ge.conv2d over a unit height: [N, C, L] as [N, C, 1, L], the
    kernel [O, I, K] as [O, I, 1, K]; the numbers are the 1-D convolution's exactly."""
    dtype = result_dtype(b, node)
    x = operand(b, tensor(b, _input(a), "the input"), dtype)
    w = operand(b, tensor(b, a["weight"], "the weight"), dtype)
    if x.type.rank not in (2, 3) or w.type.rank != 3:
        raise b.error(f"conv1d takes [N, C, L] (or [C, L]) and a [O, I, K] weight, got {x.type} and {w.type}")
    unbatched = x.type.rank == 2
    n, c, length = (1,) + x.type.shape if unbatched else x.type.shape
    x4 = reshape_to(b, x, (n, c, 1, length), hint=f"{node.name}_nc1l")
    w4 = reshape_to(b, w, w.type.shape[:2] + (1, w.type.shape[2]), hint=f"{node.name}_w")

    def one(v: Any, what: str) -> int:
        v = [v] if isinstance(v, int) else list(v)
        if len(v) != 1 or not isinstance(v[0], int):
            raise b.error(f"conv1d with a {what} {v} that is not one integer known at export")
        return int(v[0])

    stride, dilation = one(a.get("stride", 1), "stride"), one(a.get("dilation", 1), "dilation")
    padding = a.get("padding", 0)
    if padding == "same":
        total = dilation * (w.type.shape[2] - 1)
        before, after = total // 2, total - total // 2
    elif padding == "valid":
        before = after = 0
    else:
        before = after = one(padding, "padding")
    operands = [x4, w4]
    if a.get("bias") is not None:
        operands.append(operand(b, tensor(b, a["bias"], "the bias"), dtype))
    attributes = {"strides": [1, stride], "pads": [0, before, 0, after], "dilations": [1, dilation],
                  "groups": int(a.get("groups", 1))}
    out = b.value("ge.conv2d", operands, attributes, hint=f"{node.name}_nchw")
    o, lo = out.type.shape[1], out.type.shape[3]
    return reshape_to(b, out, (o, lo) if unbatched else (n, o, lo), hint=node.name)


@converts("aten.conv2d", "aten.convolution")
def _conv2d(b: GraphBuilder, node: Any, a: dict) -> Value:
    """2-D convolution as one ge.conv2d (GE lowers it to the cube); torch's symmetric padding is ONNX's pads."""
    dtype = result_dtype(b, node)
    x = operand(b, tensor(b, _input(a), "the input"), dtype)
    w = operand(b, tensor(b, a["weight"], "the weight"), dtype)
    if a.get("transposed", False):
        raise b.error("a transposed convolution (conv_transpose) is not supported: GEIR has ge.conv2d only")
    if str(node.target.overloadpacket) == "aten.convolution" and x.type.rank == 3 and w.type.rank == 3:
        return _conv1d(b, node, a)  # what torch's decompositions leave of conv1d
    unbatched = str(node.target.overloadpacket) == "aten.conv2d" and x.type.rank == 3
    if unbatched:  # conv2d takes [C, H, W] as a batch of one
        x = reshape_to(b, x, (1,) + x.type.shape, hint=f"{node.name}_batch")
    if x.type.rank != 4 or w.type.rank != 4:
        raise b.error(f"a {x.type.rank - 2}-D convolution (input {x.type}, weight {w.type}): GEIR has ge.conv2d "
                      f"(NCHW input, OIHW weight) only")
    try:
        stride, dilation = _pair(a.get("stride", 1), "stride"), _pair(a.get("dilation", 1), "dilation")
        padding = a.get("padding", 0)
        if padding == "same":  # the extra row or column of an odd total goes after, as torch pads it
            totals = [d * (k - 1) for d, k in zip(dilation, w.type.shape[2:])]
            pads = [t // 2 for t in totals] + [t - t // 2 for t in totals]
        elif padding == "valid":
            pads = [0, 0, 0, 0]
        else:  # [top, left] on both sides: ONNX's [top, left, bottom, right]
            pads = _pair(padding, "padding") * 2
    except TypeError as e:
        raise b.error(f"convolution with a {e} that is not two integers known at export") from None
    if a.get("output_padding") and any(a["output_padding"]):
        raise b.error(f"output_padding {list(a['output_padding'])} without a transposed convolution")
    operands = [x, w]
    if a.get("bias") is not None:
        operands.append(operand(b, tensor(b, a["bias"], "the bias"), dtype))
    attributes = {"strides": stride, "pads": pads, "dilations": dilation, "groups": int(a.get("groups", 1))}
    out = b.value("ge.conv2d", operands, attributes, hint=f"{node.name}_nchw" if unbatched else node.name)
    return reshape_to(b, out, out.type.shape[1:], hint=node.name) if unbatched else out


# --- shapes -------------------------------------------------------------------------------------------

def _transpose(b: GraphBuilder, x: Value, perm: list[int], hint: str | None = None) -> Value:
    if perm == list(range(len(perm))):
        return x
    return b.value("ge.transpose", [x], {"perm": perm}, hint=hint)


@converts("aten.permute")
def _permute(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    return _transpose(b, x, [_axis(b, d, x.type.rank) for d in a["dims"]])


@converts("aten.transpose", "aten.swapaxes", "aten.swapdims")
def _transpose_dims(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    d0 = _axis(b, a["dim0"] if "dim0" in a else a["axis0"], x.type.rank)
    d1 = _axis(b, a["dim1"] if "dim1" in a else a["axis1"], x.type.rank)
    perm = list(range(x.type.rank))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _transpose(b, x, perm)


@converts("aten.t", "aten.numpy_T")
def _t(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    return _transpose(b, x, list(reversed(range(x.type.rank))))


def reshape_to(b: GraphBuilder, x: Value, shape: tuple[Dim, ...], hint: str | None = None) -> Value:
    """`x` reshaped to `shape` (None: a run-time size, at most one); itself when it already has it."""
    if x.type.shape == tuple(shape) and x.type.is_static:
        return x
    if sum(d is None for d in shape) > 1:
        shown = "x".join("?" if d is None else str(d) for d in shape)
        raise b.error(f"reshape to {shown} has more than one run-time dimension; ge.reshape infers only one (-1): "
                      f"make at most one of the dimensions it touches dynamic")
    return b.value("ge.reshape", [x], {"shape": [-1 if d is None else int(d) for d in shape]}, hint=hint)


# reshapes take their target shape from what torch traced, so run-time sizes among their arguments are fine
RESHAPES = frozenset({
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.unsqueeze", "aten.squeeze", "aten.flatten",
    "aten.unflatten", "aten.view_copy", "aten._reshape_alias", "aten.expand_dims",
})
# the converters that take run-time sizes (RunTimeSize) among their arguments
# elementwise arithmetic and comparisons take a run-time size as a rank-0 operand (positions + past length)
SIZE_OPERANDS = {"aten.add", "aten.sub", "aten.rsub", "aten.mul", "aten.div", "aten.gt", "aten.lt", "aten.ge",
                 "aten.le", "aten.eq", "aten.ne", "aten.maximum", "aten.minimum"}
TAKES_RUNTIME_SIZES = RESHAPES | SIZE_OPERANDS | {"aten.arange", "aten.slice", "aten.expand", "aten.expand_copy", "aten.broadcast_to",
                                  "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.new_empty", "aten.full",
                                  "aten.zeros", "aten.ones", "aten.empty"}


def size_tensor(b: GraphBuilder, sizes: list) -> Value:
    """A 1-D i64 tensor of sizes, numbers and run-time sizes mixed (a constant when all are numbers)."""
    if not any(isinstance(s, RunTimeSize) for s in sizes):
        return b.const(np.array(sizes, dtype=np.int64), DType.i64, hint="sizes")
    pieces = [reshape_to(b, s.value, (1,), hint="size") if isinstance(s, RunTimeSize)
              else b.const(np.array([s], dtype=np.int64), DType.i64, hint="size") for s in sizes]
    return pieces[0] if len(pieces) == 1 else b.value("ge.concat", pieces, {"axis": 0}, hint="sizes")


def scalar_operand(b: GraphBuilder, x: Any, dtype: DType, hint: str) -> Value:
    """A rank-0 operand of `dtype` from a number or a run-time size."""
    if isinstance(x, RunTimeSize):
        return b.cast(x.value, dtype)
    return b.scalar(x, dtype, hint)


@converts("aten.arange")
def _arange(b: GraphBuilder, node: Any, a: dict) -> Value:
    # only an arange to a run-time size gets here: one of known numbers is evaluated at import
    dtype = result_dtype(b, node)
    bounds = [a.get("start", 0), a["end"], a.get("step", 1)]
    return b.value("ge.range", [scalar_operand(b, v, dtype, n) for v, n in zip(bounds, ("start", "end", "step"))])


@converts(*RESHAPES)
def _reshape(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    if "dtype" in a and not isinstance(a.get("size"), (list, tuple)):
        raise b.error("view as another dtype (a bit cast) is not supported")
    shape = result_type(b, node).shape
    if sum(d is None for d in shape) <= 1:
        return reshape_to(b, x, shape)
    # several run-time dims: the sizes torch passed (run-time ones computed in the graph), or else each one the
    # input has (the same symbol) read from it and one other inferred
    given = a.get("size", a.get("shape"))
    if isinstance(given, (list, tuple)) and len(given) == len(shape):
        return b.value("ge.dynamic_reshape", [x, size_tensor(b, list(given))], {"allowzero": True})
    before = [str(d) for d in result_meta(node.args[0]).shape]
    sizes: list = []
    for d in result_meta(node).shape:
        if isinstance(d, int):
            sizes.append(d)
        elif str(d) in before:
            axis = before.index(str(d))
            sizes.append(RunTimeSize(b.value("ge.dim", [x], {"axis": axis}, hint=f"{node.name}_dim{axis}")))
        else:
            sizes.append(-1)
    if sizes.count(-1) > 1:
        raise b.error(f"reshape to {'x'.join('?' if d is None else str(d) for d in shape)}: more than one of its "
                      f"run-time dimensions is new (a product of the input's), and a reshape infers only one")
    return b.value("ge.dynamic_reshape", [x, size_tensor(b, sizes)], {"allowzero": True})


@converts("aten.expand", "aten.broadcast_to", "aten.expand_copy")
def _expand(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    t = result_type(b, node)
    before = tuple(result_meta(node.args[0]).shape)
    after = tuple(result_meta(node).shape)
    before = (1,) * (len(after) - len(before)) + before
    if before == after:
        return x
    # an axis torch leaves at its own size (the same symbol before and after) needs no broadcast: the splat
    # has 1 there, so a run-time dimension kept as it is costs nothing
    grow = [1 if d == e else (e if isinstance(e, int) else None) for d, e in zip(before, after)]
    if None in grow:  # broadcast to a run-time size: sized when the shape signature binds
        sizes = [1 if s == -1 else s for s in a["size"]]
        return b.value("ge.dynamic_broadcast", [x, size_tensor(b, sizes)])
    # GEIR has no broadcast op: multiplying by a splat of ones (or selecting, for i1) of the expanded
    # shape broadcasts exactly, and canonicalize keeps it because the result shape differs
    ones = TensorType(tuple(grow), t.dtype)
    if t.dtype is DType.i1:
        return b.value("ge.select", [x, _splat(b, True, ones, "true"), _splat(b, False, ones, "false")])
    return b.value("ge.mul", [x, _splat(b, 1, ones, f"{node.name}_ones")])


@converts("aten.split", "aten.split_with_sizes", "aten.chunk", "aten.tensor_split", "aten.unsafe_split")
def _split(b: GraphBuilder, node: Any, a: dict) -> tuple:
    x = tensor(b, _input(a), "the input")
    axis = _axis(b, a.get("dim", 0), x.type.rank)
    sizes = [dims_of(t.shape)[axis] for t in result_meta(node)]
    if None in sizes:
        raise b.error("splitting a run-time dimension is not supported (ge.split takes static sizes)")
    if len(sizes) == 1:
        return (x,)
    return tuple(b.emit("ge.split", [x], {"axis": axis, "sizes": sizes}).results)


@converts("aten.unbind")
def _unbind(b: GraphBuilder, node: Any, a: dict) -> tuple:
    x = tensor(b, _input(a), "the input")
    axis = _axis(b, a.get("dim", 0), x.type.rank)
    n = x.type.shape[axis]
    pieces = b.emit("ge.split", [x], {"axis": axis, "sizes": [1] * n}, hint=f"{node.name}_piece").results \
        if n > 1 else [x]
    return tuple(reshape_to(b, p, result_type(b, node, i).shape, hint=f"{node.name}_{i}") for i, p in enumerate(pieces))


@converts("aten.cat", "aten.concat", "aten.concatenate")
def _cat(b: GraphBuilder, node: Any, a: dict) -> Value:
    t = result_type(b, node)
    xs = [operand(b, tensor(b, x, "each input"), t.dtype) for x in a["tensors"]]
    xs = [x for x in xs if x.type.shape != (0,)]  # torch lets an empty 1-D tensor join anything
    if len(xs) == 1:
        return xs[0]
    return b.value("ge.concat", xs, {"axis": _axis(b, a.get("dim", 0), t.rank)})


@converts("aten.stack")
def _stack(b: GraphBuilder, node: Any, a: dict) -> Value:
    t = result_type(b, node)
    axis = _axis(b, a.get("dim", 0), t.rank)
    xs = []
    for i, x in enumerate(a["tensors"]):
        x = operand(b, tensor(b, x, "each input"), t.dtype)
        shape = list(x.type.shape)
        shape.insert(axis, 1)
        xs.append(reshape_to(b, x, tuple(shape), hint=f"{node.name}_in{i}"))
    return xs[0] if len(xs) == 1 else b.value("ge.concat", xs, {"axis": axis})


def _slice(b: GraphBuilder, x: Value, axis: int, start: int, end: int, hint: str | None = None) -> Value:
    dim = x.type.shape[axis]
    if dim is None:  # a run-time dimension: ge.slice clamps when the size is known, as torch does
        if start < 0 or end < 0:
            raise b.error("slicing from the end of a run-time dimension is not supported")
        return b.value("ge.slice", [x], {"axes": [axis], "starts": [start], "ends": [max(end, start)]}, hint=hint)
    start, end, _ = slice(start, end).indices(dim)
    if start == 0 and end == dim:
        return x
    return b.value("ge.slice", [x], {"axes": [axis], "starts": [start], "ends": [max(end, start)]}, hint=hint)


@converts("aten.slice", "aten.narrow")
def _slice_op(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    axis = _axis(b, a.get("dim", 0), x.type.rank)
    if isinstance(a.get("start"), RunTimeSize) or isinstance(a.get("end"), RunTimeSize):
        if a.get("step", 1) != 1:
            raise b.error(f"slicing with step {a['step']} is not supported (ge.dynamic_slice takes step 1)")
        start = 0 if a.get("start") is None else a["start"]
        end = (1 << 62) if a.get("end") is None else a["end"]
        return b.value("ge.dynamic_slice", [x, size_tensor(b, [start]), size_tensor(b, [end])], {"axes": [axis]})
    if "length" in a:  # narrow
        start = a["start"] % x.type.shape[axis] if a["start"] < 0 else a["start"]
        return _slice(b, x, axis, start, start + a["length"])
    start = 0 if a.get("start") is None else a["start"]
    step = a.get("step", 1)
    if step != 1:  # GPT-J's interleaved rotary: x[..., ::2]
        end = (1 << 62) if a.get("end") is None else a["end"]  # ge.slice clamps to the dimension, as torch does
        if x.type.shape[axis] is None and (start < 0 or end < 0):
            raise b.error("slicing from the end of a run-time dimension is not supported")
        return b.value("ge.slice", [x], {"axes": [axis], "starts": [start], "ends": [max(end, start)], "steps": [step]})
    end = x.type.shape[axis] if a.get("end") is None else a["end"]
    return _slice(b, x, axis, start, end)


@converts("aten.flip")
def _flip(b: GraphBuilder, node: Any, a: dict) -> Value:
    """The elements in reverse order along `dims`: one ge.slice stepping backwards (-1) from each axis's last
    element past its first (end -dim - 1; -(2^62) on a run-time axis, before the first element of any size)."""
    x = tensor(b, _input(a), "the input")
    axes = sorted({_axis(b, d, x.type.rank) for d in a["dims"]})
    if not axes:
        return x
    ends = [-(1 << 62) if x.type.shape[d] is None else -x.type.shape[d] - 1 for d in axes]
    return b.value("ge.slice", [x], {"axes": axes, "starts": [-1] * len(axes), "ends": ends,
                                     "steps": [-1] * len(axes)}, hint=node.name)


@converts("aten.select")
def _select_index(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    axis = _axis(b, a["dim"], x.type.rank)
    dim = x.type.shape[axis]
    if dim is None and a["index"] < 0:  # from the end of a run-time dimension: the bounds computed in the graph
        size = RunTimeSize(b.value("ge.dim", [x], {"axis": axis}, hint=f"{node.name}_dim"))
        start = b.value("ge.add", [size.value, b.scalar(a["index"], DType.i64, "index")], hint=f"{node.name}_at")
        end = b.value("ge.add", [start, b.scalar(1, DType.i64, "one")], hint=f"{node.name}_end")
        piece = b.value("ge.dynamic_slice", [x, reshape_to(b, start, (1,)), reshape_to(b, end, (1,))],
                        {"axes": [axis]}, hint=f"{node.name}_slice")
        return reshape_to(b, piece, result_type(b, node).shape)
    index = a["index"] % dim if dim is not None else a["index"]
    piece = _slice(b, x, axis, index, index + 1, hint=f"{node.name}_slice")
    return reshape_to(b, piece, result_type(b, node).shape)


# --- indexing -------------------------------------------------------------------------------------------

def _indices(b: GraphBuilder, x: Any, what: str) -> Value:
    v = tensor(b, x, what)
    if not v.type.dtype.is_int:
        raise b.error(f"{what} must be integers, not {v.type.dtype}")
    return v


@converts("aten.embedding")
def _embedding(b: GraphBuilder, node: Any, a: dict) -> Value:
    # padding_idx, scale_grad_by_freq and sparse change only the gradient: the lookup is a gather of rows
    weight = tensor(b, a["weight"], "the weight")
    if weight.type.rank != 2:
        raise b.error(f"embedding weight must be 2-D [num_embeddings, dim], got {weight.type}")
    return b.value("ge.gather", [weight, _indices(b, a["indices"], "the indices")], {"axis": 0})


@converts("aten.gather")
def _gather_elements(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    index = _indices(b, a["index"], "the index")
    return b.value("ge.gather_elements", [x, index], {"axis": _axis(b, a["dim"], max(x.type.rank, 1))})


def _index_tensors(b: GraphBuilder, a: dict) -> tuple[Value, list, list[int]]:
    """aten.index's and index_put's input, its index list (trailing Nones dropped) and the indexed dims."""
    x = tensor(b, _input(a), "the input")
    given = list(a["indices"])
    while given and given[-1] is None:
        given.pop()
    return x, given, [k for k, t in enumerate(given) if t is not None]


@converts("aten.index_put")
def _index_put(b: GraphBuilder, node: Any, a: dict) -> Value:
    # x[i, j] = v (x[i, j] += v with accumulate): the elements aten.index reads, written; KV-cache updates
    x, given, at = _index_tensors(b, a)
    if not at or at != list(range(at[0], at[0] + len(at))):
        raise b.error(f"index_put with index tensors on dimensions {at}: GEIR writes through adjacent index tensors")
    if any(isinstance(given[k], Value) and given[k].type.dtype is DType.i1 for k in at):
        raise b.error("index_put through a boolean mask (torch.where keeps the shape: x = torch.where(m, v, x))")
    values = operand(b, a["values"], x.type.dtype, "values")
    indices = [_indices(b, given[k], "the index") for k in at]
    return b.value("ge.index_put", [x, values] + indices, {"axis": at[0], "accumulate": bool(a.get("accumulate"))})


@converts("aten.index_copy")
def _index_copy(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    axis = _axis(b, a["dim"], max(x.type.rank, 1))
    source = operand(b, a["source"], x.type.dtype, "source")
    return b.value("ge.index_put", [x, source, _indices(b, a["index"], "the index")], {"axis": axis})


@converts("aten.scatter", "aten.scatter_add")
def _scatter(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    index = _indices(b, a["index"], "the index")
    add = str(node.target.overloadpacket) == "aten.scatter_add" or a.get("reduce") == "add"
    if a.get("reduce") not in (None, "add"):
        raise b.error(f"scatter with reduce='{a['reduce']}' is not supported (GEIR scatters or adds)")
    if "src" in a:
        updates = operand(b, a["src"], x.type.dtype, "src")
        if updates.type.shape != index.type.shape:  # torch reads only the index's extent of src
            updates = b.value("ge.slice", [updates], {"axes": list(range(index.type.rank)),
                                                      "starts": [0] * index.type.rank,
                                                      "ends": list(index.type.shape)})
    else:  # scatter.value: one number written at every index
        updates = _splat(b, a["value"], TensorType(index.type.shape, x.type.dtype), "value")
    return b.value("ge.scatter_elements", [x, index, updates],
                   {"axis": _axis(b, a["dim"], max(x.type.rank, 1)), "reduction": "add" if add else "none"})


@converts("aten.index_select")
def _index_select(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    index = _indices(b, a["index"], "the index")
    if index.type.rank > 1:
        raise b.error(f"index_select takes a 1-D index, got {index.type}")
    if index.type.rank == 0:  # torch keeps the dimension: a scalar index selects one slice
        index = reshape_to(b, index, (1,), hint=f"{node.name}_index")
    axis = _axis(b, a["dim"], max(x.type.rank, 1))
    return b.value("ge.gather", [x, index], {"axis": axis})


@converts("aten.index")
def _index(b: GraphBuilder, node: Any, a: dict) -> Value:
    # x[..., i, ...] with one integer index tensor: the slices it names, in its place (np.take along that dim)
    x, given, at = _index_tensors(b, a)
    for k in at:
        if isinstance(given[k], Value) and given[k].type.dtype is DType.i1:
            raise b.error("indexing with a boolean mask: its result's size depends on the mask's values, and GEIR's "
                          "shapes are known when the graph is compiled (torch.where or masked_fill keep the shape)")
    if len(at) == 1:
        return b.value("ge.gather", [x, _indices(b, given[at[0]], "the index")], {"axis": _axis(b, at[0], x.type.rank)})
    return _index_several(b, x, given, at)


def _index_several(b: GraphBuilder, x: Value, given: list, at: list[int]) -> Value:
    """x[i, j] with several index tensors on adjacent dimensions (HF's mask code indexes the padding mask with
    broadcast aranges): ge.index, which becomes one gather of the merged dimensions at the flattened indices
    once the indices are constants (here, or when a dynamic-shape program's sizes are bound); indices computed
    from data stay a ge.index, which GE places on the AI CPU."""
    if at != list(range(at[0], at[0] + len(at))):
        raise b.error(f"indexing with {len(at)} index tensors on dimensions {at}, which are not adjacent, is not "
                      f"supported (torch moves such results to the front)")
    indices = [_indices(b, given[k], "the index") for k in at]
    arrays = [constant_array(b, v) for v in indices]
    dims = x.type.shape[at[0]:at[-1] + 1]
    if any(arr is None for arr in arrays) or any(d is None for d in dims):
        return b.value("ge.index", [x] + indices, {"axis": at[0]})
    try:
        flat = flat_indices([np.asarray(arr, dtype=np.int64) for arr in arrays], dims, at[0])
    except ShapeError as e:  # torch would raise at run time; GEIR says so here
        raise b.error(str(e)) from None
    shape = x.type.shape
    merged = reshape_to(b, x, shape[:at[0]] + (int(np.prod(dims)),) + shape[at[-1] + 1:])
    return b.value("ge.gather", [merged, b.const(flat.astype(np.int64), DType.i64, hint="index")], {"axis": at[0]})


def constant_array(b: GraphBuilder, v: Value) -> np.ndarray | None:
    """The value of `v` when a constant defines it (a dense literal, or a weight of the import), else None."""
    arr = literal_array(v)
    if arr is None and v.owner is not None and isinstance(v.owner.attributes.get("value"), DenseResourceAttr):
        arr = b.weights.get(v.owner.attributes["value"].key)
    return arr


@converts("aten.cumsum")
def _cumsum(b: GraphBuilder, node: Any, a: dict) -> Value:
    # torch sums integers and booleans in int64 unless told a dtype: the result's dtype is what it traced
    x = operand(b, tensor(b, _input(a), "the input"), result_dtype(b, node))
    if x.type.rank == 0:
        return x
    return b.value("ge.cumsum", [x], {"axis": _axis(b, a["dim"], x.type.rank)})


# --- reductions and normalisation ---------------------------------------------------------------------

_REDUCTIONS = {"aten.mean": "ge.reduce_mean", "aten.sum": "ge.reduce_sum", "aten.amax": "ge.reduce_max"}


@converts(*_REDUCTIONS)
def _reduce(b: GraphBuilder, node: Any, a: dict) -> Value:
    t = result_type(b, node)
    x = operand(b, tensor(b, _input(a), "the input"), t.dtype)
    dims = a.get("dim")
    if dims is None or dims == []:
        axes = list(range(x.type.rank))
    else:
        axes = sorted({_axis(b, d, x.type.rank) for d in ([dims] if isinstance(dims, int) else dims)})
    if not axes:
        return x
    return b.value(_REDUCTIONS[str(node.target.overloadpacket)], [x], {"axes": axes, "keepdims": bool(a.get("keepdim"))})


@converts("aten.softmax", "aten._softmax", "aten._safe_softmax")
def _softmax(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = operand(b, tensor(b, _input(a), "the input"), result_dtype(b, node))
    return b.value("ge.softmax", [x], {"axis": _axis(b, a["dim"], x.type.rank)})


def _affine_param(b: GraphBuilder, p: Any, fill: float, shape: tuple[int, ...], dtype: DType, hint: str) -> Value:
    if p is None:
        return _splat(b, fill, TensorType(shape, dtype), hint)
    return b.cast(tensor(b, p, hint), dtype)


@converts("aten.layer_norm", "aten.native_layer_norm")
def _layer_norm(b: GraphBuilder, node: Any, a: dict) -> Any:
    x = tensor(b, _input(a), "the input")
    normalized = tuple(int(d) for d in a["normalized_shape"])
    if x.type.shape[x.type.rank - len(normalized):] != normalized:
        raise b.error(f"normalized_shape {list(normalized)} is not the trailing shape of {x.type}")
    dtype = x.type.dtype
    gamma = _affine_param(b, a.get("weight"), 1.0, normalized, dtype, f"{node.name}_gamma")
    beta = _affine_param(b, a.get("bias"), 0.0, normalized, dtype, f"{node.name}_beta")
    out = b.value("ge.layer_norm", [x, gamma, beta], {"axis": -len(normalized), "epsilon": float(a["eps"])})
    if str(node.target.overloadpacket) == "aten.native_layer_norm":
        return (out, Unavailable("the mean of native_layer_norm"), Unavailable("the rstd of native_layer_norm"))
    return out


@converts("aten.rms_norm")
def _rms_norm(b: GraphBuilder, node: Any, a: dict) -> Value:
    x = tensor(b, _input(a), "the input")
    normalized = tuple(int(d) for d in a["normalized_shape"])
    if len(normalized) != 1 or x.type.shape[-1] != normalized[0]:
        raise b.error(f"rms_norm over {list(normalized)}: ge.rms_norm normalises the last axis only")
    eps = a.get("eps")
    if eps is None:
        eps = float(torch.finfo(result_meta(node).dtype).eps)  # torch's default
    gamma = _affine_param(b, a.get("weight"), 1.0, normalized, x.type.dtype, f"{node.name}_gamma")
    return b.value("ge.rms_norm", [x, gamma], {"epsilon": float(eps)})


class Unavailable:
    """A result of a multi-result aten op that GEIR does not compute; using it is an error."""

    def __init__(self, what: str):
        self.what = what


# --- attention ----------------------------------------------------------------------------------------

def _constant_mask(b: GraphBuilder, mask: Value, causal: bool) -> tuple[Value | None, bool]:
    """The mask and causal flag the kernel is given: a constant top-left causal mask (HF builds one for
    every prefill) is `causal = true` and no mask, one that keeps every key is no mask."""
    arr = constant_array(b, mask)
    if arr is None:
        return mask, causal
    needed, causal = constant_mask_meaning(arr, mask.type.dtype is DType.i1, causal)
    return (mask if needed else None), causal


def _hidden_rows(b: GraphBuilder, mask: Value) -> Value | None:
    """i1 [..., Sq, 1]: the query rows whose every key `mask` hides (a left-padded prompt's padding rows), or None
    when the mask is a constant that hides no whole row."""
    array = constant_array(b, mask)
    if array is not None:
        keep = array if array.dtype == np.bool_ else array > -np.inf
        if keep.shape[-1] and keep.any(axis=-1).all():
            return None
    keep = mask if mask.type.dtype is DType.i1 else b.value(
        "ge.greater", [mask, b.scalar(-np.inf, mask.type.dtype, "minus_inf")])
    seen = b.value("ge.reduce_max", [b.cast(keep, DType.f32)], {"axes": [mask.type.rank - 1], "keepdims": True})
    return b.value("ge.less", [seen, b.scalar(0.5, DType.f32, "half")], hint="hidden_rows")


@converts("aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu")
def _sdpa(b: GraphBuilder, node: Any, a: dict) -> Any:
    q = tensor(b, a["query"], "query")
    k = tensor(b, a["key"], "key")
    v = tensor(b, a["value"], "value")
    if a.get("dropout_p", 0.0):
        raise b.error(f"attention dropout_p={a['dropout_p']} is not supported (export in eval mode with dropout 0)")
    mask = a.get("attn_mask")
    causal = bool(a.get("is_causal", False))
    if mask is not None and causal:
        raise b.error("attn_mask together with is_causal=True")
    rank = q.type.rank
    if rank not in (3, 4) or k.type.rank != rank or v.type.rank != rank:
        raise b.error(f"attention takes [B, N, S, D] or [B, S, D] tensors, got {q.type}, {k.type}, {v.type}")
    head_dim = q.type.shape[-1]
    scale = a.get("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
    if rank == 3:  # one head: [B, S, D] -> [B, 1, S, D]
        q, k, v = (reshape_to(b, t, (t.type.shape[0], 1) + t.type.shape[1:], hint=f"{node.name}_{n}")
                   for t, n in ((q, "q"), (k, "k"), (v, "v")))
    operands = [q, k, v]
    if mask is not None:
        mask = tensor(b, mask, "attn_mask")
        mask, causal = _constant_mask(b, mask, causal)
    if mask is not None:
        if mask.type.dtype is not DType.i1:
            mask = b.cast(mask, q.type.dtype)
        if rank == 3 and mask.type.rank == 3:
            mask = reshape_to(b, mask, (mask.type.shape[0], 1) + mask.type.shape[1:], hint=f"{node.name}_mask")
        operands.append(mask)
    out = b.value("ge.flash_attention", operands, {"scale": scale, "causal": causal, "layout": "BNSD"},
                  hint=node.name if rank == 4 else f"{node.name}_bnsd")
    hidden = _hidden_rows(b, mask) if mask is not None else None
    if hidden is not None:  # torch's SDPA gives zeros where a row's keys are all masked; flash_attention NaN
        out = b.value("ge.select", [hidden, b.scalar(0.0, out.type.dtype, "zero"), out], hint=f"{node.name}_rows")
    if rank == 3:
        out = reshape_to(b, out, (out.type.shape[0],) + out.type.shape[2:], hint=node.name)
    if str(node.target.overloadpacket) != "aten.scaled_dot_product_attention":
        return (out,) + tuple(Unavailable("the attention's logsumexp") for _ in range(len(result_meta(node)) - 1))
    return out


# --- mixture of experts: transformers' grouped_mm experts (sort by expert, count, grouped matmul) -------------

@converts("aten.histc")
def _histc(b: GraphBuilder, node: Any, a: dict) -> Value:
    """torch.histc over a given range: ge.histc (an MoE layer counting its tokens per expert)."""
    x = tensor(b, _input(a), "the input")
    lo, hi = float(a.get("min", 0)), float(a.get("max", 0))
    if not lo < hi:
        raise b.error(f"histc over the data's own range (min {lo}, max {hi}) is not supported: give min < max")
    return b.value("ge.histc", [x], {"bins": int(a.get("bins", 100)), "min": lo, "max": hi}, hint=node.name)


@converts("aten.floor_divide")
def _floor_divide(b: GraphBuilder, node: Any, a: dict) -> Value:
    """Integer division rounding down by a positive number: ge.div truncates, so a negative remainder steps the
    quotient down by one (an MoE layer's token of each sorted token-expert pair: pair // top_k)."""
    dtype = result_dtype(b, node)
    divisor = a["other"]
    if dtype.is_float or not isinstance(divisor, int) or isinstance(divisor, bool) or divisor <= 0:
        raise b.error("floor_divide is supported for integers divided by a positive number known at export")
    x = operand(b, tensor(b, _input(a), "the input"), dtype)
    d = b.scalar(divisor, dtype, "divisor")
    q = b.value("ge.div", [x, d], hint=f"{node.name}_trunc")
    rest = b.value("ge.sub", [x, b.value("ge.mul", [q, d])], hint=f"{node.name}_rest")
    below = b.cast(b.value("ge.less", [rest, b.scalar(0, dtype, "zero")]), dtype)
    return b.value("ge.sub", [q, below], hint=node.name)


@converts("aten.empty_like")
def _empty_like(b: GraphBuilder, node: Any, a: dict) -> Value:
    """An uninitialised tensor like the input: zeros, one of the values it may hold."""
    t = result_type(b, node)
    if t.is_static:
        return _splat(b, 0, t, node.name)
    x = tensor(b, _input(a), "the input")
    return _filled(b, 0, t, b.value("ge.shape_of", [x], hint=f"{node.name}_shape"))


@converts("transformers.grouped_mm_fallback", "aten._grouped_mm")
def _grouped_mm(b: GraphBuilder, node: Any, a: dict) -> Value:
    """x [M, K] by weight [G, K, N] in groups of rows ending at `offs`: ge.grouped_matmul (the group sizes are
    run-time values); a transposed weight constant is read as transpose_b instead of copied."""
    x = tensor(b, a.get("input", a.get("self")), "the input")
    weight = tensor(b, a.get("weight", a.get("mat2")), "the weight")
    offs = a.get("offs")
    if offs is None or a.get("bias") is not None or a.get("out_dtype") is not None:
        raise b.error("grouped_mm is supported with offs, without bias or out_dtype")
    if x.type.rank != 2 or weight.type.rank != 3:
        raise b.error(f"grouped_mm takes a 2-D input and a 3-D weight (one per group), got {x.type} and {weight.type}")
    transpose_b = False
    owner = weight.owner
    if owner is not None and owner.name == "ge.transpose" and list(owner.attr("perm")) == [0, 2, 1]:
        weight, transpose_b = owner.operands[0], True
    return b.value("ge.grouped_matmul", [x, weight, tensor(b, offs, "offs")],
                   {"transpose_b": transpose_b, "group_list_type": "cumsum"}, hint=node.name)
