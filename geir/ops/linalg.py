"""Cube ops: matmul and flash_attention."""

from __future__ import annotations

import math
from typing import Sequence, TypeVar

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.numerics import broadcast_dims, require_float, same_dtype, softmax, work
from geir.traits import CubeOp, Fused
from geir.types import Dim, DType, TensorType

T = TypeVar("T")


@op("ge.matmul")
class Matmul(Operation):
    """`np.matmul` with batch broadcasting and optional transposes of the last two axes."""

    OPERAND_NAMES = ("a", "b")
    TRAITS = (CubeOp,)
    transpose_a = Attr(bool, default=False)
    transpose_b = Attr(bool, default=False)

    def infer(self, a: TensorType, b: TensorType) -> TensorType:
        dtype = same_dtype(self.name, a, b)
        if a.rank < 2 or b.rank < 2:
            raise ShapeError(f"matmul operands need rank 2 or more, got {a} and {b}")
        m, ka = (a.shape[-1], a.shape[-2]) if self.transpose_a else (a.shape[-2], a.shape[-1])
        kb, n = (b.shape[-1], b.shape[-2]) if self.transpose_b else (b.shape[-2], b.shape[-1])
        if ka is not None and kb is not None and ka != kb:
            raise ShapeError(f"matmul contraction dims differ: {ka} vs {kb}")
        batch = broadcast_dims(a.shape[:-2], b.shape[:-2])
        return TensorType(batch + (m, n), dtype)

    def compute(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = work(a), work(b)  # f16/bf16 accumulate in f32, as the cube does
        if self.transpose_a:
            a = np.swapaxes(a, -1, -2)
        if self.transpose_b:
            b = np.swapaxes(b, -1, -2)
        return np.matmul(a, b)

    def flops(self) -> float:
        """2 per multiply-add on the cube: result elements times the contraction length."""
        out, a = self.results[0].type, self.operands[0].type
        k = a.shape[-2] if self.attr("transpose_a") else a.shape[-1]
        return 2.0 * (out.num_elements or 0) * k


def bnsd(t: TensorType, layout: str = "BNSD") -> tuple[Dim, Dim, Dim, Dim]:
    """(B, N, S, D) of a rank-4 attention operand in `layout` ("BNSD" or "BSND", as flash_attention's attribute).

    The swap of N and S is its own inverse, so the same call also gives a BNSD shape in BSND order.
    """
    b, x, y, d = t.shape
    if layout == "BNSD":
        return b, x, y, d
    if layout == "BSND":
        return b, y, x, d
    raise ValueError(f"unknown attention layout '{layout}' (BNSD or BSND)")


@op("ge.flash_attention")
class FlashAttention(Operation):
    """softmax(cap(scale * q @ k^T) + pse + mask) @ v with grouped-query heads and an optional causal mask; cap(s)
    is softcap * tanh(s / softcap), the logit soft-capping of Gemma 2 and Grok, where `softcap` > 0 (0: none).

    `has_pse`: the last operand is a position bias (ALiBi's, Bloom's) added to the scaled scores, as
    ops-transformer's FlashAttentionScore takes its `pse` input with pseType 0 ("multiplication before addition":
    scale * q k^T + pse; aclnnFlashAttentionScoreV2.md), of a float dtype, in any shape that broadcasts to
    [B, N, Sq, Skv] ([B, N, 1, Skv] for ALiBi). The mask, when there is one, comes before it.

    `zero_masked_rows`: a query row whose every key the mask hides (an i1 mask all false, a float one all -inf along
    the keys) is zeros, as torch's SDPA gives it, rather than the 0 / 0 of its empty softmax: ops-transformer's
    row-invalid correction (FusedInferAttentionScore's inner_precise bit 1, "行无效修正", modes 2 and 3; Ascend/
    op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md), which the fuse pass's masked_rows rule
    sets when it takes in the select the import zeroes such rows with."""

    OPERAND_NAMES = ("q", "k", "v", "mask?", "pse?")
    TRAITS = (CubeOp, Fused)
    scale = Attr(float, default=None)  # None: 1/sqrt(head dim)
    causal = Attr(bool, default=False)
    layout = Attr(str, default="BNSD", choices=("BNSD", "BSND"))
    softcap = Attr(float, default=0.0)
    has_pse = Attr(bool, default=False)
    zero_masked_rows = Attr(bool, default=False)

    def verify(self) -> str | None:
        cap = self.softcap
        if not (math.isfinite(cap) and cap >= 0):
            return f"softcap must be a finite number >= 0 (0: no capping), not {cap}"
        if self.has_pse and len(self.operands) < 4:
            return "has_pse = true names the last operand the pse bias, but there are only q, k and v"
        if not self.has_pse and len(self.operands) > 4:
            return "a fifth operand is the pse bias, which needs has_pse = true"
        if self.zero_masked_rows and self.mask_and_pse(self.operands[3:])[0] is None:
            return "zero_masked_rows = true zeroes the rows the mask hides wholly, but there is no mask"
        return None

    def mask_and_pse(self, extras: Sequence[T]) -> tuple[T | None, T | None]:
        """The mask and the pse among what follows q, k and v (operands, their types or arrays), None where absent."""
        extras = list(extras)
        pse = extras.pop() if self.attr("has_pse") and extras else None
        return (extras[0] if extras else None), pse

    # score elements the reference holds at once: rows of q are taken in blocks so that memory stays
    # O(Sq + Skv) for long sequences instead of O(Sq * Skv)
    REFERENCE_SCORE_ELEMENTS = 1 << 24

    def flops(self) -> float:
        """The two matmuls' multiply-adds (q @ k^T and p @ v, 2 each) over the score pairs the mask keeps."""
        q, kv = self.operands[0].type, self.operands[1].type
        b, n, sq, d = bnsd(q, self.attr("layout"))
        skv = bnsd(kv, self.attr("layout"))[2]
        pairs = sq * skv if not self.attr("causal") else sum(min(i + 1, skv) for i in range(sq))
        return 4.0 * b * n * pairs * d

    def infer(self, q: TensorType, k: TensorType, v: TensorType, *extras: TensorType) -> TensorType:
        dtype = same_dtype(self.name, q, k, v)
        require_float(q, "q")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.rank != 4:
                raise ShapeError(f"{name} must have rank 4 ({self.layout}), got {t}")
        (b, n, sq, d), (bk, nk, skv, dk), (bv, nv, sv, dv) = (bnsd(t, self.layout) for t in (q, k, v))
        for what, x, y in (("batch", b, bk), ("batch", b, bv), ("head dim of q and k", d, dk),
                           ("key and value sequence", skv, sv), ("key and value heads", nk, nv)):
            if x is not None and y is not None and x != y:
                raise ShapeError(f"flash_attention {what} differ: {x} vs {y}")
        if n is not None and nk is not None and (nk == 0 or n % nk):
            raise ShapeError(f"query heads {n} are not a multiple of key/value heads {nk}")
        if d == 0 and self.scale is None:
            raise ShapeError("head dim 0: the default scale 1/sqrt(head dim) is undefined (give `scale`)")
        mask, pse = self.mask_and_pse(extras)
        if mask is not None and not (mask.dtype == DType.i1 or mask.dtype.is_float):
            raise ShapeError(f"mask must be i1 or floating-point, not {mask}")
        if pse is not None and not pse.dtype.is_float:
            raise ShapeError(f"pse must be floating-point, not {pse}")
        for what, t in (("mask", mask), ("pse", pse)):
            if t is None:
                continue
            try:
                full = broadcast_dims(t.shape, (b, n, sq, skv))
            except ShapeError:
                full = None
            if full is None or len(full) != 4 or any(
                x is not None and y is not None and x != y for x, y in zip(full, (b, n, sq, skv))
            ):
                raise ShapeError(f"{what} {t} does not broadcast to [B, N, Sq, Skv] = [{b}, {n}, {sq}, {skv}]")
        return TensorType(bnsd(TensorType((b, n, sq, dv), dtype), self.layout), dtype)

    def effective_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def compute(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, *extras: np.ndarray) -> np.ndarray:
        mask, pse = self.mask_and_pse(extras)
        if self.layout == "BSND":
            q, k, v = (np.swapaxes(t, 1, 2) for t in (q, k, v))
        q, k, v = work(q), work(k), work(v)
        b, n, sq, d = q.shape
        if q.size == 0 and d:  # no query rows (or heads): an empty result, whatever the keys
            out = np.empty((b, n, sq, v.shape[-1]), dtype=q.dtype)
            return np.swapaxes(out, 1, 2) if self.layout == "BSND" else out
        group = n // k.shape[1]
        if group > 1:
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        skv = k.shape[2]
        if mask is not None:
            mask = np.broadcast_to(mask if mask.dtype == np.bool_ else work(mask), (b, n, sq, skv))
        if pse is not None:
            pse = np.broadcast_to(work(pse), (b, n, sq, skv))
        scale = q.dtype.type(self.effective_scale(d))
        out = np.empty((b, n, sq, v.shape[-1]), dtype=q.dtype)
        cols = np.arange(skv)
        rows = max(1, self.REFERENCE_SCORE_ELEMENTS // max(b * n * skv, 1))
        for r0 in range(0, sq, rows):
            r1 = min(r0 + rows, sq)
            s = np.matmul(q[:, :, r0:r1], np.swapaxes(k, -1, -2)) * scale
            if self.softcap:
                cap = q.dtype.type(self.softcap)
                s = np.tanh(s / cap) * cap
            if pse is not None:
                s = s + pse[:, :, r0:r1]
            if mask is not None:
                m = mask[:, :, r0:r1]
                s = np.where(m, s, -np.inf) if m.dtype == np.bool_ else s + m
            if self.causal:
                s = np.where(cols[None, :] > np.arange(r0, r1)[:, None], -np.inf, s)
            out[:, :, r0:r1] = np.matmul(softmax(s, -1), v)
        if self.zero_masked_rows and mask is not None:
            out[masked_rows(mask)] = 0
        return np.swapaxes(out, 1, 2) if self.layout == "BSND" else out


def masked_rows(mask: np.ndarray) -> np.ndarray:
    """bool [..., Sq]: the query rows whose every key `mask` hides (i1: all false; float: all -inf)."""
    keep = mask if mask.dtype == np.bool_ else mask > -np.inf
    return ~keep.any(axis=-1)


# the operand after v is the pse when has_pse says so and there is no mask: the accessors ask mask_and_pse, not the
# position that OPERAND_NAMES alone would give them
FlashAttention.mask = property(lambda self: self.mask_and_pse(self.operands[3:])[0], doc="the mask, if present")
FlashAttention.pse = property(lambda self: self.mask_and_pse(self.operands[3:])[1], doc="the pse bias, if present")
