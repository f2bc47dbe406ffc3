"""The IR's data structures: values, operations, graphs and modules, with use lists."""

from __future__ import annotations

from typing import Any, ClassVar, Iterator

import attrs

from geir.diagnostics import UNKNOWN, Location
from geir.types import TensorType


@attrs.define(eq=False, slots=True)
class Value:
    """An SSA value: a graph argument (owner None) or result `index` of operation `owner`."""

    type: TensorType | None
    name: str | None = None
    owner: "Operation | None" = None
    index: int = 0
    loc: Location = UNKNOWN
    uses: list["Operation"] = attrs.field(factory=list, repr=False)

    def __repr__(self) -> str:
        return f"%{self.name or '?'}: {self.type}"

    @property
    def has_uses(self) -> bool:
        return bool(self.uses)

    def users(self) -> list["Operation"]:
        """Distinct operations that use this value, in first-use order."""
        return list(dict.fromkeys(self.uses))

    def has_other_users(self, op: "Operation") -> bool:
        """True when something besides `op` uses this value."""
        return any(u is not op for u in self.uses)

    def replace_all_uses_with(self, new: "Value") -> None:
        """Point every use of this value at `new` instead."""
        if new is self:
            return
        for user in self.users():
            user.operands = [new if v is self else v for v in user.operands]
            for _ in range(user.operands.count(new)):
                new.uses.append(user)
        self.uses.clear()


@attrs.define(eq=False, slots=True)
class Operation:
    """One operation: `%r... = name %operands... {attributes} : result types`.

    Each op kind is a subclass registered with `geir.opdef.op`; its class variables describe
    its operands and attributes, and its methods hold its checks, shape rule and semantics.
    Ops are made by `geir.builder.create_op` (or a Builder), which allocates the results and
    registers the uses; calling the class directly makes neither.
    """

    # operand names; "x+" takes one or more, "x*" any number, "mask?" may be left out
    OPERAND_NAMES: ClassVar[tuple[str, ...]] = ()
    # how many results; None when an attribute decides (split)
    NUM_RESULTS: ClassVar[int | None] = 1
    # attribute specs by name, collected from the class's `Attr` fields
    ATTRS: ClassVar[dict[str, Any]] = {}
    # trait classes (geir.traits); `geir.opdef.op` adds those of the bases
    TRAITS: ClassVar[tuple[type, ...]] = ()

    name: str
    operands: list[Value]
    results: list[Value]
    attributes: dict[str, Any]
    loc: Location = UNKNOWN
    # where each attribute was written, for diagnostics that point at it (None for built ops)
    attr_locs: dict[str, Location] | None = None
    erased: bool = False

    @property
    def result(self) -> Value:
        """The only result (asserts there is exactly one)."""
        assert len(self.results) == 1, f"{self.name} has {len(self.results)} results"
        return self.results[0]

    def attr(self, key: str) -> Any:
        """The attribute's value, or its declared default when absent."""
        if key in self.attributes:
            return self.attributes[key]
        spec = self.ATTRS.get(key)
        return None if spec is None else spec.default_value

    @classmethod
    def has_trait(cls, trait: type) -> bool:
        """Whether this op kind has `trait` (a class from geir.traits); works on an op or its class."""
        return trait in cls.TRAITS

    # --- hooks each op kind overrides -------------------------------------------------------
    def verify(self) -> str | None:
        """Op-specific checks beyond operand counts and attribute kinds: a reason, or None."""
        return None

    def infer(self, *types: TensorType) -> TensorType | tuple[TensorType, ...]:
        """Result type(s) from operand types; raises ShapeError when they are incompatible."""
        raise NotImplementedError(f"{self.name} has no shape rule")

    def compute(self, *args: Any) -> Any:
        """The op's numpy semantics: arrays in, array (or tuple of arrays) out."""
        raise NotImplementedError(f"{self.name} has no reference semantics")

    def attr_loc(self, key: str) -> Location:
        """Where an attribute was written, else the op's own location."""
        if self.attr_locs and key in self.attr_locs:
            return self.attr_locs[key]
        return self.loc

    def producer(self, i: int) -> "Operation | None":
        """The operation defining operand i (None for a graph argument)."""
        return self.operands[i].owner

    def set_operand(self, i: int, v: Value) -> None:
        old = self.operands[i]
        old.uses.remove(self)
        self.operands[i] = v
        v.uses.append(self)

    def insert_operand(self, i: int, v: Value) -> None:
        """Give the op `v` as its operand i, the later ones moving up one (an optional operand added)."""
        self.operands.insert(i, v)
        v.uses.append(self)

    def drop_operand_uses(self) -> None:
        """Forget this op's uses of its operands (before erasing it)."""
        for v in self.operands:
            try:
                v.uses.remove(self)
            except ValueError:
                pass

    def __str__(self) -> str:
        """The op's IR text, as MLIR's bindings print an operation."""
        from geir.printer import print_op  # the printer imports this module

        return print_op(self)

    def __repr__(self) -> str:
        return f"<{self.name} at {self.loc}>"


