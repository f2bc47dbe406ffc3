"""Compile a graph with GE's pipeline and run it on the Runtime: what gerun and the benchmarks call."""

from __future__ import annotations

import time
from typing import Mapping

import numpy as np

from geir.diagnostics import DiagnosticEngine, DiagnosticError
from geir.ir import Graph, Module, clone_graph
from geir.ops.core import Const
from geir.types import TensorType
from geir.verifier import verify_graph
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.runtime.interpreter import RunResult, Runtime
from geir.target_npu.target import DEFAULT_TARGET, load_target

DEFAULT_PIPELINE = "canonicalize,fuse,layout,tile,plan,lower"
NO_FUSE_PIPELINE = "canonicalize,layout,tile,plan,lower"


def lowering_pipeline(pipeline: str) -> list:
    """The passes of a pipeline, with what they require inserted and `lower` at the end."""
    passes = complete_pipeline(parse_pipeline(pipeline))
    if not passes or passes[-1].NAME != "lower":
        passes = complete_pipeline(passes + parse_pipeline("lower"))
    return passes


def run_passes(module: Module, passes: list, target: str, emit=None, spans: list | None = None,
               t0: float | None = None, verify_each: bool = True) -> Module:
    """Run passes in place; each pass's (name, start_us, end_us) since `t0` goes to `spans`.

    Errors go to `emit` and raise DiagnosticError.
    """
    errors: list = []

    def handle(d) -> None:
        errors.append(d)
        if emit is not None:
            emit(d)

    t0 = time.perf_counter() if t0 is None else t0
    now = lambda: (time.perf_counter() - t0) * 1e6  # noqa: E731
    marks: list[float] = []
    record = spans.append if spans is not None else (lambda span: None)
    pm = PassManager(passes, verify_each=verify_each, before=lambda p, m: marks.append(now()),
                     after=lambda p, m: record((p.NAME, marks[-1], now())))
    if not pm.run(module, PassContext(target=target, diagnostics=DiagnosticEngine(handle))):
        raise DiagnosticError(*[d for d in errors if d.severity == "error"] or errors)
    return module


def compile_module(module: Module, pipeline: str = DEFAULT_PIPELINE, target: str = DEFAULT_TARGET,
                   emit=None) -> tuple[Module, list[tuple[str, float, float]]]:
    """Run GE's pipeline (ending in lower) in place; returns the module and (pass, start_us, end_us) per pass."""
    spans: list[tuple[str, float, float]] = []
    return run_passes(module, lowering_pipeline(pipeline), target, emit, spans), spans


def run_program(program: Graph, inputs: Mapping[str, np.ndarray], resources: Mapping[str, np.ndarray] | None = None,
                target: str = DEFAULT_TARGET, record_pipes: bool = False) -> RunResult:
    """Run a lowered rt.program on a fresh simulated chip."""
    return Runtime(load_target(target), record_pipes=record_pipes).run(program, inputs, resources)


# passes whose results depend on the concrete shapes: they run again for every new shape signature
SHAPE_DEPENDENT = ("tile", "plan", "lower")


class ShapeMismatch(ValueError):
    """Inputs whose shapes the graph cannot take (a static dimension differs, or the rank)."""


class Session:
    """A graph compiled once and specialised per input shape signature: GE's dynamic execution plan.

    The passes before the first shape-dependent one (tile, plan, lower) run once on the graph as
    written, `?` dimensions and all. When the Runtime binds inputs of a new shape signature, GE
    specialises a copy: shape inference, tiling, memory plan and lowering only. Programs are cached
    by signature (the plan cache); a signature seen before costs nothing.
    """

    def __init__(self, module: Module, pipeline: str = DEFAULT_PIPELINE, target: str = DEFAULT_TARGET, emit=None):
        passes = lowering_pipeline(pipeline)
        cut = next(i for i, p in enumerate(passes) if p.NAME in SHAPE_DEPENDENT)
        self.target = target
        self.emit = emit
        self.spans: list[tuple[str, float, float]] = []
        self.t0 = time.perf_counter()
        self.generic = self._run(Module([module.graphs[0]], module.file, module.resources), passes[:cut],
                                 "compile").graphs[0]
        self.specialise_passes = passes[cut:]
        self.cache: dict[tuple, Graph] = {}
        self.hits = 0
        self.misses = 0
        self.replan_s = 0.0

    def _run(self, module: Module, passes: list, label: str, verify_each: bool = True) -> Module:
        """Run passes, recording each one and the whole step as GE spans."""
        start = (time.perf_counter() - self.t0) * 1e6
        run_passes(module, passes, self.target, self.emit, self.spans, self.t0, verify_each)
        self.spans.append((label, start, (time.perf_counter() - self.t0) * 1e6))
        return module

    def signature(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
        """The shape signature of some inputs; ShapeMismatch when the graph cannot take them."""
        sig = []
        for a in self.generic.args:
            shape = tuple(int(d) for d in shapes[a.name])
            t = a.type
            if len(shape) != t.rank or any(d is not None and d != s for d, s in zip(t.shape, shape)):
                raise ShapeMismatch(f"input '{a.name}' has shape {list(shape)}, but %{a.name} is {t}")
            sig.append(shape)
        return tuple(sig)

    def program(self, shapes: Mapping[str, tuple[int, ...]]) -> Graph:
        """The lowered program for inputs of these shapes, from the cache or specialised now."""
        sig = self.signature(shapes)
        cached = self.cache.get(sig)
        if cached is not None:
            self.hits += 1
            return cached
        start = time.perf_counter()
        g = clone_graph(self.generic)
        for a, shape in zip(g.args, sig):
            a.type = TensorType(shape, a.type.dtype, a.type.format)
        for op in g.ops:
            if not isinstance(op, Const):
                for r in op.results:
                    r.type = None  # inferred again from the concrete shapes
        verify_graph(g, None, fill_types=True)
        g.result_types = [v.type for v in g.terminator.operands]
        # the generic graph was verified after every pass; its specialisations are on the hot path of a run
        program = self._run(Module([g], "<specialised>"), self.specialise_passes, f"specialise {list(sig)}",
                            verify_each=False).graphs[0]
        self.replan_s += time.perf_counter() - start
        self.misses += 1
        self.cache[sig] = program
        return program

    @property
    def plan_cache(self) -> dict[str, float]:
        """The profile's plan_cache: hits, misses and the milliseconds spent specialising."""
        return {"hits": self.hits, "misses": self.misses, "replan_ms": self.replan_s * 1e3}
