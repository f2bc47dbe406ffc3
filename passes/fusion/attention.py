"""Scaled dot-product attention, in its common spellings, becomes one `ge.flash_attention`.

Rooted at the second matmul `P @ V`. Walking up from the softmax it accepts, in any order,
a scale (`mul` or `div` by a scalar constant, on the scores, on q, or on k before or after its
transpose), an additive mask (an argument or a constant; a constant lower-triangular -inf mask
becomes `causal = true`, an all-zero one is no mask) or a boolean `select` mask, optional casts
to f32 around the softmax, and the first matmul with k transposed (`transpose_b = true` or
`ge.transpose` of the last two axes). k and v may be repeated per group of query heads as
grouped-query attention is written out (reshape to [B, Nkv, 1, S, D], a concat of G copies on
axis 2, reshape to [B, Nkv * G, S, D]); the fused op takes the Nkv heads. The probabilities may
pass through a guard that zeroes whole rows, `select(rows, 0, P)` with `rows` [..., Sq, 1] (ONNX
zeroes the rows whose keys are all masked); the fused op is then followed by the same select on
its result, which is what the guard gives whenever v is finite. The dynamo ONNX exporter's SDPA
guards with `select(isnan(P), 0, P)` instead (NaN comes in whole rows): the fused op's result is then
zeroed where it is NaN. Bloom's spelling merges the heads into the batch around a [B, N, S, L] softmax: the
matmuls are [B*N, ...] batched matmuls of q, k and v reshaped from [B, N, S, D], the scores reshaped to
[B, N, S, L] before the softmax and the probabilities back to [B*N, S, L] after it, with its ALiBi bias added
by baddbmm on the [B*N, S, L] scores; the heads are lifted back to their own axis (the fused op takes the
[B, N, S, D] tensors, its result is reshaped to the root's [B*N, S, D]). The ONNX exporter's Bloom keeps the
probabilities [B, N, S, L] to a 4-D second matmul: then only the scores' side is lifted. An additive float term shaped
[B or 1, N, 1, L] with N > 1 (ALiBi's per-head bias over the key positions) is the fused op's pse
(ops-transformer's FlashAttentionScore pse input, pseType 0: scale * q k^T + pse); the other additive terms
add up into its mask. Every other shape of graph is a miss with the reason.
"""

from __future__ import annotations

from typing import Mapping

import attrs
import numpy as np

from geir.builder import create_op
from geir.ir import Operation, Value
from geir.opdef import ShapeError
from geir.passes.fusion.guards import flash_attention_guard
from geir.target_npu.target import DEFAULT_TARGET, Target, load_target
from geir.passes.fusion.match import const_array, defining, named, scalar_constant, used_only_by
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.types import DType, TensorType

# A mask value at or below this is as good as -inf: exp() of it underflows to 0 in every dtype.
_MASKED = -1e4


def _is_masked_fill(v: Value) -> bool:
    c = scalar_constant(v)
    return c is not None and c <= _MASKED


def causal_pattern(arr: np.ndarray, boolean: bool) -> bool:
    """True when a constant mask is exactly the top-left-aligned causal mask (key j > query i masked)."""
    if arr.ndim < 2 or any(d != 1 for d in arr.shape[:-2]):
        return False
    sq, skv = arr.shape[-2:]
    keep = np.tril(np.ones((sq, skv), dtype=bool))
    m = arr.reshape(sq, skv)
    if boolean:
        return bool(np.array_equal(m.astype(bool), keep))
    with np.errstate(invalid="ignore"):
        return bool(np.all(m[keep] == 0) and np.all(m[~keep] <= _MASKED))


def constant_mask_meaning(arr: np.ndarray, boolean: bool, causal: bool) -> tuple[bool, bool]:
    """What a constant attention mask does, as (still needed, causal): the top-left causal mask is the
    kernel's `causal = true`, one that keeps every key is no mask, anything else stays a mask."""
    if not causal and causal_pattern(arr, boolean):
        return False, True
    if arr.size and (bool(np.all(arr)) if boolean else not np.any(arr)):
        return False, causal
    return True, causal


