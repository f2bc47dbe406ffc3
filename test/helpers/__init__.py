"""Shared helpers for the GEIR unit tests (graph text builders, structural comparison)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from geir.attributes import DenseAttr, DenseResourceAttr
from geir.ir import Graph, Module
from geir.types import DType


def graph_text(body: str, args: str = "%x: tensor<4xf32>", results: str = "tensor<4xf32>", name: str = "main") -> str:
    """A one-graph module: `body` is the op lines (without the closing brace)."""
    body = body.strip("\n")
    return f"ge.graph @{name}({args}) -> {results} {{\n{body}\n}}\n"


def _float_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", v))[0] if v == v else -1  # every NaN compares equal


def _array_sig(a: np.ndarray) -> tuple:
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return ("b", a.shape, tuple(a.ravel().tolist()))
    if a.dtype.kind in "iu":
        return ("i", a.shape, tuple(int(x) for x in a.ravel()))
    f = a.astype(np.float64)
    return ("f", a.shape, tuple(_float_bits(float(x)) for x in f.ravel()))


def attr_sig(v: Any) -> Any:
    """A comparable description of an attribute value (floats by bits, so -0.0 != 0.0 and NaN == NaN)."""
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, int):
        return ("int", v)
    if isinstance(v, float):
        return ("float", _float_bits(v))
    if isinstance(v, str):
        return ("str", v)
    if isinstance(v, DType):
        return ("dtype", v.value)
    if isinstance(v, list):
        return ("list", tuple(attr_sig(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, attr_sig(x)) for k, x in v.items()))
    if isinstance(v, DenseAttr):
        return ("dense", _array_sig(v.values))
    if isinstance(v, DenseResourceAttr):
        return ("resource", v.key)
    raise TypeError(f"unexpected attribute value {v!r}")


def graph_sig(g: Graph, value_names: bool = True) -> tuple:
    """Everything that makes a graph what it is, independent of object identity.

    Values are referred to by their definition site; constants by the array they stand for
    (a literal written out in full and the same literal printed as a splat are the same constant).
    `value_names=False` leaves the ops' result names out (two builds that name their values apart).
    """
    where: dict[int, tuple] = {}
    for i, a in enumerate(g.args):
        where[id(a)] = ("arg", i)
    ops = []
    for k, op in enumerate(g.ops):
        operands = tuple(where[id(v)] for v in op.operands)
        attrs = {}
        for key, val in op.attributes.items():
            if op.name == "ge.const" and key == "value" and isinstance(val, DenseAttr) and op.results[0].type:
                with np.errstate(over="ignore"):  # a literal too large for f16 becomes inf
                    attrs[key] = ("const", _array_sig(val.to_array(op.results[0].type)))
            else:
                attrs[key] = attr_sig(val)
        results = tuple((r.name if value_names else None, r.type) for r in op.results)
        ops.append((op.name, operands, tuple(sorted(attrs.items())), results))
        for j, r in enumerate(op.results):
            where[id(r)] = ("op", k, j)
    return (
        g.name,
        tuple((a.name, a.type) for a in g.args),
        tuple(g.result_types),
        attr_sig(g.attributes),
        tuple(ops),
    )


def module_sig(m: Module, value_names: bool = True) -> tuple:
    return tuple(graph_sig(g, value_names) for g in m.graphs)
