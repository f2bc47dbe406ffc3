"""FlashAttention's CV-split schedule on the 910B (kernels/flash_attention_cv.py): cube and vector on separate cores.

Oracles: the on-chip schedule's results for the same blocks (bit for bit) and the float64 reference (within the
dtype's tolerance); the analytic GM byte count of the FA-2 loop plus the S, P and P V workspace round trips;
the cross-core flags' order read off the recorded pipe intervals; the workspace's size by formula in the plan.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from geir.kernels.base import LaunchContext
from geir.kernels.flash_attention import flash_attention_forward
from geir.kernels.flash_attention_a2 import workspace_per_core
from geir.kernels.flash_attention_tiling import FlashTiling, choose_cv_tiling, choose_flash_tiling
from geir.ops.linalg import FlashAttention
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.target_npu import as_target, load_target
from geir.target_npu.sim import PIPE_INDEX, Cores, GlobalMemory
from geir.types import DType, TensorType
from helpers.attention import attention_inputs

A2 = "ascend910b"
ONCHIP = "ascend910b[separate_cube_vector=0]"  # the same chip's numbers, cube and vector on one core
TOLERANCE = {np.dtype(np.float32): (1e-4, 1e-5), np.dtype(np.float16): (1e-2, 1e-3),
             np.dtype(ml_dtypes.bfloat16): (2e-2, 1e-2)}


def _context(target: str, record: bool = False) -> LaunchContext:
    t = load_target(target)
    return LaunchContext(t, Cores(t.cube_cores, record=record), GlobalMemory(t), ["q", "k", "v", "mask"], ["o"])


def _arrays(b, n, sq, d, nkv=None, skv=None, dtype=np.float16, mask_kind=None, seed=0):
    return attention_inputs(b, n, sq, d, nkv=nkv, skv=skv, dtype=dtype, mask_kind=mask_kind, seed=seed)


def _cv_tiling(q, k, causal, mask, blocks=None, preload=2) -> FlashTiling:
    b, n, sq, d = q.shape
    mask_bytes = mask.dtype.itemsize if mask is not None else 0
    return choose_cv_tiling(b, n, k.shape[1], sq, k.shape[2], d, DType.from_numpy(q.dtype), causal, mask_bytes,
                            load_target(A2), preload, blocks)


CASES = {
    "plain": dict(b=1, n=4, sq=512, d=64),
    "causal": dict(b=1, n=2, sq=700, d=64, causal=True),
    "additive mask": dict(b=1, n=2, sq=256, d=64, skv=600, mask_kind="additive"),
    "boolean mask and causal": dict(b=2, n=2, sq=256, d=64, mask_kind="boolean", causal=True),
    "grouped heads": dict(b=1, n=8, nkv=2, sq=384, d=128, causal=True),
    "bf16": dict(b=1, n=2, sq=512, d=64, dtype=ml_dtypes.bfloat16),
    "f32": dict(b=1, n=2, sq=256, d=64, dtype=np.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_both_schedules_compute_the_same_numbers(case):
    kw = dict(CASES[case])
    causal = kw.pop("causal", False)
    q, k, v, mask = _arrays(**kw)
    scale = 1 / math.sqrt(q.shape[-1])
    # blocks both schedules fit: the CV block 64 x 256, and the on-chip kernel's tile of the same size
    cv = _cv_tiling(q, k, causal, mask, blocks=(64, 256))
    assert cv.cv_split and (cv.s1, cv.s2) == (64, 256)
    onchip = FlashTiling(template=cv.template, s1=64, s2=256, d=cv.d, buffers=2, cores=cv.cores, ub_bytes=1, segments=1,
                         l1_bytes=1, l0a_bytes=1, l0b_bytes=1, l0c_bytes=1)
    a = flash_attention_forward(q, k, v, mask, causal, scale, cv, _context(A2))
    b = flash_attention_forward(q, k, v, mask, causal, scale, onchip, _context(ONCHIP))
    assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    # and the schedule the rules choose (the document's CV block) is as accurate as the dtype allows
    chosen = choose_flash_tiling(*(TensorType(x.shape, DType.from_numpy(x.dtype)) for x in (q, k, v)), causal,
                                 mask is not None, load_target(A2),
                                 mask_itemsize=mask.dtype.itemsize if mask is not None else None)
    out = flash_attention_forward(q, k, v, mask, causal, scale, chosen, _context(A2))
    op = FlashAttention("ge.flash_attention", [], [], {"causal": causal, "scale": scale})
    ref = op.compute(*(x.astype(np.float64) for x in (q, k, v)), *([mask] if mask is not None else []))
    rtol, atol = TOLERANCE[q.dtype]
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol)


def test_global_memory_bytes_are_the_fa2_count_plus_the_workspace_round_trips():
    b, n, s, d, isz = 1, 4, 2048, 64, 2
    q, k, v, _ = _arrays(b, n, s, d)
    tiling = _cv_tiling(q, k, False, None)
    assert (tiling.s1, tiling.s2, tiling.preload) == (128, 1024, 2)  # 1*4*(2048/64) = 128 > 48 vector cores
    ctx = _context(A2)
    flash_attention_forward(q, k, v, None, False, 0.125, tiling, ctx)
    s1, s2 = tiling.s1, tiling.s2
    units, blocks = b * n * (s // s1), s // s2
    qo = s1 * d * isz  # a unit's Q in, O out
    kv = 2 * s2 * d * isz  # K and V of a block
    trip = s1 * s2 * 4 + s1 * s2 * isz + s1 * d * 4  # S (f32), P, P V (f32) through the workspace
    assert ctx.gm.gm_read_bytes == units * (qo + blocks * (kv + trip))
    assert ctx.gm.gm_write_bytes == units * (qo + blocks * trip)
    # everything fits the L2: Q, K and V come from HBM once, the workspace never (it is read right after it is
    # written); what reaches HBM is O and each workspace slot's first write-back
    assert ctx.gm.hbm_read_bytes == 3 * b * n * s * d * isz
    cores = min(units, 24)
    assert ctx.gm.hbm_write_bytes == b * n * s * d * isz + cores * workspace_per_core(s1, s2, d, isz, 2)


def test_a_one_row_query_costs_its_row_not_the_templates_block():
    # a decode step's query (one row per head) on the S1S2 template, whose S1.i is 64 or 128 (S2 > 1024): the kernel
    # sizes the block by its real rows (ops-transformer's s1RealSize), so the cube's M is one fractal of 16 rows
    # and Q, S, P V and O move one row; P goes through the workspace in whole fractals (s1RealSizeAligned)
    b, n, skv, d, isz = 1, 4, 4096, 128, 2
    q, k, v, _ = _arrays(b, n, 1, d, skv=skv)
    tiling = _cv_tiling(q, k, False, None)
    assert tiling.s1 == 64 and tiling.s2 == 1024  # the template's block (few units: 64), for a query of one row
    ctx = _context(A2)
    flash_attention_forward(q, k, v, None, False, 1 / math.sqrt(d), tiling, ctx)
    s2, units, blocks = tiling.s2, b * n, skv // tiling.s2
    fm, fk, fn = load_target(A2).cube_fractal("f16")
    # per block: S = Q K^T (1 -> 16 rows by d by s2) and P V (16 rows by s2 by d), in fractals at one per cycle
    cube = units * blocks * 2 * (math.ceil(1 / fm) * math.ceil(d / fk) * math.ceil(s2 / fn))
    assert ctx.cores.busy[PIPE_INDEX["CUBE"]].sum() == cube
    trip = 1 * s2 * 4 + 16 * s2 * isz + 1 * d * 4  # S (f32) of one row, P in 16 rows, P V (f32) of one row
    assert ctx.gm.gm_read_bytes == units * (d * isz + blocks * (2 * s2 * d * isz + trip))
    assert ctx.gm.gm_write_bytes == units * (d * isz + blocks * trip)


def _per_core(ctx: LaunchContext, core: int) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for iv in ctx.cores.intervals:
        cores = list(np.asarray(iv.cores))
        if core in cores:
            i = cores.index(core)
            out.setdefault(iv.name, []).append((float(iv.start[i]), float(iv.end[i])))
    return out


@pytest.mark.parametrize("preload", [1, 2])
def test_cross_core_flags_order_every_exchange(preload):
    # 8 heads x 2 row blocks of 128 and 4 key blocks of 1024: each core runs its units' 4 blocks in turn
    q, k, v, _ = _arrays(1, 8, 256, 128, skv=4096)
    tiling = _cv_tiling(q, k, False, None, blocks=(128, 1024), preload=preload)
    ctx = _context(A2, record=True)
    flash_attention_forward(q, k, v, None, False, 0.088, tiling, ctx)
    chunks, subs = 1024 // 128, 64 // tiling.v_rows
    for core in (0, 7, 15):
        p = _per_core(ctx, core)
        blocks = len(p["P V to workspace"])
        assert blocks >= 4 and len(p["S to workspace"]) == blocks * chunks and len(p["load S"]) == blocks * subs
        for i in range(blocks):
            s_written = p["S to workspace"][i * chunks + chunks - 1][1]
            assert all(start >= s_written for start, _ in p["load S"][i * subs:(i + 1) * subs])
            p_written = p["P to workspace"][i * subs + subs - 1][1]
            assert all(start >= p_written for start, _ in p["load P, V chunk"][i * chunks:(i + 1) * chunks])
            assert p["load P V"][i][0] >= p["P V to workspace"][i][1]
            if i > preload:  # S slot i % (preload + 1) was last filled by block i - preload - 1: read by now
                assert p["S to workspace"][i * chunks][0] >= p["load S"][(i - preload - 1) * subs + subs - 1][1]
        # cube double-issue: within a unit, mm1 of block t + preload is on the cube before mm2 of block t
        mm1, mm2 = p["S = Q K^T"], p["P V"]
        for t in range(4 - preload):
            assert mm1[(t + preload) * chunks][0] < mm2[t * chunks][0]


def test_preloading_two_blocks_keeps_the_cube_busier_than_one():
    q, k, v, _ = _arrays(1, 8, 2048, 128)
    times = {}
    for preload in (1, 2):
        ctx = _context(A2)
        ctx.compute = False
        flash_attention_forward(q, k, v, None, False, 0.088, _cv_tiling(q, k, False, None, preload=preload), ctx)
        times[preload] = ctx.cores.finish
    assert times[2] < times[1]


GRAPH = """ge.graph @main(%q: tensor<1x8x4096x128xf16>) -> tensor<1x8x4096x128xf16> {
  %o = ge.flash_attention %q, %q, %q
  ge.return %o
}"""


@pytest.mark.parametrize("target", [A2, "ascend910a"])
def test_the_workspace_is_in_the_memory_plan_on_split_cores_only(target):
    module = parse(GRAPH)
    assert PassManager(complete_pipeline(parse_pipeline("tile,plan"))).run(module, PassContext(target=target))
    g = module.graphs[0]
    op = g.ops[0]
    tiling = op.attributes["tiling"]
    if target != A2:
        assert "workspace" not in op.attributes and "preload" not in tiling
        return
    offset, nbytes = op.attributes["workspace"]
    need = tiling["cores"] * workspace_per_core(tiling["s1"], tiling["s2"], 128, 2, tiling["preload"])
    assert nbytes == -(-need // 512) * 512
    out = op.attributes["mem_offset"][0], 8 * 4096 * 128 * 2
    # both live while the op runs: disjoint, and the arena holds both
    assert offset + nbytes <= out[0] or out[0] + out[1] <= offset
    assert g.attributes["arena_size"] >= nbytes + out[1]


def test_combined_core_chips_keep_the_on_chip_schedule():
    q, k, v, _ = _arrays(1, 8, 1024, 64)
    for target in ("ascend910a", "ascend310p", ONCHIP):
        t = choose_flash_tiling(*(TensorType(x.shape, DType.f16) for x in (q, k, v)), False, False, as_target(target))
        assert not t.cv_split and t.design is None
        ctx = _context(target)
        flash_attention_forward(q, k, v, None, False, 0.125, t, ctx)
        assert ctx.cores.busy[PIPE_INDEX["AIV_MTE2"]].sum() == 0  # no vector core loaded on its own
