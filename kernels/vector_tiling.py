"""The vector kernels' tilings: flat UB chunks (elementwise ops and copies) and whole rows (row-wise ops).

One buffer model serves the choice and the kernels: operands smaller than the tile's tensors
(broadcast scalars, gamma/beta, bias rows) are loaded once and stay resident in UB; everything
else streams through it, double-buffered, with an f32 working copy where 16-bit floats are
computed. A row-wise op keeps whole rows (of the reduced axes) in UB, in segments when one row
does not fit.
"""

from __future__ import annotations

from typing import Any

import attrs

from geir.opdef import lookup
from geir.kernels.tiling import (
    F32_BYTES,
    Budget,
    KernelTiling,
    Miss,
    OpSignature,
    RowBlockTiling,
    TilingError,
    Untiled,
    align,
    check_buffers,
    halve,
    never_printed,
    product,
    units_worth_starting,
)
from geir.target_npu.target import Target
from geir.types import DType, TensorType

ELEMENTWISE, ROW, SCAN = "VectorElementwise", "VectorRow", "VectorScan"
COPY_TEMPLATES = ("DataCopy", "TransData", "VectorTranspose", "ScatterUpdate")
SMALLEST_CHUNK = 32  # elements: the least a shrunk flat tile keeps


@attrs.frozen(kw_only=True)
class VectorTiling(KernelTiling):
    """A flat tile of `elems` elements per vector unit (elementwise ops, fused chains and copies)."""

    TEMPLATES = (ELEMENTWISE, *COPY_TEMPLATES)

    template: str
    elems: int
    buffers: int
    cores: int
    ub_bytes: int
    work_units: int | None = never_printed(None)
    rule: str = never_printed("")

    @property
    def blocks(self) -> dict[str, int]:
        return {"elems": self.elems}


@attrs.frozen(kw_only=True)
class RowTiling(RowBlockTiling):
    """`rows` whole rows of `cols` elements per vector unit, each row in `segments` pieces of `cols`."""

    TEMPLATES = (ROW,)

    segments: int


@attrs.frozen(kw_only=True)
class ScanTiling(RowBlockTiling):
    """A running sum's tile: `rows` steps along the scanned axis of `cols` independent sums per vector unit."""

    TEMPLATES = (SCAN,)


def reduced_axes(name: str, attributes: dict[str, Any], rank: int) -> tuple[int, ...]:
    """The axes a row-wise op reduces over (its row), as the op declares them (RowWise's `row_axes`)."""
    return lookup(name).row_axes(attributes, rank)


def _row_extent(name: str, x: TensorType, attributes: dict[str, Any]) -> tuple[int | None, int | None]:
    """(rows, row length) of a row-wise op: the row is what one output element (or row) reduces over."""
    axes = reduced_axes(name, attributes, x.rank)
    row = product(tuple(x.shape[i] for i in axes))
    rows = product(tuple(d for i, d in enumerate(x.shape) if i not in axes))
    return rows, row


@attrs.frozen
class _Streams:
    """The UB use of one vector op: resident bytes, bytes per streamed element, the largest tensor's size."""

    fixed: int
    per_elem: int
    total: int | None


def _streams(sig: OpSignature, chip: Target, buffers: int, copy: bool) -> _Streams:
    block, ub = chip.memory.ub_block_bytes, chip.buffer_bytes("ub")
    operands, results = list(sig.operands), list(sig.results)
    data = operands + results
    sizes = [product(t.shape) for t in data]
    total = None if None in sizes else max(sizes, default=1)
    resident = [t for t, n in zip(operands, sizes) if total is not None and n < total and t.nbytes * 8 <= ub]
    fixed = sum(align(t.nbytes, block) for t in resident)
    streamed = [t for t in data if not any(t is r for r in resident)]
    # Bytes per streamed element: each operand and result slice, double-buffered so MTE2/MTE3 move
    # the next tile while the vector unit works, plus an f32 working copy when 16-bit floats are
    # computed (one per step of a fused chain: a conservative bound, no reuse). Copies move each
    # element once in and once out, however many pieces they cut or join.
    if copy:
        per_elem = 2 * operands[0].dtype.itemsize * buffers
    else:
        per_elem = sum(t.dtype.itemsize for t in streamed) * buffers
        steps = len(sig.attr("body", ())) or any(t.dtype in (DType.f16, DType.bf16) for t in data)
        per_elem += F32_BYTES * steps
    return _Streams(fixed, per_elem, total)