class FuseFlashAttention(Pattern):
    """softmax(scale * q @ k^T + mask) @ v -> ge.flash_attention."""

    NAME, ROOT, BENEFIT, EXPLAIN = "flash_attention", "ge.matmul", 20, True

    def __init__(self, target: Target | None = None, resources: Mapping[str, np.ndarray] | None = None):
        # the chip whose kernel must take the shapes (passes.fusion.guards)
        self.target = target or load_target(DEFAULT_TARGET)
        self.resources = resources  # the module's weights: a mask may be a dense_resource constant

    def match(self, pv: Operation) -> Match | Miss | None:
        p_val = pv.operands[0]
        guard = defining(p_val, "ge.select")
        nan_test = None  # the isnan of a NaN guard, select(isnan(P), 0, P)
        if guard is not None:
            if not _probabilities(guard.operands[2]):
                return None  # an ordinary matmul of a select
            nan_test = defining(guard.operands[0], "ge.isnan")
            if nan_test is not None and nan_test.operands[0] is not guard.operands[2]:
                nan_test = None
            why = _zero_rows_problem(guard, pv, nan_test)
            if why is not None:
                return Miss(why)
            p_val = guard.operands[2]
        consumer = guard or pv  # the op that takes the probabilities
        takers = [consumer] + ([nan_test] if nan_test is not None else [])
        heads = None  # (B, N) where the heads are merged into the batch around the softmax (Bloom's spelling)
        view = defining(p_val, "ge.reshape", "ge.dynamic_reshape")
        if view is not None and _probabilities(view.operands[0]):
            heads = _merged_heads(view.operands[0].type, view.result.type)
            if heads is None:
                return Miss(f"the probabilities are reshaped by {named(view)} to {view.result.type} before the "
                            f"second matmul, which does not merge the heads of [B, N, S, L] into [B*N, S, L]")
            if guard is not None:
                return Miss(f"the probabilities are reshaped by {named(view)} and guarded by {named(guard)}; the "
                            f"lift of merged heads takes no guard")
            if not used_only_by(view.result, *takers):
                return Miss(f"the reshaped probabilities {named(view)} are also used elsewhere; fusing would drop them")
            takers, p_val = [view], view.operands[0]
        cast_out = defining(p_val, "ge.cast")
        if cast_out is not None and defining(cast_out.operands[0], "ge.softmax"):
            p_val = cast_out.operands[0]
        sm = defining(p_val, "ge.softmax")
        if sm is None:
            d = defining(p_val, "ge.div")
            if d is not None and defining(d.operands[0], "ge.exp"):
                return Miss("the probabilities are a written-out softmax that did not fuse (see the softmax remark)")
            return None  # an ordinary matmul
        if pv.transpose_a:
            return Miss("the second matmul transposes the probabilities")
        if pv.transpose_b:
            return Miss("the second matmul transposes v; the fused kernel takes v as [B, N, Skv, D]")
        rank = sm.result.type.rank
        if sm.axis % max(rank, 1) != rank - 1:
            return Miss(f"softmax axis is {sm.axis}, not the last axis")
        if not used_only_by(sm.result, *([cast_out] if cast_out else takers)) or (
                cast_out and not used_only_by(cast_out.result, *takers)):
            return Miss("the attention probabilities are also used elsewhere; fusing would drop them")

        found = _walk_scores(sm.operands[0], self.resources, heads)
        if isinstance(found, Miss):
            return found
        q, k, scale, masks, causal, softcap = found
        v = pv.operands[1]
        if heads is not None:
            v = _split_heads(v, heads)
            if isinstance(v, Miss):
                return Miss(f"v {v.reason}")
        # q or v reaching merged heads as a reshape of another shape: its source, reshaped by the rewrite (a view)
        q, q_shape = (q.source, q.shape) if isinstance(q, _Reshaped) else (q, None)
        v, v_shape = (v.source, v.shape) if isinstance(v, _Reshaped) else (v, None)
        if heads is not None:
            if sum(d is None for d in pv.result.type.shape) > 1:
                return Miss(f"the second matmul's result {pv.result.type} has more than one run-time dimension; "
                            f"the fused op's result cannot be reshaped back to it")
        boolean = len(masks) == 1 and masks[0].value.type.dtype == DType.i1
        pse_terms = [m for m in masks if not boolean and _is_pse(m.shape)]
        mask_terms = [m for m in masks if not any(m is t for t in pse_terms)]
        try:
            mask_type, pse_type = _sum_type(mask_terms), _sum_type(pse_terms)
        except ShapeError as e:  # several additive masks (T5: a position bias, then the padding mask) add up
            return Miss(f"the additive masks do not broadcast together: {e}")
        k_perm = k_shape = None
        if isinstance(k, tuple):
            k, k_perm = k
        if isinstance(k, _Reshaped):
            # k reaches the scores flattened to [B*N, S, D]: its source, grouped heads and all, or k reshaped
            x, k_group = _grouped_source(k.source, k.shape)
            if k_group == 1 and k.source.type.rank == 4:  # the flat view of heads already repeated as [B, N, S, D]
                x, k_group = _repeated_heads(k.source)
            k, k_shape = (x, None) if k_group > 1 else (k.source, k.shape)
            if k_shape is not None and k.type.shape == k_shape:
                k_shape = None
            v, v_group = _repeated_heads(v) if v_shape is None else (v, 1)
            if k_group != v_group:
                return Miss(f"k and v are repeated for grouped-query heads differently ({k_group} and {v_group} "
                            f"copies of each head)")
        elif k_perm is None:
            k, k_group = _repeated_heads(k)
            v, v_group = _repeated_heads(v) if v_shape is None else (v, 1)
            if k_group != v_group:
                return Miss(f"k and v are repeated for grouped-query heads differently ({k_group} and {v_group} "
                            f"copies of each head)")
        k_type = k.type if k_perm is None else k.type.with_shape(tuple(k.type.shape[p] for p in k_perm))
        if k_shape is not None:
            k_type = k.type.with_shape(k_shape)
        q_type = q.type if q_shape is None else q.type.with_shape(q_shape)
        v_type = v.type if v_shape is None else v.type.with_shape(v_shape)
        if not (q_type.dtype == k_type.dtype == v_type.dtype):
            return Miss(f"q, k and v dtypes differ: {q_type.dtype}, {k_type.dtype}, {v_type.dtype}")
        if q_type.rank != 4 or k_type.rank != 4 or v_type.rank != 4:
            return Miss(f"q, k and v must be rank 4 [B, N, S, D], got ranks {q_type.rank}, {k_type.rank}, {v_type.rank}")
        attrs = {"scale": scale, "causal": causal, "layout": "BNSD"}
        if softcap:
            attrs["softcap"] = softcap
        if pse_terms:
            attrs["has_pse"] = True
        operands = [q, k, v]
        try:
            types = [q_type, k_type, v_type] + [x for x in (mask_type, pse_type) if x is not None]
            t = create_op("ge.flash_attention", [], [], attrs).infer(*types)
        except ShapeError as e:
            return Miss(f"the fused op would not type-check: {e}")
        want = pv.result.type if heads is None else pv.result.type.with_shape(heads + pv.result.type.shape[1:])
        if t.shape != want.shape or t.dtype != want.dtype:
            return Miss(f"the fused result {t} differs from the attention's result {want}")
        why = flash_attention_guard(q_type, k_type, v_type, mask_type, causal, "BNSD", self.target, pse_type)
        if why is not None:
            return Miss(why)
        return Match(pv, operands=operands, masks=mask_terms, pse=pse_terms, attrs=attrs, k_perm=k_perm,
                     k_shape=k_shape, guard=guard, nan_guard=nan_test is not None, heads=heads, q_shape=q_shape,
                     v_shape=v_shape)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        operands = list(m.operands)
        for terms in (m.masks, m.pse):
            if terms:
                lifted = [_lift(t, rw, m.root) for t in terms]
                total = lifted[0]
                for more in lifted[1:]:
                    total = rw.create("ge.add", [total, more], before=m.root).result
                operands.append(total)
        if m.k_perm is not None:
            operands[1] = rw.create("ge.transpose", [operands[1]], {"perm": m.k_perm}, before=m.root).result
        if m.k_shape is not None:
            operands[1] = rw.create("ge.reshape", [operands[1]], {"shape": list(m.k_shape)}, before=m.root).result
        for i, shape in ((0, m.q_shape), (2, m.v_shape)):
            if shape is not None:
                t = operands[i].type.with_shape(shape)
                operands[i] = rw.create("ge.reshape", [operands[i]], {"shape": [-1 if d is None else d for d in shape]},
                                        [t], before=m.root).result
        out = m.root.result.type
        if m.heads is not None:  # the heads on their own axis, then merged back into the batch as the root had them
            lifted = out.with_shape(m.heads + out.shape[1:])
            fa = rw.create("ge.flash_attention", operands, m.attrs, [lifted], before=m.root)
            shape = [-1 if d is None else d for d in out.shape]
            rw.replace(m.root, rw.create("ge.reshape", [fa.result], {"shape": shape}, [out], before=m.root))
            return
        op = rw.create("ge.flash_attention", operands, m.attrs, [out], before=m.root)
        if m.guard is not None and m.nan_guard:
            # P is NaN only in whole rows (a row whose keys are all masked, or a NaN score): those are the
            # rows of P @ V that are NaN, and the guard's zeros there are zero rows of the result
            zero = m.guard.operands[1]
            nan = rw.create("ge.isnan", [op.result], before=m.root)
            op = rw.create("ge.select", [nan.result, zero, op.result], before=m.root)
        elif m.guard is not None:  # the rows the guard zeroes in P are zero rows of P @ V
            rows, zero = m.guard.operands[:2]
            op = rw.create("ge.select", [rows, zero, op.result], before=m.root)
        rw.replace(m.root, op)


