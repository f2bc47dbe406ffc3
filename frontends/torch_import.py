"""A torch.export ExportedProgram becomes a GEIR module: inputs, constants, the node walk, the results.

User inputs become graph arguments (named as torch named them); parameters, buffers and lifted
constants become `ge.const` (large ones `dense_resource<"state.dict.name">`, their arrays in
Module.resources); every other node goes through its converter in `torch_ops`. A node whose tensor
inputs are all constants (a mask built with torch.tril, a weight transposed in forward) is
evaluated by torch itself at import time, exactly as torch would, and becomes a constant.
"""

from __future__ import annotations

import operator
from typing import Any

import attrs
import numpy as np
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from geir.diagnostics import UNKNOWN, DiagnosticError
from geir.frontends.torch_builder import (COMPUTED_LITERAL_LIMIT, LITERAL_LIMIT, GraphBuilder, RunTimeSize,
                                          TorchImportError, dims_of, geir_dtype, is_broadcast, node_description,
                                          source_location, to_numpy)
from geir.frontends.torch_ops import CONVERTERS, TAKES_RUNTIME_SIZES, Unavailable
from geir.frontends.torch_regional import LayersDiffer, LayerWalk, RepeatedLayers
from geir.ir import Module, Value
from geir.types import DType, TensorType
from geir.verifier import verify_graph


@attrs.define
class ConstTensor:
    """A tensor known at import time; `key` is its state-dict name (None when the importer computed it)."""

    tensor: torch.Tensor
    key: str | None = None


@attrs.define
class ImportedProgram:
    """The GEIR module of an exported program, and how to call it as torch would."""

    module: Module
    # per flattened user input: the graph argument it binds, or None for a non-tensor input torch specialised
    input_names: list[str | None]
    in_spec: Any  # None where the module is not the exported program's (a regional import's: more layers)
    out_spec: Any


def functional(ep: ExportedProgram) -> ExportedProgram:
    """The program without in-place ops (torch functionalises it, keeping high-level ops like linear)."""
    mutating = any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                   and n.target._schema.is_mutable for n in ep.graph.nodes)
    return ep.run_decompositions({}) if mutating else ep


def import_program(ep: ExportedProgram, name: str = "main", source: str = "<torch.export>",
                   repeat: RepeatedLayers | None = None) -> ImportedProgram:
    """Translate an exported program into a verified `ge.graph @name` with its weights; `source` names the module.

    `repeat`: `ep` was exported from a two-layer cut of a deeper model (torch_regional.cut_to_two_layers); its
    second layer is stamped out for each further layer, so the module is the whole model's (LayersDiffer when the
    two exported layers are not one layer twice)."""
    ep = functional(ep)
    walk = None
    if repeat is not None:
        walk = LayerWalk.of(ep, repeat)
        if isinstance(walk, str):
            raise LayersDiffer(f"cannot import the model's {repeat.count} layers from two: {walk}")
    return _Importer(ep, name, repeat, walk).run(source)


