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

import numpy as np
from geir.ir import Operation
from geir.kernels import matmul_tiling as tiling_rules
from geir.kernels.base import Kernel, LaunchContext, allocate, issue, register_kernel
from geir.kernels.data_movement import (
    check_fault,
    gm_read,
    gm_tensor,
    gm_write,
    rect_pieces,
    result_dtype,
    share_pieces,
)
from geir.kernels.matmul_tiling import MatmulTiling, matmul_budget
from geir.kernels.tiling import Budget, Miss, OpSignature, cube_refuses
from geir.kernels.vector import elementwise_passes
from geir.ops.numerics import round_to
from geir.target_npu.sim import cube_cycles, local_copy_cycles, spread, vector_cycles
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


class _Costs:
    """Per-lane cube and on-chip copy cycles (tiles at the matrix edges are smaller), memoised by size."""

    def __init__(self, target, dname: str):
        self.target, self.dname = target, dname
        self.cube: dict[tuple[int, int, int], float] = {}
        self.copy: dict[int, float] = {}

    def mmad(self, m: np.ndarray, k: int, n: np.ndarray) -> np.ndarray:
        out = []
        for mm, nn in zip(m.tolist(), n.tolist()):
            key = (mm, k, nn)
            if key not in self.cube:
                self.cube[key] = cube_cycles(self.target, self.dname, mm, k, nn)
            out.append(self.cube[key])
        return np.array(out)

    def local(self, nbytes: np.ndarray) -> np.ndarray:
        out = []
        for b in nbytes.tolist():
            if b not in self.copy:
                self.copy[b] = local_copy_cycles(self.target, b)
            out.append(self.copy[b])
        return np.array(out)


def check_fits(target, m: int, n: int, k: int, itemsize: int, buffers: int, epilogue: bool, bias: bool) -> None:
    """Allocate one cube core's buffers for this base block (the kernel's matmul_budget)."""
    budget = matmul_budget(m, n, k, itemsize, buffers, target, epilogue=epilogue, bias=bias)
    allocate(target, budget, f"the {m} x {n} x {k} matmul block ({buffers} buffers)")


def matmul_forward(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, transpose_a: bool, transpose_b: bool,
                   out_dt: np.dtype, tiling: MatmulTiling, ctx: LaunchContext, epilogue=None,
                   activation: str = "none") -> np.ndarray:
    """The kernel proper; timing goes to ctx.cores and ctx.gm."""
    target, cores, gm, waits = ctx.target, ctx.cores, ctx.gm, ctx.waits
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

    costs = _Costs(target, dname)
    count = cores.count
    l1_free = np.zeros((nbuf, count))   # L1 slot: free once MTE1 moved its blocks to L0
    l0_free = np.zeros((nbuf, count))   # L0A/L0B slot: free once the cube used it
    l0c_free = np.zeros((nbuf, count))  # L0C accumulator: free once FIXP drained it
    ub_free = np.zeros((nbuf, count))   # epilogue UB tile: free once MTE3 stored it
    act_passes = (elementwise_passes(_ACTIVATION_OPS[activation]) if vector_act else 0) + 1  # + the cast
    units = nbat * tm * tn
    step = 0

    for w, (wave, lanes) in enumerate(spread(units, count)):
        bo, mi, ni = wave // (tm * tn), (wave // tn) % tm, wave % tn
        ba, bb = a_of[bo], b_of[bo]
        m0, n0 = mi * m, ni * n
        m_eff, n_eff = np.minimum(M - m0, m), np.minimum(N - n0, n)
        cs = w % nbuf
        bias_ready = np.zeros(len(wave))
        if bias is not None:
            bias_ready = cores.issue("MTE2", lanes, _read_bias(gm, biasg, bias, wave, units, m0, m_eff, n0, n_eff, ni),
                                     name="load bias")
        for kk in range(tk):
            s = step % nbuf
            step += 1
            k0 = kk * k
            k_eff = max(min(K - k0, k), 0)
            # the blocks' rectangles in the stored matrices (transposed storage swaps rows and columns)
            if transpose_a:
                a_rect = (ba * ra + k0, ba * ra + k0 + k_eff, m0, m0 + m_eff)
            else:
                a_rect = (ba * ra + m0, ba * ra + m0 + m_eff, k0, k0 + k_eff)
            if transpose_b:
                b_rect = (bb * rb + n0, bb * rb + n0 + n_eff, k0, k0 + k_eff)
            else:
                b_rect = (bb * rb + k0, bb * rb + k0 + k_eff, n0, n0 + n_eff)
            # cores loading the same block in this step share it (the first one brings it into L2)
            load_a = gm_read(gm, ag, rect_pieces(ag, *a_rect), key=ba * tm + mi)
            load_b = gm_read(gm, bg, rect_pieces(bg, *b_rect), key=bb * tn + ni)
            a_l1 = issue(cores, waits, "MTE2", lanes, load_a, slots=[l1_free[s, lanes]], name="load A")
            b_l1 = issue(cores, waits, "MTE2", lanes, load_b, slots=[l1_free[s, lanes]], name="load B")
            l0 = issue(cores, waits, "MTE1", lanes, costs.local((m_eff + n_eff) * k_eff * isz), [a_l1, b_l1],
                       [l0_free[s, lanes]], name="A, B to L0A, L0B")
            l1_free[s, lanes] = l0
            flags, slots = ([l0], []) if kk else ([l0, bias_ready], [l0c_free[cs, lanes]])
            mmad = issue(cores, waits, "CUBE", lanes, costs.mmad(m_eff, k_eff, n_eff), flags, slots, name="mmad")
            l0_free[s, lanes] = mmad

        store_pieces = rect_pieces(og, bo * M + m0, bo * M + m0 + m_eff, n0, n0 + n_eff)
        if vector_act:
            to_ub = issue(cores, waits, "FIXP", lanes, costs.local(m_eff * n_eff * 4), [mmad], [ub_free[cs, lanes]],
                          name="L0C to UB")
            l0c_free[cs, lanes] = to_ub
            act = issue(cores, waits, "VECTOR", lanes, vector_cycles(target, m_eff * n_eff * 4, act_passes), [to_ub],
                        name=f"{activation} and cast")
            ub_free[cs, lanes] = issue(cores, waits, "MTE3", lanes, gm_write(gm, og, store_pieces), [act],
                                       name="store C")
        else:
            l0c_free[cs, lanes] = issue(cores, waits, "FIXP", lanes, gm_write(gm, og, store_pieces), [mmad],
                                        name="L0C to GM")

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


def _read_bias(gm, biasg, bias, wave, units, m0, m_eff, n0, n_eff, ni) -> np.ndarray:
    """MTE2 cycles of each unit's bias tile: the distinct bias elements its output tile needs."""
    rows_vary = any(d != 1 for d in bias.shape[:-1])
    cols_vary = bias.ndim > 0 and bias.shape[-1] != 1
    if not rows_vary:
        c0 = n0 if cols_vary else np.zeros_like(n0)
        c1 = c0 + (n_eff if cols_vary else 1)
        return gm_read(gm, biasg, rect_pieces(biasg, np.zeros_like(c0), np.ones_like(c0), c0, c1),
                       key=ni if cols_vary else np.zeros_like(ni))
    return gm_read(gm, biasg, share_pieces(biasg, wave, units, m_eff * (n_eff if cols_vary else 1)))
