"""Matmul on the cube: ge.matmul and ge.fused_matmul (bias and activation epilogue), as CANN's MatMul runs it.

The tiling is Ascend C's TCubeTiling (kernels/matmul_tiling.py). C is split over the cube cores in 2-D
blocks of single_core_m x single_core_n (batch items whole when there are as many as cores); each core
walks its base blocks (base_m x base_n of C) in `iterate_order`, and for each runs the K loop of
pto-isa's gemm_performance kernel (its README: TLOAD, TEXTRACT, TMATMUL, TSTORE):

    MTE2  one load brings step_ka base_k slices of A (base_m x step_ka*base_k) into an L1 buffer, one
          brings step_kb slices of B; L1 holds depth / step such loads (2: double-buffered, a load waits
          only for the buffer the load before last used, freed once MTE1 has taken its last slice)
    MTE1  each slice L1 -> L0A / L0B, into the ping-pong half the slice before last freed
    CUBE  mmad of each slice, f32 accumulate in L0C
    FIXP  after the K loop: L0C -> GM rounded to the result dtype (a bias joins on the way out). L0C holds
          two accumulators where they fit, so the drain overlaps the next block's K loop; one (128 x 256
          f32 fills the 910B's 128 KiB) makes the next block's first mmad wait for the drain.
    with an activation (MatmulEpilogue): FIXP L0C -> UB in f32, VECTOR the activation and the cast,
          MTE3 UB -> GM. On Atlas A2 (MatmulMixEpilogue) the vector units are the AIC's two AIVs: FIXP
          writes the f32 block to a GM workspace, a cross-core flag tells the AIVs, each reads its half of
          the rows (AIV_MTE2), runs the activation (VECTOR) and stores C (MTE3): a mixed AIC + AIV kernel.
    with a glu (fused_matmul {glu}): the gate-up matmul and SwiGLU in one kernel, as ops-transformer's
          grouped_matmul_swiglu_quant runs it (gmm/grouped_matmul_swiglu_quant/op_kernel/
          grouped_matmul_swiglu_pipeline.h: the cube's f32 result through a GM workspace, the AIVs' post-process
          on it). Here each base block holds base_n / 2 gate columns and the matching up columns (B's two halves,
          loaded one after the other), so the AIVs find both halves of their result tile in one f32 block: the
          cube works the whole N, VECTOR the gate's activation and the Mul per result element (kernels/glu.py's
          count) and the cast, MTE3 stores N / 2 columns.

Numbers: the cube takes its operands in their dtype (f16, bf16 = ml_dtypes.bfloat16, f32) and
accumulates in f32 across the base_k slices in order; the epilogue is `FusedMatmul.epilogue` (bias add,
then the activation op's own compute) on the f32 accumulator, before the one rounding. Neither the core
split, the iteration order nor the L1 steps change the order any element is summed in.

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
from geir.kernels.base import Kernel, LaunchContext, allocate, issue, register_kernel
from geir.kernels.glu import MUL_PASSES
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
from geir.kernels.matmul_tiling import (MIX_EPILOGUE, N_FIRST, MatmulTiling, core_split, folds_batch, l0c_slots,
                                        tiling_budget)
from geir.kernels.tiling import Budget, KernelTiling, Miss, OpSignature, cube_refuses
from geir.kernels.vector import elementwise_passes
from geir.ops.glu import GATE_ACTIVATIONS
from geir.ops.numerics import round_to
from geir.target_npu.sim import GlobalMemory, SetPool, Transfer, vector_cycles
from geir.target_npu.target import Target

_F32 = np.float32
_CUBE_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_ACTIVATION_OPS = {"relu": "ge.relu", "gelu": "ge.gelu", "gelu_tanh": "ge.gelu", "silu": "ge.silu"}
WORKSPACE_SLOTS = 2  # f32 blocks in flight between an AIC and its AIVs (MatmulMixEpilogue)


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

    def workspace_bytes(self, tiling: KernelTiling, sig: OpSignature) -> int:
        """A mixed AIC + AIV epilogue's f32 blocks in GM, WORKSPACE_SLOTS per cube core."""
        if tiling.template != MIX_EPILOGUE:
            return 0
        return workspace_bytes(tiling)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: MatmulTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        a, b = inputs[:2]
        bias = inputs[2] if len(inputs) > 2 else None
        fused = op.name == "ge.fused_matmul"
        activation = op.attr("activation") if fused else "none"
        glu = op.attr("glu") if fused else "none"
        out = matmul_forward(a, b, bias, bool(op.attr("transpose_a")), bool(op.attr("transpose_b")),
                             result_dtype(op, 0, a.dtype), tiling, ctx,
                             epilogue=op.epilogue if fused else None, activation=activation, glu=glu)
        return [out]


