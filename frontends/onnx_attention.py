"""ONNX `Attention` (opset 23 on) as one `ge.flash_attention` where GEIR's semantics cover it.

Covered: 4-D (B, N, S, D) or 3-D (B, S, N*D with q_num_heads / kv_num_heads) inputs, grouped-query
heads, a boolean or additive mask (right-aligned broadcasting, padded to the keys with "masked"),
`scale`, `is_causal`, and a past key/value cache (concatenated in front of the new keys; the
present key/value outputs are those concatenations).

ONNX aligns causal masking at the bottom right once there is a cache: query i sees key j when
j <= i + past length. GEIR's `causal = true` is top-left aligned (j <= i), the same only without a
cache; with one the importer builds that mask as a constant instead of mis-using the flag. A row
whose keys are all masked gives zeros in ONNX (flash_attention's softmax would give NaN), so where
the mask can mask a whole row its result is selected to zero.

Softcap, the qk_matmul_output output, nonpad_kv_seqlen and the sliding windows of opset 25 are not
flash_attention's semantics: such nodes are imported through ONNX's own function body instead.
"""

from __future__ import annotations

import numpy as np

from geir.frontends.onnx_node import Node, UseFunctionBody, converter, optional, required
from geir.frontends.onnx_shapes import reshape_to
from geir.frontends.onnx_values import GraphBuilder, ImportProblem, Tensor
from geir.ops.linalg import bnsd
from geir.passes.fusion.attention import constant_mask_meaning
from geir.types import DType


@converter("Attention")
def attention(b: GraphBuilder, node: Node, xs: list[Tensor | None]) -> list[Tensor | None]:
    q, k, v = required(xs, 0, "Q"), required(xs, 1, "K"), required(xs, 2, "V")
    mask, past_k, past_v, nonpad = optional(xs, 3), optional(xs, 4), optional(xs, 5), optional(xs, 6)
    if node.wants(3):
        raise UseFunctionBody("the qk_matmul_output output is not part of flash_attention")
    if nonpad is not None:
        raise UseFunctionBody("nonpad_kv_seqlen is not part of flash_attention")
    if node.attr("left_window_size", -1) != -1 or node.attr("right_window_size", -1) != -1:
        raise UseFunctionBody("sliding windows are not part of flash_attention")
    if (past_k is None) != (past_v is None):
        raise ImportProblem("past_key and past_value must be given together", unsupported=False)

    q4 = _heads_first(b, q, node.attr("q_num_heads"), "Q")
    k4 = _heads_first(b, k, node.attr("kv_num_heads"), "K")
    v4 = _heads_first(b, v, node.attr("kv_num_heads"), "V")
    past = 0
    if past_k is not None:
        past = past_k.shape[2]
        if past is None:
            raise ImportProblem("a past key/value cache whose length is known only at run time")
        k4 = b.emit1("ge.concat", [past_k, k4], {"axis": 2})
        v4 = b.emit1("ge.concat", [past_v, v4], {"axis": 2})
    sq, skv = q4.shape[2], k4.shape[2]

    bias = _padded_mask(b, mask, skv) if mask is not None else None
    causal = bool(node.attr("is_causal", 0))
    if bias is not None and bias.is_const and not past:
        # the exporters spell a causal SDPA as a constant top-left causal mask: the kernel's causal = true
        # (it skips the blocks above the diagonal); a mask that keeps every key is no mask
        needed, causal = constant_mask_meaning(bias.array, bias.array.dtype == np.bool_, causal)
        bias = bias if needed else None
    if causal and past:
        # bottom-right alignment: an explicit mask, since causal = true means top-left
        keep = _causal_keep(sq, skv, past)
        bias = _combine(b, bias, keep)
        causal = False

    attrs: dict = {"causal": causal, "layout": "BNSD"}
    if node.has_attr("scale"):
        attrs["scale"] = float(node.attr("scale"))
    if node.attr("softcap", 0.0):  # capped before the mask is added, as the kernel caps (ONNX's reference does)
        attrs["softcap"] = float(node.attr("softcap"))
    out = b.emit1("ge.flash_attention", [q4, k4, v4] + ([bias] if bias is not None else []), attrs)
    dead = _fully_masked_rows(b, bias, causal, sq, skv) if bias is not None else None
    if dead is not None:
        out = b.emit1("ge.select", [dead, b.const(np.array(0, dtype=out.type.dtype.np)), out])
    if q.rank == 3:
        out = b.emit1("ge.transpose", [out], {"perm": [0, 2, 1, 3]})
        bsz, n, s, d = bnsd(out.type, "BSND")
        out = reshape_to(b, out, (bsz, s, None if n is None or d is None else n * d))
    return [out, k4 if node.wants(1) else None, v4 if node.wants(2) else None, None]


