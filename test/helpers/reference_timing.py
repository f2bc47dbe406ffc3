"""The reference schedule, kept as a test oracle: the kernels' timing code as it was before it was
made fast (commit 3a9b945), copied verbatim and run only by the tests.

`kernels/matmul.py`, `kernels/flash_attention.py`, `kernels/data_movement.py` and
`target_npu/sim.py` now time their tiles with batched numpy (whole waves of k steps at once, L2
hits from a byte clock computed for many reads together). Those versions must produce bit-identical
simulated figures: every pipe's free and busy cycles, every recorded interval, every GM byte
counter, the L2 residency clock and every block's last touch. `test/test_timing_speed.py` runs a
kernel through both on identical chip states and compares them float for float.

Nothing here may change except to follow a deliberate change of the modelled schedule (then both
sides change together, in one commit that says why). The functions take the chip state objects of
`geir.target_npu.sim` and only read and write their public attributes.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from geir.kernels.data_movement import FRACTAL, GmTensor, gm_tensor
from geir.kernels.base import allocate
from geir.kernels.vector import elementwise_passes
from geir.target_npu.sim import PIPE_INDEX, Cores, GlobalMemory, PipeInterval, cube_cycles, local_copy_cycles, \
    spread, vector_cycles


_CUBE_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_ACTIVATION_OPS = {"relu": "ge.relu", "gelu": "ge.gelu", "gelu_tanh": "ge.gelu", "silu": "ge.silu"}
SOFTMAX_PASSES = 7
ACCUMULATE_PASSES = 2


def cores_issue(self: Cores, pipe: str, cores: np.ndarray, cost: np.ndarray | float, after: Iterable[np.ndarray] = (),
                name: str = "") -> np.ndarray:
    """Run one instruction on `pipe` of each core in `cores`; returns its end times (an event to wait on)."""
    p = PIPE_INDEX[pipe]
    start = self.free[p, cores]
    for event in after:
        start = np.maximum(start, event)
    end = start + cost
    self.free[p, cores] = end
    self.busy[p, cores] += cost
    if self.record:
        self.intervals.append(PipeInterval(p, name, cores, start, end))
    return end


def read_pieces(self: GlobalMemory, name: str, blocks: np.ndarray, nbytes: np.ndarray,
                key: np.ndarray | None = None) -> np.ndarray:
    """Cycles for each core to read its pieces: row i lists core i's block ids and bytes (0 = no piece)."""
    last = self.last_touch[name]
    valid = nbytes > 0
    hit = (self.clock - last[blocks]) < self.l2_bytes
    if key is not None and len(key) > 1:
        _, first = np.unique(key, return_index=True)
        repeat = np.ones(len(key), dtype=bool)
        repeat[first] = False
        hit |= repeat[:, None]
    miss = np.where(valid & ~hit, nbytes, 0).sum(axis=1)
    total = nbytes.sum(axis=1)
    hbm_rate = min(self.hbm_rate, self.chip_hbm_rate / max(int(np.count_nonzero(miss)), 1))
    cost = np.where(total > 0, self.latency, 0) + (total - miss) / self.l2_rate + miss / hbm_rate
    moved = int(total.sum())
    self.gm_read_bytes += moved
    self.hbm_read_bytes += int(miss.sum())
    # the L2 holds lines: data several cores read together is touched once (GlobalMemory.read_pieces)
    self.clock += moved if key is None or len(key) < 2 else int(total[first].sum())
    last[blocks[valid]] = self.clock
    self.tensor_clock[name] = self.clock
    return cost