class NativeAttentionInputs(Pattern):
    """A `ge.flash_attention` given what its kernel does natively, spelled out, takes it natively.

    Frontends bring attention in as one op (torch's `scaled_dot_product_attention`, ONNX's
    `Attention`) with the exporter's operands: K and V repeated per group of query heads (HF's
    `repeat_kv`) and a constant causal mask. The kernel reads grouped K/V heads itself and skips
    the blocks above the diagonal when told `causal = true`, so the repeated copies are not built
    and the mask is not read: K/V of [B, Nkv, S, D] instead of [B, N, S, D], and no mask tensor. A
    constant mask that keeps everything (all true, or all zero added) is dropped.
    """

    NAME, ROOT, BENEFIT, EXPLAIN = "attention_native", "ge.flash_attention", 19, True

    def __init__(self, target: Target | None = None, resources: Mapping[str, np.ndarray] | None = None):
        self.target = target or load_target(DEFAULT_TARGET)
        self.resources = resources

    def match(self, fa: Operation) -> Match | Miss | None:
        q, k, v = fa.operands[:3]
        mask, pse = fa.mask_and_pse(fa.operands[3:])
        causal = bool(fa.attr("causal"))
        changed = False
        if fa.attr("layout") == "BNSD":
            k2, k_group = _repeated_heads(k)
            v2, v_group = _repeated_heads(v)
            if k_group != v_group:
                return Miss(f"k and v are repeated for grouped-query heads differently ({k_group} and {v_group} "
                            f"copies of each head)")
            if k_group > 1:
                k, v, changed = k2, v2, True
        arr = const_array(mask, self.resources) if mask is not None else None
        if arr is not None:
            needed, causal = constant_mask_meaning(arr, mask.type.dtype == DType.i1, causal)
            if not needed:
                mask, changed = None, True
        if not changed:
            return None  # nothing spelled out that the kernel does itself
        why = flash_attention_guard(q.type, k.type, v.type, None if mask is None else mask.type, causal,
                                    fa.attr("layout"), self.target, None if pse is None else pse.type)
        if why is not None:
            return Miss(why)
        attrs = dict(fa.attributes, causal=causal)  # its softcap and pse as they were
        extras = [x for x in (mask, pse) if x is not None]
        return Match(fa, operands=[q, k, v] + extras, attrs=attrs)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = rw.create("ge.flash_attention", m.operands, m.attrs, [m.root.result.type], before=m.root)
        rw.replace(m.root, op)


