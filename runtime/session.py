"""Compile a graph with GE's pipeline and run it on the Runtime: what gerun and the benchmarks call."""

from __future__ import annotations

import time
from typing import Mapping

import numpy as np

from geir.diagnostics import DiagnosticEngine, DiagnosticError
from geir.ir import Graph, Module
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.runtime.interpreter import RunResult, Runtime
from geir.target_npu.target import DEFAULT_TARGET, load_target

DEFAULT_PIPELINE = "canonicalize,fuse,layout,tile,plan,lower"
NO_FUSE_PIPELINE = "canonicalize,layout,tile,plan,lower"


def compile_module(module: Module, pipeline: str = DEFAULT_PIPELINE, target: str = DEFAULT_TARGET,
                   emit=None) -> tuple[Module, list[tuple[str, float, float]]]:
    """Run GE's pipeline (ending in lower) in place; returns the module and (pass, start_us, end_us) per pass.

    Errors go to `emit` and raise DiagnosticError.
    """
    passes = complete_pipeline(parse_pipeline(pipeline))
    if not passes or passes[-1].NAME != "lower":
        passes = complete_pipeline(passes + parse_pipeline("lower"))
    errors: list = []

    def handle(d) -> None:
        errors.append(d)
        if emit is not None:
            emit(d)

    engine = DiagnosticEngine(handle)
    spans: list[tuple[str, float, float]] = []
    t0 = time.perf_counter()

    def before(p, m) -> None:
        spans.append((p.NAME, (time.perf_counter() - t0) * 1e6, 0.0))

    def after(p, m) -> None:
        name, start, _ = spans[-1]
        spans[-1] = (name, start, (time.perf_counter() - t0) * 1e6)

    pm = PassManager(passes, before=before, after=after)
    if not pm.run(module, PassContext(target=target, diagnostics=engine)):
        raise DiagnosticError(*[d for d in errors if d.severity == "error"] or errors)
    return module, spans


def run_program(program: Graph, inputs: Mapping[str, np.ndarray], resources: Mapping[str, np.ndarray] | None = None,
                target: str = DEFAULT_TARGET, record_pipes: bool = False) -> RunResult:
    """Run a lowered rt.program on a fresh simulated chip."""
    return Runtime(load_target(target), record_pipes=record_pipes).run(program, inputs, resources)
