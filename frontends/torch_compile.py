"""`torch.compile(model, backend="geir")`: the graphs TorchDynamo captures, compiled by GE and run on the simulated NPU.

Dynamo hands a backend one FX GraphModule per captured graph (a model with graph breaks gives several)
and example inputs; the backend returns a callable that replaces the graph. This one runs the graph
through the same torch.export importer as `geir.frontends.torch.compile`, GE's default pipeline and
the Runtime, and returns torch tensors. What GEIR cannot run (an op it has no mapping for, float64,
autograd) runs eagerly instead, with a `GeirFallbackWarning` naming the op, as torch's own backends
fall back: the result is always eager PyTorch's where GEIR does not take the graph.

The backend is registered as "geir" when `geir.frontends.torch` is imported, and through the
`torch_dynamo_backends` entry point (so `backend="geir"` works in an installed GEIR without the import).
This module imports the rest of the torch frontend only when a graph arrives, because torch loads it
through that entry point by itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported when a graph arrives (the entry point loads this module alone)
    from geir.target_npu.target import Target

__all__ = ["GeirFallbackWarning", "geir_backend", "register"]

BACKEND_NAME = "geir"


class GeirFallbackWarning(UserWarning):
    """A graph that `torch.compile(..., backend="geir")` runs eagerly, and why."""


def geir_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: dict[str, Any] | None = None,
                 mode: str | None = None) -> Callable[..., Any]:
    """The Dynamo backend: a callable that runs `gm` on the simulated NPU (eagerly where GEIR cannot).

    `options` (torch.compile's) may give `target` (a target name or .toml file) and `pipeline` (GE's
    pass pipeline); `mode` is accepted and ignored, as GEIR has one compile mode.
    """
    from geir.session import DEFAULT_PIPELINE
    from geir.target_npu.target import DEFAULT_TARGET, as_target

    options = dict(options or {})
    target = options.pop("target", DEFAULT_TARGET)
    pipeline = options.pop("pipeline", DEFAULT_PIPELINE)
    if options:
        # a misspelt option is the caller's mistake, not a graph to run eagerly
        raise ValueError(f"backend 'geir' takes the options 'target' and 'pipeline', not {', '.join(sorted(options))}")
    return GeirGraph(gm, example_inputs, pipeline, as_target(target))


class GeirGraph:
    """One Dynamo graph: GE compiles it per input signature (shapes, dtypes, the values of int inputs).

    A graph GEIR cannot import runs eagerly from then on; a call that fails on the NPU runs that
    call eagerly. Either way a `GeirFallbackWarning` says why.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pipeline: str, target: Target):
        self.gm = gm
        self.pipeline = pipeline
        self.target = target
        # per input signature: the compiled graph
        self.compiled: dict[tuple, Any] = {}
        # why the whole graph runs eagerly (an op GEIR has no mapping for), once known
        self.eager_reason: str | None = None
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self._returns_list = isinstance(output.args[0], list)
        if all(_concrete(x) for x in example_inputs) and not _needs_autograd(example_inputs):
            # compile now, as other backends do, so that an unsupported op is reported at torch.compile time;
            # with symbolic shapes (Dynamo's automatic dynamic) it waits for the real inputs of a call
            self._compiled_for(list(example_inputs))

    def __call__(self, *args: Any) -> Any:
        if self.eager_reason is not None:
            return self.gm(*args)
        if _needs_autograd(args):
            self._warn("autograd: GEIR runs inference only; call the compiled model under torch.no_grad() "
                       "or torch.inference_mode() to run it on the NPU")
            return self.gm(*args)
        fast = self._compiled_for(list(args))
        if fast is None:
            return self.gm(*args)
        try:
            outs = fast(*args)
        except Exception as e:  # noqa: BLE001 - the backend's promise: never fail where eager would not
            self._warn(f"the simulated NPU could not run it ({type(e).__name__}: {_first_line(e)}); this call ran "
                       f"eagerly")
            return self.gm(*args)
        # Dynamo's graphs return a tuple or a list of outputs; give back the kind the graph does
        return list(outs) if isinstance(outs, (tuple, list)) and self._returns_list else outs

    def _compiled_for(self, args: list[Any]) -> Any:
        """The CompiledModule for these inputs' signature, compiling it on first sight; None to run eagerly."""
        from geir.frontends.torch import CompiledModule, export
        from geir.frontends.torch_builder import TorchImportError

        key = _signature(args)
        if key in self.compiled:
            return self.compiled[key]
        try:
            fast = CompiledModule(export(self.gm, args), self.pipeline, self.target)
            # GE compiles the program for this shape signature now, not inside the first run
            fast.session.program({n: tuple(x.shape) for n, x in zip(fast._imported.input_names, args)
                                  if n is not None and isinstance(x, torch.Tensor)})
        except TorchImportError as e:
            # an op (or a dtype) GEIR has no mapping for: the same for every shape, so the whole graph goes eager
            self.eager_reason = _first_line(e)
            self._warn(self.eager_reason)
            return None
        except Exception as e:  # noqa: BLE001 - GE could not compile this shape: run it eagerly, say why
            self._warn(f"GE could not compile it for {_describe(args)} ({type(e).__name__}: {_first_line(e)})")
            fast = None
        self.compiled[key] = fast
        return fast

    def _warn(self, reason: str) -> None:
        warnings.warn(f"torch.compile backend 'geir': graph runs eagerly: {reason}", GeirFallbackWarning,
                      stacklevel=3)


def register() -> None:
    """Register `geir_backend` with TorchDynamo as "geir" (once; the entry point may have done it)."""
    from torch._dynamo.backends.registry import lookup_backend, register_backend

    try:
        register_backend(geir_backend, name=BACKEND_NAME)
    except AssertionError:
        # already registered: by an earlier import, or by torch itself through the entry point
        if lookup_backend(BACKEND_NAME) is not geir_backend:
            raise


def _concrete(x: Any) -> bool:
    """Whether a Dynamo example input is a real value (not a SymInt, nor a tensor with symbolic sizes)."""
    if isinstance(x, torch.Tensor):
        return all(isinstance(d, int) for d in x.shape)
    return not isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _needs_autograd(args: Sequence[Any]) -> bool:
    # Dynamo lifts the module's parameters to graph inputs, so in grad mode they arrive requiring grad;
    # results computed on the NPU would have no grad_fn and a backward through them would fail
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in args)


def _signature(args: Sequence[Any]) -> tuple:
    return tuple((str(x.dtype), tuple(x.shape)) if isinstance(x, torch.Tensor) else (type(x).__name__, x)
                 for x in args)


def _describe(args: Sequence[Any]) -> str:
    shapes = ["x".join(map(str, x.shape)) or "scalar" for x in args if isinstance(x, torch.Tensor)]
    return "inputs " + ", ".join(shapes[:6]) + (", ..." if len(shapes) > 6 else "")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
