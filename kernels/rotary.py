"""The rotary position embedding kernel (`ge.rotary_embedding`), as ops-transformer's RotaryPositionEmbedding
runs it: whole rows of the head dim in UB, `rows` a tile per vector unit.

    per tile   MTE2 the x rows (and the cos/sin rows they use, unless the tables are small enough to stay
               resident in UB, loaded once per unit), VECTOR the rotation, MTE3 the rows; 2 UB slots overlap.
    VECTOR     over the rotated part, the obvious Ascend C sequence: Mul(x, cos); the rotated copy (half:
               Muls(-1) of x2 and a copy of x1, one pass over the part; interleave: a Gather of the pair
               partners and a Muls(-1) of the odd lanes, two); Mul(rotated, sin); Add. The passed-through
               part is one copy. 16-bit floats are cast to f32 on the way in and back on the way out.

The numbers are the op's own `compute` on each wave's rows, rounded once to the result dtype.

q and k in one launch (the op's fourth operand): k's rows follow q's in one row space that the tiles cut, each
row read from and written to its own tensor, so one launch costs what the two would less one launch head.

Tables shared by the heads (cos/sin [1, 1, S, r] against x [B, N, S, D]: every head turns position s by the same
angle) that are too big to stay resident are walked as ops-transformer's RotaryPositionEmbedding walks its
broadcast ("ABA") case (posembedding/rotary_position_embedding/op_kernel/arch35/
rotary_position_embedding_aba_and_ba.h: the cores split S; per UB block of S positions, CopyInCosAndSin once, then
the loops over B and N CopyInQ / Compute / CopyOutQ with the same cos/sin in UB): each vector unit owns a block
of `rows` positions and turns it in every head of q and k, loading its cos/sin rows with the first head's tile only.
The tables then cross MTE2 once, not once per head. It is taken where the blocks give every core of the tiling one
(S at least the cores: a prefill); a decode step's one position keeps the row walk, which spreads the heads over
the units.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from geir.ir import Operation
from geir.kernels.base import Kernel, LaunchContext, issue, register_kernel
from geir.kernels.data_movement import UbSlots, VectorLanes, check_fault, flat_pieces, gm_read, gm_tensor, gm_write, \
    result_dtype, share_pieces
from geir.kernels.tiling import (
    F32_BYTES,
    Budget,
    KernelTiling,
    Miss,
    OpSignature,
    TilingError,
    Untiled,
    align,
    check_buffers,
    choice,
    cut_leading,
    halve,
    never_printed,
    product,
    units_worth_starting,
)
from geir.ops.numerics import round_to
from geir.target_npu.target import Target
from geir.types import DType

TEMPLATE = "RotaryEmbedding"
# VECTOR instructions per element of the rotated part (see the module docstring), by mode
ROTATE_PASSES = {"half": 4, "interleave": 5}
PASS_THROUGH_PASSES = 1
CAST_PASSES = 2  # 16-bit floats: one cast in, one out


@attrs.frozen(kw_only=True)
class RotaryTiling(KernelTiling):
    """`rows` whole rows of the head dim a tile per vector unit."""

    TEMPLATES = (TEMPLATE,)

    template: str
    rows: int
    buffers: int
    cores: int
    ub_bytes: int
    work_units: int | None = never_printed(None)
    rule: str = never_printed("")

    @property
    def blocks(self) -> dict[str, int]:
        return {"rows": self.rows}


@attrs.frozen
class _Layout:
    """One op's UB use: resident table bytes, bytes per row of a tile, the rows, and which tables stream."""

    fixed: int
    per_row: int
    rows: int | None
    streamed_tables: tuple[bool, bool]


def _is_half(dtype: DType) -> bool:
    return dtype in (DType.f16, DType.bf16)