class _Importer:
    """One walk over an exported program's fx graph, building the GEIR graph as it goes."""

    def __init__(self, ep: ExportedProgram, name: str, repeat: RepeatedLayers | None = None,
                 walk: LayerWalk | None = None):
        self.ep = ep
        self.b = GraphBuilder(name)
        self.env: dict[Any, Any] = {}
        self.input_names: list[str | None] = []
        # id(constant) -> (the constant, kept alive so that its id is never another's, its ge.const)
        self._consts: dict[int, tuple[ConstTensor, Value]] = {}
        self.repeat, self.walk = repeat, walk
        self.layer_results: list[list[Value]] = []  # a regional import's results of its second and further layers

    def run(self, source: str) -> ImportedProgram:
        """Convert every node in order, then verify the graph."""
        specs = {s.arg.name: s for s in self.ep.graph_signature.input_specs}
        results: list[Value] = []
        last = self.walk.second[-1] if self.walk is not None else None
        for node in self.ep.graph.nodes:
            self.b.node, self.b.loc = node, source_location(node)
            if node.op == "placeholder":
                self.placeholder(node, specs[node.name])
            elif node.op == "call_function":
                self.env[node] = self.call(node)
                if node is last:
                    self.further_layers()
            elif node.op == "output":
                results = self.outputs(node)
            else:
                raise TorchImportError(f"{node_description(node)}: {node.op} nodes (submodules, control flow) are "
                                       f"not supported")
        self.b.node, self.b.loc = None, UNKNOWN
        graph = self.b.finish(results)
        try:
            verify_graph(graph)
        except DiagnosticError as e:  # a converter produced bad IR: the importer's bug, reported plainly
            raise TorchImportError(f"the imported graph does not verify: {e}") from None
        module = Module([graph], source, dict(self.b.weights))
        if self.walk is not None:
            return ImportedProgram(module, self.input_names, None, None)
        return ImportedProgram(module, self.input_names, self.ep.call_spec.in_spec, self.ep.call_spec.out_spec)

    def further_layers(self) -> None:
        """A regional import: the second layer's nodes walked again for each further layer, each reading the layer
        before it, its own weights and inputs (new graph arguments after the program's); the nodes after the
        layers then read the last layer's values."""
        walk, repeat = self.walk, self.repeat
        self.layer_results.append([self.value_of(r) for r in walk.outputs])
        outer = {n: self.env[n] for n in (*walk.carried, *walk.weights, *walk.inputs)}
        for layer in range(2, repeat.count):
            self.env.update({first: self.env[twin] for first, twin in walk.carried.items()})  # the layer before
            for node, name in walk.weights.items():
                key, tensor = repeat.tensor(name, layer)
                self.env[node] = ConstTensor(tensor, key)
            for node in walk.inputs:
                arg = self.b.argument(outer[node].type, walk.input_name(node.name, layer))
                self.input_names.append(arg.name)
                self.env[node] = arg
            for node in walk.second:
                self.b.node, self.b.loc = node, source_location(node)
                self.env[node] = self.call(node)
            self.layer_results.append([self.value_of(r) for r in walk.outputs])
        self.env.update(outer)  # the first layer's values and the second's inputs, as the program's outputs read them

    # --- inputs and constants --------------------------------------------------------------------------

    def placeholder(self, node: Any, spec: Any) -> None:
        """A user input becomes a graph argument; a parameter, buffer or constant a ConstTensor."""
        if spec.kind == InputKind.USER_INPUT:
            if not isinstance(spec.arg, TensorArgument):
                self.env[node] = getattr(spec.arg, "value", None)
                self.input_names.append(None)
                return
            val = node.meta["val"]
            t = TensorType(dims_of(val.shape), geir_dtype(val.dtype, f"input '{node.name}'"))
            arg = self.b.argument(t, node.name)
            self.input_names.append(arg.name)
            self.env[node] = arg
            return
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            target = spec.target
            t = self.ep.state_dict.get(target)
            if t is None:
                t = self.ep.constants.get(target)
            if not isinstance(t, torch.Tensor):
                raise TorchImportError(f"{node_description(node)}: no tensor for {spec.kind.name.lower()} '{target}'")
            self.env[node] = ConstTensor(t.detach(), target)
            return
        raise TorchImportError(f"{node_description(node)}: inputs of kind {spec.kind.name} are not supported")

    def value_of(self, x: Any) -> Any:
        """A node argument as a converter takes it: tensors as GEIR values, the rest as Python values."""
        if isinstance(x, (list, tuple)):
            return type(x)(self.value_of(e) for e in x)
        if not isinstance(x, torch.fx.Node):
            return x
        v = self.env[x]
        if isinstance(v, ConstTensor):
            return self.materialize(x, v)
        if isinstance(v, Unavailable):
            raise self.b.error(f"uses {v.what} (node '{x.name}'), which GEIR does not compute")
        return v

    def materialize(self, node: Any, c: ConstTensor) -> Value:
        """The ge.const for a constant tensor (one per tensor, emitted at its first use)."""
        kept = self._consts.get(id(c))
        v = None if kept is None else kept[1]
        if v is None and c.key is not None and is_broadcast(c.tensor):
            # one element behind many (a timing-only model's weight: bench/serve.py's LLaMA-7B shape): a resource, as
            # a checkpoint's weight is, that keeps its zero strides, not a splat literal or a copy of its bytes
            one = to_numpy(c.tensor[(0,) * c.tensor.dim()])
            dtype = geir_dtype(c.tensor.dtype, f"constant '{c.key}'")
            v = self.b.broadcast_resource(np.broadcast_to(one, tuple(c.tensor.shape)), dtype, node.name, c.key)
            self._consts[id(c)] = (c, v)
        if v is None:
            dtype = geir_dtype(c.tensor.dtype, f"constant '{c.key or node.name}'")
            limit = LITERAL_LIMIT if c.key is not None else COMPUTED_LITERAL_LIMIT
            v = self.b.const(to_numpy(c.tensor), dtype, hint=node.name, key=c.key, limit=limit)
            self._consts[id(c)] = (c, v)
        return v

    # --- operations ------------------------------------------------------------------------------------

    def call(self, node: Any) -> Any:
        """What a call_function node stands for: GEIR value(s), a folded constant, or a run-time size."""
        target = node.target
        if target is operator.getitem:
            return self.env[node.args[0]][node.args[1]]
        if _is_size(node):
            return self.size(node)
        if not isinstance(target, torch._ops.OpOverload):
            raise self.b.error("only aten operators are supported")
        if _is_check(target):
            return None  # a run-time assertion torch.export left in (metadata, value ranges): nothing to compute
        if self.foldable(node):
            return self.fold(node)
        converter = CONVERTERS.get(str(target.overloadpacket))
        if converter is None:
            raise self.b.error("unsupported op: GEIR has no mapping for it")
        kwargs = _schema_arguments(node)
        mapped = {k: self.value_of(v) for k, v in kwargs.items()}
        if str(target.overloadpacket) not in TAKES_RUNTIME_SIZES and _has_symbolic(mapped):
            raise self.b.error("takes a run-time size as an argument, which GEIR does not map for this op (it does for "
                               "reshapes, arange, slice and expand)")
        try:
            out = converter(self.b, node, mapped)
        except TorchImportError:
            raise
        except Exception as e:  # noqa: BLE001 - a case the converter did not foresee: name the node, not a deep frame
            raise self.b.error(f"cannot import: {type(e).__name__}: {e}") from None
        self.check(node, out)
        return out

    def size(self, node: Any) -> RunTimeSize:
        """A SymInt node: the rank-0 i64 value computing it (ge.dim of an input, arithmetic on those)."""
        if node.target is torch.ops.aten.sym_size.int:
            x = self.value_of(node.args[0])
            axis = node.args[1] % x.type.rank
            return RunTimeSize(self.b.value("ge.dim", [x], {"axis": axis}, hint=node.name))
        name = _SIZE_ARITHMETIC.get(node.target)
        if name is None:
            raise self.b.error(f"computes a run-time size with {getattr(node.target, '__name__', node.target)}, which "
                               f"GEIR does not map (it maps sym_size, +, - and *)")
        operands = []
        for x in node.args:
            v = self.value_of(x)
            operands.append(v.value if isinstance(v, RunTimeSize) else self.b.scalar(int(v), DType.i64, "size"))
        return RunTimeSize(self.b.value(name, operands, hint=node.name))

    def foldable(self, node: Any) -> bool:
        """Every tensor input is a constant and the op is deterministic: torch can evaluate it now."""
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            return False
        for x in node.all_input_nodes:
            if not isinstance(self.env.get(x), ConstTensor):
                return False
        return True

    def fold(self, node: Any) -> Any:
        """Run the aten op on the constant tensors now; its result is a constant too."""
        def real(x: Any) -> Any:
            if isinstance(x, (list, tuple)):
                return type(x)(real(e) for e in x)
            return self.env[x].tensor if isinstance(x, torch.fx.Node) else x

        try:
            out = node.target(*real(node.args), **{k: real(v) for k, v in node.kwargs.items()})
        except Exception as e:  # noqa: BLE001
            raise self.b.error(f"evaluating it on constants failed: {type(e).__name__}: {e}") from None
        if isinstance(out, (list, tuple)):
            return [ConstTensor(t) if isinstance(t, torch.Tensor) else t for t in out]
        return ConstTensor(out) if isinstance(out, torch.Tensor) else out

    def check(self, node: Any, out: Any) -> None:
        """The converter's result types agree with what torch traced (a guard against mapping mistakes)."""
        vals = node.meta.get("val")
        outs = out if isinstance(out, tuple) else (out,)
        metas = vals if isinstance(vals, (list, tuple)) else (vals,)
        for v, m in zip(outs, metas):
            if not isinstance(v, Value) or not isinstance(m, torch.Tensor):
                continue
            want = TensorType(dims_of(m.shape), geir_dtype(m.dtype, f"the result of node '{node.name}'"))
            if v.type.dtype != want.dtype or len(v.type.shape) != len(want.shape) or any(
                    a is not None and b is not None and a != b for a, b in zip(v.type.shape, want.shape)):
                raise self.b.error(f"imported as {v.type}, but torch computes {want}")

    def outputs(self, node: Any) -> list[Value]:
        """The values the graph returns (the user outputs; a program that mutates state is refused)."""
        specs = self.ep.graph_signature.output_specs
        mutated = [s.target for s in specs if s.kind != OutputKind.USER_OUTPUT]
        if mutated:
            raise TorchImportError(f"the program mutates {', '.join(map(str, mutated))} (e.g. batch-norm statistics "
                                   f"in training mode); export the module in eval mode (module.eval())")
        results = []
        layered = set(self.walk.outputs) if self.walk is not None else set()
        for x in node.args[0]:
            if not isinstance(x, torch.fx.Node):
                raise TorchImportError(f"output {x!r} is not a tensor; GEIR graphs return tensors only")
            if x in layered:
                continue  # a regional import's layers' results come last, layer by layer
            self.b.node, self.b.loc = x, source_location(x)
            results.append(self.value_of(x))
        return results + [v for layer in self.layer_results for v in layer]


