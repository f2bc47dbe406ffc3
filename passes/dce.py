"""dce: erase ops whose results nobody uses."""

from __future__ import annotations

from geir.ir import Graph, Module
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.pattern import is_trivially_dead


def eliminate_dead_ops(graph: Graph) -> int:
    """Erase dead ops in one backward sweep (erasing an op may kill its producers); returns the count."""
    erased = 0
    for op in reversed(graph.ops):
        if is_trivially_dead(op):
            graph.erase(op)
            erased += 1
    return erased


@register_pass("dce")
class DeadCodeElimination(Pass):
    """Remove every op whose results are unused (all ge ops are free of side effects)."""

    def run(self, module: Module, ctx: PassContext) -> None:
        for g in module.graphs:
            eliminate_dead_ops(g)