def _layout(sig: OpSignature, chip: Target, buffers: int) -> _Layout:
    """What a row tile keeps in UB: x and result rows and streamed cos/sin rows double-buffered, two f32 working
    rows of the rotated part (the rotated copy and the sum), an f32 copy of the row where 16-bit floats are
    computed; cos/sin tables smaller than x that fit an eighth of UB stay resident."""
    if any(t is None for t in sig.operands + sig.results):
        raise Untiled("its types are unknown")
    x, cos, sin = sig.operands[:3]
    rotated = sig.operands[:1] + sig.operands[3:]  # q, and k where one launch turns both
    out = sig.results[0]
    d = x.shape[-1] if x.rank else None
    if d is None:
        raise Untiled("the head dim is dynamic, and a row must fit in UB")
    r = sig.attr("rotary_dim", d)
    block, ub = chip.memory.ub_block_bytes, chip.buffer_bytes("ub")
    sizes = [product(t.shape) for t in rotated]
    x_size = None if None in sizes else sum(sizes)
    resident = [x_size is not None and product(t.shape) is not None and product(t.shape) < x_size
                and t.nbytes * 8 <= ub for t in (cos, sin)]
    fixed = sum(align(t.nbytes, block) for t, res in zip((cos, sin), resident) if res)
    streamed = (x.dtype.itemsize + out.dtype.itemsize) * d + sum(
        t.dtype.itemsize * r for t, res in zip((cos, sin), resident) if not res)
    working = F32_BYTES * (2 * r + (d if _is_half(x.dtype) else 0))
    rows = [product(t.shape[:-1]) for t in rotated]
    return _Layout(fixed, align(streamed * buffers + working, block), None if None in rows else sum(rows),
                   (not resident[0], not resident[1]))


def _shared_positions(sig: OpSignature) -> int | None:
    """S, where the cos/sin tables are shared by every head of every rotated tensor ([1, ..., 1, S, r] against
    x [..., S, D], S known and above 1); else None."""
    rotated = sig.operands[:1] + sig.operands[3:]
    cos, sin = sig.operands[1:3]
    if any(t is None or t.rank < 2 for t in (*rotated, cos, sin)) or cos.shape != sin.shape:
        return None
    s = rotated[0].shape[-2]
    if s is None or s < 2 or any(t.shape[-2] != s for t in rotated) or cos.shape[-2] != s:
        return None
    return s if all(d == 1 for d in cos.shape[:-2]) else None


def _head_walk(sig: OpSignature, lay: _Layout, cores: int) -> int | None:
    """S, when a launch over `cores` cores walks the heads with the tables held (the module docstring): streamed
    tables shared by the heads, and at least one position for every core."""
    s = _shared_positions(sig)
    if s is None or not any(lay.streamed_tables) or s < cores:
        return None
    return s