def _is_check(target: Any) -> bool:
    """An aten op that only asserts something and returns nothing (aten._assert_*, sym_constrain_range*)."""
    name = str(target.overloadpacket)
    return not target._schema.returns and name.startswith(("aten._assert", "aten.sym_constrain"))


def _has_symbolic(x: Any) -> bool:
    if isinstance(x, dict):
        return any(_has_symbolic(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_symbolic(v) for v in x)
    return isinstance(x, RunTimeSize)


# SymInt arithmetic torch.export records, as ops on rank-0 i64 tensors
_SIZE_ARITHMETIC = {operator.add: "ge.add", operator.sub: "ge.sub", operator.mul: "ge.mul"}


def _is_size(node: Any) -> bool:
    """A node computing a run-time size: aten.sym_size or arithmetic on sizes."""
    return isinstance(node.meta.get("val"), torch.SymInt)


def _schema_arguments(node: Any) -> dict[str, Any]:
    """The node's arguments by their schema names, defaults filled in."""
    pair = node.normalized_arguments(node.graph.owning_module, normalize_to_only_use_kwargs=True)
    if pair is not None:
        return dict(pair.kwargs)
    bound: dict[str, Any] = {}
    schema_args = node.target._schema.arguments
    for arg, value in zip(schema_args, node.args):
        bound[arg.name] = value
    for arg in schema_args:
        if arg.name not in bound:
            bound[arg.name] = node.kwargs.get(arg.name, arg.default_value if arg.has_default_value() else None)
    return bound
