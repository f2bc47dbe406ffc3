"""Global-memory tensors as the kernels see them, and the data-movement kernels.

**GM residency blocks.** Every kernel of this package (matmul, vector, data movement) tracks a GM
tensor on one grid: each of its matrices (the last two dims; a vector is one row) cut into 16 x
16-element fractals, the last ones of a matrix partial (512 bytes at f16: the HBM block and the
NZ fractal; a fractal never spans two matrices). A tile is a set of pieces (fractal id, bytes of
the tile inside it); `GlobalMemory.read_pieces` / `write_pieces` judge L2 residency per piece
and cost it, so a producer and a consumer with different tilings agree on where the data is. Bytes
are always exact; for strided accesses (a slice, a transposed read, a region of a concat) the
fractal ids are approximated by the tile's proportional position. Cores that read the same tile
together (matmul lanes sharing an A or B block) are told apart by a `key`: the first brings it
into L2, the others hit. A kernel whose tiles are disjoint tiles of the fractal grid (matmul
operands, `TileSets`) has a whole wave's moves costed at once by `GlobalMemory.transfer`, with the
same results as one read_pieces / write_pieces per move.

**Copy kernels** (transpose, concat, split, slice, trans_data, and reshape of NZ data) tile the
elements they move with the tile pass's `elems` (template DataCopy / TransData / VectorTranspose):
per tile MTE2 loads the source pieces into a UB slot, the vector unit permutes them where the op
reorders elements (transpose, ND <-> NZ), and MTE3 stores the tile; with 2 buffers the load of the
next tile overlaps the store of this one. Waves deal tiles to every vector unit (`VectorLanes`).

**Gather** (`ge.gather`, an embedding lookup with run-time indices) copies whole table rows by index
(template Gather): per tile MTE2 loads the tile's indices, then each of its rows from the table by a DMA
of its own (one start latency per row), and MTE3 stores the tile's rows, which are consecutive in the
output. Which table rows a tile reads depends on the index values, and the timing never does: its bytes
are exact and their fractal ids the tile's proportional position in the table (as for strided copies).

**Views and constants.** `ge.reshape` of ND data is a view: no cost; the result shares the
operand's residency (`alias`). So is a `ge.split` whose pieces are runs of the operand's bytes (only
axes of size 1 before the cut axis). `ge.const` has no kernel: `lower` turns each constant into an
`rt.const` that the Runtime copies into device memory once, when the program is loaded (host link
time counted in the load, not per run); kernels then read it like any other GM tensor, cold in L2
the first time.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from geir.ir import Operation
from geir.kernels import gather_tiling, vector_tiling as tiling_rules
from geir.kernels.base import Kernel, LaunchContext, PipeWaits, issue, no_bytes_c, register_kernel
from geir.kernels.gather_tiling import GatherTiling
from geir.kernels.tiling import Budget, Miss, OpSignature, choice
from geir.kernels.vector_tiling import VectorTiling
from geir.ops.indexing import index_problem
from geir.ops.numerics import normalize_axis
from geir.target_npu.residency import SparseResidency, resampled
from geir.target_npu.sim import BlockSets, CapacityError, Cores, DeviceFault, GlobalMemory, spread, vector_cycles
from geir.target_npu.target import Target

FRACTAL = 16  # rows and columns of one GM residency block


# --- GM tensors on the fractal grid ---------------------------------------------------------------

def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a tensor viewed as a matrix: cols is the last dim, rows all the others."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


@attrs.frozen
class GmTensor:
    """A GM tensor's name, matrix view (`rows` x `cols`, made of matrices of `mrows` rows) and itemsize."""

    name: str
    rows: int
    cols: int
    itemsize: int
    mrows: int = 1

    @property
    def fcols(self) -> int:
        return max(-(-self.cols // FRACTAL), 1)

    @property
    def padded_rows(self) -> int:
        """Rows of one matrix rounded up to whole fractals."""
        return max(-(-self.mrows // FRACTAL), 1) * FRACTAL

    @property
    def blocks(self) -> int:
        matrices = max(self.rows // max(self.mrows, 1), 1)
        return matrices * (self.padded_rows // FRACTAL) * self.fcols

    @property
    def size(self) -> int:
        return self.rows * self.cols


def gm_tensor(gm: GlobalMemory, name: str, shape: tuple[int, ...], itemsize: int) -> GmTensor:
    """Register a tensor on the fractal grid (`gm.ensure`: unknown blocks start from what is known of the
    tensor). A tensor known on a smaller grid (another kernel's blocks, a reshape) keeps its block-level
    residency, resampled onto this one; a larger one is kept as it is (the same memory seen as several
    tensors, with an in-place plan), so every kernel's block ids stay in range."""
    rows, cols = matrix_shape(tuple(shape))
    t = GmTensor(name, rows, cols, itemsize, shape[-2] if len(shape) >= 2 and shape[-2] else 1)
    last = gm.last_touch.get(name)
    if last is not None and len(last) == 0 < t.blocks:  # known only as empty (no blocks): nothing to resample
        del gm.last_touch[name]
        last = None
    if last is None:
        gm.ensure(name, t.blocks)
    elif len(last) < t.blocks:
        gm.last_touch[name] = resampled(last, t.blocks)
    return t


def alias(gm: GlobalMemory, src: str, dst: str) -> None:
    """`dst` is a view of `src` (a reshape): it shares the residency of `src`'s blocks."""
    if src in gm.last_touch and src != dst:
        gm.last_touch[dst] = gm.last_touch[src].copy()
        gm.tensor_clock[dst] = gm.tensor_clock.get(src, -np.inf)


class TileSets(BlockSets):
    """A GM tensor's every matrix cut into row tiles x column tiles on the fractal grid, as BlockSets.

    Tiles start on fractal boundaries (a tile size is a multiple of FRACTAL, or the whole dimension), so
    each tile's pieces are exactly the fractals it covers, as rect_pieces lists them for its rectangle,
    and the tiles are disjoint. Set ids run matrix by matrix, then row tile, then column tile (`swap`:
    column tile before row tile). Nothing is listed piece by piece: the residency is read and written
    through the tensor's fractal grid, reshaped by tiles.
    """

    def __init__(self, gm: GlobalMemory, t: GmTensor, row_tile: int, col_tile: int, swap: bool = False):
        super().__init__(gm, t.name)
        R, C = max(t.mrows, 1), t.cols
        self.t, self.swap = t, swap
        self.mats = max(t.rows // R, 1)
        self.BR, self.FC = t.padded_rows // FRACTAL, t.fcols  # fractal rows of a matrix, fractal columns
        row_tile, col_tile = min(row_tile, self.BR * FRACTAL), min(col_tile, self.FC * FRACTAL)
        self.Rp, self.Cp = -(-row_tile // FRACTAL), -(-col_tile // FRACTAL)  # fractals of a tile
        self.RT, self.CT = -(-self.BR // self.Rp), -(-self.FC // self.Cp)  # tiles of a matrix
        # rows (columns) of each fractal row (column): 16 but at the matrix's end
        self.band_rows = np.minimum(R - FRACTAL * np.arange(self.RT * self.Rp), FRACTAL).clip(0)
        self.col_cols = np.minimum(C - FRACTAL * np.arange(self.CT * self.Cp), FRACTAL).clip(0)
        rows = self.band_rows.reshape(self.RT, self.Rp).sum(axis=1)
        cols = self.col_cols.reshape(self.CT, self.Cp).sum(axis=1)
        total = np.broadcast_to((rows[:, None] * cols[None, :] * t.itemsize)[None], (self.mats, self.RT, self.CT))
        grid = self._grid()
        pad = (self.mats, self.RT * self.Rp, self.CT * self.Cp)
        if pad == grid.shape:
            lo = hi = grid.reshape(self.mats, self.RT, self.Rp, self.CT, self.Cp)
            lo, hi = lo.min(axis=(2, 4)), hi.max(axis=(2, 4))
        else:  # partial tiles at the edges: padding that neither min nor max picks
            g = np.full(pad, np.inf)
            g[:, :self.BR, :self.FC] = grid
            lo = g.reshape(self.mats, self.RT, self.Rp, self.CT, self.Cp).min(axis=(2, 4))
            g[:, :self.BR, :self.FC] = grid
            g[:, self.BR:, :] = -np.inf
            g[:, :, self.FC:] = -np.inf
            hi = g.reshape(self.mats, self.RT, self.Rp, self.CT, self.Cp).max(axis=(2, 4))
        self.settle(*(self._order(x) for x in (total, lo, hi)))

    def _grid(self) -> np.ndarray:
        """The tensor's residency as [matrix, fractal row, fractal column] (a view; a copy of a tensor kept as runs,
        which `commit` writes back)."""
        size = self.mats * self.BR * self.FC
        if isinstance(self.init, SparseResidency):
            return self.init[np.arange(size)].reshape(self.mats, self.BR, self.FC)
        return self.init[:size].reshape(self.mats, self.BR, self.FC)

    def _order(self, x: np.ndarray) -> np.ndarray:
        """[matrix, row tile, column tile] -> set ids' order, flat."""
        return (x.transpose(0, 2, 1) if self.swap else x).reshape(-1)

    def pieces(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.swap:
            mat, ct, rt = ids // (self.CT * self.RT), (ids // self.RT) % self.CT, ids % self.RT
        else:
            mat, rt, ct = ids // (self.RT * self.CT), (ids // self.CT) % self.RT, ids % self.CT
        band = rt[:, None] * self.Rp + np.arange(self.Rp)
        col = ct[:, None] * self.Cp + np.arange(self.Cp)
        nbytes = self.band_rows[band][:, :, None] * self.col_cols[col][:, None, :] * self.t.itemsize
        blocks = (mat[:, None, None] * self.BR + band[:, :, None]) * self.FC + col[:, None, :]
        blocks = np.where(nbytes > 0, blocks, 0)
        return blocks.reshape(len(ids), -1), nbytes.reshape(len(ids), -1)

    def commit(self, gm: GlobalMemory) -> None:
        shape = (self.mats, self.CT, self.RT) if self.swap else (self.mats, self.RT, self.CT)
        seen = self.seen.reshape(shape)
        mixed = self.mixed.reshape(shape)
        if self.swap:
            seen, mixed = seen.transpose(0, 2, 1), mixed.transpose(0, 2, 1)
        full = (self.mats, self.RT, self.Rp, self.CT, self.Cp)
        pad = (self.mats, self.RT * self.Rp, self.CT * self.Cp)
        new = np.broadcast_to(seen[:, :, None, :, None], full).reshape(pad)[:, :self.BR, :self.FC]
        grid = self._grid()
        if self.any_mixed and mixed.any():  # sets never moved keep their pieces' own last touches
            keep = np.broadcast_to(mixed[:, :, None, :, None], full).reshape(pad)[:, :self.BR, :self.FC]
            new = np.where(keep, grid, new)
        if isinstance(self.init, SparseResidency):
            self.init[np.arange(grid.size)] = new.reshape(-1)
        else:
            grid[...] = new


def _ints(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def rect_pieces(t: GmTensor, r0, r1, c0, c1) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of one rectangle per mover (rows [r0, r1) x cols [c0, c1) of the matrix view, rows may run
    across matrices): fractal ids and bytes, [movers, pieces]; padding pieces have 0 bytes."""
    r0, r1, c0, c1 = np.broadcast_arrays(_ints(r0), _ints(r1), _ints(c0), _ints(c1))
    r1 = np.minimum(r1, t.rows)
    c1 = np.minimum(c1, t.cols)
    R, Rp = max(t.mrows, 1), t.padded_rows
    # rows on the fractal grid, where every matrix starts on a fresh fractal row
    last = np.maximum(r1 - 1, r0)
    p0 = (r0 // R) * Rp + r0 % R
    p1 = np.where(r1 > r0, (last // R) * Rp + last % R + 1, p0)
    b0, k0 = p0 // FRACTAL, c0 // FRACTAL
    nb = np.where(p1 > p0, (p1 - 1) // FRACTAL - b0 + 1, 0)
    nk = np.where(c1 > c0, (c1 - 1) // FRACTAL - k0 + 1, 0)
    NB, NK = int(nb.max(initial=0)), int(nk.max(initial=0))
    if NB == 0 or NK == 0:
        empty = np.zeros((r0.shape[0], 0), dtype=np.int64)
        return empty, empty
    band = b0[:, None] + np.arange(NB)
    lo, hi = np.maximum(p0[:, None], band * FRACTAL), np.minimum(p1[:, None], (band + 1) * FRACTAL)
    # minus the grid rows past the end of a matrix that the range steps over
    matrix = band // (Rp // FRACTAL)
    pad = np.minimum(hi, (matrix + 1) * Rp) - np.maximum(lo, matrix * Rp + R)
    rows_in = np.maximum(hi - lo, 0) - np.maximum(pad, 0)
    kb = k0[:, None] + np.arange(NK)
    cols_in = np.minimum(c1[:, None], (kb + 1) * FRACTAL) - np.maximum(c0[:, None], kb * FRACTAL)
    nbytes = np.maximum(rows_in, 0)[:, :, None] * np.maximum(cols_in, 0)[:, None, :] * t.itemsize
    blocks = band[:, :, None] * t.fcols + kb[:, None, :]
    blocks = np.where(nbytes > 0, blocks, 0)
    return blocks.reshape(len(r0), -1), nbytes.reshape(len(r0), -1)


def _row_range(t: GmTensor, lo, hi) -> tuple:
    """A row-major element range [lo, hi) per mover, clipped to the tensor, in rows and columns of its
    matrix view: (lo, hi, cols, first row, its first column, last row, its end column, whether one row)."""
    lo, hi = np.broadcast_arrays(_ints(lo), _ints(hi))
    hi = np.maximum(np.minimum(hi, t.size), lo)
    C = max(t.cols, 1)
    rlo, clo = np.divmod(lo, C)
    rhi, chi = np.divmod(hi, C)
    return lo, hi, C, rlo, clo, rhi, chi, rlo == rhi


def flat_pieces(t: GmTensor, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of the row-major element range [lo, hi) per mover: a partial first row, whole rows, a partial
    last row, each fractal they touch listed once with all the range's bytes in it.

    Read or written, that costs and touches exactly what `listed_flat_pieces` (the three parts listed one
    after another, a fractal the first row shares with the whole rows listed twice) does: per mover the
    same bytes, the same fractals, each judged by its own last touch (pieces of 0 bytes, whatever their
    ids, are neither judged nor touched). It is built in one go on the fractal rows the range spans, in
    int32 (half the memory traffic; the sums GlobalMemory takes of it are int64 as before).
    """
    lo, hi, C, rlo, clo, rhi, chi, same = _row_range(t, lo, hi)
    if same.all():  # no mover leaves its row: the first part is all there is
        return listed_flat_pieces(t, lo, hi)
    R, Rp = max(t.mrows, 1), t.padded_rows
    grid_row = lambda r: (r // R) * Rp + r % R  # noqa: E731 (every matrix starts on a fresh fractal row)
    e1 = np.where(same, chi, C)  # the first row's columns [clo, e1)
    m0, m1 = rlo + 1, np.where(same, rlo + 1, rhi)  # the whole rows [m0, m1)
    e3 = np.where(same, 0, chi)  # the last row's columns [0, e3)
    first, whole, last = clo < e1, m1 > m0, e3 > 0
    # the fractal rows the range spans, from its first row's to its last row's
    top = np.where(first, rlo, np.where(whole, m0, rhi))
    bottom = np.where(last, rhi, np.where(whole, m1 - 1, rlo))
    b0 = grid_row(top) // FRACTAL
    span = np.where(first | whole | last, grid_row(bottom) // FRACTAL - b0 + 1, 0)
    NB, FC = int(span.max(initial=0)), t.fcols
    if NB == 0:
        empty = np.zeros((len(lo), 0), dtype=np.int64)
        return empty, empty
    band = b0[:, None] + np.arange(NB)
    # whole rows in each fractal row (as rect_pieces counts them, minus the grid rows past a matrix's end)
    p0 = grid_row(m0)
    p1 = np.where(whole, grid_row(np.maximum(m1 - 1, m0)) + 1, p0)
    rlo_, rhi_ = np.maximum(p0[:, None], band * FRACTAL), np.minimum(p1[:, None], (band + 1) * FRACTAL)
    matrix = band // (Rp // FRACTAL)
    pad = np.minimum(rhi_, (matrix + 1) * Rp) - np.maximum(rlo_, matrix * Rp + R)
    rows = np.maximum(np.maximum(rhi_ - rlo_, 0) - np.maximum(pad, 0), 0).astype(np.int32)
    col = np.arange(FC) * FRACTAL
    width = (np.minimum(C - col, FRACTAL) * t.itemsize).astype(np.int32)  # bytes of a row in each fractal column
    nbytes = rows[:, :, None] * width
    # the partial first row lies in the first fractal row of the span, the partial last row in the last
    head = np.maximum(np.minimum(e1[:, None], col + FRACTAL) - np.maximum(clo[:, None], col), 0) * t.itemsize
    nbytes[:, 0, :] += (head * first[:, None]).astype(np.int32)
    tail = np.maximum(np.minimum(e3[:, None], col + FRACTAL) - col, 0) * t.itemsize
    nbytes[np.arange(len(lo)), np.maximum(span - 1, 0), :] += (tail * last[:, None]).astype(np.int32)
    # past a mover's span the pieces have no bytes; their ids need only be in range
    band = np.minimum(band, t.blocks // FC - 1).astype(np.int32)
    blocks = band[:, :, None] * np.int32(FC) + np.arange(FC, dtype=np.int32)
    return blocks.reshape(len(lo), -1), nbytes.reshape(len(lo), -1)


def listed_flat_pieces(t: GmTensor, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """`flat_pieces` as three rectangles listed one after another: a partial first row, whole rows, a
    partial last row (the piece order share_pieces relies on)."""
    lo, hi, C, rlo, clo, rhi, chi, same = _row_range(t, lo, hi)
    parts = [rect_pieces(t, rlo, rlo + 1, clo, np.where(same, chi, C)),
             rect_pieces(t, rlo + 1, np.where(same, rlo + 1, rhi), 0, C),
             rect_pieces(t, rhi, rhi + 1, 0, np.where(same, 0, chi))]
    return np.concatenate([p[0] for p in parts], axis=1), np.concatenate([p[1] for p in parts], axis=1)


def share_pieces(t: GmTensor, part, parts, count) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of a strided access that moves `count` elements (per mover) as share `part` of `parts` of
    the tensor: the fractal ids are its proportional position, the bytes exact."""
    part, count = np.broadcast_arrays(_ints(part), _ints(count))
    lo = (part * t.size) // max(int(parts), 1)
    span = np.maximum(np.minimum(lo + count, t.size) - lo, 0)
    short = np.maximum(count - span, 0)  # elements read more than once (broadcast): charged on the first piece
    if not short.any():
        return flat_pieces(t, lo, lo + span)
    blocks, nbytes = listed_flat_pieces(t, lo, lo + span)  # the first piece as the three parts list it
    if nbytes.shape[1] == 0:
        blocks, nbytes = np.zeros((len(part), 1), np.int64), np.zeros((len(part), 1), np.int64)
    nbytes = nbytes.copy()
    nbytes[:, 0] += short * t.itemsize
    return blocks, nbytes


def gm_read(gm: GlobalMemory, t: GmTensor, pieces: tuple[np.ndarray, np.ndarray],
            key: np.ndarray | None = None) -> np.ndarray:
    """Cycles for each mover to read its pieces of `t` (GlobalMemory.read_pieces: L2 hits, HBM misses)."""
    blocks, nbytes = pieces
    return gm.read_pieces(t.name, blocks, nbytes, key)


def gm_write(gm: GlobalMemory, t: GmTensor, pieces: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Cycles for each mover to write its pieces of `t` (GlobalMemory.write_pieces)."""
    blocks, nbytes = pieces
    return gm.write_pieces(t.name, blocks, nbytes)


# --- vector units and UB slots -------------------------------------------------------------------

class VectorLanes:
    """The vector units of the cores: lane i of `Cores` is one AI core group (on 910B one AIC with two AIVs).

    Waves deal one tile to every vector unit: slot j is unit j // lanes of lane j % lanes, so a
    partial wave spreads over all lanes first. Each vector unit has its own UB and MTE2/MTE3 queues;
    a lane's pipe stands for its units working side by side, so a step costs the lane its slowest unit.
    """

    def __init__(self, ctx: LaunchContext):
        self.ctx = ctx
        self.target = ctx.target
        self.lanes = ctx.cores.count
        self.per = ctx.target.vector_per_cube
        self.slots = self.lanes * self.per

    def waves(self, units: int):
        """(tile ids, vector-unit slots) per wave."""
        # the vector units a launch starts (its head's share): those its widest wave deals a tile to
        self.ctx.vector_units = max(self.ctx.vector_units, min(units, self.slots))
        return spread(units, self.slots)

    def used(self, on: np.ndarray) -> np.ndarray:
        """The lanes (cores) that the slots `on` belong to, in order."""
        return np.unique(on % self.lanes)

    def per_lane(self, on: np.ndarray, cost) -> np.ndarray:
        """Each used lane's cost for per-tile costs on slots `on`: the slowest of its vector units."""
        padded = np.zeros(self.slots)
        padded[on] = cost
        return padded.reshape(self.per, self.lanes).max(axis=0)[self.used(on)]

    def vector(self, nbytes, passes: float) -> np.ndarray:
        """Cycles of one vector unit for `passes` instructions over `nbytes` (per tile) of operands."""
        # vector_cycles rates a whole lane (all its units); one unit alone has 1/per of that rate
        return vector_cycles(self.target, np.asarray(nbytes) * self.per, 1) * passes


class UbSlots:
    """Double-buffered UB slots of a streaming vector kernel, as set/wait flags: a load waits until its
    slot's previous tile was computed, a computation until its slot's previous result was stored."""

    def __init__(self, cores: Cores, buffers: int, waits: PipeWaits | None = None):
        self.cores = cores
        self.waits = waits  # where the pipes' idle time is booked, if counted
        self.nbuf = max(int(buffers), 1)
        self.in_free = np.zeros((self.nbuf, cores.count))
        self.out_free = np.zeros((self.nbuf, cores.count))
        self.n = 0

    def step(self, lanes: np.ndarray, load, vector=None, store=None, after=(), names=("load", "compute", "store")):
        """One tile step on `lanes`: MTE2 `load`, VECTOR `vector` (None: a plain copy), MTE3 `store`
        (None: the result stays in UB); returns when the tile is ready in UB."""
        s = self.n % self.nbuf
        self.n += 1
        cores, waits = self.cores, self.waits
        ready = issue(cores, waits, "MTE2", lanes, load, after, [self.in_free[s, lanes]], name=names[0])
        if vector is not None:
            ready = issue(cores, waits, "VECTOR", lanes, vector, [ready], [self.out_free[s, lanes]], name=names[1])
            self.in_free[s, lanes] = ready
        if store is not None:
            done = issue(cores, waits, "MTE3", lanes, store, [ready], name=names[2])
            self.out_free[s, lanes] = done
            if vector is None:
                self.in_free[s, lanes] = done
        return ready


def check_fault(ctx: LaunchContext) -> None:
    """The injected `ub_overflow` fault: the launch's tile does not fit UB at run time."""
    if ctx.fault == "ub_overflow":
        ub = ctx.target.buffer_bytes("ub")
        raise CapacityError("UB", 2 * ub, ub, 0, "the injected fault's tile")


def result_dtype(op: Operation, i: int, fallback: np.dtype) -> np.dtype:
    t = op.results[i].type if i < len(op.results) else None
    return t.dtype.np if t is not None else np.dtype(fallback)


# --- copy kernels --------------------------------------------------------------------------------

def read_flat(view: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of a (possibly strided) view in row-major order."""
    if view.flags.c_contiguous:
        return view.reshape(-1)[lo:hi]
    return view[np.unravel_index(np.arange(lo, hi), view.shape)]


def write_flat(view: np.ndarray, lo: int, hi: int, data: np.ndarray) -> None:
    """Store `data` as elements [lo, hi) of a (possibly strided) writable view."""
    if view.flags.c_contiguous:
        view.reshape(-1)[lo:hi] = data
    else:
        view[np.unravel_index(np.arange(lo, hi), view.shape)] = data


@attrs.define
class CopyPair:
    """One source view copied to one destination view of the same shape, with the GM tensors behind them."""

    src: np.ndarray
    dst: np.ndarray
    src_gm: GmTensor
    dst_gm: GmTensor


def copy_kernel(pairs: list[CopyPair], elems: int, buffers: int, ctx: LaunchContext, vector_passes: int = 0,
                name: str = "copy") -> None:
    """Move every pair tile by tile: MTE2 source -> UB, the vector unit reorders (when `vector_passes`),
    MTE3 UB -> destination."""
    cores, gm = ctx.cores, ctx.gm
    lanes = VectorLanes(ctx)
    slots = UbSlots(cores, buffers, ctx.waits)
    for pair in pairs:
        total = pair.src.size
        if total == 0:
            continue
        isz = pair.src.dtype.itemsize
        contiguous_src, contiguous_dst = pair.src.flags.c_contiguous, pair.dst.flags.c_contiguous
        nt = -(-total // elems)
        for wave, on in lanes.waves(nt):
            lo = wave * elems
            hi = np.minimum(lo + elems, total)
            w0, w1 = int(lo[0]), int(hi[-1])
            if ctx.compute:  # the numbers: the wave's tiles as one gather and one scatter
                write_flat(pair.dst, w0, w1, read_flat(pair.src, w0, w1))
            # the timing
            count = hi - lo
            src = flat_pieces(pair.src_gm, lo, hi) if contiguous_src else \
                share_pieces(pair.src_gm, wave, nt, count)
            load = lanes.per_lane(on, gm_read(gm, pair.src_gm, src))
            vec = lanes.per_lane(on, lanes.vector(count * isz, vector_passes)) if vector_passes else None
            dst = flat_pieces(pair.dst_gm, lo, hi) if contiguous_dst else \
                share_pieces(pair.dst_gm, wave, nt, count)
            store = lanes.per_lane(on, gm_write(gm, pair.dst_gm, dst))
            slots.step(lanes.used(on), load, vec, store, names=(f"load {name}", name, f"store {name}"))


class FlatTiledKernel(Kernel):
    """A kernel tiled as flat chunks of elements on the vector units (elementwise ops and copies), its
    template naming the kind: the vector tiling's TilingInterface."""

    TILING = VectorTiling
    TEMPLATE = tiling_rules.ELEMENTWISE

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> VectorTiling | Miss:
        return choice(lambda: tiling_rules.choose_elementwise_tiling(sig, target, buffers, self.TEMPLATE))

    def budget(self, tiling: VectorTiling, sig: OpSignature, target: Target) -> Budget:
        return tiling_rules.elementwise_budget(tiling, sig, target)

    def shrink(self, tiling: VectorTiling) -> tuple[VectorTiling, str] | None:
        return tiling_rules.shrink_elementwise(tiling)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[VectorTiling]:
        return tiling_rules.elementwise_candidates(sig, target, buffers, self.TEMPLATE)


class _CopyKernel(FlatTiledKernel):
    """Shared run: build the (source view, destination view) pairs, then move them."""

    VECTOR_PASSES = 0
    TEMPLATE = "DataCopy"

    def pairs(self, op: Operation, inputs: list[np.ndarray],
              outs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
        """(source view, destination view, operand index, result index) of every copy."""
        raise NotImplementedError

    def out_shapes(self, op: Operation, inputs: list[np.ndarray]) -> list[tuple[int, ...]]:
        types = [r.type for r in op.results]
        if all(t is not None and t.is_static for t in types):
            return [tuple(t.shape) for t in types]
        # shapes only: the op's own semantics on zero-stride stand-ins of the operands
        out = op.compute(*[np.broadcast_to(np.zeros((), dtype=np.bool_), a.shape) for a in inputs])
        out = out if isinstance(out, tuple) else (out,)
        return [tuple(np.shape(o)) for o in out]

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: VectorTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        elems, buffers = tiling.elems, tiling.buffers
        x = inputs[0]
        self.allocate(tiling, OpSignature.of_arrays(op, inputs), ctx.target,
                      f"{buffers} x the in and out tiles of {elems} elements")
        make = np.empty if ctx.compute else no_bytes_c  # timing only: results laid out as real ones, no bytes
        outs = [make(s, result_dtype(op, i, x.dtype)) for i, s in enumerate(self.out_shapes(op, inputs))]
        in_gm = [gm_tensor(ctx.gm, n, a.shape, a.dtype.itemsize) for n, a in zip(ctx.operand_names, inputs)]
        for i, j in self.shared(op):
            if i < len(ctx.operand_names) and j < len(ctx.result_names):
                alias(ctx.gm, ctx.operand_names[i], ctx.result_names[j])
        out_gm = [gm_tensor(ctx.gm, n, a.shape, a.dtype.itemsize) for n, a in zip(ctx.result_names, outs)]
        pairs = [CopyPair(s, d, in_gm[i], out_gm[j]) for s, d, i, j in self.pairs(op, inputs, outs)]
        copy_kernel(pairs, elems, buffers, ctx, self.VECTOR_PASSES, op.name[3:])
        return outs


@register_kernel
class TransposeKernel(_CopyKernel):
    """Output tiles gathered from the permuted source; the vector unit reorders each tile (VectorTranspose)."""

    OPS = ("ge.transpose",)
    VECTOR_PASSES = 1
    TEMPLATE = "VectorTranspose"

    def pairs(self, op, inputs, outs):
        return [(np.transpose(inputs[0], op.perm), outs[0], 0, 0)]


@register_kernel
class TransDataKernel(_CopyKernel):
    """ND <-> NZ: values unchanged; every byte moves once and the vector unit rearranges the fractals."""

    OPS = ("ge.trans_data",)
    VECTOR_PASSES = 1
    TEMPLATE = "TransData"

    def pairs(self, op, inputs, outs):
        return [(inputs[0], outs[0], 0, 0)]


@register_kernel
class ConcatKernel(_CopyKernel):
    """Each operand is copied into its region of the output."""

    OPS = ("ge.concat",)

    def pairs(self, op, inputs, outs):
        axis = op.axis % outs[0].ndim
        pairs, at = [], 0
        for i, x in enumerate(inputs):
            region = (slice(None),) * axis + (slice(at, at + x.shape[axis]),)
            pairs.append((x, outs[0][region], i, 0))
            at += x.shape[axis]
        return pairs


@register_kernel
class SplitKernel(_CopyKernel):
    """Each result is copied out of its region of the operand; where every piece is one run of the operand's bytes
    (nothing but axes of size 1 before the cut axis: a decode step's q/k/v out of the merged projection), the
    pieces are views, as torch's split returns them: no launch cost, each sharing the operand's residency."""

    OPS = ("ge.split",)

    def needs_tiling(self, sig: OpSignature) -> bool:
        x = sig.operands[0]
        if x is None or not x.is_static or x.format != "ND" or not x.rank:
            return True
        axis = sig.attr("axis", 0) % x.rank
        return math.prod(x.shape[:axis]) != 1

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: VectorTiling | None,
            ctx: LaunchContext) -> list[np.ndarray]:
        if tiling is not None:
            return super().run(op, inputs, tiling, ctx)
        for name in ctx.result_names if ctx.operand_names else ():
            alias(ctx.gm, ctx.operand_names[0], name)
        return [np.ascontiguousarray(piece) for piece in op.compute(inputs[0])]

    def pairs(self, op, inputs, outs):
        x = inputs[0]
        axis = op.axis % x.ndim
        pairs, at = [], 0
        for j, size in enumerate(op.sizes):
            region = (slice(None),) * axis + (slice(at, at + size),)
            pairs.append((x[region], outs[j], 0, j))
            at += size
        return pairs


@register_kernel
class SliceKernel(_CopyKernel):
    """The result is copied out of the sliced (strided) region of the operand; where that region is one run of the
    operand's bytes (steps of 1, nothing but axes of size 1 before the first cut axis and whole axes after it: a
    decode step's q/k/v out of Phi-3's fused projection), the result is a view, as torch's slice is: no launch
    cost, sharing the operand's residency (as the split's pieces)."""

    OPS = ("ge.slice",)

    def needs_tiling(self, sig: OpSignature) -> bool:
        x, r = sig.operands[0], sig.results[0]
        if x is None or r is None or not x.is_static or not r.is_static or x.format != "ND" or not x.rank:
            return True
        if any(step != 1 for step in sig.attr("steps", None) or ()):
            return True
        cut = next((i for i, (a, b) in enumerate(zip(x.shape, r.shape)) if a != b), x.rank)
        return math.prod(r.shape[:cut]) != 1 or tuple(r.shape[cut + 1:]) != tuple(x.shape[cut + 1:])

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: VectorTiling | None,
            ctx: LaunchContext) -> list[np.ndarray]:
        if tiling is not None:
            return super().run(op, inputs, tiling, ctx)
        if ctx.operand_names:
            alias(ctx.gm, ctx.operand_names[0], ctx.result_names[0])
        return [np.ascontiguousarray(op.compute(inputs[0]))]

    def pairs(self, op, inputs, outs):
        return [(op.compute(inputs[0]), outs[0], 0, 0)]


@register_kernel
class ScatterUpdateKernel(_CopyKernel):
    """ge.index_put with one index tensor and no accumulation (the KV cache's update, torch's index_copy), as
    ops-transformer's ScatterUpdate: the operand copied to the result, then each indexed slab of values written
    over its place (an update whose result does not share the operand's memory moves the operand once; the
    indexed slabs are the only other bytes; `in_place`, the result is the operand's memory and only the slabs
    move). Several index tensors or accumulation stay on the AI CPU."""

    OPS = ("ge.index_put",)
    TEMPLATE = "ScatterUpdate"

    def refuses(self, sig: OpSignature, target: Target) -> str | None:
        if sig.attr("accumulate", False):
            return "it accumulates (duplicate indices add up in order, as np.add.at), which ScatterUpdate does not"
        if len(sig.operands) != 3:
            return f"it takes {len(sig.operands) - 2} index tensors; ScatterUpdate writes slabs along one axis"
        return super().refuses(sig, target)

    @staticmethod
    def _copied(sig: OpSignature) -> OpSignature:
        """The copy the tiles are chosen for: the operand into the result (the values' slabs stream through the
        same flat tiles)."""
        return OpSignature(sig.name, sig.operands[:1], sig.results, sig.attributes)

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> VectorTiling | Miss:
        return super().choose(self._copied(sig), target, buffers)

    def budget(self, tiling: VectorTiling, sig: OpSignature, target: Target) -> Budget:
        return super().budget(tiling, self._copied(sig), target)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[VectorTiling]:
        return super().candidates(self._copied(sig), target, buffers)

    def out_shapes(self, op, inputs):
        return [inputs[0].shape]

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: VectorTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        x, values, index = inputs
        axis = op.axis % x.ndim
        index = self.positions(index, x.shape[axis], axis, ctx)
        outs = super().run(op, [x, values, index], tiling, ctx)
        if op.attr("in_place") and ctx.compute:  # the operand's bytes stay where they are: the numbers, untimed
            outs = [op.compute(x, values, index)]
        return outs

    @staticmethod
    def positions(index: np.ndarray, dim: int, axis: int, ctx: LaunchContext) -> np.ndarray:
        """The indices as positions along a dimension of `dim`: checked (a device fault outside it), counted from
        the end made positive; timing only, the indices are stand-ins whose values are unknown: costed as one run
        of consecutive positions, a step's new tokens (what a KV cache writes)."""
        if ctx.compute:
            problem = index_problem(index, dim, axis, "index_put")
            if problem is not None:  # a write outside the tensor is an access the device faults on
                raise DeviceFault(problem)
        if dim:
            index = np.asarray(index, dtype=np.int64)
            if not ctx.compute:
                index = np.arange(index.size, dtype=np.int64).reshape(index.shape)
            index = np.mod(index, dim)
        return index

    def shared(self, op: Operation) -> list[tuple[int, int]]:
        return [(0, 0)] if op.attr("in_place") else []

    def pairs(self, op, inputs, outs):
        x, values, index = inputs
        return self.slab_pairs(x, values, index, op.axis % x.ndim, outs[0], (0, 1), 0, op.attr("in_place"))

    @staticmethod
    def slab_pairs(x: np.ndarray, values: np.ndarray, index: np.ndarray, axis: int, out: np.ndarray,
                   operands: tuple[int, int], result: int, in_place: bool = False) -> list:
        """The copies of one update into result `result`: x (operand operands[0]) whole, then the slabs of the
        values (operand operands[1]); `in_place`, the result is x's memory and only the slabs move."""
        where = np.asarray(index).reshape(-1).astype(np.int64)  # in range, from the end made positive (run)
        slabs = np.broadcast_to(values, x.shape[:axis] + index.shape + x.shape[axis + 1:])
        slabs = slabs.reshape(x.shape[:axis] + (where.size,) + x.shape[axis + 1:])
        pairs = [] if in_place else [(x, out, operands[0], result)]
        # one slab per index, in order (a duplicate keeps the last value written, as the op's semantics says);
        # a run of consecutive positions (a step's new tokens) is one slab
        start = 0
        for i in range(1, where.size + 1):
            if i == where.size or where[i] != where[i - 1] + 1:
                lo, hi = int(where[start]), int(where[i - 1]) + 1
                dst = (slice(None),) * axis + (slice(lo, hi),)
                src = (slice(None),) * axis + (slice(start, i),)
                pairs.append((slabs[src], out[dst], operands[1], result))
                start = i
        return pairs


@register_kernel
class ScatterPairKernel(ScatterUpdateKernel):
    """ge.index_put_pair: two ScatterUpdates at the same positions in one launch (ATB's ReshapeAndCache writing K
    and V): both operands copied to their results and both tensors' slabs written, through the same flat tiles;
    one launch head instead of two."""

    OPS = ("ge.index_put_pair",)

    def refuses(self, sig: OpSignature, target: Target) -> str | None:
        return _CopyKernel.refuses(self, sig, target)

    @staticmethod
    def _copied(sig: OpSignature) -> OpSignature:
        """The copies the tiles are chosen for: both operands into their results."""
        return OpSignature(sig.name, sig.operands[:2], sig.results, sig.attributes)

    def out_shapes(self, op, inputs):
        return [inputs[0].shape, inputs[1].shape]

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: VectorTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        x, y, xv, yv, index = inputs
        axis = op.axis % x.ndim
        index = self.positions(index, x.shape[axis], axis, ctx)  # y is as long along axis (the op's shape rule)
        outs = _CopyKernel.run(self, op, [x, y, xv, yv, index], tiling, ctx)
        if op.attr("in_place") and ctx.compute:  # the operands' bytes stay where they are: the numbers, untimed
            outs = list(op.compute(x, y, xv, yv, index))
        return outs

    def shared(self, op: Operation) -> list[tuple[int, int]]:
        return [(0, 0), (1, 1)] if op.attr("in_place") else []

    def pairs(self, op, inputs, outs):
        x, y, xv, yv, index = inputs
        axis = op.axis % x.ndim
        in_place = op.attr("in_place")
        return (self.slab_pairs(x, xv, index, axis, outs[0], (0, 2), 0, in_place)
                + self.slab_pairs(y, yv, index, axis, outs[1], (1, 3), 1, in_place))


@register_kernel
class ReshapeKernel(_CopyKernel):
    """A view of ND data: no launch cost, the result aliases the operand. Of NZ data (the tile pass gave
    it a tiling) the fractals are rearranged: a copy with a vector pass."""

    OPS = ("ge.reshape",)
    VECTOR_PASSES = 1

    def pairs(self, op, inputs, outs):
        return [(op.compute(inputs[0]), outs[0], 0, 0)]

    def needs_tiling(self, sig: OpSignature) -> bool:
        # a reshape is a view of ND data; of NZ fractals it is a real relayout
        return any(t is not None and t.format != "ND" for t in sig.operands)

    def views(self, op: Operation) -> list[tuple[int, int]]:
        return [] if self.needs_tiling(OpSignature.of(op)) else [(0, 0)]

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: VectorTiling | None,
            ctx: LaunchContext) -> list[np.ndarray]:
        if tiling is not None:
            return super().run(op, inputs, tiling, ctx)
        if ctx.operand_names and ctx.result_names:
            alias(ctx.gm, ctx.operand_names[0], ctx.result_names[0])
        return [op.compute(inputs[0])]


@register_kernel
class GatherKernel(Kernel):
    """Table rows copied by run-time index: MTE2 the tile's indices and its rows, MTE3 the rows out."""

    OPS = ("ge.gather",)
    TILING = GatherTiling

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> GatherTiling | Miss:
        return choice(lambda: gather_tiling.choose_gather_tiling(sig, target, buffers))

    def budget(self, tiling: GatherTiling, sig: OpSignature, target: Target) -> Budget:
        return gather_tiling.gather_budget(tiling, sig, target)

    def shrink(self, tiling: GatherTiling) -> tuple[GatherTiling, str] | None:
        return gather_tiling.shrink_gather(tiling)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[GatherTiling]:
        return gather_tiling.gather_candidates(sig, target, buffers)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: GatherTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        table, indices = inputs
        axis = normalize_axis(op.axis, table.ndim)
        outer, dim, inner = math.prod(table.shape[:axis]), table.shape[axis], math.prod(table.shape[axis + 1:])
        n = indices.size
        R = outer * n
        rows, cols, buffers = tiling.rows, max(tiling.cols, 1), tiling.buffers
        self.allocate(tiling, OpSignature.of_arrays(op, inputs), ctx.target,
                      f"{buffers} x the indices and {rows} rows of {cols} elements")
        out = np.empty(table.shape[:axis] + indices.shape + table.shape[axis + 1:], dtype=table.dtype)
        # an index outside the table is an access the device faults on, rows of no elements too (as torch's
        # embedding and the op's semantics refuse it)
        problem = index_problem(indices, dim, axis) if ctx.compute else None
        if problem is not None:
            raise DeviceFault(problem)
        if out.size == 0:
            return [out]
        if ctx.compute:
            index = indices.reshape(-1).astype(np.int64) % dim
            table3, out2 = table.reshape(outer, dim, inner), out.reshape(R, inner)
        gm = ctx.gm
        table_gm = gm_tensor(gm, ctx.operand_names[0], table.shape, table.dtype.itemsize)
        index_gm = gm_tensor(gm, ctx.operand_names[1], indices.shape, indices.dtype.itemsize)
        out_gm = gm_tensor(gm, ctx.result_names[0], out.shape, out.dtype.itemsize)
        pieces = -(-inner // cols)
        blocks = -(-R // rows)
        nt = blocks * pieces
        lanes = VectorLanes(ctx)
        slots = UbSlots(ctx.cores, buffers, ctx.waits)
        latency = gm.latency
        for wave, on in lanes.waves(nt):
            block, piece = wave // pieces, wave % pieces
            r0 = block * rows
            r1 = np.minimum(r0 + rows, R)
            c0 = piece * cols
            c1 = np.minimum(c0 + cols, inner)
            count = r1 - r0
            if ctx.compute:  # the numbers: the wave's rows, by index (pieces of rows one tile at a time)
                if pieces == 1:
                    r = np.arange(int(r0[0]), int(r1[-1]))
                    out2[r] = table3[r // n, index[r % n]]
                else:
                    for a, b, x, y in zip(r0, r1, c0, c1):
                        r = np.arange(a, b)
                        out2[r, x:y] = table3[r // n, index[r % n], x:y]
            # the timing: the tile's indices (one DMA), its rows (one DMA each), its rows out
            idx = flat_pieces(index_gm, r0, r1) if outer == 1 else share_pieces(index_gm, block, blocks, count)
            load = gm_read(gm, index_gm, idx)
            load = load + gm_read(gm, table_gm, share_pieces(table_gm, wave, nt, count * (c1 - c0)))
            load = load + (count - 1) * latency
            if pieces == 1:
                store = gm_write(gm, out_gm, flat_pieces(out_gm, r0 * inner, r1 * inner))
            else:  # pieces of rows are strided in the output: one DMA a row
                store = gm_write(gm, out_gm, share_pieces(out_gm, wave, nt, count * (c1 - c0))) + (count - 1) * latency
            slots.step(lanes.used(on), lanes.per_lane(on, load), None, lanes.per_lane(on, store),
                       names=("load indices and rows", "gather", "store rows"))
        return [out]