@attrs.frozen
class _Term:
    """An additive term (or a boolean mask) on the scores: the value, its shape lifted to [B, N, Sq, Skv] terms, and
    whether it was added to [B*N, S, L] scores (Bloom's), so that the rewrite reshapes it to that shape."""

    value: Value
    shape: tuple
    flat: bool = False


def _merged_heads(split: TensorType, merged: TensorType) -> tuple[int, int] | None:
    """(B, N) when `merged` is `split` [B, N, X, Y] with its first two axes merged, [B*N, X, Y]; else None.

    B and N must be known; X and Y are the same on both sides (equal sizes, or both run-time)."""
    if split.rank != 4 or merged.rank != 3:
        return None
    b, n = split.shape[:2]
    if b is None or n is None or merged.shape[0] != b * n:
        return None
    if any(x != y for x, y in zip(split.shape[2:], merged.shape[1:])):  # None == None: both run-time
        return None
    return b, n


def _lifted_shape(shape: tuple, heads: tuple[int, int]) -> tuple | None:
    """A term added to [B*N, S, L] scores, as the shape that adds it to [B, N, S, L] ones: its first axis B*N split
    into (B, N), or 1 into (1, 1); None where it is neither or the reshape would need two run-time sizes."""
    if len(shape) > 3:
        return None
    shape = (1,) * (3 - len(shape)) + tuple(shape)
    b, n = heads
    if shape[0] == b * n:
        lifted = (b, n) + shape[1:]
    elif shape[0] == 1:
        lifted = (1, 1) + shape[1:]
    else:
        return None
    return lifted if sum(d is None for d in lifted) <= 1 else None


def _split_heads(v: Value, heads: tuple[int, int]) -> Value | _Reshaped | Miss:
    """The [B, N, S, D] tensor that `v` [B*N, S, D] reshapes, or a Miss (its reason follows the operand's name).

    Where the reshape's source is another shape (a decode step's q: [B, 1, N, D], its size-1 transpose to
    [B, N, 1, D] a view since canonicalize, the two reshapes one), the source reshaped to [B, N, S, D] instead
    (`_Reshaped`, which the rewrite builds): a reshape keeps the elements' order, so reshaping the source to
    [B, N, S, D] and merging B and N gives `v` again, and the fused op pairs the same rows of q, k and v."""
    op = defining(v, "ge.reshape", "ge.dynamic_reshape")
    if op is None:
        source = "a graph argument" if v.owner is None else named(v.owner)
        return Miss(f"reaches the [B*N, S, D] matmul from {source}, not as a reshape of [{heads[0]}, {heads[1]}, S, D]")
    if _merged_heads(op.operands[0].type, v.type) == heads:
        return op.operands[0]
    shape = tuple(heads) + tuple(v.type.shape[1:])
    if v.type.rank != 3 or v.type.shape[0] != heads[0] * heads[1] or sum(d is None for d in shape) > 1:
        return Miss(f"reaches the [B*N, S, D] matmul as {named(op)} of {op.operands[0].type} to {v.type}, which "
                    f"does not split into [{heads[0]}, {heads[1]}, S, D] with at most one run-time size")
    return _Reshaped(op.operands[0], shape)


