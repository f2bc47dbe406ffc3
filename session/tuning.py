"""Tuning: every tiled op's legal candidate tilings timed with the cost model, the best kept in a repository.

What getune does (CANN's AOE op tuning; TVM MetaSchedule's and Triton's autotuners). For each target the
graph is compiled up to `tile` with the rules; each distinct op (kernel, types, attributes) becomes a
`TuneOp` with the rules' tiling and its kernel's candidates (the TilingInterface). The candidates not yet
in the repository are timed on an `Executor` (in this process, or on Ray), chunk by chunk, each chunk's
times stored as it arrives, so an interrupted sweep resumes. An op's best is the fastest candidate
(ties go to the rules); before it is stored as the op's entry, one that is not the rules' own is run
with real numbers on a small instance of the op and judged against the float64 reference. Finally the
whole graph runs timing-only with the rules and with `tile{db=...}`: the graph's kernel time before and
after, on the program's own timeline (L2 and all).

Timing is a model of the chip, deterministic: the same candidates give the same times on every worker.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Sequence

import attrs

from geir.diagnostics import DiagnosticError, Location
from geir.ir import Module
from geir.kernels import KERNELS
from geir.kernels.tiling import KernelTiling, Miss, OpSignature
from geir.parser import parse
from geir.passes.tile import Tile, describe
from geir.passes.tuning_repository import Entry, TuningRepository, op_key, target_key, tiling_text
from geir.runtime.device import host_memory_problem, stand_in
from geir.runtime.profile import time_split
from geir.runtime.single_launch import check_numerics, launch_us
from geir.session.executors import Executor
from geir.session.pipeline import lowering_pipeline, run_passes, run_program
from geir.session.plan_cache import bind_shapes
from geir.target_npu.target import Target, load_target
from geir.types import TensorType

# GE's pipeline up to the tile pass: what decides which ops there are and what the rules give them
TUNE_PIPELINE = "conv2d-im2col,canonicalize,fuse,layout,tile"
GRAPH_PIPELINE = "conv2d-im2col,canonicalize,fuse,layout,tile,plan,lower"
CHUNK = 4  # candidates a task times: enough to outweigh a task's dispatch, few enough to spread


class TuneError(ValueError):
    """A graph that cannot be tuned (dynamic shapes with no binding, an argument named in no graph)."""


@attrs.frozen(eq=False)
class TuneOp:
    """One distinct tiled op on one target: where it occurs, the rules' tiling and the candidates to time."""

    sig: OpSignature
    target: Target
    spec: str  # how the target was named (a bundled name, a TOML path, a what-if chip): what the passes load
    buffers: int
    locs: tuple[Location, ...]
    rules: KernelTiling
    candidates: tuple[KernelTiling, ...]

    @property
    def key(self) -> str:
        return op_key(self.sig, self.buffers)

    @property
    def target_key(self) -> str:
        return target_key(self.target)


@attrs.frozen(eq=False)
class TimingJob:
    """Candidates of one op for one worker to time (what crosses to a Ray worker: plain typed values)."""

    sig: OpSignature
    target: Target
    tilings: tuple[KernelTiling, ...]


def time_job(job: TimingJob) -> list[tuple[str, float]]:
    """(tiling text, simulated us) of each candidate in the job: the work a worker does."""
    return [(tiling_text(t), launch_us(job.sig, t, job.target)) for t in job.tilings]


@attrs.frozen(eq=False)
class CheckJob:
    sig: OpSignature
    target: Target
    tiling: KernelTiling


def check_job(job: CheckJob) -> tuple[bool, str]:
    """Whether the tiling's numbers pass against the float64 reference on a small instance, and the report."""
    result = check_numerics(job.sig, job.tiling, job.target)
    return result.passed, result.render()


@attrs.frozen
class OpResult:
    """What tuning found for one op: the rules' tiling and time, the best and its time, what was timed."""

    op: TuneOp
    rules_us: float
    best: KernelTiling
    best_us: float
    timed_now: int  # candidates timed in this run (the rest came from the repository)
    check: str

    @property
    def speedup(self) -> float:
        return self.rules_us / self.best_us if self.best_us > 0 else 1.0

    def record(self) -> dict[str, Any]:
        """The op's line of `getune --json`."""
        return {"op": self.op.sig.name, "loc": str(self.op.locs[0]), "count": len(self.op.locs),
                "target": self.op.target.name, "rules_us": self.rules_us, "best_us": self.best_us,
                "speedup": self.speedup, "rules_tiling": self.op.rules.to_attr(), "tiling": self.best.to_attr(),
                "candidates": len(self.op.candidates), "timed": self.timed_now, "check": self.check}


