"""A fused q/k/v projection whose weight interleaves the pieces head by head (GPT-NeoX's and Bloom's
`query_key_value`: output features ordered [heads, 3, head_dim]) gets its weight rows reordered at compile time to
[3, heads, head_dim], the layout of LLaMA's merged projection (qkv_merge), so that q, k and v are runs of the
matmul's last axis instead of strided pieces of every head.

    y = matmul(x, W) -> reshape [..., H, 3*D] (or [..., H, 3, D]) -> [transpose keeping that axis] ->
        split (or one slice per piece) of the 3*D (or 3) axis into G equal pieces
    ==> y' = matmul(x, W[perm]) -> split(y', last axis, G equal runs) -> each reshaped (and transposed) as before

The reshape only renames bytes: a block of the last B = prod(view.shape[axis:]) elements of the view is a run of
one row of y (B divides N), so piece i of block (row, h) is y[row, h*B + i*E : h*B + (i+1)*E] (E = B / G), and
ordering W's output features as (i, h, e) instead of (h, i, e) makes piece i the run y'[row, i*H*E:(i+1)*H*E]
in the same element order. The matmul computes the same dot products, only stored in another order: no rounding
changes. The split on the last axis is then what qkv_merge makes: in decode (one row) a view, no kernel; the
strided split (or Bloom's three slices, a launch each) goes, and q, k and v reach attention as the separate inputs
npu_fusion_attention takes. The reorder is a compile-time fold of the weight, as qkv_merge's concatenation is, and
like it needs the weight (and a bias) to be constants.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from geir.attributes import DenseAttr, DenseResourceAttr
from geir.ir import Operation, Value
from geir.passes.fusion.match import const_array, defining, named
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.target_npu.target import Target
from geir.types import TensorType

_MATMULS = ("ge.matmul", "ge.fused_matmul")


def _cut(view: Operation) -> tuple[int, list[Operation], list[Value], list[int] | None] | None:
    """How the view's result is cut into equal pieces on one axis: (axis, the ops that cut, the pieces in order,
    the transpose between view and split or None), or None when it is not."""
    users = view.result.users()
    t = None
    source = view.result
    if len(users) == 1 and users[0].name == "ge.transpose":
        t = users[0]
        source = t.result
        users = t.result.users()
    rank = source.type.rank
    if len(users) == 1 and users[0].name == "ge.split":
        split = users[0]
        axis = split.axis % rank
        if len(split.results) < 2 or len(set(split.sizes)) != 1:
            return None
        if t is not None and list(t.perm)[axis] != axis:
            return None  # the transpose moves the cut axis: the pieces are not the view's
        return axis, [split], list(split.results), list(t.perm) if t is not None else None
    if t is not None or len(users) < 2 or any(u.name != "ge.slice" or len(u.axes) != 1 for u in users):
        return None
    axis = users[0].axes[0] % rank
    dim = source.type.shape[axis]
    if dim is None or any(u.axes[0] % rank != axis or (u.steps is not None and list(u.steps) != [1]) for u in users):
        return None
    spans = sorted(((range(*slice(u.starts[0], u.ends[0]).indices(dim)), u) for u in users), key=lambda s: s[0].start)
    size = dim // len(users)
    if dim % len(users) or any(r.start != i * size or len(r) != size or r.step != 1
                               for i, (r, _) in enumerate(spans)):
        return None  # not a partition into equal runs
    return axis, [u for _, u in spans], [u.result for _, u in spans], None


def _bias(mm: Operation) -> Value | None:
    return mm.operands[2] if len(mm.operands) > 2 else None


class DeinterleaveQkvHeads(Pattern):
    """matmul -> view as heads of G interleaved pieces -> cut  ==>  matmul on reordered weight rows -> split."""

    # above qkv_merge (5), whose split on the last axis this makes, and split_heads (2), which then takes the
    # pieces' head transposes of a prefill
    NAME, ROOT, BENEFIT, EXPLAIN = "qkv_heads", "ge.reshape", 6, True

    def __init__(self, target: Target | None = None, resources: Mapping[str, np.ndarray] | None = None):
        self.resources = resources

    def match(self, view: Operation) -> Match | Miss | None:
        mm = defining(view.operands[0], *_MATMULS)
        r = view.result.type
        if mm is None or r is None or r.rank < 2:
            return None
        cut = _cut(view)
        if cut is None:
            return None  # not cut into equal pieces of one axis: nothing interleaved to undo
        axis, cutters, pieces, perm = cut
        y = mm.results[0].type
        n, tail = y.shape[-1], r.shape[axis:]
        if axis == r.rank - 1 and tail == (n,) and perm is None:
            return None  # already runs of the matmul's last axis
        if n is None or any(d is None for d in tail):
            return Miss(f"{named(view)} views {named(mm)} with a dynamic size at or after the cut axis {axis}")
        block = math.prod(tail)
        if n % block:
            return Miss(f"{named(view)} is not whole rows of heads of {named(mm)}: {block} elements a head "
                        f"do not divide its {n} output features")
        if len(mm.results[0].uses) != 1:
            return Miss(f"the result of {named(mm)} is also read besides {named(view)}: reordering it would change "
                        f"what the other reader sees")
        if mm.attributes.get("glu", "none") != "none":
            return Miss(f"{named(mm)} has a glu epilogue, which pairs its output features")
        if pieces[0].type.shape.count(None) > 1:
            return Miss(f"the pieces of {named(view)} have more than one dynamic size: not one reshape each")
        w = const_array(mm.operands[1], self.resources)
        if w is None or w.ndim != 2:
            owner = mm.operands[1].owner
            return Miss(f"the weight of {named(mm)} is {named(owner) if owner else 'an argument of the graph'}, "
                        f"not a constant matrix to reorder at compile time")
        b = None
        if _bias(mm) is not None:
            b = const_array(_bias(mm), self.resources)
            if b is None or (b.ndim and b.shape[-1] not in (1, n)):
                return Miss(f"the bias of {named(mm)} is not a constant of its output features")
        return Match(view, mm=mm, cutters=cutters, pieces=pieces, perm=perm, heads=n // block,
                     groups=len(pieces), w=w, b=b)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        mm, view = m.mm, m.root
        n = mm.results[0].type.shape[-1]
        run = n // m.groups  # a piece's features over all heads
        # new feature i*H*E + h*E + e reads old h*G*E + i*E + e
        order = np.arange(n).reshape(m.heads, m.groups, run // m.heads).transpose(1, 0, 2).reshape(-1)
        tb = mm.attributes.get("transpose_b", False)
        operands = [mm.operands[0], self._reordered(m.w, order, 0 if tb else 1, mm.operands[1], rw, mm)]
        if _bias(mm) is not None:
            bias = _bias(mm)
            operands.append(self._reordered(m.b, order, -1, bias, rw, mm) if m.b.ndim and m.b.shape[-1] == n
                            else bias)
        new = rw.create(mm.name, operands, dict(mm.attributes), [mm.results[0].type], before=mm)
        y = mm.results[0].type
        split = rw.create("ge.split", new.results, {"axis": -1, "sizes": [run] * m.groups},
                          [y.with_shape(y.shape[:-1] + (run,))] * m.groups, before=mm)
        values = []
        for piece, q in zip(m.pieces, split.results):
            t = piece.type
            shape = t.shape if m.perm is None else tuple(t.shape[p] for p in np.argsort(m.perm))
            v = rw.create("ge.reshape", [q], {"shape": [-1 if d is None else d for d in shape]},
                          [t.with_shape(shape)], before=mm).result
            if m.perm is not None:
                v = rw.create("ge.transpose", [v], {"perm": list(m.perm)}, [t], before=mm).result
            values.append(v)
        if len(m.cutters) == 1 and len(m.cutters[0].results) == len(values):
            rw.replace(m.cutters[0], values)
        else:
            for cutter, v in zip(m.cutters, values):
                rw.replace(cutter, [v])
        t = view.result.users()[0] if view.result.users() else None
        if t is not None and t.name == "ge.transpose":
            rw.erase(t)
        rw.erase(view)
        rw.erase(mm)

    def _reordered(self, arr: np.ndarray, order: np.ndarray, axis: int, old: Value, rw: Rewriter,
                   before: Operation) -> Value:
        """`arr` reordered along `axis` as a constant: a literal, or a new array of the weights archive."""
        if arr.size > 1 and not any(arr.strides):
            reordered = arr  # every element the same (a timing-only model's weights): any order is this one
        else:
            reordered = np.take(arr, order, axis=axis)
        value = old.owner.value
        if isinstance(value, DenseResourceAttr) and isinstance(self.resources, dict):
            key = f"{value.key}[qkv_heads]"
            self.resources[key] = reordered
            attr = DenseResourceAttr(key)
        else:
            attr = DenseAttr(np.ascontiguousarray(reordered))
        return rw.create("ge.const", [], {"value": attr}, [TensorType(reordered.shape, old.type.dtype)],
                         before=before).result