def _is_pse(shape: tuple) -> bool:
    """A term shaped [B or 1, N, 1, Skv] with N > 1: ALiBi's per-head bias over the key positions, the shape
    FlashAttentionScore takes its pse in (ops-transformer aclnnFlashAttentionScoreV2: pse [B, N, 1, Skv])."""
    return len(shape) == 4 and shape[1] is not None and shape[1] > 1 and shape[2] == 1


def _sum_type(terms: list[_Term]) -> TensorType | None:
    """The type of the terms added up (ShapeError where they do not broadcast), None for no terms."""
    if not terms:
        return None
    t = terms[0].value.type.with_shape(terms[0].shape)
    for more in terms[1:]:
        t = create_op("ge.add", [], []).infer(t, more.value.type.with_shape(more.shape))
    return t


def _lift(term: _Term, rw: Rewriter, before: Operation) -> Value:
    """The term as the fused op takes it: reshaped to [B, N, ...] where it was added to [B*N, S, L] scores."""
    if not term.flat or term.value.type.shape == term.shape:
        return term.value
    shape = [-1 if d is None else d for d in term.shape]
    return rw.create("ge.reshape", [term.value], {"shape": shape}, [term.value.type.with_shape(term.shape)],
                     before=before).result


@attrs.frozen
class _Reshaped:
    """k as a reshape of `source` to `shape` [B, N, S, D] (which the rewrite builds when needed)."""

    source: Value
    shape: tuple


