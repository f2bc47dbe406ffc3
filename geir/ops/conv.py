"""Convolution: ge.conv2d, NCHW input and OIHW weight, with ONNX's strides, pads, dilations and groups.

GE lowers it to the cube (im2col + ge.matmul, see geir.passes.conv2d); where it is not lowered it runs
as itself, by this `compute`.
"""

from __future__ import annotations

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.numerics import require_float, same_dtype, work
from geir.types import Dim, TensorType


def conv_output_dim(size: Dim, kernel: Dim, stride: int, pad_before: int, pad_after: int, dilation: int) -> Dim:
    """One spatial dimension of a convolution's result (`?` when the input's or the kernel's is)."""
    if size is None or kernel is None:
        return None
    return (size + pad_before + pad_after - dilation * (kernel - 1) - 1) // stride + 1


@op("ge.conv2d")
class Conv2d(Operation):
    """2-D cross-correlation as ONNX Conv and torch conv2d define it: x [N,C,H,W], w [O,C/groups,kH,kW], bias [O].

    `pads` is ONNX's [top, left, bottom, right]; output channel o of group g = o // (O / groups) sees
    input channels g * C/groups ... (g + 1) * C/groups - 1.
    """

    OPERAND_NAMES = ("x", "w", "bias?")
    strides = Attr("ints", default=[1, 1])
    pads = Attr("ints", default=[0, 0, 0, 0])
    dilations = Attr("ints", default=[1, 1])
    groups = Attr(int, default=1)

    def verify(self) -> str | None:
        for name, value, n, least in (("strides", self.strides, 2, 1), ("pads", self.pads, 4, 0),
                                      ("dilations", self.dilations, 2, 1)):
            if len(value) != n:
                return f"conv2d {name} must have {n} entries, got {value}"
            if any(v < least for v in value):
                return f"conv2d {name} {value} must be {'positive' if least else 'non-negative'}"
        if self.groups < 1:
            return f"conv2d groups must be positive, got {self.groups}"
        return None

    def infer(self, x: TensorType, w: TensorType, bias: TensorType | None = None) -> TensorType:
        dtype = same_dtype(self.name, x, w, *(() if bias is None else (bias,)))
        require_float(x, "the input")
        if x.rank != 4:
            raise ShapeError(f"conv2d input must have rank 4 [N, C, H, W], got {x}")
        if w.rank != 4:
            raise ShapeError(f"conv2d weight must have rank 4 [O, C/groups, kH, kW], got {w}")
        n, c, h, wd = x.shape
        o, cg, kh, kw = w.shape
        g = self.groups
        if c is not None and c % g:
            raise ShapeError(f"conv2d input channels {c} are not a multiple of groups {g}")
        if c is not None and cg is not None and c != cg * g:
            raise ShapeError(f"conv2d input has {c} channels but the weight expects {cg} x {g} groups = {cg * g}")
        if o is not None and o % g:
            raise ShapeError(f"conv2d output channels {o} are not a multiple of groups {g}")
        if bias is not None and (bias.rank != 1 or (o is not None and bias.shape[0] not in (None, o))):
            raise ShapeError(f"conv2d bias must be [{'?' if o is None else o}] (one per output channel), got {bias}")
        (sh, sw), (pt, pl, pb, pr), (dh, dw) = self.strides, self.pads, self.dilations
        ho = conv_output_dim(h, kh, sh, pt, pb, dh)
        wo = conv_output_dim(wd, kw, sw, pl, pr, dw)
        if (ho is not None and ho < 1) or (wo is not None and wo < 1):
            raise ShapeError(f"conv2d kernel {kh}x{kw} (dilations {self.dilations}) does not fit the padded "
                             f"input {h}x{wd} (pads {self.pads}): the result would be {ho}x{wo}")
        return TensorType((n, o, ho, wo), dtype)

    def compute(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        x, w = work(x), work(w)  # f16/bf16 accumulate in f32, as ge.matmul does on the cube
        n, c, _, _ = x.shape
        o, cg, kh, kw = w.shape
        g = self.groups
        (sh, sw), (pt, pl, pb, pr), (dh, dw) = self.strides, self.pads, self.dilations
        xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
        ho = conv_output_dim(x.shape[2], kh, sh, pt, pb, dh)
        wo = conv_output_dim(x.shape[3], kw, sw, pl, pr, dw)
        # im2col: cols[n, c, i, j, y, z] is the input under kernel tap (i, j) for output pixel (y, z)
        cols = np.empty((n, c, kh, kw, ho, wo), dtype=x.dtype)
        for i in range(kh):
            for j in range(kw):
                cols[:, :, i, j] = xp[:, :, i * dh:i * dh + sh * (ho - 1) + 1:sh, j * dw:j * dw + sw * (wo - 1) + 1:sw]
        # per group: [O/g, C/g*kH*kW] @ [C/g*kH*kW, Ho*Wo]; (c, i, j) flattens in the weight's own order
        cols = cols.reshape(n, g, cg * kh * kw, ho * wo)
        out = np.matmul(w.reshape(g, o // g, cg * kh * kw), cols).reshape(n, o, ho, wo)
        if bias is not None:
            out = out + work(bias).reshape(1, o, 1, 1)
        return out
