"""Check that IR is well formed: op structure, attribute kinds, shape rules, returns.

The same walk infers result types: `infer-shapes` runs it with `fill_types=True`.
"""

from __future__ import annotations

from typing import Callable

from geir.diagnostics import Diagnostic, DiagnosticError, Location
from geir.ir import Graph, Module, Operation, Value
from geir.opdef import PASS_ATTRIBUTES, ShapeError, operand_count_error
from geir.types import TensorType, format_type, types_compatible

Emit = Callable[[Diagnostic], None]


def verify_module(module: Module, emit: Emit | None = None, fill_types: bool = False) -> bool:
    """Verify every graph; each problem goes to `emit` (default: raise the first). True when clean."""
    ok = True
    for g in module.graphs:
        ok &= verify_graph(g, emit, fill_types)
    return ok


def infer_types_again(graph: Graph) -> None:
    """Every result's type but a constant's inferred again from the arguments' types (after they changed), the
    graph's result types with them; DiagnosticError where the new types do not type-check."""
    for op in graph.ops:
        if op.name != "ge.const":
            for r in op.results:
                r.type = None
    verify_graph(graph, None, fill_types=True)
    graph.result_types = [v.type for v in graph.terminator.operands]


def verify_graph(graph: Graph, emit: Emit | None = None, fill_types: bool = False,
                 known: dict[int, TensorType] | None = None) -> bool:
    """Verify one graph, reporting every bad op; with fill_types, set result types that were missing.

    `known`, when given, receives the inferred type of every result whose type is missing (by id).
    """
    errors: list[Diagnostic] = []

    def report(message: str, loc: Location) -> None:
        d = Diagnostic("error", message, loc)
        if emit is None:
            raise DiagnosticError(d)
        errors.append(d)
        emit(d)

    # types known for values whose printed type is missing (inferred along the way)
    known = {} if known is None else known

    def type_of(v: Value) -> TensorType | None:
        return v.type if v.type is not None else known.get(id(v))

    for a in graph.args:
        _check_size(a.type, a.loc, report)
    target = graph.attributes.get("target")
    if graph.kind == "rt.program" and target is not None and not (isinstance(target, str) and target.strip()):
        report(f"rt.program @{graph.name}: 'target' names the chip it was lowered for, a string such as "
               f"\"ascend910b\" or \"ascend910b[separate_cube_vector=0]\", not {target!r}", graph.attr_loc("target"))
    ops = graph.ops
    end = graph.terminator_name
    if not ops or ops[-1].name != end:
        report(f"graph '@{graph.name}' must end with {end}", (ops[-1].loc if ops else graph.loc))
    dialect = graph.kind.split(".")[0] + "."
    for op in ops:
        if op.name == end and op is not ops[-1]:
            report(f"{end} must be the last op of its graph", op.loc)
        if not op.name.startswith(dialect):
            report(f"{op.name} cannot appear in a {graph.kind} (only {dialect} ops)", op.loc)
            continue
        problem = _structure_problem(op)
        if problem is not None:
            message, loc = problem
            report(message, loc)
            continue
        types = [type_of(v) for v in op.operands]
        if any(t is None for t in types):
            continue  # an operand's type is unknown after an earlier error: do not cascade
        try:
            inferred = op.infer(*types)
        except ShapeError as e:
            report(str(e), op.loc)
            continue
        if op.name == end:
            _check_return(graph, op, types, report)
            continue
        inferred = list(inferred) if isinstance(inferred, tuple) else [inferred]
        for r, t in zip(op.results, inferred):
            _check_size(r.type if r.type is not None else t, r.loc, report)
            if r.type is None:
                if t is not None:
                    known[id(r)] = t
                    if fill_types:
                        r.type = t
            elif t is not None and not (types_compatible(r.type, t) and _format_ok(op, r.type, t)):
                report(f"result type {format_type(r.type)} contradicts the inferred type {format_type(t)}", r.loc)
    return not errors


# The largest tensor GEIR models: 2^48 bytes (256 TiB), beyond any device's memory, so that sizes,
# offsets and sums of them stay exact in 64-bit integers; and numpy's limit of 64 dimensions.
MAX_TENSOR_BYTES = 1 << 48
MAX_RANK = 64


def _check_size(t: TensorType | None, loc: Location, report) -> None:
    """Report a type GEIR cannot hold (see size_problem)."""
    problem = size_problem(t) if t is not None else None
    if problem is not None:
        report(problem, loc)


def size_problem(t: TensorType) -> str | None:
    """Why GEIR cannot hold a tensor of type `t` (more dimensions than numpy has, more bytes than any device)."""
    if t.rank > MAX_RANK:
        return f"a tensor of rank {t.rank}: at most {MAX_RANK} dimensions are supported"
    nbytes = t.nbytes
    if nbytes is not None and nbytes > MAX_TENSOR_BYTES:
        return f"{format_type(t)} holds {nbytes} bytes, more than the {MAX_TENSOR_BYTES} (256 TiB) a tensor may hold"
    return None


def _format_ok(op: Operation, declared: TensorType, inferred: TensorType) -> bool:
    # storage formats are the layout pass's choice; only trans_data promises one
    return op.name != "ge.trans_data" or declared.format == inferred.format


def structure_problem(op: Operation) -> tuple[str, Location] | None:
    """Why an op is malformed (operand or result count, an attribute, its own checks) and where, or None."""
    return _structure_problem(op)


def _structure_problem(op: Operation) -> tuple[str, Location] | None:
    """Operand and result counts, attributes present and of the right kind, the op's own checks."""
    cls = type(op)
    if getattr(cls, "NAME", None) != op.name:
        return f"unknown op '{op.name}'", op.loc
    count = operand_count_error(cls, len(op.operands))
    if count is not None:
        return f"{op.name} {count}", op.loc
    if cls.NUM_RESULTS is not None and len(op.results) != cls.NUM_RESULTS:
        return f"{op.name} produces {cls.NUM_RESULTS} results, not {len(op.results)}", op.loc
    for key, spec in cls.ATTRS.items():
        if key not in op.attributes:
            if spec.required:
                return f"{op.name} needs attribute '{key}'", op.loc
            continue
        why = spec.check(op.attributes[key])
        if why is not None:
            return why, op.attr_loc(key)
    for key in op.attributes:
        if key not in cls.ATTRS and key not in PASS_ATTRIBUTES:
            takes = ", ".join(cls.ATTRS) or "no attributes"
            return f"unknown attribute '{key}' for {op.name} (it takes {takes})", op.attr_loc(key)
    why = op.verify()
    if why is not None:
        return why, op.loc
    return None


def _check_return(graph: Graph, op: Operation, types: list[TensorType], report) -> None:
    want = graph.result_types
    if len(types) != len(want):
        report(f"{op.name} gives {len(types)} value{'s' * (len(types) != 1)} but graph '@{graph.name}' "
               f"returns {len(want)}", op.loc)
        return
    for i, (got, expected) in enumerate(zip(types, want)):
        if not types_compatible(got, expected):
            report(f"result {i} has type {format_type(got)} but graph '@{graph.name}' returns "
                   f"{format_type(expected)}", op.loc)


def inferred_types(graph: Graph) -> dict[int, TensorType]:
    """The inferred type of every result that has none written, by id(value); raises on bad IR."""
    known: dict[int, TensorType] = {}
    verify_graph(graph, None, False, known)
    return known