def _tiling(rows: int, buffers: int, lay: _Layout, chip: Target, rule: str) -> RotaryTiling:
    work = None if lay.rows is None else -(-lay.rows // rows)
    cores = chip.vector_cores if work is None else min(work, chip.vector_cores)
    return RotaryTiling(template=TEMPLATE, rows=rows, buffers=buffers, cores=cores,
                        ub_bytes=lay.fixed + rows * lay.per_row, work_units=work, rule=rule)


def _moved_bytes(sig: OpSignature) -> int | None:
    sizes = [t.nbytes for t in list(sig.operands) + list(sig.results)]
    return None if any(n is None for n in sizes) else sum(sizes)


def choose_rotary_tiling(sig: OpSignature, chip: Target, buffers: int = 2) -> RotaryTiling:
    """As many whole rows a tile as UB holds and the vector units worth starting can share."""
    check_buffers(buffers)
    lay = _layout(sig, chip, buffers)
    ub = chip.buffer_bytes("ub")
    fit = (ub - lay.fixed) // lay.per_row
    if fit < 1:
        raise TilingError(f"no rotary_embedding tiling fits {chip.name}: one row needs {lay.fixed + lay.per_row} "
                          f"bytes of UB, which holds {ub}")
    units = units_worth_starting(chip, _moved_bytes(sig), chip.vector_cores)
    rows = fit if lay.rows is None else max(1, min(fit, -(-lay.rows // units)))
    tiling = _tiling(rows, buffers, lay, chip, "")
    work = tiling.work_units
    rule = (f"{rows} rows of {sig.operands[0].shape[-1]} a tile, {lay.per_row} UB bytes a row with {buffers} "
            f"buffers; {'an unknown number of' if work is None else work} work units over {tiling.cores} cores")
    if _shared_positions(sig) is not None and any(lay.streamed_tables):
        rule += ("; where the positions are at least the cores, each core turns its block of them in every head, "
                 "up to that many a tile, with their cos/sin loaded once")
    return attrs.evolve(tiling, rule=rule)


@register_kernel
class RotaryEmbeddingKernel(Kernel):
    """`ge.rotary_embedding` over whole rows of the head dim."""

    OPS = ("ge.rotary_embedding",)
    TILING = RotaryTiling

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> RotaryTiling | Miss:
        return choice(lambda: choose_rotary_tiling(sig, target, buffers))

    def budget(self, tiling: RotaryTiling, sig: OpSignature, target: Target) -> Budget:
        lay = _layout(sig, target, tiling.buffers)
        return Budget(lay.fixed + tiling.rows * lay.per_row, 0, 0, 0, 0)

    def shrink(self, tiling: RotaryTiling) -> tuple[RotaryTiling, str] | None:
        """Half the rows a tile: each row is rotated alone, bit-identical."""
        return halve(tiling, "rows", 1)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[RotaryTiling]:
        """Row tiles cutting the rows into a power of two of pieces or into pieces for every vector unit
        (once, twice, four times over); largest first."""
        try:
            lay = _layout(sig, target, buffers)
        except Untiled:
            return []
        fit = (target.buffer_bytes("ub") - lay.fixed) // lay.per_row
        if fit < 1 or lay.rows is None:
            return []
        pieces = {1 << i for i in range(max(lay.rows, 1).bit_length())} | {target.vector_cores * m for m in (1, 2, 4)}
        counts = {max(1, min(fit, -(-lay.rows // p))) for p in pieces}
        return [_tiling(n, buffers, lay, target, f"candidate {n} rows a tile") for n in sorted(counts, reverse=True)]

    def check_instance(self, sig: OpSignature, tiling: KernelTiling) -> OpSignature:
        """Fewer leading rows: each row is rotated alone (a table varying along the cut axis is cut alike)."""
        x = sig.operands[0]
        return cut_leading(sig, x.rank) if x is not None and x.rank >= 2 else sig

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: RotaryTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        x, cos, sin = inputs[:3]
        xs = inputs[:1] + inputs[3:]  # q, and k where one launch turns both: their rows one after the other
        sig = OpSignature.of_arrays(op, inputs)
        lay = _layout(sig, ctx.target, tiling.buffers)
        self.allocate(tiling, sig, ctx.target, f"{tiling.buffers} x {tiling.rows} rows and their f32 working rows")
        out_dt = result_dtype(op, 0, x.dtype)
        d, r = x.shape[-1], op.rotary_dim
        counts = [math.prod(t.shape[:-1]) for t in xs]
        starts = np.cumsum([0] + counts)  # each tensor's first row in the joint row space
        R = int(starts[-1])
        out = np.empty((R, d), dtype=out_dt)
        if R == 0 or d == 0:
            return self._results(out, xs, starts)
        rows = tiling.rows
        gm, cores = ctx.gm, ctx.cores
        lanes = VectorLanes(ctx)
        names = ctx.operand_names[:1] + ctx.operand_names[3:]
        x_gms = [gm_tensor(gm, n, t.shape, t.dtype.itemsize) for n, t in zip(names, xs)]
        tables = [gm_tensor(gm, n, t.shape, t.dtype.itemsize) for n, t in zip(ctx.operand_names[1:3], (cos, sin))]
        out_gms = [gm_tensor(gm, n, t.shape, out.dtype.itemsize) for n, t in zip(ctx.result_names, xs)]
        nt = -(-R // rows)
        if ctx.compute:  # the tables laid out as x's rows (a broadcast table gathered as the rows read it)
            x2 = np.concatenate([np.ascontiguousarray(t).reshape(-1, d) for t in xs])
            c2, s2 = (np.concatenate([np.broadcast_to(table, t.shape[:-1] + (r,)).reshape(-1, r) for t in xs])
                      for table in (cos, sin))
            # each row is turned alone, so the rows of every tile at once are the tiles' rows bit for bit
            out[:] = round_to(op.rotate_one(x2, c2, s2), out_dt)
        slots = UbSlots(cores, tiling.buffers, ctx.waits)
        half = x.dtype.name in ("float16", "bfloat16") or np.dtype(out_dt).name in ("float16", "bfloat16")
        passes = ROTATE_PASSES[op.mode] + (CAST_PASSES if half else 0)
        positions = _head_walk(sig, lay, tiling.cores)
        if positions is not None:
            self._head_walk(ctx, lanes, slots, x_gms, tables, out_gms, lay, positions, min(tiling.cores, lanes.slots),
                            rows, d, r, passes)
            return self._results(out, xs, starts)
        ready = self._load_resident(ctx, lanes, [t for t, s in zip(tables, lay.streamed_tables) if not s], nt)
        for wave, on in lanes.waves(nt):
            lo, hi = wave * rows, np.minimum(wave * rows + rows, R)
            count = hi - lo
            load = np.zeros(len(wave))
            for g, first, last in zip(x_gms, starts[:-1], starts[1:]):  # each tile's rows in each tensor
                a, b = np.clip(lo, first, last) - first, np.clip(hi, first, last) - first
                load = load + gm_read(gm, g, flat_pieces(g, a * d, b * d))
            for g, streamed in zip(tables, lay.streamed_tables):
                if streamed:
                    load = load + gm_read(gm, g, share_pieces(g, wave, nt, count * r))
            vec = lanes.vector(count * r * F32_BYTES, passes)
            if r < d:
                vec = vec + lanes.vector(count * (d - r) * F32_BYTES, PASS_THROUGH_PASSES)
            store = np.zeros(len(wave))
            for g, first, last in zip(out_gms, starts[:-1], starts[1:]):
                a, b = np.clip(lo, first, last) - first, np.clip(hi, first, last) - first
                store = store + gm_write(gm, g, flat_pieces(g, a * d, b * d))
            used = lanes.used(on)
            slots.step(used, lanes.per_lane(on, load), lanes.per_lane(on, vec), lanes.per_lane(on, store),
                       after=[ready[used]], names=("load rows", "rotary_embedding", "store rows"))
        return self._results(out, xs, starts)

    @staticmethod
    def _head_walk(ctx: LaunchContext, lanes: VectorLanes, slots: UbSlots, x_gms: list, tables: list, out_gms: list,
                   lay: _Layout, s: int, units: int, rows: int, d: int, r: int, passes: int) -> None:
        """The tiles of the head walk (module docstring): the S positions split into one block per vector unit (the
        real tiling's blockFactorS), each block turned `sub` positions at a time (its ubFactorS) in as many heads a
        tile as the tiling's `rows` rows hold (its ubFactorN; the UB the tiling budgets), the heads of q, then of k;
        a streamed table's rows come in with the first tile of each piece of the block only and stay in UB for
        the others. A tile's heads are one DMA of one piece per head (CopyInQ's loop mode)."""
        block = -(-s // units)
        sub = min(rows, block)
        per_tile = max(1, rows // sub)
        chunks = [(g, o, list(range(h, min(h + per_tile, g.size // (s * d)))))
                  for g, o in zip(x_gms, out_gms) for h in range(0, g.size // (s * d), per_tile)]
        (ids, on), = lanes.waves(units)

        def pieces(g, heads, s0, s1):
            parts = [flat_pieces(g, (h * s + s0) * d, (h * s + s1) * d) for h in heads]
            return tuple(np.concatenate([p[i] for p in parts], axis=1) for i in (0, 1))

        for k in range(-(-block // sub)):
            s0 = np.minimum(ids * block + k * sub, s)
            s1 = np.minimum(np.minimum(s0 + sub, (ids + 1) * block), s)
            busy = s1 > s0
            s0, s1, w_on = s0[busy], s1[busy], on[busy]
            if not len(w_on):
                break
            count = s1 - s0
            used = lanes.used(w_on)
            for i, (g, o, heads) in enumerate(chunks):
                n = count * len(heads)
                vec = lanes.vector(n * r * F32_BYTES, passes)
                if r < d:
                    vec = vec + lanes.vector(n * (d - r) * F32_BYTES, PASS_THROUGH_PASSES)
                load = gm_read(ctx.gm, g, pieces(g, heads, s0, s1))
                if i == 0:  # CopyInCosAndSin: the piece's table rows, held in UB for every tile after
                    for t, streamed in zip(tables, lay.streamed_tables):
                        if streamed:
                            width = t.size // s
                            load = load + gm_read(ctx.gm, t, flat_pieces(t, s0 * width, s1 * width))
                store = gm_write(ctx.gm, o, pieces(o, heads, s0, s1))
                slots.step(used, lanes.per_lane(w_on, load), lanes.per_lane(w_on, vec), lanes.per_lane(w_on, store),
                           names=("load rows" + (" and cos/sin" if i == 0 else ""), "rotary_embedding",
                                  "store rows"))

    @staticmethod
    def _results(out: np.ndarray, xs: list[np.ndarray], starts: np.ndarray) -> list[np.ndarray]:
        """The joint rows cut back into each rotated tensor's result."""
        return [out[a:b].reshape(t.shape) for t, a, b in zip(xs, starts[:-1], starts[1:])]

    @staticmethod
    def _load_resident(ctx: LaunchContext, lanes: VectorLanes, tensors: list, units: int) -> np.ndarray:
        """Every vector unit that will run a tile loads the resident tables once; the lanes' ready events."""
        cores = ctx.cores
        ready = np.zeros(cores.count)
        movers = min(units, lanes.slots)
        on = np.arange(movers)
        used = lanes.used(on)
        for t in tensors:
            pieces = flat_pieces(t, np.zeros(movers, np.int64), np.full(movers, t.size))
            cost = lanes.per_lane(on, gm_read(ctx.gm, t, pieces, key=np.zeros(movers)))
            ready[used] = issue(cores, ctx.waits, "MTE2", used, cost, [ready[used]], name=f"load resident {t.name}")
        return ready