def _walk_scores(x: Value, resources: Mapping[str, np.ndarray] | None = None, heads: tuple | None = None):
    """From the softmax input up to `q @ k^T`: (q, k, scale, masks, causal, softcap) or a Miss.

    `masks` are the additive masks (`_Term`s) in the order they were added (T5 adds a position bias, then the
    padding mask); a boolean `select` mask is the only one. `softcap`: the logit cap c of c * tanh(s / c)
    between the scale and the masks (Gemma 2), 0.0 where there is none. `heads`: (B, N) when the probabilities
    were [B*N, S, L] (Bloom's spelling): the scores must come from [B*N, S, L] too. Where a reshape splits the
    heads out of [B*N, S, L] scores (Bloom's, whether or not the probabilities are merged again), the terms added
    above it, q and k are lifted to [B, N, ...]."""
    scale = 1.0
    softcap = 0.0
    masks: list[Value] = []
    boolean_mask = False
    causal = False
    seen_scale = False  # walking up, a scale seen before the mask was applied after it
    mask_before_scale = False
    chain: list[Operation] = []  # intermediates that must have no other users
    flat = False  # walking up, the scores are now [B*N, S, L] (the heads merged into the batch)
    root_heads = heads  # the probabilities' own (B, N) where they reach the second matmul merged
    while True:
        op = x.owner
        if op is None:
            return Miss("the softmax input is a graph argument, not attention scores")
        if op.name in ("ge.reshape", "ge.dynamic_reshape"):
            split = _merged_heads(op.result.type, op.operands[0].type)
            if flat or split is None or (heads is not None and split != heads):
                return Miss(f"the scores are reshaped by {named(op)} from {op.operands[0].type} to {op.result.type}; "
                            f"only heads split out of a [B*N, S, L] batch (Bloom's scores) lift")
            # the probabilities may stay [B, N, S, L] to the second matmul (the ONNX exporter's Bloom)
            heads, flat = split, True
            chain.append(op)
            x = op.operands[0]
            continue
        if op.name == "ge.cast":
            chain.append(op)
            x = op.operands[0]
            continue
        if op.name == "ge.tanh" or (op.name == "ge.mul" and any(defining(o, "ge.tanh") for o in op.operands)):
            found = _softcap(op)
            if isinstance(found, Miss):
                return found
            if softcap:
                return Miss(f"the scores are capped twice (a second tanh at {named(op)})")
            if seen_scale:
                return Miss(f"the scores are scaled after the softcap at {named(op)}; the fused kernel caps the "
                            f"scaled scores")
            softcap, capped = found
            scale *= softcap  # the cap's own 1 / c is among the scales above it: c * tanh(s * scale / c)
            chain.extend(capped)
            x = capped[-1].operands[0]
            continue
        if op.name in ("ge.mul", "ge.div"):
            for side in (1, 0) if op.name == "ge.mul" else (1,):
                c = scalar_constant(op.operands[side])
                if c is not None:
                    break
            else:
                if any(const_array(o) is not None for o in op.operands):
                    return Miss(f"the scale is not a scalar constant ({op.name} by a tensor)")
                return Miss(f"the scores are scaled by a {op.name} with a non-constant")
            if op.name == "ge.div" and c == 0:
                return Miss("the scores are divided by zero")
            scale *= c if op.name == "ge.mul" else 1.0 / c
            seen_scale = True
            chain.append(op)
            x = op.operands[1 - side]
            continue
        if op.name == "ge.add":
            if softcap:
                return Miss(f"the mask at {named(op)} is added before the softcap; the fused kernel caps the scores "
                            f"before masking")
            if boolean_mask:
                return Miss("the scores get an additive mask and a boolean one")
            a, b = op.operands
            side = _mask_side(a, b)
            if side is None:
                return Miss(_no_mask_side(a, b))
            m, x = (a, b) if side == 0 else (b, a)
            mask_before_scale = mask_before_scale or seen_scale
            arr = const_array(m, resources)
            if arr is not None and not causal and causal_pattern(arr, boolean=False):
                causal = True
            elif arr is not None and m.type.dtype.is_float and arr.size and not np.any(arr.astype(np.float32)):
                pass  # adding zeros leaves every score as it is: no mask
            else:
                if m.type.dtype == DType.i1 or not m.type.dtype.is_float:
                    return Miss(f"the additive mask has dtype {m.type.dtype}, not a float")
                shape = _lifted_shape(m.type.shape, heads) if flat else m.type.shape
                if shape is None:
                    return Miss(f"the term {m.type} added at {named(op)} to the [B*N, S, L] scores does not split "
                                f"into heads {heads[0]} x {heads[1]} (its first axis is neither B*N nor 1, or it has "
                                f"more than one run-time dimension)")
                masks.insert(0, _Term(m, tuple(shape), flat))  # walking up: the mask added first is found last
            chain.append(op)
            continue
        if op.name == "ge.select":
            if softcap:
                return Miss(f"the mask at {named(op)} is applied before the softcap; the fused kernel caps the "
                            f"scores before masking")
            if masks or causal or boolean_mask:
                return Miss("the scores get two masks")
            cond, keep, fill = op.operands
            if not _is_masked_fill(fill):
                if _is_masked_fill(keep):
                    return Miss("the select keeps -inf where the condition is true; the fused mask means true = keep")
                return Miss("the select fills masked scores with something other than -inf")
            arr = const_array(cond, resources)
            if arr is not None and causal_pattern(arr, boolean=True):
                causal = True
            else:
                shape = _lifted_shape(cond.type.shape, heads) if flat else cond.type.shape
                if shape is None:
                    return Miss(f"the mask {cond.type} of {named(op)} on the [B*N, S, L] scores does not split into "
                                f"heads {heads[0]} x {heads[1]}")
                masks, boolean_mask = [_Term(cond, tuple(shape), flat)], True
            chain.append(op)
            x = keep
            continue
        if op.name == "ge.matmul":
            break
        return Miss(f"the scores come from {op.name}, not from q @ k^T")
    if root_heads is not None and not flat:
        return Miss(f"the probabilities are [B*N, S, L] but the scores are not reshaped from [B*N, S, L] to "
                    f"{x.type} before the softmax")
    if masks and mask_before_scale and not boolean_mask:
        return Miss("the additive mask is added before the scale; the fused kernel adds it after scaling")
    for inner in chain:
        if len(inner.result.users()) != 1:
            return Miss(f"the intermediate {inner.name} result is also used elsewhere; fusing would drop it")
    qk = op
    if qk.transpose_a:
        return Miss("the first matmul transposes q")
    if len(qk.result.users()) != 1:
        return Miss("the scores q @ k^T are also used elsewhere; fusing would drop them")
    q, kt = qk.operands
    # a scale applied to q, or to k before or after its transpose, is the same scale
    q, q_scale = _peel_scale(q)
    kt, k_scale = _peel_scale(kt)
    scale *= q_scale * k_scale
    if heads is not None:  # [B*N, S, D] q and k^T: each a reshape of [B, N, S, D] (k transposed after it)
        if not qk.transpose_b:
            t = defining(kt, "ge.transpose")
            if t is None or list(t.perm) != [0, 2, 1]:
                source = "a graph argument" if kt.owner is None else named(kt.owner)
                return Miss(f"the [B*N, S, L] scores' right operand comes from {source}, not from k transposed (a "
                            f"transpose of its last two axes, or transpose_b = true)")
            kt, k_scale = _peel_scale(t.operands[0])
            scale *= k_scale
        q4, k4 = _split_heads(q, heads), _split_heads(kt, heads)
        for what, found in (("q", q4), ("k", k4)):
            if isinstance(found, Miss):
                return Miss(f"{what} {found.reason}")
        return q4, k4, float(scale), masks, causal, softcap
    if qk.transpose_b:
        k = kt
    else:
        t = defining(kt, "ge.transpose")
        flat = _flat_heads_transpose(kt) if t is None or t.result.type.rank != kt.type.rank else None
        if flat is not None:
            b, n, d, s = kt.type.shape
            return q, _Reshaped(flat, (b, n, s, d)), float(scale), masks, causal, softcap
        if t is None:
            k = _unit_transposed(kt)
            if k is None:
                return Miss("the first matmul's right operand is not k transposed (no ge.transpose, transpose_b = false)")
            k, k_scale = _peel_scale(k)
            return q, k, float(scale * k_scale), masks, causal, softcap
        rank = len(t.perm)
        want = list(range(rank - 2)) + [rank - 1, rank - 2]
        k, k_scale = _peel_scale(t.operands[0])
        scale *= k_scale
        if list(t.perm) != want:
            # k^T = transpose(x, p) (say a head split merged into the transpose by canonicalize):
            # k itself is transpose(x, p with its last two entries swapped), which the rewrite builds
            k_perm = list(t.perm[:-2]) + [t.perm[-1], t.perm[-2]]
            k = (k, k_perm)
    return q, k, float(scale), masks, causal, softcap