@attrs.frozen
class GraphTimes:
    """The graph's kernel time on one target with the rules' tilings and with the repository's."""

    target: str
    rules_us: float
    best_us: float
    label: str = ""  # what a sweep changed at this point

    @property
    def speedup(self) -> float:
        return self.rules_us / self.best_us if self.best_us > 0 else 1.0

    def record(self) -> dict[str, Any]:
        return {"target": self.target, "label": self.label, "rules_us": self.rules_us, "best_us": self.best_us,
                "speedup": self.speedup}


@attrs.frozen
class TuneReport:
    """One getune run: each op's result, the graph before and after on each target, and the throughput."""

    ops: tuple[OpResult, ...]
    graphs: tuple[GraphTimes, ...]
    timed: int  # candidates timed in this run
    seconds: float  # host wall time of the timing (for candidates per second)
    workers: int
    check_seconds: float = 0.0  # host wall time of the numerics checks of the winners

    @property
    def candidates_per_second(self) -> float:
        return self.timed / self.seconds if self.seconds > 0 else 0.0

    def record(self) -> dict[str, Any]:
        """`getune --json`: the spec's `ops` and `graph` (the first target's), with every target's graph."""
        return {"ops": [o.record() for o in self.ops], "graph": self.graphs[0].record() if self.graphs else None,
                "graphs": [g.record() for g in self.graphs], "timed": self.timed, "workers": self.workers,
                "timing_seconds": self.seconds, "check_seconds": self.check_seconds,
                "candidates_per_second": self.candidates_per_second}

    def render(self) -> str:
        """The table getune prints: per op the rules and the best, then the graph on each target."""
        locs = [str(o.op.locs[0]) + (f" (x{len(o.op.locs)})" if len(o.op.locs) > 1 else "") for o in self.ops]
        width = max([24] + [len(x) for x in locs])
        chip = max([12] + [len(o.op.target.name) for o in self.ops])
        lines = [f"{'op':<20} {'loc':<{width}} {'target':<{chip}} {'rules us':>10} {'best us':>10} {'speedup':>8}  "
                 f"best tiling"]
        for o, loc in zip(self.ops, locs):
            same = o.best.to_attr() == o.op.rules.to_attr()
            lines.append(f"{o.op.sig.name[3:]:<20} {loc:<{width}} {o.op.target.name:<{chip}} {o.rules_us:>10.2f} "
                         f"{o.best_us:>10.2f} {o.speedup:>7.2f}x  "
                         + ("the rules' own (" + describe(o.best.to_attr()) + ")" if same
                            else f"{describe(o.best.to_attr())} (rules: {describe(o.op.rules.to_attr())})"))
        for g in self.graphs:
            lines.append(f"graph on {g.target}: kernel time {g.rules_us:.2f} us with the rules, {g.best_us:.2f} us "
                         f"tuned ({g.speedup:.2f}x)")
        lines.append(f"timed {self.timed} candidates on {self.workers} worker{'s' * (self.workers != 1)} in "
                     f"{self.seconds:.1f} s ({self.candidates_per_second:.1f} candidates/s of host time); the winners' "
                     f"numerics checked in {self.check_seconds:.1f} s")
        return "\n".join(lines)


# --- the steps --------------------------------------------------------------------------------------------

