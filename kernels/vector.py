"""Vector kernels: elementwise ops, fused elementwise chains, reductions, softmax, layer norm and RMS norm,
running sums (cumsum) and arange.

Tiles come from the tile pass (template VectorElementwise: `elems` per tile; VectorRow: `rows`
whole rows of `cols` elements, in `segments` pieces when a row does not fit UB). A wave deals one
tile to every vector unit (`VectorLanes`); its tiles are gathered into one array and the op's own
`compute` runs on that array, so the numbers are the reference interpreter's and the semantics
live in one place; each result is rounded to its dtype as `run_op` rounds it.

    elementwise   per tile: MTE2 each streamed operand's tile (broadcast operands small enough stay
                  resident in UB, loaded once per unit), VECTOR the op (a fused chain: every body step
                  on the UB tile, each by its op's compute), MTE3 the result tile; 2 UB slots overlap.
    row ops       per tile of whole rows: MTE2 the rows (+ streamed gamma/beta), VECTOR the row
                  reduction and normalisation, MTE3 the rows (or one value per row for reduce_*).
                  Segmented rows: a statistics pass over the segments (running max and sum, running
                  mean and M2, sum of squares), then an apply pass that reads each segment again.
    cumsum        template VectorScan: per tile of `rows` steps of the scanned axis for a unit's `cols` sums,
                  MTE2 the tile, VECTOR one add a step, MTE3 the tile; the sums carry to the next tile.
    arange        per tile VECTOR the progression, MTE3 it; nothing is loaded.
"""

from __future__ import annotations

import math

import numpy as np

from geir.builder import create_op
from geir.ir import Operation
from geir.kernels import vector_tiling as tiling_rules
from geir.kernels.base import Kernel, LaunchContext, issue, register_kernel
from geir.kernels.data_movement import (
    FlatTiledKernel,
    GmTensor,
    UbSlots,
    VectorLanes,
    check_fault,
    flat_pieces,
    gm_read,
    gm_tensor,
    gm_write,
    rect_pieces,
    result_dtype,
    share_pieces,
)
from geir.kernels.tiling import Budget, KernelTiling, Miss, OpSignature, choice, cut_leading
from geir.kernels.vector_tiling import RowTiling, ScanTiling, VectorTiling, reduced_axes
from geir.opdef import lookup, ops_with_trait
from geir.ops.fused import chainable_ops
from geir.ops.numerics import round_to, work
from geir.target_npu.target import Target
from geir.traits import RowWise

_F32 = np.float32
_HALF = ("float16", "bfloat16")
UB_BLOCK = 32

# Vector instructions per element: each op's own VECTOR_PASSES (Elementwise) or ROW_PASSES / ROW_STAT_PASSES
# (RowWise), declared on the op class and checked when it is registered (geir/traits.py).
# 16-bit floats are cast to f32 on the way in and back on the way out
CAST_PASSES = 2


def elementwise_passes(name: str) -> int:
    """Vector instructions per element of an elementwise op, as the op declares them."""
    return lookup(name).VECTOR_PASSES


def _is_half(dt: np.dtype) -> bool:
    return np.dtype(dt).name in _HALF


