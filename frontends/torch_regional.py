"""Regional export: a model of many identical layers traced with two of them, imported with all of them.

torch.export traces a deep model node by node, every layer again (about 0.2 s a LLaMA-7B decoder layer on this
project's hosts: 6-7 s for one 32-layer step program), though its layers are one program with different weights.
torch.compile's regional compilation (`torch.compiler.nested_compile_region`) and vLLM's piecewise graphs compile
such a layer once; non-strict torch.export has no such mode, and strict export of a Hugging Face model with marked
regions takes longer than the whole trace. So GEIR exports a copy of the model cut to its first two layers
(sharing the model's weights) and, importing it, walks the second layer's nodes once more for every further layer,
with that layer's weights, its own inputs and outputs (a decode step's KV pools) and the layer before it as its
input. The result is the module a full export imports to, op for op (test_regional_import.py holds them equal).

The second layer is the template, not the first: the first reads the embedding, the second reads a layer's output,
as every further layer does. The walk is taken only when it is sound: the layers must be one layer repeated (the
same modules, shapes and settings but their index, one `layer_types` entry) and the two exported layers must be
the same nodes over their own inputs, weights and the values before them (`LayerWalk.of` says why not, and the
caller exports the whole model). What neither check sees is a layer's forward branching on its own index beyond
the first two in code alone (no attribute, no config entry saying so); Hugging Face's models keep such choices in
per-layer attributes or `layer_types` (GPT-2's inverse-index scaling shows in the first two layers).
"""

from __future__ import annotations

import copy
import re
from typing import Any, Mapping

import attrs
import torch

from geir.frontends.torch_builder import TorchImportError

# user-input names torch gives a tuple's elements (pools_0, pools_1, ...): a layer's own inputs are renumbered
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


class LayersDiffer(TorchImportError):
    """The two exported layers are not one layer twice: the model must be exported whole."""


@attrs.frozen
class RepeatedLayers:
    """How to import a program exported from a two-layer cut of a model as the whole model."""

    path: str  # the layer list's module path in the exported module ("model.model.layers")
    count: int  # the whole model's layers
    tensors: Mapping[str, torch.Tensor]  # the whole exported module's parameters and buffers, by name

    def tensor(self, name: str, layer: int) -> tuple[str, torch.Tensor]:
        """The state name and tensor of layer `layer` that `name` (the second layer's) stands for."""
        own = f"{self.path}.{layer}." + name[len(f"{self.path}.1."):]
        return own, self.tensors[own].detach()


@attrs.frozen
class Cut:
    """A model cut to its first two layers (sharing their weights) and what importing it whole needs."""

    model: torch.nn.Module
    path: str  # the layer list's module path in the model
    count: int

    def repeat(self, exported: torch.nn.Module, prefix: str = "") -> RepeatedLayers:
        """The import's RepeatedLayers for `exported`, a module over the whole model at attribute path `prefix`."""
        tensors = {**dict(exported.named_parameters(remove_duplicate=False)),
                   **dict(exported.named_buffers(remove_duplicate=False))}
        return RepeatedLayers(f"{prefix}.{self.path}" if prefix else self.path, self.count, tensors)


def cut_to_two_layers(model: torch.nn.Module) -> Cut | None:
    """`model` with only its first two decoder layers (a shallow copy: its weights shared), or None when its
    layers are fewer than three or not one layer repeated (then the whole model must be exported)."""
    found = _layer_list(model)
    if found is None:
        return None
    path, layers = found
    if len(layers) < 3 or not _one_layer_repeated(model, layers):
        return None
    config = copy.copy(model.config)
    try:
        config.num_hidden_layers = 2
    except (AttributeError, TypeError):  # a config whose layer count is derived, not set: export the whole model
        return None
    root = _own_copy(model, config)
    parent, parts = root, path.split(".")
    for part in parts[:-1]:
        child = _own_copy(parent._modules[part], config)
        parent._modules[part] = child
        parent = child
    parent._modules[parts[-1]] = torch.nn.ModuleList(list(layers[:2]))
    return Cut(root, path, len(layers))


def _own_copy(module: torch.nn.Module, config: Any) -> torch.nn.Module:
    """A shallow copy of `module` whose child list is its own (so replacing a child leaves `module` as it was),
    reading `config` where it read the model's."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    if "config" in vars(module):
        out.config = config
    return out


def _layer_list(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """The ModuleList holding the model's `num_hidden_layers` decoder layers, and its path."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not isinstance(count, int):
        return None
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == count and name]
    return found[0] if len(found) == 1 else None


def _one_layer_repeated(model: torch.nn.Module, layers: torch.nn.ModuleList) -> bool:
    """Every layer the same modules, parameter shapes and settings but its index (config.layer_types one kind)."""
    kinds = getattr(model.config, "layer_types", None)
    if kinds is not None and len(set(kinds)) > 1:
        return False
    first = _signature(layers[0])
    return all(_signature(layer) == first for layer in layers)


