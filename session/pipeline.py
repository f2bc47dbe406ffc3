"""GE's pipeline, defined once: the default pass lists, completing a pipeline with `lower`, running passes.

What compile_module, the plan cache's specialisations, compile-while-running and the fusion probe
all use, so that "the pipeline tail" (what a pipeline needs before `lower`) has one definition.
"""

from __future__ import annotations

import time
from typing import Iterable, Mapping

import numpy as np

from geir.diagnostics import DiagnosticEngine, DiagnosticError
from geir.ir import Graph, Module
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.runtime.interpreter import GraphCaptures, RunResult, Runtime, RuntimeListener
from geir.runtime.launch_memo import LaunchMemo
from geir.runtime.trace import GE, Span
from geir.target_npu.target import DEFAULT_TARGET, Target, as_target

DEFAULT_PIPELINE = "conv2d-im2col,canonicalize,cse,fuse,layout,tile,plan,lower"
NO_FUSE_PIPELINE = "conv2d-im2col,canonicalize,cse,layout,tile,plan,lower"


def lowering_pipeline(pipeline: str) -> list:
    """The passes of a pipeline, with what they require inserted and `lower` at the end."""
    passes = complete_pipeline(parse_pipeline(pipeline))
    if not passes or passes[-1].NAME != "lower":
        passes = complete_pipeline(passes + parse_pipeline("lower"))
    return passes


def run_passes(module: Module, passes: list, target: Target, emit=None, spans: list | None = None,
               t0: float | None = None, verify_each: bool = True, explain: bool = False,
               tiling_memo: dict | None = None, records: list | None = None) -> Module:
    """Run passes in place; each pass's span (GE's track, microseconds since `t0`) goes to `spans`, and the typed
    outcomes the passes report (tiling decisions, fusion outcomes, fusions undone) to `records`.

    Errors (and with `explain`, remarks) go to `emit`; errors raise DiagnosticError.
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
                     after=lambda p, m: record(Span(GE, p.NAME, marks[-1], now(), "ge")))
    ctx = PassContext(target=target, diagnostics=DiagnosticEngine(handle), explain=explain, tiling_memo=tiling_memo,
                      records=records if records is not None else [])
    if not pm.run(module, ctx):
        raise DiagnosticError(*[d for d in errors if d.severity == "error"] or errors)
    return module


def compile_module(module: Module, pipeline: str = DEFAULT_PIPELINE, target: Target | str = DEFAULT_TARGET,
                   emit=None, verify_each: bool = True) -> tuple[Module, list[Span]]:
    """Run GE's pipeline (ending in lower) in place; returns the module and each pass's span on GE's track.

    `verify_each=False` is the serving path: the IR is not re-verified between passes (the input was
    verified when it was read, and the passes are tested to keep it valid)."""
    spans: list[Span] = []
    return run_passes(module, lowering_pipeline(pipeline), as_target(target), emit, spans, verify_each=verify_each), spans


def run_program(program: Graph, inputs: Mapping[str, np.ndarray], resources: Mapping[str, np.ndarray] | None = None,
                target: Target | str = DEFAULT_TARGET, record_pipes: bool = False, timing_only: bool = False,
                resident: Iterable[str] = (), memo: LaunchMemo | None = None, keep: Iterable[int] = (),
                listeners: Iterable[RuntimeListener] = (), launch_mode: str = "single-op",
                graphs: GraphCaptures | None = None) -> RunResult:
    """Run a lowered rt.program on a fresh simulated chip (`resident`: inputs already on the device; `keep`:
    results that stay there, as DeviceTensors; `memo`: timing only, the launches earlier runs timed;
    `listeners`: told of every task as it runs; `launch_mode` "graph": the launches replayed from a task graph
    captured once per program in `graphs`, one submission a run)."""
    return Runtime(as_target(target), record_pipes=record_pipes, timing_only=timing_only,
                   memo=True if memo is None else memo, listeners=listeners, launch_mode=launch_mode,
                   graphs=graphs).run(program, inputs, resources, resident, keep)
