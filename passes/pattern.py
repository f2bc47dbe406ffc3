"""MLIR-style pattern rewriting: patterns that rewrite or say why not, and a greedy driver.

A pattern names the op it is rooted at and its benefit. `match` returns a Match (it fires),
a Miss with a reason (a candidate that did not fit: the reason is what --explain shows), or
None (not a candidate at all: nothing to say). The driver applies the highest-benefit pattern
that matches each op, revisits what a rewrite touched, erases dead ops, and stops at a fixpoint.
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar, Iterable

import attrs

from geir.builder import Builder
from geir.diagnostics import Location
from geir.ir import Graph, Operation, Value
from geir.opdef import ShapeError
from geir.ops.core import Const
from geir.traits import Terminator
from geir.types import TensorType


@attrs.frozen
class Miss:
    """A candidate that did not match, and why."""

    reason: str


class Match:
    """What a pattern found: the root op and named pieces (`m.q`, `m.scale`, ...)."""

    def __init__(self, root: Operation, **found: Any):
        self.root = root
        self.__dict__.update(found)


class Pattern:
    """A rewrite rooted at ops named `ROOT`."""

    NAME: ClassVar[str] = ""
    # the op name this pattern is rooted at, or a tuple of names
    ROOT: ClassVar[str | tuple[str, ...]] = ""
    BENEFIT: ClassVar[int] = 1
    # whether outcomes are --explain remarks (fusion rules); identities stay quiet
    EXPLAIN: ClassVar[bool] = False

    def match(self, op: Operation) -> Match | Miss | None:
        raise NotImplementedError

    def rewrite(self, m: Match, rw: "Rewriter") -> None:
        raise NotImplementedError


class Rewriter:
    """The only way patterns change the graph, so the driver knows what to revisit."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.builder = Builder(graph)
        self.touched: list[Operation] = []

    def create(self, name: str, operands: list[Value], attributes: dict[str, Any] | None = None,
               result_types: list[TensorType] | None = None, *, before: Operation,
               loc: Location | None = None) -> Operation:
        """Insert a new op before `before`, at its location unless `loc` is given; result types are inferred
        when not given (ShapeError naming the op when its shape rule rejects the operands)."""
        self.builder.set_insertion_point_before(before)
        op = self.builder.create(name, operands, attributes, result_types, loc=loc or before.loc)
        self.touched.append(op)
        return op

    def replace(self, op: Operation, new: Operation | list[Value]) -> None:
        """Point every use of `op`'s results at `new`'s and erase `op`."""
        values = new.results if isinstance(new, Operation) else new
        assert len(values) == len(op.results), f"replacing {op} with {len(values)} values"
        for old, v in zip(op.results, values):
            self.touched.extend(old.users())
            if v.name is None and old.name is not None and v.owner is not None:
                v.name = old.name  # keep the user's name on the value that now plays its part
                old.name = None
            old.replace_all_uses_with(v)
        self.erase(op)

    def erase(self, op: Operation) -> None:
        self.touched.extend(v.owner for v in op.operands if v.owner is not None)
        self.graph.erase(op)


@attrs.frozen
class FusionOutcome:
    """One fusion candidate's outcome: its rule, where, and why it did not match (None: it fused)."""

    rule: str
    loc: Location
    reason: str | None = None

    @property
    def fused(self) -> bool:
        return self.reason is None

    def render(self) -> str:
        """The --explain remark: "<rule> fused" or "<rule> not fused: <reason>"."""
        return f"{self.rule} fused" if self.reason is None else f"{self.rule} not fused: {self.reason}"


class PatternListener:
    """Collects, per candidate, whether a pattern fired or why it did not (for --explain)."""

    def __init__(self) -> None:
        self.fired: list[tuple[Pattern, Location]] = []
        self.misses: dict[tuple[str, int], tuple[Pattern, Operation, str]] = {}

    def matched(self, p: Pattern, op: Operation) -> None:
        if p.EXPLAIN:
            self.fired.append((p, op.loc))
            self.misses.pop((p.NAME, id(op)), None)

    def missed(self, p: Pattern, op: Operation, reason: str) -> None:
        if p.EXPLAIN:
            self.misses[(p.NAME, id(op))] = (p, op, reason)

    def outcomes(self) -> list[FusionOutcome]:
        """One outcome per candidate, in source order: fused, or the last reason it did not match.

        A miss stays even when another rule later absorbed the op: its reason is still why this rule did not fire.
        """
        out = [FusionOutcome(p.NAME, loc) for p, loc in self.fired]
        out += [FusionOutcome(p.NAME, op.loc, why) for p, op, why in self.misses.values()]
        return sorted(out, key=lambda o: (o.loc.line, o.loc.col, o.render()))

    def remarks(self) -> list[tuple[str, Location]]:
        """The outcomes as (remark, location), in source order."""
        return [(o.render(), o.loc) for o in self.outcomes()]


def is_trivially_dead(op: Operation) -> bool:
    """Whether erasing `op` changes nothing: it ends no graph and nothing uses its results."""
    return not op.has_trait(Terminator) and not any(r.uses for r in op.results)


def apply_patterns_greedily(graph: Graph, patterns: Iterable[Pattern], listener: PatternListener | None = None,
                            max_rewrites: int | None = None) -> bool:
    """Rewrite to a fixpoint; True when anything changed. Each op is visited once plus once per touch."""
    by_root: dict[str, list[Pattern]] = {}
    for p in sorted(patterns, key=lambda p: -p.BENEFIT):
        for root in (p.ROOT,) if isinstance(p.ROOT, str) else p.ROOT:
            by_root.setdefault(root, []).append(p)
    listener = listener or PatternListener()
    worklist = deque(graph.ops)
    queued = {id(op) for op in worklist}
    limit = max_rewrites if max_rewrites is not None else 10 * len(worklist) + 1000
    changed = False
    rewrites = 0
    while worklist:
        op = worklist.popleft()
        queued.discard(id(op))
        if op.erased:
            continue
        rw = Rewriter(graph)
        if is_trivially_dead(op):
            rw.erase(op)
            changed = True
        else:
            for p in by_root.get(op.name, ()):
                try:
                    m = p.match(op)
                except ShapeError as e:  # a rewrite would build ill-typed IR: treat as a reasoned miss
                    m = Miss(str(e))
                if m is None:
                    continue
                if isinstance(m, Miss):
                    listener.missed(p, op, m.reason)
                    continue
                listener.matched(p, op)
                p.rewrite(m, rw)
                changed = True
                rewrites += 1
                break
        for t in rw.touched:
            if t is not None and not t.erased and id(t) not in queued:
                worklist.append(t)
                queued.add(id(t))
        if rewrites > limit:
            break
    return changed


def constant_splat(v: Value) -> float | int | bool | None:
    """The value of a constant whose elements are all equal, else None."""
    op = v.owner
    if isinstance(op, Const) and hasattr(op.value, "splat_value"):
        return op.value.splat_value()
    return None