def specialised(text: str, shapes: dict[str, tuple[int, ...]], name: str = "<input>") -> Module:
    """The module parsed from `text`, with the named arguments bound to these shapes (its sizes folded)."""
    module = parse(text, name)
    known = {a.name: a.type for g in module.graphs for a in g.args}
    unknown = sorted(set(shapes) - set(known))
    if unknown:
        raise TuneError(f"no graph takes an argument %{unknown[0]} (--shape names an argument)")
    for arg, shape in shapes.items():
        problem = shape_problem(known[arg], shape)
        if problem:
            raise TuneError(f"--shape {arg}={'x'.join(map(str, shape))}: %{arg} is {known[arg]}: {problem}")
    for g in module.graphs:
        for a in g.args:
            if a.name not in shapes and not a.type.is_static:
                raise TuneError(f"argument %{a.name} of @{g.name} is {a.type}: give its shape with "
                                f"--shape {a.name}=DIMS (the timing needs every size)")
    if shapes:
        out = []
        for g in module.graphs:
            bound = bind_shapes(g, tuple(shapes.get(a.name, a.type.shape) for a in g.args))
            bound.name = g.name
            out.append(bound)
        module.graphs = out
    for g in module.graphs:
        # refused before anything is timed: a tensor the host cannot hold would fail (or swap for minutes) later
        too_big = host_memory_problem(g, timing_only=True)
        if too_big is not None:
            raise DiagnosticError(too_big)
    return module


def shape_problem(t: TensorType, shape: tuple[int, ...]) -> str | None:
    """Why an argument of type `t` cannot take `shape` (another rank, a static dimension that differs), or None."""
    if len(shape) != t.rank:
        return f"it has rank {t.rank}, not {len(shape)}"
    for i, (have, want) in enumerate(zip(t.shape, shape)):
        if have is not None and have != want:
            return f"dimension {i} is {have}, not {want}"
    return None


def ops_to_tune(module: Module, spec: str, buffers: int = 2) -> list[TuneOp]:
    """Each distinct tiled op of the module compiled with the rules for the target `spec` (compiled in place)."""
    target = load_target(spec)
    passes = [p if p.NAME != "tile" else Tile(buffers=buffers) for p in lowering_pipeline(TUNE_PIPELINE)
              if p.NAME not in ("plan", "lower")]
    run_passes(module, passes, spec)
    found: dict[tuple, list] = {}
    for graph in module.graphs:
        for op in graph.walk():
            if "tiling" not in op.attributes:
                continue
            sig = OpSignature.of(op)
            found.setdefault(sig.key, [sig, []])[1].append(op.loc)
    out = []
    for sig, locs in found.values():
        kernel = KERNELS[sig.name]
        rules = kernel.choose(sig, target, buffers)
        if isinstance(rules, Miss):
            continue
        cands = [rules]
        seen = {tiling_text(rules)}
        for c in kernel.candidates(sig, target, buffers):
            if tiling_text(c) not in seen:
                seen.add(tiling_text(c))
                cands.append(c)
        out.append(TuneOp(sig, target, spec, buffers, tuple(locs), rules, tuple(cands)))
    return out


def timing_jobs(ops: Sequence[TuneOp], repository: TuningRepository) -> list[tuple[TuneOp, TimingJob]]:
    """The candidates the repository has no time for, in chunks of CHUNK; the largest ops' first, so that the
    longest tasks do not start last and leave the other workers idle (longest-processing-time order)."""
    jobs = []
    for op in sorted(ops, key=lambda o: -max((t.num_elements or 0) for t in o.sig.operands + o.sig.results if t)):
        done = repository.measured(op.key, op.target_key)
        todo = [c for c in op.candidates if tiling_text(c) not in done]
        for i in range(0, len(todo), CHUNK):
            jobs.append((op, TimingJob(op.sig, op.target, tuple(todo[i:i + CHUNK]))))
    return jobs