def choose_elementwise_tiling(sig: OpSignature, chip: Target, buffers: int = 2,
                              template: str = ELEMENTWISE) -> VectorTiling:
    """A flat UB chunk in whole UB blocks, spread over the vector units (copies: `template` names the copy)."""
    check_buffers(buffers)
    _check_types(sig)
    ub, block, vcores = chip.buffer_bytes("ub"), chip.memory.ub_block_bytes, chip.vector_cores
    s = _streams(sig, chip, buffers, template in COPY_TEMPLATES)
    # a flat chunk in whole UB blocks for every dtype (block elements is a multiple of 32 bytes at 1 byte and up)
    fit = ((ub - s.fixed) // s.per_elem) // block * block
    if fit < block:
        raise TilingError(f"no {sig.name[3:]} tiling fits {chip.name}: {block} elements need "
                          f"{s.fixed + block * s.per_elem} bytes of UB, which holds {ub}")
    units = units_worth_starting(chip, _moved_bytes(sig), vcores)
    elems = fit if s.total is None else max(block, min(fit, align(-(-s.total // units), block)))
    tiling = _flat(template, elems, buffers, s, chip, "")
    work = tiling.work_units
    rule = (f"{elems} elements a tile, {s.per_elem} UB bytes each with {buffers} buffers; "
            f"{'an unknown number of' if work is None else work} work units over {tiling.cores} cores")
    return attrs.evolve(tiling, rule=rule + _fewer(units, vcores, chip))


def _moved_bytes(sig: OpSignature) -> int | None:
    """Bytes a vector op streams through GM: its operands and results, where their sizes are known."""
    sizes = [t.nbytes for t in list(sig.operands) + list(sig.results) if t is not None]
    return None if any(n is None for n in sizes) else sum(sizes)


def _fewer(units: int, vcores: int, chip: Target) -> str:
    """The rule's reason for leaving vector units idle, if it does."""
    if units >= vcores:
        return ""
    head_us = chip.head_cycles(1) / chip.clock_hz * 1e6
    return (f" (of {vcores} vector units: each more would cost {head_us:.2f} us of launch head, more than its "
            f"share of the bytes saves)")


def _flat(template: str, elems: int, buffers: int, s: _Streams, chip: Target, rule: str) -> VectorTiling:
    work = None if s.total is None else -(-s.total // elems)
    cores = chip.vector_cores if work is None else min(work, chip.vector_cores)
    return VectorTiling(template=template, elems=elems, buffers=buffers, cores=cores,
                        ub_bytes=s.fixed + elems * s.per_elem, work_units=work, rule=rule)


def choose_row_tiling(sig: OpSignature, chip: Target, buffers: int = 2) -> RowTiling:
    """Whole rows in UB (segmented when one row cannot fit), as many a tile as fit and the units can share."""
    check_buffers(buffers)
    _check_types(sig)
    ub, block, vcores = chip.buffer_bytes("ub"), chip.memory.ub_block_bytes, chip.vector_cores
    s = _streams(sig, chip, buffers, False)
    rows, row = _row_extent(sig.name, sig.operands[0], sig.attributes)
    if row is None:
        raise Untiled("the reduced extent is dynamic, and a row must fit in UB")
    segments, seg_len = 1, row
    while _row_bytes(seg_len, s, block) + s.fixed > ub:
        if seg_len <= block:
            need = s.fixed + _row_bytes(seg_len, s, block)
            raise TilingError(f"no {sig.name[3:]} tiling fits {chip.name}: even a {seg_len}-element piece of a row "
                              f"needs {need} bytes of UB, which holds {ub}")
        segments *= 2
        seg_len = -(-row // segments)
    fit = (ub - s.fixed) // _row_bytes(seg_len, s, block)
    units = units_worth_starting(chip, _moved_bytes(sig), vcores)
    tile_rows = fit if rows is None else max(1, min(fit, rows, -(-rows // units)))
    tiling = _rows(tile_rows, seg_len, segments, rows, buffers, s, chip, "")
    work = tiling.work_units
    rule = f"rows of {row} elements, {tile_rows} rows a tile"
    if segments > 1:
        rule += (f"; a row needs more than UB holds ({ub}), so {segments} segments of {seg_len} "
                 f"combined by the reduction")
    rule += f"; {'an unknown number of' if work is None else work} work units over {tiling.cores} cores"
    return attrs.evolve(tiling, rule=rule + _fewer(units, vcores, chip))


def _row_bytes(cols: int, s: _Streams, block: int) -> int:
    # a row's streamed pieces, plus one UB block for each of its two statistics (max and sum, or mean and variance)
    return align(cols * s.per_elem, block) + 2 * block


def _rows(tile_rows: int, cols: int, segments: int, rows: int | None, buffers: int, s: _Streams, chip: Target,
          rule: str) -> RowTiling:
    block = chip.memory.ub_block_bytes
    work = None if rows is None else -(-rows // tile_rows) * segments
    cores = chip.vector_cores if work is None else min(work, chip.vector_cores)
    return RowTiling(template=ROW, rows=tile_rows, cols=cols, buffers=buffers, cores=cores,
                     ub_bytes=s.fixed + tile_rows * _row_bytes(cols, s, block), segments=segments, work_units=work,
                     rule=rule)


def _check_types(sig: OpSignature) -> None:
    if any(t is None for t in sig.operands + sig.results):
        raise Untiled("its types are unknown")


def choose_vector_tiling(name: str, operands: list[TensorType], results: list[TensorType], chip: Target,
                         buffers: int = 2, attributes: dict[str, Any] | None = None) -> VectorTiling | RowTiling:
    """The tiling the kernel implementing `name` chooses for these types (TilingError or Untiled when none)."""
    from geir.kernels.base import KERNELS  # the registry is filled once every kernel module is imported

    sig = OpSignature(name, tuple(operands), tuple(results), dict(attributes or {}))
    tiling = KERNELS[name].choose(sig, chip, buffers)
    if isinstance(tiling, Miss):
        raise (TilingError if tiling.overflow else Untiled)(tiling.reason)
    return tiling


# --- the kernels' tiling interface (geir.kernels.base.Kernel) ----------------------------------------

def elementwise_budget(tiling: VectorTiling, sig: OpSignature, chip: Target) -> Budget:
    """One vector unit's UB for a flat tile: the resident operands and `elems` streamed elements."""
    s = _streams(sig, chip, tiling.buffers, tiling.template in COPY_TEMPLATES)
    return Budget(s.fixed + tiling.elems * s.per_elem, 0, 0, 0, 0)


def row_budget(tiling: RowTiling, sig: OpSignature, chip: Target) -> Budget:
    """One vector unit's UB for a row tile: the resident parameters and `rows` rows of `cols` streamed elements."""
    s = _streams(sig, chip, tiling.buffers, False)
    return Budget(s.fixed + tiling.rows * _row_bytes(tiling.cols, s, chip.memory.ub_block_bytes),
                  0, 0, 0, 0)


def shrink_elementwise(tiling: VectorTiling) -> tuple[VectorTiling, str] | None:
    """Half the elements a tile: work cut finer, every element computed alike, bit-identical."""
    return halve(tiling, "elems", SMALLEST_CHUNK)


def shrink_rows(tiling: RowTiling) -> tuple[RowTiling, str] | None:
    """Half the rows a tile: each row is still reduced whole (same segments), bit-identical."""
    return halve(tiling, "rows", 1)


def elementwise_candidates(sig: OpSignature, chip: Target, buffers: int = 2,
                           template: str = ELEMENTWISE) -> list[VectorTiling]:
    """Flat tiles that cut the tensor into a power of two of pieces, or into pieces for every vector unit
    (once, twice, four times over), in whole UB blocks that fit; largest first."""
    try:
        _check_types(sig)
    except Untiled:
        return []
    block = chip.memory.ub_block_bytes
    s = _streams(sig, chip, buffers, template in COPY_TEMPLATES)
    fit = ((chip.buffer_bytes("ub") - s.fixed) // s.per_elem) // block * block
    if fit < block or s.total is None:
        return []
    pieces = {1 << i for i in range(max(s.total // block, 1).bit_length())}
    pieces |= {chip.vector_cores * m for m in (1, 2, 4)}
    sizes = {max(block, min(fit, align(-(-s.total // p), block))) for p in pieces}
    return [_flat(template, e, buffers, s, chip, f"candidate {e} elements a tile") for e in sorted(sizes, reverse=True)]


def row_candidates(sig: OpSignature, chip: Target, buffers: int = 2) -> list[RowTiling]:
    """Row tiles that cut the rows into a power of two of pieces, or into pieces for every vector unit (once,
    twice, four times over), at the segmentation the rule needs; largest first."""
    try:
        chosen = choose_row_tiling(sig, chip, buffers)
    except (Untiled, TilingError):
        return []
    s = _streams(sig, chip, buffers, False)
    rows, _ = _row_extent(sig.name, sig.operands[0], sig.attributes)
    if rows is None:
        return []
    fit = (chip.buffer_bytes("ub") - s.fixed) // _row_bytes(chosen.cols, s, chip.memory.ub_block_bytes)
    pieces = {1 << i for i in range(max(rows, 1).bit_length())} | {chip.vector_cores * m for m in (1, 2, 4)}
    counts = {max(1, min(fit, -(-rows // p))) for p in pieces}
    return [_rows(r, chosen.cols, chosen.segments, rows, buffers, s, chip, f"candidate {r} rows a tile")
            for r in sorted(counts, reverse=True)]


# --- running sums (ge.cumsum) -------------------------------------------------------------------------

def scan_extent(sig: OpSignature) -> tuple[int | None, int | None]:
    """(steps, sums) of a cumsum: the scanned axis's length, and how many independent running sums there are."""
    x = sig.operands[0]
    axis = sig.attr("axis", 0) % max(x.rank, 1)
    return x.shape[axis], product(tuple(d for i, d in enumerate(x.shape) if i != axis))


def _scan_bytes(rows: int, cols: int, sig: OpSignature, buffers: int, block: int) -> int:
    # per buffer a tile in and out, each row of it in whole UB blocks; the f32 working tile where 16-bit
    # floats are summed, and the carried row of sums (in the working precision)
    x, out = sig.operands[0], sig.results[0]
    work = F32_BYTES if x.dtype in (DType.f16, DType.bf16) else x.dtype.itemsize
    streamed = buffers * rows * (align(cols * x.dtype.itemsize, block) + align(cols * out.dtype.itemsize, block))
    working = rows * align(cols * work, block) if work != x.dtype.itemsize else 0
    return streamed + working + align(cols * work, block)


def choose_scan_tiling(sig: OpSignature, chip: Target, buffers: int = 2) -> ScanTiling:
    """The independent sums split over the vector units (whole UB blocks of them a tile), as many steps of the
    scanned axis a tile as fit UB; each unit walks the whole axis, carrying its sums from tile to tile."""
    check_buffers(buffers)
    _check_types(sig)
    steps, sums = scan_extent(sig)
    if sums is None:
        raise Untiled("the number of running sums is dynamic")
    ub, block, vcores = chip.buffer_bytes("ub"), chip.memory.ub_block_bytes, chip.vector_cores
    per_block = max(block // sig.operands[0].dtype.itemsize, 1)
    cols = align(max(-(-sums // vcores), 1), per_block)
    while cols > per_block and _scan_bytes(1, cols, sig, buffers, block) > ub:
        cols = align(cols // 2, per_block)
    if _scan_bytes(1, cols, sig, buffers, block) > ub:
        raise TilingError(f"no cumsum tiling fits {chip.name}: one step of {cols} sums needs "
                          f"{_scan_bytes(1, cols, sig, buffers, block)} bytes of UB, which holds {ub}")
    rows = 1
    while _scan_bytes(rows * 2, cols, sig, buffers, block) <= ub and (steps is None or rows < steps):
        rows *= 2
    if steps is not None:
        rows = max(1, min(rows, steps))
    tiling = _scan(rows, cols, buffers, sig, chip, "")
    rule = (f"{cols} running sums a unit, {rows} steps of the axis a tile; "
            f"{tiling.work_units} work units over {tiling.cores} cores")
    return attrs.evolve(tiling, rule=rule)


def _scan(rows: int, cols: int, buffers: int, sig: OpSignature, chip: Target, rule: str) -> ScanTiling:
    _, sums = scan_extent(sig)
    work = -(-sums // cols) if sums else 0
    block = chip.memory.ub_block_bytes
    return ScanTiling(template=SCAN, rows=rows, cols=cols, buffers=buffers, cores=max(min(work, chip.vector_cores), 1),
                      ub_bytes=_scan_bytes(rows, cols, sig, buffers, block), work_units=work, rule=rule)


def scan_budget(tiling: ScanTiling, sig: OpSignature, chip: Target) -> Budget:
    """One vector unit's UB for a cumsum tile: the streamed tiles, the working tile and the carried sums."""
    return Budget(_scan_bytes(tiling.rows, max(tiling.cols, 1), sig, tiling.buffers,
                              chip.memory.ub_block_bytes), 0, 0, 0, 0)


def shrink_scan(tiling: ScanTiling) -> tuple[ScanTiling, str] | None:
    """Half the steps a tile: the sums are still added in the same order, bit-identical."""
    return halve(tiling, "rows", 1)


def scan_candidates(sig: OpSignature, chip: Target, buffers: int = 2) -> list[ScanTiling]:
    """The rule's sums a unit with power-of-two steps a tile, from the rule's down to 1."""
    try:
        chosen = choose_scan_tiling(sig, chip, buffers)
    except (Untiled, TilingError):
        return []
    out, rows = [], chosen.rows
    while rows >= 1:
        out.append(_scan(rows, chosen.cols, buffers, sig, chip, f"candidate {rows} steps a tile"))
        rows //= 2
    return out
