"""Horizontal matmul merge: sibling matmuls that read the same input (attention's q, k and v projections) become
one matmul on the concatenated weights, followed by a `ge.split` of its result into the pieces each read.

One launch streams the input once instead of three times and fills the cube with the wider N. The weights (and
biases) must be constants, and are concatenated here, at compile time: a `dense<...>` literal becomes a new
literal, a `dense_resource<...>` weight a new array of the module's weights archive (named by the keys it joins).
A weight computed at run time is a miss, deliberately: concatenating it every run moves all the weight bytes
again, more than the merge saves.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from geir.attributes import DenseAttr, DenseResourceAttr
from geir.ir import Operation, Value
from geir.passes.fusion.match import const_array, named
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.target_npu.target import Target
from geir.types import TensorType

_MATMULS = ("ge.matmul", "ge.fused_matmul")


def _bias(mm: Operation) -> Value | None:
    return mm.operands[2] if len(mm.operands) > 2 else None


def _why_apart(root: Operation, other: Operation) -> str | None:
    """Why `other` cannot share one launch with `root` (both read the same input), or None."""
    for key, default in (("transpose_a", False), ("transpose_b", False), ("activation", "none")):
        mine, theirs = root.attributes.get(key, default), other.attributes.get(key, default)
        if mine != theirs:
            return f"{named(other)} has {key} = {str(theirs).lower()}, this one {str(mine).lower()}"
    if (_bias(root) is None) != (_bias(other) is None):
        return f"{named(other if _bias(other) is None else root)} has no bias and the other has one"
    b, ob = root.operands[1].type, other.operands[1].type
    if b.dtype != ob.dtype:
        return f"the weight of {named(other)} is {ob.dtype}, this one's {b.dtype}"
    if ob.rank != 2:
        return f"the weight of {named(other)} is {ob}, not a matrix shared by the batch"
    k = 1 if root.attributes.get("transpose_b", False) else 0
    if ob.shape[k] != b.shape[k]:
        return f"the weight of {named(other)} is {ob}, with another contraction length than {b}"
    return None


class MergeSiblingMatmuls(Pattern):
    """matmul(x, w1), matmul(x, w2), ... -> split(matmul(x, concat(w1, w2, ...)))."""

    # below the epilogue rule (10): the bias adds and activations are in the matmuls by the time this runs
    NAME, ROOT, BENEFIT, EXPLAIN = "qkv_merge", _MATMULS, 5, True

    def __init__(self, target: Target | None = None, resources: Mapping[str, np.ndarray] | None = None):
        self.resources = resources

    def match(self, mm: Operation) -> Match | Miss | None:
        x = mm.operands[0]
        others = [u for u in x.users() if u is not mm and u.name in _MATMULS and u.operands[0] is x]
        if not others:
            return None  # the only matmul on its input
        w = mm.operands[1]
        if w.type.rank != 2:
            return Miss(f"the weight of {named(mm)} is {w.type}, not a matrix shared by the batch")
        group, apart = [mm], []
        for o in others:
            why = _why_apart(mm, o)
            (apart if why else group).append(why or o)
        if len(group) == 1:
            return Miss(apart[0])
        weights, biases = [], []
        for o in group:
            for what, v, into in (("weight", o.operands[1], weights), ("bias", _bias(o), biases)):
                if v is None:
                    continue
                arr = const_array(v, self.resources)
                if arr is None:
                    return Miss(self._not_constant(what, o, v))
                into.append(arr)
        return Match(mm, group=group, weights=weights, biases=biases)

    def _not_constant(self, what: str, mm: Operation, v: Value) -> str:
        owner = v.owner
        if owner is not None and isinstance(getattr(owner, "value", None), DenseResourceAttr):
            return (f"the {what} of {named(mm)} is dense_resource<\"{owner.value.key}\">, whose array is not at hand "
                    f"to concatenate at compile time")
        source = "an argument of the graph" if owner is None else f"computed at run time by {named(owner)}"
        return f"the {what} of {named(mm)} is {source}: concatenating it every run would move all the weights again"

    def _constant(self, arr: np.ndarray, parts: list[Value], t: TensorType, rw: Rewriter, before: Operation) -> Value:
        """The concatenated array as a constant: a literal, or a new array of the weights archive when a part is one."""
        keys = [p.owner.value.key for p in parts if isinstance(p.owner.value, DenseResourceAttr)]
        if keys and isinstance(self.resources, dict):
            key = "+".join(p.owner.value.key if isinstance(p.owner.value, DenseResourceAttr) else "dense" for p in parts)
            self.resources[key] = arr
            value = DenseResourceAttr(key)
        else:
            value = DenseAttr(arr)
        return rw.create("ge.const", [], {"value": value}, [t], before=before).result

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        order = {id(op): i for i, op in enumerate(rw.graph.ops)}
        # the group in graph order, each matmul's weight and bias (gathered in match order) kept beside it, so the
        # concatenation's pieces are the split's
        perm = sorted(range(len(m.group)), key=lambda i: order[id(m.group[i])])
        group = [m.group[i] for i in perm]
        weights = [m.weights[i] for i in perm]
        biases = [m.biases[i] for i in perm] if m.biases else []
        first = group[0]
        tb = first.attributes.get("transpose_b", False)
        sizes = [o.results[0].type.shape[-1] for o in group]
        w = _concatenate(weights, axis=0 if tb else 1)
        wt = first.operands[1].type
        operands = [first.operands[0],
                    self._constant(w, [o.operands[1] for o in group], TensorType(w.shape, wt.dtype), rw, first)]
        if biases:
            b = np.concatenate([np.broadcast_to(a, a.shape[:-1] + (n,)).reshape(-1) if a.ndim else np.full(n, a)
                                for a, n in zip(biases, sizes)])
            operands.append(self._constant(b, [_bias(o) for o in group],
                                           TensorType(b.shape, _bias(first).type.dtype), rw, first))
        merged = rw.create(first.name, operands, dict(first.attributes), before=first)
        split = rw.create("ge.split", merged.results, {"axis": -1, "sizes": sizes},
                          [o.results[0].type for o in group], before=first)
        for o, piece in zip(group, split.results):
            rw.replace(o, [piece])


def _concatenate(arrays: list[np.ndarray], axis: int) -> np.ndarray:
    """np.concatenate, except that arrays that all broadcast one and the same element (zero strides: a timing-only
    model's weights) stay a broadcast of it: the merged weight of a LLaMA-7B layer would otherwise take 280 MB."""
    first = arrays[0]
    if all(a.size > 1 and not any(a.strides) and a.dtype == first.dtype and a.flat[0] == first.flat[0]
           for a in arrays):
        shape = list(first.shape)
        shape[axis] = sum(a.shape[axis] for a in arrays)
        return np.broadcast_to(np.array(first.flat[0], dtype=first.dtype), tuple(shape))
    return np.concatenate(arrays, axis=axis)
