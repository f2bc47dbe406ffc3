"""The zeroing of fully masked query rows taken into FlashAttention.

torch's SDPA gives zeros for a query row whose every key the mask hides; FlashAttention's online softmax gives the
0 / 0 of an empty row, so the frontends zero such rows after it: `select(hidden, 0, attention)`, `hidden` the rows
where the mask keeps no key. ops-transformer's FlashAttention does this itself when asked (FusedInferAttentionScore's
row-invalid correction, inner_precise bit 1; Ascend/op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md):
`ge.flash_attention {zero_masked_rows}`. The select's launch goes away (in decode, one vector kernel per layer).

The rule checks that `hidden` is the check the frontends build from the attention's own mask operand, spelled as
the torch frontend does (less(reduce_max(cast(keep, f32)), 0.5), keep the i1 mask or mask > -inf) or as the ONNX one
does (equal(reduce_max(cast(mask, f32)), 0) for an i1 mask, equal(reduce_max(mask), -inf) for a float one).
"""

from __future__ import annotations

import math

from geir.ir import Operation, Value
from geir.passes.fusion.match import defining, named, scalar_constant
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.types import DType


def _what(v: Value) -> str:
    """A value as a remark names it: its defining op, or the argument."""
    return named(v.owner) if v.owner is not None else f"the argument %{v.name}"


def _last_axis_max(v: Value) -> tuple[Operation | None, str | None]:
    """(the reduce_max over the last axis, keepdims, that defines v; else None and why)."""
    red = defining(v, "ge.reduce_max")
    if red is None:
        return None, f"the row check reads {_what(v)}, not a reduce_max over the keys"
    x = red.operands[0]
    rank = x.type.rank if x.type is not None else None
    axes = [a % rank for a in red.attr("axes")] if rank else []
    if rank is None or axes != [rank - 1] or not red.attr("keepdims"):
        return None, f"{named(red)} does not reduce the last (key) axis alone with keepdims"
    return red, None


def _kept_source(keep: Value) -> Value | None:
    """The mask a `keep` value stands for: itself when i1, m where keep = greater(m, -inf)."""
    gt = defining(keep, "ge.greater")
    if gt is not None and scalar_constant(gt.operands[1]) == -math.inf:
        return gt.operands[0]
    if keep.type is not None and keep.type.dtype is DType.i1:
        return keep
    return None


def hidden_rows_mask(cond: Value) -> tuple[Value | None, str]:
    """(the mask whose wholly hidden rows `cond` flags, or None; why not)."""
    cmp = defining(cond, "ge.less", "ge.equal")
    if cmp is None:
        return None, f"the condition comes from {_what(cond)}, not a row check"
    red, why = _last_axis_max(cmp.operands[0])
    if red is None:
        return None, why
    bound = scalar_constant(cmp.operands[1])
    x = red.operands[0]
    cast = defining(x, "ge.cast")
    if cmp.name == "ge.less":  # torch: no key kept has a maximum below one half
        if bound != 0.5 or cast is None:
            return None, f"{named(cmp)} is not (reduce_max of the kept keys as f32) < 0.5"
        mask = _kept_source(cast.operands[0])
        return mask, "" if mask is not None else f"{named(cast)} casts neither an i1 mask nor mask > -inf"
    if cast is not None and bound == 0.0 and cast.operands[0].type.dtype is DType.i1:  # ONNX, i1 mask
        return cast.operands[0], ""
    if cast is None and bound == -math.inf and x.type.dtype.is_float:  # ONNX, float mask
        return x, ""
    return None, f"{named(cmp)} is not a check that every key of a row is masked"


class FoldMaskedRowsSelect(Pattern):
    """select(rows the attention's mask hides wholly, 0, flash_attention(q, k, v, mask))
    -> flash_attention(q, k, v, mask) {zero_masked_rows}."""

    # below attention_native (19) and paged_attention (18), which rebuild the flash_attention it marks, and above
    # the elementwise chains (1), which would take the select into a fused_elementwise
    NAME, ROOT, BENEFIT, EXPLAIN = "masked_rows", "ge.select", 17, True

    def match(self, sel: Operation) -> Match | Miss | None:
        cond, zero, x = sel.operands
        fa = defining(x, "ge.flash_attention")
        if fa is None or defining(cond, "ge.less", "ge.equal") is None:
            return None  # not a select after attention, or on no comparison (a NaN guard): not a row check
        mask = fa.mask
        if mask is None:
            return Miss(f"{named(fa)} takes no mask whose hidden rows the select could be zeroing")
        if scalar_constant(zero) != 0.0:
            return Miss(f"the select writes {_what(zero)}, not zeros, "
                        f"where the rows are hidden")
        if len(x.uses) != 1:
            return Miss(f"{named(fa)}'s result is also used without the select; its rows stay as they are")
        if fa.attr("layout") != "BNSD":
            return Miss(f"{named(fa)} is {fa.attr('layout')}; the row check is over BNSD rows")
        if sel.result.type != x.type:
            return Miss(f"the select broadcasts the attention {x.type} to {sel.result.type}")
        source, why = hidden_rows_mask(cond)
        if source is None:
            return Miss(why)
        if source is not mask:
            return Miss(f"the row check reads {_what(source)}, "
                        f"not {named(fa)}'s mask")
        return Match(sel, fa=fa)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        fa = m.fa
        new = rw.create("ge.flash_attention", list(fa.operands), dict(fa.attributes, zero_masked_rows=True),
                        [fa.result.type], before=m.root)
        rw.replace(m.root, new)
        rw.erase(fa)
