"""Converters for the ONNX ops that map onto GEIR's graph ops (Attention has its own module).

Each converter reads its node's attributes and inputs as the node's opset defines them (axes and
sizes moved from attributes to inputs over the versions; both forms are accepted) and emits GEIR
ops through the builder, which evaluates them on the spot when their operands are constants.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from geir.frontends.onnx_node import Node, constant, converter, int_list, optional, required
from geir.frontends.onnx_shapes import broadcast_shape, broadcast_to, normalize_axis, reshape_to
from geir.frontends.onnx_values import GraphBuilder, ImportProblem, Tensor, dtype_of
from geir.ops.numerics import multiply_dims
from geir.types import DType
from geir.verifier import size_problem

Inputs = list[Tensor | None]


def scalar(b: GraphBuilder, value: float | int | bool, like: Tensor) -> Tensor:
    """A rank-0 constant in the dtype of `like`."""
    return b.const(np.array(value, dtype=like.type.dtype.np))


def onnx_dtype(code: int) -> DType:
    """The GEIR dtype of an ONNX TensorProto data type code."""
    try:
        np_dtype = helper.tensor_dtype_to_np_dtype(code)
    except (KeyError, ValueError, TypeError):
        raise ImportProblem(f"GEIR has no dtype for ONNX data type {code}") from None
    return dtype_of(np_dtype)


# --- elementwise ---------------------------------------------------------------------------------------

def _binary(ge_name: str):
    """A converter for an elementwise binary op with numpy broadcasting."""
    def convert(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
        if node.opset < 7 and node.attr("broadcast", 0):
            raise ImportProblem("the broadcast attribute of opsets before 7 (an axis-aligned broadcast, not numpy's)")
        return [b.emit1(ge_name, [required(xs, 0, "A"), required(xs, 1, "B")])]
    return convert


for _onnx, _ge in {"Add": "ge.add", "Sub": "ge.sub", "Mul": "ge.mul", "Div": "ge.div",
                   "Equal": "ge.equal", "Greater": "ge.greater", "Less": "ge.less"}.items():
    converter(_onnx)(_binary(_ge))


@converter("Pow")
def _pow(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Pow, whose base and exponent may have different dtypes in ONNX (one dtype in GEIR)."""
    x, y = required(xs, 0, "X"), required(xs, 1, "Y")
    if x.type.dtype == y.type.dtype:
        return [b.emit1("ge.pow", [x, y])]
    if x.type.dtype.is_float:  # a float base: the exponent in the base's dtype
        return [b.emit1("ge.pow", [x, b.emit1("ge.cast", [y], {"to": x.type.dtype})])]
    # an integer base: computed in the exponent's float dtype, the result back in the base's
    p = b.emit1("ge.pow", [b.emit1("ge.cast", [x], {"to": y.type.dtype}), y])
    return [b.emit1("ge.cast", [p], {"to": x.type.dtype})]


