"""Compile while running: GE compiles subgraph k+1 while the device runs subgraph k, on one modelled timeline.

A multi-layer graph is cut into consecutive subgraphs where a single activation crosses (between
transformer layers, the residual stream). GE compiles them one after another; the Runtime starts
on subgraph 0 as soon as it is compiled instead of waiting for the whole graph. GE's compile of
each part is measured in host time (GE really does it here); each part's run is its simulated
timeline (the Runtime's submissions, the copies, the kernels). The two are placed on one axis by
their dependencies: no threads, so the figures do not depend on how slow numpy is or how loaded
the host is. The point is how soon the first kernel starts and how much of GE's work hides behind
the device's; when compiling a part takes longer than the device's run of the one before, GE is
the bottleneck and little can hide (the seed's claim needs device work to hide behind).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import attrs
import numpy as np

from geir.builder import Builder, clone_op
from geir.ir import Graph, Module, Operation, Value
from geir.ops.core import Const
from geir.runtime.device import stand_in
from geir.runtime.interpreter import RunResult
from geir.runtime.launch_memo import LaunchMemo
from geir.runtime.profile import time_split
from geir.runtime.trace import Span, Trace, Track, chrome_trace_json
from geir.session.pipeline import DEFAULT_PIPELINE, compile_module, run_program
from geir.session.plan_cache import bind_shapes
from geir.target_npu.target import DEFAULT_TARGET, Target, as_target
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
class Schedule:
    """GE's compiles and the parts' runs placed on one modelled timeline (microseconds from the request)."""

    compile_spans: list[tuple[str, float, float]]  # (part, start, end) of GE's host work
    run_spans: list[tuple[str, float, float]]  # (part, start, end): the Runtime's submissions and the device
    time_to_first_kernel_us: float
    end_to_end_us: float
    compile_hidden_us: float  # GE's compile time spent while an earlier part ran on the device

    @staticmethod
    def place(names: list[str], compile_us: list[float], run_us: list[float], first_kernel_us: float,
              overlap: bool) -> "Schedule":
        """GE compiles the parts one after another; part k runs once it is compiled and part k-1 is done
        (overlap), or once every part is compiled (compile-then-run)."""
        compile_spans, run_spans = [], []
        t = 0.0
        for name, c in zip(names, compile_us):
            compile_spans.append((f"compile {name}", t, t + c))
            t += c
        ready = [end for _, _, end in compile_spans] if overlap else [t] * len(names)
        end = 0.0
        for name, r, at in zip(names, run_us, ready):
            start = max(at, end)
            end = start + r
            run_spans.append((f"run {name}", start, end))
        hidden = sum(max(0.0, min(ce, re) - max(cs, rs)) for _, cs, ce in compile_spans for _, rs, re in run_spans)
        return Schedule(compile_spans, run_spans, run_spans[0][1] + first_kernel_us, end, hidden)


# the schedule's tracks, on one modelled clock
COMPILE_TRACK = Track(0, 0, "modelled timeline", "GE (host)")
RUN_TRACK = Track(0, 1, "modelled timeline", "Runtime and device")


@attrs.frozen
class PipelinedRun:
    """The outputs of a partitioned run, each part's measured compile and simulated run, and both schedules.

    GE's compile of each part is measured in host time (GE really does it); each part's run is its
    simulated timeline (the Runtime's submissions and the device). Both schedules are placed from the
    same measurements, so the comparison does not depend on how loaded the host is between them.
    """

    outputs: list[np.ndarray]
    results: list[RunResult]
    names: list[str]
    compile_us: list[float]

    @property
    def run_us(self) -> list[float]:
        """Each part's run: from the Runtime's first submission to the end of its last task."""
        return [max((t.end_us for t in r.tasks), default=0.0) for r in self.results]

    def schedule(self, overlap: bool) -> Schedule:
        """GE compiling part k+1 while the device runs part k (overlap), or everything compiled first."""
        first = min((t.start_us for t in self.results[0].tasks if t.kind == "kernel"), default=0.0)
        return Schedule.place(self.names, self.compile_us, self.run_us, first, overlap)

    def ge_bound_parts(self) -> list[tuple[str, float, float]]:
        """(part, its compile us, the previous part's run us) where compiling took longer than the run it hides behind."""
        return [(self.names[k], self.compile_us[k], self.run_us[k - 1]) for k in range(1, len(self.names))
                if self.compile_us[k] > self.run_us[k - 1]]

    def summary(self) -> dict[str, Any]:
        """The spec's overlap_compile figures (us), the compile-then-run figures beside them, and the GE-bound parts."""
        ovl, seq = self.schedule(True), self.schedule(False)
        bound = self.ge_bound_parts()
        return {"parts": len(self.names),
                "time_to_first_kernel_us": ovl.time_to_first_kernel_us,
                "compile_hidden_us": ovl.compile_hidden_us,
                "end_to_end_us": ovl.end_to_end_us,
                "compile_then_run_us": seq.end_to_end_us,
                "compile_then_run_first_kernel_us": seq.time_to_first_kernel_us,
                "compile_us": sum(self.compile_us),
                "device_us": sum(self.run_us),
                "kernel_time_us": sum(time_split(r)["kernel_time_us"] for r in self.results),
                "ge_bound": bool(bound),
                "ge_bound_parts": [{"part": p, "compile_us": c, "previous_run_us": r} for p, c, r in bound]}

    def verdict(self) -> str:
        """One sentence: whether the overlap hid GE's work, or GE was the bottleneck and by how much."""
        s = self.summary()
        hidden = f"{s['compile_hidden_us']:.0f} of {s['compile_us']:.0f} us of compile ran while earlier parts ran"
        waiting = len(s["ge_bound_parts"])
        if not waiting:
            return f"the device's work hid GE's: {hidden}"
        worst = max(s["ge_bound_parts"], key=lambda b: b["compile_us"] - b["previous_run_us"])
        why = (f"compiling {worst['part']} took {worst['compile_us']:.0f} us, longer than the device's "
               f"{worst['previous_run_us']:.1f} us run of the part before it")
        if waiting * 2 < s["parts"] - 1:
            return f"the device's work hid most of GE's: {hidden}; {waiting} of {s['parts'] - 1} parts waited for GE ({why})"
        return f"GE is the bottleneck: {why} ({waiting} of {s['parts'] - 1} parts wait for GE); {hidden}"

    def timeline(self, overlap: bool = True) -> Trace:
        """The schedule as the one typed timeline (geir.runtime.trace): GE's compile of each part beside each
        part's run."""
        sched = self.schedule(overlap)
        trace = Trace([Span(COMPILE_TRACK, name, start, end, "ge") for name, start, end in sched.compile_spans])
        for n, (name, start, end) in enumerate(sched.run_spans):
            trace.spans.append(Span(RUN_TRACK, name, start, end, "run",
                                    {"kernel_time_us": time_split(self.results[n])["kernel_time_us"],
                                     "kernels": len(self.results[n].kernels)}))
        return trace

    def trace(self, overlap: bool = True) -> str:
        """Chrome trace of the schedule's timeline."""
        return chrome_trace_json(self.timeline(overlap), display_unit="ms")


def run_pipelined(module: Module, inputs: Mapping[str, np.ndarray], resources: Mapping[str, np.ndarray] | None = None,
                  *, parts: int = 4, pipeline: str = DEFAULT_PIPELINE, target: Target | str = DEFAULT_TARGET,
                  timing_only: bool = False) -> PipelinedRun:
    """Partition the graph, compile each part (measuring GE's host time) and run it on the simulated chip.

    Dynamic dimensions are bound from the inputs first. The result places both schedules,
    compile-while-running and compile-then-run, on one modelled timeline.
    """
    target = as_target(target)
    graph = module.graphs[0]
    shapes = tuple(tuple(np.shape(inputs[a.name])) for a in graph.args)
    bound = bind_shapes(graph, shapes)
    subgraphs = partition(bound, parts)
    resources = dict(resources if resources is not None else module.resources)
    values: dict[str, np.ndarray] = {a.name: np.asarray(inputs[a.name]) for a in graph.args}
    results: list[RunResult] = []
    compile_us: list[float] = []
    memo = LaunchMemo()  # timing only: a part's launches identical to an earlier part's are replayed
    for g in subgraphs:
        start = time.perf_counter()
        # the serving path, as the plan cache's re-plans: no re-verification between passes
        program = compile_module(Module([g], module.file, resources), pipeline, target, verify_each=False)[0].graphs[0]
        compile_us.append((time.perf_counter() - start) * 1e6)
        feed = {a.name: values[a.name] if a.name in values else stand_in(a.type) for a in g.args}
        result = run_program(program, feed, resources, target=target, timing_only=timing_only, memo=memo)
        results.append(result)
        for v, out in zip(g.terminator.operands, result.outputs):
            values[v.name] = out
    outputs = [values.get(v.name) for v in _final_values(bound)] if not timing_only else []
    return PipelinedRun(outputs, results, [g.name for g in subgraphs], compile_us)


def _final_values(graph: Graph) -> list[Value]:
    return list(graph.terminator.operands)