def _heads_first(b: GraphBuilder, x: Tensor, heads: int | None, what: str) -> Tensor:
    """A 4-D input as it is; a 3-D (B, S, N*D) one split into heads and transposed to (B, N, S, D)."""
    if x.rank == 4:
        return x
    if x.rank != 3:
        raise ImportProblem(f"{what} must be 3-D or 4-D, not {x.type}", unsupported=False)
    hidden = x.shape[2]
    if not heads:
        raise ImportProblem(f"a 3-D {what} needs the q_num_heads and kv_num_heads attributes", unsupported=False)
    if hidden is None or hidden % heads:
        raise ImportProblem(f"{what}'s hidden size {hidden} does not split into {heads} heads",
                            unsupported=hidden is None)
    split = reshape_to(b, x, (x.shape[0], x.shape[1], heads, hidden // heads))
    return b.emit1("ge.transpose", [split], {"perm": [0, 2, 1, 3]})


def _padded_mask(b: GraphBuilder, mask: Tensor, skv: int | None) -> Tensor:
    """The mask widened to all the keys: what it leaves out is masked (False, or -inf)."""
    have = mask.shape[-1]
    if have == skv:
        return mask
    if have is None or skv is None or have > skv:
        raise ImportProblem(f"attn_mask {mask.type} does not cover the {skv} keys",
                            unsupported=None in (have, skv))
    if None in mask.shape:
        raise ImportProblem("padding an attn_mask whose shape is known only at run time")
    boolean = mask.type.dtype == DType.i1
    fill = np.full(tuple(mask.shape[:-1]) + (skv - have,), False if boolean else -np.inf,
                   dtype=mask.type.dtype.np)
    return b.emit1("ge.concat", [mask, b.const(fill)], {"axis": -1 % mask.rank})


def _causal_keep(sq: int | None, skv: int | None, past: int) -> np.ndarray:
    """Which keys each query sees with a cache of `past` keys in front: j <= i + past."""
    if sq is None or skv is None:
        raise ImportProblem("a causal mask with a cache needs the sequence lengths at import time")
    return np.arange(skv)[None, :] <= np.arange(sq)[:, None] + past


def _combine(b: GraphBuilder, bias: Tensor | None, keep: np.ndarray) -> Tensor:
    """A mask that also hides what `keep` hides, in the mask's own form (boolean or additive)."""
    if bias is None:
        return b.const(keep)
    if bias.type.dtype == DType.i1:
        return b.emit1("ge.select", [b.const(keep), bias, b.const(False)])
    additive = np.where(keep, 0.0, -np.inf).astype(bias.type.dtype.np)
    return b.emit1("ge.add", [bias, b.const(additive)])


def _fully_masked_rows(b: GraphBuilder, bias: Tensor, causal: bool, sq: int | None,
                       skv: int | None) -> Tensor | None:
    """i1 [..., Sq, 1]: the query rows whose keys are all masked, or None when no row can be."""
    if causal:  # top-left causal keeps key 0 for every row, but a mask can still hide it
        bias = _combine(b, bias, _causal_keep(sq, skv, 0))
    if bias.is_const:
        a = bias.array
        keep = a if a.dtype == np.bool_ else ~np.isneginf(a)
        dead = ~keep.any(axis=-1, keepdims=True)
        return b.const(dead) if dead.any() else None
    if bias.type.dtype == DType.i1:
        kept = b.emit1("ge.reduce_max", [b.emit1("ge.cast", [bias], {"to": DType.f32})],
                       {"axes": [-1 % bias.rank], "keepdims": True})
        return b.emit1("ge.equal", [kept, b.const(np.float32(0))])
    best = b.emit1("ge.reduce_max", [bias], {"axes": [-1 % bias.rank], "keepdims": True})
    return b.emit1("ge.equal", [best, b.const(np.array(-np.inf, dtype=bias.type.dtype.np))])
