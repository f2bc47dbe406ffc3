"""Attention over a paged KV cache: ge.paged_attention, FusedInferAttentionScore's block-table mode.

The keys and values live in a pool of fixed-size blocks, `key_cache` / `value_cache` of [num_blocks, block_size,
Nkv * D] (FIA's BnBsH layout), and each batch row names its blocks in order in `block_table` [B, max_blocks]:
row b's key j is slot j % block_size of block block_table[b, j // block_size]. `actual_seq_lengths_kv` [B] (FIA's
input of that name) says how many of those keys each row has; an optional mask [B, N, Sq, L] (L = max_blocks x
block_size, broadcast) is applied on top. Sq == 1 is FIA's IncreFlashAttention branch, Sq > 1 its
PromptFlashAttention branch; the numbers are one definition for both: flash_attention's (geir.ops.linalg) over the
dense keys and values the table names, so a paged call equals dense attention on the same blocks.
"""

from __future__ import annotations

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.linalg import FlashAttention
from geir.ops.numerics import require_float, same_dtype
from geir.traits import CubeOp, Fused
from geir.types import DType, TensorType


def gather_blocks(cache: np.ndarray, table: np.ndarray, kv_heads: int) -> np.ndarray:
    """The dense [B, Nkv, max_blocks * block_size, D] keys (or values) a block table names in a [num_blocks,
    block_size, Nkv * D] pool: row b's key j is slot j % block_size of block table[b, j // block_size]."""
    num_blocks, block_size, hidden = cache.shape
    batch, blocks = table.shape
    rows = cache[np.asarray(table, dtype=np.int64)]  # [B, max_blocks, block_size, Nkv * D]
    rows = rows.reshape(batch, blocks * block_size, kv_heads, hidden // kv_heads)
    return np.ascontiguousarray(np.swapaxes(rows, 1, 2))


def keep_mask(lengths: np.ndarray | None, mask: np.ndarray | None, shape: tuple[int, int, int, int]) -> np.ndarray | None:
    """The one mask [B, N, Sq, L] the dense attention takes: keys at or past a row's actual length dropped (False,
    or -inf added to a float mask), then `mask` as given; None when there is neither."""
    if lengths is None:
        return None if mask is None else np.broadcast_to(mask, shape)
    b, _, _, length = shape
    within = (np.arange(length)[None, :] < np.asarray(lengths, dtype=np.int64).reshape(b, 1))[:, None, None, :]
    if mask is None:
        return np.broadcast_to(within, shape)
    if mask.dtype == np.bool_:
        return np.broadcast_to(within & mask, shape)
    return np.broadcast_to(np.where(within, mask, mask.dtype.type(-np.inf)), shape)


@op("ge.paged_attention")
class PagedAttention(Operation):
    """softmax(scale * q @ k^T + mask) @ v with k and v read from a block pool through `block_table`, each row
    over its `actual_seq_lengths_kv` keys (FIA with block_table); q is BNSD, grouped-query heads as
    flash_attention's. The operands after the block table are the lengths (an integer [B]) then an optional mask."""

    OPERAND_NAMES = ("q", "key_cache", "value_cache", "block_table", "extra*")
    TRAITS = (CubeOp, Fused)
    num_key_value_heads = Attr(int)
    scale = Attr(float, default=None)  # None: 1/sqrt(head dim)
    causal = Attr(bool, default=False)

    @property
    def actual_seq_lengths_kv(self):
        """The keys per row (an integer [B] operand), or None."""
        extra = self.operands[4:]
        return extra[0] if extra and not _is_mask(extra[0].type) else None

    @property
    def mask(self):
        """The mask operand, or None."""
        extra = self.operands[4:]
        return extra[-1] if extra and _is_mask(extra[-1].type) else None

    def verify(self) -> str | None:
        extra = self.operands[4:]
        if len(extra) > 2 or (len(extra) == 2 and (_is_mask(extra[0].type) or not _is_mask(extra[1].type))):
            return "takes at most actual_seq_lengths_kv (an integer [B]) and then a mask, in that order"
        if self.num_key_value_heads < 1:
            return f"num_key_value_heads must be at least 1, not {self.num_key_value_heads}"
        return None

    def flops(self) -> float:
        """The two matmuls' multiply-adds over every key the block table names (2 each)."""
        q, table, cache = self.operands[0].type, self.operands[3].type, self.operands[1].type
        b, n, sq, d = q.shape
        return 4.0 * b * n * sq * table.shape[1] * cache.shape[1] * d

    def infer(self, q: TensorType, key_cache: TensorType, value_cache: TensorType, block_table: TensorType,
              *extra: TensorType) -> TensorType:
        dtype = same_dtype(self.name, q, key_cache, value_cache)
        require_float(q, "q")
        if q.rank != 4:
            raise ShapeError(f"q must have rank 4 (BNSD), got {q}")
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if t.rank != 3:
                raise ShapeError(f"{name} must be [num_blocks, block_size, Nkv * D], got {t}")
        if key_cache.shape[:2] != value_cache.shape[:2]:
            raise ShapeError(f"key_cache {key_cache} and value_cache {value_cache} hold different blocks")
        if block_table.rank != 2 or not block_table.dtype.is_int:
            raise ShapeError(f"block_table must be an integer [B, max_blocks], not {block_table}")
        b, n, sq, d = q.shape
        nkv = self.num_key_value_heads
        if n is not None and n % nkv:
            raise ShapeError(f"query heads {n} are not a multiple of key/value heads {nkv}")
        hk, hv = key_cache.shape[2], value_cache.shape[2]
        if hk is not None and (hk % nkv or (d is not None and hk != nkv * d)):
            raise ShapeError(f"key_cache's last axis {hk} is not {nkv} key/value heads of head dim {d}")
        if hv is not None and hv % nkv:
            raise ShapeError(f"value_cache's last axis {hv} is not {nkv} key/value heads")
        if None not in (b, block_table.shape[0]) and b != block_table.shape[0]:
            raise ShapeError(f"block_table has {block_table.shape[0]} rows for a batch of {b}")
        for t in extra:
            if not _is_mask(t) and (t.rank != 1 or (None not in (b, t.shape[0]) and t.shape[0] != b)):
                raise ShapeError(f"actual_seq_lengths_kv must be an integer [B] = [{b}], not {t}")
        dv = None if hv is None else hv // nkv
        return TensorType((b, n, sq, dv), dtype)

    def dense(self, q: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, block_table: np.ndarray,
              *extra: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The dense keys, values and the one mask this call attends over (flash_attention's operands)."""
        nkv = self.num_key_value_heads
        k, v = gather_blocks(key_cache, block_table, nkv), gather_blocks(value_cache, block_table, nkv)
        lengths = next((x for x in extra if np.issubdtype(x.dtype, np.integer)), None)
        mask = next((x for x in extra if not np.issubdtype(x.dtype, np.integer)), None)
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return k, v, keep_mask(lengths, mask, shape)

    def as_flash_attention(self) -> FlashAttention:
        """flash_attention with this call's attributes: the semantics over the dense keys and values."""
        from geir.builder import create_op  # the builder imports the op registry, which imports this module

        return create_op("ge.flash_attention", [], [], {"scale": self.scale, "causal": self.causal})

    def compute(self, q: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, block_table: np.ndarray,
                *extra: np.ndarray) -> np.ndarray:
        k, v, mask = self.dense(q, key_cache, value_cache, block_table, *extra)
        return self.as_flash_attention().compute(q, k, v, *([] if mask is None else [mask]))


def _is_mask(t: TensorType) -> bool:
    """A mask operand (i1 or floating point), as opposed to the integer lengths."""
    return t.dtype == DType.i1 or t.dtype.is_float
