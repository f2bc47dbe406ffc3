"""conv2d-im2col: ge.conv2d becomes im2col + ge.matmul, so that convolutions run on the cube.

What is lowered (`--explain` says which way, or why not, for every ge.conv2d):

- A patch embedding (kernel == stride, no padding, dilation 1, groups 1: ViT's): im2col is a pure
  re-layout, `ge.reshape` [N, C, Ho, kH, Wo, kW] + `ge.transpose` to [N, Ho, Wo, C, kH, kW] + `ge.reshape`
  to [N, Ho*Wo, C*kH*kW], then one `ge.matmul` with the weight as [O, C*kH*kW] (`transpose_b`), the
  bias as a `ge.add` on the last axis (which `fuse` makes a matmul epilogue), and `ge.reshape` +
  `ge.transpose` back to NCHW. A `?` batch is fine here.
- Any other convolution (overlapping windows, padding, dilation, groups) whose input height and width
  are known (a `?` batch is fine): padding is zero slabs joined by `ge.concat`, the padded input is viewed as
  [N, C, Hq, sH, Wq, sW] by one `ge.reshape` (so a strided window needs no strided slice), each of the
  kH*kW kernel taps is one `ge.slice` of that view, the taps are joined by `ge.concat` into
  [N, groups, C/groups*kH*kW, Ho*Wo], and one batched `ge.matmul` gives every group's
  [O/groups, Ho*Wo] product, reshaped to NCHW (+ `ge.add` of the bias as [O, 1, 1]).

What is not lowered, and stays `ge.conv2d`, run by its `compute` (on the AI CPU engine, where the
Runtime has one; no AI Core kernel implements it): a convolution that is not a patch embedding whose
input height or width is known only at run time (its windows' slices need them; this pass runs before
GE's session specialises shapes), one whose channels or kernel size are `?`, and one with more than
MAX_TAPS kernel taps (the slices would swamp the graph).
"""

from __future__ import annotations

import numpy as np

from geir.attributes import DenseAttr
from geir.ir import Module, Operation, Value
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.pattern import Match, Miss, Pattern, Rewriter

# kernel taps above which a general convolution stays one op: each tap is two ops here
MAX_TAPS = 64


class Conv2dToMatmul(Pattern):
    """ge.conv2d -> im2col (reshape/transpose, or slices and concat) + ge.matmul."""

    NAME, ROOT, BENEFIT, EXPLAIN = "conv2d", "ge.conv2d", 1, True

    def match(self, op: Operation) -> Match | Miss | None:
        x, w = op.operands[0], op.operands[1]
        if x.type is None or w.type is None or op.result.type is None:
            return Miss("its types are unknown")
        _, c, h, wd = x.type.shape
        o, cg, kh, kw = w.type.shape
        _, _, ho, wo = op.result.type.shape
        if None in (c, o, cg, kh, kw, ho, wo):
            return Miss(f"the channels, the kernel or the result's spatial dims are known only at run time "
                        f"(input {x.type}, weight {w.type})")
        strides, pads, dilations = list(op.strides), list(op.pads), list(op.dilations)
        if strides == [kh, kw] and pads == [0, 0, 0, 0] and dilations == [1, 1] and op.groups == 1:
            return Match(op, how="patches", detail="a patch embedding: im2col by reshape and transpose")
        if h is None or wd is None:
            return Miss(f"the input's height and width are known only at run time ({x.type}), and its windows "
                        f"need them")
        if kh * kw > MAX_TAPS:
            return Miss(f"{kh}x{kw} = {kh * kw} kernel taps would take more than {MAX_TAPS} slices")
        return Match(op, how="windows", detail=f"im2col by {kh * kw} window slice{'s' * (kh * kw != 1)} and concat")

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        out = _patches(m.root, rw) if m.how == "patches" else _windows(m.root, rw)
        rw.replace(m.root, [out])


def _create(rw: Rewriter, at: Operation, name: str, operands: list[Value], **attributes) -> Value:
    return rw.create(name, operands, attributes, before=at).result


def _patches(op: Operation, rw: Rewriter) -> Value:
    """A patch embedding: non-overlapping windows are a reshape and a transpose of the input."""
    x, w, bias = op.operands[0], op.operands[1], op.bias
    n, c, h, wd = x.type.shape
    o, _, kh, kw = w.type.shape
    _, _, ho, wo = op.result.type.shape
    batch = -1 if n is None else n
    if h != ho * kh or wd != wo * kw:  # rows and columns past the last whole patch are not seen
        x = _create(rw, op, "ge.slice", [x], axes=[2, 3], starts=[0, 0], ends=[ho * kh, wo * kw])
    t = _create(rw, op, "ge.reshape", [x], shape=[batch, c, ho, kh, wo, kw])
    t = _create(rw, op, "ge.transpose", [t], perm=[0, 2, 4, 1, 3, 5])
    cols = _create(rw, op, "ge.reshape", [t], shape=[batch, ho * wo, c * kh * kw])
    wm = _create(rw, op, "ge.reshape", [w], shape=[o, c * kh * kw])
    y = _create(rw, op, "ge.matmul", [cols, wm], transpose_b=True)
    if bias is not None:
        y = _create(rw, op, "ge.add", [y, bias])
    y = _create(rw, op, "ge.reshape", [y], shape=[batch, ho, wo, o])
    return _create(rw, op, "ge.transpose", [y], perm=[0, 3, 1, 2])


