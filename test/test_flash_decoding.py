"""Flash-decoding (split-KV) path of the FlashAttention kernel: when the tiling takes it, how many key
parts and work units, and its numbers against a float64 softmax attention written here."""

from __future__ import annotations

import math

import attrs
import ml_dtypes
import numpy as np
import pytest

from geir.accuracy import compare
from geir.kernels.base import LaunchContext
from geir.kernels.flash_attention import flash_attention_forward
from geir.kernels.flash_attention_tiling import FLASH_DECODE, SPLIT_KV, choose_flash_tiling
from geir.ops.linalg import FlashAttention
from geir.ops.numerics import round_to
from geir.target_npu import as_target, load_target
from geir.target_npu.sim import Cores, GlobalMemory
from geir.types import DType, TensorType
from helpers.attention import attention_inputs

BF16 = np.dtype(ml_dtypes.bfloat16)


def reference(q, k, v, mask, causal: bool, scale: float) -> np.ndarray:
    """softmax(scale q k^T + mask) v in float64, K/V heads repeated for their groups; causal is top-left."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = scale * q @ np.swapaxes(k, -1, -2)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask.astype(np.float64)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def assert_close(out, ref, q, k, v, mask, causal: bool) -> None:
    """The torch.compile rule (geir.accuracy): within the dtype's tolerance of float64, or of the eager op's error."""
    op = FlashAttention("ge.flash_attention", [], [], {"causal": causal, "scale": 1 / math.sqrt(q.shape[-1])})
    eager = round_to(op.compute(q, k, v, *([mask] if mask is not None else [])), q.dtype)
    verdict = compare(out, ref, TensorType(out.shape, DType.from_numpy(q.dtype)), eager)
    assert verdict.passed, verdict.render("o")


def tiling_for(b, n, nkv, sq, skv, d=128, dtype=np.float16, causal=False, mask=None, target="ascend910b"):
    dt = DType.from_numpy(np.dtype(dtype))
    q, k = TensorType((b, n, sq, d), dt), TensorType((b, nkv, skv, d), dt)
    return choose_flash_tiling(q, k, k, causal, mask is not None, as_target(target),
                               mask_itemsize=None if mask is None else mask.dtype.itemsize)


def run(q, k, v, mask, causal, tiling, target="ascend910b"):
    t = load_target(target)
    ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), ["q", "k", "v", "mask"], ["o"])
    out = flash_attention_forward(q, k, v, mask, causal, 1 / math.sqrt(q.shape[-1]), tiling, ctx)
    return out, ctx


def inputs(b, n, nkv, sq, skv, d=128, dtype=np.float16, mask_kind=None, seed=0):
    return attention_inputs(b, n, sq, d, nkv=nkv, skv=skv, dtype=dtype, mask_kind=mask_kind, keep=0.7, seed=seed)


# --- the rule ---------------------------------------------------------------------------------------

def parts_by_hand(units: int, skv: int, cores: int = 24, s2: int = 128) -> int:
    """FlashAttention-2's num_splits_heuristic, counted out: the fewest parts within 85 % of the best efficiency."""
    blocks = math.ceil(skv / s2)
    effs = {}
    for p in range(1, min(blocks, cores) + 1):
        if p > 1 and math.ceil(blocks / p) == math.ceil(blocks / (p - 1)):
            continue
        waves = units * p / cores
        effs[p] = waves / math.ceil(waves)
    p = min(p for p, e in effs.items() if e >= 0.85 * max(effs.values()))
    return math.ceil(blocks / math.ceil(blocks / p))


@pytest.mark.parametrize("b, n, nkv, skv", [(1, 32, 8, 512), (1, 32, 8, 2048), (1, 32, 8, 8192), (1, 8, 8, 8192),
                                            (1, 1, 1, 8192), (1, 32, 32, 8192), (2, 8, 2, 1000), (1, 4, 4, 300)])
def test_decode_takes_flash_decoding_with_the_rules_parts(b, n, nkv, skv):
    t = tiling_for(b, n, nkv, 1, skv)
    assert t.template == FLASH_DECODE
    assert t.s1 == n // nkv  # the group's query rows are one unit's rows
    parts = parts_by_hand(b * nkv, skv)
    assert t.segments == t.kv_splits == parts
    assert t.work_units == b * nkv * parts  # (batch, K/V head, key part)
    assert "flash-decoding" in t.rule and (f"split in {parts} parts" in t.rule or parts == 1)


def test_the_decode_figure_splits_in_three_parts_for_24_cores():
    t = tiling_for(1, 32, 8, 1, 8192)
    assert (t.segments, t.work_units) == (3, 24)
    assert t.rule.startswith("flash-decoding: Sq = 1 x 4 grouped heads leaves 8 work unit(s) for 24 cores: "
                             "Skv 8192 split in 3 parts of up to 2816 keys")


@pytest.mark.parametrize("b, n, nkv, sq, skv", [(1, 8, 8, 1024, 1024), (1, 8, 8, 4096, 4096), (1, 8, 2, 512, 2048),
                                                (1, 8, 8, 128, 128), (1, 24, 24, 1, 8192)])
def test_prefill_and_balanced_decode_keep_their_template(b, n, nkv, sq, skv):
    t = tiling_for(b, n, nkv, sq, skv)
    assert t.template != FLASH_DECODE
    if skv > 1024:
        assert t.template == SPLIT_KV and t.segments == 1


def test_a_tiling_round_trips_through_its_attribute():
    t = tiling_for(1, 32, 8, 1, 8192)
    assert type(t).from_attr(t.to_attr()) == t


