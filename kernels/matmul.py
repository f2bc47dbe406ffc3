"""Matmul on the cube: ge.matmul and ge.fused_matmul (bias and activation epilogue), tiled in base blocks.

Output tiles m x n of every batch item are the work units, dealt round-robin to the cube cores
(ops-transformer's BMM basic-block scheme); a wave runs one unit per core, all of them in one
batched numpy step per k step:

    MTE2  the A block (m x k) and the B block (k x n), GM -> L1 slot (step % buffers), through ctx.gm
    MTE1  both blocks L1 -> L0A / L0B     CUBE  mmad, f32 accumulate in L0C (slot per unit)
    ...   next k step: with 2 buffers its loads wait only for the slot the step before last freed,
          so they overlap this step's MTE1 and CUBE (the slot-free events of the FlashAttention kernel)
    FIXP  L0C -> GM, rounded to the result dtype; or, with an activation, L0C -> UB in f32, VECTOR
          the activation and the cast, MTE3 UB -> GM (template MatmulEpilogue)

Numbers: the cube takes its operands in their dtype (f16, bf16 = ml_dtypes.bfloat16, f32) and
accumulates in f32 across the k steps; the epilogue is `FusedMatmul.epilogue` (bias add, then the
activation op's own compute) on the f32 accumulator, before the one rounding. The bias tile is
loaded into L1 with the first k step and joins the accumulator on its way out of L0C.

Layouts: transpose_a / transpose_b read the stored matrices' blocks transposed (the cube's load
path transposes fractals for free). A matrix stored NZ (fractal-major) holds the same values as
ND: only the DMA pattern differs (contiguous 16 x 16 fractals instead of strided rows), and the
cost model charges bytes, not bursts, so the kernel treats both alike; on targets without ND->NZ
on load the layout pass has already put trans_data in front of the cube.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from geir.ir import Operation
from geir.kernels import matmul_tiling as tiling_rules
from geir.kernels.base import Kernel, LaunchContext, PipeWaits, allocate, register_kernel
from geir.kernels.data_movement import (
    FRACTAL,
    GmTensor,
    TileSets,
    check_fault,
    gm_read,
    gm_tensor,
    gm_write,
    rect_pieces,
    result_dtype,
    share_pieces,
)
from geir.kernels.matmul_tiling import MatmulTiling, matmul_budget
from geir.kernels.tiling import Budget, KernelTiling, Miss, OpSignature, cube_refuses
from geir.kernels.vector import elementwise_passes
from geir.ops.numerics import round_to
from geir.target_npu.sim import (
    PIPES,
    Cores,
    GlobalMemory,
    PipeInterval,
    SetPool,
    Transfer,
    spread,
    vector_cycles,
    whole_sums,
)
from geir.target_npu.target import Target

_F32 = np.float32
_CUBE_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_ACTIVATION_OPS = {"relu": "ge.relu", "gelu": "ge.gelu", "gelu_tanh": "ge.gelu", "silu": "ge.silu"}


@register_kernel
class MatmulKernel(Kernel):
    """a @ b (batch broadcast, optional transposes), with a bias/activation epilogue for fused_matmul."""

    OPS = ("ge.matmul", "ge.fused_matmul")
    TILING = MatmulTiling

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> MatmulTiling | Miss:
        return tiling_rules.choose(sig, target, buffers)

    def refuses(self, sig: OpSignature, target: Target) -> str | None:
        return cube_refuses(sig.operands[:2], target)

    def budget(self, tiling: MatmulTiling, sig: OpSignature, target: Target) -> Budget:
        return tiling_rules.budget(tiling, sig, target)

    def shrink(self, tiling: MatmulTiling) -> tuple[MatmulTiling, str] | None:
        return tiling_rules.shrink(tiling)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[MatmulTiling]:
        return tiling_rules.candidates(sig, target, buffers)

    def check_instance(self, sig: OpSignature, tiling: KernelTiling) -> OpSignature:
        return tiling_rules.check_instance(sig, tiling)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: MatmulTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        a, b = inputs[:2]
        bias = inputs[2] if len(inputs) > 2 else None
        fused = op.name == "ge.fused_matmul"
        activation = op.attr("activation") if fused else "none"
        out = matmul_forward(a, b, bias, bool(op.attr("transpose_a")), bool(op.attr("transpose_b")),
                             result_dtype(op, 0, a.dtype), tiling, ctx,
                             epilogue=op.epilogue if fused else None, activation=activation)
        return [out]


def check_fits(target, m: int, n: int, k: int, itemsize: int, buffers: int, epilogue: bool, bias: bool) -> None:
    """Allocate one cube core's buffers for this base block (the kernel's matmul_budget)."""
    budget = matmul_budget(m, n, k, itemsize, buffers, target, epilogue=epilogue, bias=bias)
    allocate(target, budget, f"the {m} x {n} x {k} matmul block ({buffers} buffers)")


def matmul_forward(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, transpose_a: bool, transpose_b: bool,
                   out_dt: np.dtype, tiling: MatmulTiling, ctx: LaunchContext, epilogue=None,
                   activation: str = "none") -> np.ndarray:
    """The kernel proper; timing goes to ctx.cores and ctx.gm."""
    target, gm = ctx.target, ctx.gm
    m, n, k, nbuf = tiling.m, tiling.n, tiling.k, tiling.buffers
    dt = a.dtype
    isz = dt.itemsize
    dname = _CUBE_DTYPES[dt.name]  # the cube's modes (the tile pass leaves other dtypes untiled)
    vector_act = activation != "none"  # bias only: applied as L0C drains, no vector pass
    check_fits(target, m, n, k, isz, nbuf, vector_act, bias is not None)

    A = np.swapaxes(a, -1, -2) if transpose_a else a  # logical [.., M, K]
    B = np.swapaxes(b, -1, -2) if transpose_b else b  # logical [.., K, N]
    M, K = A.shape[-2:]
    N = B.shape[-1]
    batch = np.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    nbat = math.prod(batch)
    a_of = np.broadcast_to(np.arange(math.prod(A.shape[:-2])).reshape(A.shape[:-2]), batch).reshape(-1)
    b_of = np.broadcast_to(np.arange(math.prod(B.shape[:-2])).reshape(B.shape[:-2]), batch).reshape(-1)
    tm, tn, tk = -(-M // m), -(-N // n), max(-(-K // k), 1)
    if M == 0 or N == 0 or nbat == 0:
        return np.empty(batch + (M, N), dtype=out_dt)

    an, bn = ctx.operand_names[:2]
    on = ctx.result_names[0]
    ag = gm_tensor(gm, an, a.shape, isz)
    bg = gm_tensor(gm, bn, b.shape, isz)
    og = gm_tensor(gm, on, batch + (M, N), np.dtype(out_dt).itemsize)
    biasg = None if bias is None else gm_tensor(gm, ctx.operand_names[2], bias.shape, bias.dtype.itemsize)
    ra, rb = a.shape[-2], b.shape[-2]  # stored rows of one batch item

    grid = _Grid(M, N, K, m, n, k, nbuf, tm, tn, tk, a_of, b_of, transpose_a, transpose_b, ra, rb)
    _time(ctx, grid, ag, bg, og, biasg, None if bias is None else bias.shape, isz, dname, activation)

    if not ctx.compute:
        return np.empty(batch + (M, N), dtype=out_dt)
    return _compute(A, B, bias, batch, k, m, out_dt, epilogue)


def _compute(A: np.ndarray, B: np.ndarray, bias: np.ndarray | None, batch: tuple, k: int, m: int,
             out_dt: np.dtype, epilogue) -> np.ndarray:
    """The kernel's arithmetic: f32 partial products per k block summed in order, as L0C accumulates them.

    Output tiles are independent, so every tile's k step runs as one batched numpy operation (big
    GEMMs over whole row slabs rather than one small matmul per core); each element sees the same
    k blocks in the same order, then the epilogue on the f32 accumulator, then one rounding.
    """
    M, K = A.shape[-2:]
    N = B.shape[-1]
    out = np.empty(batch + (M, N), dtype=out_dt)
    # row slabs of whole m blocks, sized so the f32 accumulator stays around 64 MiB
    slab = max(m, (16 * 2**20 // max(N * max(math.prod(batch), 1), 1)) // m * m)
    bias_full = None if bias is None else np.broadcast_to(bias, batch + (M, N))
    for r0 in range(0, M, slab):
        r1 = min(r0 + slab, M)
        acc = np.zeros(batch + (r1 - r0, N), dtype=_F32)
        for k0 in range(0, K, k):
            acc += np.matmul(A[..., r0:r1, k0:k0 + k].astype(_F32), B[..., k0:k0 + k, :].astype(_F32))
        if epilogue is not None:
            acc = epilogue(acc, None if bias_full is None else bias_full[..., r0:r1, :])
        out[..., r0:r1, :] = round_to(acc, out_dt)
    return out


def _read_bias(gm: GlobalMemory, biasg: GmTensor, shape: tuple[int, ...], wave: np.ndarray, units: int,
               m0: np.ndarray, m_eff: np.ndarray, n0: np.ndarray, n_eff: np.ndarray, ni: np.ndarray) -> np.ndarray:
    """MTE2 cycles of each unit's bias tile (a bias of this shape): the distinct bias elements its output tile needs."""
    rows_vary = any(d != 1 for d in shape[:-1])
    cols_vary = len(shape) > 0 and shape[-1] != 1
    if not rows_vary:
        c0 = n0 if cols_vary else np.zeros_like(n0)
        c1 = c0 + (n_eff if cols_vary else 1)
        return gm_read(gm, biasg, rect_pieces(biasg, np.zeros_like(c0), np.ones_like(c0), c0, c1),
                       key=ni if cols_vary else np.zeros_like(ni))
    return gm_read(gm, biasg, share_pieces(biasg, wave, units, m_eff * (n_eff if cols_vary else 1)))


