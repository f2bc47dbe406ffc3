"""The gather kernel's tiling: `rows` gathered rows of `cols` elements per vector unit, with their indices.

A gather with run-time indices (`ge.gather`, an embedding lookup) copies whole rows of its table: output
row r (of `outer x indices` rows) is the table's row `indices[r % n]` of its `r // n`-th leading slab,
`inner` elements long. A tile holds the tile's indices and its rows in UB, each row in whole UB blocks
(every row lands by a DMA of its own, on a 32-byte boundary), double-buffered; a row longer than UB
holds is cut into pieces of `cols` elements.
"""

from __future__ import annotations

import attrs

from geir.kernels.tiling import (
    Budget,
    OpSignature,
    RowBlockTiling,
    TilingError,
    Untiled,
    align,
    check_buffers,
    halve,
    product,
)
from geir.ops.numerics import normalize_axis
from geir.target_npu.target import Target

GATHER = "Gather"


@attrs.frozen(kw_only=True)
class GatherTiling(RowBlockTiling):
    """`rows` gathered rows (or pieces of `cols` elements of them) and their indices per vector unit."""

    TEMPLATES = (GATHER,)


@attrs.frozen
class GatherShape:
    """A gather as rows: `outer` leading slabs of `dim` table rows of `inner` elements; `n` indices."""

    outer: int | None
    dim: int | None
    inner: int | None
    n: int | None

    @property
    def rows(self) -> int | None:
        """Output rows: one per (slab, index)."""
        return None if self.outer is None or self.n is None else self.outer * self.n


def gather_shape(sig: OpSignature) -> GatherShape:
    """The row view of a gather signature (dims None where dynamic)."""
    table, indices = sig.operands[0], sig.operands[1]
    axis = normalize_axis(sig.attr("axis", 0), table.rank)
    return GatherShape(product(table.shape[:axis]), table.shape[axis], product(table.shape[axis + 1:]),
                       product(indices.shape))


def _ub(rows: int, cols: int, itemsize: int, index_size: int, buffers: int, block: int) -> int:
    # per buffer: the tile's indices, and each row in whole UB blocks
    return buffers * (align(rows * index_size, block) + rows * align(cols * itemsize, block))


def _sizes(sig: OpSignature) -> tuple[int, int]:
    return sig.operands[0].dtype.itemsize, sig.operands[1].dtype.itemsize


def choose_gather_tiling(sig: OpSignature, chip: Target, buffers: int = 2) -> GatherTiling:
    """Whole rows when one fits UB (else the largest piece of whole UB blocks that does), as many rows a tile
    as fit and the vector units can share."""
    check_buffers(buffers)
    if any(t is None for t in sig.operands + sig.results):
        raise Untiled("its types are unknown")
    g = gather_shape(sig)
    if g.inner is None:
        raise Untiled("the gathered rows' length is dynamic")
    isz, xsz = _sizes(sig)
    ub, block, vcores = chip.buffer_bytes("ub"), chip.memory.ub_block_bytes, chip.vector_cores
    cols = max(g.inner, 1)
    if _ub(1, cols, isz, xsz, buffers, block) > ub:  # a row longer than UB holds: pieces of whole UB blocks
        per_block = max(block // isz, 1)
        cols = ((ub // buffers - align(xsz, block)) // block) * per_block
        if cols < per_block:
            raise TilingError(f"no gather tiling fits {chip.name}: one UB block of a row and its index need "
                              f"{_ub(1, per_block, isz, xsz, buffers, block)} bytes of UB, which holds {ub}")
    fit = 1
    while _ub(fit * 2, cols, isz, xsz, buffers, block) <= ub:
        fit *= 2
    step = fit
    while step > 1:  # the largest count that fits, between fit and 2 * fit
        step //= 2
        if _ub(fit + step, cols, isz, xsz, buffers, block) <= ub:
            fit += step
    rows = fit if g.rows is None else max(1, min(fit, -(-g.rows // vcores)))
    tiling = _tiling(rows, cols, buffers, g, sig, chip, "")
    pieces = -(-max(g.inner, 1) // cols)
    work = tiling.work_units
    rule = (f"{rows} rows of {cols} elements a tile" + (f" ({pieces} pieces a row: a row needs more than UB holds)"
                                                         if pieces > 1 else "")
            + f"; {'an unknown number of' if work is None else work} work units over {tiling.cores} cores")
    return attrs.evolve(tiling, rule=rule)


def _tiling(rows: int, cols: int, buffers: int, g: GatherShape, sig: OpSignature, chip: Target,
            rule: str) -> GatherTiling:
    isz, xsz = _sizes(sig)
    block = chip.memory.ub_block_bytes
    pieces = -(-max(g.inner or 1, 1) // cols)
    work = None if g.rows is None else -(-g.rows // rows) * pieces
    cores = chip.vector_cores if work is None else max(min(work, chip.vector_cores), 1)
    return GatherTiling(template=GATHER, rows=rows, cols=cols, buffers=buffers, cores=cores,
                        ub_bytes=_ub(rows, cols, isz, xsz, buffers, block), work_units=work, rule=rule)


def gather_budget(tiling: GatherTiling, sig: OpSignature, chip: Target) -> Budget:
    """One vector unit's UB for a gather tile: its indices and `rows` row slots, per buffer."""
    isz, xsz = _sizes(sig)
    return Budget(_ub(tiling.rows, max(tiling.cols, 1), isz, xsz, tiling.buffers,
                      chip.memory.ub_block_bytes), 0, 0, 0, 0)


def shrink_gather(tiling: GatherTiling) -> tuple[GatherTiling, str] | None:
    """Half the rows a tile: each row is still copied whole, bit-identical."""
    return halve(tiling, "rows", 1)


def gather_candidates(sig: OpSignature, chip: Target, buffers: int = 2) -> list[GatherTiling]:
    """Row counts that cut the rows into a power of two of pieces, or into pieces for every vector unit (once,
    twice, four times over), at the rule's row length; largest first."""
    try:
        chosen = choose_gather_tiling(sig, chip, buffers)
    except (Untiled, TilingError):
        return []
    g = gather_shape(sig)
    if g.rows is None:
        return []
    isz, xsz = _sizes(sig)
    block, ub = chip.memory.ub_block_bytes, chip.buffer_bytes("ub")
    pieces = {1 << i for i in range(max(g.rows, 1).bit_length())} | {chip.vector_cores * m for m in (1, 2, 4)}
    counts = {max(1, -(-g.rows // p)) for p in pieces}
    fits = sorted((r for r in counts if _ub(r, chosen.cols, isz, xsz, buffers, block) <= ub), reverse=True)
    return [_tiling(r, chosen.cols, buffers, g, sig, chip, f"candidate {r} rows a tile") for r in fits]