def _unit_transposed(kt: Value) -> Value | None:
    """k where k^T is k reshaped with its last two axes swapped and one of them of size 1 (canonicalize makes such a
    transpose, one head dim or one key, a reshape: the same bytes), else None."""
    r = defining(kt, "ge.reshape")
    if r is None:
        return None
    k = r.operands[0]
    ks, kts = k.type.shape, kt.type.shape
    if k.type.rank != kt.type.rank or k.type.rank < 2 or 1 not in ks[-2:]:
        return None
    return k if tuple(ks[:-2]) + (ks[-1], ks[-2]) == tuple(kts) and None not in ks else None


def _softcap(op: Operation) -> tuple[float, list[Operation]] | Miss:
    """The cap c of `c * tanh(y)` ending at `op` (a bare tanh: c = 1, as canonicalize leaves a cap of 1), with its
    ops, or a Miss naming the op that is not that form. y is the scores scaled by whatever the walk finds above
    (the model's s / c, or that folded into the scale): c * tanh(a * s) is the cap c of scores scaled by a * c."""
    if op.name == "ge.tanh":
        return 1.0, [op]
    tanh_side = 0 if defining(op.operands[0], "ge.tanh") else 1
    tanh = op.operands[tanh_side].owner
    c = scalar_constant(op.operands[1 - tanh_side])
    if c is None or not c > 0:
        return Miss(f"{named(op)} multiplies {named(tanh)} by something other than a positive scalar constant: "
                    f"a logit softcap is c * tanh(s / c)")
    return float(c), [op, tanh]


def _peel_scale(v: Value) -> tuple[Value, float]:
    """What `v` scales and by how much, when it is a mul or div by a nonzero scalar constant used once."""
    op = defining(v, "ge.mul", "ge.div")
    if op is None or len(v.users()) != 1:
        return v, 1.0
    for side in (1, 0) if op.name == "ge.mul" else (1,):
        c = scalar_constant(op.operands[side])
        inner = op.operands[1 - side]
        if c is not None and c != 0 and inner.type.shape == v.type.shape:
            return inner, (c if op.name == "ge.mul" else 1.0 / c)
    return v, 1.0


def _probabilities(v: Value) -> bool:
    """`v` is a softmax result, or a cast of one."""
    cast = defining(v, "ge.cast")
    return defining(cast.operands[0] if cast is not None else v, "ge.softmax") is not None


def _zero_rows_problem(guard: Operation, pv: Operation, nan_test: Operation | None = None) -> str | None:
    """Why `select(rows, 0, P)` (or `select(isnan(P), 0, P)`, the dynamo exporter's) before P @ V is not a guard
    that zeroes whole rows of P, or None."""
    rows, zero, p = guard.operands
    if scalar_constant(zero) != 0:
        return "the probabilities go through a select whose other value is not 0"
    if nan_test is not None:
        if not used_only_by(nan_test.result, guard):
            return "the NaN test of the probabilities is also used elsewhere; fusing would drop it"
    elif rows.type.rank == 0 or rows.type.shape[-1] != 1:
        return f"the select on the probabilities picks single elements ({rows.type}), not whole rows"
    if guard.result.type != p.type:
        return f"the select on the probabilities broadcasts them from {p.type} to {guard.result.type}"
    if not used_only_by(guard.result, pv):
        return "the guarded probabilities are also used elsewhere; fusing would drop them"
    return None


def _repeated_heads(v: Value) -> tuple[Value, int]:
    """k or v repeated per group of query heads, written out: (the [B, Nkv, S, D] tensor, the group size).

    The spelling is reshape(x, [B, Nkv, 1, S, D]), G copies along axis 2, reshape to
    [B, Nkv * G, S, D], which gives query head h the kv head h // G (as flash_attention does). The
    copies are a concat of G times the same value (ONNX `Expand` as geimport brings it in) or a
    multiplication by a constant of ones shaped [B, Nkv, G, S, D] (`expand` as the torch frontend
    brings it in: HF's `repeat_kv`). Anything else is (v, 1).
    """
    outer = defining(v, "ge.reshape")
    if outer is None or v.type.rank != 4:
        return v, 1
    x, group = _grouped_source(outer.operands[0], v.type.shape)
    return (x, group) if group > 1 else (v, 1)


