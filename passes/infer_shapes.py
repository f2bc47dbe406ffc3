"""infer-shapes: give every result its type from its operands' types and its attributes."""

from __future__ import annotations

from geir.ir import Module
from geir.verifier import verify_graph
from geir.passes.pass_manager import Pass, PassContext, register_pass


@register_pass("infer-shapes")
class InferShapes(Pass):
    """Fill in result types (each op's shape rule; `?` dims propagate); bad shapes are errors at the op."""

    def run(self, module: Module, ctx: PassContext) -> None:
        for g in module.graphs:
            verify_graph(g, ctx.diagnostics.emit, fill_types=True)