def workspace_bytes(tiling: MatmulTiling) -> int:
    """GM workspace of a MatmulMixEpilogue launch: WORKSPACE_SLOTS f32 base blocks per cube core."""
    return tiling.cores * WORKSPACE_SLOTS * tiling.base_m * tiling.base_n * 4


def check_fits(target, tiling: MatmulTiling, itemsize: int, epilogue: bool, bias: bool) -> None:
    """Allocate one cube core's buffers for this tiling (the kernel's budget)."""
    budget = tiling_budget(tiling, itemsize, target, epilogue=epilogue, bias=bias)
    allocate(target, budget, f"the {tiling.base_m} x {tiling.base_n} x {tiling.base_k} matmul block "
                             f"({tiling.buffers} buffers, L1 depth {tiling.depth_a1} / {tiling.depth_b1})")


def matmul_forward(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, transpose_a: bool, transpose_b: bool,
                   out_dt: np.dtype, tiling: MatmulTiling, ctx: LaunchContext, epilogue=None,
                   activation: str = "none", glu: str = "none") -> np.ndarray:
    """The kernel proper; timing goes to ctx.cores and ctx.gm.

    With a glu epilogue each base block pairs base_n / 2 gate columns with the matching up columns (B's two
    halves, loaded side by side), so the AIVs have both halves of their output tile in one f32 block and store
    base_n / 2 columns of the N / 2-column result."""
    target, gm = ctx.target, ctx.gm
    m, n, k = tiling.base_m, tiling.base_n, tiling.base_k
    dt = a.dtype
    isz = dt.itemsize
    dname = _CUBE_DTYPES[dt.name]  # the cube's modes (the tile pass leaves other dtypes untiled)
    vector_act = activation != "none" or glu != "none"  # bias only: applied as L0C drains, no vector pass
    check_fits(target, tiling, isz, vector_act, bias is not None)

    A = np.swapaxes(a, -1, -2) if transpose_a else a  # logical [.., M, K]
    B = np.swapaxes(b, -1, -2) if transpose_b else b  # logical [.., K, N]
    M, K = A.shape[-2:]
    N = B.shape[-1]
    out_n = N // 2 if glu != "none" else N  # the result's columns
    batch = np.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    nbat = math.prod(batch)
    a_of = np.broadcast_to(np.arange(math.prod(A.shape[:-2])).reshape(A.shape[:-2]), batch).reshape(-1)
    b_of = np.broadcast_to(np.arange(math.prod(B.shape[:-2])).reshape(B.shape[:-2]), batch).reshape(-1)
    if M == 0 or N == 0 or nbat == 0:
        return np.empty(batch + (M, out_n), dtype=out_dt)

    an, bn = ctx.operand_names[:2]
    on = ctx.result_names[0]
    ag = gm_tensor(gm, an, a.shape, isz)
    bg = gm_tensor(gm, bn, b.shape, isz)
    og = gm_tensor(gm, on, batch + (M, out_n), np.dtype(out_dt).itemsize)
    biasg = None if bias is None else gm_tensor(gm, ctx.operand_names[2], bias.shape, bias.dtype.itemsize)
    if folds_batch(a.shape, b.shape, transpose_a):
        # The cube runs one [batch * M, K] problem (B read once, rows of several batch items in a base block);
        # the arithmetic below stays per batch item: every element's k blocks and their order are the same.
        # A, C (and a bias of rows) as the one matrix each the folded problem reads or writes
        ag = gm_tensor(gm, an, (nbat * M, K), isz)
        og = gm_tensor(gm, on, (nbat * M, out_n), np.dtype(out_dt).itemsize)
        bias_shape = None if bias is None else bias.shape
        if bias is not None and bias.ndim >= 2 and any(d != 1 for d in bias.shape[:-1]):
            bias_shape = (nbat * M, bias.shape[-1])
            biasg = gm_tensor(gm, ctx.operand_names[2], bias_shape, bias.dtype.itemsize)
        one = np.zeros(1, dtype=np.int64)
        g = _grid(tiling, target, nbat * M, N, K, one, one, False, transpose_b, nbat * M, b.shape[-2],
                  ctx.cores.count, glu != "none")
    else:
        bias_shape = None if bias is None else bias.shape
        g = _grid(tiling, target, M, N, K, a_of, b_of, transpose_a, transpose_b, a.shape[-2], b.shape[-2],
                  ctx.cores.count, glu != "none")
    _time(ctx, g, tiling, ag, bg, og, biasg, bias_shape, isz, dname, activation, glu)

    if not ctx.compute:
        return np.empty(batch + (M, out_n), dtype=out_dt)
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
    out = None  # its columns are the epilogue's (a glu halves them)
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
        if out is None:
            out = np.empty(batch + (M, acc.shape[-1]), dtype=out_dt)
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
# The schedule is the one the module docstring describes, issued one instruction at a time on every core
# that has a base block in the wave (a wave: each core's w-th base block). The GM moves of a wave are timed
# together first (_Moves: their cycles depend only on the order of the moves, which is fixed: the bias
# tile, then A and B of each L1 load, then C), then the pipes' recurrence runs on them.

