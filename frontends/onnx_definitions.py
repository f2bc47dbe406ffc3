"""ONNX's own definitions of a node: its reference implementation and its function body.

The importer evaluates a node whose inputs are all constants and that has no GEIR equivalent
(Shape arithmetic: Range, Gather on shapes, ConstantOfShape, Mod, ...) with `onnx.reference`, and
imports an op GEIR has no equivalent for through the function body ONNX defines it by (the same
primitive graph ONNX's `_expanded` node tests hold). Neither re-states an op's semantics.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import helper

_expansions = itertools.count()


def evaluate(node: onnx.NodeProto, inputs: list[np.ndarray | None], opsets: dict[str, int]) -> list[np.ndarray | None]:
    """Run one node on constant inputs with ONNX's reference implementation (at the model's opset)."""
    from onnx.reference import ReferenceEvaluator

    feeds = {name: a for name, a in zip(node.input, inputs) if name}
    graph_inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                    for name, a in feeds.items()]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
    graph = helper.make_graph([node], "constant", graph_inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    results = iter(ReferenceEvaluator(model).run(None, feeds))
    return [np.asarray(next(results)) if o else None for o in node.output]


def function_body(node: onnx.NodeProto, opsets: dict[str, int], input_types: list[onnx.TypeProto],
                  local_functions: dict[tuple[str, str], onnx.FunctionProto]
                  ) -> tuple[list[onnx.NodeProto], dict[str, int]] | None:
    """The nodes a function-defined op expands to (edges renamed into the node's graph) and their opsets.

    None when the op is not a function: neither local to the model nor given a body by its schema.
    """
    function = local_functions.get((node.domain, node.op_type))
    attributes = {a.name: a for a in node.attribute}
    if function is None:
        function = _schema_function(node, opsets, input_types, attributes)
        if function is None:
            return None
    else:
        for a in function.attribute_proto:  # defaults of a local function's attributes
            attributes.setdefault(a.name, a)
    body_opsets = dict(opsets)
    body_opsets.update({o.domain: o.version for o in function.opset_import})
    return _instantiate(node, function, attributes), body_opsets


def _schema_function(node: onnx.NodeProto, opsets: dict[str, int], input_types: list[onnx.TypeProto],
                     attributes: dict[str, onnx.AttributeProto]) -> onnx.FunctionProto | None:
    version = opsets.get(node.domain, opsets.get("ai.onnx" if node.domain == "" else node.domain))
    try:
        schema = onnx.defs.get_schema(node.op_type, version, node.domain) if version is not None else None
    except onnx.defs.SchemaError:
        return None
    if schema is None:
        return None
    for name, spec in schema.attributes.items():
        if name not in attributes and spec.default_value.name:
            attributes[name] = spec.default_value
    function = onnx.FunctionProto()
    if schema.has_function:
        function.ParseFromString(schema.get_function_with_opset_version(_pick(schema.function_opset_versions, version)))
        return function
    if schema.has_context_dependent_function:
        complete = onnx.NodeProto()
        complete.CopyFrom(node)
        del complete.attribute[:]
        complete.attribute.extend(attributes.values())
        text = schema.get_context_dependent_function_with_opset_version(
            _pick(schema.context_dependent_function_opset_versions, version), complete.SerializeToString(),
            [t.SerializeToString() for t in input_types])
        if not text:
            return None
        function.ParseFromString(text)
        return function
    return None


def _pick(versions: list[int], opset: int) -> int:
    """The newest function body at or below the model's opset (else the oldest there is)."""
    fitting = [v for v in versions if v <= opset]
    return max(fitting) if fitting else min(versions)


def _instantiate(node: onnx.NodeProto, function: onnx.FunctionProto,
                 attributes: dict[str, onnx.AttributeProto]) -> list[onnx.NodeProto]:
    """The function's nodes with its formal inputs and outputs bound to the node's, the rest made unique."""
    prefix = f"{node.name or node.op_type}.{next(_expansions)}."
    # formal inputs the node leaves out are absent ("") inside the body, as ONNX binds them
    names = {formal: (node.input[i] if i < len(node.input) else "") for i, formal in enumerate(function.input)}
    names.update({formal: actual for formal, actual in zip(function.output, node.output) if actual})

    def rename(name: str) -> str:
        if not name:
            return ""
        return names.get(name, prefix + name)

    out = []
    for inner in function.node:
        new = onnx.NodeProto()
        new.CopyFrom(inner)
        new.name = prefix + (inner.name or inner.op_type)
        del new.input[:]
        new.input.extend(rename(n) for n in inner.input)
        del new.output[:]
        new.output.extend(rename(n) for n in inner.output)
        del new.attribute[:]
        for a in inner.attribute:
            if a.ref_attr_name:
                if a.ref_attr_name in attributes:
                    bound = onnx.AttributeProto()
                    bound.CopyFrom(attributes[a.ref_attr_name])
                    bound.name = a.name
                    new.attribute.append(bound)
            else:
                new.attribute.append(a)
        out.append(new)
    return out
