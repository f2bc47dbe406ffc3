"""A mixture-of-experts layer as transformers' grouped_mm experts write it becomes ops-transformer's moe family:

- the router's softmax, top-k and optional renormalisation: one `ge.moe_gating_topk_softmax`
  (MoeGatingTopKSoftmaxV2);
- the pairs sorted by expert, each pair's token row gathered, the inverse order and the tokens per expert (sort,
  floor-divide, gather, index_put of an arange, histc, cumsum): one `ge.moe_init_routing` (MoeInitRoutingV2);
- the experts' rows weighted by the sorted routing weights, put back in pair order and summed per token: one
  `ge.moe_finalize_routing` (MoeFinalizeRouting).

The experts themselves are already one `ge.grouped_matmul` per projection (the importer maps transformers'
grouped_mm to it). The combine runs first (it reads the sorted order the routing rule then absorbs), the routing
next, the gating last; all above the matmul epilogue and elementwise chains, which would swallow their pieces.
"""

from __future__ import annotations

import numpy as np

from geir.ir import Operation, Value
from geir.passes.fusion.match import const_array, defining, named, scalar_constant, used_only_by
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.types import DType


def _is_last_axis(axis: int, rank: int) -> bool:
    return rank > 0 and axis % rank == rank - 1


def _sorts_ascending(op: Operation | None) -> bool:
    """A stable ascending sort of a 1-D tensor: ge.sort, or ge.topk of every element, smallest first (the importer's
    spelling of a sort whose length is known at export)."""
    if op is None or op.operands[0].type.rank != 1:
        return False
    if op.name == "ge.sort":
        return not op.attr("descending")
    return (op.name == "ge.topk" and not op.attr("largest") and op.attr("sorted")
            and op.attr("k") == op.operands[0].type.shape[0])


def _reader(v: Value, other_than: tuple[Operation, ...]) -> Operation | None:
    """An op reading `v` that is none of `other_than` (the first such), else None."""
    return next((u for u in v.users() if all(u is not o for o in other_than)), None)


class FuseMoeGating(Pattern):
    """topk(softmax(x), k) over the experts, optionally values / sum(values) -> ge.moe_gating_topk_softmax."""

    NAME, ROOT, BENEFIT, EXPLAIN = "moe_gating", "ge.topk", 25, True

    def match(self, topk: Operation) -> Match | Miss | None:
        sm = defining(topk.operands[0], "ge.softmax")
        if sm is None:
            return None  # a top-k of something other than probabilities: no router
        x = sm.operands[0]
        rank = x.type.rank
        if not _is_last_axis(sm.attr("axis"), rank) or not _is_last_axis(topk.attr("axis"), rank):
            return Miss(f"{named(sm)} and {named(topk)} do not both run over the last axis (the experts)")
        if not topk.attr("largest") or not topk.attr("sorted"):
            return Miss(f"{named(topk)} takes the smallest or unsorted probabilities; the router takes the largest, "
                        f"sorted")
        other = _reader(sm.results[0], (topk,))
        if other is not None:
            return Miss(f"the probabilities of {named(sm)} are also read by {named(other)}")
        values = topk.results[0]
        renorm = _renormalised(values)
        return Match(topk, x=x, renorm=renorm)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        topk = m.root
        fused = rw.create("ge.moe_gating_topk_softmax", [m.x], {"k": topk.attr("k"), "renorm": m.renorm is not None},
                          before=topk)
        weights, experts = fused.results
        if m.renorm is not None:
            rw.replace(m.renorm, [weights])  # the division's readers read the renormalised weights
        rw.replace(topk, [weights, experts])  # the sum left behind reads nothing anyone needs: erased as dead


def _renormalised(values: Value) -> Operation | None:
    """The ge.div of values / reduce_sum(values, last axis, keepdims) when that is all that reads `values`."""
    users = values.users()
    if len(users) != 2:
        return None
    total = next((u for u in users if u.name == "ge.reduce_sum"), None)
    div = next((u for u in users if u.name == "ge.div"), None)
    if total is None or div is None or div.operands[0] is not values or div.operands[1] is not total.results[0]:
        return None
    axes, rank = list(total.attr("axes")), values.type.rank
    if len(axes) != 1 or not _is_last_axis(axes[0], rank) or not total.attr("keepdims"):
        return None
    return div if used_only_by(total.results[0], div) else None


