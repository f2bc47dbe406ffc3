"""Two independent ops of one kind on a shared operand become one launch with both results: the form of
`kv_scatter_pair` (K and V written at one set of slots) and `rotary_pair` (q and k turned by one table)."""

from __future__ import annotations

from geir.ir import Operation
from geir.passes.fusion.match import named, reaches, restore_order
from geir.passes.pattern import Match, Miss, Pattern, Rewriter


class MergeSiblings(Pattern):
    """Finds a sibling that can share this op's launch, or says why none can; subclasses say what a sibling is,
    what keeps two apart and how the pair is built. The pair takes the later op's place, so that everything both
    read is defined before it."""

    SIBLING = "sibling"  # how a miss remark names the other op: "the other {SIBLING} (ge.x %v) ..."

    def siblings(self, op: Operation) -> list[Operation]:
        """The other ops that share this one's operand (none: nothing to merge)."""
        raise NotImplementedError

    def incompatible(self, op: Operation, other: Operation) -> str | None:
        """Why `other` cannot share `op`'s launch, after `the other {SIBLING} (...)`; None when it can."""
        raise NotImplementedError

    def build_pair(self, op: Operation, other: Operation, rw: Rewriter) -> Operation:
        """The one op computing both results, `op`'s first; created before `other`."""
        raise NotImplementedError

    def match(self, op: Operation) -> Match | Miss | None:
        others = self.siblings(op)
        if not others:
            return None
        why = None
        for other in others:
            why = self.incompatible(op, other)
            if why is None and (reaches(op, other) or reaches(other, op)):
                why = "is computed from this one or feeds it"
            if why is None:
                return Match(op, other=other)
            why = f"the other {self.SIBLING} ({named(other)}) {why}"
        return Miss(why)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        pair = self.build_pair(m.root, m.other, rw)
        rw.replace(m.root, pair.results[:1])
        rw.replace(m.other, pair.results[1:])
        restore_order(rw.graph)
