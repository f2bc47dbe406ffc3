"""layout: choose ND or NZ storage for cube operands and results, with ge.trans_data where formats meet.

The cube reads and writes matrices in the fractal NZ layout. Constants (weights) used only by
cube ops are stored in NZ: they are converted once, when the weights are prepared, not per run.
Activations are stored in NZ only on targets whose load path cannot convert ND to NZ on the fly;
there a chain of matmuls keeps its intermediates in NZ, and only ND consumers get a conversion.
Conversions that cancel out are removed. Values never change: trans_data is a storage change.
"""

from __future__ import annotations

import attrs

from geir.ir import Graph, Module, Operation, Value
from geir.ops.core import Const
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.canonicalize import TransDataPair
from geir.passes.pattern import Rewriter, apply_patterns_greedily
from geir.target_npu.target import check_target, load_target

CUBE_OPS = ("ge.matmul", "ge.fused_matmul")


def _nz_capable(v: Value) -> bool:
    return v.type is not None and v.type.rank >= 2


def wanted_input_format(op: Operation, i: int, nd2nz_on_load: bool) -> str | None:
    """The storage format `op` wants for operand i (None: it takes either)."""
    if op.name == "ge.trans_data":
        return None
    v = op.operands[i]
    if op.name in CUBE_OPS and i < 2 and _nz_capable(v):
        return "NZ" if isinstance(v.owner, Const) or not nd2nz_on_load else "ND"
    return "ND"


def produced_format(op: Operation, nd2nz_on_load: bool) -> str:
    """The storage format `op` writes its results in."""
    if op.name == "ge.trans_data":
        return op.dst_format
    if isinstance(op, Const):
        return op.result.type.format  # weights keep the format _retag_weights gave them
    if op.name in CUBE_OPS and not nd2nz_on_load and _nz_capable(op.result):
        return "NZ"
    return "ND"


def _retag_weights(graph: Graph, nd2nz_on_load: bool) -> None:
    """Constants whose every user wants NZ are stored in NZ: converted once, offline, not per run."""
    for op in graph.ops:
        if isinstance(op, Const) and op.result.uses and op.result.type.format != "NZ":
            wants = {wanted_input_format(u, i, nd2nz_on_load)
                     for u in op.result.users() for i, v in enumerate(u.operands) if v is op.result}
            if wants == {"NZ"}:
                op.result.type = attrs.evolve(op.result.type, format="NZ")


def assign_layouts(graph: Graph, nd2nz_on_load: bool) -> int:
    """Set every cube operand's and result's format and insert the conversions; returns how many were inserted."""
    _retag_weights(graph, nd2nz_on_load)
    rw = Rewriter(graph)
    converted: dict[tuple[int, str], Value] = {}
    inserted = 0
    for op in graph.ops:
        for i, v in enumerate(op.operands):
            want = wanted_input_format(op, i, nd2nz_on_load)
            if want is None or v.type is None or v.type.format == want:
                continue
            key = (id(v), want)
            if key not in converted:
                t = rw.create("ge.trans_data", [v], {"dst_format": want}, before=op)
                converted[key] = t.result
                inserted += 1
            op.set_operand(i, converted[key])
        if op.name == "ge.trans_data":
            continue
        fmt = produced_format(op, nd2nz_on_load)
        for r in op.results:
            if r.type is not None and r.type.format != fmt:
                r.type = attrs.evolve(r.type, format=fmt)
    return inserted


@register_pass("layout")
@attrs.define(kw_only=True)
class Layout(Pass):
    """Choose ND/NZ storage for cube ops on the target and insert (then cancel) trans_data."""

    REQUIRES = ("infer-shapes",)
    target: str = attrs.field(default="", validator=check_target)  # empty: the --target of the run

    def run(self, module: Module, ctx: PassContext) -> None:
        chip = load_target(self.target) if self.target else ctx.target
        nd2nz = chip.nd2nz_on_load
        for g in module.graphs:
            assign_layouts(g, nd2nz)
            apply_patterns_greedily(g, [TransDataPair()])