@attrs.frozen
class _Grid:
    """A matmul's problem and tiling: base blocks, L1 loads (k = base_k x step: the k of one load) and slots."""

    M: int
    N: int
    K: int
    m: int  # base_m
    n: int  # base_n
    k: int  # the k of one L1 load: step x base_k
    base_k: int
    step: int  # base_k slices per L1 load
    tm: int
    tn: int
    tk: int  # L1 loads per base block
    l1_slots: int  # L1 buffers per operand (depth / step)
    l0_slots: int  # L0A / L0B ping-pong halves
    l0c_slots: int
    order: np.ndarray = attrs.field(eq=False)  # [core, w]: the unit of each core's w-th base block, -1 past its end
    a_of: np.ndarray = attrs.field(eq=False)  # A's matrix for each batch item
    b_of: np.ndarray = attrs.field(eq=False)
    transpose_a: bool = False
    transpose_b: bool = False
    ra: int = 0  # stored rows of one matrix of A, B
    rb: int = 0
    pair: int = 1  # cube columns per result column: 2 with a glu (N, n count result columns; B's up half is N on)

    @property
    def units(self) -> int:
        return len(self.a_of) * self.tm * self.tn


def _grid(t: MatmulTiling, target: Target, M: int, N: int, K: int, a_of: np.ndarray, b_of: np.ndarray,
          transpose_a: bool, transpose_b: bool, ra: int, rb: int, count: int, glu: bool = False) -> _Grid:
    """The launch's grid: the tiling's blocks on this problem (a single_core size of 0 is decided here). With a glu
    the grid is the result's: N / 2 columns, base_n / 2 of them a block (each with its base_n / 2 up columns)."""
    pair = 2 if glu else 1
    m, n = t.base_m, t.base_n // pair
    N //= pair
    step = min(t.step_ka, t.step_kb)  # a load of each operand per L1 step (the rules make the steps equal)
    kg = step * t.base_k
    tm, tn = -(-M // m), -(-N // n)
    nbat = len(a_of)
    if t.single_core_m and t.single_core_n:
        sm, sn = max(min(t.single_core_m // m, tm), 1), max(min(t.single_core_n // t.base_n, tn), 1)
    else:
        split = core_split(nbat, M, N, m, n, count)
        sm, sn = split.single_core_m // m, split.single_core_n // n
    order = _order(nbat, tm, tn, sm, sn, t.iterate_order, count)
    return _Grid(M, N, K, m, n, kg, t.base_k, step, tm, tn, max(-(-K // kg), 1),
                 min(t.l1_buffers_a, t.l1_buffers_b), t.buffers, l0c_slots(m, n, target), order, a_of, b_of,
                 transpose_a, transpose_b, ra, rb, pair)


def _order(nbat: int, tm: int, tn: int, sm: int, sn: int, iterate_order: int, count: int) -> np.ndarray:
    """[core, w]: the unit (batch item, row block, column block) of each core's w-th base block, -1 past its end.

    C's blocks of sm x sn base blocks (per batch item, row-major) are dealt to the cores in turn; a core walks
    each of its blocks N first (along a row of C) or M first."""
    gm, gn = -(-tm // sm), -(-tn // sn)
    blocks = np.arange(nbat * gm * gn)
    bo, bi, bj = blocks // (gm * gn), (blocks // gn) % gm, blocks % gn
    ii, jj = np.meshgrid(np.arange(sm), np.arange(sn), indexing="ij")
    if iterate_order != N_FIRST:
        ii, jj = ii.T, jj.T
    ii, jj = ii.reshape(-1), jj.reshape(-1)
    rows = bi[:, None] * sm + ii[None, :]  # [block, tile]
    cols = bj[:, None] * sn + jj[None, :]
    units = np.where((rows < tm) & (cols < tn), bo[:, None] * tm * tn + rows * tn + cols, -1)
    per_core = [units[c::count].reshape(-1) for c in range(min(count, len(blocks)))]
    per_core = [u[u >= 0] for u in per_core]
    out = np.full((len(per_core), max((len(u) for u in per_core), default=0)), -1, dtype=np.int64)
    for c, u in enumerate(per_core):
        out[c, :len(u)] = u
    return out


def _time(ctx: LaunchContext, g: _Grid, tiling: MatmulTiling, ag: GmTensor, bg: GmTensor, og: GmTensor,
          biasg: GmTensor | None, bias_shape: tuple[int, ...] | None, isz: int, dname: str, activation: str,
          glu: str = "none") -> None:
    """Issue every wave's instructions on ctx.cores and its moves on ctx.gm (the kernel's timing).

    A glu epilogue (ops-transformer's grouped_matmul_swiglu_quant: the gate-up matmul and SwiGLU in one kernel)
    runs the cube over both halves of each block (g.pair columns per result column), drains the f32 block, runs
    the gate's activation and the Mul per result element (kernels/glu.py's count) and the cast, and stores the
    result tile: half the product's bytes."""
    target, cores, waits = ctx.target, ctx.cores, ctx.waits
    count = cores.count
    mix = tiling.template == MIX_EPILOGUE
    vector_act = activation != "none" or glu != "none"
    if glu != "none":
        act_passes = elementwise_passes(GATE_ACTIVATIONS[glu][0]) + MUL_PASSES + 1  # + the cast
        activation = f"{glu} glu"
    else:
        act_passes = (elementwise_passes(_ACTIVATION_OPS[activation]) if vector_act else 0) + 1  # + the cast
    pair = g.pair
    fm, fk, fn = target.cube_fractal(dname)
    onchip = target.memory.onchip_bytes_per_cycle
    latency = target.memory.dma_latency_cycles
    sync = target.overhead("cross_core_sync_cycles") if mix else 0.0
    moves = _Moves(ctx, g, ag, bg, og, biasg, bias_shape)
    ws = _Workspace(ctx, og.name, len(g.order), g.m * g.n * pair * 4) if mix else None
    lanes_all = np.arange(len(g.order))
    l1_free = np.zeros((g.l1_slots, count))  # an L1 buffer (A's and B's of one load): free once MTE1 took its last slice
    l0_free = np.zeros((g.l0_slots, count))  # an L0A / L0B half: free once the cube used it
    l0c_free = np.zeros((g.l0c_slots, count))  # an accumulator: free once FIXP drained it
    ub_free = np.zeros((g.l0_slots, count))  # the epilogue's UB tiles: free once MTE3 stored them
    ws_free = np.zeros((WORKSPACE_SLOTS, count))  # a workspace slot: free once the AIVs read it
    on_chip: dict[bytes, tuple] = {}
    loads = slices = 0  # L1 loads and base_k slices issued so far by every core in the waves before
    for w in range(g.order.shape[1] if g.order.size else 0):
        # cores reading the same panel in a wave share it and the first of them brings it into the L2; which core's
        # request reaches the L2 first is not the model's to know, so the first one rotates with the wave (as in the
        # CV-split FlashAttention) rather than putting every miss on the lowest core
        lanes = lanes_all[g.order[:, w] >= 0]
        lanes = np.roll(lanes, -(w % max(len(lanes), 1)))
        units = g.order[lanes, w]
        mi, ni = (units // g.tn) % g.tm, units % g.tn
        m_eff, n_eff = np.minimum(g.M - mi * g.m, g.m), np.minimum(g.N - ni * g.n, g.n)
        bias_cost, load_a, load_b, store = moves.wave(w, units)
        key = m_eff.tobytes() + n_eff.tobytes()
        if key not in on_chip:
            # per base_k slice: MTE1's and the cube's cycles [slice, lane]
            kk = np.arange(-(-g.K // g.base_k) if g.K else 1)
            k_eff = np.maximum(np.minimum(g.K - kk * g.base_k, g.base_k), 0)
            to_l0 = np.ceil((m_eff + pair * n_eff)[None, :] * k_eff[:, None] * isz / onchip)
            mmad = ((-(-m_eff // fm) * pair * -(-n_eff // fn))[None, :] * -(-k_eff // fk)[:, None]).astype(np.float64)
            on_chip[key] = (to_l0, mmad)
        to_l0, mmad = on_chip[key]
        bias_ready = None
        if bias_cost is not None:
            bias_ready = issue(cores, waits, "MTE2", lanes, bias_cost, name="load bias")
        cs, us = w % g.l0c_slots, w % g.l0_slots  # the accumulator and the epilogue's UB tiles
        mm = None
        for j in range(g.tk):
            s1 = (loads + j) % g.l1_slots
            a_in = issue(cores, waits, "MTE2", lanes, load_a[j], slots=[l1_free[s1, lanes]], name="load A")
            b_in = issue(cores, waits, "MTE2", lanes, load_b[j], slots=[l1_free[s1, lanes]], name="load B")
            for i in range(j * g.step, min((j + 1) * g.step, len(to_l0))):
                s0 = (slices + i) % g.l0_slots
                to = issue(cores, waits, "MTE1", lanes, to_l0[i], [a_in, b_in], [l0_free[s0, lanes]],
                           name="A, B to L0A, L0B")
                first = i == 0
                flags = [to] if not first or bias_ready is None else [to, bias_ready]
                mm = issue(cores, waits, "CUBE", lanes, mmad[i], flags, [l0c_free[cs, lanes]] if first else [],
                           name="mmad")
                l0_free[s0, lanes] = mm
            l1_free[s1, lanes] = to
        loads += g.tk
        slices += len(to_l0)
        if mix:
            ss = w % WORKSPACE_SLOTS
            l0c_free[cs, lanes], ws_free[ss, lanes], ub_free[us, lanes] = _mix_drain(
                cores, waits, ws, lanes, ss, mm, m_eff, pair * n_eff, store, ws_free[ss, lanes], ub_free[us, lanes],
                sync, latency, vector_cycles(target, -(-m_eff // 2) * n_eff * 4, act_passes), activation)
        elif vector_act:
            to_ub = issue(cores, waits, "FIXP", lanes, np.ceil(m_eff * pair * n_eff * 4 / onchip), [mm],
                          [ub_free[us, lanes]], name="L0C to UB")
            l0c_free[cs, lanes] = to_ub
            act = issue(cores, waits, "VECTOR", lanes, vector_cycles(target, m_eff * n_eff * 4, act_passes),
                        [to_ub], name=f"{activation} and cast")
            ub_free[us, lanes] = issue(cores, waits, "MTE3", lanes, store, [act], name="store C")
        else:
            l0c_free[cs, lanes] = issue(cores, waits, "FIXP", lanes, store, [mm], name="L0C to GM")
    moves.commit()
    if ws is not None:
        ws.release()


class _Workspace:
    """A MatmulMixEpilogue launch's GM workspace: WORKSPACE_SLOTS f32 blocks per core, each cut in two halves
    (one per AIV)."""

    def __init__(self, ctx: LaunchContext, out: str, cores: int, block_bytes: int):
        self.gm = ctx.gm
        self.name = f"{out}:workspace"
        self.block_bytes = block_bytes
        self.gm.workspace(self.name, cores * WORKSPACE_SLOTS * 2, cores * WORKSPACE_SLOTS * block_bytes)

    def ids(self, lanes: np.ndarray, slot: int) -> np.ndarray:
        """[lane, half] ids of one slot on these cores."""
        base = (lanes * WORKSPACE_SLOTS + slot) * 2
        return np.stack([base, base + 1], axis=1)

    def write(self, lanes: np.ndarray, slot: int, nbytes: np.ndarray) -> np.ndarray:
        """FIXP's cycles writing each lane's f32 block (both halves, by the AIC)."""
        half = np.repeat((nbytes // 2)[:, None], 2, axis=1)
        return self.gm.write_pieces(self.name, self.ids(lanes, slot), half)

    def read(self, lanes: np.ndarray, slot: int, nbytes: np.ndarray) -> np.ndarray:
        """The AIV pair's cycles reading its halves side by side (the slower half)."""
        ids = self.ids(lanes, slot)
        half = np.repeat((nbytes // 2)[:, None], 2, axis=1)
        return self.gm.read_pieces(self.name, ids.reshape(-1, 1), half.reshape(-1, 1)).reshape(-1, 2).max(axis=1)

    def release(self) -> None:
        self.gm.release(self.name)


def _mix_drain(cores, waits, ws: _Workspace, lanes: np.ndarray, slot: int, mm: np.ndarray, m_eff: np.ndarray,
               n_eff: np.ndarray, store: np.ndarray, ws_free: np.ndarray, ub_free: np.ndarray, sync: float,
               latency: float, act: np.ndarray, activation: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drain one base block through the AIVs (MatmulMixEpilogue): FIXP to a workspace slot, the cross-core flag,
    each AIV's half of the rows in, the activation, its half of C out. Returns when L0C, the workspace slot and
    the UB tile are free again."""
    nbytes = m_eff * n_eff * 4
    drained = issue(cores, waits, "FIXP", lanes, ws.write(lanes, slot, nbytes), [mm], [ws_free],
                    name="L0C to workspace")
    flagged = drained + sync  # the AIVs see the AIC's flag this much after the data landed
    loaded = issue(cores, waits, "AIV_MTE2", lanes, ws.read(lanes, slot, nbytes), [flagged], [ub_free],
                   name="load block from workspace")
    done = issue(cores, waits, "VECTOR", lanes, act, [loaded], name=f"{activation} and cast")
    top = -(-m_eff // 2)
    # each AIV stores its half of the rows side by side: the DMA start and its share of the bytes
    half_store = np.where(store > 0, latency + (store - latency) * top / np.maximum(m_eff, 1), 0.0)
    stored = issue(cores, waits, "MTE3", lanes, half_store, [done], name="store C")
    return drained, loaded, stored


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
        # a glu's B tile is two rectangles (the gate columns and the up columns N on): two tiles of B's grid where
        # the up half starts on a tile boundary (N a multiple of n), else moved one at a time
        halves_on_grid = g.pair == 1 or g.N % g.n == 0
        self.sets = None
        if len(set(names)) == len(names) and g.K > 0 and on_grid and halves_on_grid:
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
        # A and B of each k step take turns (a glu's B: its gate tile, then its up tile, as _each moves them);
        # cores loading the same block in a step share it (the first one brings it into L2)
        P = g.pair
        ka = g.a_of[bo] * g.tm + mi
        kbs = [g.b_of[bo] * P * g.tn + half * g.tn + ni for half in range(P)]  # B's column tiles: P x tn a matrix
        turns = 1 + P
        ids = np.empty((turns * g.tk, len(wave)), dtype=np.int64)
        ids[0::turns] = (ka * g.tk + sa.base)[None, :] + kk
        for half, kb in enumerate(kbs):
            ids[1 + half::turns] = (kb * g.tk + sb.base)[None, :] + kk
        moves.append(Transfer([sa] + [sb] * P, ids, first + np.arange(turns * g.tk), key=[ka, *kbs]))
        moves.append(Transfer([sc], wave[None, :] + sc.base, np.array([first + turns * g.tk]), write=True))
        costs = gm.transfer(moves)
        if first:
            bias = costs.pop(0)[0]
        load_b = sum(costs[0][1 + half::turns] for half in range(P))  # the halves' cycles, summed as _each sums them
        return bias, costs[0][0::turns], load_b, costs[1][0]

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
            # cores loading the same block in this step share it (the first one brings it into L2)
            load_a.append(gm_read(gm, ag, rect_pieces(ag, *a_rect), key=ba * g.tm + mi))
            cycles = 0
            for half in range(g.pair):  # a glu's block: the gate columns, then the up columns N further on
                c0 = n0 + half * g.N
                if g.transpose_b:
                    b_rect = (bb * g.rb + c0, bb * g.rb + c0 + n_eff, k0, k0 + k_eff)
                else:
                    b_rect = (bb * g.rb + k0, bb * g.rb + k0 + k_eff, c0, c0 + n_eff)
                cycles = cycles + gm_read(gm, bg, rect_pieces(bg, *b_rect), key=(bb * g.pair + half) * g.tn + ni)
            load_b.append(cycles)
        store = gm_write(gm, self.og, rect_pieces(self.og, bo * g.M + m0, bo * g.M + m0 + m_eff, n0, n0 + n_eff))
        return np.array(load_a), np.array(load_b), store

    def commit(self) -> None:
        if self.sets is not None:
            self.pool.commit(self.gm)

