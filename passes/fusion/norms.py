"""Layer norm and RMS norm written out op by op become `ge.layer_norm` / `ge.rms_norm`.

layer norm: d = x - mean(x); var = mean(d * d); y = d / sqrt(var + eps) * gamma + beta
            (also d * rsqrt(var + eps), and pow(d, 2) for the square)
RMS norm:   ms = mean(x * x); y = x * rsqrt(ms + eps) * gamma   (also x / sqrt(ms + eps), and
            x * (1 / sqrt(ms + eps)) as ONNX exporters write T5's)
"""

from __future__ import annotations

import numpy as np

from geir.attributes import DenseAttr
from geir.ir import Operation, Value
from geir.passes.fusion.match import close, defining, scalar_constant, used_only_by
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.types import TensorType


def _square_of(v: Value) -> Value | None:
    """x when v is x * x or pow(x, 2)."""
    op = defining(v, "ge.mul", "ge.pow")
    if op is None:
        return None
    a, b = op.operands
    if op.name == "ge.mul":
        return a if a is b else None
    return a if close(scalar_constant(b), 2.0, 1e-6) else None


def _trailing_axes(axes: list[int], rank: int) -> int | None:
    """The first axis when `axes` are the trailing axes of a rank-`rank` tensor, else None."""
    norm = sorted(a % rank for a in axes) if rank else []
    if norm and norm == list(range(norm[0], rank)):
        return norm[0]
    return None


def _reciprocal_root(v: Value) -> tuple[Operation, list[Operation]] | None:
    """For v = rsqrt(a) or 1 / sqrt(a) (ONNX's `Reciprocal(Sqrt(a))`, T5's spelling): the root op and the ops
    between it and v."""
    r = defining(v, "ge.rsqrt")
    if r is not None:
        return r, []
    inv = defining(v, "ge.div")
    if inv is not None and close(scalar_constant(inv.operands[0]), 1.0, 1e-6):
        root = defining(inv.operands[1], "ge.sqrt")
        if root is not None:
            return root, [inv]
    return None


def _normalizer(n: Value):
    """For n = d / sqrt(s + eps), d * rsqrt(s + eps) or d * (1 / sqrt(s + eps)): (d, s, eps, ops) or a Miss,
    or None if not a normalisation."""
    op = defining(n, "ge.div", "ge.mul")
    if op is None:
        return None
    between: list[Operation] = []
    if op.name == "ge.div":
        root = defining(op.operands[1], "ge.sqrt")
        d = op.operands[0]
        if scalar_constant(d) is not None:
            return None  # 1 / sqrt(...): a reciprocal, which the mul that uses it normalises with
    else:
        root, d = None, None
        for side in (0, 1):
            found = _reciprocal_root(op.operands[side])
            if found is not None:
                (root, between), d = found, op.operands[1 - side]
                break
    if root is None:
        return None
    add = defining(root.operands[0], "ge.add")
    if add is None:
        return Miss("there is no epsilon added under the square root")
    eps = None
    for side in (0, 1):
        eps = scalar_constant(add.operands[side])
        if eps is not None:
            s = add.operands[1 - side]
            break
    if eps is None:
        return Miss("epsilon is not a scalar constant")
    return d, s, eps, [op, *between, root, add]