def _variadic(ge_name: str):
    """A converter folding any number of inputs with a binary op."""
    def convert(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
        operands = [x for x in xs if x is not None]
        if not operands:
            raise ImportProblem("needs at least one input", unsupported=False)
        out = operands[0]
        for x in operands[1:]:
            out = b.emit1(ge_name, [out, x])
        return [out]
    return convert


converter("Max")(_variadic("ge.max"))
converter("Min")(_variadic("ge.min"))
converter("Sum")(_variadic("ge.add"))


@converter("Mean")
def _mean(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Mean of the inputs: their sum over their count."""
    (total,) = _variadic("ge.add")(b, node, xs)
    count = sum(1 for x in xs if x is not None)
    return [b.emit1("ge.div", [total, scalar(b, count, total)]) if count > 1 else total]


def _or(b: GraphBuilder, x: Tensor, y: Tensor) -> Tensor:
    """x or y on booleans."""
    return b.emit1("ge.select", [x, b.const(True), y])


@converter("GreaterOrEqual", "LessOrEqual")
def _compare_or_equal(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """a >= b as (a > b) or (a == b), which keeps NaN's answer (false)."""
    x, y = required(xs, 0, "A"), required(xs, 1, "B")
    strict = b.emit1("ge.greater" if node.op_type == "GreaterOrEqual" else "ge.less", [x, y])
    return [_or(b, strict, b.emit1("ge.equal", [x, y]))]


@converter("Not")
def _not(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """not x as x == false."""
    return [b.emit1("ge.equal", [required(xs, 0, "X"), b.const(False)])]


@converter("And", "Or", "Xor")
def _logical(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """And, Or and Xor as selects on booleans."""
    x, y = required(xs, 0, "A"), required(xs, 1, "B")
    if node.op_type == "And":
        return [b.emit1("ge.select", [x, y, b.const(False)])]
    if node.op_type == "Or":
        return [_or(b, x, y)]
    return [b.emit1("ge.select", [x, b.emit1("ge.equal", [y, b.const(False)]), y])]


@converter("Where")
def _where(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Where as ge.select; a condition known now picks its side."""
    cond, x, y = required(xs, 0, "condition"), required(xs, 1, "X"), required(xs, 2, "Y")
    if cond.is_const and cond.array.size and (cond.array.all() or not cond.array.any()):
        # a condition known now picks one side: no select (the fuse rules then see the side itself)
        pick = x if cond.array.all() else y
        shape = broadcast_shape(cond.shape, x.shape, y.shape)
        if None not in shape and x.type.dtype == y.type.dtype:
            return [broadcast_to(b, pick, shape)]
    return [b.emit1("ge.select", [cond, x, y])]


_UNARY = {"Sqrt": "ge.sqrt", "Exp": "ge.exp", "Log": "ge.log", "Erf": "ge.erf", "Tanh": "ge.tanh",
          "Sigmoid": "ge.sigmoid", "Relu": "ge.relu", "Abs": "ge.abs", "Neg": "ge.neg", "Sin": "ge.sin", "Cos": "ge.cos"}


@converter(*_UNARY)
def _unary(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """The elementwise unary ops GEIR has under another name."""
    return [b.emit1(_UNARY[node.op_type], [required(xs, 0, "X")])]


@converter("IsNaN")
def _isnan(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """IsNaN as ge.isnan."""
    return [b.emit1("ge.isnan", [required(xs, 0, "X")])]


@converter("IsInf")
def _isinf(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """IsInf as ge.isinf; detecting only one sign keeps the infinities on that side of zero."""
    x = required(xs, 0, "X")
    positive, negative = bool(node.attr("detect_positive", 1)), bool(node.attr("detect_negative", 1))
    inf = b.emit1("ge.isinf", [x])
    if positive and negative:
        return [inf]
    if not positive and not negative:
        return [b.emit1("ge.select", [inf, b.const(False), b.const(False)])]
    side = b.emit1("ge.greater" if positive else "ge.less", [x, scalar(b, 0, x)])
    return [b.emit1("ge.select", [inf, side, b.const(False)])]


@converter("Range")
def _range(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Range with inputs known at import as ge.arange (a constant: the builder evaluates it now); with one
    computed in the graph (a length read by Shape), ge.range, evaluated when the shape signature is bound."""
    given = [required(xs, i, what) for i, what in enumerate(("start", "limit", "delta"))]
    if not all(t.is_const for t in given):
        if any(t.type.num_elements != 1 for t in given):
            raise ImportProblem("Range takes three scalars", unsupported=False)
        return [b.emit1("ge.range", [t if t.rank == 0 else reshape_to(b, t, ()) for t in given])]
    bounds = [np.asarray(constant(t, f"the {what}")) for t, what in zip(given, ("start", "limit", "delta"))]
    dtype = dtype_of(bounds[0].dtype)
    if dtype is DType.i1 or any(a.size != 1 for a in bounds):
        raise ImportProblem("Range takes three numeric scalars", unsupported=False)
    start, limit, delta = (float(a.reshape(-1)[0]) if dtype.is_float else int(a.reshape(-1)[0]) for a in bounds)
    return [b.emit1("ge.arange", [], {"start": start, "limit": limit, "delta": delta, "dtype": dtype})]


@converter("CumSum")
def _cumsum(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """CumSum with its axis known at import as ge.cumsum, exclusive and reverse as ONNX defines them."""
    x = required(xs, 0, "x")
    axes = int_list(required(xs, 1, "axis"), "the axis")
    if len(axes) != 1:
        raise ImportProblem(f"CumSum takes one axis, got {len(axes)}", unsupported=False)
    axis = axes[0]
    return [b.emit1("ge.cumsum", [x], {"axis": axis, "exclusive": bool(node.attr("exclusive", 0)),
                                        "reverse": bool(node.attr("reverse", 0))})]


@converter("Reciprocal")
def _reciprocal(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """1 / x."""
    x = required(xs, 0, "X")
    return [b.emit1("ge.div", [scalar(b, 1, x), x])]


@converter("Gelu")
def _gelu(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Gelu, exact or tanh-approximated."""
    approximate = node.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ImportProblem(f"Gelu approximation '{approximate}' (GEIR has 'none' and 'tanh')")
    return [b.emit1("ge.gelu", [required(xs, 0, "X")], {"approximate": approximate})]


@converter("Clip")
def _clip(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Clip to [min, max] (attributes before opset 11, inputs after)."""
    x = required(xs, 0, "input")
    lo, hi = optional(xs, 1), optional(xs, 2)
    if node.opset < 11:
        lo = scalar(b, node.attr("min", -3.4028234663852886e38), x) if node.has_attr("min") else None
        hi = scalar(b, node.attr("max", 3.4028234663852886e38), x) if node.has_attr("max") else None
    # np.clip: min(max(x, lo), hi)
    if lo is not None:
        x = b.emit1("ge.max", [x, lo])
    if hi is not None:
        x = b.emit1("ge.min", [x, hi])
    return [x]


@converter("Identity")
def _identity(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Identity: the input itself."""
    return [required(xs, 0, "input")]


@converter("Dropout")
def _dropout(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor | None]:
    """Dropout at inference: the input, and an all-true mask if asked for."""
    x = required(xs, 0, "data")
    training = optional(xs, 2)
    if training is not None and bool(np.asarray(constant(training, "training_mode")).reshape(-1)[0]):
        raise ImportProblem("Dropout in training mode (GEIR graphs are for inference)")
    mask = None
    if node.wants(1):
        if None in x.shape:
            raise ImportProblem("Dropout's mask output for a shape known only at run time")
        mask = b.const(np.ones(x.shape, dtype=bool))
    return [x, mask]


@converter("Cast", "CastLike")
def _cast(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Cast, or CastLike to the second input's dtype."""
    x = required(xs, 0, "input")
    to = onnx_dtype(node.attr("to")) if node.op_type == "Cast" else required(xs, 1, "target_type").type.dtype
    if x.type.dtype == to:
        return [x]
    return [b.emit1("ge.cast", [x], {"to": to})]


# --- softmax -------------------------------------------------------------------------------------------

def _coerced_2d(b: GraphBuilder, node: Node, x: Tensor, axis: int, body) -> Tensor:
    """Before opset 13 softmax ran over everything from `axis` on, as if x were 2-D."""
    if axis == x.rank - 1:
        return body(x, -1)
    rows = multiply_dims(x.shape[:axis])
    cols = multiply_dims(x.shape[axis:])
    flat = reshape_to(b, x, (rows, cols))
    return reshape_to(b, body(flat, -1), x.shape)


@converter("Softmax", "LogSoftmax")
def _softmax(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Softmax and LogSoftmax over one axis (over the trailing axes from `axis` before opset 13)."""
    x = required(xs, 0, "input")
    legacy = node.opset < 13
    axis = node.attr("axis", 1 if legacy else -1)
    normalize_axis(axis, max(x.rank, 1))

    def body(t: Tensor, ax: int) -> Tensor:
        if node.op_type == "Softmax":
            return b.emit1("ge.softmax", [t], {"axis": ax})
        # log-softmax written stably: (x - max) - log(sum(exp(x - max)))
        shifted = b.emit1("ge.sub", [t, b.emit1("ge.reduce_max", [t], {"axes": [ax], "keepdims": True})])
        total = b.emit1("ge.reduce_sum", [b.emit1("ge.exp", [shifted])], {"axes": [ax], "keepdims": True})
        return b.emit1("ge.sub", [shifted, b.emit1("ge.log", [total])])

    if legacy:
        return [_coerced_2d(b, node, x, normalize_axis(axis, max(x.rank, 1)), body)]
    return [body(x, axis)]


# --- reductions ----------------------------------------------------------------------------------------

_REDUCE = {"ReduceSum": "ge.reduce_sum", "ReduceMean": "ge.reduce_mean", "ReduceMax": "ge.reduce_max",
           "ReduceMin": "ge.reduce_max"}


@converter(*_REDUCE)
def _reduce(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """ReduceSum/Mean/Max/Min over axes from an attribute or an input."""
    x = required(xs, 0, "data")
    axes_input = optional(xs, 1)
    axes = int_list(axes_input, "axes") if axes_input is not None else list(node.attr("axes", []))
    if not axes:
        if node.attr("noop_with_empty_axes", 0):
            return [x]
        axes = list(range(x.rank))
    axes = sorted({normalize_axis(a, x.rank, "axis") for a in axes})
    if node.op_type in ("ReduceMax", "ReduceMin") and any(x.shape[a] == 0 for a in axes):
        raise ImportProblem(f"{node.op_type} over an empty axis (GEIR's reduce_max has no value for no elements)")
    attrs = {"axes": axes, "keepdims": bool(node.attr("keepdims", 1))}
    if node.op_type == "ReduceMin":  # min(x) = -max(-x), exactly
        if x.type.dtype == DType.i1:
            raise ImportProblem("ReduceMin of booleans")
        return [b.emit1("ge.neg", [b.emit1("ge.reduce_max", [b.emit1("ge.neg", [x])], attrs)])]
    return [b.emit1(_REDUCE[node.op_type], [x], attrs)]


# --- matrix products -----------------------------------------------------------------------------------

@converter("MatMul")
def _matmul(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """MatMul with numpy's semantics, vectors included."""
    a, w = required(xs, 0, "A"), required(xs, 1, "B")
    # numpy's matmul on vectors: a vector is a row (left) or a column (right), dropped from the result
    a2 = reshape_to(b, a, (1,) + tuple(a.shape)) if a.rank == 1 else a
    w2 = reshape_to(b, w, tuple(w.shape) + (1,)) if w.rank == 1 else w
    y = b.emit1("ge.matmul", [a2, w2])
    if a.rank == 1 or w.rank == 1:
        shape = list(y.shape)
        if w.rank == 1:
            shape.pop(-1)
        if a.rank == 1:
            shape.pop(-2 if w.rank != 1 else -1)
        y = reshape_to(b, y, shape)
    return [y]


@converter("Gemm")
def _gemm(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """alpha * A' B' + beta * C."""
    a, w, c = required(xs, 0, "A"), required(xs, 1, "B"), optional(xs, 2)
    y = b.emit1("ge.matmul", [a, w], {"transpose_a": bool(node.attr("transA", 0)),
                                      "transpose_b": bool(node.attr("transB", 0))})
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    if alpha != 1.0:
        y = b.emit1("ge.mul", [y, scalar(b, alpha, y)])
    if c is not None and beta != 0.0:
        if beta != 1.0:
            c = b.emit1("ge.mul", [c, scalar(b, beta, c)])
        y = b.emit1("ge.add", [y, c])
    return [y]


@converter("Conv")
def _conv(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """2-D Conv as one ge.conv2d (GE lowers it to the cube); auto_pad SAME_* becomes explicit pads. A 1-D Conv
    (Whisper) is the 2-D one over a unit height: [N, C, L] as [N, C, 1, L], the same numbers."""
    x, w, bias = required(xs, 0, "X"), required(xs, 1, "W"), optional(xs, 2)
    if x.rank == 3 and w.rank == 3:
        return _conv1d(b, node, x, w, bias)
    if x.rank != 4 or w.rank != 4:
        raise ImportProblem(f"a {x.rank - 2}-D Conv (X of rank {x.rank}, W of rank {w.rank}): GEIR has ge.conv2d "
                            f"(NCHW input, OIHW weight) only")
    kernel = list(node.attr("kernel_shape", list(w.shape[2:])))
    if kernel != list(w.shape[2:]):
        raise ImportProblem(f"kernel_shape {kernel} differs from the weight's {list(w.shape[2:])}", unsupported=False)
    strides = list(node.attr("strides", [1, 1]))
    dilations = list(node.attr("dilations", [1, 1]))
    auto_pad = node.attr("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if None in x.shape[2:] or None in kernel:
            raise ImportProblem(f"Conv with auto_pad {auto_pad} on a spatial size known only at run time")
        # the result is ceil(size / stride); SAME_UPPER puts the odd row or column of padding at the end
        totals = [max(0, (-(-n // s) - 1) * s + (k - 1) * d + 1 - n)
                  for n, k, s, d in zip(x.shape[2:], kernel, strides, dilations)]
        first = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
        pads = first + [t - f for t, f in zip(totals, first)]
    elif auto_pad in ("NOTSET", "VALID"):
        pads = list(node.attr("pads", [0, 0, 0, 0])) if auto_pad == "NOTSET" else [0, 0, 0, 0]
    else:
        raise ImportProblem(f"Conv auto_pad '{auto_pad}' (NOTSET, SAME_UPPER, SAME_LOWER or VALID)", unsupported=False)
    operands = [x, w] + ([bias] if bias is not None else [])
    return [b.emit1("ge.conv2d", operands, {"strides": strides, "pads": pads, "dilations": dilations,
                                            "groups": int(node.attr("group", 1))})]


def _conv1d(b: GraphBuilder, node: Node, x: Tensor, w: Tensor, bias: Tensor | None) -> list[Tensor]:
    """A 1-D Conv as ge.conv2d over a unit height, its attributes widened with the height's identity."""
    kernel = list(node.attr("kernel_shape", list(w.shape[2:])))
    if kernel != list(w.shape[2:]):
        raise ImportProblem(f"kernel_shape {kernel} differs from the weight's {list(w.shape[2:])}", unsupported=False)
    (stride,), (dilation,) = list(node.attr("strides", [1])), list(node.attr("dilations", [1]))
    auto_pad = node.attr("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        n, k = x.shape[2], kernel[0]
        if n is None or k is None:
            raise ImportProblem(f"Conv with auto_pad {auto_pad} on a length known only at run time")
        total = max(0, (-(-n // stride) - 1) * stride + (k - 1) * dilation + 1 - n)
        before = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        pads = [before, total - before]
    elif auto_pad in ("NOTSET", "VALID"):
        pads = list(node.attr("pads", [0, 0])) if auto_pad == "NOTSET" else [0, 0]
    else:
        raise ImportProblem(f"Conv auto_pad '{auto_pad}' (NOTSET, SAME_UPPER, SAME_LOWER or VALID)", unsupported=False)
    x4 = reshape_to(b, x, [x.shape[0], x.shape[1], 1, x.shape[2]])
    w4 = reshape_to(b, w, [w.shape[0], w.shape[1], 1, w.shape[2]])
    operands = [x4, w4] + ([bias] if bias is not None else [])
    out = b.emit1("ge.conv2d", operands, {"strides": [1, stride], "pads": [0, pads[0], 0, pads[1]],
                                          "dilations": [1, dilation], "groups": int(node.attr("group", 1))})
    return [reshape_to(b, out, [out.shape[0], out.shape[1], out.shape[3]])]


# --- data movement -------------------------------------------------------------------------------------

@converter("Transpose")
def _transpose(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Transpose (default: the axes reversed)."""
    x = required(xs, 0, "data")
    perm = list(node.attr("perm", list(range(x.rank))[::-1]))
    if perm == list(range(x.rank)):
        return [x]
    return [b.emit1("ge.transpose", [x], {"perm": perm})]


@converter("Reshape")
def _reshape(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Reshape to a shape known at import (0 copies a dimension unless allowzero)."""
    x = required(xs, 0, "data")
    allow_zero = bool(node.attr("allowzero", 0))
    if node.opset < 5:
        shape = list(node.attr("shape", []))
    else:
        given = required(xs, 1, "shape")
        if not given.is_const:  # a shape computed in the graph: sized when the shape signature is bound
            return [b.emit1("ge.dynamic_reshape", [x, given], {"allowzero": allow_zero})]
        shape = int_list(given, "the shape")
    dims: list[int | None] = []
    for i, d in enumerate(shape):
        if d == 0 and not allow_zero:  # 0 copies the input's dimension
            if i >= x.rank:
                raise ImportProblem(f"shape {shape} copies dimension {i} of a rank-{x.rank} input", unsupported=False)
            dims.append(x.shape[i])
        else:
            dims.append(d)
    if -1 in dims:
        known = multiply_dims([d for d in dims if d != -1])
        total = multiply_dims(x.shape)
        if known is not None and total is not None:
            if known == 0 or total % known:
                raise ImportProblem(f"cannot reshape {x.type} into {shape}", unsupported=False)
            dims[dims.index(-1)] = total // known
    if sum(1 for d in dims if d is None) + dims.count(-1) > 1:  # several run-time dims: read from the input
        return [b.emit1("ge.dynamic_reshape", [x, b.const(np.array(shape, dtype=np.int64))],
                        {"allowzero": allow_zero})]
    return [reshape_to(b, x, dims)]


@converter("Flatten")
def _flatten(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Flatten into two dimensions at `axis`."""
    x = required(xs, 0, "input")
    axis = node.attr("axis", 1)
    axis = axis + x.rank if axis < 0 else axis
    return [reshape_to(b, x, (multiply_dims(x.shape[:axis]), multiply_dims(x.shape[axis:])))]


def _axes(node: Node, xs: Inputs, what: str) -> list[int] | None:
    """Axes from input 1 (newer opsets) or the `axes` attribute (older ones); None when neither is given."""
    given = optional(xs, 1)
    if given is not None:
        return int_list(given, what)
    return list(node.attr("axes")) if node.has_attr("axes") else None


@converter("Unsqueeze")
def _unsqueeze(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Unsqueeze: size-1 axes inserted, as a reshape."""
    x = required(xs, 0, "data")
    axes = _axes(node, xs, "axes")
    if axes is None:
        raise ImportProblem("Unsqueeze without axes", unsupported=False)
    rank = x.rank + len(axes)
    new = sorted(normalize_axis(a, rank) for a in axes)
    dims = list(x.shape)
    for a in new:
        dims.insert(a, 1)
    return [reshape_to(b, x, dims)]


@converter("Squeeze")
def _squeeze(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Squeeze: size-1 axes dropped, as a reshape."""
    x = required(xs, 0, "data")
    axes = _axes(node, xs, "axes")
    if axes is None:
        if None in x.shape:
            raise ImportProblem("Squeeze without axes of a shape with dimensions known only at run time")
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    drop = {normalize_axis(a, x.rank) for a in axes}
    for a in drop:
        if x.shape[a] not in (1, None):
            raise ImportProblem(f"cannot squeeze axis {a} of {x.type}: its size is not 1", unsupported=False)
    return [reshape_to(b, x, [d for i, d in enumerate(x.shape) if i not in drop])]


@converter("Concat")
def _concat(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Concat along an axis."""
    parts = [x for x in xs if x is not None]
    if not parts:
        raise ImportProblem("Concat of nothing", unsupported=False)
    axis = normalize_axis(node.attr("axis", 0), parts[0].rank)
    if len(parts) == 1:
        return parts
    return [b.emit1("ge.concat", parts, {"axis": axis})]


@converter("Split")
def _split(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Split by sizes from an input or attribute, or into equal parts."""
    x = required(xs, 0, "input")
    axis = normalize_axis(node.attr("axis", 0), x.rank)
    count = len(node.outputs)
    given = optional(xs, 1)
    if given is not None:
        sizes = int_list(given, "split")
    elif node.has_attr("split"):
        sizes = list(node.attr("split"))
    else:
        dim = x.shape[axis]
        if dim is None:
            raise ImportProblem("Split into equal parts along a dimension known only at run time")
        count = node.attr("num_outputs", count)
        if count != len(node.outputs):  # before the sizes are listed: a count is not bounded by the model's size
            raise ImportProblem(f"Split into {count} parts but the node has {len(node.outputs)} outputs",
                                unsupported=False)
        chunk = -(-dim // count)  # ceil: the last part is the smaller one (opset 18)
        sizes = [min(chunk, dim - i * chunk) for i in range(count)]
    if len(sizes) != len(node.outputs):
        raise ImportProblem(f"Split into {len(sizes)} parts but the node has {len(node.outputs)} outputs",
                            unsupported=False)
    if len(sizes) == 1:
        return [x]
    return b.emit("ge.split", [x], {"axis": axis, "sizes": sizes}, results=len(sizes))


@converter("Slice")
def _slice(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Slice (attributes before opset 10, inputs after), with any nonzero steps where the bounds are constants."""
    x = required(xs, 0, "data")
    if node.opset < 10:
        starts, ends = list(node.attr("starts")), list(node.attr("ends"))
        axes = list(node.attr("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        given = [required(xs, 1, "starts"), required(xs, 2, "ends")]
        if not all(t.is_const for t in given):  # bounds computed in the graph (torch's slice to a length S)
            count = given[0].type.num_elements
            axes = int_list(xs[3], "axes") if optional(xs, 3) is not None else list(range(count or 0))
            steps = int_list(xs[4], "steps") if optional(xs, 4) is not None else [1] * len(axes)
            if any(s != 1 for s in steps):
                raise ImportProblem(f"Slice with steps {steps} and bounds computed at run time (ge.dynamic_slice "
                                    f"takes every element)")
            return [b.emit1("ge.dynamic_slice", [x] + given, {"axes": [normalize_axis(a, x.rank) for a in axes]})]
        starts = int_list(given[0], "starts")
        ends = int_list(given[1], "ends")
        axes = int_list(xs[3], "axes") if optional(xs, 3) is not None else list(range(len(starts)))
        steps = int_list(xs[4], "steps") if optional(xs, 4) is not None else [1] * len(starts)
    if 0 in steps:
        raise ImportProblem(f"Slice with steps {steps}: ONNX's steps are nonzero", unsupported=False)
    axes = [normalize_axis(a, x.rank) for a in axes]
    # clamp to the dimension where it is known, so the IR holds readable numbers; numpy's clamping is then
    # ONNX's, but for an end before the first element of a backward step: -n - 1 there (-n would stop at index 0)
    bound = [x.shape[a] if x.shape[a] is not None else 2 ** 62 for a in axes]
    starts = [max(-n, min(n, s)) for s, n in zip(starts, bound)]
    ends = [max(-n - (st < 0), min(n, e)) for e, n, st in zip(ends, bound, steps)]
    if all(x.shape[a] is not None and s in (0, -x.shape[a]) and e == x.shape[a] and st == 1
           for a, s, e, st in zip(axes, starts, ends, steps)):
        return [x]
    strided = {"steps": steps} if any(st != 1 for st in steps) else {}
    return [b.emit1("ge.slice", [x], {"axes": axes, "starts": starts, "ends": ends, **strided})]


@converter("TopK")
def _topk(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """TopK with K known at import: one ge.topk (values and i64 indices; the AI CPU runs it)."""
    x = required(xs, 0, "X")
    if node.opset < 10:
        k = int(node.attr("k"))
    else:
        # a K fed at run time is refused as every size the model computes then (ge.topk's k is known at import)
        ks = int_list(required(xs, 1, "K"), "K")
        if len(ks) != 1:
            raise ImportProblem(f"TopK's K holds one value (the count to keep), not {len(ks)}")
        (k,) = ks
    attrs = {"k": k, "axis": normalize_axis(node.attr("axis", -1), x.rank),
             "largest": bool(node.attr("largest", 1)), "sorted": bool(node.attr("sorted", 1))}
    return b.emit("ge.topk", [x], attrs, results=2)


@converter("ConstantOfShape")
def _constant_of_shape(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """ConstantOfShape of a shape computed at run time (BART with dynamic axes): the value broadcast to it,
    sized when the shape signature binds (a constant shape is evaluated at import, as every all-constant node)."""
    shape = required(xs, 0, "input")
    value = node.attr("value", None)
    value = np.zeros((), np.float32) if value is None else np.asarray(value).reshape(())
    return [b.emit1("ge.dynamic_broadcast", [b.const(value), shape])]


@converter("Gather")
def _gather(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Gather: ge.gather with indices computed at run time; with indices known at import, slices of the
    consecutive runs they name, concatenated (what the fusion rules and shape arithmetic read)."""
    data, indices = required(xs, 0, "data"), required(xs, 1, "indices")
    if not indices.is_const:
        return [b.emit1("ge.gather", [data, indices], {"axis": node.attr("axis", 0)})]
    return _gather_known(b, node, data, indices)


def _gather_known(b: GraphBuilder, node: Node, data: Tensor, indices: Tensor) -> list[Tensor]:
    """Gather with indices known at import: slices of consecutive runs, concatenated."""
    indices = np.asarray(constant(indices, "the indices"))
    axis = normalize_axis(node.attr("axis", 0), data.rank)
    dim = data.shape[axis]
    flat = [int(i) for i in indices.reshape(-1)]
    if any(i < 0 for i in flat):
        if dim is None:
            raise ImportProblem("negative Gather indices on a dimension known only at run time")
        flat = [i + dim if i < 0 else i for i in flat]
    # runs of consecutive indices become one slice each; the pieces are concatenated
    pieces: list[Tensor] = []
    start = 0
    while start < len(flat):
        end = start + 1
        while end < len(flat) and flat[end] == flat[end - 1] + 1:
            end += 1
        pieces.append(b.emit1("ge.slice", [data], {"axes": [axis], "starts": [flat[start]],
                                                    "ends": [flat[end - 1] + 1]}))
        start = end
    if not pieces:
        picked = b.emit1("ge.slice", [data], {"axes": [axis], "starts": [0], "ends": [0]})
    elif len(pieces) == 1:
        picked = pieces[0]
    else:
        picked = b.emit1("ge.concat", pieces, {"axis": axis})
    shape = tuple(data.shape[:axis]) + tuple(indices.shape) + tuple(data.shape[axis + 1:])
    return [reshape_to(b, picked, shape)]


@converter("GatherND")
def _gather_nd(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """GatherND with indices known at import (the exporters' spelling of HF's mask[batch, kv]): one ge.gather of
    the first K dimensions merged, at the flattened indices, each checked against its own dimension here."""
    data, indices = required(xs, 0, "data"), required(xs, 1, "indices")
    if node.attr("batch_dims", 0):
        raise ImportProblem("GatherND with batch_dims is not supported")
    if not indices.is_const:  # ge.index with the last axis of the indices split into one index per dimension
        k = indices.shape[-1] if indices.rank else None
        if k is None or k > data.rank:
            raise ImportProblem(f"GatherND indices {indices.type} do not index {data.type} (their last dimension "
                                f"must be static, at most the data's rank)", unsupported=k is None and indices.rank > 0)
        return [b.emit1("ge.index", [data] + _per_dimension(b, indices), {"axis": 0})]
    index = np.asarray(constant(indices, "the indices")).astype(np.int64)
    k = index.shape[-1] if index.ndim else 0
    dims = tuple(data.shape[:k])
    if index.ndim == 0 or k > data.rank:
        raise ImportProblem(f"GatherND indices {list(index.shape)} do not index {data.type}", unsupported=False)
    if any(d is None for d in dims):
        raise ImportProblem("GatherND over a dimension known only at run time")
    parts = [index[..., i] for i in range(k)]
    for i, (p, d) in enumerate(zip(parts, dims)):
        if p.size and (p.min() < -d or p.max() >= d):
            raise ImportProblem(f"GatherND index {int(p.min() if p.min() < -d else p.max())} is out of range for "
                                f"dimension {i} of size {d}", unsupported=False)
    flat = np.ravel_multi_index(tuple(np.where(p < 0, p + d, p) for p, d in zip(parts, dims)), dims)
    merged = reshape_to(b, data, (int(np.prod(dims)),) + tuple(data.shape[k:]))
    return [b.emit1("ge.gather", [merged, b.const(flat.astype(np.int64))], {"axis": 0})]


def _per_dimension(b: GraphBuilder, indices: Tensor) -> list[Tensor]:
    """GatherND/ScatterND indices [..., K] as K index tensors [...], one per leading dimension (ge.index's)."""
    k = indices.shape[-1]
    parts = b.emit("ge.split", [indices], {"axis": -1, "sizes": [1] * k}, results=k) if k > 1 else [indices]
    return [reshape_to(b, p, indices.shape[:-1]) for p in parts]


def _reduction(node: Node) -> str:
    """A scatter's reduction: none or add (mul, max and min are not supported)."""
    reduction = node.attr("reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in ("none", "add"):
        raise ImportProblem(f"{node.op_type} with reduction '{reduction}' (GEIR scatters or adds)")
    return reduction


@converter("ScatterND")
def _scatter_nd(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """ScatterND as ge.index_put: the indices' last axis split into one index per leading dimension."""
    data, indices, updates = required(xs, 0, "data"), required(xs, 1, "indices"), required(xs, 2, "updates")
    k = indices.shape[-1] if indices.rank else None
    if k is None or k > data.rank or k == 0:
        raise ImportProblem(f"ScatterND indices {indices.type} do not index {data.type}", unsupported=False)
    return [b.emit1("ge.index_put", [data, updates] + _per_dimension(b, indices),
                    {"axis": 0, "accumulate": _reduction(node) == "add"})]


@converter("ScatterElements", "Scatter")
def _scatter_elements(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """ScatterElements (and opset 9's Scatter) as ge.scatter_elements."""
    data, indices, updates = required(xs, 0, "data"), required(xs, 1, "indices"), required(xs, 2, "updates")
    axis = normalize_axis(node.attr("axis", 0), data.rank)
    return [b.emit1("ge.scatter_elements", [data, indices, updates], {"axis": axis, "reduction": _reduction(node)})]


# GatherElements is spelled as a one-hot selection summed over the gathered axis; past this many elements
# in that selection the spelling costs more than it is worth (constant inputs then go to ONNX's evaluator)
MAX_GATHER_ELEMENTS_SELECTION = 1 << 24


@converter("GatherElements")
def _gather_elements(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """GatherElements as GEIR ops: out[.., t, ..] = sum over s of select(index[.., t, ..] == s, data[.., s, ..], -0).

    The builder folds it with GEIR's own semantics when the inputs are constants (ONNX's reference
    evaluator gathers with np.choose, which takes at most 64 choices, so BERT's 64 positions broke it),
    and keeps it in the graph when they are not. The sum of one picked element and -0.0s is that element
    exactly (NaN and inf included); only a picked -0.0 comes out as 0.0, as numpy's sum starts from +0.0.
    """
    data = required(xs, 0, "data")
    index = required(xs, 1, "indices")
    if index.rank != data.rank:
        raise ImportProblem(f"indices have rank {index.rank}, but the data has rank {data.rank}", unsupported=False)
    axis = normalize_axis(node.attr("axis", 0), data.rank)
    if None in data.shape or None in index.shape:  # GEIR's own op, on the AI CPU unless it folds
        return [b.emit1("ge.gather_elements", [data, index], {"axis": axis})]
    n = data.shape[axis]
    for d, (have, want) in enumerate(zip(data.shape, index.shape)):
        if d != axis and want > have:
            raise ImportProblem(f"indices have {want} elements along axis {d}, but the data only {have}",
                                unsupported=False)
    if multiply_dims(index.shape) * n > MAX_GATHER_ELEMENTS_SELECTION:
        raise ImportProblem(f"GatherElements selecting from {n} elements for each of {multiply_dims(index.shape)} "
                            f"indices (GEIR spells it as a selection of at most {MAX_GATHER_ELEMENTS_SELECTION})")
    if index.type.dtype not in (DType.i32, DType.i64):
        raise ImportProblem(f"indices must be integers, not {index.type.dtype}", unsupported=False)
    # the data's elements each output element may read: the index's extent on the other axes
    ends = [n if d == axis else want for d, want in enumerate(index.shape)]
    if any(e != have for e, have in zip(ends, data.shape)):
        data = b.emit1("ge.slice", [data], {"axes": list(range(data.rank)), "starts": [0] * data.rank, "ends": ends})
    # dims: [before axis] + [t: the index's position] + [s: the data's position] + [after axis]
    picked_shape = tuple(index.shape[:axis]) + (index.shape[axis], n) + tuple(index.shape[axis + 1:])
    iota = np.arange(n, dtype=index.type.dtype.np).reshape((n,) + (1,) * (data.rank - axis - 1))
    if index.is_const:
        flat = np.asarray(index.array)
        bad = (flat < -n) | (flat >= n)
        if bad.any():
            raise ImportProblem(f"index {int(flat[bad].reshape(-1)[0])} is out of range for axis {axis} of size {n}",
                                unsupported=False)
        normalized = np.where(flat < 0, flat + n, flat)
        mask = b.const(np.expand_dims(normalized, axis + 1) == iota)
    else:  # indices computed at run time: the same arithmetic in the graph (negative ones count from the end)
        negative = b.emit1("ge.less", [index, scalar(b, 0, index)])
        normalized = b.emit1("ge.select", [negative, b.emit1("ge.add", [index, scalar(b, n, index)]), index])
        expanded = reshape_to(b, normalized, tuple(index.shape[:axis + 1]) + (1,) + tuple(index.shape[axis + 1:]))
        mask = b.emit1("ge.equal", [expanded, b.const(iota)])
    boolean = data.type.dtype is DType.i1
    values = b.emit1("ge.cast", [data], {"to": DType.i8}) if boolean else data
    values = reshape_to(b, values, tuple(data.shape[:axis]) + (1, n) + tuple(data.shape[axis + 1:]))
    neutral = scalar(b, -0.0 if values.type.dtype.is_float else 0, values)
    chosen = b.emit1("ge.select", [mask, values, neutral])  # values broadcast along t
    out = b.emit1("ge.reduce_sum", [chosen], {"axes": [axis + 1], "keepdims": False})
    return [b.emit1("ge.cast", [out], {"to": DType.i1}) if boolean else out]


@converter("Pad")
def _pad(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Pad with a constant: slabs concatenated on either side (negative pads cut)."""
    x = required(xs, 0, "data")
    mode = node.attr("mode", "constant")
    if mode != "constant":
        raise ImportProblem(f"Pad in '{mode}' mode (GEIR pads with a constant only)")
    if node.opset < 11:
        name = "paddings" if node.opset < 2 else "pads"  # Pad-1 named the attribute `paddings`
        if node.attr(name) is None:
            raise ImportProblem(f"Pad at opset {node.opset} takes its pads as the attribute '{name}', and it has none",
                                unsupported=False)
        pads, value = list(node.attr(name)), node.attr("value", 0.0)
        axes = list(range(x.rank))
    else:
        pads = int_list(required(xs, 1, "pads"), "pads")
        given = optional(xs, 2)
        value = np.asarray(constant(given, "constant_value")).reshape(-1)[0] if given is not None else 0
        axes = int_list(xs[3], "axes") if optional(xs, 3) is not None else list(range(x.rank))
    axes = [normalize_axis(a, x.rank) for a in axes]
    if len(pads) != 2 * len(axes):
        raise ImportProblem(f"Pad has {len(pads)} pads for {len(axes)} axes", unsupported=False)
    for axis, before, after in zip(axes, pads[:len(axes)], pads[len(axes):]):
        # negative pads cut, positive ones add constant slabs on either side
        if before < 0 or after < 0:
            dim = x.shape[axis]
            if dim is None:
                raise ImportProblem("negative Pad on a dimension known only at run time")
            x = b.emit1("ge.slice", [x], {"axes": [axis], "starts": [max(-before, 0)],
                                           "ends": [dim - max(-after, 0)]})
            before, after = max(before, 0), max(after, 0)
        if not before and not after:
            continue
        if None in x.shape:
            raise ImportProblem("Pad of a tensor whose shape is known only at run time")
        padded = list(x.shape)
        padded[axis] += before + after
        why = size_problem(x.type.with_shape(tuple(padded)))
        if why is not None:  # before the slabs are allocated
            raise ImportProblem(f"the padded result: {why}")
        parts = []
        for amount in (before, after):
            shape = list(x.shape)
            shape[axis] = amount
            parts.append(b.const(np.full(shape, value, dtype=x.type.dtype.np)) if amount else None)
        x = b.emit1("ge.concat", [p for p in (parts[0], x, parts[1]) if p is not None], {"axis": axis})
    return [x]


@converter("Expand")
def _expand(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Expand: numpy broadcasting to a shape known at import, or to one computed in the graph
    (ge.dynamic_broadcast, sized when the shape signature is bound)."""
    x = required(xs, 0, "input")
    given = required(xs, 1, "shape")
    if not given.is_const:
        return [b.emit1("ge.dynamic_broadcast", [x, given])]
    shape = int_list(given, "the shape")
    return [broadcast_to(b, x, broadcast_shape(x.shape, shape))]


@converter("Shape")
def _shape(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Shape: a constant where the dims read are static, else ge.shape_of (sliced to start:end), evaluated
    when the shape signature is bound."""
    x = required(xs, 0, "data")
    start, end = node.attr("start", 0), node.attr("end", None)
    dims = list(x.shape)[slice(start, end)]
    if None not in dims:
        return [b.const(np.array(dims, dtype=np.int64))]
    shape = b.emit1("ge.shape_of", [x])
    begin, stop, _ = slice(start, end).indices(x.rank)
    if (begin, stop) == (0, x.rank):
        return [shape]
    return [b.emit1("ge.slice", [shape], {"axes": [0], "starts": [begin], "ends": [max(stop, begin)]})]


@converter("Size")
def _size(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """Size of a static tensor: a constant."""
    x = required(xs, 0, "data")
    n = multiply_dims(x.shape)
    if n is None:
        raise ImportProblem(f"Size of {x.type}, which is known only at run time")
    return [b.const(np.array(n, dtype=np.int64))]


# --- normalisations ------------------------------------------------------------------------------------

@converter("LayerNormalization")
def _layer_norm(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor | None]:
    """LayerNormalization as ge.layer_norm, with its Mean and InvStdDev outputs written out."""
    x, gamma, beta = required(xs, 0, "X"), required(xs, 1, "Scale"), optional(xs, 2)
    given = node.attr("axis", -1)
    axis = normalize_axis(given, x.rank)
    epsilon = float(node.attr("epsilon", 1e-5))
    if beta is None:
        beta = b.const(np.zeros(gamma.shape, dtype=gamma.type.dtype.np))
    y = b.emit1("ge.layer_norm", [x, gamma, beta], {"axis": given, "epsilon": epsilon})
    mean = inv_std = None
    if node.wants(1) or node.wants(2):
        # the statistics outputs, in the stash type (f32 unless it says otherwise), written out
        stash = onnx_dtype(node.attr("stash_type", 1))
        xf = x if x.type.dtype == stash else b.emit1("ge.cast", [x], {"to": stash})
        axes = list(range(axis, x.rank))
        mean = b.emit1("ge.reduce_mean", [xf], {"axes": axes, "keepdims": True})
        centred = b.emit1("ge.sub", [xf, mean])
        var = b.emit1("ge.reduce_mean", [b.emit1("ge.mul", [centred, centred])], {"axes": axes, "keepdims": True})
        inv_std = b.emit1("ge.rsqrt", [b.emit1("ge.add", [var, scalar(b, epsilon, var)])])
    return [y, mean, inv_std]


@converter("RMSNormalization")
def _rms_norm(b: GraphBuilder, node: Node, xs: Inputs) -> list[Tensor]:
    """RMSNormalization as ge.rms_norm, over several trailing axes by folding them into one."""
    x, gamma = required(xs, 0, "X"), required(xs, 1, "scale")
    axis = normalize_axis(node.attr("axis", -1), x.rank)
    attrs = {"epsilon": float(node.attr("epsilon", 1e-5))}
    if axis == x.rank - 1:
        return [b.emit1("ge.rms_norm", [x, gamma], attrs)]
    # GEIR normalises over the last axis: fold the normalised axes into one, and the scale with them
    inner = tuple(x.shape[axis:])
    if None in inner:
        raise ImportProblem("RMSNormalization over several axes, some known only at run time")
    flat_gamma = reshape_to(b, broadcast_to(b, gamma, broadcast_shape(gamma.shape, inner)), (multiply_dims(inner),))
    flat = reshape_to(b, x, tuple(x.shape[:axis]) + (multiply_dims(inner),))
    return [reshape_to(b, b.emit1("ge.rms_norm", [flat, flat_gamma], attrs), x.shape)]


