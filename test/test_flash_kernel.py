"""The FlashAttention kernel: numbers against the float64 reference, bytes against the FA-2 count, overlap."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from geir.kernels.base import LaunchContext
from geir.kernels.flash_attention import flash_attention_forward
from geir.kernels.flash_attention_a2 import PRELOAD
from geir.ops.linalg import FlashAttention
from geir.kernels.flash_attention_tiling import FlashTiling, choose_flash_tiling
from geir.target_npu import as_target, load_target
from geir.target_npu.sim import CapacityError, Cores, GlobalMemory
from geir.types import DType, TensorType
from helpers.attention import attention_inputs

# the on-chip schedule (one AI core holds cube and vector) on the 910B's numbers; the 910B itself runs the CV-split
# schedule, whose bytes and overlap test_flash_cv.py checks
ONCHIP = "ascend910b[separate_cube_vector=0]"
TOLERANCE = {np.dtype(np.float32): (1e-4, 1e-5), np.dtype(np.float16): (1e-2, 1e-3),
             np.dtype(ml_dtypes.bfloat16): (2e-2, 1e-2)}


def _context(target: str = "ascend910b", record: bool = False) -> LaunchContext:
    t = load_target(target)
    return LaunchContext(t, Cores(t.cube_cores, record=record), GlobalMemory(t), ["q", "k", "v", "mask"], ["o"])


def _tiling(q, k, causal: bool, mask, target: str = "ascend910b", buffers: int = 2) -> dict:
    dt = DType.from_numpy(q.dtype)
    tq, tk = TensorType(q.shape, dt), TensorType(k.shape, dt)
    return choose_flash_tiling(tq, tk, tk, causal, mask is not None, as_target(target), buffers,
                               mask_itemsize=mask.dtype.itemsize if mask is not None else None).to_attr()


def _blocks(s1: int, s2: int, buffers: int = 2, cv: bool = True) -> FlashTiling:
    """A FlashAttention tiling with these blocks (its budgets are the kernel's to check); `cv`: the CV-split schedule
    a split-core chip runs, else the on-chip one."""
    return FlashTiling(template="S1s2Bn2gs1", s1=s1, s2=s2, d=128, buffers=buffers, cores=24, ub_bytes=1, segments=1,
                       l1_bytes=1, l0a_bytes=1, l0b_bytes=1, l0c_bytes=1, preload=PRELOAD if cv else 0)


def _run(b, n, sq, d, *, nkv=None, skv=None, dtype=np.float16, causal=False, mask_kind=None, target="ascend910b",
         buffers=2, tiling=None, seed=0):
    q, k, v, mask = attention_inputs(b, n, sq, d, nkv=nkv, skv=skv, dtype=dtype, mask_kind=mask_kind, seed=seed)
    ctx = _context(target)
    tiling = tiling or _tiling(q, k, causal, mask, target, buffers)
    scale = 1 / math.sqrt(d)
    out = flash_attention_forward(q, k, v, mask, causal, scale, FlashTiling.from_attr(tiling), ctx)
    op = FlashAttention("ge.flash_attention", [], [], {"causal": causal, "scale": scale})
    ref = op.compute(*(x.astype(np.float64) for x in (q, k, v)), *([mask] if mask is not None else []))
    return out, ref, ctx, tiling


CASES = [
    dict(b=1, n=2, sq=200, d=64),                                 # Sq not a multiple of the block
    dict(b=2, n=2, sq=130, d=32, skv=300),                        # Sq != Skv, both ragged
    dict(b=1, n=4, sq=256, d=64, causal=True),
    dict(b=1, n=3, sq=257, d=16, skv=200, causal=True),           # causal with Sq > Skv
    dict(b=1, n=2, sq=128, d=64, mask_kind="additive"),
    dict(b=2, n=2, sq=96, d=64, skv=160, mask_kind="boolean"),
    dict(b=1, n=8, sq=128, d=64, nkv=2),                          # grouped-query heads
    dict(b=1, n=4, sq=1100, d=64, nkv=1, causal=True),            # long: split template
    dict(b=1, n=2, sq=300, d=128, dtype=np.float32),
    dict(b=1, n=2, sq=300, d=64, dtype=ml_dtypes.bfloat16, causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_matches_float64_reference(case: dict) -> None:
    out, ref, _, _ = _run(**case)
    rtol, atol = TOLERANCE[np.dtype(case.get("dtype", np.float16))]
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("target", ["ascend910b", "ascend910a", "ascend310p"])
def test_every_target_runs_the_tile_pass_choice(target: str) -> None:
    out, ref, _, tiling = _run(1, 4, 384, 128, causal=True, target=target)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-2, atol=1e-3)
    assert tiling["s1"] in (64, 128)


def test_key_segments_combine_by_log_sum_exp() -> None:
    base = _run(1, 2, 256, 64)[3]
    out, ref, _, _ = _run(1, 2, 256, 64, tiling=dict(base, segments=2, s2=64))
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-2, atol=1e-3)


def test_global_memory_bytes_are_the_flash_attention_2_count() -> None:
    b, n, s, d = 1, 8, 512, 64
    _, _, ctx, tiling = _run(b, n, s, d, target=ONCHIP)
    e = 2
    row_blocks = math.ceil(s / tiling["s1"])
    expected_read = b * n * s * d * e + 2 * b * n * s * d * e * row_blocks  # Q once; K and V per row block
    expected_write = b * n * s * d * e  # O once
    assert ctx.gm.gm_read_bytes == expected_read
    assert ctx.gm.gm_write_bytes == expected_write
    # heads' K and V are read by several cores at once: only the first read of a block reaches HBM
    assert ctx.gm.hbm_read_bytes < ctx.gm.gm_read_bytes / 2


def test_causal_skips_blocks_above_the_diagonal() -> None:
    _, _, full, _ = _run(1, 4, 1024, 64, causal=False, target=ONCHIP)
    _, _, causal, _ = _run(1, 4, 1024, 64, causal=True, target=ONCHIP)
    assert causal.gm.gm_read_bytes < 0.7 * full.gm.gm_read_bytes
    assert causal.cores.finish < 0.8 * full.cores.finish


def test_double_buffering_overlaps_loads_with_compute() -> None:
    _, _, two, _ = _run(1, 8, 1024, 128, buffers=2, target=ONCHIP)
    _, _, one, _ = _run(1, 8, 1024, 128, buffers=1, target=ONCHIP)
    assert one.cores.finish > 1.2 * two.cores.finish
    # with one buffer the cube idles while the next block loads: it is busy for a smaller share of the time
    cube_share = lambda ctx: ctx.cores.busy[2].sum() / (ctx.cores.finish * ctx.cores.count)  # noqa: E731
    assert cube_share(one) < cube_share(two)


def test_cube_runs_the_next_scores_while_the_vector_units_run_the_softmax() -> None:
    ctx = _context(ONCHIP, record=True)
    rng = np.random.default_rng(0)
    # eight heads share one K/V head: after core 0 brings each block into L2 the others read it fast,
    # so on core 1 the cube and the vector units, not the loads, set the pace
    q = rng.standard_normal((1, 8, 128, 128)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, 512, 128)).astype(np.float16) for _ in range(2))
    flash_attention_forward(q, k, v, None, False, 0.088, _blocks(128, 128, cv=False), ctx)

    def on_core_1(name: str) -> list[tuple[float, float]]:
        out = []
        for iv in ctx.cores.intervals:
            if iv.name == name and 1 in iv.cores:
                i = list(iv.cores).index(1)
                out.append((iv.start[i], iv.end[i]))
        return out

    scores, softmax, pv = on_core_1("S = Q K^T"), on_core_1("online softmax"), on_core_1("P V")
    assert len(scores) == len(softmax) == len(pv) == 4
    for t in range(3):
        # S of block t+1 is on the cube before P V of block t, and overlaps block t's softmax
        assert scores[t + 1][0] < pv[t][0]
        assert scores[t + 1][0] < softmax[t][1] and scores[t + 1][1] > softmax[t][0]


def test_a_tiling_names_its_schedule_and_a_chip_that_cannot_run_it_refuses() -> None:
    q = np.zeros((1, 1, 128, 128), np.float16)
    with pytest.raises(ValueError, match="CV-split schedule .* needs separate cube and vector cores"):
        flash_attention_forward(q, q, q, None, False, 0.088, _blocks(128, 128, cv=True), _context(ONCHIP))
    with pytest.raises(ValueError, match="names the on-chip schedule .* separate cores"):
        flash_attention_forward(q, q, q, None, False, 0.088, _blocks(128, 128, cv=False), _context())


def test_a_tile_too_large_for_the_buffers_is_an_error() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 512, 512)).astype(np.float16)
    with pytest.raises(CapacityError, match=r"(UB|L1|L0A|L0B|L0C) overflow: .* needs \d+ bytes, but .* holds \d+ bytes"):
        flash_attention_forward(q, q, q, None, False, 0.05, _blocks(512, 512), _context())


def test_one_tensor_as_q_and_k_is_cut_into_the_blocks_of_each_role() -> None:
    # Skv > 1024: s1 = 64 row blocks of q, s2 = 128 key blocks of k; the same GM tensor plays both roles
    rng = np.random.default_rng(5)
    q = (0.5 * rng.standard_normal((1, 2, 2048, 64))).astype(np.float16)
    v = rng.standard_normal((1, 2, 2048, 64)).astype(np.float16)
    tiling = FlashTiling.from_attr(_tiling(q, q, False, None))
    shared = LaunchContext(load_target("ascend910b"), Cores(24), GlobalMemory(load_target("ascend910b")),
                           ["q", "q", "v"], ["o"])
    apart = _context()
    out = flash_attention_forward(q, q, v, None, False, 0.125, tiling, shared)
    again = flash_attention_forward(q, q.copy(), v, None, False, 0.125, tiling, apart)
    assert out.tobytes() == again.tobytes()
    ref = FlashAttention("ge.flash_attention", [], [], {"scale": 0.125}).compute(
        *(x.astype(np.float64) for x in (q, q, v)))
    assert np.allclose(out, ref, rtol=1e-2, atol=1e-3)
    assert shared.gm.gm_read_bytes == apart.gm.gm_read_bytes  # the same bytes move, whoever holds them


def test_a_power_of_two_scale_folded_into_the_queries_gives_the_same_bits(monkeypatch) -> None:
    # extreme f16 values (the largest, subnormals, mixed signs): the folded scale must not move a single bit
    from geir.kernels import flash_attention as fa
    rng = np.random.default_rng(11)
    specials = np.array([65504, -65504, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -14, 0.0, -0.0, 1.0], np.float16)
    with np.errstate(over="ignore"):  # some products overflow to inf, which the kernel must carry alike
        q, k, v = (rng.choice(specials, (1, 2, 96, 16)) * rng.standard_normal((1, 2, 96, 16)).astype(np.float16)
                   for _ in range(3))
    q[0, 1, :8] = rng.choice(specials, (8, 16))
    scales = (0.125, 2.0 ** -60, 1.0, 0.5)
    assert all(fa._scale_folds(np.float16, s) for s in scales)
    assert not any(fa._scale_folds(np.float16, s) for s in (0.088, 2.0, 2.0 ** -61))
    assert not fa._scale_folds(np.float32, 0.125)  # f32 products can be subnormal: scaled first they would round
    with np.errstate(all="ignore"):
        folded = [fa._compute(q, k, v, None, causal, s, 32, 32, 1) for s in scales for causal in (False, True)]
        monkeypatch.setattr(fa, "_scale_folds", lambda dt, scale: False)
        plain = [fa._compute(q, k, v, None, causal, s, 32, 32, 1) for s in scales for causal in (False, True)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(folded, plain))


def test_f16_operands_widen_to_f32_bit_for_bit() -> None:
    # every f16 bit pattern (subnormals, infinities, NaN payloads), in a strided view as the kernel may get one:
    # the kernel's table lookup must give numpy's own conversion
    from geir.kernels import flash_attention as fa
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 256)
    for x in (every, every.T, every[::3, 1::2]):
        widened = fa._widened(x)
        assert widened.dtype == np.float32 and widened.shape == x.shape
        assert widened.view(np.uint32).tobytes() == x.astype(np.float32).view(np.uint32).tobytes()
