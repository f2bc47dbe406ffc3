"""tile: place each op on an engine, then ask each AI Core op's kernel for its tiling (the kernel's
TilingInterface), checked against the target's buffers. Ops the AI Core cannot take go to the AI CPU
(geir.passes.placement) and need no tiling."""

from __future__ import annotations

import attrs

from geir.diagnostics import Location
from geir.ir import Module, Operation
from geir.kernels import KERNELS
from geir.kernels.tiling import KernelTiling, Miss, OpSignature
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.placement import AICPU, ENGINE_ATTR, Unplaceable, place_op
from geir.target_npu.target import Target, load_target
from geir.traits import NoKernel


@attrs.frozen
class TilingDecision:
    """What the tile pass decided for one op: its tiling, or why it has none (`miss`)."""

    op: str  # the op's name without its dialect: "flash_attention"
    loc: Location
    tiling: KernelTiling | None
    miss: Miss | None = None

    def render(self) -> str:
        """The --explain remark (or, for an overflow, the error) this decision prints as."""
        if self.miss is None:
            return f"tile: {self.op} {self.tiling.rule}"
        if self.miss.overflow:
            return self.miss.reason
        return f"tile: {self.op} left untiled: {self.miss.reason}"


@register_pass("tile")
class Tile(Pass):
    """Place each op on the AI Core or the AI CPU; put `tiling = {...}` on each AI Core op.

    Tilings: FlashAttention templates, matmul blocks, vector tiles; ops placed on the AI CPU need none."""

    REQUIRES = ("infer-shapes",)
    target: str = ""  # empty: the context's --target
    buffers: int = 2

    def __attrs_post_init__(self) -> None:
        # checked when the pipeline is parsed: the pass manager reports a ValueError as a usage error
        if self.buffers not in (1, 2):
            raise ValueError(f"option 'buffers' must be 1 (single) or 2 (double buffering), not {self.buffers}")
        if self.target:
            try:
                load_target(self.target)
            except KeyError as e:  # TargetError: an unknown name or an invalid file, said in its message
                raise ValueError(f"option 'target': {e}") from None

    def run(self, module: Module, ctx: PassContext) -> None:
        chip = load_target(self.target or ctx.target)
        for graph in module.graphs:
            for op in graph.walk():
                if op.has_trait(NoKernel):
                    continue  # constants and the terminator become no task
                try:
                    placement = place_op(op, chip)
                except Unplaceable as e:
                    ctx.error(str(e), op.loc)
                    continue
                ctx.record(placement)
                if placement.engine == AICPU:
                    op.attributes[ENGINE_ATTR] = AICPU
                    op.attributes.pop("tiling", None)  # the AI CPU runs the op whole
                    ctx.remark(placement.render(), op.loc)
                    continue
                op.attributes.pop(ENGINE_ATTR, None)
                kernel = KERNELS[op.name]
                sig = OpSignature.of(op)
                if not kernel.needs_tiling(sig):
                    continue
                chosen = self._choose(op, sig, chip, ctx.tiling_memo)
                decision = TilingDecision(op.name.partition(".")[2], op.loc, None if isinstance(chosen, Miss) else chosen,
                                          chosen if isinstance(chosen, Miss) else None)
                ctx.record(decision)
                if decision.miss is not None and decision.miss.overflow:
                    ctx.error(decision.render(), op.loc)
                    continue
                if decision.miss is not None:
                    op.attributes.pop("tiling", None)
                else:
                    op.attributes["tiling"] = decision.tiling.to_attr()
                ctx.remark(decision.render(), op.loc)

    def _choose(self, op: Operation, sig: OpSignature, chip: Target, memo: dict | None) -> KernelTiling | Miss:
        """tile_op, remembered in `memo` by everything the choice depends on."""
        if memo is None:
            return tile_op(op, chip, self.buffers)
        key = (chip.name, self.buffers, sig.key)
        found = memo.get(key)
        if found is None:
            found = memo[key] = tile_op(op, chip, self.buffers)
        return found


def tile_op(op: Operation, chip: Target, buffers: int = 2) -> KernelTiling | Miss:
    """The tiling the op's kernel chooses for it, or why there is none."""
    sig = OpSignature.of(op)
    if any(t is None for t in sig.operands + sig.results):
        return Miss("its types are unknown")
    return KERNELS[op.name].choose(sig, chip, buffers)
