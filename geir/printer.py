"""Print IR in GEIR's one canonical form; printing what was parsed from it gives the same text."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from geir.attributes import DenseAttr, DenseResourceAttr, format_float
from geir.ir import Graph, Module, Operation, Value
from geir.types import DType, format_type

_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def print_module(module: Module) -> str:
    """The text of every graph in the module, separated by blank lines."""
    return "\n".join(print_graph(g) for g in module.graphs)


def print_graph(graph: Graph) -> str:
    """One graph: signature, its ops one per line, closing brace; ends with a newline."""
    names = _Namer(graph)
    args = ", ".join(f"%{names(a)}: {format_type(a.type)}" for a in graph.args)
    results = graph.result_types
    if len(results) == 1:
        sig = format_type(results[0])
    else:
        sig = "(" + ", ".join(format_type(t) for t in results) + ")"
    attrs = f" attributes {format_attr_dict(graph.attributes)}" if graph.attributes else ""
    lines = [f"{graph.kind} @{graph.name}({args}) -> {sig}{attrs} {{"]
    for op in graph.ops:
        lines.append("  " + print_op(op, names))
    lines.append("}")
    return "\n".join(lines) + "\n"


def print_op(op: Operation, names: "_Namer | None" = None) -> str:
    """One op in the uniform form `%r = dialect.op %a, %b dense<..> {attrs} : types`."""
    name_of = names or (lambda v: v.name or "?")
    parts = []
    if op.results:
        parts.append(", ".join("%" + name_of(r) for r in op.results) + " = ")
    parts.append(op.name)
    if op.operands:
        parts.append(" " + ", ".join("%" + name_of(v) for v in op.operands))
    attributes = op.attributes
    if op.name in ("ge.const", "rt.const") and "value" in attributes:
        parts.append(" " + format_attr(attributes["value"]))
        attributes = {k: v for k, v in attributes.items() if k != "value"}
    if attributes:
        parts.append(" " + format_attr_dict(attributes, sort=True))
    types = [r.type for r in op.results]
    if types and all(t is not None for t in types):
        parts.append(" : " + ", ".join(format_type(t) for t in types))
    return "".join(parts)


class _Namer:
    """Names values as the source did; values that passes created get fresh numbers."""

    def __init__(self, graph: Graph):
        self.taken = {a.name for a in graph.args if a.name}
        for op in graph.ops:
            for r in op.results:
                if r.name:
                    self.taken.add(r.name)
        self.fresh: dict[int, str] = {}
        self.counter = 0

    def __call__(self, v: Value) -> str:
        if v.name:
            return v.name
        name = self.fresh.get(id(v))
        if name is None:
            while str(self.counter) in self.taken:
                self.counter += 1
            name = str(self.counter)
            self.taken.add(name)
            self.fresh[id(v)] = name
        return name


def format_attr_dict(attributes: dict[str, Any], sort: bool = False) -> str:
    """`{k = v, ...}`; op-level dictionaries print sorted by key, nested ones in their own order."""
    items = sorted(attributes.items()) if sort else attributes.items()
    return "{" + ", ".join(f"{_key(k)} = {format_attr(v)}" for k, v in items) + "}"


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def format_attr(v: Any) -> str:
    """The canonical text of an attribute value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return format_float(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, DType):
        return v.value
    if isinstance(v, list):
        return "[" + ", ".join(format_attr(x) for x in v) + "]"
    if isinstance(v, dict):
        return format_attr_dict(v)
    if isinstance(v, DenseAttr):
        return f"dense<{format_dense(v.values)}>"
    if isinstance(v, DenseResourceAttr):
        return f"dense_resource<{json.dumps(v.key)}>"
    raise TypeError(f"cannot print attribute value {v!r}")


def format_dense(values: np.ndarray) -> str:
    """Elements of a dense literal; an array whose elements are all equal prints as one splat."""
    fmt = _element_formatter(values.dtype)
    if values.ndim == 0:
        return fmt(values[()])
    # flat: numpy cannot index or compare an array of more than 32 dimensions element by element
    flat = values.reshape(-1)
    if flat.size and _all_equal(flat):
        return fmt(flat[0])
    return _nested(values, fmt)


def _all_equal(flat: np.ndarray) -> bool:
    if flat.dtype.kind in "biu":
        return bool(np.all(flat == flat[0]))
    # floats by bit pattern: 0.0 and -0.0 are different constants, and equal NaNs are one splat
    bits = flat.view(f"u{flat.dtype.itemsize}")
    return bool(np.all(bits == bits[0]))


def _nested(values: np.ndarray, fmt) -> str:
    if values.ndim == 1:
        return "[" + ", ".join(fmt(x) for x in values) + "]"
    return "[" + ", ".join(_nested(x, fmt) for x in values) + "]"


def _element_formatter(dtype: np.dtype):
    if dtype == np.bool_:
        return lambda x: "true" if x else "false"
    if dtype.kind in "iu":
        return lambda x: str(int(x))
    if dtype == np.float64:
        return lambda x: format_float(float(x))
    narrow_type = dtype.type

    def narrow(x) -> str:
        # the shortest decimal that rounds back to this element in its own precision (f16, bf16, f32)
        f = float(x)
        if not np.isfinite(f):
            return format_float(f)
        if f.is_integer() and abs(f) < 1e16:
            return f"{f:.1f}"  # keeps the sign of -0.0
        with np.errstate(over="ignore"):
            for digits in range(1, 10):
                s = f"{f:.{digits}g}"
                if narrow_type(float(s)) == x:
                    break
        if "e" not in s and "." not in s and "n" not in s:
            s += ".0"
        return s

    return narrow
