"""A step's K and V cache updates in one launch: two `ge.index_put`s at the same positions (one index tensor, the
step's slots) become one `ge.index_put_pair`, as ATB's ReshapeAndCache writes K and V together (vLLM-Ascend's
`_npu_reshape_and_cache`): one launch head instead of two, the slots read once."""

from __future__ import annotations

from geir.ir import Operation
from geir.passes.fusion.match import named, reaches, restore_order
from geir.passes.pattern import Match, Miss, Pattern, Rewriter


def _plain(op: Operation) -> bool:
    """An index_put that ScatterUpdate runs: one index tensor, no accumulation."""
    return op.name == "ge.index_put" and len(op.operands) == 3 and not op.attributes.get("accumulate", False)


class MergeIndexPutPair(Pattern):
    """index_put(x, a, i), index_put(y, b, i) -> index_put_pair(x, y, a, b, i), both results."""

    NAME, ROOT, BENEFIT, EXPLAIN = "kv_scatter_pair", "ge.index_put", 3, True

    def match(self, put: Operation) -> Match | Miss | None:
        if not _plain(put):
            return None
        index = put.operands[2]
        others = [u for u in index.users() if u is not put and u.name == "ge.index_put" and u.operands[2] is index]
        if not others:
            return None  # the only update at these positions
        why = None
        for other in others:
            x, y = put.operands[0].type, other.operands[0].type
            if not _plain(other):
                why = f"the other update at these positions ({named(other)}) accumulates or takes several index tensors"
            elif other.attributes.get("axis", 0) % max(y.rank, 1) != put.attributes.get("axis", 0) % max(x.rank, 1):
                why = f"the other update at these positions ({named(other)}) writes another axis"
            elif x.rank != y.rank or x.shape[put.axis] != y.shape[other.axis]:
                why = f"the other update at these positions ({named(other)}) writes {y}, this one {x}"
            elif bool(put.attributes.get("in_place", False)) != bool(other.attributes.get("in_place", False)):
                why = (f"the other update at these positions ({named(other)}) "
                       f"{'writes in place' if other.attributes.get('in_place', False) else 'copies its operand'}, "
                       f"this one does not")
            elif reaches(put, other) or reaches(other, put):
                why = f"the other update at these positions ({named(other)}) is computed from this one or feeds it"
            else:
                return Match(put, other=other)
        return Miss(why)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        put, other = m.root, m.other
        operands = [put.operands[0], other.operands[0], put.operands[1], other.operands[1], put.operands[2]]
        attributes = {"axis": put.axis}
        if put.attributes.get("in_place", False):  # both write in place (match): so does the pair
            attributes["in_place"] = True
        pair = rw.create("ge.index_put_pair", operands, attributes, [put.result.type, other.result.type],
                         before=other)
        rw.replace(put, pair.results[:1])
        rw.replace(other, pair.results[1:])
        restore_order(rw.graph)