def write_pieces(self: GlobalMemory, name: str, blocks: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Cycles for each core to write its pieces (rows as in read_pieces)."""
    total = nbytes.sum(axis=1)
    moved = int(total.sum())
    self.gm_write_bytes += moved
    self.hbm_write_bytes += moved
    self.clock += moved
    if name in self.last_touch:
        self.last_touch[name][blocks[nbytes > 0]] = self.clock
    self.tensor_clock[name] = self.clock
    rate = self.l2_rate
    if self.sizes.get(name, 0) > self.l2_bytes:
        rate = min(self.hbm_rate, self.chip_hbm_rate / max(int(np.count_nonzero(total)), 1))
    return np.where(total > 0, self.latency, 0) + total / rate


def gm_read_block(self: GlobalMemory, name: str, blocks: np.ndarray, nbytes: int | np.ndarray) -> np.ndarray:
    """GlobalMemory.read: one block per core."""
    sizes = np.broadcast_to(np.asarray(nbytes, dtype=np.int64), blocks.shape)
    return read_pieces(self, name, blocks[:, None], sizes[:, None], key=blocks)


def gm_write_block(self: GlobalMemory, name: str, blocks: np.ndarray, nbytes: int | np.ndarray) -> np.ndarray:
    """GlobalMemory.write: one block per core."""
    sizes = np.broadcast_to(np.asarray(nbytes, dtype=np.int64), blocks.shape)
    return write_pieces(self, name, blocks[:, None], sizes[:, None])


# --- kernels/base.py: issue ------------------------------------------------------------------------

def issue(cores: Cores, waits, pipe: str, on: np.ndarray, cost: np.ndarray | float,
          flags: Iterable[np.ndarray] = (), slots: Iterable[np.ndarray] = (), name: str = "") -> np.ndarray:
    """`cores.issue` with the events told apart: `flags` (operands ready) and `slots` (a buffer slot free)."""
    flags, slots = tuple(flags), tuple(slots)
    if waits is not None:
        free = cores.free[PIPE_INDEX[pipe], on]
        ready = free
        for event in flags:
            ready = np.maximum(ready, event)
        start = ready
        for event in slots:
            start = np.maximum(start, event)
        waits.flag[pipe] += float(np.sum(ready - free))
        waits.slot[pipe] += float(np.sum(start - ready))
    return cores_issue(cores, pipe, on, cost, flags + slots, name=name)


# --- kernels/data_movement.py: pieces ----------------------------------------------------------------

def _ints(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def rect_pieces(t: GmTensor, r0, r1, c0, c1) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of one rectangle per mover: fractal ids and bytes, [movers, pieces]; padding pieces have 0 bytes."""
    r0, r1, c0, c1 = np.broadcast_arrays(_ints(r0), _ints(r1), _ints(c0), _ints(c1))
    r1 = np.minimum(r1, t.rows)
    c1 = np.minimum(c1, t.cols)
    R, Rp = max(t.mrows, 1), t.padded_rows
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
    matrix = band // (Rp // FRACTAL)
    pad = np.minimum(hi, (matrix + 1) * Rp) - np.maximum(lo, matrix * Rp + R)
    rows_in = np.maximum(hi - lo, 0) - np.maximum(pad, 0)
    kb = k0[:, None] + np.arange(NK)
    cols_in = np.minimum(c1[:, None], (kb + 1) * FRACTAL) - np.maximum(c0[:, None], kb * FRACTAL)
    nbytes = np.maximum(rows_in, 0)[:, :, None] * np.maximum(cols_in, 0)[:, None, :] * t.itemsize
    blocks = band[:, :, None] * t.fcols + kb[:, None, :]
    blocks = np.where(nbytes > 0, blocks, 0)
    return blocks.reshape(len(r0), -1), nbytes.reshape(len(r0), -1)


def flat_pieces(t: GmTensor, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of the row-major element range [lo, hi) per mover."""
    lo, hi = np.broadcast_arrays(_ints(lo), _ints(hi))
    hi = np.maximum(np.minimum(hi, t.size), lo)
    C = max(t.cols, 1)
    rlo, clo = np.divmod(lo, C)
    rhi, chi = np.divmod(hi, C)
    same = rlo == rhi
    parts = [rect_pieces(t, rlo, rlo + 1, clo, np.where(same, chi, C)),
             rect_pieces(t, rlo + 1, np.where(same, rlo + 1, rhi), 0, C),
             rect_pieces(t, rhi, rhi + 1, 0, np.where(same, 0, chi))]
    return np.concatenate([p[0] for p in parts], axis=1), np.concatenate([p[1] for p in parts], axis=1)


def share_pieces(t: GmTensor, part, parts, count) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of a strided access moving `count` elements as share `part` of `parts` of the tensor."""
    part, count = np.broadcast_arrays(_ints(part), _ints(count))
    lo = (part * t.size) // max(int(parts), 1)
    span = np.maximum(np.minimum(lo + count, t.size) - lo, 0)
    blocks, nbytes = flat_pieces(t, lo, lo + span)
    short = np.maximum(count - span, 0)
    if short.any():
        if nbytes.shape[1] == 0:
            blocks, nbytes = np.zeros((len(part), 1), np.int64), np.zeros((len(part), 1), np.int64)
        nbytes = nbytes.copy()
        nbytes[:, 0] += short * t.itemsize
    return blocks, nbytes


def gm_read(gm: GlobalMemory, t: GmTensor, pieces, key=None) -> np.ndarray:
    blocks, nbytes = pieces
    return read_pieces(gm, t.name, blocks, nbytes, key)


def gm_write(gm: GlobalMemory, t: GmTensor, pieces) -> np.ndarray:
    blocks, nbytes = pieces
    return write_pieces(gm, t.name, blocks, nbytes)


# --- kernels/matmul.py: the timing of matmul_forward -------------------------------------------------
#
# The MatMul schedule of issue 25 (TCubeTiling: 2-D core split, step_k slices per L1 load, L0 ping-pong), one
# instruction and one GM move at a time: the oracle of the kernel's batched moves (a wave's reads timed together).

class _Costs:
    """Per-lane cube and on-chip copy cycles, memoised by size."""

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


def matmul_timing(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, transpose_a: bool, transpose_b: bool,
                  out_dt: np.dtype, tiling, ctx, activation: str = "none") -> None:
    """matmul_forward's timing (arrays are read for their shapes and dtypes only)."""
    from geir.kernels.matmul import WORKSPACE_SLOTS, _grid, _Workspace, _mix_drain
    from geir.kernels.matmul_tiling import folds_batch

    if folds_batch(a.shape, b.shape, transpose_a):  # the folded problem: A's batch as rows of one matrix
        rows = math.prod(a.shape[:-1])
        if bias is not None and bias.ndim >= 2 and any(d != 1 for d in bias.shape[:-1]):
            bias = np.broadcast_to(bias, a.shape[:-1] + (bias.shape[-1],)).reshape(rows, -1)
        return matmul_timing(a.reshape(rows, a.shape[-1]), b, bias, False, transpose_b, out_dt, tiling, ctx,
                             activation)

    target, cores, gm, waits = ctx.target, ctx.cores, ctx.gm, ctx.waits
    dt = a.dtype
    isz = dt.itemsize
    dname = _CUBE_DTYPES[dt.name]
    vector_act = activation != "none"
    A = np.swapaxes(a, -1, -2) if transpose_a else a
    B = np.swapaxes(b, -1, -2) if transpose_b else b
    M, K = A.shape[-2:]
    N = B.shape[-1]
    batch = np.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    nbat = math.prod(batch)
    a_of = np.broadcast_to(np.arange(math.prod(A.shape[:-2])).reshape(A.shape[:-2]), batch).reshape(-1)
    b_of = np.broadcast_to(np.arange(math.prod(B.shape[:-2])).reshape(B.shape[:-2]), batch).reshape(-1)
    if M == 0 or N == 0 or nbat == 0:
        return
    g = _grid(tiling, target, M, N, K, a_of, b_of, transpose_a, transpose_b, a.shape[-2], b.shape[-2], cores.count)
    m, n, kg = g.m, g.n, g.k
    an, bn = ctx.operand_names[:2]
    on = ctx.result_names[0]
    ag = gm_tensor(gm, an, a.shape, isz)
    bg = gm_tensor(gm, bn, b.shape, isz)
    og = gm_tensor(gm, on, batch + (M, N), np.dtype(out_dt).itemsize)
    biasg = None if bias is None else gm_tensor(gm, ctx.operand_names[2], bias.shape, bias.dtype.itemsize)
    ra, rb = a.shape[-2], b.shape[-2]
    mix = tiling.template == "MatmulMixEpilogue"
    ws = _Workspace(ctx, on, len(g.order), m * n * 4) if mix else None
    sync = target.overhead("cross_core_sync_cycles") if mix else 0.0
    latency = target.data["memory"].get("dma_latency_cycles", 0)
    costs = _Costs(target, dname)
    count = cores.count
    l1_free = np.zeros((g.l1_slots, count))
    l0_free = np.zeros((g.l0_slots, count))
    l0c_free = np.zeros((g.l0c_slots, count))
    ub_free = np.zeros((g.l0_slots, count))  # the epilogue's UB tiles: free once MTE3 stored them
    ws_free = np.zeros((WORKSPACE_SLOTS, count))  # a workspace slot: free once the AIVs read it
    act_passes = (elementwise_passes(_ACTIVATION_OPS[activation]) if vector_act else 0) + 1
    units = nbat * g.tm * g.tn
    slices_per_unit = -(-K // g.base_k) if K else 1
    loads = slices = 0
    every = np.arange(len(g.order))
    for w in range(g.order.shape[1]):
        lanes = every[g.order[:, w] >= 0]
        lanes = np.roll(lanes, -(w % len(lanes)))
        wave = g.order[lanes, w]
        bo, mi, ni = wave // (g.tm * g.tn), (wave // g.tn) % g.tm, wave % g.tn
        ba, bb = a_of[bo], b_of[bo]
        m0, n0 = mi * m, ni * n
        m_eff, n_eff = np.minimum(M - m0, m), np.minimum(N - n0, n)
        cs, us = w % g.l0c_slots, w % g.l0_slots  # the accumulator and the epilogue's UB tiles
        bias_ready = None
        if bias is not None:
            bias_ready = cores_issue(cores, "MTE2", lanes,
                                     _read_bias(gm, biasg, bias, wave, units, m0, m_eff, n0, n_eff, ni),
                                     name="load bias")
        for j in range(g.tk):
            s1 = (loads + j) % g.l1_slots
            k0 = j * kg
            k_eff = max(min(K - k0, kg), 0)
            if transpose_a:
                a_rect = (ba * ra + k0, ba * ra + k0 + k_eff, m0, m0 + m_eff)
            else:
                a_rect = (ba * ra + m0, ba * ra + m0 + m_eff, k0, k0 + k_eff)
            if transpose_b:
                b_rect = (bb * rb + n0, bb * rb + n0 + n_eff, k0, k0 + k_eff)
            else:
                b_rect = (bb * rb + k0, bb * rb + k0 + k_eff, n0, n0 + n_eff)
            load_a = gm_read(gm, ag, rect_pieces(ag, *a_rect), key=ba * g.tm + mi)
            load_b = gm_read(gm, bg, rect_pieces(bg, *b_rect), key=bb * g.tn + ni)
            a_in = issue(cores, waits, "MTE2", lanes, load_a, slots=[l1_free[s1, lanes]], name="load A")
            b_in = issue(cores, waits, "MTE2", lanes, load_b, slots=[l1_free[s1, lanes]], name="load B")
            for i in range(j * g.step, min((j + 1) * g.step, slices_per_unit)):
                ke = max(min(K - i * g.base_k, g.base_k), 0)
                s0 = (slices + i) % g.l0_slots
                to = issue(cores, waits, "MTE1", lanes, costs.local((m_eff + n_eff) * ke * isz), [a_in, b_in],
                           [l0_free[s0, lanes]], name="A, B to L0A, L0B")
                first = i == 0
                flags = [to] if not first or bias_ready is None else [to, bias_ready]
                mm = issue(cores, waits, "CUBE", lanes, costs.mmad(m_eff, ke, n_eff), flags,
                           [l0c_free[cs, lanes]] if first else [], name="mmad")
                l0_free[s0, lanes] = mm
            l1_free[s1, lanes] = to
        loads += g.tk
        slices += slices_per_unit
        store = gm_write(gm, og, rect_pieces(og, bo * M + m0, bo * M + m0 + m_eff, n0, n0 + n_eff))
        if mix:
            ss = w % WORKSPACE_SLOTS
            l0c_free[cs, lanes], ws_free[ss, lanes], ub_free[us, lanes] = _mix_drain(
                cores, waits, ws, lanes, ss, mm, m_eff, n_eff, store, ws_free[ss, lanes], ub_free[us, lanes], sync,
                latency, vector_cycles(target, -(-m_eff // 2) * n_eff * 4, act_passes), activation)
        elif vector_act:
            to_ub = issue(cores, waits, "FIXP", lanes, costs.local(m_eff * n_eff * 4), [mm], [ub_free[us, lanes]],
                          name="L0C to UB")
            l0c_free[cs, lanes] = to_ub
            act = issue(cores, waits, "VECTOR", lanes, vector_cycles(target, m_eff * n_eff * 4, act_passes), [to_ub],
                        name=f"{activation} and cast")
            ub_free[us, lanes] = issue(cores, waits, "MTE3", lanes, store, [act], name="store C")
        else:
            l0c_free[cs, lanes] = issue(cores, waits, "FIXP", lanes, store, [mm], name="L0C to GM")
    if ws is not None:
        ws.release()


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


# --- kernels/flash_attention.py: _time_tiles -----------------------------------------------------------

def _bytes(dtype: np.dtype) -> int:
    return np.dtype(dtype).itemsize


def flash_timing(q_shape, k_shape, dt: np.dtype, mask, causal: bool, s1: int, s2: int, nbuf: int, segments: int,
                 ctx, causal_rows: int | None = None) -> None:
    """flash_attention's _time_tiles: every tile's instructions, wave by wave (`causal_rows`: flash-decoding's
    stacked heads, whose query positions all lie below it)."""
    target, cores, gm, waits = ctx.target, ctx.cores, ctx.gm, ctx.waits
    B, N, Sq, D = q_shape
    Nkv, Skv = k_shape[1], k_shape[2]
    group = N // Nkv
    isz = _bytes(dt)
    dname = "bf16" if dt.name == "bfloat16" else ("f16" if dt == np.float16 else "f32")
    nq, nk = -(-Sq // s1), -(-Skv // s2)
    per_seg = -(-nk // segments)
    roles = [("q", ctx.operand_names[0], B * N * nq), ("k", ctx.operand_names[1], B * Nkv * nk),
             ("v", ctx.operand_names[2], B * Nkv * nk),
             ("mask", ctx.operand_names[3] if mask is not None else None, B * N * nq * nk),
             ("o", ctx.result_names[0], B * N * nq * segments)]
    qname, kname, vname, mname, oname = _role_names(gm, roles)
    units = B * N * nq * segments
    # a block's real rows (kernels/flash_attention_cv.block_rows): fewer than s1 where the query has fewer; on chip
    # in whole fractals of 16 rows
    rows = min(s1, Sq) if Sq > 0 else s1
    m = -(-rows // 16) * 16
    q_bytes, kv_bytes, p_bytes = rows * D * isz, s2 * D * isz, m * s2 * isz

    k_free = [np.zeros(cores.count) for _ in range(nbuf)]
    slot_free = [np.zeros(cores.count) for _ in range(nbuf)]
    score_free = [np.zeros(cores.count) for _ in range(nbuf)]
    unit_trips = np.zeros(units, dtype=np.int64)
    for wave, on in spread(units, cores.count):
        seg = wave % segments
        rest = wave // segments
        qi = rest % nq
        bn = rest // nq
        b, n = bn // N, bn % N
        nkv = n // group
        t0 = seg * per_seg
        t1 = np.minimum(t0 + per_seg, nk)
        if causal:
            t1 = np.minimum(t1, -(-(causal_rows if causal_rows is not None else (qi + 1) * s1) // s2))
        trips = np.maximum(t1 - t0, 0)
        unit_trips[wave] = trips

        q_ready = cores_issue(cores, "MTE2", on, gm_read_block(gm, qname, bn * nq + qi, q_bytes), name="load Q")
        q_ready = issue(cores, waits, "MTE1", on, local_copy_cycles(target, m * D * isz), [q_ready], name="Q to L0A")
        pending = None

        for step in range(int(trips.max(initial=0))):
            act = np.nonzero(step < trips)[0]
            core = on[act]
            t = t0[act] + step
            slot = step % nbuf
            kv_block = (b[act] * Nkv + nkv[act]) * nk + t
            k_ready = issue(cores, waits, "MTE2", core, gm_read_block(gm, kname, kv_block, kv_bytes),
                            slots=[k_free[slot][core]], name="load K")
            kv_ready = issue(cores, waits, "MTE2", core, gm_read_block(gm, vname, kv_block, kv_bytes),
                             slots=[slot_free[slot][core]], name="load V")
            if mname is not None:
                mtile = cores_issue(cores, "MTE2", core,
                                    gm_read_block(gm, mname, ((bn[act] * nq) + qi[act]) * nk + t,
                                                  rows * s2 * _bytes(mask.dtype)), name="load mask")
                k_ready = np.maximum(k_ready, mtile)
            k_l0 = issue(cores, waits, "MTE1", core, local_copy_cycles(target, kv_bytes), [k_ready], name="K to L0B")
            k_free[slot][core] = k_l0
            s_done = issue(cores, waits, "CUBE", core, cube_cycles(target, dname, rows, D, s2), [k_l0, q_ready[act]],
                           name="S = Q K^T")
            s_ub = issue(cores, waits, "FIXP", core, local_copy_cycles(target, m * s2 * 4), [s_done],
                         [score_free[slot][core]], name="S to UB")
            sm_done = issue(cores, waits, "VECTOR", core, vector_cycles(target, rows * s2 * 4, SOFTMAX_PASSES), [s_ub],
                            name="online softmax")
            score_free[slot][core] = sm_done
            p_l1 = issue(cores, waits, "MTE3", core, local_copy_cycles(target, p_bytes), [sm_done],
                         [slot_free[slot][core]], name="P to L1")
            if pending is not None:
                _issue_pv(cores, waits, target, dname, rows, s2, D, isz, pending, slot_free)
                pending = None

            pending = (core, p_l1, kv_ready, sm_done, slot)
            if nbuf == 1:
                _issue_pv(cores, waits, target, dname, rows, s2, D, isz, pending, slot_free)
                pending = None
        if pending is not None:
            _issue_pv(cores, waits, target, dname, rows, s2, D, isz, pending, slot_free)
        if segments == 1:
            cores_issue(cores, "VECTOR", on, vector_cycles(target, rows * D * 4, 1), name="O / l")
            cores_issue(cores, "MTE3", on, gm_write_block(gm, oname, bn * nq + qi, rows * D * isz), name="store O")
        else:
            cores_issue(cores, "MTE3", on, gm_write_block(gm, oname, wave, rows * (D + 2) * 4), name="store partial O")

    if segments > 1:
        # each row block combines the parts that hold its keys (IncreFlashAttention's actualCombineLoopSize)
        _time_combine(ctx, oname, np.count_nonzero(unit_trips.reshape(-1, segments) > 0, axis=1), segments, rows,
                      D, isz)


def _role_names(gm, roles: list[tuple[str, str | None, int]]) -> list[str | None]:
    """The GM name each operand role is tracked under, each registered with its own blocks."""
    out: list[str | None] = []
    blocks_of: dict[str, int] = {}
    for role, name, blocks in roles:
        if name is not None and blocks_of.get(name, blocks) != blocks:
            shared, name = name, f"{name}:{role}"
            gm.tensor_clock[name] = gm.tensor_clock.get(shared, -np.inf)
            if shared in gm.sizes:
                gm.sizes[name] = gm.sizes[shared]
        if name is not None:
            blocks_of[name] = blocks
            gm.ensure(name, blocks)
        out.append(name)
    return out


def _issue_pv(cores, waits, target, dname, s1, s2, D, isz, pending, slot_free) -> None:
    core, p_l1, kv_ready, sm_done, slot = pending
    m = -(-s1 // 16) * 16  # s1: the block's real rows; on chip in whole fractals
    p_l0 = issue(cores, waits, "MTE1", core, local_copy_cycles(target, m * s2 * isz), [p_l1], name="P to L0A")
    pv = issue(cores, waits, "CUBE", core, cube_cycles(target, dname, s1, s2, D), [p_l0, kv_ready], name="P V")
    slot_free[slot][core] = pv
    o_ub = issue(cores, waits, "FIXP", core, local_copy_cycles(target, m * D * 4), [pv], name="P V to UB")
    issue(cores, waits, "VECTOR", core, vector_cycles(target, s1 * D * 4, ACCUMULATE_PASSES), [o_ub, sm_done],
          name="rescale and accumulate O")


def _time_combine(ctx, oname: str, spans: np.ndarray, segments: int, s1: int, D: int, isz: int) -> None:
    cores, gm = ctx.cores, ctx.gm
    stored = cores.free[PIPE_INDEX["MTE3"]].max(initial=0.0)  # every core's partials are stored first
    for wave, on in spread(len(spans), cores.count):
        n = spans[wave]  # row r reads and combines its first spans[r] partials
        read = sum(gm_read_block(gm, oname, wave * segments + j, np.where(j < n, s1 * (D + 2) * 4, 0))
                   for j in range(segments))
        ready = cores_issue(cores, "MTE2", on, read, [np.full(len(on), stored)], name="load partials")
        work = np.array([vector_cycles(ctx.target, k * s1 * D * 4, 3) if k else 0.0 for k in n])
        done = issue(cores, ctx.waits, "VECTOR", on, work, [ready], name="combine segments")
        issue(cores, ctx.waits, "MTE3", on, gm_write_block(gm, oname, wave, s1 * D * isz), [done], name="store O")