# --- the numbers ------------------------------------------------------------------------------------

CASES = {
    "gqa f16": dict(b=1, n=32, nkv=8, sq=1, skv=2048),
    "gqa bf16": dict(b=1, n=8, nkv=2, sq=1, skv=1024, dtype=BF16),
    "gqa f32": dict(b=1, n=8, nkv=2, sq=1, skv=700, d=64, dtype=np.float32),
    "no groups": dict(b=2, n=4, nkv=4, sq=1, skv=1000),
    "ragged parts": dict(b=1, n=4, nkv=1, sq=1, skv=1000, d=64),  # 8 blocks, the last one partial
    "causal": dict(b=1, n=8, nkv=2, sq=1, skv=640, causal=True),
    "causal rows": dict(b=1, n=4, nkv=2, sq=3, skv=900, d=64, causal=True),
    "additive mask": dict(b=1, n=8, nkv=2, sq=2, skv=600, d=64, mask_kind="additive"),
    "boolean mask": dict(b=2, n=4, nkv=2, sq=1, skv=1500, d=64, mask_kind="boolean", dtype=BF16),
    "rows over a block": dict(b=1, n=8, nkv=1, sq=32, skv=1024, d=64, causal=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference_within_the_torch_compile_rule(case):
    c = dict(CASES[case])
    causal = c.pop("causal", False)
    q, k, v, mask = inputs(**c)
    tiling = tiling_for(c["b"], c["n"], c["nkv"], c["sq"], c["skv"], c.get("d", 128), c.get("dtype", np.float16),
                        causal, mask)
    assert tiling.template == FLASH_DECODE
    out, _ = run(q, k, v, mask, causal, tiling)
    assert out.dtype == q.dtype
    assert_close(out, reference(q, k, v, mask, causal, 1 / math.sqrt(q.shape[-1])), q, k, v, mask, causal)


@pytest.mark.parametrize("case", ["gqa f16", "causal rows", "boolean mask", "ragged parts"])
def test_split_and_unsplit_paths_agree(case):
    c = dict(CASES[case])
    causal = c.pop("causal", False)
    q, k, v, mask = inputs(**c)
    split = tiling_for(c["b"], c["n"], c["nkv"], c["sq"], c["skv"], c.get("d", 128), c.get("dtype", np.float16),
                       causal, mask)
    assert split.segments > 1
    # the prefill path on the same inputs: one unit per (batch, head), every key in order
    whole = attrs.evolve(split, template=SPLIT_KV, s1=c["sq"], segments=1)
    a, b = run(q, k, v, mask, causal, split)[0], run(q, k, v, mask, causal, whole)[0]
    # both within the rule of the float64 reference, and of each other at the dtype's tolerance
    ref = reference(q, k, v, mask, causal, 1 / math.sqrt(q.shape[-1]))
    assert_close(a, ref, q, k, v, mask, causal)
    assert_close(b, ref, q, k, v, mask, causal)
    assert compare(a, b.astype(np.float64), TensorType(a.shape, DType.from_numpy(q.dtype))).passed


@pytest.mark.parametrize("target", ["ascend910a", "ascend910b"])
def test_key_and_value_bytes_are_read_once_per_group(target):
    q, k, v, _ = inputs(1, 32, 8, 1, 2048)
    tiling = tiling_for(1, 32, 8, 1, 2048, target=target)
    _, ctx = run(q, k, v, None, False, tiling, target)
    kv = 2 * k.nbytes
    partials = tiling.work_units * tiling.s1 * (128 + 2) * 4  # each unit's O, max and sum in f32
    # on A2 (CV-split, as IncreFlashAttention runs there) every key block's S (f32), P (f16) and P V (f32) go
    # through the GM workspace between the AIC and its AIVs: written once and read once each
    blocks = 8 * math.ceil(2048 / tiling.s2)  # the key blocks of the 8 groups
    # P in whole fractals of 16 rows, as the cube reads it (ops-transformer's CopyInMm2AToL1: s1RealSizeAligned)
    p_rows = math.ceil(tiling.s1 / 16) * 16
    workspace = blocks * (tiling.s1 * tiling.s2 * 4 + p_rows * tiling.s2 * 2 + tiling.s1 * 128 * 4) if tiling.cv_split else 0
    assert tiling.cv_split == (target == "ascend910b")
    # Q once per key part, K and V once per group (not per head), the partials back for the combine
    assert ctx.gm.gm_read_bytes == tiling.segments * q.nbytes + kv + partials + workspace
    assert ctx.gm.gm_write_bytes == partials + q.nbytes + workspace  # the partials, then O once


def test_splitting_is_faster_than_one_unit_per_head():
    q, k, v, _ = inputs(1, 8, 8, 1, 8192)
    split = tiling_for(1, 8, 8, 1, 8192)
    whole = attrs.evolve(split, template=SPLIT_KV, s1=1, segments=1)
    assert run(q, k, v, None, False, split)[1].cores.finish < 0.5 * run(q, k, v, None, False, whole)[1].cores.finish


def test_the_rules_tiling_is_among_the_candidates():
    from geir.kernels.flash_attention_tiling import candidates
    from geir.kernels.tiling import OpSignature

    q, k = TensorType((1, 32, 1, 128), DType.f16), TensorType((1, 8, 8192, 128), DType.f16)
    sig = OpSignature("ge.flash_attention", (q, k, k), (q,), {"causal": True})
    rule = choose_flash_tiling(q, k, k, True, False, load_target("ascend910b"))
    found = candidates(sig, load_target("ascend910b"))
    assert rule in found and all(t.template == FLASH_DECODE for t in found)
