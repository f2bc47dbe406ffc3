"""const-fold: evaluate ops whose operands are all constants, with the reference semantics.

It also evaluates sizes: an op that reads only shapes (ge.dim, ge.shape_of) folds once they are
static, result types with `?` are inferred again as sizes become constants, and an op that takes
sizes from tensors becomes its static form once they are known (geir.traits.StaticForm). GE's
session runs this on each shape signature it binds (`fold_sizes`), so a dynamic-shape program's
size arithmetic is done when its shapes are known, and only that arithmetic.
"""

from __future__ import annotations

import attrs

from geir.attributes import MAX_LITERAL_RANK, DenseAttr
import numpy as np

from geir.builder import infer_result_types
from geir.diagnostics import Diagnostic, DiagnosticError
from geir.ir import Graph, Module, Operation, Value
from geir.opdef import ShapeError
from geir.ops.core import Const
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.pattern import Rewriter
from geir.reference import run_op
from geir.traits import ShapeOnly, StaticForm, Terminator
from geir.types import format_type, types_compatible


# the most elements an operand of a folded op may have (512 MiB of i64): beyond, the op stays unfolded
MAX_FOLD_OPERAND = 1 << 26


def _reads_static_shapes(op: Operation) -> bool:
    """An op that reads only its operands' shapes, and they are all static."""
    return op.has_trait(ShapeOnly) and all(v.type is not None and v.type.is_static for v in op.operands)


def foldable(op: Operation, max_elements: int) -> bool:
    """All operands are dense constants (an op without operands, ge.arange, always folds), or the op reads only
    static shapes, and every result is static and small enough to materialise."""
    if isinstance(op, Const) or op.has_trait(Terminator):
        return False
    if not _reads_static_shapes(op) and not all(isinstance(v.owner, Const) and isinstance(v.owner.value, DenseAttr)
                                                for v in op.operands):
        return False
    for r in op.results:
        n = r.type.num_elements if r.type is not None else None
        if n is None or n > max_elements or r.type.rank > MAX_LITERAL_RANK:  # no literal could hold it
            return False
    # the reference semantics may materialise a splat constant whole: a 2^40-element one would not fit the host
    # (an op that reads only shapes reads no elements)
    return _reads_static_shapes(op) or all((v.type.num_elements or 0) <= MAX_FOLD_OPERAND for v in op.operands)


def refine(op: Operation) -> None:
    """Infer again the result types that have `?` dims: sizes that became constants may now tell them."""
    if isinstance(op, Const) or all(r.type is None or r.type.is_static for r in op.results):
        return
    for r, t in zip(op.results, infer_result_types(op)):
        if r.type is None or types_compatible(r.type, t):
            r.type = t
        else:  # the graph said otherwise: keep its word and let the verifier report the contradiction
            continue


def _operand_array(v: Value) -> np.ndarray:
    """What a folded op reads of an operand: a constant's elements, or for a shape-reading op only the shape."""
    if isinstance(v.owner, Const):
        return v.owner.compute()
    return np.broadcast_to(np.zeros((), v.type.dtype.np), v.type.shape)  # a shape with no bytes behind it


def fold_constants(graph: Graph, max_elements: int, sizes_only: bool = False) -> int:
    """Replace every foldable op by constants and every size-taking op whose sizes are known by its static form,
    in order (so chains of them fold), refining `?` result types on the way; returns the count of ops replaced.

    With `sizes_only`, only size arithmetic folds: ops reading shapes, size-taking ops, and ops on what they
    computed.
    """
    rw = Rewriter(graph)
    folded = 0
    from_sizes: set[int] = set()  # values that size arithmetic computed (sizes_only)
    made: set[int] = set()  # ops a static form made, visited on the next round (they may fold in turn)
    changed = True
    while changed:
        changed = False
        for op in list(graph.ops):
            if op.erased:
                continue
            try:
                refine(op)
            except ShapeError as e:  # a size known now breaks a shape rule (a reshape that does not divide, ...)
                raise DiagnosticError(Diagnostic("error", str(e), op.loc)) from None
            if sizes_only and not (op.has_trait(ShapeOnly) or isinstance(op, StaticForm) or id(op) in made
                                   or any(id(v) in from_sizes for v in op.operands)):
                continue
            if foldable(op, max_elements):
                args = [_operand_array(v) for v in op.operands]
                # run_op rounds each result to its dtype exactly as the unfolded op would produce it
                outs = run_op(op, args, result_types=[r.type for r in op.results])
                new = [rw.create("ge.const", [], {"value": DenseAttr(a.copy() if a.base is not None else a)},
                                 [r.type], before=op).result for a, r in zip(outs, op.results)]
            elif isinstance(op, StaticForm):
                rw.builder.set_insertion_point_before(op)
                rw.builder.loc = op.loc
                try:
                    value = op.static_form(rw.builder)
                except ShapeError as e:  # constant indices out of range, found now that they are known
                    raise DiagnosticError(Diagnostic("error", f"{op.name}: {e}", op.loc)) from None
                if value is None:
                    continue
                new = [value]
                if value.owner is not None and value.owner is not op:
                    made.add(id(value.owner))
                changed = True
            else:
                continue
            from_sizes.update(id(v) for v in new)
            rw.replace(op, new)
            folded += 1
    for op in reversed(graph.ops):
        if isinstance(op, Const) and not op.result.uses:
            graph.erase(op)
    return folded


def fold_sizes(graph: Graph, max_elements: int = 1 << 16) -> None:
    """Evaluate a graph's size arithmetic once its argument shapes are bound; a DiagnosticError at the first op
    whose result still has a `?` dimension (a size it takes depends on tensor data, not on shapes)."""
    fold_constants(graph, max_elements, sizes_only=True)
    for op in graph.ops:
        for r in op.results:
            if r.type is not None and not r.type.is_static:
                raise DiagnosticError(Diagnostic(
                    "error", f"{op.name}: its result {format_type(r.type)} still has a run-time dimension once the "
                    f"inputs' shapes are bound: a size it takes depends on tensor data, not on shapes", op.loc))


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