class FuseLayerNorm(Pattern):
    """(x - mean) / sqrt(var + eps) * gamma + beta -> ge.layer_norm."""

    NAME, ROOT, BENEFIT, EXPLAIN = "layer_norm", "ge.add", 35, True

    def match(self, add: Operation) -> Match | Miss | None:
        for side in (0, 1):
            scaled = defining(add.operands[side], "ge.mul")
            if scaled is None:
                continue
            for gside in (0, 1):
                found = _normalizer(scaled.operands[gside])
                if found is None:
                    continue
                if isinstance(found, Miss):
                    return found
                return self._match(add, add.operands[1 - side], scaled, scaled.operands[1 - gside], found)
        return None

    def _match(self, add: Operation, beta: Value, scaled: Operation, gamma: Value, found) -> Match | Miss | None:
        d, var, eps, ops = found
        sub = defining(d, "ge.sub")
        mean = defining(sub.operands[1], "ge.reduce_mean") if sub is not None else None
        if mean is None or mean.operands[0] is not sub.operands[0]:
            return None  # a plain normalisation (maybe an RMS norm), not a layer norm
        x = sub.operands[0]
        rank = x.type.rank
        axis = _trailing_axes(mean.axes, rank)
        if axis is None:
            return Miss(f"the mean runs over axes {mean.axes}, not the trailing axes")
        if not mean.keepdims:
            return Miss("the mean drops its axes (keepdims = false)")
        vmean = defining(var, "ge.reduce_mean")
        if vmean is None or _square_of(vmean.operands[0]) is not d:
            return Miss("the variance is not the mean of the squared deviations")
        if sorted(a % rank for a in vmean.axes) != sorted(a % rank for a in mean.axes) or not vmean.keepdims:
            return Miss("the variance and the mean reduce over different axes")
        square = vmean.operands[0].owner
        inner = ops + [square, vmean, mean, scaled]  # the deviations d feed both the square and the division
        if not used_only_by(d, ops[0], square) or any(len(o.result.users()) != 1 for o in inner):
            return Miss("an intermediate of the layer norm is also used elsewhere; fusing would drop it")
        norm_shape = x.type.shape[axis:]
        for what, p in (("gamma", gamma), ("beta", beta)):
            if p.type.dtype != x.type.dtype:
                return Miss(f"{what} dtype {p.type.dtype} differs from the input's {x.type.dtype}")
            if len(p.type.shape) > len(norm_shape) or any(
                    dp != 1 and dp != dn for dp, dn in zip(reversed(p.type.shape), reversed(norm_shape))):
                return Miss(f"{what} {p.type} varies along the non-normalised axes")
        if add.result.type.shape != x.type.shape:
            return Miss(f"the result {add.result.type} is not shaped like the input {x.type}")
        return Match(add, x=x, gamma=gamma, beta=beta, axis=axis - rank, eps=eps)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = rw.create("ge.layer_norm", [m.x, m.gamma, m.beta], {"axis": m.axis, "epsilon": m.eps}, before=m.root)
        rw.replace(m.root, op)


class FuseRmsNorm(Pattern):
    """x * rsqrt(mean(x * x) + eps) * gamma -> ge.rms_norm (without the gamma: a gamma of ones)."""

    NAME, ROOT, BENEFIT, EXPLAIN = "rms_norm", "ge.mul", 34, True

    def match(self, root: Operation) -> Match | Miss | None:
        users = root.result.users()
        if not (len(users) == 1 and users[0].name == "ge.mul"):
            # the normalisation with no scale after it (a gamma of ones, which GE's canonicalize folds away)
            found = _normalizer(root.result)
            if isinstance(found, tuple):
                return self._match(root, found, None)
        for gside in (0, 1):
            found = _normalizer(root.operands[gside])
            if found is None:
                continue
            if isinstance(found, Miss):
                return found
            return self._match(root, found, root.operands[1 - gside])
        return None

    def _match(self, root: Operation, found, gamma: Value | None) -> Match | Miss:
        x, ms, eps, ops = found
        m = defining(ms, "ge.reduce_mean")
        if m is None or _square_of(m.operands[0]) is not x:
            return Miss("the normaliser is not the mean of the input squared")
        rank = x.type.rank
        if not (len(m.axes) == 1 and rank and m.axes[0] % rank == rank - 1):
            return Miss(f"the mean runs over axes {m.axes}, not the last axis")
        if not m.keepdims:
            return Miss("the mean drops its axis (keepdims = false)")
        square = m.operands[0].owner
        inner = [o for o in ops + [square, m] if o is not root]
        if any(len(o.result.users()) != 1 for o in inner):
            return Miss("an intermediate of the RMS norm is also used elsewhere; fusing would drop it")
        if root.result.type.shape != x.type.shape:
            return Miss(f"the result {root.result.type} is not shaped like the input {x.type}")
        if gamma is not None:
            if gamma.type.dtype != x.type.dtype:
                return Miss(f"gamma {gamma.type} does not scale the input {x.type} elementwise")
            if len(gamma.type.shape) > 1 and any(d != 1 for d in gamma.type.shape[:-1]):
                return Miss(f"gamma {gamma.type} varies along axes other than the last")
        return Match(root, x=x, gamma=gamma, eps=eps)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        gamma = m.gamma
        if gamma is None:
            t = m.x.type
            gamma = rw.create("ge.const", [], {"value": DenseAttr(np.ones((), dtype=t.dtype.np))},
                              [TensorType((t.shape[-1],), t.dtype)], before=m.root).result
        rw.replace(m.root, rw.create("ge.rms_norm", [m.x, gamma], {"epsilon": m.eps}, before=m.root))