def _signature(layer: torch.nn.Module) -> list:
    """What makes a layer compute what it does, its weights' values and its index aside."""
    out: list = []
    for name, m in layer.named_modules():
        settings = {k: v for k, v in vars(m).items()
                    if not k.startswith("_") and k not in ("layer_idx", "layer_id", "layer_number")
                    and isinstance(v, (bool, int, float, str, type(None), tuple))}
        out.append((name, type(m), repr(m), settings))
    out.extend((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())
    out.extend((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    return out


@attrs.frozen
class LayerWalk:
    """The exported program's nodes as a regional import walks them: the second layer's walked once more for
    every further layer."""

    second: tuple  # the second layer's nodes, in order
    carried: Mapping[Any, Any]  # a first-layer node the second layer reads -> its twin among the second's nodes
    weights: Mapping[Any, str]  # a second-layer parameter or buffer placeholder -> its state name
    inputs: tuple  # the second layer's own user inputs (the program's last ones)
    outputs: tuple  # the second layer's results among the program's outputs (its last ones)

    @staticmethod
    def of(ep: Any, repeat: RepeatedLayers) -> "LayerWalk | str":
        """The walk over `ep`'s graph, or why the two exported layers are not one layer stamped out twice."""
        nodes = list(ep.graph.nodes)
        layer = [_layer_of(n, repeat.path) for n in nodes]
        first = [n for n, k in zip(nodes, layer) if k == 0]
        second = [n for n, k in zip(nodes, layer) if k == 1]
        if not first or len(first) != len(second):
            return f"the exported layers have {len(first)} and {len(second)} nodes"
        at = [i for i, k in enumerate(layer) if k == 1]
        if at[-1] - at[0] + 1 != len(second):
            return "the second layer's nodes are not consecutive"
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
        live = _live(nodes)
        weights, own = {}, {0: [], 1: []}
        for n in nodes:
            if n.op != "placeholder":
                continue
            spec = specs[n.name]
            target = getattr(spec, "target", None) or ""
            for k in (0, 1):
                if target.startswith(f"{repeat.path}.{k}."):
                    if k == 1:
                        weights[n] = target
                    break
            else:
                # a dead node's use aside (the cache layers' stand-ins of the attended length, made per layer), and
                # a run-time size read before the layers (the cache's length: every layer's input has it)
                users = {_layer_of(u, repeat.path) for u in n.users
                         if u in live and u.target is not torch.ops.aten.sym_size.int}
                if spec.kind.name == "USER_INPUT" and len(users) == 1 and users <= {0, 1}:
                    own[users.pop()].append(n)
        missing = [t for t in weights.values() if t not in repeat.tensors]
        if missing:
            return f"the whole model has no {missing[0]}"
        user = [n for n in nodes if n.op == "placeholder" and specs[n.name].kind.name == "USER_INPUT"]
        if len(own[0]) != len(own[1]) or (own[1] and user[-len(own[1]):] != own[1]):
            return "the second layer's own inputs are not the program's last inputs"
        index0 = {n: i for i, n in enumerate(first)}
        index1 = {n: i for i, n in enumerate(second)}
        twins = {a1: a0 for a0, a1 in zip(own[0], own[1])}
        carried: dict = {}

        def same(a0: Any, a1: Any) -> bool:
            if isinstance(a1, (list, tuple)):
                return (isinstance(a0, (list, tuple)) and len(a0) == len(a1)
                        and all(same(x, y) for x, y in zip(a0, a1)))
            if isinstance(a1, dict):
                return isinstance(a0, dict) and a0.keys() == a1.keys() and all(same(a0[k], a1[k]) for k in a1)
            if not isinstance(a1, torch.fx.Node):
                return not isinstance(a0, torch.fx.Node) and type(a0) is type(a1) and a0 == a1
            if not isinstance(a0, torch.fx.Node):
                return False
            if a1 in index1:
                return index0.get(a0) == index1[a1]
            if a1 in index0:  # the layer before: the second layer's input, as the first's is a value before it
                carried[a1] = second[index0[a1]]
                return a0 not in index0 and a0 not in index1
            if a1 in weights:
                name = weights[a1][len(f"{repeat.path}.1."):]
                return specs[a0.name].target == f"{repeat.path}.0.{name}"
            if a1 in twins:
                return twins[a1] is a0
            return a0 is a1  # a value before both layers, which both read

        for n0, n1 in zip(first, second):
            if n0.op != n1.op or n0.target != n1.target or not same(n0.args, n1.args) \
                    or not same(n0.kwargs, n1.kwargs) or _meta(n0) != _meta(n1):
                return f"the exported layers differ at node '{n1.name}' (the first layer's '{n0.name}')"
        output = nodes[-1]
        results = list(output.args[0])
        mine = [r for r in results if r in index1]
        if mine and results[-len(mine):] != mine:
            return "the second layer's results are not the program's last results"
        return LayerWalk(tuple(second), carried, weights, tuple(own[1]), tuple(mine))

    def input_name(self, name: str, layer: int) -> str:
        """A further layer's name for the second layer's input `name` (pools_2 -> pools_4 for the third layer of
        two inputs each)."""
        m = _NUMBERED.match(name)
        if m is None:
            return f"{name}_{layer}"
        return f"{m.group(1)}{int(m.group(2)) + (layer - 1) * len(self.inputs)}"


def _layer_of(node: Any, path: str) -> int | None:
    """Which exported layer a node was traced in (its innermost module under the layer list), or None."""
    stack = node.meta.get("nn_module_stack") or {}
    for module_path, _ in reversed(list(stack.values())):
        if module_path.startswith(path + "."):
            index = module_path[len(path) + 1:].split(".", 1)[0]
            return int(index) if index.isdigit() else None
    return None


def _live(nodes: list) -> set:
    """The nodes the program's results depend on."""
    live = {nodes[-1]}
    for n in reversed(nodes):
        if n in live:
            live.update(n.all_input_nodes)
    return live


def _meta(node: Any) -> Any:
    """A node's traced result types (shapes as torch printed them, dtypes)."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else (val,)
    return tuple((str(tuple(v.shape)), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__ for v in vals)
