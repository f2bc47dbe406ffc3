"""Chains of elementwise ops become one `ge.fused_elementwise` vector kernel.

Rooted at the end of a chain (an elementwise op whose result does not feed exactly one other
elementwise op); it takes in every producer that is elementwise and used only inside the chain, and a
producer broadcast into it (fewer elements than the chain's result) that only elementwise ops use: each of
their chains recomputes it, a pass over a few elements, rather than launching it alone (the all-masked-rows
flag SDPA's import computes once per step and every layer's select reads).
A step on an element type no AI Core unit computes (f64) is left out: the fused op is an AI Core
vector kernel, and GE places such an op on the AI CPU on its own.
"""

from __future__ import annotations

from geir.ir import Operation, Value
from geir.ops.fused import chainable, chainable_ops
from geir.passes.pattern import Match, Pattern, Rewriter
from geir.target_npu.target import AICORE_DTYPES


def _on_aicore(op: Operation) -> bool:
    """Whether every operand and result of `op` has an element type the AI Core computes."""
    return all(v.type is None or v.type.dtype.value in AICORE_DTYPES for v in (*op.operands, *op.results))


def _chainable(op: Operation) -> bool:
    return chainable(op) and _on_aicore(op)


def _feeds_one_elementwise(op: Operation) -> bool:
    users = op.result.users()
    return len(users) == 1 and _chainable(users[0]) and len(op.result.uses) == 1


# The most steps one fused vector kernel takes: its tiling keeps an f32 working copy of the tile per
# step in UB (kernels/vector_tiling.py), so a longer body would shrink the tile below a useful size
# (at 32 steps an f16 tile is still over 1000 elements). A longer chain becomes several kernels.
MAX_STEPS = 32


def _recomputed(op: Operation, root: Operation) -> bool:
    """Whether `op`, used by several elementwise ops, is broadcast into the chain of `root` (fewer elements than its
    result), so each chain that reads it recomputes it."""
    n, total = op.result.type.num_elements, root.result.type.num_elements
    return (n is not None and total is not None and n < total and len(op.result.uses) > 1
            and all(_chainable(u) for u in op.result.users()))


def _post_order(root: Operation) -> list[Operation]:
    """The chain ending at `root` (at most MAX_STEPS ops, the nearest to it), producers first.

    Iterative: exported models have chains thousands of ops long, deeper than Python's recursion.
    """
    steps: list[Operation] = []
    seen = {id(root)}
    stack: list[tuple[Operation, int]] = [(root, 0)]
    while stack:
        op, i = stack.pop()
        if i < len(op.operands):
            stack.append((op, i + 1))
            p = op.operands[i].owner
            if (p is not None and id(p) not in seen and len(seen) < MAX_STEPS and _chainable(p)
                    and (_feeds_one_elementwise(p) or _recomputed(p, root))):
                seen.add(id(p))
                stack.append((p, 0))
        else:
            steps.append(op)
    return steps


class FuseElementwiseChain(Pattern):
    """Elementwise producers used only by the chain fold into one vector kernel."""

    NAME, ROOT, BENEFIT, EXPLAIN = "elementwise", chainable_ops(), 1, True

    def match(self, root: Operation) -> Match | None:
        if not _on_aicore(root) or _feeds_one_elementwise(root):
            return None  # not the end of its chain; the op it feeds is the root
        steps = _post_order(root)
        if len(steps) < 2:
            return None  # a lone op is already one kernel
        return Match(root, steps=steps)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        inputs: list[Value] = []
        index: dict[int, int] = {}
        in_chain = {id(op) for op in m.steps}
        for op in m.steps:
            for v in op.operands:
                if id(v.owner) not in in_chain and id(v) not in index:
                    index[id(v)] = len(inputs)
                    inputs.append(v)
        body = []
        for j, op in enumerate(m.steps):
            step = {"op": op.name, "args": [index[id(v)] for v in op.operands]}
            if op.attributes:
                step["attrs"] = dict(op.attributes)
            body.append(step)
            index[id(op.result)] = len(inputs) + j
        fused = rw.create("ge.fused_elementwise", inputs, {"body": body}, [m.root.result.type], before=m.root)
        rw.replace(m.root, fused)