def choose_best(ops: Sequence[TuneOp], times: Sequence[dict[str, float]], executor: Executor,
                repository: TuningRepository, timed_now: Sequence[int]) -> list[OpResult]:
    """For each op the fastest candidate whose numbers pass the check (the rules when none is faster), stored as
    the op's entry. The checks of all ops run together on the executor, round by round: an op whose best
    fails offers its next best in the next round."""
    queues, best, check = [], [], []
    for op, t in zip(ops, times):
        rules_us = t[tiling_text(op.rules)]
        order = sorted(range(len(op.candidates)), key=lambda i: (t[tiling_text(op.candidates[i])], i))
        queues.append([op.candidates[i] for i in order if t[tiling_text(op.candidates[i])] < rules_us])
        best.append(op.rules)
        check.append("the rules' own tiling")
    open_ = [i for i in range(len(ops)) if queues[i]]
    while open_:
        jobs, asked = [], []
        for i in open_:
            op, cand = ops[i], queues[i].pop(0)
            known = repository.entry(op.sig, op.buffers, op.target)
            if (known is not None and known.current and known.tiling == cand.to_attr()
                    and known.rules_tiling == op.rules.to_attr()):
                best[i], check[i] = cand, known.check  # checked when it was stored
                continue
            jobs.append(CheckJob(op.sig, op.target, cand))
            asked.append(i)
        for i, (passed, report) in zip(asked, executor.map(check_job, jobs)):
            if passed:
                best[i], check[i] = jobs[asked.index(i)].tiling, report
        open_ = [i for i in asked if best[i] is ops[i].rules and queues[i]]
    out = []
    for i, op in enumerate(ops):
        rules_us, best_us = times[i][tiling_text(op.rules)], times[i][tiling_text(best[i])]
        repository.store(op.sig, op.buffers, op.target_key, Entry(op.sig.name, op.rules.to_attr(), rules_us,
                                                                   best[i].to_attr(), best_us, len(op.candidates),
                                                                   check[i]))
        out.append(OpResult(op, rules_us, best[i], best_us, timed_now[i], check[i]))
    return out


def graph_kernel_us(module: Module, spec: str, db: str | None, entry: str | None = None,
                    buffers: int = 2) -> float:
    """The kernel time of the module's entry graph compiled for the target `spec` (with the repository at `db`,
    if given), run timing-only."""
    passes = [p if p.NAME != "tile" else Tile(buffers=buffers, db=db or "") for p in lowering_pipeline(GRAPH_PIPELINE)]
    compiled = run_passes(module, passes, spec)
    program = compiled.graph(entry)
    inputs = {a.name: stand_in(a.type) for a in program.args}
    result = run_program(program, inputs, target=spec, timing_only=True)
    return time_split(result)["kernel_time_us"]


@attrs.frozen
class Point:
    """One chip and shape binding to tune the graph for: a target spec (bundled, a TOML file or a what-if chip)
    and the shapes bound to named arguments; `label` says what a sweep changed."""

    spec: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    label: str = ""

    @property
    def shape_map(self) -> dict[str, tuple[int, ...]]:
        return dict(self.shapes)


def tune(text: str, points: Sequence[Point], executor: Executor, repository: TuningRepository, *,
         buffers: int = 2, name: str = "<input>", entry: str | None = None, graph_times: bool = True,
         progress: Callable[[int, int], None] | None = None) -> TuneReport:
    """Tune every tiled op of the module in `text` at each point (all points' candidates timed together on the
    executor); then time the graph before and after at each point."""
    per_point = [ops_to_tune(specialised(text, p.shape_map, name), p.spec, buffers) for p in points]
    # a point that shares an op with another (same chip, same types) tunes it once
    unique: dict[tuple[str, str], TuneOp] = {}
    for ops in per_point:
        for op in ops:
            unique.setdefault((op.key, op.target_key), op)
    ops = list(unique.values())
    jobs = timing_jobs(ops, repository)
    start = time.perf_counter()
    timed: dict[int, int] = {}
    for done, (index, times) in enumerate(executor.map_unordered(time_job, [j for _, j in jobs]), 1):
        op = jobs[index][0]
        repository.record(op.key, op.target_key, times)  # kept at once: an interrupted run resumes from here
        timed[id(op)] = timed.get(id(op), 0) + len(times)
        if progress is not None:
            progress(done, len(jobs))
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    results = choose_best(ops, [repository.measured(op.key, op.target_key) for op in ops], executor, repository,
                          [timed.get(id(op), 0) for op in ops])
    check_seconds = time.perf_counter() - start
    graphs = []
    if graph_times:
        for p in points:
            before = graph_kernel_us(specialised(text, p.shape_map, name), p.spec, None, entry, buffers)
            after = graph_kernel_us(specialised(text, p.shape_map, name), p.spec, str(repository.path), entry,
                                    buffers)
            graphs.append(GraphTimes(load_target(p.spec).name, before, after, p.label))
    return TuneReport(tuple(results), tuple(graphs), sum(timed.values()), seconds, executor.workers, check_seconds)


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 1.0
