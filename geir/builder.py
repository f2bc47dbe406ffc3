"""Building IR in Python: GEIR's counterpart of MLIR's OpBuilder.

`create_op` is the one place an Operation is assembled from its parts: its class looked up by
name, its results allocated (typed as given, or by the op's own shape rule), its uses registered
on its operands. The parser, passes (through their Rewriter), `lower`, the frontends, the
Runtime's detached kernel ops and cloning all call it, so every op starts out the same way.

A `Builder` adds what building a graph needs around it: an insertion point (the end of a graph,
or before an anchor op), unique value names, graph arguments, constants and the return that
finishes the graph:

    b = Builder()                                    # a new ge.graph @main
    x = b.argument(TensorType((4,), DType.f32), "x")
    y = b.create("ge.neg", [x], hint="y").result     # its type inferred: tensor<4xf32>
    graph = b.finish([y])
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from geir.attributes import DenseAttr, DenseResourceAttr
from geir.diagnostics import UNKNOWN, Location
from geir.ir import Graph, Operation, Value
from geir.opdef import ShapeError, lookup
from geir.types import DType, TensorType


def create_op(name: str, operands: Sequence[Value] = (), result_types: Sequence[TensorType | None] | None = None,
              attributes: dict[str, Any] | None = None, loc: Location = UNKNOWN,
              result_names: Sequence[str | None] | None = None, *, result_locs: Sequence[Location] | None = None,
              attr_locs: dict[str, Location] | None = None, op_class: type[Operation] | None = None) -> Operation:
    """A new, unplaced op `name` with fresh results; their types are inferred by its shape rule when not given.

    `op_class` overrides the class registered for `name` (a clone keeps its original's class).
    Raises KeyError for an op nobody registered, ShapeError when inference rejects the operands.
    """
    cls = op_class or lookup(name)
    if cls is None:
        raise KeyError(f"unknown op '{name}'")
    op = cls(name, list(operands), [], dict(attributes) if attributes else {}, loc, attr_locs)
    if result_types is None:
        result_types = infer_result_types(op)
    n = len(result_types)
    names = result_names if result_names is not None else [None] * n
    locs = result_locs if result_locs is not None else [loc] * n
    if len(names) != n or len(locs) != n:
        raise ValueError(f"{name} has {n} result type(s) but {len(names)} name(s) and {len(locs)} location(s)")
    op.results = [Value(t, rn, op, i, rl) for i, (t, rn, rl) in enumerate(zip(result_types, names, locs))]
    # uses only once the op is whole: an op that failed to build leaves its operands untouched
    for v in op.operands:
        v.uses.append(op)
    return op


def infer_result_types(op: Operation, types: Sequence[TensorType | None] | None = None) -> list[TensorType]:
    """The result types `op`'s shape rule gives for `types` (default: its operands' types).

    Raises ShapeError naming the op and the operand types when the rule rejects them.
    """
    types = [v.type for v in op.operands] if types is None else list(types)
    for i, t in enumerate(types):
        if t is None:
            raise ShapeError(f"{op.name}: operand {i} has no type yet (run infer-shapes first)")
    try:
        inferred = op.infer(*types)
    except ShapeError as e:
        on = f" on {', '.join(str(t) for t in types)}" if types else ""
        raise ShapeError(f"{op.name} does not type-check{on}: {e}") from None
    return list(inferred) if isinstance(inferred, tuple) else [inferred]


def clone_op(op: Operation, operands: list[Value], mapping: dict[int, Value]) -> Operation:
    """A copy of `op` on new operands, with new results; `mapping` gets old result id -> new result."""
    new = create_op(op.name, operands, [r.type for r in op.results], op.attributes, op.loc,
                    [r.name for r in op.results], result_locs=[r.loc for r in op.results], attr_locs=op.attr_locs,
                    op_class=type(op))
    for r, nr in zip(op.results, new.results):
        mapping[id(r)] = nr
    return new


def clone_graph(graph: Graph) -> Graph:
    """A copy of a graph with new values and ops (attribute dictionaries copied, their values shared)."""
    mapping: dict[int, Value] = {}
    args = []
    for i, a in enumerate(graph.args):
        mapping[id(a)] = Value(a.type, a.name, None, i, a.loc)
        args.append(mapping[id(a)])
    ops = [clone_op(op, [mapping[id(v)] for v in op.operands], mapping) for op in graph.ops]
    return Graph(graph.name, args, list(graph.result_types), ops, dict(graph.attributes), graph.loc, kind=graph.kind)


class Builder:
    """Creates ops in one graph at an insertion point: its end (the default), or before an anchor op.

    Names given to `argument`, `constant`, `resource` and `create(hint=...)` are made unique in
    the graph ("x", "x_1", ...); `create(result_names=...)` sets names exactly.
    """

    # what a value name may not hold (the grammar's VALUE_ID); each such character becomes '_'
    NAME_CHARS = re.compile(r"[^A-Za-z0-9_$.\-]")

    def __init__(self, graph: Graph | None = None, *, loc: Location = UNKNOWN) -> None:
        """Build into `graph`, or into a new empty `ge.graph @main`; ops get `loc` unless told otherwise."""
        self.graph = graph if graph is not None else Graph("main", [], [])
        self.loc = loc
        self.anchor: Operation | None = None  # new ops go just before it; None: at the end
        # names in use, collected from the graph on the first request for a fresh one (a Rewriter makes a
        # builder per visited op and rarely names anything: it must not pay for a scan of the graph)
        self._taken: set[str] | None = None

    # --- the insertion point -----------------------------------------------------------------------
    def set_insertion_point_to_end(self) -> None:
        """New ops go at the end of the graph."""
        self.anchor = None

    def set_insertion_point_before(self, op: Operation) -> None:
        """New ops go just before `op`, in the order they are made."""
        self.anchor = op

    def insert(self, op: Operation) -> Operation:
        """Place an op built by `create_op` (or `clone_op`) at the insertion point."""
        if self.anchor is None:
            self.graph.append(op)
        else:
            self.graph.insert_before(self.anchor, op)
        if self._taken is not None:
            self._taken.update(r.name for r in op.results if r.name)
        return op

    # --- names -------------------------------------------------------------------------------------
    def fresh_name(self, hint: str) -> str:
        """A value name not used in the graph yet: `hint` with odd characters replaced, suffixed if taken."""
        if self._taken is None:
            self._taken = {a.name for a in self.graph.args if a.name}
            self._taken.update(r.name for op in self.graph.ops for r in op.results if r.name)
        base = self.NAME_CHARS.sub("_", hint) or "v"
        name, i = base, 1
        while name in self._taken:
            name, i = f"{base}_{i}", i + 1
        self._taken.add(name)
        return name

    # --- values and ops ----------------------------------------------------------------------------
    def argument(self, type: TensorType, name: str | None = None, *, loc: Location | None = None) -> Value:
        """A new graph argument of `type`, added after the others."""
        v = Value(type, self.fresh_name(name) if name else None, None, len(self.graph.args),
                  self.loc if loc is None else loc)
        self.graph.args.append(v)
        return v

    def create(self, name: str, operands: Sequence[Value] = (), attributes: dict[str, Any] | None = None,
               result_types: Sequence[TensorType] | None = None, *, loc: Location | None = None,
               hint: str | None = None, result_names: Sequence[str | None] | None = None) -> Operation:
        """Op `name` at the insertion point; result types are inferred (ShapeError naming the op) when not given.

        Results are named from `hint` (one result: the hint, several: hint_0, hint_1, ...), or exactly
        `result_names`, or left unnamed (printed with numbers).
        """
        if hint is not None and result_names is not None:
            raise ValueError("give a name hint or exact result names, not both")
        op = create_op(name, operands, result_types, attributes, self.loc if loc is None else loc, result_names)
        if hint is not None:
            many = len(op.results) != 1
            for i, r in enumerate(op.results):
                r.name = self.fresh_name(f"{hint}_{i}" if many else hint)
        return self.insert(op)

    def constant(self, value: Any, type: TensorType | DType | None = None, *, name: str | None = None,
                 loc: Location | None = None) -> Value:
        """A `ge.const` holding a dense literal: an array (or array-like) or a DenseAttr.

        `type` is the result type, or a dtype for the array's shape, or left out for the array's own
        shape and dtype; a rank-0 literal (a splat) fills a result type of any shape.
        """
        attr = value if isinstance(value, DenseAttr) else DenseAttr(np.asarray(value))
        if not isinstance(type, TensorType):
            shape = tuple(int(d) for d in attr.values.shape)
            try:
                dtype = type if type is not None else DType.from_numpy(attr.values.dtype)
            except KeyError:
                raise ValueError(f"GEIR has no dtype for {attr.values.dtype} literals: give the constant's "
                                 f"type or dtype") from None
            type = TensorType(shape, dtype)
        return self._const(attr, type, name, loc)

    def resource(self, key: str, type: TensorType, *, name: str | None = None, loc: Location | None = None) -> Value:
        """A `ge.const` of `dense_resource<"key">`: array `key` of the weights archive, of type `type`."""
        return self._const(DenseResourceAttr(key), type, name, loc)

    def _const(self, attr: DenseAttr | DenseResourceAttr, type: TensorType, name: str | None,
               loc: Location | None) -> Value:
        """The result of a new `ge.const` of `attr`."""
        return self.create("ge.const", [], {"value": attr}, [type], loc=loc, hint=name).result

    def finish(self, results: Sequence[Value], *, loc: Location | None = None) -> Graph:
        """End the graph with its return of `results` (at the end, whatever the insertion point) and
        make their types the graph's result types; returns the graph."""
        self.set_insertion_point_to_end()
        self.create(self.graph.terminator_name, results, result_types=[], loc=loc)
        self.graph.result_types = [v.type for v in results]
        return self.graph
