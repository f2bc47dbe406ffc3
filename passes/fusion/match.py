"""Small matchers the fusion rules share: who defines a value, who uses it, constant values."""

from __future__ import annotations

import heapq
import math

import numpy as np

from typing import Mapping

from geir.attributes import DenseAttr, DenseResourceAttr
from geir.ir import Graph, Operation, Value
from geir.ops.core import Const


def defining(v: Value | None, *names: str) -> Operation | None:
    """The op that defines `v` when it is one of `names`, else None."""
    op = v.owner if v is not None else None
    return op if op is not None and op.name in names else None


def used_only_by(v: Value, *ops: Operation) -> bool:
    """Every use of `v` is by one of `ops`."""
    return all(any(u is o for o in ops) for u in v.uses)


def const_array(v: Value, resources: Mapping[str, np.ndarray] | None = None) -> np.ndarray | None:
    """The value of a `dense<...>` constant (in its own dtype), or of a `dense_resource<...>` one found in
    `resources` (the module's weights), else None."""
    op = v.owner
    if not isinstance(op, Const) or v.type is None:
        return None
    if isinstance(op.value, DenseAttr):
        return op.value.to_array(v.type)
    if isinstance(op.value, DenseResourceAttr) and resources is not None and op.value.key in resources:
        arr = np.asarray(resources[op.value.key])
        return arr.astype(v.type.dtype.np, copy=False) if arr.shape == v.type.shape else None
    return None


def scalar_constant(v: Value) -> float | None:
    """The number held by a constant with a single element (any rank of ones, or a splat of one element)."""
    arr = const_array(v)
    if arr is None or arr.size != 1:
        return None
    return float(np.asarray(arr, dtype=np.float64).reshape(()))


def close(a: float | None, b: float, rel: float = 2e-3) -> bool:
    """Equal up to the rounding a half-precision constant suffers."""
    return a is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def is_last_axis(axes: list[int], rank: int) -> bool:
    return len(axes) == 1 and rank > 0 and axes[0] % rank == rank - 1


def named(op: Operation) -> str:
    """An op as a remark names it: its kind and its first result's name (`ge.add %h`)."""
    value = op.results[0].name if op.results else None
    return f"{op.name} %{value}" if value else op.name


def reaches(start: Operation, target: Operation) -> bool:
    """Whether `target` is among the ops `start` is computed from."""
    seen, todo = set(), [start]
    while todo:
        op = todo.pop()
        for v in op.operands:
            p = v.owner
            if p is target:
                return True
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                todo.append(p)
    return False


def restore_order(graph: Graph) -> None:
    """Reorder the ops (stably, by their places) so that each comes after what it reads: after two ops merge into
    one launch at the later one's place, users of the earlier one's results that sat between move after it."""
    ops = graph.ops
    index = {id(op): i for i, op in enumerate(ops)}
    waiting = [sum(1 for v in {id(v): v for v in op.operands}.values() if v.owner is not None and id(v.owner) in index)
               for op in ops]
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order: list[Operation] = []
    while ready:
        op = ops[heapq.heappop(ready)]
        order.append(op)
        for user in {id(u): u for r in op.results for u in r.users()}.values():
            j = index.get(id(user))
            if j is None:
                continue
            waiting[j] -= sum(1 for v in {id(v): v for v in user.operands}.values() if v.owner is op)
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) == len(ops) and any(a is not b for a, b in zip(order, ops)):
        graph.ops = order
