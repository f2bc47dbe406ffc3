"""cse: merge ops that compute the same thing from the same operands."""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np

from geir.attributes import DenseAttr
from geir.ir import Graph, Module, Operation
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.traits import Terminator


def _dense_key(values: np.ndarray) -> Hashable:
    """A literal as the printer shows it: one whose elements are all equal (bit for bit) is a splat,
    so `dense<[1.0, 1.0]>` and `dense<1.0>` of one type merge, as they would once printed and parsed."""
    flat = values.reshape(-1)
    if values.ndim and flat.size:
        bits = flat.view(f"u{flat.dtype.itemsize}") if flat.dtype.kind == "f" else flat
        if np.all(bits == bits[0]):
            return ("dense", values.dtype.str, (), flat[:1].tobytes())
    return ("dense", values.dtype.str, values.shape, values.tobytes())


def _hashable(v: Any) -> Hashable:
    if isinstance(v, DenseAttr):
        return _dense_key(v.values)
    if isinstance(v, list):
        return ("list",) + tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return ("dict",) + tuple((k, _hashable(x)) for k, x in v.items())
    if isinstance(v, float):
        return ("float", v)  # 1.0 and 1 are different attributes
    return (type(v).__name__, v)


def op_key(op: Operation) -> Hashable:
    """What makes two ops interchangeable: name, operands, attributes and result types."""
    attrs = tuple(sorted((k, _hashable(v)) for k, v in op.attributes.items()))
    return (op.name, tuple(id(v) for v in op.operands), attrs, tuple(r.type for r in op.results))


def eliminate_common_subexpressions(graph: Graph) -> int:
    """Replace each op equal to an earlier one by that one; returns how many were merged."""
    seen: dict[Hashable, Operation] = {}
    merged = 0
    for op in graph.ops:
        if op.has_trait(Terminator):
            continue
        key = op_key(op)
        first = seen.get(key)
        if first is None:
            seen[key] = op
            continue
        for old, new in zip(op.results, first.results):
            old.replace_all_uses_with(new)
        graph.erase(op)
        merged += 1
    return merged


@register_pass("cse")
class CommonSubexpressionElimination(Pass):
    """Merge identical pure ops (including equal constants)."""

    def run(self, module: Module, ctx: PassContext) -> None:
        for g in module.graphs:
            eliminate_common_subexpressions(g)
