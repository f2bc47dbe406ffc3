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

import numpy as np

from geir.ir import Operation
from geir.kernels import flash_attention_tiling as tiling_rules
from geir.kernels.base import Kernel, LaunchContext, allocate, issue, register_kernel
from geir.kernels.flash_attention_tiling import FlashTiling, flash_budget
from geir.kernels.tiling import Budget, Miss, OpSignature, cube_refuses
from geir.ops.numerics import round_in_f32, round_to
from geir.target_npu.sim import CapacityError, cube_cycles, local_copy_cycles, spread, vector_cycles
from geir.target_npu.target import Target
from geir.types import DType

# vector passes over the score tile per block: scale, mask, row max, subtract, exp, row sum, cast to P
SOFTMAX_PASSES = 7
# vector passes over the O tile per block: rescale by exp(m_old - m_new), add P V
ACCUMULATE_PASSES = 2
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

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: FlashTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        q, k, v = inputs[:3]
        mask = inputs[3] if len(inputs) > 3 else None
        bsnd = op.layout == "BSND"
        if bsnd:
            q, k, v = (np.swapaxes(t, 1, 2) for t in (q, k, v))
            if mask is not None and mask.ndim == 4:
                mask = np.broadcast_to(mask, (q.shape[0], q.shape[2], q.shape[1], k.shape[2]))
        out = flash_attention_forward(q, k, v, mask, op.causal, op.effective_scale(q.shape[-1]), tiling, ctx)
        return [np.swapaxes(out, 1, 2) if bsnd else out]


def flash_attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, causal: bool,
                            scale: float, tiling: FlashTiling, ctx: LaunchContext) -> np.ndarray:
    """The kernel proper on BNSD arrays: the numbers, and their timing on ctx.cores and ctx.gm."""
    target = ctx.target
    B, N, Sq, D = q.shape
    Skv = k.shape[2]
    s1, s2, nbuf, segments = tiling.s1, tiling.s2, tiling.buffers, max(tiling.segments, 1)
    if ctx.fault == "ub_overflow":
        raise CapacityError("UB", 2 * target.buffer_bytes("ub"), target.buffer_bytes("ub"), 0,
                            "the injected fault's score tile")
    check_fits(target, s1, s2, D, q.dtype, nbuf, causal, _bytes(mask.dtype) if mask is not None else 0)
    if mask is not None:
        mask = np.broadcast_to(mask, (B, N, Sq, Skv))
    _time_tiles(q.shape, k.shape, q.dtype, mask, causal, s1, s2, nbuf, segments, ctx)
    if not ctx.compute:
        return np.empty((B, N, Sq, v.shape[-1]), dtype=q.dtype)
    return _compute(q, k, v, mask, causal, scale, s1, s2, segments)


