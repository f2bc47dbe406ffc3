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
its result, which is what the guard gives whenever v is finite. Every other shape of graph is a
miss with the reason.
"""

from __future__ import annotations

import numpy as np

from geir.builder import create_op
from geir.ir import Operation, Value
from geir.opdef import ShapeError
from geir.passes.fusion.guards import flash_attention_guard
from geir.target_npu.target import DEFAULT_TARGET, load_target
from geir.passes.fusion.match import const_array, defining, scalar_constant, used_only_by
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.types import DType

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


class FuseFlashAttention(Pattern):
    """softmax(scale * q @ k^T + mask) @ v -> ge.flash_attention."""

    NAME, ROOT, BENEFIT, EXPLAIN = "flash_attention", "ge.matmul", 20, True

    def __init__(self, target: str = DEFAULT_TARGET):
        self.target = target  # the chip whose kernel must take the shapes (passes.fusion.guards)

    def match(self, pv: Operation) -> Match | Miss | None:
        p_val = pv.operands[0]
        guard = defining(p_val, "ge.select")
        if guard is not None:
            if not _probabilities(guard.operands[2]):
                return None  # an ordinary matmul of a select
            why = _zero_rows_problem(guard, pv)
            if why is not None:
                return Miss(why)
            p_val = guard.operands[2]
        consumer = guard or pv  # the op that takes the probabilities
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
        if not used_only_by(sm.result, cast_out or consumer) or (
                cast_out and not used_only_by(cast_out.result, consumer)):
            return Miss("the attention probabilities are also used elsewhere; fusing would drop them")

        found = _walk_scores(sm.operands[0])
        if isinstance(found, Miss):
            return found
        q, k, scale, mask, causal = found
        k_perm = None
        if isinstance(k, tuple):
            k, k_perm = k
        v = pv.operands[1]
        if k_perm is None:
            k, k_group = _repeated_heads(k)
            v, v_group = _repeated_heads(v)
            if k_group != v_group:
                return Miss(f"k and v are repeated for grouped-query heads differently ({k_group} and {v_group} "
                            f"copies of each head)")
        k_type = k.type if k_perm is None else k.type.with_shape(tuple(k.type.shape[p] for p in k_perm))
        if not (q.type.dtype == k_type.dtype == v.type.dtype):
            return Miss(f"q, k and v dtypes differ: {q.type.dtype}, {k_type.dtype}, {v.type.dtype}")
        if q.type.rank != 4 or k_type.rank != 4 or v.type.rank != 4:
            return Miss(f"q, k and v must be rank 4 [B, N, S, D], got ranks {q.type.rank}, {k_type.rank}, {v.type.rank}")
        attrs = {"scale": scale, "causal": causal, "layout": "BNSD"}
        operands = [q, k, v] + ([mask] if mask is not None else [])
        try:
            types = [x.type for x in operands]
            types[1] = k_type
            t = create_op("ge.flash_attention", [], [], attrs).infer(*types)
        except ShapeError as e:
            return Miss(f"the fused op would not type-check: {e}")
        if t.shape != pv.result.type.shape or t.dtype != pv.result.type.dtype:
            return Miss(f"the fused result {t} differs from the attention's result {pv.result.type}")
        why = flash_attention_guard(q.type, k_type, v.type, None if mask is None else mask.type, causal, "BNSD",
                                    load_target(self.target))
        if why is not None:
            return Miss(why)
        return Match(pv, operands=operands, attrs=attrs, k_perm=k_perm, guard=guard)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        operands = list(m.operands)
        if m.k_perm is not None:
            operands[1] = rw.create("ge.transpose", [operands[1]], {"perm": m.k_perm}, before=m.root).result
        op = rw.create("ge.flash_attention", operands, m.attrs, [m.root.result.type], before=m.root)
        if m.guard is not None:  # the rows the guard zeroes in P are zero rows of P @ V
            rows, zero = m.guard.operands[:2]
            op = rw.create("ge.select", [rows, zero, op.result], before=m.root)
        rw.replace(m.root, op)


def _walk_scores(x: Value):
    """From the softmax input up to `q @ k^T`: (q, k, scale, mask, causal) or a Miss."""
    scale = 1.0
    mask: Value | None = None
    causal = False
    seen_scale = False  # walking up, a scale seen before the mask was applied after it
    mask_before_scale = False
    chain: list[Operation] = []  # intermediates that must have no other users
    while True:
        op = x.owner
        if op is None:
            return Miss("the softmax input is a graph argument, not attention scores")
        if op.name == "ge.cast":
            chain.append(op)
            x = op.operands[0]
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
            if mask is not None or causal:
                return Miss("the scores get two masks added")
            a, b = op.operands
            side = _mask_side(a, b)
            if side is None:
                return Miss("neither operand of the mask add is a mask (both come from matmuls)")
            m, x = (a, b) if side == 0 else (b, a)
            mask_before_scale = seen_scale
            arr = const_array(m)
            if arr is not None and causal_pattern(arr, boolean=False):
                causal = True
            elif arr is not None and m.type.dtype.is_float and arr.size and not np.any(arr.astype(np.float32)):
                pass  # adding zeros leaves every score as it is: no mask
            else:
                if m.type.dtype == DType.i1 or not m.type.dtype.is_float:
                    return Miss(f"the additive mask has dtype {m.type.dtype}, not a float")
                mask = m
            chain.append(op)
            continue
        if op.name == "ge.select":
            if mask is not None or causal:
                return Miss("the scores get two masks")
            cond, keep, fill = op.operands
            if not _is_masked_fill(fill):
                if _is_masked_fill(keep):
                    return Miss("the select keeps -inf where the condition is true; the fused mask means true = keep")
                return Miss("the select fills masked scores with something other than -inf")
            arr = const_array(cond)
            if arr is not None and causal_pattern(arr, boolean=True):
                causal = True
            else:
                mask = cond
            chain.append(op)
            x = keep
            continue
        if op.name == "ge.matmul":
            break
        return Miss(f"the scores come from {op.name}, not from q @ k^T")
    if mask is not None and mask_before_scale and mask.type.dtype != DType.i1:
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
    if qk.transpose_b:
        k = kt
    else:
        t = defining(kt, "ge.transpose")
        if t is None:
            return Miss("the first matmul's right operand is not k transposed (no ge.transpose, transpose_b = false)")
        rank = len(t.perm)
        want = list(range(rank - 2)) + [rank - 1, rank - 2]
        k, k_scale = _peel_scale(t.operands[0])
        scale *= k_scale
        if list(t.perm) != want:
            # k^T = transpose(x, p) (say a head split merged into the transpose by canonicalize):
            # k itself is transpose(x, p with its last two entries swapped), which the rewrite builds
            k_perm = list(t.perm[:-2]) + [t.perm[-1], t.perm[-2]]
            k = (k, k_perm)
    return q, k, float(scale), mask, causal


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


def _zero_rows_problem(guard: Operation, pv: Operation) -> str | None:
    """Why `select(rows, 0, P)` before P @ V is not a guard that zeroes whole rows of P, or None."""
    rows, zero, p = guard.operands
    if scalar_constant(zero) != 0:
        return "the probabilities go through a select whose other value is not 0"
    if rows.type.rank == 0 or rows.type.shape[-1] != 1:
        return f"the select on the probabilities picks single elements ({rows.type}), not whole rows"
    if guard.result.type != p.type:
        return f"the select on the probabilities broadcasts them from {p.type} to {guard.result.type}"
    if not used_only_by(guard.result, pv):
        return "the guarded probabilities are also used elsewhere; fusing would drop them"
    return None


def _repeated_heads(v: Value) -> tuple[Value, int]:
    """k or v repeated per group of query heads, written out: (the [B, Nkv, S, D] tensor, the group size).

    The spelling is reshape(x, [B, Nkv, 1, S, D]), a concat of G copies on axis 2, reshape to
    [B, Nkv * G, S, D], which gives query head h the kv head h // G (as flash_attention does).
    Anything else is (v, 1).
    """
    outer = defining(v, "ge.reshape")
    cat = defining(outer.operands[0], "ge.concat") if outer is not None else None
    if cat is None or cat.result.type.rank != 5 or cat.axis % 5 != 2:
        return v, 1
    one = cat.operands[0]
    inner = defining(one, "ge.reshape")
    if inner is None or any(x is not one for x in cat.operands):
        return v, 1
    x = inner.operands[0]
    b, nkv, g, s, d = one.type.shape
    group = len(cat.operands)
    if g != 1 or x.type.shape != (b, nkv, s, d) or v.type.shape != (b, None if nkv is None else nkv * group, s, d):
        return v, 1
    return x, group


def _mask_side(a: Value, b: Value) -> int | None:
    """Which operand of `scores + mask` is the mask: the one that does not come from the scores path."""
    def from_scores(v: Value) -> bool:
        op = v.owner
        while op is not None and op.name in ("ge.mul", "ge.div", "ge.cast"):
            inner = [o for o in op.operands if scalar_constant(o) is None]
            if len(inner) != 1:
                return False
            op = inner[0].owner
        return op is not None and op.name == "ge.matmul"

    if from_scores(b) and not from_scores(a):
        return 0
    if from_scores(a) and not from_scores(b):
        return 1
    return None
