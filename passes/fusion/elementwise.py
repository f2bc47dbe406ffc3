"""Chains of elementwise ops become one `ge.fused_elementwise` vector kernel.

Rooted at the end of a chain (an elementwise op whose result does not feed exactly one other
elementwise op); it takes in every producer that is elementwise and used only inside the chain.
"""

from __future__ import annotations

from geir.ir import Operation, Value
from geir.ops.fused import chainable, chainable_ops
from geir.passes.pattern import Match, Pattern, Rewriter


def _feeds_one_elementwise(op: Operation) -> bool:
    users = op.result.users()
    return len(users) == 1 and chainable(users[0]) and len(op.result.uses) == 1


class FuseElementwiseChain(Pattern):
    """Elementwise producers used only by the chain fold into one vector kernel."""

    NAME, ROOT, BENEFIT, EXPLAIN = "elementwise", chainable_ops(), 1, True

    def match(self, root: Operation) -> Match | None:
        if _feeds_one_elementwise(root):
            return None  # not the end of its chain; the op it feeds is the root
        steps: list[Operation] = []
        seen: set[int] = set()

        def visit(op: Operation) -> None:
            # post-order: producers first, so every step's arguments are defined before it
            seen.add(id(op))
            for v in op.operands:
                p = v.owner
                if p is not None and id(p) not in seen and chainable(p) and _feeds_one_elementwise(p):
                    visit(p)
            steps.append(op)

        visit(root)
        if len(steps) < 2:
            return None  # a lone op is already one kernel
        return Match(root, steps=steps)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        inputs: list[Value] = []
        index: dict[int, int] = {}
        for op in m.steps:
            for v in op.operands:
                if v.owner not in m.steps and id(v) not in index:
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