# --- the timing --------------------------------------------------------------------------------------
#
# The schedule is the one the module docstring describes, issued wave by wave and k step by k step.
# It is computed in three parts that never feed back into each other: the GM reads and writes (their
# cycles depend only on the order of the moves, which is fixed: a wave's bias tile, then A and B of
# each k step, then C), each wave's pipe recurrence (an instruction starts at the latest of its pipe
# and the events it waits for), and the accounting (busy cycles, recorded intervals, booked waits),
# which only needs the start and end times. Each part is exactly the arithmetic of issuing one
# instruction at a time, in the same order where order matters (float sums), on whole waves at once.

@attrs.frozen
class _Grid:
    """A matmul's problem and base block: the work units and k steps the schedule runs."""

    M: int
    N: int
    K: int
    m: int
    n: int
    k: int
    nbuf: int
    tm: int
    tn: int
    tk: int
    a_of: np.ndarray = attrs.field(eq=False)  # A's matrix for each batch item
    b_of: np.ndarray = attrs.field(eq=False)
    transpose_a: bool = False
    transpose_b: bool = False
    ra: int = 0  # stored rows of one matrix of A, B
    rb: int = 0

    @property
    def units(self) -> int:
        return len(self.a_of) * self.tm * self.tn


def _time(ctx: LaunchContext, g: _Grid, ag: GmTensor, bg: GmTensor, og: GmTensor, biasg: GmTensor | None,
          bias_shape: tuple[int, ...] | None, isz: int, dname: str, activation: str) -> None:
    """Issue every wave's instructions on ctx.cores and its moves on ctx.gm (the kernel's timing)."""
    target, cores = ctx.target, ctx.cores
    count = cores.count
    vector_act = activation != "none"
    act_passes = (elementwise_passes(_ACTIVATION_OPS[activation]) if vector_act else 0) + 1  # + the cast
    kk = np.arange(g.tk)
    k_eff = np.maximum(np.minimum(g.K - kk * g.k, g.k), 0)
    fm, fk, fn = target.data["cube"][dname]
    onchip = target.data["memory"].get("onchip_bytes_per_cycle", 256)
    moves = _Moves(ctx, g, ag, bg, og, biasg, bias_shape)
    state = _State(count, g.nbuf)
    on_chip: dict[bytes, tuple] = {}  # by the lanes' block sizes: most waves are all whole blocks
    # MTE1 and cube cycles are whole numbers: where the counters are too, a wave's busy cycles add as one
    # sum per lane (exact in any order), not one instruction at a time
    per_core = -(-g.units // count) * g.tk
    most = max(np.ceil((g.m + g.n) * g.k * isz / onchip), -(-g.m // fm) * -(-g.n // fn) * -(-g.k // fk))
    whole = whole_sums(cores.busy[1:3], per_core * most)
    for w, (wave, lanes) in enumerate(spread(g.units, count)):
        mi, ni = (wave // g.tn) % g.tm, wave % g.tn
        m_eff, n_eff = np.minimum(g.M - mi * g.m, g.m), np.minimum(g.N - ni * g.n, g.n)
        bias_cost, load_a, load_b, store = moves.wave(w, wave)
        key = m_eff.tobytes() + n_eff.tobytes()
        if key not in on_chip:
            # the on-chip costs of every k step, [k step, lane] (local_copy_cycles and cube_cycles, elementwise)
            to_l0 = np.ceil((m_eff + n_eff)[None, :] * k_eff[:, None] * isz / onchip)
            mmad = ((-(-m_eff // fm) * -(-n_eff // fn))[None, :] * -(-k_eff // fk)[:, None]).astype(np.float64)
            drain = (np.ceil(m_eff * n_eff * 4 / onchip), vector_cycles(target, m_eff * n_eff * 4, act_passes)) \
                if vector_act else ()
            sums = (to_l0.sum(axis=0), mmad.sum(axis=0)) if whole else None
            on_chip[key] = (to_l0, mmad, drain, sums)
        to_l0, mmad, drain, sums = on_chip[key]
        _run_wave(cores, ctx.waits, state, lanes, w, g, bias_cost, load_a, load_b, to_l0, mmad, drain + (store,),
                  activation, sums)
    moves.commit()


class _State:
    """The buffer-slot events of every core, kept across waves: a core's next unit reuses its last one's slots."""

    def __init__(self, count: int, nbuf: int):
        self.l1_free = np.zeros((nbuf, count))   # L1 slot: free once MTE1 moved its blocks to L0
        self.l0_free = np.zeros((nbuf, count))   # L0A/L0B slot: free once the cube used it
        self.l0c_free = np.zeros((nbuf, count))  # L0C accumulator: free once FIXP drained it
        self.ub_free = np.zeros((nbuf, count))   # epilogue UB tile: free once MTE3 stored it
        self.template = [0]  # the pipe regime that held last (_Steps), tried first in the next wave


class _Moves:
    """The kernel's GM moves, wave by wave, in the order the schedule makes them.

    Each operand's tiles are fixed rectangles (A: batch matrix x row block x k step; B: matrix x column
    block x k step; C: the unit's tile; the bias row: its column block). When the blocks lie on the
    fractal grid they are disjoint tiles of it (TileSets), and a wave's moves are timed together
    (`GlobalMemory.transfer`): a wave reads each A and B tile at most once. Otherwise (tiles sharing
    fractals, one tensor as two operands, no k) every move is made on its own, as read_pieces /
    write_pieces take them.
    """

    def __init__(self, ctx: LaunchContext, g: _Grid, ag: GmTensor, bg: GmTensor, og: GmTensor,
                 biasg: GmTensor | None, bias_shape: tuple[int, ...] | None):
        self.gm, self.g = ctx.gm, g
        self.ag, self.bg, self.og, self.biasg, self.bias_shape = ag, bg, og, biasg, bias_shape
        self.rows_vary = bias_shape is not None and any(d != 1 for d in bias_shape[:-1])
        self.cols_vary = bias_shape is not None and len(bias_shape) > 0 and bias_shape[-1] != 1
        names = [t.name for t in (ag, bg, og, biasg) if t is not None]
        on_grid = all(size % FRACTAL == 0 or size >= dim for size, dim in ((g.m, g.M), (g.n, g.N), (g.k, g.K)))
        self.sets = None
        if len(set(names)) == len(names) and g.K > 0 and on_grid:
            gm, m, n, k = self.gm, g.m, g.n, g.k
            self.sets = {"a": TileSets(gm, ag, k, m, swap=True) if g.transpose_a else TileSets(gm, ag, m, k),
                         "b": TileSets(gm, bg, n, k) if g.transpose_b else TileSets(gm, bg, k, n, swap=True),
                         "c": TileSets(gm, og, m, n)}
            if biasg is not None and not self.rows_vary:
                self.sets["bias"] = TileSets(gm, biasg, FRACTAL, n if self.cols_vary else FRACTAL)
            self.pool = SetPool(list(self.sets.values()))

    def wave(self, w: int, wave: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
        """(bias tile cycles or None, A and B cycles [k step, lane], C store cycles) of one wave's moves."""
        g, gm = self.g, self.gm
        bo, mi, ni = wave // (g.tm * g.tn), (wave // g.tn) % g.tm, wave % g.tn
        m0, n0 = mi * g.m, ni * g.n
        m_eff, n_eff = np.minimum(g.M - m0, g.m), np.minimum(g.N - n0, g.n)
        bias = None
        if self.biasg is not None and (self.sets is None or "bias" not in self.sets):
            bias = _read_bias(gm, self.biasg, self.bias_shape, wave, g.units, m0, m_eff, n0, n_eff, ni)
        if self.sets is None:
            return (bias,) + self._each(bo, mi, ni, m0, m_eff, n0, n_eff)
        kk = np.arange(g.tk)[:, None]
        first = 0
        moves = []
        sa, sb, sc = self.sets["a"], self.sets["b"], self.sets["c"]
        if bias is None and self.biasg is not None:
            ids = ni if self.cols_vary else np.zeros_like(ni)
            moves.append(Transfer([self.sets["bias"]], ids[None, :] + self.sets["bias"].base, np.zeros(1, np.int64),
                                  key=[ids]))
            first = 1
        # A and B of each k step take turns; cores loading the same block in a step share it (the first
        # one brings it into L2)
        ka, kb = g.a_of[bo] * g.tm + mi, g.b_of[bo] * g.tn + ni
        ids = np.empty((2 * g.tk, len(wave)), dtype=np.int64)
        ids[0::2], ids[1::2] = (ka * g.tk + sa.base)[None, :] + kk, (kb * g.tk + sb.base)[None, :] + kk
        moves.append(Transfer([sa, sb], ids, first + np.arange(2 * g.tk), key=[ka, kb]))
        moves.append(Transfer([sc], wave[None, :] + sc.base, np.array([first + 2 * g.tk]), write=True))
        costs = gm.transfer(moves)
        if first:
            bias = costs.pop(0)[0]
        return bias, costs[0][0::2], costs[0][1::2], costs[1][0]

    def _each(self, bo, mi, ni, m0, m_eff, n0, n_eff) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One wave's A, B and C moves one at a time (read_pieces, write_pieces)."""
        g, gm, ag, bg = self.g, self.gm, self.ag, self.bg
        ba, bb = g.a_of[bo], g.b_of[bo]
        load_a, load_b = [], []
        for kk in range(g.tk):
            k0 = kk * g.k
            k_eff = max(min(g.K - k0, g.k), 0)
            if g.transpose_a:
                a_rect = (ba * g.ra + k0, ba * g.ra + k0 + k_eff, m0, m0 + m_eff)
            else:
                a_rect = (ba * g.ra + m0, ba * g.ra + m0 + m_eff, k0, k0 + k_eff)
            if g.transpose_b:
                b_rect = (bb * g.rb + n0, bb * g.rb + n0 + n_eff, k0, k0 + k_eff)
            else:
                b_rect = (bb * g.rb + k0, bb * g.rb + k0 + k_eff, n0, n0 + n_eff)
            # cores loading the same block in this step share it (the first one brings it into L2)
            load_a.append(gm_read(gm, ag, rect_pieces(ag, *a_rect), key=ba * g.tm + mi))
            load_b.append(gm_read(gm, bg, rect_pieces(bg, *b_rect), key=bb * g.tn + ni))
        store = gm_write(gm, self.og, rect_pieces(self.og, bo * g.M + m0, bo * g.M + m0 + m_eff, n0, n0 + n_eff))
        return np.array(load_a), np.array(load_b), store

    def commit(self) -> None:
        if self.sets is not None:
            self.pool.commit(self.gm)


def _run_wave(cores: Cores, waits: PipeWaits | None, state: _State, lanes: np.ndarray, w: int, g: _Grid,
              bias_cost: np.ndarray | None, load_a: np.ndarray, load_b: np.ndarray, to_l0: np.ndarray,
              mmad: np.ndarray, drain: tuple, activation: str, sums: tuple | None) -> None:
    """One wave's instructions on its lanes: the k steps' recurrence, the drain of L0C, the accounting
    (`sums`: each lane's MTE1 and cube cycles of the wave, where they may be added as one sum)."""
    nbuf, tk = g.nbuf, g.tk
    step0 = w * tk  # k steps issued before this wave (every wave has tk of them)
    cs = w % nbuf
    P = cores.free[:, lanes]  # [pipe, lane], updated below and written back
    l1, l0 = state.l1_free[:, lanes], state.l0_free[:, lanes]
    mte2_0 = P[0].copy()
    mte2 = mte2_0
    bias_ready = np.zeros(len(lanes))
    if bias_cost is not None:
        bias_ready = mte2 = mte2_0 + bias_cost
    mte1, cube = P[1].copy(), P[2].copy()
    slots = [(step0 + j) % nbuf for j in range(nbuf)]
    l1_0 = [l1[s] for s in slots]  # by k step: the slot step j finds is l1_0[j % nbuf]
    l0_0 = [l0[s] for s in slots]
    l0c = state.l0c_free[cs, lanes]
    steps = _Steps(nbuf, mte2, mte1, cube, l1_0, l0_0, bias_ready, l0c, load_a, load_b, to_l0, mmad)
    steps.solve(state.template)
    A, B, L, Mm = steps.A, steps.B, steps.L, steps.M
    last = Mm[-1]
    # drain L0C: straight to GM, or through UB with the activation
    if len(drain) == 3:
        c_ub, c_act, c_store = drain
        ub = state.ub_free[cs, lanes]
        fix_ready = np.maximum(P[3], last)
        fix_start = np.maximum(fix_ready, ub)
        U = fix_start + c_ub
        vec_start = np.maximum(P[4], U)
        V = vec_start + c_act
        st_start = np.maximum(P[5], V)
        S = st_start + c_store
        tail = [(3, "L0C to UB", c_ub, P[3].copy(), fix_ready, fix_start, U),
                (4, f"{activation} and cast", c_act, P[4].copy(), vec_start, vec_start, V),
                (5, "store C", c_store, P[5].copy(), st_start, st_start, S)]
        state.l0c_free[cs, lanes] = U
        state.ub_free[cs, lanes] = S
    else:
        (c_store,) = drain
        fix_start = np.maximum(P[3], last)
        F = fix_start + c_store
        tail = [(3, "L0C to GM", c_store, P[3].copy(), fix_start, fix_start, F)]
        state.l0c_free[cs, lanes] = F
    if cores.record or waits is not None:
        _account(cores, waits, lanes, nbuf, mte2_0, mte2, bias_cost, mte1, cube, l1_0, l0_0, bias_ready, l0c,
                 load_a, load_b, to_l0, mmad, A, B, L, Mm, tail)
    # the pipes' and slots' new state
    P[0], P[1], P[2] = B[-1], L[-1], last
    for p, _, _, _, _, _, end in tail:
        P[p] = end
    cores.free[:, lanes] = P
    for j in range(max(tk - nbuf, 0), tk):
        s = (step0 + j) % nbuf
        l1[s], l0[s] = L[j], Mm[j]
    state.l1_free[:, lanes], state.l0_free[:, lanes] = l1, l0
    # busy cycles: each pipe's costs added one instruction at a time, in issue order (cumsum adds in order)
    busy = cores.busy[:, lanes]
    mte2_costs = np.empty((2 * tk + 2, len(lanes)))
    mte2_costs[0] = busy[0]
    mte2_costs[1] = bias_cost if bias_cost is not None else 0.0  # x + 0.0 == x
    mte2_costs[2::2], mte2_costs[3::2] = load_a, load_b
    busy[0] = np.cumsum(mte2_costs, axis=0)[-1]
    if sums is not None:
        busy[1] += sums[0]
        busy[2] += sums[1]
    else:
        busy[1] = np.cumsum(np.concatenate([busy[1][None, :], to_l0]), axis=0)[-1]
        busy[2] = np.cumsum(np.concatenate([busy[2][None, :], mmad]), axis=0)[-1]
    for p, _, cost, _, _, _, _ in tail:
        busy[p] += cost
    cores.busy[:, lanes] = busy


class _Steps:
    """The end times of one wave's k steps, [k step, lane] each: load A, load B (MTE2, each waiting for its
    L1 slot), A, B to L0A, L0B (MTE1: both loads and the L0 slot), mmad (CUBE; the first step also waits
    for the bias tile and the unit's L0C slot).

    Each end is fl(max(what it waits for) + cost), one instruction after another; a float sum depends on
    its order, so the only exact way to get them is that recurrence. But where a pipe never waits, its
    ends are a running sum (np.cumsum adds in order: the same floats), and the instructions hanging off
    it are one add each. `solve` guesses such a regime (a template: which pipe streams) for the rest of
    the wave, then checks every instruction's equation on the guess at once; every step before the first
    one that fails is then exact (each equation only looks back), and the failing step onwards is redone
    by the plain recurrence for a few steps before guessing again. Costs are >= 0, so load B's wait for
    the slot load A already waited for, and MTE1's for load A (before load B), change nothing.
    """

    LOOP = 3  # steps done one by one where a guess failed, before guessing again

    def __init__(self, nbuf, mte2, mte1, cube, l1_0, l0_0, bias_ready, l0c, load_a, load_b, to_l0, mmad):
        self.nbuf = nbuf
        self.init = (mte2, mte1, cube, l1_0, l0_0, bias_ready, l0c)
        self.costs = (load_a, load_b, to_l0, mmad)
        tk, lanes = load_a.shape
        self.A, self.B, self.L, self.M = (np.empty((tk, lanes)) for _ in range(4))
        self.templates = [self._mte2_streams, self._cube_streams] if nbuf > 1 else \
            [self._through_mte1, self._cube_loop]

    def solve(self, pref: list[int]) -> None:
        """Fill A, B, L, M; `pref` holds the index of the template that worked last (kept across waves)."""
        tk = len(self.A)
        j = 0
        while j < tk:
            if j >= self.nbuf and tk - j > self.LOOP:
                order = [pref[0]] + [i for i in range(len(self.templates)) if i != pref[0]]
                for i in order:
                    self.templates[i](j)
                    f = self._check(j)
                    if f > j:
                        pref[0] = i
                        break
                if f > j:
                    j = f
                    continue
            # the first nbuf steps look back into the last wave, whose state the guesses do not read
            run = self.LOOP if j else self.nbuf
            self._loop(j, min(j + run, tk))
            j += run

    def _loop(self, j0: int, j1: int) -> None:
        """Steps [j0, j1) one instruction at a time (the recurrence itself)."""
        mx = np.maximum
        A, B, L, M, nbuf = self.A, self.B, self.L, self.M, self.nbuf
        mte2, mte1, cube, l1_0, l0_0, bias_ready, l0c = self.init
        load_a, load_b, to_l0, mmad = self.costs
        for j in range(j0, j1):
            a_free = B[j - 1] if j else mte2
            l1 = L[j - nbuf] if j >= nbuf else l1_0[j]
            a = mx(a_free, l1, out=A[j])
            a += load_a[j]
            b = np.add(a, load_b[j], out=B[j])
            l = mx(L[j - 1] if j else mte1, b, out=L[j])
            mx(l, M[j - nbuf] if j >= nbuf else l0_0[j], out=l)
            l += to_l0[j]
            c = mx(M[j - 1] if j else cube, l, out=M[j])
            if j == 0:
                mx(c, bias_ready, out=c)
                mx(c, l0c, out=c)
            c += mmad[j]

    def _check(self, j0: int) -> int:
        """The first step from j0 on (j0 >= nbuf) whose instructions do not satisfy their equations; tk if none."""
        A, B, L, M, nbuf = self.A, self.B, self.L, self.M, self.nbuf
        load_a, _, to_l0, mmad = self.costs
        mx = np.maximum
        tk = len(A)
        a, b, l, m = A[j0:], B[j0:], L[j0:], M[j0:]
        # every template sets B = A + cost, and A >= its L1 slot, so load B's equation holds with A's
        ok = a == mx(B[j0 - 1:tk - 1], L[j0 - nbuf:tk - nbuf]) + load_a[j0:]
        ok &= l == mx(mx(L[j0 - 1:tk - 1], b), M[j0 - nbuf:tk - nbuf]) + to_l0[j0:]
        ok &= m == mx(M[j0 - 1:tk - 1], l) + mmad[j0:]
        rows = ok.all(axis=1)
        return tk if rows.all() else j0 + int(np.argmin(rows))

    def _chain(self, start: np.ndarray, parts: list[np.ndarray], j0: int) -> list[np.ndarray]:
        """A running sum from `start` through the steps' costs `parts` (interleaved per step), split back per part."""
        n = len(parts)
        seq = np.empty((1 + n * (len(parts[0]) - j0), start.shape[0]))
        seq[0] = start
        for i, p in enumerate(parts):
            seq[1 + i::n] = p[j0:]
        run = np.cumsum(seq, axis=0)
        return [run[1 + i::n] for i in range(n)]

    def _mte2_streams(self, j0: int) -> None:
        """MTE2 never waits: the loads run back to back, MTE1 and the cube follow each load B."""
        A, B, L, M, nbuf = self.A, self.B, self.L, self.M, self.nbuf
        load_a, load_b, to_l0, mmad = self.costs
        A[j0:], B[j0:] = self._chain(np.maximum(B[j0 - 1], L[j0 - nbuf]), [load_a, load_b], j0)
        np.add(B[j0:], to_l0[j0:], out=L[j0:])
        np.add(L[j0:], mmad[j0:], out=M[j0:])

    def _cube_streams(self, j0: int) -> None:
        """The cube never waits: MTE1 waits for the L0 slot the cube frees, the loads for the L1 slot MTE1 frees."""
        A, B, L, M, nbuf = self.A, self.B, self.L, self.M, self.nbuf
        load_a, load_b, to_l0, mmad = self.costs
        tk = len(A)
        (M[j0:],) = self._chain(M[j0 - 1], [mmad], j0)
        np.add(M[j0 - nbuf:tk - nbuf], to_l0[j0:], out=L[j0:])
        np.add(L[j0 - nbuf:tk - nbuf], load_a[j0:], out=A[j0:])
        np.add(A[j0:], load_b[j0:], out=B[j0:])

    def _through_mte1(self, j0: int) -> None:
        """One buffer, memory bound: each load waits for MTE1 to free the slot, MTE1 for the loads; the cube follows."""
        A, B, L, M = self.A, self.B, self.L, self.M
        load_a, load_b, to_l0, mmad = self.costs
        A[j0:], B[j0:], L[j0:] = self._chain(np.maximum(B[j0 - 1], L[j0 - 1]), [load_a, load_b, to_l0], j0)
        np.add(L[j0:], mmad[j0:], out=M[j0:])

    def _cube_loop(self, j0: int) -> None:
        """One buffer, cube bound: MTE1 waits for the cube to free L0, the cube for MTE1; the loads follow MTE1."""
        A, B, L, M = self.A, self.B, self.L, self.M
        load_a, load_b, to_l0, mmad = self.costs
        tk = len(A)
        L[j0:], M[j0:] = self._chain(M[j0 - 1], [to_l0, mmad], j0)
        np.add(L[j0 - 1:tk - 1], load_a[j0:], out=A[j0:])
        np.add(A[j0:], load_b[j0:], out=B[j0:])


def _account(cores, waits, lanes, nbuf, mte2_0, mte2, bias_cost, mte1, cube, l1_0, l0_0, bias_ready, l0c,
             load_a, load_b, to_l0, mmad, A, B, L, Mm, tail) -> None:
    """Record one wave's intervals and book its pipes' waits, from its instructions' end times."""
    tk = len(A)
    # what each instruction waited for: its pipe's previous instruction, its flags, its slots
    l1 = np.concatenate([np.array(l1_0), L])[:tk]  # the L1 slot step j waits for (step j - nbuf's MTE1)
    l0 = np.concatenate([np.array(l0_0), Mm])[:tk]
    a_free = np.concatenate([mte2[None, :], B[:-1]])
    a_start = np.maximum(a_free, l1)
    b_start = np.maximum(A, l1)
    l_free = np.concatenate([mte1[None, :], L[:-1]])
    l_ready = np.maximum(np.maximum(l_free, A), B)
    l_start = np.maximum(l_ready, l0)
    m_free = np.concatenate([cube[None, :], Mm[:-1]])
    m_ready = np.maximum(m_free, L)
    m_ready[0] = np.maximum(m_ready[0], bias_ready)
    m_start = m_ready.copy()
    m_start[0] = np.maximum(m_ready[0], l0c)
    if waits is not None:
        inter = lambda x, y: np.stack([x, y], axis=1).reshape(2 * tk, -1)  # noqa: E731 (A, B alternate on MTE2)
        _book(waits, "MTE2", inter(a_free, A), inter(a_free, A), inter(a_start, b_start))
        _book(waits, "MTE1", l_free, l_ready, l_start)
        _book(waits, "CUBE", m_free, m_ready, m_start)
        for p, _, _, pfree, ready, start, _ in tail:
            _book(waits, PIPES[p], pfree[None, :], ready[None, :], start[None, :])
    if cores.record:
        out = cores.intervals
        if bias_cost is not None:
            out.append(PipeInterval(0, "load bias", lanes, mte2_0, mte2))
        for j in range(tk):
            out.append(PipeInterval(0, "load A", lanes, a_start[j], A[j]))
            out.append(PipeInterval(0, "load B", lanes, b_start[j], B[j]))
            out.append(PipeInterval(1, "A, B to L0A, L0B", lanes, l_start[j], L[j]))
            out.append(PipeInterval(2, "mmad", lanes, m_start[j], Mm[j]))
        for p, name, _, _, _, start, end in tail:
            out.append(PipeInterval(p, name, lanes, start, end))


def _book(waits: PipeWaits, pipe: str, free: np.ndarray, ready: np.ndarray, start: np.ndarray) -> None:
    """Book idle cycles as `issue` does, one instruction (row) at a time: to the flags first, then the slots."""
    # row sums of C-contiguous rows are the sums of the rows alone; cumsum adds them in issue order
    flag = np.sum(np.ascontiguousarray(ready - free), axis=1)
    slot = np.sum(np.ascontiguousarray(start - ready), axis=1)
    waits.flag[pipe] = float(np.cumsum(np.concatenate([[waits.flag[pipe]], flag]))[-1])
    waits.slot[pipe] = float(np.cumsum(np.concatenate([[waits.slot[pipe]], slot]))[-1])
