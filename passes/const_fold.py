"""const-fold: evaluate ops whose operands are all constants, with the reference semantics."""

from __future__ import annotations

import attrs

from geir.attributes import MAX_LITERAL_RANK, DenseAttr
from geir.ir import Graph, Module, Operation
from geir.ops.core import Const
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.pattern import Rewriter
from geir.reference import run_op
from geir.traits import Terminator


def foldable(op: Operation, max_elements: int) -> bool:
    """All operands are dense constants (an op without operands, ge.arange, always folds) and every result is
    static and small enough to materialise."""
    if isinstance(op, Const) or op.has_trait(Terminator):
        return False
    if not all(isinstance(v.owner, Const) and isinstance(v.owner.value, DenseAttr) for v in op.operands):
        return False
    for r in op.results:
        n = r.type.num_elements if r.type is not None else None
        if n is None or n > max_elements or r.type.rank > MAX_LITERAL_RANK:  # no literal could hold it
            return False
    return True


def fold_constants(graph: Graph, max_elements: int) -> int:
    """Replace every foldable op by constants, in order (so chains of them fold); returns the count."""
    rw = Rewriter(graph)
    folded = 0
    for op in graph.ops:
        if op.erased or not foldable(op, max_elements):
            continue
        args = [v.owner.compute() for v in op.operands]
        # run_op rounds each result to its dtype exactly as the unfolded op would produce it
        outs = run_op(op, args, result_types=[r.type for r in op.results])
        consts = [rw.create("ge.const", [], {"value": DenseAttr(a.copy() if a.base is not None else a)}, [r.type],
                            before=op) for a, r in zip(outs, op.results)]
        rw.replace(op, [c.result for c in consts])
        folded += 1
    for op in reversed(graph.ops):
        if isinstance(op, Const) and not op.result.uses:
            graph.erase(op)
    return folded


@register_pass("const-fold")
@attrs.define(kw_only=True)
class ConstFold(Pass):
    """Fold ops on constants into constants; results larger than `max_elements` stay unfolded."""

    REQUIRES = ("infer-shapes",)
    max_elements: int = 1 << 16

    def __attrs_post_init__(self) -> None:
        if self.max_elements < 0:
            raise ValueError(f"option 'max-elements' must be a count of elements (0 or more), not {self.max_elements}")

    def run(self, module: Module, ctx: PassContext) -> None:
        for g in module.graphs:
            fold_constants(g, self.max_elements)
