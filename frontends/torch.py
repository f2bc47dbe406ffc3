"""PyTorch models into GEIR (via torch.export), compiled by GE and run on the simulated NPU.

    from geir.frontends.torch import compile, from_module, save

    module = from_module(model.eval(), (x,))     # a verified ge.graph @main; weights in module.resources
    save(module, "model.geir")                   # model.geir + model.npz, ready for geopt / gerun
    fast = compile(model.eval(), (x,))
    y = fast(x)                                  # torch tensors in and out, computed on the simulated NPU
    fast.profile()                               # the last run's figures (simulated time, pipes, kernels)

    run = generate(hf_causal_lm, input_ids, max_new_tokens=16, buckets="pow2")  # token by token, KV on the device
    print(run.render())                          # one record per step: plan cache, GE and device time, KV bytes

    fast = torch.compile(model.eval(), backend="geir")   # TorchDynamo's way in: registered by this import
    with torch.no_grad():
        y = fast(x)                              # each captured graph on the simulated NPU; what GEIR cannot
                                                 # run, eagerly with a GeirFallbackWarning naming the op

Only this module and its `torch_*` siblings import torch, so `import geir` works without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from geir.builder import clone_graph
from geir.frontends.torch_builder import TorchImportError, from_numpy, geir_dtype, to_numpy
from geir.frontends.generate import Generation, Step, generate
from geir.frontends.serve import Serving, serve
from geir.frontends.torch_compile import GeirFallbackWarning, geir_backend, register
from geir.frontends.torch_import import ImportedProgram, import_program
from geir.ir import Graph, Module
from geir.printer import print_module
from geir.runtime.interpreter import RunResult
from geir.session import DEFAULT_PIPELINE, Session, run_program
from geir.target_npu.target import DEFAULT_TARGET, Target, as_target


__all__ = ["CompiledModule", "GeirFallbackWarning", "Generation", "Step", "TorchImportError", "compile", "export",
           "from_exported", "from_module", "generate", "geir_backend", "save", "serve", "Serving"]


def export(module: torch.nn.Module, example_args: Sequence[Any], dynamic_shapes: Any = None) -> ImportedProgram:
    """torch.export the module on the example inputs and import the program (module, input and output structure)."""
    try:
        ep = torch.export.export(module, tuple(example_args), dynamic_shapes=dynamic_shapes)
    except Exception as e:
        raise TorchImportError(f"torch.export could not trace {type(module).__name__}: {type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
    return import_program(ep, source=f"<torch {type(module).__name__}>")


def from_module(module: torch.nn.Module, example_args: Sequence[Any], dynamic_shapes: Any = None) -> Module:
    """The module as a verified GEIR module (`ge.graph @main`, arguments named as torch.export names them).

    Parameters and buffers larger than a few elements are `dense_resource<"their.state_dict.name">`
    constants whose arrays are in `Module.resources`; `dynamic_shapes` (torch.export's) makes
    dimensions `?`.
    """
    return export(module, example_args, dynamic_shapes).module


def from_exported(program: torch.export.ExportedProgram) -> Module:
    """A GEIR module from a program already exported with torch.export."""
    return import_program(program).module


def compile(module: torch.nn.Module, example_args: Sequence[Any], dynamic_shapes: Any = None,
            pipeline: str = DEFAULT_PIPELINE, target: Target | str = DEFAULT_TARGET) -> CompiledModule:
    """A callable that runs the module on the simulated NPU: GE compiles it once, new shapes re-plan."""
    return CompiledModule(export(module, example_args, dynamic_shapes), pipeline, target)


class CompiledModule:
    """A PyTorch module compiled by GE: call it with torch tensors, get torch tensors back.

    `module` is the imported GEIR module as written; `session` the GE session (its `generic` graph is
    the optimised one, fused ops included; its plan cache holds one program per input-shape
    signature); `last_result` the Runtime's RunResult of the latest call.
    """

    def __init__(self, imported: ImportedProgram, pipeline: str = DEFAULT_PIPELINE,
                 target: Target | str = DEFAULT_TARGET):
        self.module = imported.module
        self.target = as_target(target)  # a name is loaded once, here
        self._imported = imported
        graph = self.module.graph()
        # the session's passes rewrite the graph in place; the imported one stays as torch spelled it
        self.session = Session(Module([clone_graph(graph)], self.module.file, self.module.resources), pipeline, target)
        self.last_result: RunResult | None = None

    @property
    def graph(self) -> Graph:
        """The graph after GE's shape-independent passes (fusion included): what runs, before per-shape planning."""
        return self.session.generic

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        names = self._imported.input_names
        if spec != self._imported.in_spec:
            raise TypeError(f"the inputs must be structured as the example inputs were ({len(names)} of them), "
                            f"got {len(flat)}")
        types = {a.name: a.type for a in self.session.generic.args}
        inputs: dict[str, np.ndarray] = {}
        for name, x in zip(names, flat):
            if name is None:
                continue
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input '{name}' must be a tensor, got {type(x).__name__}")
            if geir_dtype(x.dtype, f"input '{name}'") != types[name].dtype:
                raise TypeError(f"input '{name}' is {str(x.dtype).removeprefix('torch.')}, but the module was "
                                f"compiled for {types[name].dtype}")
            inputs[name] = to_numpy(x)
        program = self.session.program({k: v.shape for k, v in inputs.items()})
        result = run_program(program, inputs, self.module.resources, self.target)
        self.last_result = result
        outs = [from_numpy(a, t.dtype) for a, t in zip(result.outputs, program.result_types)]
        return pytree.tree_unflatten(outs, self._imported.out_spec)

    def profile(self) -> dict[str, Any]:
        """The last run's profile with the spec's keys (simulated_time_us, pipe ratios, kernels, plan_cache)."""
        from geir.runtime.profile import profile

        if self.last_result is None:
            raise RuntimeError("no run yet: call the compiled module first")
        return profile(self.last_result, plan_cache=self.session.plan_cache)


def save(module: Module, path: str | Path) -> tuple[Path, Path | None]:
    """Write the module as PATH (.geir text) and its weights as the .npz beside it, where gerun looks.

    bf16 weights are stored as float32 (npz has no bf16; gerun casts them back exactly). Returns
    the paths written (the .npz is None when the module has no weights).
    """
    from geir.files import ToolError, npz_bytes, write_all_atomically

    path = Path(path)
    weights_path = path.with_suffix(".npz") if module.resources else None
    files: list[tuple[str, str | bytes]] = []
    if weights_path is not None:
        files.append((str(weights_path), npz_bytes({k: _storable(np.asarray(a)) for k, a in module.resources.items()})))
    files.append((str(path), print_module(module)))
    try:
        write_all_atomically(files)  # both or neither
    except ToolError as e:  # the tools' one-line message, as the OSError a library caller expects
        raise OSError(str(e)) from None
    return path, weights_path


def _storable(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


# torch.compile(model, backend="geir") works once this module is imported (the entry point in
# pyproject.toml does the same for an installed GEIR without the import)
register()
