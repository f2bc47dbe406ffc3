"""fusion-guards: re-check the shape guards of fused ops once shapes are known; undo what fails.

GE runs this for every new shape signature of a dynamic graph (geir.session), before the
shape-dependent passes: a `ge.flash_attention` fused on `?` dims whose head dim or sequence
length the kernel cannot take at this shape is expanded back into primitive ops here, and only
that subgraph changes. Each undone fusion is an --explain remark with the guard's reason.
"""

from __future__ import annotations

import attrs

from geir.diagnostics import Location
from geir.ir import Module
from geir.passes.fusion.guards import FUSION_GUARDS
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.pattern import Rewriter


@attrs.frozen
class Unfusion:
    """A fused op expanded back into primitive ops for this shape, and the guard's reason."""

    op: str  # the fused op's name without its dialect: "flash_attention"
    loc: Location
    reason: str

    def render(self) -> str:
        return f"{self.op} unfused for this shape: {self.reason}"


@register_pass("fusion-guards")
class FusionGuards(Pass):
    """Expand fused ops whose shape guards fail on the known shapes (a remark says why)."""

    REQUIRES = ("infer-shapes",)

    def run(self, module: Module, ctx: PassContext) -> None:
        chip = ctx.target
        for graph in module.graphs:
            rw = Rewriter(graph)
            for op in list(graph.ops):
                guard = FUSION_GUARDS.get(op.name)
                if guard is None or any(v.type is None or None in v.type.shape for v in op.operands):
                    continue
                why = guard[0](op, chip)
                if why is not None:
                    undone = Unfusion(op.name.partition(".")[2], op.loc, why)
                    ctx.record(undone)
                    ctx.remark(undone.render(), op.loc)
                    guard[1](op, rw)
