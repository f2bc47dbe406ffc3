"""GE's engine placement: each op runs on the AI Core (a tiled kernel) or on the AI CPU (its numpy semantics).

As CANN's GE asks the ops information library which engine takes an op (AiCoreEngine first, then
AiCpuEngine), the `tile` pass asks the op's AI Core kernel: an op no kernel implements, or whose
kernel refuses its operands (a dtype its units lack, f64 above all), is placed on the AI CPU, which
runs the op's own `compute` on the device's ARM cores. An op with neither a kernel nor numpy
semantics cannot run anywhere: that is an error at the op. The decision is a `Placement` record on
the pass context (what `--explain` prints) and `engine = "aicpu"` on the op in the IR (what `lower`
turns into an AI CPU launch); an op on the AI Core carries no mark.
"""

from __future__ import annotations

import attrs

from geir.diagnostics import Location
from geir.ir import Operation
from geir.kernels import KERNELS
from geir.kernels.tiling import OpSignature
from geir.ops.rt import ENGINES
from geir.runtime.aicpu import has_semantics
from geir.target_npu.target import Target

AICORE, AICPU = ENGINES
# the op attribute that records an AI CPU placement in the IR
ENGINE_ATTR = "engine"


class Unplaceable(ValueError):
    """An op no engine can run: no AI Core kernel takes it and it has no numpy semantics for the AI CPU."""


@attrs.frozen
class Placement:
    """Where GE placed one op, and why it is not on the AI Core when it is not."""

    op: str  # the op's name: "ge.add"
    node: str  # its first result's name, as GE names a node: "c"
    loc: Location
    engine: str  # AICORE or AICPU
    reason: str = ""  # empty on the AI Core

    def render(self) -> str:
        """The --explain remark of an AI CPU placement."""
        return f"place: {self.op} (%{self.node}) on the AI CPU: {self.reason}"


def place_op(op: Operation, chip: Target) -> Placement:
    """The engine that runs `op` on `chip` and why; Unplaceable when none can."""
    node = op.results[0].name if op.results and op.results[0].name else "?"
    kernel = KERNELS.get(op.name)
    if kernel is not None:
        refusal = kernel.refuses(OpSignature.of(op), chip)
        if refusal is None:
            return Placement(op.name, node, op.loc, AICORE)
        reason = f"its AI Core kernel refuses it: {refusal}"
    else:
        reason = f"no AI Core kernel implements {op.name}"
    if not has_semantics(op):
        raise Unplaceable(f"{op.name} (%{node}) cannot run: {reason}, and it has no numpy semantics for the AI CPU")
    if not chip.has_aicpu:
        raise Unplaceable(f"{op.name} (%{node}) cannot run: {reason}, and {chip.name} has no AI CPU engine "
                          f"(no [aicpu] table in its target file)")
    return Placement(op.name, node, op.loc, AICPU, reason)


def engine_of(op: Operation) -> str:
    """The engine the IR records for an op (AI Core unless it is marked for the AI CPU)."""
    return AICPU if op.attributes.get(ENGINE_ATTR) == AICPU else AICORE
