"""Paged attention's tiling (FusedInferAttentionScore with a block table): the branch, the key tile in whole blocks.

The rules, each from a documented source:
- The branch: Sq == 1 is FIA's IncreFlashAttention branch, anything else its PromptFlashAttention branch
  (torch_npu.npu_fused_infer_attention_score: "当query矩阵的S为1, 进入IncreFlashAttention分支, 其余场景进入
  PromptFlashAttention分支"). Both run FlashAttention's templates (kernels/flash_attention_tiling.py) on the keys
  the block table names: the query blocks, the template and its budget are the dense call's.
- The key tile holds whole blocks: a block's keys are contiguous in the pool only within the block, so a tile
  gathers `blocks_per_tile` blocks through the table, s2 = blocks_per_tile x block_size. It starts from the dense
  template's s2 (at least one block) and halves the blocks while the tile's buffers overflow.
- One block must fit the cube's tile: block_size x head dim <= 128 x 128, and block_size a multiple of 16 is
  Ascend's recommendation (ATB PagedAttentionOperation's constraints, CANN 8.0: "embedding * blockSize <= 128 * 128",
  "block_size % 16 == 0, 推荐 block_size = 128"); the first is enforced, the second only recommended.
- Flash-decoding splits (IFA over long contexts), each part whole tiles of whole blocks: on a chip whose AIC and AIV
  are separate cores (Atlas A2), IncreFlashAttention's own rule (`ifa_kv_parts`); elsewhere the key parts
  FlashAttention-2's num_splits_heuristic gives for the (batch, K/V head) units at this s2
  (flash_attention_tiling.kv_parts).
"""

from __future__ import annotations

import attrs

from geir.kernels.flash_attention_a2 import cv_budget
from geir.kernels.flash_attention_tiling import (
    FLASH_DECODE,
    FlashTiling,
    causal_skipped,
    choose_flash_tiling,
    cv_fit,
    decode_skipped,
    decode_units,
    flash_budget,
    kv_parts,
)
from geir.kernels.tiling import Budget, Miss, OpSignature, TilingError, Untiled, choice
from geir.target_npu.target import Target
from geir.types import DType, TensorType

# ATB PagedAttentionOperation: one block's keys are one cube tile, block_size x head dim <= 128 x 128
CUBE_TILE_ELEMENTS = 128 * 128
INCRE, PROMPT = "IncreFlashAttention", "PromptFlashAttention"
# IncreFlashAttention's flash-decode rule on Atlas A2 (hicann/ops-transformer @c29bc1069d3252c641e2aa059ec88f392d3f05ac,
# attention/incre_flash_attention/op_host/incre_flash_attention_tiling_check.cpp, IsFlashDecode and CheckCoreOkFlag;
# incre_flash_attention_tiling.cpp, SetCoreNum and SplitBNS): no split with a block table on 910B while the longest
# row holds at most 1024 keys; a split only while B x Nkv < 0.4 x the cores it splits over (the vector cores in its
# default mode), and with grouped queries only over at least 2048 keys; then cores / (B x Nkv) parts, fewer while a
# part would hold under 512 keys (each "经验值", the source's empirical constants)
IFA_PA_NO_SPLIT_KEYS = 1024
IFA_SPLIT_BN_RATIO = 0.4
IFA_GQA_SPLIT_KEYS = 2048
IFA_PART_MIN_KEYS = 512


@attrs.frozen(kw_only=True)
class PagedTiling(FlashTiling):
    """A FlashAttention tiling whose key tile is `blocks_per_tile` whole blocks of `block_size` keys of the pool."""

    block_size: int
    blocks_per_tile: int

    def as_flash(self) -> FlashTiling:
        """The FlashAttention tiling the kernel runs over the keys the table names (the same blocks and parts)."""
        return FlashTiling(**{f.name: getattr(self, f.name) for f in attrs.fields(FlashTiling)})


@attrs.frozen
class PagedProblem:
    """One paged attention as the rules see it: q, the dense keys and values the table names, the mask."""

    q: TensorType
    k: TensorType  # [B, Nkv, max_blocks x block_size, D]
    v: TensorType
    block_size: int | None
    causal: bool
    has_mask: bool  # a mask operand, or the lengths' (the kernel masks the keys past each row's length)
    mask_itemsize: int | None


def problem(sig: OpSignature) -> PagedProblem:
    """The rules' view of one ge.paged_attention signature."""
    q, kc, vc, table = sig.operands[:4]
    extra = sig.operands[4:]
    nkv = int(sig.attr("num_key_value_heads", 1))
    b, blocks = table.shape
    bs = kc.shape[1]
    length = None if None in (blocks, bs) else blocks * bs
    d = None if kc.shape[2] is None else kc.shape[2] // nkv
    dv = None if vc.shape[2] is None else vc.shape[2] // nkv
    k = TensorType((b, nkv, length, d), q.dtype)
    v = TensorType((b, nkv, length, dv), q.dtype)
    masks = [t for t in extra if t.dtype == DType.i1 or t.dtype.is_float]
    itemsize = masks[0].dtype.itemsize if masks else (1 if extra else None)
    return PagedProblem(q, k, v, bs, bool(sig.attr("causal", False)), bool(extra), itemsize)


