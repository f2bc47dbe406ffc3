"""Compile while running: GE compiles subgraph k+1 on a background thread while the Runtime runs k.

A multi-layer graph is cut into consecutive subgraphs where a single activation crosses (between
transformer layers, the residual stream). GE compiles them one after another on a worker thread;
the Runtime starts on subgraph 0 as soon as it is ready instead of waiting for the whole graph.
numpy releases the GIL inside its kernels, so the two threads really overlap. Everything here is
host wall-clock time (each run's simulated device time is reported beside it): the point is how
soon the first kernel starts and how much of GE's work hides behind the Runtime's.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import attrs
import numpy as np

from geir.builder import Builder, clone_op
from geir.ir import Graph, Module, Operation, Value
from geir.ops.core import Const
from geir.runtime.interpreter import RunResult
from geir.runtime.profile import profile
from geir.session.pipeline import DEFAULT_PIPELINE, compile_module, run_program
from geir.session.plan_cache import bind_shapes
from geir.target_npu.target import DEFAULT_TARGET
from geir.traits import Terminator


def _is_const(v: Value) -> bool:
    return isinstance(v.owner, Const)


def cut_points(graph: Graph) -> list[int]:
    """Op indices before which exactly one computed value (not a constant, not an argument) is live."""
    ops = [op for op in graph.ops if not op.has_trait(Terminator)]
    position = {id(op): i for i, op in enumerate(ops)}
    last_use: dict[int, int] = {}
    for i, op in enumerate(ops):
        for v in op.operands:
            last_use[id(v)] = i
    end = len(ops)
    for v in graph.terminator.operands:
        last_use[id(v)] = end
    live_from = [0] * (end + 1)  # live_from[i]: computed values defined before i and used at or after i
    for op in ops:
        if isinstance(op, Const):
            continue
        for r in op.results:
            last = last_use.get(id(r))
            if last is not None and last > position[id(op)]:
                for i in range(position[id(op)] + 1, last + 1):
                    live_from[i] += 1
    return [i for i in range(1, end) if live_from[i] == 1 and not isinstance(ops[i], Const)]


def partition(graph: Graph, parts: int) -> list[Graph]:
    """Cut a static-shape ge.graph into at most `parts` consecutive subgraphs of similar size.

    Each subgraph takes the graph arguments and earlier results it uses, clones the constants it
    uses, and returns what later subgraphs (or the graph's result) need.
    """
    ops = [op for op in graph.ops if not op.has_trait(Terminator)]
    candidates = cut_points(graph)
    cuts: list[int] = []
    for k in range(1, parts):
        target = k * len(ops) / parts
        best = min((c for c in candidates if not cuts or c > cuts[-1]), key=lambda c: abs(c - target), default=None)
        if best is not None and best not in cuts:
            cuts.append(best)
    bounds = [0] + cuts + [len(ops)]
    pieces = [ops[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    owner_piece = {id(op): n for n, piece in enumerate(pieces) for op in piece}
    needed_later: set[int] = {id(v) for v in graph.terminator.operands}
    for n, piece in enumerate(pieces):
        for op in piece:
            for v in op.operands:
                if v.owner is not None and not _is_const(v) and owner_piece[id(v.owner)] != n:
                    needed_later.add(id(v))
    graphs = []
    for n, piece in enumerate(pieces):
        graphs.append(_subgraph(graph, n, piece, needed_later))
    return graphs


def _subgraph(graph: Graph, n: int, piece: list[Operation], needed_later: set[int]) -> Graph:
    """One piece as a ge.graph of its own (values keep their names; unnamed ones get one)."""
    b = Builder(Graph(f"{graph.name}_part{n}", [], [], loc=graph.loc))
    mapping: dict[int, Value] = {}
    inside = {id(op) for op in piece}

    def name_of(v: Value) -> str:
        if v.name is None:
            v.name = f"v{id(v) & 0xFFFFFF:x}"
        return v.name

    def clone(op: Operation) -> None:
        b.insert(clone_op(op, [value(v) for v in op.operands], mapping))

    def value(v: Value) -> Value:
        if id(v) not in mapping:
            if v.owner is not None and id(v.owner) not in inside and _is_const(v):
                clone(v.owner)  # a constant used here: this subgraph holds its own copy
            else:
                mapping[id(v)] = b.argument(v.type, name_of(v), loc=v.loc)
        return mapping[id(v)]

    for op in piece:
        clone(op)
    outs = [mapping[id(r)] for op in piece for r in op.results if id(r) in needed_later]
    for v in outs:
        name_of(v)
    return b.finish(outs, loc=graph.loc)


@attrs.frozen
class PipelinedRun:
    """The outputs of a partitioned run and its host timeline (seconds since the start)."""

    outputs: list[np.ndarray]
    results: list[RunResult]
    compile_spans: list[tuple[str, float, float]]  # (part, start, end) on GE's worker thread
    run_spans: list[tuple[str, float, float]]  # (part, start, end) on the Runtime's thread
    total_s: float
    overlapped: bool

    @property
    def time_to_first_kernel_s(self) -> float:
        return self.run_spans[0][1]

    def summary(self) -> dict[str, Any]:
        """The figures gerun reports: parts, time to first kernel, total, and how much compile was hidden."""
        compile_s = sum(e - s for _, s, e in self.compile_spans)
        hidden = sum(max(0.0, min(ce, re) - max(cs, rs)) for _, cs, ce in self.compile_spans
                     for _, rs, re in self.run_spans)
        return {"parts": len(self.run_spans), "overlapped": self.overlapped,
                "time_to_first_kernel_ms": self.time_to_first_kernel_s * 1e3, "total_ms": self.total_s * 1e3,
                "compile_ms": compile_s * 1e3, "compile_hidden_ms": hidden * 1e3,
                "simulated_time_us": sum(profile(r)["simulated_time_us"] for r in self.results)}

    def trace(self) -> str:
        """Chrome trace of the host: GE's compile of each part beside the Runtime's run of each (wall clock)."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "host (wall clock)"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "GE"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "Runtime"}},
        ]
        for tid, spans in ((0, self.compile_spans), (1, self.run_spans)):
            for n, (name, start, end) in enumerate(spans):
                args = {}
                if tid == 1:
                    args = {"simulated_us": profile(self.results[n])["simulated_time_us"],
                            "kernels": len(self.results[n].kernels)}
                events.append({"ph": "X", "name": name, "pid": 0, "tid": tid, "ts": start * 1e6,
                               "dur": (end - start) * 1e6, "args": args})
        return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def run_pipelined(module: Module, inputs: Mapping[str, np.ndarray], resources: Mapping[str, np.ndarray] | None = None,
                  *, parts: int = 4, pipeline: str = DEFAULT_PIPELINE, target: str = DEFAULT_TARGET,
                  overlap: bool = True) -> PipelinedRun:
    """Partition the graph, compile the parts on a worker thread and run each as soon as it is ready.

    With `overlap=False` every part is compiled before the first runs (compile-then-run), for
    comparison. Dynamic dimensions are bound from the inputs first.
    """
    graph = module.graphs[0]
    shapes = tuple(tuple(np.shape(inputs[a.name])) for a in graph.args)
    bound = bind_shapes(graph, shapes)
    subgraphs = partition(bound, parts)
    resources = dict(resources if resources is not None else module.resources)
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    compile_spans: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def compile_part(g: Graph) -> Graph:
        start = clock()
        program = compile_module(Module([g], module.file, resources), pipeline, target)[0].graphs[0]
        with lock:
            compile_spans.append((f"compile {g.name}", start, clock()))
        return program

    values: dict[str, np.ndarray] = {a.name: np.asarray(inputs[a.name]) for a in graph.args}
    results: list[RunResult] = []
    run_spans: list[tuple[str, float, float]] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ge-compile") as pool:
        futures = [pool.submit(compile_part, g) for g in subgraphs]
        if not overlap:
            for f in futures:
                f.result()
        for g, f in zip(subgraphs, futures):
            program = f.result()
            start = clock()
            result = run_program(program, {a.name: values[a.name] for a in g.args}, resources, target=target)
            run_spans.append((f"run {g.name}", start, clock()))
            results.append(result)
            for v, out in zip(g.terminator.operands, result.outputs):
                values[v.name] = out
    outputs = [values[v.name] if v.name in values else None for v in _final_values(bound)]
    return PipelinedRun(outputs, results, sorted(compile_spans, key=lambda s: s[1]), run_spans, clock(), overlap)


def _final_values(graph: Graph) -> list[Value]:
    return list(graph.terminator.operands)