def _zeros(rw: Rewriter, at: Operation, shape: list, like: Value, batch: Value | None) -> Value:
    """Zeros of `shape` in `like`'s dtype; with shape[0] None (a run-time batch), broadcast to `batch`'s."""
    known = [1 if shape[0] is None else shape[0]] + list(shape[1:])
    value = DenseAttr(np.zeros((), dtype=like.type.dtype.np))  # a splat: one number, broadcast to the shape
    zeros = rw.create("ge.const", [], {"value": value}, [like.type.with_shape(tuple(known))], before=at).result
    return zeros if shape[0] is not None else _create(rw, at, "ge.select", [batch, zeros, zeros])


def _fit(rw: Rewriter, at: Operation, x: Value, axis: int, before: int, size: int, batch: Value | None) -> Value:
    """x with `before` zero rows on `axis`, then cut or padded with zeros at the end to `size` rows in all
    (zero slabs and a concat, as ONNX Pad is imported)."""
    after = size - before - x.type.shape[axis]
    if after < 0:  # rows past the last one any window reaches are never read
        x = _create(rw, at, "ge.slice", [x], axes=[axis], starts=[0], ends=[size - before])
        after = 0
    if not before and not after:
        return x
    slabs = []
    for amount in (before, after):
        shape = list(x.type.shape)
        shape[axis] = amount
        slabs.append(_zeros(rw, at, shape, x, batch) if amount else None)
    return _create(rw, at, "ge.concat", [p for p in (slabs[0], x, slabs[1]) if p is not None], axis=axis)


def _windows(op: Operation, rw: Rewriter) -> Value:
    """A general convolution: one strided window of the padded input per kernel tap, joined, then a matmul per group."""
    x, w, bias = op.operands[0], op.operands[1], op.bias
    n, c, _, _ = x.type.shape
    o, cg, kh, kw = w.type.shape
    _, _, ho, wo = op.result.type.shape
    n = -1 if n is None else n  # the reshapes' batch; the zero slabs take it from the input at run time
    g = op.groups
    (sh, sw), (pt, pl, _, _), (dh, dw) = op.strides, op.pads, op.dilations
    # Strided windows without a strided slice: the padded input is cut or padded to sh * hq rows and
    # viewed as [.., hq, sh, ..]; row a + sh*y is then (a // sh + y, a % sh), so the window of tap
    # offset a is one plain slice. hq rows reach the last tap's last window.
    hq, wq = (kh - 1) * dh // sh + ho, (kw - 1) * dw // sw + wo
    batch = None
    if n == -1 and (pt or pl or sh * hq > x.type.shape[2] + pt or sw * wq > x.type.shape[3] + pl):
        # zero slabs of a batch known only at run time: select(cond, 0, 0) with cond [N, 1, 1, 1] broadcasts
        # the zeros to it, and is 0 whatever x holds (a product with 0 would turn NaN and inf into NaN)
        row = _create(rw, op, "ge.slice", [x], axes=[1, 2, 3], starts=[0, 0, 0], ends=[1, 1, 1])
        batch = _create(rw, op, "ge.equal", [row, row])
    xp = _fit(rw, op, _fit(rw, op, x, 2, pt, sh * hq, batch), 3, pl, sw * wq, batch)
    xp = _create(rw, op, "ge.reshape", [xp], shape=[n, c, hq, sh, wq, sw])
    taps = []
    for i in range(kh):
        for j in range(kw):
            a, b = i * dh, j * dw
            t = _create(rw, op, "ge.slice", [xp], axes=[2, 3, 4, 5], starts=[a // sh, a % sh, b // sw, b % sw],
                        ends=[a // sh + ho, a % sh + 1, b // sw + wo, b % sw + 1])
            taps.append(_create(rw, op, "ge.reshape", [t], shape=[n, c, 1, ho * wo]))
    # [N, C, kH*kW, L] in (c, i, j) order, the order the weight [O, C/g, kH, kW] flattens in
    cols = taps[0] if len(taps) == 1 else _create(rw, op, "ge.concat", taps, axis=2)
    cols = _create(rw, op, "ge.reshape", [cols], shape=[n, g, cg * kh * kw, ho * wo])
    wm = _create(rw, op, "ge.reshape", [w], shape=[g, o // g, cg * kh * kw])
    y = _create(rw, op, "ge.matmul", [wm, cols])  # [G, O/G, K] @ [N, G, K, L]: one product per group
    y = _create(rw, op, "ge.reshape", [y], shape=[n, o, ho, wo])
    if bias is not None:
        y = _create(rw, op, "ge.add", [y, _create(rw, op, "ge.reshape", [bias], shape=[o, 1, 1])])
    return y


@register_pass("conv2d-im2col")
class Conv2dToMatmulPass(Pass):
    """Lower every ge.conv2d it can to im2col + ge.matmul on the cube; --explain says how, or why not."""

    REQUIRES = ("infer-shapes",)

    def run(self, module: Module, ctx: PassContext) -> None:
        pattern = Conv2dToMatmul()
        for graph in module.graphs:
            for op in [op for op in graph.ops if op.name == "ge.conv2d"]:
                m = pattern.match(op)
                if isinstance(m, Miss):
                    ctx.remark(f"conv2d not lowered to matmul: {m.reason}; it runs as ge.conv2d", op.loc)
                    continue
                loc = op.loc
                pattern.rewrite(m, Rewriter(graph))
                ctx.remark(f"conv2d lowered to matmul: {m.detail}", loc)