def _align(x: int, a: int = UB_BLOCK) -> int:
    return -(-x // a) * a


_cast = round_to


def _tiles(flat: np.ndarray, a0: int, a1: int, U: int, elems: int) -> np.ndarray:
    """Elements [a0, a1) of a flat array as U tiles of `elems` (the last one padded with its last element)."""
    if flat.size == 1:
        return flat.reshape(1, 1)
    n = U * elems
    if a0 + n <= flat.size:
        return flat[a0:a0 + n].reshape(U, elems)
    t = np.empty(n, flat.dtype)
    t[:a1 - a0] = flat[a0:a1]
    t[a1 - a0:] = flat[a1 - 1]
    return t.reshape(U, elems)


def _row_tiles(x2: np.ndarray, r0: int, U: int, rows: int) -> np.ndarray:
    """Rows [r0, r0 + U*rows) of a [R, C] array as [U, rows, C] (past the end: the last row again)."""
    R = x2.shape[0]
    if r0 + U * rows <= R:
        return x2[r0:r0 + U * rows].reshape(U, rows, x2.shape[1])
    idx = np.minimum(r0 + np.arange(U * rows), R - 1)
    return x2[idx].reshape(U, rows, x2.shape[1])


class _Streams:
    """The GM side of a vector kernel: its tensors and the pieces each tile reads or writes."""

    def __init__(self, ctx: LaunchContext):
        self.ctx = ctx
        self.gm = ctx.gm
        self.lanes = VectorLanes(ctx)

    def tensor(self, name: str, a: np.ndarray) -> GmTensor:
        return gm_tensor(self.gm, name, a.shape, a.dtype.itemsize)

    def load_resident(self, tensors: list[GmTensor], units: int) -> np.ndarray:
        """Every vector unit that will run a tile loads the resident operands once; the lanes' ready events."""
        cores = self.ctx.cores
        ready = np.zeros(cores.count)
        movers = min(units, self.lanes.slots)
        on = np.arange(movers)
        used = self.lanes.used(on)
        for t in tensors:
            pieces = flat_pieces(t, np.zeros(movers, np.int64), np.full(movers, t.size))
            cost = self.lanes.per_lane(on, gm_read(self.gm, t, pieces, key=np.zeros(movers)))
            ready[used] = issue(cores, self.ctx.waits, "MTE2", used, cost, [ready[used]],
                                name=f"load resident {t.name}")
        return ready


# --- elementwise ------------------------------------------------------------------------------------

@register_kernel
class ElementwiseKernel(FlatTiledKernel):
    """Every elementwise op, and fused chains of them, over the flattened output."""

    OPS = chainable_ops() + ("ge.fused_elementwise",)

    def check_instance(self, sig: OpSignature, tiling: KernelTiling) -> OpSignature:
        """Fewer leading rows: each element is computed alone, whatever tile it falls in."""
        out = sig.results[0]
        return cut_leading(sig, out.rank) if out is not None else sig

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: VectorTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        elems, nbuf = tiling.elems, tiling.buffers
        t = op.results[0].type
        shape = tuple(t.shape) if t is not None and t.is_static else np.broadcast_shapes(*[a.shape for a in inputs])
        total = math.prod(shape)
        out_dt = result_dtype(op, 0, inputs[0].dtype)
        ub = ctx.target.buffer_bytes("ub")
        # operands smaller than the output that fit an eighth of UB stay resident (the tile pass's rule)
        resident = [a.size < total and a.nbytes * 8 <= ub for a in inputs]
        body = op.attributes.get("body") or []
        halves = any(_is_half(a.dtype) for a in inputs) or _is_half(out_dt)
        self.allocate(tiling, OpSignature.of_arrays(op, inputs), ctx.target,
                      f"{nbuf} x the streamed tiles of {elems} elements and their f32 working copies")
        out = np.empty(total, dtype=out_dt)
        if total == 0:
            return [out.reshape(shape)]
        # The flat operands: full ones are views; broadcast ones are materialised once (the data a
        # tile of the output reads), size-1 ones stay scalars.
        flats = []
        for a in inputs if ctx.compute else ():
            if a.size == 1:
                flats.append(a.reshape(1))
            elif a.shape == shape:
                flats.append(np.ascontiguousarray(a).reshape(-1))
            else:
                flats.append(np.broadcast_to(a, shape).reshape(-1))
        io = _Streams(ctx)
        in_gm = [io.tensor(n, a) for n, a in zip(ctx.operand_names, inputs)]
        out_gm = gm_tensor(ctx.gm, ctx.result_names[0], shape, out.dtype.itemsize)
        nt = -(-total // elems)
        ready = io.load_resident([g for g, r in zip(in_gm, resident) if r], nt)
        lanes = io.lanes
        slots = UbSlots(ctx.cores, nbuf, ctx.waits)
        names = [s["op"] for s in body] or [op.name]
        passes = sum(elementwise_passes(n) for n in names) + (CAST_PASSES if halves else 0)
        work_bytes = max([a.dtype.itemsize for a in inputs] + [out.dtype.itemsize] + [4 if halves else 0])

        for wave, on in lanes.waves(nt):
            U = len(wave)
            lo = wave * elems
            hi = np.minimum(lo + elems, total)
            a0, a1 = int(lo[0]), int(hi[-1])
            if ctx.compute:  # the numbers: the wave's tiles in one array, the op's semantics, rounded to the result dtype
                res = op.compute(*[_tiles(f, a0, a1, U, elems) for f in flats])
                res = np.broadcast_to(_cast(res, out_dt), (U, elems))
                out[a0:a1] = res.reshape(-1)[:a1 - a0]
            # the timing
            count = hi - lo
            load = np.zeros(U)
            for a, g, r in zip(inputs, in_gm, resident):
                if r:
                    continue
                pieces = flat_pieces(g, lo, hi) if a.shape == shape else share_pieces(g, wave, nt, count)
                load += gm_read(ctx.gm, g, pieces)
            store = gm_write(ctx.gm, out_gm, flat_pieces(out_gm, lo, hi))
            used = lanes.used(on)
            slots.step(used, lanes.per_lane(on, load), lanes.per_lane(on, lanes.vector(count * work_bytes, passes)),
                       lanes.per_lane(on, store), after=[ready[used]], names=("load tiles", op.name[3:], "store tile"))
        return [out.reshape(shape)]


@register_kernel
class ArangeKernel(FlatTiledKernel):
    """`ge.arange` not folded away (a sequence too long for a literal): per tile the vector unit writes the
    progression into UB (Ascend C's ArithProgression: one instruction per element, as other ops without a
    longer sequence) and MTE3 stores it; nothing is loaded."""

    OPS = ("ge.arange",)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: VectorTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        elems, nbuf = tiling.elems, tiling.buffers
        total = op.length
        out_dt = op.dtype.np
        self.allocate(tiling, OpSignature.of_arrays(op, inputs), ctx.target, f"{nbuf} x the tiles of {elems} elements")
        out = np.empty(total, dtype=out_dt)
        if total == 0:
            return [out]
        out_gm = gm_tensor(ctx.gm, ctx.result_names[0], out.shape, out.dtype.itemsize)
        lanes = VectorLanes(ctx)
        cores = ctx.cores
        free = np.zeros((nbuf, cores.count))  # when each UB slot's previous tile was stored
        work_bytes = max(out.dtype.itemsize, 4 if _is_half(out_dt) else 0)
        passes = 1 + (CAST_PASSES // 2 if _is_half(out_dt) else 0)  # f16/bf16: made in f32, cast on the way out
        nt = -(-total // elems)
        for n, (wave, on) in enumerate(lanes.waves(nt)):
            lo = wave * elems
            hi = np.minimum(lo + elems, total)
            if ctx.compute:  # the numbers: the op's own sequence for the wave's range
                a0, a1 = int(lo[0]), int(hi[-1])
                out[a0:a1] = _cast(op.values(a0, a1), out_dt)
            used = lanes.used(on)
            s = n % nbuf
            made = issue(cores, ctx.waits, "VECTOR", used, lanes.per_lane(on, lanes.vector((hi - lo) * work_bytes, passes)),
                         [], [free[s, used]], name="arange")
            store = lanes.per_lane(on, gm_write(ctx.gm, out_gm, flat_pieces(out_gm, lo, hi)))
            free[s, used] = issue(cores, ctx.waits, "MTE3", used, store, [made], name="store tile")
        return [out]


# --- running sums ----------------------------------------------------------------------------------------

@register_kernel
class CumsumKernel(Kernel):
    """`ge.cumsum` as Ascend C scans a tile: the scanned axis laid out as rows, one vector add per row adding
    it to the running sums of the row before (`cols` sums side by side), the last row's sums carried to the
    unit's next tile. Each unit owns `cols` of the independent sums and walks the whole axis in tiles of
    `rows` steps: MTE2 the tile, VECTOR `rows` adds over `cols` elements, MTE3 the tile.

    Each sum is added in order, element after element, as numpy's cumsum adds: the results are bit-identical.
    """

    OPS = ("ge.cumsum",)
    TILING = ScanTiling

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> ScanTiling | Miss:
        return choice(lambda: tiling_rules.choose_scan_tiling(sig, target, buffers))

    def budget(self, tiling: ScanTiling, sig: OpSignature, target: Target) -> Budget:
        return tiling_rules.scan_budget(tiling, sig, target)

    def shrink(self, tiling: ScanTiling) -> tuple[ScanTiling, str] | None:
        return tiling_rules.shrink_scan(tiling)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[ScanTiling]:
        return tiling_rules.scan_candidates(sig, target, buffers)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: ScanTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        x = inputs[0]
        axis = op.axis % x.ndim
        rows, cols, nbuf = tiling.rows, max(tiling.cols, 1), tiling.buffers
        C, M = x.shape[axis], math.prod(d for i, d in enumerate(x.shape) if i != axis)
        out_dt = result_dtype(op, 0, x.dtype)
        self.allocate(tiling, OpSignature.of_arrays(op, inputs), ctx.target,
                      f"{nbuf} x tiles of {rows} steps of {cols} sums, the working tile and the carried sums")
        moved_shape = (C,) + tuple(d for i, d in enumerate(x.shape) if i != axis)
        if x.size == 0:
            return [np.empty(x.shape, dtype=out_dt)]
        halves = _is_half(x.dtype)
        work_bytes = 4 if halves else x.dtype.itemsize
        if ctx.compute:  # the scanned axis first, as rows; reverse: the rows from the end
            y = np.moveaxis(work(x), axis, 0).reshape(C, M)
            y = y[::-1] if op.reverse else y
            out2 = np.empty((C, M), dtype=out_dt)
            target2 = out2[::-1] if op.reverse else out2
        io = _Streams(ctx)
        lanes = io.lanes
        x_gm = io.tensor(ctx.operand_names[0], x)
        out_gm = gm_tensor(ctx.gm, ctx.result_names[0], x.shape, np.dtype(out_dt).itemsize)
        units = -(-M // cols)
        chunks = -(-C // rows)
        slots = UbSlots(ctx.cores, nbuf, ctx.waits)
        for wave, on in lanes.waves(units):
            used = lanes.used(on)
            a0, a1 = int(wave[0]) * cols, min((int(wave[-1]) + 1) * cols, M)
            width = np.minimum((wave + 1) * cols, M) - wave * cols
            carry = None
            for k in range(chunks):
                r0, r1 = k * rows, min((k + 1) * rows, C)
                if ctx.compute:
                    carry = self._chunk(op, y[r0:r1, a0:a1], target2[r0:r1, a0:a1], carry, out_dt)
                count = (r1 - r0) * width
                load = gm_read(ctx.gm, x_gm, share_pieces(x_gm, wave * chunks + k, units * chunks, count))
                # one add per step over the unit's sums, and the 16-bit casts in and out over the tile
                vec = lanes.vector(width * work_bytes, r1 - r0) + (lanes.vector(count * 4, CAST_PASSES) if halves else 0)
                store = gm_write(ctx.gm, out_gm, share_pieces(out_gm, wave * chunks + k, units * chunks, count))
                slots.step(used, lanes.per_lane(on, load), lanes.per_lane(on, vec), lanes.per_lane(on, store),
                           names=("load tile", "cumsum", "store tile"))
        if not ctx.compute:
            return [np.empty(x.shape, dtype=out_dt)]
        return [np.ascontiguousarray(np.moveaxis(out2.reshape(moved_shape), 0, axis))]

    @staticmethod
    def _chunk(op: Operation, tile: np.ndarray, out: np.ndarray, carry: np.ndarray | None,
               out_dt: np.dtype) -> np.ndarray:
        """Sum one tile of steps into `out` after the carried sums (None: the first tile); the new carry.

        The carried row is the first term of the scan, so every sum is still added element after element.
        """
        sums = np.cumsum(tile if carry is None else np.concatenate([carry[None], tile]), axis=0, dtype=tile.dtype)
        sums = sums if carry is None else sums[1:]
        if op.exclusive:  # each step without its own term: the sums before it
            first = np.zeros_like(sums[:1]) if carry is None else carry[None]
            out[...] = _cast(np.concatenate([first, sums[:-1]]), out_dt)
        else:
            out[...] = _cast(sums, out_dt)
        return sums[-1]


# --- row ops -------------------------------------------------------------------------------------------

def _row_op(op: Operation) -> Operation:
    """A detached op of the same kind that works on the last axis of a [tiles, rows, C] array."""
    attrs = dict(op.attributes)
    if "axis" in type(op).ATTRS:  # the row starts at one axis (softmax, layer_norm): the tile's last
        attrs["axis"] = -1
    if "axes" in type(op).ATTRS:  # a reduction over listed axes: the tile's last, not kept
        attrs.update(axes=[-1], keepdims=False)
    return create_op(op.name, [], [], {k: v for k, v in attrs.items() if k in type(op).ATTRS})


@register_kernel
class RowKernel(Kernel):
    """Row-wise ops: the reduced axes (moved last when they are not) stay whole in UB, `rows` rows a tile."""

    TRAIT = RowWise  # every op that declares the row facts (geir/traits.py), whenever it was registered
    TILING = RowTiling

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> RowTiling | Miss:
        return choice(lambda: tiling_rules.choose_row_tiling(sig, target, buffers))

    def budget(self, tiling: RowTiling, sig: OpSignature, target: Target) -> Budget:
        return tiling_rules.row_budget(tiling, sig, target)

    def shrink(self, tiling: RowTiling) -> tuple[RowTiling, str] | None:
        return tiling_rules.shrink_rows(tiling)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[RowTiling]:
        return tiling_rules.row_candidates(sig, target, buffers)

    def check_instance(self, sig: OpSignature, tiling: KernelTiling) -> OpSignature:
        """Fewer leading rows when the leading axis is not reduced: each row is reduced alone."""
        x = sig.operands[0]
        if x is None or x.rank < 2 or 0 in reduced_axes(sig.name, sig.attributes, x.rank):
            return sig
        return cut_leading(sig, x.rank)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: RowTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        tr, nbuf, segments = tiling.rows, tiling.buffers, max(tiling.segments, 1)
        x, params = inputs[0], inputs[1:]
        rank = x.ndim
        axes = reduced_axes(op.name, op.attributes, rank)
        trailing = axes == tuple(range(rank - len(axes), rank))
        kept = [d for i, d in enumerate(x.shape) if i not in axes]
        R, C = math.prod(kept), math.prod(x.shape[i] for i in axes)
        seg = -(-C // segments) if segments > 1 else C
        reduce = type(op).ROW_STAT_PASSES is None  # a reduction: its result is the row's statistic
        moved = x if trailing else np.moveaxis(x, axes, range(rank - len(axes), rank))
        x2 = np.ascontiguousarray(moved).reshape(R, C) if ctx.compute else None  # timing only: no data to lay out
        out_dt = result_dtype(op, 0, x.dtype)
        out2 = np.empty((R,) if reduce else (R, C), dtype=out_dt)
        ub = ctx.target.buffer_bytes("ub")
        resident = [p.size < x.size and p.nbytes * 8 <= ub for p in params]
        halves = _is_half(x.dtype) or _is_half(out_dt)
        self.allocate(tiling, OpSignature.of_arrays(op, inputs), ctx.target,
                      f"{tr} rows of {seg} elements: {nbuf} x the streamed tiles and an f32 working copy")
        # gamma / beta: one row when they do not vary over the kept axes, else rows gathered like x
        lead = rank - len(axes)
        rowwise = []
        for p in params if ctx.compute else ():
            padded = (1,) * (rank - p.ndim) + p.shape
            if all(d == 1 for d in padded[:lead]):
                rowwise.append((True, np.broadcast_to(p.reshape(padded[lead:]), x.shape[lead:]).reshape(C)))
            else:
                rowwise.append((False, np.ascontiguousarray(np.broadcast_to(p, x.shape)).reshape(R, C)))
        out_shape = x.shape
        if reduce:
            t = op.results[0].type
            out_shape = tuple(t.shape) if t is not None and t.is_static else (
                tuple(1 if i in axes else d for i, d in enumerate(x.shape)) if op.keepdims else tuple(kept))
        if R and C:
            self.tiles(op, ctx, x, x2, out2, out_shape, params, rowwise, resident, R, C, tr, seg, nbuf, trailing,
                       halves)
        elif reduce and ctx.compute:
            out2[...] = _cast(op.compute(x), out_dt).reshape(-1)  # an empty row: the op's own identity
        if reduce:
            return [out2.reshape(out_shape)]
        if not ctx.compute:
            return [np.empty(x.shape, dtype=out_dt)]
        out = out2.reshape(moved.shape)
        if not trailing:
            out = np.ascontiguousarray(np.moveaxis(out, range(rank - len(axes), rank), axes))
        return [out]

    def tiles(self, op, ctx, x, x2, out2, out_shape, params, rowwise, resident, R, C, tr, seg, nbuf, trailing,
              halves) -> None:
        """The tile loop: numbers per wave with the op's compute, timing per tile on the lanes' pipes."""
        gm, cores = ctx.gm, ctx.cores
        io = _Streams(ctx)
        lanes = io.lanes
        reduce = type(op).ROW_STAT_PASSES is None  # a reduction: its result is the row's statistic
        in_gm = [io.tensor(n, a) for n, a in zip(ctx.operand_names, [x, *params])]
        out_gm = gm_tensor(gm, ctx.result_names[0], out_shape, out2.dtype.itemsize)
        xg, pg = in_gm[0], in_gm[1:]
        nt = -(-R // tr)
        segments = -(-C // seg)
        ready = io.load_resident([g for g, r in zip(pg, resident) if r], nt)
        streamed = [(g, p) for g, p, r in zip(pg, params, resident) if not r]
        slots = UbSlots(cores, nbuf, ctx.waits)
        row_op = _row_op(op)
        passes = type(op).ROW_PASSES
        casts = CAST_PASSES if halves else 0
        # the [R, C] view is the matrix view of x (so a segment is a rectangle of it) when one last axis is reduced
        matrix = trailing and C == xg.cols

        def pieces(g: GmTensor, full_shape: bool, r0, r1, c0, c1, part, parts):
            if full_shape and matrix:
                return rect_pieces(g, r0, r1, c0, c1)
            if full_shape and trailing and c0 == 0 and c1 == C:
                return flat_pieces(g, r0 * C, r1 * C)
            return share_pieces(g, part, parts, (r1 - r0) * (c1 - c0))

        def load(wave, on, r0, r1, c0, c1, s):
            cost = gm_read(gm, xg, pieces(xg, True, r0, r1, c0, c1, wave * segments + s, nt * segments))
            for g, p in streamed:
                cost = cost + gm_read(gm, g, pieces(g, p.shape == x.shape, r0, r1, c0, c1,
                                                     wave * segments + s, nt * segments))
            return lanes.per_lane(on, cost)

        def store(wave, on, r0, r1, c0, c1, s):
            if reduce:
                return lanes.per_lane(on, gm_write(gm, out_gm, flat_pieces(out_gm, r0, r1)))
            return lanes.per_lane(on, gm_write(gm, out_gm, pieces(out_gm, True, r0, r1, c0, c1,
                                                                  wave * segments + s, nt * segments)))

        for wave, on in lanes.waves(nt):
            U = len(wave)
            used = lanes.used(on)
            r0 = wave * tr
            r1 = np.minimum(r0 + tr, R)
            rows = r1 - r0
            lo, hi = int(r0[0]), int(r1[-1])
            compute = ctx.compute
            xt = _row_tiles(x2, lo, U, tr) if compute else None
            pt = [p if row else _row_tiles(p, lo, U, tr) for row, p in rowwise]
            name = op.name[3:]
            if segments == 1:
                if compute:
                    res = _cast(row_op.compute(xt, *pt), out2.dtype)
                    out2[lo:hi] = res.reshape((U * tr,) + out2.shape[1:])[:hi - lo]
                vec = lanes.per_lane(on, lanes.vector(rows * C * 4, passes + casts))
                slots.step(used, load(wave, on, r0, r1, 0, C, 0), vec, store(wave, on, r0, r1, 0, C, 0),
                           after=[ready[used]], names=("load rows", name, "store rows"))
                continue
            # segmented rows: a statistics pass over the segments, then (but for reduce_*) an apply pass
            stat_passes = passes if reduce else type(op).ROW_STAT_PASSES
            cuts = [(s, s * seg, min((s + 1) * seg, C)) for s in range(segments)]
            stats = _SegmentStats(op, row_op, (U, tr))
            for s, c0, c1 in cuts:
                if compute:
                    stats.add(xt[..., c0:c1], c1 - c0)
                vec = lanes.per_lane(on, lanes.vector(rows * (c1 - c0) * 4, stat_passes + casts // 2))
                done = slots.step(used, load(wave, on, r0, r1, c0, c1, s), vec, None, after=[ready[used]],
                                  names=("load segment", f"{name} statistics", ""))
            if reduce:
                if compute:
                    res = _cast(stats.result(C), out2.dtype)
                    out2[lo:hi] = res.reshape(-1)[:hi - lo]
                issue(cores, ctx.waits, "MTE3", used, store(wave, on, r0, r1, 0, C, 0), [done],
                      name="store row results")
                continue
            for s, c0, c1 in cuts:
                if compute:
                    res = _cast(stats.apply(xt[..., c0:c1], [p[..., c0:c1] for p in pt], C), out2.dtype)
                    out2[lo:hi, c0:c1] = res.reshape(U * tr, c1 - c0)[:hi - lo]
                vec = lanes.per_lane(on, lanes.vector(rows * (c1 - c0) * 4, passes - stat_passes + casts))
                slots.step(used, load(wave, on, r0, r1, c0, c1, s), vec, store(wave, on, r0, r1, c0, c1, s),
                           names=("load segment", f"{name} apply", "store segment"))


class _SegmentStats:
    """Row statistics combined over the segments of rows too long for UB (the kernel's own algorithm:
    partial reductions of the op's kind, online softmax, Chan's mean/M2 merge, a running sum of squares)."""

    def __init__(self, op: Operation, row_op: Operation, shape: tuple[int, ...]):
        self.op, self.row_op = op, row_op
        self.n = 0
        self.acc = None
        self.m = np.full(shape, -np.inf, dtype=_F32)
        self.l = np.zeros(shape, dtype=_F32)
        self.mean = np.zeros(shape, dtype=_F32)
        self.m2 = np.zeros(shape, dtype=_F32)

    def add(self, xs: np.ndarray, count: int) -> None:
        kind = type(self.op).SEGMENT_STATISTIC
        if kind in ("sum", "max", "min"):
            part = self.row_op.compute(xs)
            merge = {"sum": np.add, "max": np.maximum, "min": np.minimum}[kind]
            self.acc = part if self.acc is None else merge(self.acc, part)
            return
        xs = work(xs)
        if kind == "mean":
            part = xs.sum(axis=-1)
            self.acc = part if self.acc is None else self.acc + part
        elif kind == "softmax":
            m_new = np.maximum(self.m, xs.max(axis=-1))
            safe = np.where(np.isneginf(m_new), 0, m_new).astype(xs.dtype)
            with np.errstate(invalid="ignore"):
                self.l = self.l * np.exp(self.m - safe) + np.exp(xs - safe[..., None]).sum(axis=-1)
            self.m = m_new
        elif kind == "mean_m2":
            mean_s = xs.mean(axis=-1)
            m2_s = np.square(xs - mean_s[..., None]).sum(axis=-1)
            total = self.n + count
            delta = mean_s - self.mean
            self.mean = self.mean + delta * (count / total)
            self.m2 = self.m2 + m2_s + np.square(delta) * (self.n * count / total)
        else:  # "sum_of_squares" (ROW_STATISTICS names no other)
            part = np.square(xs).sum(axis=-1)
            self.acc = part if self.acc is None else self.acc + part
        self.n += count

    def result(self, C: int) -> np.ndarray:
        if type(self.op).SEGMENT_STATISTIC == "mean":
            return self.acc / C
        return self.acc

    def apply(self, xs: np.ndarray, params: list[np.ndarray], C: int) -> np.ndarray:
        """The apply pass over a segment, from the row's statistics: what softmax, layer norm (mean and M2) and
        RMS norm (sum of squares) do with theirs."""
        xs = work(xs)
        kind = type(self.op).SEGMENT_STATISTIC
        eps = self.op.attr("epsilon")
        with np.errstate(invalid="ignore", divide="ignore"):
            if kind == "softmax":
                safe = np.where(np.isneginf(self.m), 0, self.m).astype(xs.dtype)
                return np.exp(xs - safe[..., None]) / self.l[..., None]
            if kind == "mean_m2":
                var = self.m2 / C
                y = (xs - self.mean[..., None]) / np.sqrt(var + eps)[..., None]
                return y * work(params[0]) + work(params[1])
            ms = self.acc / C
            return xs / np.sqrt(ms + eps)[..., None] * work(params[0])
