"""A step's K and V cache updates in one launch: two `ge.index_put`s at the same positions (one index tensor, the
step's slots) become one `ge.index_put_pair`, as ATB's ReshapeAndCache writes K and V together (vLLM-Ascend's
`_npu_reshape_and_cache`): one launch head instead of two, the slots read once."""

from __future__ import annotations

from geir.ir import Operation
from geir.passes.fusion.siblings import MergeSiblings
from geir.passes.pattern import Rewriter


def _plain(op: Operation) -> bool:
    """An index_put that ScatterUpdate runs: one index tensor, no accumulation."""
    return op.name == "ge.index_put" and len(op.operands) == 3 and not op.attributes.get("accumulate", False)


class MergeIndexPutPair(MergeSiblings):
    """index_put(x, a, i), index_put(y, b, i) -> index_put_pair(x, y, a, b, i), both results."""

    NAME, ROOT, BENEFIT, EXPLAIN = "kv_scatter_pair", "ge.index_put", 3, True
    SIBLING = "update at these positions"

    def siblings(self, put: Operation) -> list[Operation]:
        if not _plain(put):
            return []
        index = put.operands[2]
        return [u for u in index.users() if u is not put and u.name == "ge.index_put" and u.operands[2] is index]

    def incompatible(self, put: Operation, other: Operation) -> str | None:
        x, y = put.operands[0].type, other.operands[0].type
        if not _plain(other):
            return "accumulates or takes several index tensors"
        if other.attributes.get("axis", 0) % max(y.rank, 1) != put.attributes.get("axis", 0) % max(x.rank, 1):
            return "writes another axis"
        if x.rank != y.rank or x.shape[put.axis] != y.shape[other.axis]:
            return f"writes {y}, this one {x}"
        if bool(put.attributes.get("in_place", False)) != bool(other.attributes.get("in_place", False)):
            return (f"{'writes in place' if other.attributes.get('in_place', False) else 'copies its operand'}, "
                    f"this one does not")
        return None

    def build_pair(self, put: Operation, other: Operation, rw: Rewriter) -> Operation:
        operands = [put.operands[0], other.operands[0], put.operands[1], other.operands[1], put.operands[2]]
        attributes = {"axis": put.axis}
        if put.attributes.get("in_place", False):  # both write in place (match): so does the pair
            attributes["in_place"] = True
        return rw.create("ge.index_put_pair", operands, attributes, [put.result.type, other.result.type],
                         before=other)
