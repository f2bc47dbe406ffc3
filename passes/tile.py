"""tile: choose a tiling for every op that becomes a kernel, checked against the target's buffers."""

from __future__ import annotations

from geir.ir import Module, Operation
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.tiling import (
    NO_KERNEL,
    FlashTiling,
    Tiling,
    TilingError,
    Untiled,
    choose_flash_tiling,
    choose_matmul_tiling,
    choose_vector_tiling,
)
from geir.target_npu.target import Target, available_targets, load_target


@register_pass("tile")
class Tile(Pass):
    """Put `tiling = {...}` on each kernel op: FlashAttention templates, matmul blocks, vector tiles."""

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
            except KeyError:
                raise ValueError(f"option 'target': unknown target '{self.target}' "
                                 f"(available: {', '.join(available_targets())})") from None

    def run(self, module: Module, ctx: PassContext) -> None:
        chip = load_target(self.target or ctx.target)
        for graph in module.graphs:
            for op in graph.walk():
                if op.name in NO_KERNEL and not _reshape_copies(op):
                    continue
                try:
                    tiling = self._tile(op, chip, ctx.tiling_memo)
                except Untiled as e:
                    op.attributes.pop("tiling", None)
                    ctx.remark(f"tile: {_short(op)} left untiled: {e}", op.loc)
                    continue
                except TilingError as e:
                    ctx.error(str(e), op.loc)
                    continue
                op.attributes["tiling"] = tiling.to_attr()
                ctx.remark(f"tile: {_short(op)} {tiling.rule}", op.loc)


    def _tile(self, op: Operation, chip: Target, memo: dict | None) -> FlashTiling | Tiling:
        """tile_op, remembered in `memo` by everything the choice depends on."""
        if memo is None:
            return tile_op(op, chip, self.buffers)
        key = (op.name, chip.name, self.buffers, tuple(str(v.type) for v in op.operands),
               tuple(str(r.type) for r in op.results),
               repr(sorted((k, v) for k, v in op.attributes.items() if k not in ("tiling", "mem_offset"))))
        found = memo.get(key)
        if found is None:
            try:
                found = tile_op(op, chip, self.buffers)
            except Untiled as e:
                found = e
            memo[key] = found
        if isinstance(found, Untiled):
            raise found
        return found


def _short(op: Operation) -> str:
    return op.name.partition(".")[2]


def _reshape_copies(op: Operation) -> bool:
    # a reshape is a view of ND data; of NZ fractals it is a real relayout
    return op.name == "ge.reshape" and any(v.type is not None and v.type.format != "ND" for v in op.operands)


def tile_op(op: Operation, chip: Target, buffers: int) -> FlashTiling | Tiling:
    """The tiling for one op (FlashTiling or Tiling); raises Untiled or TilingError."""
    types = [v.type for v in op.operands]
    results = [r.type for r in op.results]
    if any(t is None for t in types + results):
        raise Untiled("its types are unknown")
    if op.name == "ge.flash_attention":
        mask = types[3] if len(types) > 3 else None
        return choose_flash_tiling(types[0], types[1], types[2], bool(op.attr("causal")), mask is not None, chip,
                                   buffers, layout=op.attr("layout"),
                                   mask_itemsize=None if mask is None else mask.dtype.itemsize)
    if op.name in ("ge.matmul", "ge.fused_matmul"):
        epilogue = len(types) > 2 or op.attributes.get("activation", "none") != "none"
        return choose_matmul_tiling(types[0], types[1], chip, buffers, epilogue=epilogue,
                                    transpose_a=bool(op.attr("transpose_a")), transpose_b=bool(op.attr("transpose_b")))
    return choose_vector_tiling(op.name, types, results, chip, buffers, op.attributes)
