"""What an ONNX op converter sees: the node with its decoded attributes and opset, and the registry of converters."""

from __future__ import annotations

import functools
from typing import Any, Callable

import attrs
import numpy as np
import onnx
from onnx import helper, numpy_helper

from geir.frontends.onnx_values import GraphBuilder, ImportProblem, Tensor


@attrs.define(eq=False)
class Node:
    """One ONNX node being converted, at the opset version its domain is imported with."""

    proto: onnx.NodeProto
    opset: int

    @property
    def op_type(self) -> str:
        return self.proto.op_type

    @property
    def outputs(self) -> list[str]:
        return list(self.proto.output)

    def wants(self, i: int) -> bool:
        """Whether the model uses output i (it is listed and not left empty)."""
        return i < len(self.proto.output) and bool(self.proto.output[i])

    def attr(self, name: str, default: Any = None) -> Any:
        """An attribute's value (strings decoded, tensors as arrays), or `default` when absent.

        ImportProblem when it is not of the type the op's schema gives it (say, a list where an int goes), or
        when the schema requires it and it is absent.
        """
        schema = _schema_attributes(self.proto.op_type, self.opset, self.proto.domain)
        expected, required = schema.get(name, (None, False))
        for a in self.proto.attribute:
            if a.name == name:
                if expected is not None and a.type != expected:
                    raise ImportProblem(f"attribute '{name}' is {_type_words(a.type)}, but {self.op_type} takes "
                                        f"{_type_words(expected)} there", unsupported=False)
                return decode_attribute(a)
        if required and default is None:
            raise ImportProblem(f"attribute '{name}' is missing, and {self.op_type} requires it", unsupported=False)
        return default

    def has_attr(self, name: str) -> bool:
        return any(a.name == name for a in self.proto.attribute)


@functools.lru_cache(maxsize=None)
def _schema_attributes(op_type: str, opset: int, domain: str) -> dict[str, tuple[int, bool]]:
    """(AttributeProto type, required) of each attribute the op's schema declares at this opset (empty: no schema)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        try:  # an op used at an opset before the one that introduced it: its types are still its schema's
            schema = onnx.defs.get_schema(op_type, domain)
        except onnx.defs.SchemaError:
            return {}
    return {name: (int(spec.type), spec.required) for name, spec in schema.attributes.items()}


def _type_words(code: int) -> str:
    """An AttributeProto type in words: 'INTS' as 'a list of ints'."""
    name = onnx.AttributeProto.AttributeType.Name(code) if code in onnx.AttributeProto.AttributeType.values() else ""
    if not name or name == "UNDEFINED":
        return "of no type"
    if name.endswith("S"):
        return f"a list of {name[:-1].lower()}s"
    return f"an {name.lower()}" if name[0] in "IA" else f"a {name.lower()}"


def decode_attribute(a: onnx.AttributeProto) -> Any:
    """A Python value for an attribute: numbers, lists, str, or numpy arrays for tensors."""
    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        raise ImportProblem(f"attribute '{a.name}' holds a subgraph, which GEIR graphs cannot express")
    try:
        value = helper.get_attribute_value(a)
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
    except Exception as e:  # noqa: BLE001 - no type, or a tensor whose data does not match its dims
        raise ImportProblem(f"attribute '{a.name}' cannot be read: {type(e).__name__}: {e}",
                            unsupported=False) from None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", errors="replace") for v in value]
    return value


class UseFunctionBody(ImportProblem):
    """Raised by a converter for a form of its op it does not map: the importer takes ONNX's function body."""


# A converter turns one node into GEIR ops: (builder, node, inputs with None for absent ones)
# -> one Tensor per node output (None for outputs the model leaves out).
Converter = Callable[[GraphBuilder, Node, list[Tensor | None]], list[Tensor | None]]
CONVERTERS: dict[str, Converter] = {}


def converter(*op_types: str) -> Callable[[Converter], Converter]:
    """Register a converter for ops of the default ONNX domain."""

    def register(fn: Converter) -> Converter:
        for t in op_types:
            CONVERTERS[t] = fn
        return fn

    return register


# how a value the conversion needs now but the model computes at run time is reported
RUN_TIME_VALUE = "is computed at run time; GEIR needs it known at import time"


def constant(t: Tensor | None, what: str) -> np.ndarray:
    """The value of an input the conversion needs at import time (a shape, axes, sizes)."""
    if t is None:
        raise ImportProblem(f"{what} is missing", unsupported=False)
    if not t.is_const:
        raise ImportProblem(f"{what} {RUN_TIME_VALUE}")
    return t.array


def int_list(t: Tensor | None, what: str) -> list[int]:
    """An import-time integer vector input (axes, shape, sizes) as a list."""
    array = np.asarray(constant(t, what))
    if array.dtype.kind not in "iu":  # ONNX types these int64 (or int32): a float or complex one is no count
        raise ImportProblem(f"{what} must be integers, not {array.dtype.name}", unsupported=False)
    return [int(x) for x in array.reshape(-1)]


def required(xs: list[Tensor | None], i: int, what: str) -> Tensor:
    """Input i, which the op cannot do without."""
    if i >= len(xs) or xs[i] is None:
        raise ImportProblem(f"the {what} input is missing", unsupported=False)
    return xs[i]


def optional(xs: list[Tensor | None], i: int) -> Tensor | None:
    """Input i, or None when the node leaves it out."""
    return xs[i] if i < len(xs) else None