@attrs.define(eq=False)
class Graph:
    """`ge.graph @name(args) -> results { ops }`; the last op is `ge.return` (`rt.return` in an rt.program).

    Insertions and erasures are recorded and applied in one linear pass the next time the op
    list is read, so rewriting many ops in a large graph stays linear.
    """

    name: str
    args: list[Value]
    result_types: list[TensorType]
    _ops: list[Operation] = attrs.field(factory=list, alias="ops")
    attributes: dict[str, Any] = attrs.field(factory=dict)
    loc: Location = UNKNOWN
    # "ge.graph", or "rt.program" for a lowered task-stream program
    kind: str = attrs.field(default="ge.graph", kw_only=True)
    # where each graph attribute was written, for diagnostics that point at it (None for built graphs)
    attr_locs: dict[str, Location] | None = attrs.field(default=None, kw_only=True)
    _inserts: dict[int, list[Operation]] = attrs.field(factory=dict, alias="_inserts", repr=False)
    _dirty: bool = attrs.field(default=False, alias="_dirty", repr=False)

    @property
    def ops(self) -> list[Operation]:
        if self._dirty:
            self._compact()
        return self._ops

    @ops.setter
    def ops(self, ops: list[Operation]) -> None:
        self._ops = ops
        self._inserts.clear()
        self._dirty = False

    def attr_loc(self, key: str) -> Location:
        """Where a graph attribute was written, else the graph's own location."""
        if self.attr_locs and key in self.attr_locs:
            return self.attr_locs[key]
        return self.loc

    def append(self, op: Operation) -> None:
        self.ops.append(op)

    def insert_before(self, anchor: Operation, op: Operation) -> None:
        """Place `op` just before `anchor` (applied lazily)."""
        self._inserts.setdefault(id(anchor), []).append(op)
        self._dirty = True

    def erase(self, op: Operation) -> None:
        """Remove an op whose results are unused (applied lazily)."""
        assert not any(r.uses for r in op.results), f"erasing {op} whose results are still used"
        op.drop_operand_uses()
        op.erased = True
        self._dirty = True

    def _compact(self) -> None:
        out: list[Operation] = []
        inserts = self._inserts
        # each op after the ops inserted before it (those after theirs, and so on): a stack, not recursion, as
        # inserts may nest as deep as a rewrite chains them
        stack: list[tuple[Operation, bool]] = [(op, False) for op in reversed(self._ops)]
        while stack:
            op, expanded = stack.pop()
            if expanded:
                if not op.erased:
                    out.append(op)
                continue
            stack.append((op, True))
            stack += [(new, False) for new in reversed(inserts.pop(id(op), ()))]
        self._ops = out
        self._dirty = False

    def walk(self, name: str | None = None) -> Iterator[Operation]:
        """The live ops in order, optionally only those called `name`."""
        for op in list(self.ops):
            if not op.erased and (name is None or op.name == name):
                yield op

    def __str__(self) -> str:
        """The graph's IR text (what `print_graph` writes), as MLIR's and xDSL's bindings print IR."""
        from geir.printer import print_graph  # the printer imports this module

        return print_graph(self)

    def __repr__(self) -> str:
        # short on purpose: attrs' generated repr would dump every op and every weight array
        return f"<{self.kind} @{self.name}: {_count(len(self.args), 'arg')}, {_count(len(self.ops), 'op')}>"

    @property
    def terminator(self) -> Operation:
        return self.ops[-1]

    @property
    def terminator_name(self) -> str:
        """The op that must end this graph: ge.return, or rt.return in a task-stream program."""
        return "rt.return" if self.kind == "rt.program" else "ge.return"


@attrs.define(eq=False)
class Module:
    """A parsed file: its graphs, and the weights archive that `dense_resource` refers to."""

    graphs: list[Graph] = attrs.field(factory=list)
    file: str = "<stdin>"
    resources: dict[str, Any] = attrs.field(factory=dict)

    def graph(self, name: str | None = None) -> Graph:
        """The graph tools run: `name`, else `@main`, else the only graph (KeyError if ambiguous)."""
        by_name = {g.name: g for g in self.graphs}
        if name is not None:
            return by_name[name]
        if "main" in by_name:
            return by_name["main"]
        if len(self.graphs) == 1:
            return self.graphs[0]
        raise KeyError("main")

    def __str__(self) -> str:
        """The module's IR text (what `print_module` writes), as MLIR's and xDSL's bindings print IR."""
        from geir.printer import print_module  # the printer imports this module

        return print_module(self)

    def __repr__(self) -> str:
        # names and counts only, never the weight arrays in `resources`
        names = ", ".join(f"@{g.name}" for g in self.graphs[:4]) + (", ..." if len(self.graphs) > 4 else "")
        parts = [_count(sum(len(g.ops) for g in self.graphs), "op")]
        if len(self.graphs) != 1:
            parts.insert(0, _count(len(self.graphs), "graph"))
        if self.resources:
            parts.append(_count(len(self.resources), "resource"))
        return f"<Module {names or '(empty)'}: {', '.join(parts)}>"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"

