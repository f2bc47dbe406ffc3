"""FlashAttention forward on the simulated NPU: FlashAttention-2 loop order, tiled by the `tile` pass.

Work units are (batch, head, query row block [, key segment]) dealt round-robin to the cores; a
wave runs one unit per core, all of them in one batched numpy step per key block. Per block:

    MTE2  load K_t, V_t into an L1 slot (slot t % buffers: with 2 buffers the next load overlaps compute)
    MTE1  K_t to L0B          CUBE  S_t = Q K_t^T (f32 accumulate)      FIXP  S_t to UB
    VECTOR online softmax: scale, mask, running max and sum in f32, P_t = exp(S_t - m)
    MTE3  P_t to L1 (on-chip)  CUBE  P_t V_t                              FIXP  to UB
    VECTOR rescale and accumulate O

and the cube runs the first matmul of block t before the second matmul of block t-1, so it works
on S_t while the vector units compute the softmax of block t-1 (ops-transformer's cross-pipe
software pipeline). Causal masking skips blocks that lie wholly above the diagonal. When the tile
pass split the keys into segments, each segment is its own work unit and the partial results are
combined by log-sum-exp.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from geir.host_threads import run_split
from geir.ir import Operation
from geir.kernels import flash_attention_tiling as tiling_rules
from geir.kernels.base import Kernel, LaunchContext, PipeWaits, allocate, issue, register_kernel
from geir.kernels.flash_attention_a2 import cv_budget, vector_rows
from geir.kernels.flash_attention_cv import (
    ACCUMULATE_PASSES,
    block_rows,
    cv_grid,
    parts_spanned,
    softmax_passes,
    time_cv_split,
    unit_trips,
)
from geir.kernels.flash_attention_tiling import FLASH_DECODE, FlashTiling, flash_budget
from geir.kernels.tiling import Budget, KernelTiling, Miss, OpSignature, align, cube_refuses
from geir.ops.linalg import masked_rows
from geir.ops.numerics import round_in_f32, round_to
from geir.target_npu.sim import (
    PIPE_INDEX,
    PIPES,
    BlockSets,
    CapacityError,
    Cores,
    GlobalMemory,
    PipeInterval,
    SetPool,
    Transfer,
    cube_cycles,
    local_copy_cycles,
    spread,
    vector_cycles,
    whole_sums,
)
from geir.target_npu.target import Target
from geir.types import DType

_F32 = np.float32


def _bytes(dtype: np.dtype) -> int:
    return np.dtype(dtype).itemsize


def check_fits(target, s1: int, s2: int, d: int, dtype: np.dtype, buffers: int, causal: bool,
               mask_itemsize: int) -> None:
    """Allocate one core's buffers for this tiling; CapacityError names the buffer that overflows.

    What a work unit keeps on chip is the kernel's budget (flash_attention_tiling.flash_budget):
    one model of the kernel's buffers serves both the choice of blocks and the kernel.
    """
    budget = flash_budget(s1, s2, d, DType.from_numpy(dtype), buffers, target, causal=causal,
                          mask_itemsize=mask_itemsize)
    allocate(target, budget, f"the {s1} x {s2} FlashAttention tile (d = {d})")


@register_kernel
class FlashAttentionKernel(Kernel):
    """softmax(scale * q k^T + mask) v, tile by tile."""

    OPS = ("ge.flash_attention",)
    TILING = FlashTiling

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> FlashTiling | Miss:
        return tiling_rules.choose(sig, target, buffers)

    def refuses(self, sig: OpSignature, target: Target) -> str | None:
        return cube_refuses(sig.operands[:3], target)

    def budget(self, tiling: FlashTiling, sig: OpSignature, target: Target) -> Budget:
        return tiling_rules.budget(tiling, sig, target)

    def shrink(self, tiling: FlashTiling) -> tuple[FlashTiling, str] | None:
        return tiling_rules.shrink(tiling)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[FlashTiling]:
        return tiling_rules.candidates(sig, target, buffers)

    def check_instance(self, sig: OpSignature, tiling: KernelTiling) -> OpSignature:
        return tiling_rules.check_instance(sig, tiling)

    def schedule_problem(self, tiling: FlashTiling, target: Target) -> str | None:
        return schedule_problem(tiling, target)

    def workspace_bytes(self, tiling: FlashTiling, sig: OpSignature) -> int:
        return tiling_rules.workspace_bytes(tiling, sig)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: FlashTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        q, k, v = inputs[:3]
        mask, pse = op.mask_and_pse(inputs[3:])
        bsnd = op.layout == "BSND"
        if bsnd:
            # the mask and the pse are [B, N, Sq, Skv] in both layouts (the op's semantics): only q, k and v swap
            q, k, v = (np.swapaxes(t, 1, 2) for t in (q, k, v))
        out = flash_attention_forward(q, k, v, mask, op.causal, op.effective_scale(q.shape[-1]), tiling, ctx,
                                      softcap=op.softcap, pse=pse)
        if op.zero_masked_rows and mask is not None and ctx.compute:
            # the row-invalid correction: a row whose running max stayed -inf (the mask hid every key) writes zeros
            # instead of its 0 / 0, as the final O / l rescale selects them (its vector work is that rescale's)
            out[masked_rows(np.broadcast_to(mask, out.shape[:3] + (k.shape[2],)))] = 0
        return [np.swapaxes(out, 1, 2) if bsnd else out]


def schedule_problem(tiling: FlashTiling, target: Target) -> str | None:
    """Why this chip cannot run the schedule the tiling names, or None: the CV-split schedule needs separate cube
    and vector cores, and on such a chip only flash-decoding also has an on-chip schedule (IncreFlashAttention's)."""
    if tiling.cv_split and not target.separate_cube_vector:
        return (f"the tiling names the CV-split schedule (preload = {tiling.preload}), which needs separate cube and "
                f"vector cores; {target.name} has none")
    if not tiling.cv_split and target.separate_cube_vector and tiling.template != FLASH_DECODE:
        return (f"the tiling names the on-chip schedule (no preload), but {target.name}'s cube and vector units are "
                f"separate cores: template {tiling.template} runs there as the CV-split schedule (preload and v_rows)")
    return None


def flash_attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, causal: bool,
                            scale: float, tiling: FlashTiling, ctx: LaunchContext, *,
                            softcap: float = 0.0, pse: np.ndarray | None = None,
                            kv_tiles: np.ndarray | None = None) -> np.ndarray:
    """The kernel proper on BNSD arrays: the numbers, and their timing on ctx.cores and ctx.gm (`softcap` > 0:
    the scores capped, cap * tanh(s / cap), on the vector units before the mask; `pse`: a bias added to the
    scaled scores, ops-transformer's pse with pseType 0, one more vector pass over each score tile).
    `kv_tiles` [B]: the key tiles (of s2) each batch row reads, the rest of its keys lying past its actual length
    (IncreFlashAttention's actual_seq_lengths_kv): a unit stops there, neither loading nor computing the tiles
    after. The mask hides those keys, so the numbers are the same: a tile whose every score is -inf adds exactly 0
    to the running sum and the output and leaves the running max as it was."""
    target = ctx.target
    B, N, Sq, D = q.shape
    Skv = k.shape[2]
    s1, s2, nbuf, segments = tiling.s1, tiling.s2, tiling.buffers, max(tiling.segments, 1)
    if ctx.fault == "ub_overflow":
        raise CapacityError("UB", 2 * target.buffer_bytes("ub"), target.buffer_bytes("ub"), 0,
                            "the injected fault's score tile")
    # the schedule is the tiling's, decided once when it was chosen for the program's target (the Runtime refuses a
    # program lowered for another chip, and a tiling whose schedule this chip cannot run: schedule_problem)
    decode = tiling.template == FLASH_DECODE
    problem = schedule_problem(tiling, target)
    if problem is not None:
        raise ValueError(problem)
    cv = tiling.cv_split
    mask_isz = _bytes(mask.dtype) if mask is not None else 0
    pse_bytes = 0
    if pse is not None:
        # the pse tile comes in with the scores: a row of s2 where it is the same for every query row (ALiBi's
        # [B, N, 1, Skv]), else s1 x s2; the UB budget holds it as a tile beside the mask's
        rows = block_rows(s1, (N // k.shape[1]) * Sq if decode else Sq)  # a unit's query rows (decode: its group's)
        pse_bytes = (s2 if pse.ndim < 2 or pse.shape[-2] == 1 else rows * s2) * _bytes(pse.dtype)
        mask_isz += _bytes(pse.dtype)
    if cv:
        preload = tiling.preload
        v_rows = tiling.v_rows or vector_rows(s2, -(-s1 // target.vector_per_cube))
        allocate(target, cv_budget(s1, s2, D, v_rows, DType.from_numpy(q.dtype), target, buffers=nbuf,
                                   causal=causal, mask_itemsize=mask_isz), f"the {s1} x {s2} CV block (d = {D})")
    else:
        check_fits(target, s1, s2, D, q.dtype, nbuf, causal, mask_isz)
    if mask is not None:
        mask = np.broadcast_to(mask, (B, N, Sq, Skv))
    if pse is not None:
        pse = np.broadcast_to(pse, (B, N, Sq, Skv))
    q_grid, causal_rows = q.shape, None
    if decode:
        # flash-decoding: the query heads sharing a K/V head are one unit's rows, so the units are timed
        # as attention of B x Nkv heads with group x Sq rows each, and K/V are read once per group
        Nkv = k.shape[1]
        q_grid, causal_rows = (B, Nkv, (N // Nkv) * Sq, D), Sq
    parts = segments if decode else 1
    if cv:
        grid = cv_grid(q_grid, k.shape, s1, s2, parts)
        roles = [("q", ctx.operand_names[0], grid["q"]), ("k", ctx.operand_names[1], grid["k"]),
                 ("v", ctx.operand_names[2], grid["v"]),
                 ("mask", ctx.operand_names[3] if mask is not None or pse is not None else None, grid["mask"]),
                 ("o", ctx.result_names[0], grid["o"])]
        names = _role_names(ctx.gm, roles)
        time_cv_split(q_grid, k.shape, q.dtype, mask, causal, s1, s2, v_rows, preload, ctx, names, nbuf, parts,
                      causal_rows, softcap, pse_bytes=pse_bytes, kv_tiles=kv_tiles)
        if parts > 1:
            # on the AIVs, loading with their own engine
            nq, nk = -(-q_grid[2] // s1), -(-k.shape[2] // s2)
            _, trips = unit_trips(q_grid[0], q_grid[1], nq, nk, parts, s1, s2, causal, causal_rows, kv_tiles)
            _time_combine(ctx, names[4], parts_spanned(trips, parts), parts, block_rows(s1, q_grid[2]), D,
                          _bytes(q.dtype), "AIV_MTE2")
        segments = parts  # the CV schedule's own blocks hold a whole key row segment per unit
    else:
        _time_tiles(q_grid, k.shape, q.dtype, mask, causal, s1, s2, nbuf, segments, ctx, causal_rows, softcap,
                    pse_bytes=pse_bytes, kv_tiles=kv_tiles)
    if not ctx.compute:
        return np.empty((B, N, Sq, v.shape[-1]), dtype=q.dtype)
    return _compute(q, k, v, mask, causal, scale, s1, s2, segments, softcap, pse)


def _compute(q, k, v, mask, causal: bool, scale: float, s1: int, s2: int, segments: int,
             softcap: float = 0.0, pse: np.ndarray | None = None) -> np.ndarray:
    """The kernel's arithmetic, FlashAttention-2 style, for many work units at once.

    Work units are independent, so one key-block step of many of them (every core's tile of that
    step, and the next waves' too) runs as one batched numpy operation; each row sees exactly the
    sequence of key blocks, online-softmax updates and roundings it sees on its core: S in f32,
    running max and sum in f32, P rounded to the inputs' dtype for the cube, O accumulated in f32.
    Rows go in chunks whose score tile stays in the host's cache.
    """
    B, N, Sq, D = q.shape
    Nkv, Skv = k.shape[1], k.shape[2]
    Dv = v.shape[-1]  # the output's head dim is v's, which may differ from q's and k's
    if Skv == 0:  # no keys: P V sums nothing, so O is zeros (as torch's SDPA gives), with no running sum to divide
        return np.zeros((B, N, Sq, Dv), dtype=q.dtype)
    group = N // Nkv
    R = group * Sq
    # heads that share a K/V head are stacked as rows: [B, Nkv, group * Sq, D]
    qg = _widened(q).reshape(B, Nkv, R, D)
    if _scale_folds(q.dtype, scale):
        qg *= _F32(scale)  # once over Q instead of once over every score tile, bit for bit (see _scale_folds)
        scale = 1.0
    kf, vf = _widened(k), _widened(v)  # O(S): converted once, not per block
    mg = None if mask is None else mask.reshape(B, Nkv, R, Skv)
    pg = None if pse is None else pse.reshape(B, Nkv, R, Skv)
    rows = np.tile(np.arange(Sq), group)
    out = np.empty((B, Nkv, R, Dv), dtype=_F32)
    # The chunks depend on the blocks alone, never on how many batches and heads there are: a row's matmuls then
    # see the same operand shapes in any op of these blocks (BLAS's summation order may follow the shapes), so a
    # check instance of fewer heads computes its rows bit for bit as the whole op does.
    chunk = max(s1, (_CACHE_SCORES // max(s2, 1)) // s1 * s1)
    heads = max(1, _CACHE_SCORES // max(chunk * s2, 1))
    flat = lambda x: x.reshape(B * Nkv, 1, *x.shape[2:])  # noqa: E731 ((batch, K/V head) pairs as one axis)
    qf, kff, vff, of = flat(qg), flat(kf), flat(vf), flat(out)
    mf = None if mg is None else flat(mg)
    pf = None if pg is None else flat(pg)
    # one set of tile-sized buffers for every chunk and key block: a fresh 2 MiB temporary per step costs more in
    # page faults than its arithmetic (the values are the same: each op writes where its result would have gone)
    rows_at_once = min(heads, B * Nkv) * min(chunk, R)
    tile = rows_at_once * min(s2, Skv)
    pieces = [(slice(h0, min(h0 + heads, B * Nkv)), c0, min(c0 + chunk, R))
              for h0 in range(0, B * Nkv, heads) for c0 in range(0, R, chunk)]

    def lane_rows(lane: int, part: list[tuple[slice, int, int]]) -> None:
        buffers = _Buffers(np.empty(tile, dtype=_F32), np.empty(tile, dtype=_F32) if _bytes(q.dtype) < 4 else None,
                           np.empty(rows_at_once * Dv, dtype=_F32))
        for h, c0, c1 in part:
            _rows(qf[h, :, c0:c1], kff[h], vff[h], None if mf is None else mf[h, :, c0:c1], rows[c0:c1], causal,
                  scale, q.dtype, s1, s2, segments, softcap, None if pf is None else pf[h, :, c0:c1], buffers,
                  of[h, :, c0:c1])

    # the chunks are independent (each writes its own rows of `out`): on a multi-core host they run a lane per core,
    # where there is enough of them to repay the threads (see geir.host_threads: the numbers are the same)
    worth_lanes = len(pieces) > 1 and B * Nkv * R * Skv >= 2 * _CACHE_SCORES
    run_split(pieces, lane_rows, None if worth_lanes else 1)
    return round_to(out.reshape(B, N, Sq, Dv), q.dtype)


@functools.cache
def _f16_values() -> np.ndarray:
    """Every f16 bit pattern's f32 value, as numpy's own conversion gives it (NaN payloads included)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(_F32)


def _widened(x: np.ndarray) -> np.ndarray:
    """x as a new f32 array, bit for bit x.astype(float32): f16 by a lookup of its bit patterns in the table of all
    65536 conversions (numpy converts f16 one element at a time; the gather costs about 3/4 of that)."""
    if x.dtype == np.float16:
        return _f16_values().take(x.view(np.uint16))
    return x.astype(_F32)


def _scale_folds(dt: np.dtype, scale: float) -> bool:
    """Whether f32 scores of `dt` queries scaled after the matmul equal those of queries scaled before it, bit for bit.

    A power of two in [2^-60, 1] scales every f32 product and partial sum exactly unless one leaves the normal
    range: products of f16 values are multiples of 2^-48 below 2^33, so scaled by it they and their sums stay
    normal (or zero) and never overflow, and the rounding of each sum commutes with the scaling.
    """
    return np.dtype(dt) == np.float16 and 2.0 ** -60 <= scale <= 1.0 and math.frexp(scale)[0] == 0.5


# score elements per step of the arithmetic: a 2 MiB f32 tile stays in a host core's L2 cache
_CACHE_SCORES = 1 << 19


class _Buffers(NamedTuple):
    """Flat f32 buffers of the row loop, each as large as the largest chunk's: the score tile (which becomes P),
    P rounded to the inputs' dtype (None for f32 inputs) and P V."""

    scores: np.ndarray
    rounded: np.ndarray | None
    pv: np.ndarray


def _rows(qg, kf, vf, mg, rows, causal: bool, scale: float, dt: np.dtype, s1: int, s2: int,
          segments: int, softcap: float, pg, buffers: _Buffers, out: np.ndarray) -> None:
    """Attention output (f32, into `out`) of one chunk of stacked query rows, over every key block in order (`pg`:
    the pse rows of the chunk, added to the scaled and capped scores before the mask)."""
    B, Nkv, R, D = qg.shape
    Skv = kf.shape[2]
    half = _bytes(dt) < 4
    nk = -(-Skv // s2)
    per_seg = -(-nk // segments)
    scale32, cap32 = _F32(scale), _F32(softcap)
    Dv = vf.shape[-1]
    scores, rounded, pv_out = buffers

    def buffer(flat: np.ndarray, *shape: int) -> np.ndarray:
        return flat[:math.prod(shape)].reshape(shape)

    partials = []
    for seg in range(segments):
        m = np.full((B, Nkv, R), -np.inf, dtype=_F32)
        l = np.zeros((B, Nkv, R), dtype=_F32)
        acc = np.zeros((B, Nkv, R, Dv), dtype=_F32)
        for t in range(seg * per_seg, min((seg + 1) * per_seg, nk)):
            k0, k1 = t * s2, min((t + 1) * s2, Skv)
            # causal: query row blocks that lie wholly above this key block skip it (as their units do)
            sel = rows >= (k0 // s1) * s1 if causal else slice(None)
            if causal and not sel.any():
                continue
            kb = kf[:, :, k0:k1]
            vb = vf[:, :, k0:k1]
            qs = qg[:, :, sel] if causal else qg
            shape = (B, Nkv, qs.shape[2], k1 - k0)
            sc = np.matmul(qs, np.swapaxes(kb, -1, -2), out=buffer(scores, *shape))
            if scale32 != 1:
                sc *= scale32
            if softcap:  # the logit cap, in f32 on the score tile as the scale is
                sc /= cap32
                np.tanh(sc, out=sc)
                sc *= cap32
            if pg is not None:
                pt = pg[:, :, :, k0:k1]
                sc += (pt[:, :, sel] if causal else pt).astype(_F32)
            keep = None
            if causal:
                keep = np.arange(k0, k1)[None, :] <= rows[sel][:, None]
            if mg is not None:
                mt = mg[:, :, :, k0:k1]
                mt = mt[:, :, sel] if causal else mt
                if mt.dtype == np.bool_:
                    keep = mt if keep is None else keep & mt
                else:
                    sc += mt.astype(_F32)
            if keep is not None:
                np.copyto(sc, _F32(-np.inf), where=~np.broadcast_to(keep, sc.shape))
            m_old = m[:, :, sel]
            m_new = np.maximum(m_old, sc.max(axis=-1))
            m_safe = np.where(m_new == _F32(-np.inf), _F32(0), m_new)  # np.isneginf's Python wrapper costs more
            sc -= m_safe[..., None]
            p = np.exp(sc, out=sc)  # in place: the score tile becomes P
            alpha = np.exp(m_old - m_safe)
            p_sum = p.sum(axis=-1)  # before the rounding below, which consumes P
            # the cube takes P in the inputs' dtype; the rounding's temporary is P's own tile (two tiles, not three,
            # pass through the host's cache)
            p_in = round_in_f32(p, dt, probabilities=True, out=buffer(rounded, *shape), scratch=p) if half else p
            pv = np.matmul(p_in, vb, out=buffer(pv_out, *shape[:3], Dv))
            if causal:
                l[:, :, sel] = l[:, :, sel] * alpha + p_sum
                acc[:, :, sel] = acc[:, :, sel] * alpha[..., None] + pv
                m[:, :, sel] = m_new
            else:
                l *= alpha
                l += p_sum
                acc *= alpha[..., None]
                acc += pv
                m = m_new
        partials.append((acc, m, l))
    with np.errstate(invalid="ignore", divide="ignore"):
        if segments == 1:
            acc, _, l = partials[0]
            np.divide(acc, l[..., None], out=out)
            return
        # log-sum-exp combine of the key segments
        top = np.max([m for _, m, _ in partials], axis=0)
        top = np.where(np.isneginf(top), _F32(0), top)
        num = sum(acc * np.exp(m - top)[..., None] for acc, m, _ in partials)
        den = sum(l * np.exp(m - top) for _, m, l in partials)
        np.divide(num, den[..., None], out=out)


def _time_tiles(q_shape, k_shape, dt: np.dtype, mask, causal: bool, s1: int, s2: int, nbuf: int, segments: int,
                ctx: LaunchContext, causal_rows: int | None = None, softcap: float = 0.0, *,
                pse_bytes: int = 0, kv_tiles: np.ndarray | None = None) -> None:
    """Issue every tile's instructions, wave by wave, for the cores that run them (the kernel's timing).

    `causal_rows`: the rows are stacked heads whose query positions all lie below it (flash-decoding),
    so a causal mask hides the same key blocks from every row block. `kv_tiles` [B]: the key tiles each batch
    row reads (its actual length's); a unit stops there.
    """
    target, cores, gm, waits = ctx.target, ctx.cores, ctx.gm, ctx.waits
    B, N, Sq, D = q_shape
    Nkv, Skv = k_shape[1], k_shape[2]
    group = N // Nkv
    isz = _bytes(dt)
    dname = "bf16" if dt.name == "bfloat16" else ("f16" if dt == np.float16 else "f32")
    nq, nk = -(-Sq // s1), -(-Skv // s2)
    roles = [("q", ctx.operand_names[0], B * N * nq), ("k", ctx.operand_names[1], B * Nkv * nk),
             ("v", ctx.operand_names[2], B * Nkv * nk),
             ("mask", ctx.operand_names[3] if mask is not None or pse_bytes else None, B * N * nq * nk),
             ("o", ctx.result_names[0], B * N * nq * segments)]
    qname, kname, vname, mname, oname = _role_names(gm, roles)
    units = B * N * nq * segments
    rows = block_rows(s1, Sq)
    q_bytes, kv_bytes = rows * D * isz, s2 * D * isz

    moves = _Moves(gm, [qname, kname, vname, mname, oname], q_bytes, kv_bytes,
                   (rows * s2 * _bytes(mask.dtype) if mask is not None else 0) + pse_bytes,
                   rows * D * isz if segments == 1 else rows * (D + 2) * 4)
    c = _Consts(target, dname, rows, s2, D, isz, softmax_passes(softcap, pse=pse_bytes > 0))
    # slot events per core, kept across waves: a core's next unit reuses the slots its last one used
    slots = _Slots(cores.count, nbuf)
    # MTE1, cube, FIXP and vector cycles are whole numbers: where those busy counters are too, a wave adds
    # each lane's as one sum (exact in any order), not one instruction at a time
    per_core = -(-units // cores.count) * (nk + 1)
    whole = whole_sums(cores.busy[[MTE1, CUBE, FIXP, VECTOR]], per_core * 4 * max(vars(c).values()))
    first_block, unit_blocks = unit_trips(B, N, nq, nk, segments, s1, s2, causal, causal_rows, kv_tiles)
    for wave, on in spread(units, cores.count):
        rest = wave // segments
        qi = rest % nq
        bn = rest // nq
        b, n = bn // N, bn % N
        nkv = n // group
        t0, trips = first_block[wave], unit_blocks[wave]
        q_block = bn * nq + qi
        costs = moves.wave(q_block, (b * Nkv + nkv) * nk + t0, (bn * nq + qi) * nk + t0,
                           q_block if segments == 1 else wave, trips)
        _run_wave(cores, waits, slots, on, trips, costs, c, segments == 1, whole)
    moves.commit()

    if segments > 1:
        _time_combine(ctx, oname, parts_spanned(unit_blocks, segments), segments, rows, D, isz)


def _role_names(gm, roles: list[tuple[str, str | None, int]]) -> list[str | None]:
    """The GM name each operand role is tracked under, each registered with its own blocks.

    One tensor may play two roles (`flash_attention %q, %q, %v`), cut into blocks differently for
    each (row blocks of q, key blocks of k): a role that finds its tensor already registered with
    other blocks is tracked under a name of its own, starting from the tensor's residency.
    """
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


def _time_combine(ctx: LaunchContext, oname: str, spans: np.ndarray, segments: int, s1: int, D: int, isz: int,
                  load: str = "MTE2") -> None:
    """Timing of the log-sum-exp combine: each row block's partials in, one vector pass, O out.

    A row block's partials come from other cores, so the combine starts after every core stored its
    partials (the SyncAll that IncreFlashAttention's flash-decoding runs before its combine). Row block r
    reads and combines the partials of its first spans[r] key parts, those that hold its keys, as
    IncreFlashAttention's FlashDecodeCompute combines actualCombineLoopSize of them (hicann/ops-transformer
    @c29bc1069d3252c641e2aa059ec88f392d3f05ac, attention/incre_flash_attention/op_kernel/
    incre_flash_attention_split_Bbn2s2_Us2.h); a row with no keys only stores its O.
    """
    cores, gm = ctx.cores, ctx.gm
    stored = cores.free[MTE3].max(initial=0.0)
    partial = s1 * (D + 2) * 4
    work = {int(k): (vector_cycles(ctx.target, k * s1 * D * 4, 3) if k else 0.0) for k in np.unique(spans)}
    for wave, on in spread(len(spans), cores.count):
        n = spans[wave]
        read = sum(gm.read(oname, wave * segments + j, np.where(j < n, partial, 0)) for j in range(segments))
        ready = cores.issue(load, on, read, [np.full(len(on), stored)], name="load partials")
        done = issue(cores, ctx.waits, "VECTOR", on, np.array([work[int(k)] for k in n]), [ready],
                     name="combine segments")
        issue(cores, ctx.waits, "MTE3", on, gm.write(oname, wave, s1 * D * isz), [done], name="store O")


# --- the timing of one wave ----------------------------------------------------------------------------
#
# A lane's program is the same every wave: load Q, Q to L0A; per key block t: load K, load V (and the
# mask), K to L0B, S = Q K^T, S to UB, online softmax, P to L1, then the second half of block t - 1
# (P to L0A, P V, P V to UB, rescale and accumulate O; with one buffer block t's own); after the last
# block its second half, O / l and store O. Lanes differ only in how many blocks they do (causal rows)
# and in their loads' cycles. The GM moves are costed first (their cycles do not depend on the pipes),
# then the pipes run block by block with the lanes sorted by their block count, so the lanes still
# working are always a leading slice; then the busy cycles, intervals and waits are accounted in the
# order the instructions were issued.

class _Consts:
    """The cycles of a block's on-chip instructions (the same for every block of a launch)."""

    def __init__(self, target: Target, dname: str, s1: int, s2: int, D: int, isz: int, score_passes: int):
        # s1: the block's rows (block_rows): the cube's M and the vector work; on chip (L1, L0, L0C to UB) they
        # are kept in whole fractals of 16 rows
        m = align(s1, 16)
        self.q_l0 = local_copy_cycles(target, m * D * isz)
        self.k_l0 = local_copy_cycles(target, s2 * D * isz)
        self.qk = cube_cycles(target, dname, s1, D, s2)
        self.s_ub = local_copy_cycles(target, m * s2 * 4)
        self.softmax = vector_cycles(target, s1 * s2 * 4, score_passes)
        self.p_l1 = local_copy_cycles(target, m * s2 * isz)
        self.p_l0 = local_copy_cycles(target, m * s2 * isz)
        self.pv = cube_cycles(target, dname, s1, s2, D)
        self.o_ub = local_copy_cycles(target, m * D * 4)
        self.acc = vector_cycles(target, s1 * D * 4, ACCUMULATE_PASSES)
        self.o_l = vector_cycles(target, s1 * D * 4, 1)


class _Slots:
    """The buffer-slot events of every core, kept across waves."""

    def __init__(self, count: int, nbuf: int):
        self.nbuf = nbuf
        self.k_free = np.zeros((nbuf, count))      # K slots: free once K is in L0B
        self.slot_free = np.zeros((nbuf, count))   # V and P slots: free after their P V
        self.score_free = np.zeros((nbuf, count))  # UB score slots: free after their softmax


class _Moves:
    """The kernel's GM moves, wave by wave: Q, then each block's K, V (and mask) on the lanes doing it, then O.

    Every move is of whole blocks of the kernel's own grid, which are disjoint, and a wave moves each block
    at most once (a lane's blocks of K and V differ from step to step; lanes on the same block move it in
    the same step), so a wave's moves are timed together (`GlobalMemory.transfer`) when the roles are
    distinct tensors; otherwise one move at a time, as `GlobalMemory.read` / `write` take them.
    """

    def __init__(self, gm: GlobalMemory, names: list[str | None], q_bytes: int, kv_bytes: int, mask_bytes: int,
                 o_bytes: int):
        self.gm, self.names = gm, names
        self.bytes = (q_bytes, kv_bytes, kv_bytes, mask_bytes, o_bytes)
        present = [x for x in names if x is not None]
        self.sets = None
        if len(set(present)) == len(present):
            self.sets = []
            for name, nbytes in zip(names, self.bytes):
                if name is None:
                    self.sets.append(None)
                    continue
                blocks = len(gm.last_touch[name])
                self.sets.append(BlockSets(gm, name, np.arange(blocks)[:, None], np.full((blocks, 1), nbytes)))
            self.pool = SetPool(self.sets)

    def wave(self, q_block: np.ndarray, kv_first: np.ndarray, mask_first: np.ndarray, o_block: np.ndarray,
             trips: np.ndarray) -> tuple:
        """Cycles of one wave's moves: Q and O [lane], K, V and mask [block step, lane] (0 where a lane is done)."""
        gm = self.gm
        qname, kname, vname, mname, oname = self.names
        q_bytes, kv_bytes, _, mask_bytes, o_bytes = self.bytes
        steps = int(trips.max(initial=0))
        step = np.arange(steps)[:, None]
        act = step < trips[None, :]
        if self.sets is None:
            lanes = len(trips)
            k, v, m = np.zeros((steps, lanes)), np.zeros((steps, lanes)), np.zeros((steps, lanes))
            q = gm.read(qname, q_block, q_bytes)
            for s in range(steps):
                on = np.nonzero(act[s])[0]
                k[s, on] = gm.read(kname, kv_first[on] + s, kv_bytes)
                v[s, on] = gm.read(vname, kv_first[on] + s, kv_bytes)
                if mname is not None:
                    m[s, on] = gm.read(mname, mask_first[on] + s, mask_bytes)
            return q, k, v, (m if mname is not None else None), gm.write(oname, o_block, o_bytes)
        per = 3 if mname is not None else 2
        qs, ks, vs, ms, os_ = self.sets
        kv = np.where(act, kv_first + step, 0)  # a lane past its last block sits out (its id is ignored)
        moves = [Transfer([qs], q_block[None, :] + qs.base, np.zeros(1, np.int64), key=[q_block])]
        if steps:  # K, V (and the mask) of each block take turns
            if ms is None:
                ids, key, turns = np.stack([kv + ks.base, kv + vs.base], axis=1), [kv_first, kv_first], [ks, vs]
            else:
                ids = np.stack([kv + ks.base, kv + vs.base, np.where(act, mask_first + step, 0) + ms.base], axis=1)
                key, turns = [kv_first, kv_first, mask_first], [ks, vs, ms]
            moves.append(Transfer(turns, ids.reshape(per * steps, -1), 1 + np.arange(per * steps), key=key,
                                  active=np.repeat(act, per, axis=0)))
        moves.append(Transfer([os_], o_block[None, :] + os_.base, np.array([1 + per * steps]), write=True))
        costs = gm.transfer(moves)
        if steps == 0:
            return costs[0][0], np.zeros((0, len(trips))), np.zeros((0, len(trips))), None, costs[-1][0]
        kvm = costs[1]
        return (costs[0][0], kvm[0::per], kvm[1::per], kvm[2::per] if ms is not None else None, costs[-1][0])

    def commit(self) -> None:
        if self.sets is not None:
            self.pool.commit(self.gm)


class _Lanes:
    """One wave's pipes on its lanes, sorted by block count (most first): the lanes doing block t are the
    first `n` of them, so every instruction runs on a leading slice of the state arrays."""

    def __init__(self, cores: Cores, waits: PipeWaits | None, slots: _Slots, on: np.ndarray, trips: np.ndarray):
        self.cores, self.waits, self.slots = cores, waits, slots
        self.order = np.argsort(-trips, kind="stable")
        self.lanes = on[self.order]
        self.pipes = cores.free[:, self.lanes]  # [pipe, lane]: when each pipe is free
        self.k_free = slots.k_free[:, self.lanes]
        self.slot_free = slots.slot_free[:, self.lanes]
        self.score_free = slots.score_free[:, self.lanes]
        # what was issued, for the intervals and waits: (pipe, name, lanes, free, ready, start, end, booked)
        self.log: list | None = [] if cores.record or waits is not None else None

    def ins(self, pipe: int, n: int, cost, flags=(), slots=(), name: str = "", booked: bool = True) -> np.ndarray:
        """One instruction on `pipe` of the first n lanes: it starts when the pipe, its flags and its slots
        are all ready (issue's arithmetic); returns its end times."""
        free = self.pipes[pipe, :n]
        ready = free
        for e in flags:
            ready = np.maximum(ready, e)
        start = ready
        for e in slots:
            start = np.maximum(start, e)
        end = start + cost
        if self.log is not None:
            copy = lambda x: x.copy() if x is free else x  # noqa: E731 (free is overwritten below)
            self.log.append((pipe, name, n, free.copy(), copy(ready), copy(start), end, booked))
        self.pipes[pipe, :n] = end
        return end

    def done(self, busy_rows: dict[int, np.ndarray]) -> None:
        """Write the wave's state back, add each pipe's busy cycles (`busy_rows[pipe]`: its costs in issue
        order, [instruction, lane], 0 where a lane issued nothing), and record the intervals and waits."""
        cores, lanes = self.cores, self.lanes
        cores.free[:, lanes] = self.pipes
        self.slots.k_free[:, lanes] = self.k_free
        self.slots.slot_free[:, lanes] = self.slot_free
        self.slots.score_free[:, lanes] = self.score_free
        for p, rows in busy_rows.items():
            # cumsum adds in order: the same floats as adding one instruction's cost at a time (x + 0.0 == x)
            cores.busy[p, lanes] = np.cumsum(np.concatenate([cores.busy[p, lanes][None, :], rows]), axis=0)[-1]
        if self.log is None:
            return
        # back to the lanes' order in the wave, as each instruction saw them
        back = {}
        for pipe, name, n, free, ready, start, end, booked in self.log:
            if n not in back:
                idx = np.argsort(self.order[:n])
                back[n] = (idx, lanes[:n][idx])
            idx, on = back[n]
            if booked and self.waits is not None:
                self.waits.flag[PIPES[pipe]] += float(np.sum((ready - free)[idx]))
                self.waits.slot[PIPES[pipe]] += float(np.sum((start - ready)[idx]))
            if cores.record:
                cores.intervals.append(PipeInterval(pipe, name, on, start[idx], end[idx]))


def _steps_of(first: list[np.ndarray], second: list[np.ndarray], single: bool) -> np.ndarray:
    """A pipe's per-lane costs in issue order, from the first half's costs of each block ([block, lane]) and
    the second half's (block t's comes after block t + 1's first half; with one buffer, right after its own)."""
    parts = first + second
    steps = len(first[0])
    rows = np.zeros((len(parts) * (steps + 1), first[0].shape[1]))
    k = len(parts)
    for i, x in enumerate(first):
        rows[i:k * steps:k] = x
    shift = 0 if single else k
    for i, x in enumerate(second):
        rows[len(first) + i + shift::k][:steps] = x
    return rows


def _run_wave(cores: Cores, waits: PipeWaits | None, slots: _Slots, on: np.ndarray, trips: np.ndarray,
              costs: tuple, c: _Consts, single_segment: bool, whole: bool) -> None:
    """One wave's instructions (the lane program above) on its lanes (`whole`: the on-chip pipes' busy
    cycles may be added as one sum per lane, see whole_sums)."""
    q_cost, k_cost, v_cost, m_cost, o_cost = costs
    w = _Lanes(cores, waits, slots, on, trips)
    order = w.order
    T = trips[order]
    steps = int(T[0]) if len(T) else 0
    n_at = np.searchsorted(-T, -np.arange(steps), side="left").tolist()  # lanes still working at each block
    k_cost, v_cost = k_cost[:, order], v_cost[:, order]
    m_cost = m_cost[:, order] if m_cost is not None else None
    lanes = len(order)

    q_end = w.ins(MTE2, lanes, q_cost[order], name="load Q", booked=False)
    q_ready = w.ins(MTE1, lanes, c.q_l0, [q_end], name="Q to L0A")
    (_blocks if w.log is not None else _blocks_fast)(w, n_at, k_cost, v_cost, m_cost, q_ready, c)
    if single_segment:
        w.ins(VECTOR, lanes, c.o_l, name="O / l", booked=False)
        w.ins(MTE3, lanes, o_cost[order], name="store O", booked=False)
    else:  # partial O, max and sum go to a workspace for the combine
        w.ins(MTE3, lanes, o_cost[order], name="store partial O", booked=False)

    # the busy cycles each pipe's instructions added, lane by lane in issue order
    busy = {MTE2: np.concatenate([q_cost[order][None, :],
                                  _steps_of([k_cost, v_cost] + ([m_cost] if m_cost is not None else []), [], True)])}
    if whole:  # whole numbers: each lane's sum at once (T blocks of each instruction)
        Tf = T.astype(np.float64)
        busy[MTE1] = (c.q_l0 + Tf * c.k_l0 + Tf * c.p_l0)[None, :]
        busy[CUBE] = (Tf * c.qk + Tf * c.pv)[None, :]
        busy[FIXP] = (Tf * c.s_ub + Tf * c.o_ub)[None, :]
        busy[VECTOR] = (Tf * c.softmax + Tf * c.acc + (c.o_l if single_segment else 0.0))[None, :]
    else:
        act = (np.arange(steps)[:, None] < T[None, :]).astype(np.float64)
        single = slots.nbuf == 1
        busy[MTE1] = np.concatenate([np.full((1, lanes), c.q_l0), _steps_of([act * c.k_l0], [act * c.p_l0], single)])
        busy[CUBE] = _steps_of([act * c.qk], [act * c.pv], single)
        busy[FIXP] = _steps_of([act * c.s_ub], [act * c.o_ub], single)
        busy[VECTOR] = _steps_of([act * c.softmax], [act * c.acc], single)
        if single_segment:
            busy[VECTOR] = np.concatenate([busy[VECTOR], np.full((1, lanes), c.o_l)])
    # MTE3 also stores O (fractional GM cycles): always one instruction at a time
    act = (np.arange(steps)[:, None] < T[None, :]).astype(np.float64)
    busy[MTE3] = np.concatenate([_steps_of([act * c.p_l1], [], True), o_cost[order][None, :]])
    w.done(busy)


MTE2, MTE1, CUBE, FIXP, VECTOR, MTE3 = (PIPE_INDEX[p] for p in ("MTE2", "MTE1", "CUBE", "FIXP", "VECTOR", "MTE3"))


def _blocks(w: _Lanes, n_at: list[int], k_cost, v_cost, m_cost, q_ready: np.ndarray, c: _Consts) -> None:
    """Every block's instructions, one `ins` at a time (each logged for the intervals and waits)."""
    nbuf = w.slots.nbuf
    kf, sf, scf = w.k_free, w.slot_free, w.score_free

    def second_half(pending) -> None:
        n, p_l1, kv_ready, sm_done, slot = pending
        p_l0 = w.ins(MTE1, n, c.p_l0, [p_l1], name="P to L0A")
        pv = w.ins(CUBE, n, c.pv, [p_l0, kv_ready], name="P V")
        sf[slot, :n] = pv
        o_ub = w.ins(FIXP, n, c.o_ub, [pv], name="P V to UB")
        w.ins(VECTOR, n, c.acc, [o_ub, sm_done], name="rescale and accumulate O")

    pending = None
    for t, n in enumerate(n_at):
        slot = t % nbuf
        k_ready = w.ins(MTE2, n, k_cost[t, :n], slots=[kf[slot, :n]], name="load K")
        kv_ready = w.ins(MTE2, n, v_cost[t, :n], slots=[sf[slot, :n]], name="load V")
        if m_cost is not None:
            mtile = w.ins(MTE2, n, m_cost[t, :n], name="load mask", booked=False)
            k_ready = np.maximum(k_ready, mtile)
        k_l0 = w.ins(MTE1, n, c.k_l0, [k_ready], name="K to L0B")
        kf[slot, :n] = k_l0
        s_done = w.ins(CUBE, n, c.qk, [k_l0, q_ready[:n]], name="S = Q K^T")
        s_ub = w.ins(FIXP, n, c.s_ub, [s_done], [scf[slot, :n]], name="S to UB")
        sm_done = w.ins(VECTOR, n, c.softmax, [s_ub], name="online softmax")
        scf[slot, :n] = sm_done
        p_l1 = w.ins(MTE3, n, c.p_l1, [sm_done], [sf[slot, :n]], name="P to L1")
        # with two buffers the second matmul of the previous block follows this block's first on the
        # cube, and runs while the vector units work on this block's softmax; with one buffer the
        # next load needs this block's slot back, so its second matmul runs now
        if pending is not None:
            second_half(pending)
            pending = None
        pending = (n, p_l1, kv_ready, sm_done, slot)
        if nbuf == 1:
            second_half(pending)
            pending = None
    if pending is not None:
        second_half(pending)


def _blocks_fast(w: _Lanes, n_at: list[int], k_cost, v_cost, m_cost, q_ready: np.ndarray, c: _Consts) -> None:
    """`_blocks` without the log: the same arithmetic in the same order, each end written straight into its
    pipe's state (an instruction starts at the latest of its pipe, its flags and its slots)."""
    mx = np.maximum
    nbuf = w.slots.nbuf
    kf, sf, scf = w.k_free, w.slot_free, w.score_free
    mte2, mte1, cube, fixp, vec, mte3 = (w.pipes[p] for p in (MTE2, MTE1, CUBE, FIXP, VECTOR, MTE3))

    def second_half(n, p_l1, kv_ready, slot) -> None:
        l0 = mte1[:n]  # P to L0A
        mx(l0, p_l1, out=l0)
        l0 += c.p_l0
        pv = cube[:n]  # P V
        mx(pv, l0, out=pv)
        mx(pv, kv_ready, out=pv)
        pv += c.pv
        sf[slot, :n] = pv
        ub = fixp[:n]  # P V to UB
        mx(ub, pv, out=ub)
        ub += c.o_ub
        acc = vec[:n]  # rescale and accumulate O; its softmax's end is still in the score slot
        mx(acc, ub, out=acc)
        mx(acc, scf[slot, :n], out=acc)
        acc += c.acc

    pending = None
    for t, n in enumerate(n_at):
        slot = t % nbuf
        k_ready = mx(mte2[:n], kf[slot, :n])  # load K
        k_ready += k_cost[t, :n]
        kv_ready = mx(k_ready, sf[slot, :n])  # load V
        kv_ready += v_cost[t, :n]
        if m_cost is not None:
            mtile = kv_ready + m_cost[t, :n]  # load mask
            mte2[:n] = mtile
            mx(k_ready, mtile, out=k_ready)
        else:
            mte2[:n] = kv_ready
        k_l0 = mte1[:n]  # K to L0B
        mx(k_l0, k_ready, out=k_l0)
        k_l0 += c.k_l0
        kf[slot, :n] = k_l0
        s = cube[:n]  # S = Q K^T
        mx(s, k_l0, out=s)
        mx(s, q_ready[:n], out=s)
        s += c.qk
        s_ub = fixp[:n]  # S to UB
        mx(s_ub, s, out=s_ub)
        mx(s_ub, scf[slot, :n], out=s_ub)
        s_ub += c.s_ub
        sm = vec[:n]  # online softmax
        mx(sm, s_ub, out=sm)
        sm += c.softmax
        scf[slot, :n] = sm
        p_l1 = mte3[:n]  # P to L1
        mx(p_l1, sm, out=p_l1)
        mx(p_l1, sf[slot, :n], out=p_l1)
        p_l1 += c.p_l1
        p_l1 = p_l1.copy()  # MTE3's next instruction comes before this block's P to L0A
        if pending is not None:
            second_half(*pending)
            pending = None
        pending = (n, p_l1, kv_ready, slot)
        if nbuf == 1:
            second_half(*pending)
            pending = None
    if pending is not None:
        second_half(*pending)