def choose_paged_tiling(p: PagedProblem, chip: Target, buffers: int = 2) -> PagedTiling:
    """The branch, FlashAttention's template and blocks for the dense call, the key tile in whole blocks."""
    bs = p.block_size
    b, n, sq, d = p.q.shape
    nkv, length = p.k.shape[1], p.k.shape[2]
    if bs is None:
        raise Untiled("the block size is dynamic, and the key tile is whole blocks")
    if d is not None and bs * d > CUBE_TILE_ELEMENTS:
        raise TilingError(f"a block of {bs} keys of head dim {d} ({bs * d} elements) exceeds one 128 x 128 cube tile "
                          f"(ATB PagedAttention: block_size x head dim <= 128 x 128)")
    dense = choose_flash_tiling(p.q, p.k, p.v, p.causal, p.has_mask, chip, buffers, mask_itemsize=p.mask_itemsize)
    branch = INCRE if sq == 1 else PROMPT
    dtype = p.q.dtype
    mask_bytes = (p.mask_itemsize or dtype.itemsize) if p.has_mask else 0
    decode = dense.template == FLASH_DECODE
    per_tile = max(1, dense.s2 // bs)
    while True:
        s2 = per_tile * bs
        v_rows = dense.v_rows
        if dense.cv_split:
            v_rows, budget = cv_fit(dense.s1, s2, dense.d, dtype, chip, buffers, p.causal, mask_bytes)
        else:
            budget = flash_budget(dense.s1, s2, dense.d, dtype, buffers, chip, causal=p.causal,
                                  mask_itemsize=mask_bytes)
        miss = budget.overflow(chip)
        if miss is None:
            break
        if per_tile == 1:
            buf, need, cap = miss
            raise TilingError(f"no paged attention tiling fits {chip.name}: one block of {bs} keys with s1 = {dense.s1}"
                              f" needs {need} bytes of {buf}, which holds {cap}")
        per_tile //= 2
    segments, work, skipped = dense.segments, dense.work_units, dense.skipped_blocks
    split = ""
    if decode and None not in (b, n, sq, length):
        units = decode_units(b, n, nkv, sq, dense.s1)
        if chip.separate_cube_vector and sq == 1:  # Atlas A2's IncreFlashAttention: its own rule
            blocks = -(-length // s2)
            per = -(-blocks // ifa_kv_parts(length, b * nkv, n // nkv, chip.vector_cores))
            segments, how = -(-blocks // per), "IncreFlashAttention's rule"
        else:
            segments, how = kv_parts(length, units, chip.cube_cores, s2), "FlashAttention-2's heuristic"
        work = units * segments
        skipped = decode_skipped(n, nkv, sq, length, dense.s1, s2) if p.causal else 0
        if segments > 1:
            split = f"; flash-decoding ({how}): the {length} keys split in {segments} parts of whole tiles"
    elif p.causal and None not in (sq, length):
        skipped = causal_skipped(sq, length, dense.s1, s2)
    cores = chip.cube_cores if work is None else min(work, chip.cube_cores)
    rule = (f"{branch} branch (Sq = {sq}); key tiles of {per_tile} block(s) of {bs} (s2 = {s2}) read through the block "
            f"table{split}; the dense call's rule: {dense.rule}")
    return PagedTiling(template=dense.template, s1=dense.s1, s2=s2, d=dense.d, buffers=buffers, cores=cores,
                       ub_bytes=budget.ub, segments=segments, l1_bytes=budget.l1, l0a_bytes=budget.l0a,
                       l0b_bytes=budget.l0b, l0c_bytes=budget.l0c, work_units=work, skipped_blocks=skipped,
                       preload=dense.preload, v_rows=v_rows, rule=rule, design=dense.design, block_size=bs,
                       blocks_per_tile=per_tile)


def ifa_kv_parts(keys: int, units: int, group: int, cores: int, paged: bool = True) -> int:
    """IncreFlashAttention's key parts on Atlas A2 for `units` (batch x K/V head) units of `group` query heads each
    over `keys` keys, split over `cores` cores (the IFA_* rules above): 1 where it does not split."""
    if paged and keys <= IFA_PA_NO_SPLIT_KEYS:
        return 1
    if not units < IFA_SPLIT_BN_RATIO * cores or (group > 1 and keys < IFA_GQA_SPLIT_KEYS):
        return 1
    parts = max(cores // units, 1)
    while parts > 1 and keys / parts < IFA_PART_MIN_KEYS:
        parts -= 1
    return parts


def choose(sig: OpSignature, chip: Target, buffers: int = 2) -> PagedTiling | Miss:
    """The rules' tiling for one ge.paged_attention, or why there is none."""
    return choice(lambda: choose_paged_tiling(problem(sig), chip, buffers))


def budget(tiling: PagedTiling, sig: OpSignature, chip: Target) -> Budget:
    """What one work unit of this tiling keeps on chip."""
    p = problem(sig)
    mask_bytes = (p.mask_itemsize or p.q.dtype.itemsize) if p.has_mask else 0
    if tiling.cv_split:
        return cv_budget(tiling.s1, tiling.s2, tiling.d, tiling.v_rows, p.q.dtype, chip, buffers=tiling.buffers,
                         causal=p.causal, mask_itemsize=mask_bytes)
    return flash_budget(tiling.s1, tiling.s2, tiling.d, p.q.dtype, tiling.buffers, chip, causal=p.causal,
                        mask_itemsize=mask_bytes)
