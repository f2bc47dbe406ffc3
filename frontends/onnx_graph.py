"""The walk over an ONNX graph: inputs and initializers, each node converted in order, the outputs.

A node is converted by its GEIR converter when there is one; a node whose inputs are all known at
import time and that GEIR has no op for is evaluated by ONNX's reference implementation; an op
that ONNX defines by a function body (or a form of one the converter leaves to it) is imported
through that body; anything else is an unsupported op, reported with the node's name and type.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import helper, numpy_helper

import geir.frontends.onnx_attention  # noqa: F401  (registers the Attention converter)
import geir.frontends.onnx_ops  # noqa: F401  (registers the converters)
from geir.diagnostics import DiagnosticError
from geir.frontends.onnx import OnnxImportError
from geir.frontends.onnx_definitions import evaluate, function_body
from geir.frontends.onnx_node import CONVERTERS, Node, UseFunctionBody
from geir.frontends.onnx_values import GraphBuilder, ImportProblem, Tensor, dtype_of
from geir.ir import Graph, Module
from geir.types import TensorType
from geir.verifier import size_problem, verify_module

# function bodies inside function bodies: a deeper chain is refused (each level is a few Python frames)
MAX_FUNCTION_NESTING = 64


def _domain(d: str) -> str:
    return "" if d == "ai.onnx" else d


def supported_opsets() -> range:
    """The versions of the default ONNX domain the importer reads: those the installed onnx defines."""
    return range(1, onnx.defs.onnx_opset_version() + 1)


class OnnxGraphImporter:
    """Imports the main graph of one model into a `ge.graph`."""

    def __init__(self, model: onnx.ModelProto, source: str, graph_name: str, base_dir: str = ""):
        self.model = model
        self.source = source
        self.base_dir = base_dir
        self.opsets = {_domain(o.domain): o.version for o in model.opset_import}
        self.local_functions = {(f.domain, f.name): f for f in model.functions}
        self.graph = Graph(graph_name, [], [])
        self.b = GraphBuilder(self.graph)
        self.env: dict[str, Tensor] = {}
        self.count = 0
        # the function-defined ops being expanded, outermost first (a local function may not call itself)
        self.expanding: list[tuple[str, str]] = []

    def run(self) -> tuple[Module, dict[str, np.ndarray]]:
        g = self.model.graph
        check_text_fields(self.model)
        problem = _opset_problem(self.opsets, "the model", any(_domain(n.domain) == "" for n in g.node))
        if problem is not None:
            raise problem
        if g.sparse_initializer:
            raise OnnxImportError("sparse initializers are not supported", unsupported=True)
        for init in g.initializer:
            try:
                array = numpy_helper.to_array(init, self.base_dir)
            except Exception as e:  # noqa: BLE001 - a broken tensor (missing external data, bad sizes)
                raise OnnxImportError(f"initializer '{init.name}' cannot be read: {e}") from None
            self.env[init.name] = Tensor(array=array, name=init.name, initializer=True)
        for vi in g.input:
            if vi.name not in self.env:  # an input that is also an initializer is a constant with a default
                self.env[vi.name] = Tensor(value=self.b.argument(self._input_type(vi), vi.name), name=vi.name)
        for node in g.node:
            self._convert(node, self.opsets)
        results = []
        for out in g.output:
            if out.name not in self.env:
                raise OnnxImportError(f"graph output '{out.name}' is not computed by any node")
            t = self.env[out.name]
            try:
                value = self.b.value_of(t)
            except ImportProblem as e:
                raise OnnxImportError(f"graph output '{out.name}': {e}", unsupported=e.unsupported) from None
            self._check_declared(out, value.type)
            results.append(value)
        self.b.finish(results)
        self.b.remove_dead_ops()
        module = Module([self.graph], self.source, dict(self.b.resources))
        try:
            verify_module(module)
        except DiagnosticError as e:
            raise OnnxImportError(f"internal error: the imported graph does not verify: {e}") from None
        return module, dict(self.b.resources)

    # --- types ------------------------------------------------------------------------------------
    def _input_type(self, vi: onnx.ValueInfoProto) -> TensorType:
        if vi.type.WhichOneof("value") != "tensor_type":
            raise OnnxImportError(f"graph input '{vi.name}' is a {vi.type.WhichOneof('value') or 'value of no type'}, "
                                  f"not a tensor", unsupported=True)
        tt = vi.type.tensor_type
        try:
            dtype = dtype_of(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        except ImportProblem as e:
            raise OnnxImportError(f"graph input '{vi.name}': {e}", unsupported=True) from None
        except (KeyError, ValueError, TypeError):
            raise OnnxImportError(f"graph input '{vi.name}' has ONNX data type {tt.elem_type}, which GEIR has no "
                                  f"dtype for", unsupported=True) from None
        if not tt.HasField("shape"):
            raise OnnxImportError(f"graph input '{vi.name}' has no shape (its rank is unknown)", unsupported=True)
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
        for axis, d in enumerate(dims):
            if d is not None and d < 0:
                raise OnnxImportError(f"graph input '{vi.name}' has dimension {d} at axis {axis}; a dimension is "
                                      f"0 or more (or a dim_param for one known only at run time)")
        t = TensorType(dims, dtype)
        problem = size_problem(t)
        if problem is not None:
            raise OnnxImportError(f"graph input '{vi.name}': {problem}", unsupported=True)
        return t

    def _check_declared(self, out: onnx.ValueInfoProto, t: TensorType) -> None:
        """A declared output type must agree with what the graph computes."""
        if out.type.WhichOneof("value") != "tensor_type":
            return
        tt = out.type.tensor_type
        if tt.elem_type:
            try:
                declared = dtype_of(helper.tensor_dtype_to_np_dtype(tt.elem_type))
            except (ImportProblem, KeyError, ValueError, TypeError):
                raise OnnxImportError(f"graph output '{out.name}' has ONNX data type {tt.elem_type}, which GEIR has "
                                      f"no dtype for", unsupported=True) from None
            if declared != t.dtype:
                raise OnnxImportError(f"graph output '{out.name}' is declared {declared} but computes {t.dtype}")
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            if len(dims) != t.rank or any(a is not None and b is not None and a != b for a, b in zip(dims, t.shape)):
                shown = "x".join("?" if d is None else str(d) for d in dims)
                raise OnnxImportError(f"graph output '{out.name}' is declared {shown} but computes {t}")

    # --- nodes ------------------------------------------------------------------------------------
    def _convert(self, node: onnx.NodeProto, opsets: dict[str, int]) -> None:
        label = node.name or f"#{self.count}"
        self.count += 1
        try:
            xs = [self._input(name) for name in node.input]
            outs = self._dispatch(node, xs, opsets)
        except ImportProblem as e:
            raise OnnxImportError(str(e), label, node.op_type, unsupported=e.unsupported) from None
        except OnnxImportError as e:  # from a node of its function body
            raise OnnxImportError(f"in its ONNX function body, {e}", label, node.op_type,
                                  unsupported=e.unsupported) from None
        except MemoryError:  # a constant it computes (a pad, a broadcast) is too large for this host
            raise OnnxImportError("importing it needs more memory than this host has", label, node.op_type,
                                  unsupported=True) from None
        except Exception as e:  # noqa: BLE001 - a converter's bug still names the node it failed on
            raise OnnxImportError(f"internal error: {type(e).__name__}: {e}", label, node.op_type) from e
        for i, name in enumerate(node.output):
            if not name:
                continue
            t = outs[i] if i < len(outs) else None
            if t is None:
                if name in self.env:  # a function body bound it already
                    continue
                raise OnnxImportError(f"output {i} ('{name}') is not supported", label, node.op_type,
                                      unsupported=True)
            self.b.name_result(t, name)
            self.env[name] = t

    def _input(self, name: str) -> Tensor | None:
        if not name:
            return None
        t = self.env.get(name)
        if t is None:
            raise ImportProblem(f"input '{name}' is not defined before this node", unsupported=False)
        return t

    def _dispatch(self, node: onnx.NodeProto, xs: list[Tensor | None], opsets: dict[str, int]) -> list:
        domain = _domain(node.domain)
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise ImportProblem(f"unsupported op: {node.op_type} holds a subgraph (control flow), which a GEIR "
                                f"graph cannot express")
        constant = all(x is None or x.is_const for x in xs)
        conv = CONVERTERS.get(node.op_type) if domain == "" else None
        if conv is not None:
            try:
                return conv(self.b, Node(node, opsets.get(domain, 0)), xs)
            except UseFunctionBody as e:
                return self._expand(node, xs, opsets, str(e))
            except ImportProblem as e:
                if not (e.unsupported and constant):
                    raise
            # all inputs are known but GEIR cannot hold them (say, float64): ONNX evaluates it
        if constant and self._known(node, opsets):
            return self._evaluate(node, xs, opsets)
        return self._expand(node, xs, opsets, None)

    def _known(self, node: onnx.NodeProto, opsets: dict[str, int]) -> bool:
        domain = _domain(node.domain)
        if (node.domain, node.op_type) in self.local_functions:
            return True
        try:
            onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
            return True
        except onnx.defs.SchemaError:
            return False

    def _evaluate(self, node: onnx.NodeProto, xs: list[Tensor | None], opsets: dict[str, int]) -> list:
        arrays = [x.array if x is not None else None for x in xs]
        try:
            results = evaluate(node, arrays, {d: v for d, v in opsets.items()})
        except Exception as e:  # noqa: BLE001 - whatever ONNX's reference raises is a problem of this node
            raise ImportProblem(f"evaluating it at import time failed: {type(e).__name__}: {e}",
                                unsupported=False) from None
        weight = any(x is not None and x.initializer for x in xs)
        return [Tensor(array=a, initializer=weight) if a is not None else None for a in results]

    def _expand(self, node: onnx.NodeProto, xs: list[Tensor | None], opsets: dict[str, int],
                why: str | None) -> list:
        types = [self._type_proto(x) for x in xs]
        body = function_body(node, opsets, types, self.local_functions)
        if body is None:
            domain = f" of domain '{node.domain}'" if node.domain else ""
            if why is not None:
                raise ImportProblem(f"{why}, and ONNX gives this op no function body to import instead")
            if self._known(node, opsets):
                raise ImportProblem(f"unsupported op: GEIR has no {node.op_type}, and ONNX gives it no function "
                                    f"body; it is imported only where all its inputs are known at import time")
            raise ImportProblem(f"unsupported op{domain}: neither GEIR nor ONNX knows {node.op_type}")
        nodes, body_opsets = body
        key = (node.domain, node.op_type)
        if key in self.local_functions and key in self.expanding:
            cycle = [name for _, name in self.expanding[self.expanding.index(key):]] + [node.op_type]
            raise ImportProblem(f"model-local function '{node.op_type}' is recursive ({' -> '.join(cycle)}): "
                                f"its body cannot be imported", unsupported=False)
        if len(self.expanding) == MAX_FUNCTION_NESTING:
            raise ImportProblem(f"function bodies nest more than {MAX_FUNCTION_NESTING} deep", unsupported=False)
        problem = _opset_problem(body_opsets, "its function body", any(_domain(n.domain) == "" for n in nodes))
        if problem is not None:
            raise ImportProblem(problem.reason, problem.unsupported)
        self.expanding.append(key)
        try:
            for inner in nodes:
                self._convert(inner, body_opsets)
        finally:
            self.expanding.pop()
        return [self.env.get(name) if name else None for name in node.output]

    @staticmethod
    def _type_proto(x: Tensor | None) -> onnx.TypeProto:
        if x is None:
            return onnx.TypeProto()
        np_dtype = x.array.dtype if x.is_const else x.type.dtype.np
        return helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(np_dtype),
                                             [d if d is not None else "?" for d in x.shape])


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Read a model file (with its external data); OnnxImportError when it is not a readable ONNX model."""
    try:
        model = onnx.load(os.fspath(path))
    except OSError as e:
        raise OnnxImportError(f"cannot read it: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - DecodeError and friends from protobuf, bad external data
        raise OnnxImportError(f"not an ONNX model ({type(e).__name__}: {e})") from None
    if not model.HasField("graph"):
        raise OnnxImportError("not an ONNX model (it has no graph)")
    return model


def check_text_fields(model: onnx.ModelProto) -> None:
    """OnnxImportError naming the first string field that is not UTF-8 (protobuf hands those over as bytes)."""
    stack: list[tuple[object, str]] = [(model, "model")]
    while stack:  # iterative: a model of 20,000 nodes is a wide tree, a nested function graph a deep one
        message, path = stack.pop()
        for field, value in message.ListFields():
            # a singular field's value is the message or string itself, a repeated one's a container of them
            if field.type == field.TYPE_MESSAGE:
                if isinstance(value, Message):
                    stack.append((value, f"{path}.{field.name}"))
                else:
                    stack.extend((v, f"{path}.{field.name}[{i}]") for i, v in enumerate(value))
            elif field.type == field.TYPE_STRING:
                values = [value] if isinstance(value, (str, bytes)) else list(value)
                if any(isinstance(v, bytes) for v in values):
                    raise OnnxImportError(f"not an ONNX model: {path}.{field.name} is not valid UTF-8 text")


def _opset_problem(opsets: dict[str, int], what: str, needed: bool) -> OnnxImportError | None:
    """The default domain's version must be one the importer reads, and given where its ops are used."""
    version = opsets.get("")
    supported = supported_opsets()
    span = f"{supported.start} to {supported.stop - 1}"
    if version is None:
        if not needed:
            return None
        return OnnxImportError(f"{what} uses ONNX ops but imports no version of the default domain (opset_import); "
                               f"GEIR reads opsets {span}")
    if version in supported:
        return None
    return OnnxImportError(f"{what} imports opset {version} of the default domain; GEIR reads opsets {span} "
                           f"(those of onnx {onnx.__version__})", unsupported=version > supported.stop - 1)