def _compute(q, k, v, mask, causal: bool, scale: float, s1: int, s2: int, segments: int) -> np.ndarray:
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
    group = N // Nkv
    R = group * Sq
    # heads that share a K/V head are stacked as rows: [B, Nkv, group * Sq, D]
    qg = q.astype(_F32).reshape(B, Nkv, R, D)
    kf, vf = k.astype(_F32), v.astype(_F32)  # O(S): converted once, not per block
    mg = None if mask is None else mask.reshape(B, Nkv, R, Skv)
    rows = np.tile(np.arange(Sq), group)
    out = np.empty((B, Nkv, R, Dv), dtype=_F32)
    chunk = max(s1, (_CACHE_SCORES // max(B * Nkv * s2, 1)) // s1 * s1)
    for c0 in range(0, R, chunk):
        c1 = min(c0 + chunk, R)
        out[:, :, c0:c1] = _rows(qg[:, :, c0:c1], kf, vf, None if mg is None else mg[:, :, c0:c1], rows[c0:c1],
                                 causal, scale, q.dtype, s1, s2, segments)
    return round_to(out.reshape(B, N, Sq, Dv), q.dtype)


# score elements per step of the arithmetic: a 2 MiB f32 tile stays in a host core's L2 cache
_CACHE_SCORES = 1 << 19


def _rows(qg, kf, vf, mg, rows, causal: bool, scale: float, dt: np.dtype, s1: int, s2: int,
          segments: int) -> np.ndarray:
    """Attention output (f32) of one chunk of stacked query rows, over every key block in order."""
    B, Nkv, R, D = qg.shape
    Skv = kf.shape[2]
    half = _bytes(dt) < 4
    nk = -(-Skv // s2)
    per_seg = -(-nk // segments)
    scale32 = _F32(scale)
    partials = []
    for seg in range(segments):
        m = np.full((B, Nkv, R), -np.inf, dtype=_F32)
        l = np.zeros((B, Nkv, R), dtype=_F32)
        acc = np.zeros((B, Nkv, R, vf.shape[-1]), dtype=_F32)
        for t in range(seg * per_seg, min((seg + 1) * per_seg, nk)):
            k0, k1 = t * s2, min((t + 1) * s2, Skv)
            # causal: query row blocks that lie wholly above this key block skip it (as their units do)
            sel = rows >= (k0 // s1) * s1 if causal else slice(None)
            if causal and not sel.any():
                continue
            kb = kf[:, :, k0:k1]
            vb = vf[:, :, k0:k1]
            qs = qg[:, :, sel] if causal else qg
            sc = np.matmul(qs, np.swapaxes(kb, -1, -2))
            sc *= scale32
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
                sc = np.where(keep, sc, -np.inf)
            m_old = m[:, :, sel]
            m_new = np.maximum(m_old, sc.max(axis=-1))
            m_safe = np.where(np.isneginf(m_new), _F32(0), m_new)
            sc -= m_safe[..., None]
            p = np.exp(sc, out=sc)  # in place: the score tile becomes P
            alpha = np.exp(m_old - m_safe)
            p_in = round_in_f32(p, dt) if half else p  # the cube takes P in the inputs' dtype
            if causal:
                l[:, :, sel] = l[:, :, sel] * alpha + p.sum(axis=-1)
                acc[:, :, sel] = acc[:, :, sel] * alpha[..., None] + np.matmul(p_in, vb)
                m[:, :, sel] = m_new
            else:
                l *= alpha
                l += p.sum(axis=-1)
                acc *= alpha[..., None]
                acc += np.matmul(p_in, vb)
                m = m_new
        partials.append((acc, m, l))
    with np.errstate(invalid="ignore", divide="ignore"):
        if segments == 1:
            acc, _, l = partials[0]
            return acc / l[..., None]
        # log-sum-exp combine of the key segments
        top = np.max([m for _, m, _ in partials], axis=0)
        top = np.where(np.isneginf(top), _F32(0), top)
        num = sum(acc * np.exp(m - top)[..., None] for acc, m, _ in partials)
        den = sum(l * np.exp(m - top) for _, m, l in partials)
        return num / den[..., None]


def _time_tiles(q_shape, k_shape, dt: np.dtype, mask, causal: bool, s1: int, s2: int, nbuf: int, segments: int,
                ctx: LaunchContext) -> None:
    """Issue every tile's instructions, wave by wave, for the cores that run them (the kernel's timing)."""
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
    q_bytes, kv_bytes, p_bytes = s1 * D * isz, s2 * D * isz, s1 * s2 * isz

    # slot events per core, kept across waves: a core's next unit reuses the slots its last one used
    k_free = [np.zeros(cores.count) for _ in range(nbuf)]      # K slots: free once K is in L0B
    slot_free = [np.zeros(cores.count) for _ in range(nbuf)]   # V and P slots: free after their P V
    score_free = [np.zeros(cores.count) for _ in range(nbuf)]  # UB score slots: free after their softmax
    for wave, on in spread(units, cores.count):
        seg = wave % segments
        rest = wave // segments
        qi = rest % nq
        bn = rest // nq
        b, n = bn // N, bn % N
        nkv = n // group
        t0 = seg * per_seg
        t1 = np.minimum(t0 + per_seg, nk)
        if causal:  # blocks wholly above the diagonal are skipped
            t1 = np.minimum(t1, -(-((qi + 1) * s1) // s2))
        trips = np.maximum(t1 - t0, 0)

        # Q block: GM -> L1 -> L0A once per unit
        q_ready = cores.issue("MTE2", on, gm.read(qname, bn * nq + qi, q_bytes), name="load Q")
        q_ready = issue(cores, waits, "MTE1", on, local_copy_cycles(target, q_bytes), [q_ready], name="Q to L0A")
        pending = None  # the previous block's (cores, P event, V event, softmax event, slot)

        for step in range(int(trips.max(initial=0))):
            act = np.nonzero(step < trips)[0]  # lanes (positions in this wave) with a block to do
            core = on[act]
            t = t0[act] + step
            slot = step % nbuf
            # each load waits until its slot's previous block is done with it: K once it is in L0B,
            # V (and P) once the second matmul has read them
            kv_block = (b[act] * Nkv + nkv[act]) * nk + t
            k_ready = issue(cores, waits, "MTE2", core, gm.read(kname, kv_block, kv_bytes),
                            slots=[k_free[slot][core]], name="load K")
            kv_ready = issue(cores, waits, "MTE2", core, gm.read(vname, kv_block, kv_bytes),
                             slots=[slot_free[slot][core]], name="load V")
            if mname is not None:
                mtile = cores.issue("MTE2", core, gm.read(mname, ((bn[act] * nq) + qi[act]) * nk + t,
                                                         s1 * s2 * _bytes(mask.dtype)), name="load mask")
                k_ready = np.maximum(k_ready, mtile)
            k_l0 = issue(cores, waits, "MTE1", core, local_copy_cycles(target, kv_bytes), [k_ready], name="K to L0B")
            k_free[slot][core] = k_l0
            s_done = issue(cores, waits, "CUBE", core, cube_cycles(target, dname, s1, D, s2), [k_l0, q_ready[act]],
                           name="S = Q K^T")
            s_ub = issue(cores, waits, "FIXP", core, local_copy_cycles(target, s1 * s2 * 4), [s_done],
                         [score_free[slot][core]], name="S to UB")
            sm_done = issue(cores, waits, "VECTOR", core, vector_cycles(target, s1 * s2 * 4, SOFTMAX_PASSES), [s_ub],
                            name="online softmax")
            score_free[slot][core] = sm_done
            p_l1 = issue(cores, waits, "MTE3", core, local_copy_cycles(target, p_bytes), [sm_done],
                         [slot_free[slot][core]], name="P to L1")
            # with two buffers the second matmul of the previous block follows this block's first on the
            # cube, and runs while the vector units work on this block's softmax; with one buffer the
            # next load needs this block's slot back, so its second matmul runs now
            if pending is not None:
                _issue_pv(cores, waits, target, dname, s1, s2, D, isz, pending, slot_free)
                pending = None

            pending = (core, p_l1, kv_ready, sm_done, slot)
            if nbuf == 1:
                _issue_pv(cores, waits, target, dname, s1, s2, D, isz, pending, slot_free)
                pending = None
        if pending is not None:
            _issue_pv(cores, waits, target, dname, s1, s2, D, isz, pending, slot_free)
        if segments == 1:
            cores.issue("VECTOR", on, vector_cycles(target, s1 * D * 4, 1), name="O / l")
            cores.issue("MTE3", on, gm.write(oname, bn * nq + qi, s1 * D * isz), name="store O")
        else:  # partial O, max and sum go to a workspace for the combine
            cores.issue("MTE3", on, gm.write(oname, wave, s1 * (D + 2) * 4), name="store partial O")

    if segments > 1:
        _time_combine(ctx, oname, units // segments, segments, s1, D, isz)


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


def _issue_pv(cores, waits, target, dname, s1, s2, D, isz, pending, slot_free) -> None:
    """Timing of the second matmul of a block and the accumulation that follows it."""
    core, p_l1, kv_ready, sm_done, slot = pending
    p_l0 = issue(cores, waits, "MTE1", core, local_copy_cycles(target, s1 * s2 * isz), [p_l1], name="P to L0A")
    pv = issue(cores, waits, "CUBE", core, cube_cycles(target, dname, s1, s2, D), [p_l0, kv_ready], name="P V")
    slot_free[slot][core] = pv
    o_ub = issue(cores, waits, "FIXP", core, local_copy_cycles(target, s1 * D * 4), [pv], name="P V to UB")
    issue(cores, waits, "VECTOR", core, vector_cycles(target, s1 * D * 4, ACCUMULATE_PASSES), [o_ub, sm_done],
          name="rescale and accumulate O")


def _time_combine(ctx: LaunchContext, oname: str, units: int, segments: int, s1: int, D: int, isz: int) -> None:
    """Timing of the log-sum-exp combine: each row block's partials in, one vector pass, O out."""
    cores, gm = ctx.cores, ctx.gm
    for wave, on in spread(units, cores.count):
        read = sum(gm.read(oname, wave * segments + j, s1 * (D + 2) * 4) for j in range(segments))
        ready = cores.issue("MTE2", on, read, name="load partials")
        done = issue(cores, ctx.waits, "VECTOR", on, vector_cycles(ctx.target, segments * s1 * D * 4, 3), [ready],
                     name="combine segments")
        issue(cores, ctx.waits, "MTE3", on, gm.write(oname, wave, s1 * D * isz), [done], name="store O")