class FuseMoeFinalizeRouting(Pattern):
    """reduce_sum(reshape(gather(y * w_flat[order], inverse(order)), [N, k, H]), 1) -> ge.moe_finalize_routing."""

    NAME, ROOT, BENEFIT, EXPLAIN = "moe_finalize_routing", "ge.reduce_sum", 27, True

    def match(self, total: Operation) -> Match | Miss | None:
        shaped = defining(total.operands[0], "ge.reshape")
        back = defining(shaped.operands[0], "ge.gather") if shaped is not None else None
        if back is None or shaped.results[0].type.rank != 3:
            return None  # not a sum over the pairs of each token
        if list(total.attr("axes")) != [1] or total.attr("keepdims"):
            return Miss(f"{named(total)} does not sum the k pairs of each token (axis 1 of [N, k, H])")
        weighted = defining(back.operands[0], "ge.mul")
        if weighted is None or back.attr("axis") != 0:
            return Miss(f"{named(back)} does not put weighted expert rows back in pair order")
        inverse = _inverse_order(back.operands[1])
        if isinstance(inverse, Miss):
            return inverse
        order = inverse
        for side in (0, 1):
            scales = _sorted_weights(weighted.operands[side], order)
            if scales is not None:
                rows = weighted.operands[1 - side]
                break
        else:
            return Miss(f"{named(weighted)} does not weigh the rows by the routing weights taken in the sorted order")
        k = shaped.results[0].type.shape[1]
        if scales.type.rank != 2 or scales.type.shape[1] != k:
            return Miss(f"the routing weights {scales.type} are not [N, {k}] for the {k} pairs of each token")
        for v, reader in ((weighted.results[0], back), (back.results[0], shaped), (shaped.results[0], total)):
            other = _reader(v, (reader,))
            if other is not None:
                return Miss(f"an intermediate of the combine is also read by {named(other)}")
        return Match(total, rows=rows, scales=scales, inverse=back.operands[1])

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        fused = rw.create("ge.moe_finalize_routing", [m.rows, m.scales, m.inverse], before=m.root)
        rw.replace(m.root, fused)


def _inverse_order(v: Value) -> Value | Miss:
    """The sort's order whose inverse `v` is (index_put(_, arange, order): v[order[i]] = i), or a Miss."""
    put = defining(v, "ge.index_put")
    if put is None or len(put.operands) != 3 or put.attr("axis") != 0 or put.attr("accumulate"):
        return Miss(f"the rows are put back by indices {_by(v)}, not the inverse of the sort's order")
    order = put.operands[2]
    if not _sorts_ascending(order.owner) or order.owner.results[1] is not order:
        return Miss(f"the order inverted by {named(put)} is not an ascending sort's")
    if not _is_arange(put.operands[1]):
        return Miss(f"{named(put)} writes {_by(put.operands[1])}, not 0, 1, 2, ... (the inverse of the order)")
    return order


def _by(v: Value) -> str:
    return named(v.owner) if v.owner is not None else f"argument %{v.name}"


def _is_arange(v: Value) -> bool:
    """Whether `v` is 0, 1, 2, ...: a ge.range from 0 by 1, or a constant holding that."""
    rng = defining(v, "ge.range")
    if rng is not None:
        start, _, step = rng.operands
        return scalar_constant(start) == 0 and scalar_constant(step) == 1
    arr = const_array(v)
    return arr is not None and arr.ndim == 1 and np.array_equal(arr, np.arange(arr.size))


def _sorted_weights(v: Value, order: Value) -> Value | None:
    """The weights [N, k] when v is reshape(gather(reshape(weights, [-1]), order), [-1, 1])."""
    column = defining(v, "ge.reshape")
    pick = defining(column.operands[0], "ge.gather") if column is not None else None
    if pick is None or pick.operands[1] is not order or column.results[0].type.rank != 2:
        return None
    flat = defining(pick.operands[0], "ge.reshape")
    return flat.operands[0] if flat is not None and flat.results[0].type.rank == 1 else None


class FuseMoeInitRouting(Pattern):
    """sort(flatten(expert_idx)) with x[order // k], the inverse order and histc(+cumsum) of the sorted experts
    -> ge.moe_init_routing."""

    NAME, ROOT, BENEFIT, EXPLAIN = "moe_init_routing", ("ge.sort", "ge.topk"), 26, True

    def match(self, sort: Operation) -> Match | Miss | None:
        flat = defining(sort.operands[0], "ge.reshape")
        if flat is None or flat.operands[0].type.rank != 2 or sort.results[0].type.rank != 1:
            return None  # not a sort of the token-expert pairs
        if sort.name == "ge.topk" and not _sorts_ascending(sort):
            return None  # the k largest or smallest of the pairs, not all of them in order
        if not sort.results[0].uses:
            return None  # nothing reads the sorted experts (what a fused routing leaves until it is erased)
        expert_idx = flat.operands[0]
        k = expert_idx.type.shape[1]
        if sort.attr("descending"):
            return Miss(f"{named(sort)} sorts the experts in descending order; routing orders them ascending")
        counted = _counts(sort.results[0])
        if isinstance(counted, Miss):
            return counted
        cumsum, tokens, experts, counting = counted
        order = sort.results[1]
        token = _pair_token(order, k)
        if isinstance(token, Miss):
            return token
        token_value, token_ops = token
        gathers = token_value.users()
        if len(gathers) != 1 or gathers[0].name != "ge.gather" or gathers[0].attr("axis") != 0 \
                or gathers[0].operands[1] is not token_value or gathers[0].operands[0].type.rank != 2:
            return Miss(f"the tokens of the sorted pairs are read by {named(gathers[0]) if gathers else 'nothing'}, "
                        f"not one gather of the token rows")
        gather = gathers[0]
        inverse = next((u for u in order.users() if u.name == "ge.index_put"), None)
        if inverse is None or isinstance(_inverse_order(inverse.results[0]), Miss):
            return Miss(f"the inverse of the order of {named(sort)} is not computed (index_put of an arange)")
        # ge.shape_of and ge.dim read only how many pairs there are (the inverse's base and arange, sized like it)
        shapes = tuple(u for u in order.users() if u.name in ("ge.shape_of", "ge.dim"))
        other = _reader(order, tuple(token_ops) + (inverse,) + shapes)
        if other is not None:
            return Miss(f"the order of {named(sort)} is also read by {named(other)}")
        return Match(sort, x=gather.operands[0], expert_idx=expert_idx, experts=experts, gather=gather,
                     inverse=inverse, tokens=tokens, cumsum=cumsum, replaced=counting + token_ops)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        list_type = "cumsum" if m.cumsum else "count"
        fused = rw.create("ge.moe_init_routing", [m.x, m.expert_idx],
                          {"num_experts": m.experts, "tokens_list_type": list_type}, before=m.root)
        expanded_x, expanded_row_idx, tokens = fused.results
        if tokens.type.dtype != m.tokens.results[0].type.dtype:
            tokens = rw.create("ge.cast", [tokens], {"to": m.tokens.results[0].type.dtype}, before=m.root).result
        rw.replace(m.gather, [expanded_x])
        rw.replace(m.inverse, [expanded_row_idx])
        rw.replace(m.tokens, [tokens])
        # the sort and what computed from it go now, so that the sort is never a candidate again
        for op in [*reversed(m.replaced), m.root]:
            if not op.erased and not any(r.uses for r in op.results):
                rw.erase(op)