def _grouped_source(copies_val: Value, heads_shape: tuple) -> tuple[Value, int]:
    """For G copies of each kv head ([B, Nkv, G, S, D], see _repeated_heads) that a reshape makes
    `heads_shape` [B, Nkv * G, S, D]: the [B, Nkv, S, D] tensor copied and G; else (copies_val, 1)."""
    copies = defining(copies_val, "ge.concat", "ge.mul", "ge.dynamic_broadcast")
    if copies is None or copies.result.type.rank != 5:
        return copies_val, 1
    if copies.name == "ge.dynamic_broadcast":  # Expand to a shape read at run time (the ONNX spelling at a run-time S)
        one = copies.operands[0]
        full = copies.result.type.shape
        if one.type.rank != 5 or any(one.type.shape[i] != full[i] for i in (0, 1, 3, 4)):
            return copies_val, 1
        group = full[2]
    elif copies.name == "ge.concat":
        one = copies.operands[0]
        if copies.axis % 5 != 2 or any(x is not one for x in copies.operands):
            return copies_val, 1
        group = len(copies.operands)
    else:
        a, b = copies.operands
        full = copies.result.type.shape
        # ones of any shape that broadcasts the copies out along the group axis only (torch's expand keeps the
        # other axes, a run-time S among them, at 1)
        if _all_ones(b) and b.type.rank <= 5:
            one = a
        elif _all_ones(a) and a.type.rank <= 5:
            one = b
        else:
            return copies_val, 1
        if one.type.rank != 5 or any(one.type.shape[i] != full[i] for i in (0, 1, 3, 4)):
            return copies_val, 1
        group = full[2]
    inner = defining(one, "ge.reshape")
    if inner is None:
        return copies_val, 1
    x = inner.operands[0]
    b, nkv, g, s, d = one.type.shape
    if g != 1 or group is None or x.type.shape != (b, nkv, s, d) or tuple(heads_shape) != (
            b, None if nkv is None else nkv * group, s, d):
        return copies_val, 1
    return x, group


def _flat_heads_transpose(kt: Value) -> Value | None:
    """k^T as the dynamo ONNX exporter writes SDPA's: reshape(transpose(reshape(k, [B*N, S, D]), [0, 2, 1]),
    [B, N, D, S]); the value reshaped (k, or the copies of grouped heads that make k), else None. With a
    run-time S the reshapes take their shapes from Shape(k) (ge.dynamic_reshape); B, N and D are static."""
    reshapes = ("ge.reshape", "ge.dynamic_reshape")
    outer = defining(kt, *reshapes)
    t = defining(outer.operands[0], "ge.transpose") if outer is not None else None
    inner = defining(t.operands[0], *reshapes) if t is not None else None
    if inner is None or list(t.perm) != [0, 2, 1] or kt.type.rank != 4 or None in kt.type.shape[:3]:
        return None
    if len(t.result.users()) != 1 or len(inner.result.users()) != 1:
        return None
    b, n, d, s = kt.type.shape
    if inner.result.type.shape != (b * n, s, d):
        return None
    return inner.operands[0]


def _all_ones(v: Value) -> bool:
    """`v` is a constant whose every element is 1."""
    arr = const_array(v)
    return arr is not None and arr.size > 0 and bool(np.all(arr == 1))


def _from_scores(v: Value) -> bool:
    """`v` comes from a matmul through scales, casts, a softcap's tanh and adds of something else (earlier masks):
    at each add, exactly one side does.

    A loop with its own stack and a memo, not recursion: a chain of thousands of adds is a graph's depth, not a
    limit, and an add of a value to itself is decided once, not once per path."""
    known: dict[int, bool] = {}
    stack = [v]
    while stack:
        u = stack[-1]
        if id(u) in known:
            stack.pop()
            continue
        op = u.owner
        # tanh: a logit softcap; a reshape: Bloom's scores with the heads split out of the batch
        while op is not None and op.name in ("ge.mul", "ge.div", "ge.cast", "ge.tanh", "ge.reshape",
                                             "ge.dynamic_reshape"):
            inner = [o for o in op.operands if scalar_constant(o) is None]
            if op.name in ("ge.reshape", "ge.dynamic_reshape"):
                inner = op.operands[:1]  # the data; a dynamic reshape's sizes are not on the scores' path
            op = inner[0].owner if len(inner) == 1 else None
        if op is not None and op.name == "ge.add":
            a, b = op.operands
            todo = [x for x in (a, b) if id(x) not in known]
            if todo:
                stack += todo
                continue
            known[id(u)] = known[id(a)] != known[id(b)]
        else:
            known[id(u)] = op is not None and op.name == "ge.matmul"
        stack.pop()
    return known[id(v)]


def _mask_side(a: Value, b: Value) -> int | None:
    """Which operand of `scores + mask` is the mask: the one that does not come from the scores path."""
    if _from_scores(b) and not _from_scores(a):
        return 0
    if _from_scores(a) and not _from_scores(b):
        return 1
    return None


def _no_mask_side(a: Value, b: Value) -> str:
    """Why neither operand of an add on the scores is a mask."""
    if _from_scores(a) and _from_scores(b):
        return "both operands of the add on the scores come from matmuls (scores added to scores, not a mask)"
    return "neither operand of the add on the scores leads up to q @ k^T through scales, casts and masks"