def _counts(sorted_experts: Value) -> tuple[bool, Operation, int, list[Operation]] | Miss:
    """(whether they are running ends, the op giving the tokens per expert, the number of experts, the ops) when the
    sorted experts are only counted per expert: [cast] -> histc over [0, E-1] with E bins -> [cast] -> [cumsum]."""
    op = _only_reader(sorted_experts)
    chain = [op]
    if op is not None and op.name == "ge.cast":
        op = _only_reader(op.results[0])
        chain.append(op)
    if op is None or op.name != "ge.histc":
        return Miss(f"the sorted experts are not only counted per expert (ge.histc): read by "
                    f"{', '.join(named(u) for u in sorted_experts.users()) or 'nothing'}")
    bins = op.attr("bins")
    if op.attr("min") != 0 or op.attr("max") != bins - 1:
        return Miss(f"{named(op)} counts [{op.attr('min')}, {op.attr('max')}] in {bins} bins, not one bin per "
                    f"expert 0..{bins - 1}")
    last, cumsum = op, False
    nxt = _only_reader(last.results[0])
    if nxt is not None and nxt.name == "ge.cast" and not nxt.results[0].type.dtype.is_float:
        last, nxt = nxt, _only_reader(nxt.results[0])
        chain.append(last)
    if nxt is not None and nxt.name == "ge.cumsum" and not nxt.attr("exclusive") and not nxt.attr("reverse"):
        last, cumsum = nxt, True
        chain.append(last)
    if last.results[0].type.dtype.is_float or last.results[0].type.dtype is DType.i1:
        return Miss(f"the tokens per expert stay {last.results[0].type.dtype} numbers ({named(last)}), not integers")
    return cumsum, last, bins, chain


def _only_reader(v: Value) -> Operation | None:
    users = v.users()
    return users[0] if len(users) == 1 else None


def _pair_token(order: Value, k: int | None) -> tuple[Value, list[Operation]] | Miss:
    """The token of each sorted pair, order // k, and the ops computing it: ge.div by k (order is never negative,
    so truncating is flooring), or the importer's floor_divide (div, then one less where the remainder is < 0)."""
    div = next((u for u in order.users() if u.name == "ge.div" and u.operands[0] is order), None)
    if div is None or k is None or scalar_constant(div.operands[1]) != k:
        return Miss(f"the sorted pairs are not divided by k = {k} to find their tokens")
    ops, token = [div], div.results[0]
    fix = next((u for u in token.users() if u.name == "ge.sub" and u.operands[0] is token), None)
    if fix is not None:
        cast = defining(fix.operands[1], "ge.cast")
        less = defining(cast.operands[0], "ge.less") if cast is not None else None
        rest = defining(less.operands[0], "ge.sub") if less is not None else None
        times = defining(rest.operands[1], "ge.mul") if rest is not None else None
        if times is None or rest.operands[0] is not order or times.operands[0] is not token \
                or scalar_constant(less.operands[1]) != 0:
            return Miss(f"{named(fix)} is not the floor-division's correction of the pairs' tokens")
        ops += [times, rest, less, cast, fix]
        token = fix.results[0]
    for op in ops[:-1]:
        other = _reader(op.results[0], tuple(ops))
        if other is not None:
            return Miss(f"a step of the pairs' tokens, {named(op)}, is also read by {named(other)}")
    return token, ops
