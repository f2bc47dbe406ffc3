"""The plan cache: a graph compiled once and specialised per input shape signature (GE's dynamic execution plan)."""

from __future__ import annotations

import time
from typing import Mapping

import attrs

from geir.builder import clone_graph
from geir.diagnostics import DiagnosticError, Location
from geir.ir import Graph, Module
from geir.kernels import KERNELS
from geir.kernels.tiling import KernelTiling
from geir.ops.core import Const
from geir.passes.const_fold import fold_sizes
from geir.passes.fusion_guards import FusionGuards, Unfusion
from geir.passes.tile import TilingDecision
from geir.runtime.trace import GE, Span
from geir.session.pipeline import DEFAULT_PIPELINE, lowering_pipeline, run_passes
from geir.target_npu.target import DEFAULT_TARGET, Target, as_target
from geir.types import TensorType
from geir.verifier import verify_graph


def bind_shapes(graph: Graph, shapes: tuple[tuple[int, ...], ...]) -> Graph:
    """A copy of `graph` whose arguments have these shapes, its size arithmetic evaluated, and every result its
    inferred (static) type."""
    g = clone_graph(graph)
    for a, shape in zip(g.args, shapes):
        a.type = TensorType(shape, a.type.dtype, a.type.format)
    for op in g.ops:
        if not isinstance(op, Const):
            for r in op.results:
                r.type = None  # inferred again from the concrete shapes
    verify_graph(g, None, fill_types=True)
    fold_sizes(g)  # the size arithmetic of a dynamic-shape program, now that its shapes are known
    g.result_types = [v.type for v in g.terminator.operands]
    return g


# passes whose results depend on the concrete shapes: they run again for every new shape signature
# (layout too, so that a fusion undone for a shape gets its storage formats like any other op)
SHAPE_DEPENDENT = ("layout", "tile", "plan", "lower")


class ShapeMismatch(ValueError):
    """Inputs whose shapes the graph cannot take (a static dimension differs, or the rank)."""


@attrs.frozen
class Retiling:
    """An op whose tiling changed since the last plan that had it."""

    op: str
    loc: Location
    old: KernelTiling
    new: KernelTiling

    def render(self) -> str:
        return f"{self.op} at {self.loc}: {self.old.rule} -> {self.new.rule}"


@attrs.frozen
class Replan:
    """What GE changed for one new shape signature, and why (gerun --explain, the trace)."""

    signature: tuple[tuple[int, ...], ...]
    ms: float
    unfusions: tuple[Unfusion, ...]  # fusions undone by their shape guard
    retilings: tuple[Retiling, ...]  # ops whose tiling changed since the last plan
    tiled: int  # ops with a tiling in this specialisation
    arena_size: int

    @property
    def unfused(self) -> list[str]:
        """"flash_attention at FILE:L:C: reason", per fusion undone."""
        return [f"{u.op} at {u.loc}: {u.reason}" for u in self.unfusions]

    @property
    def retiled(self) -> list[str]:
        """"matmul at FILE:L:C: OLD -> NEW" (the rules that chose them), per op re-tiled."""
        return [r.render() for r in self.retilings]

    def summary(self) -> str:
        """One line: the signature, the cost and what changed."""
        shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in self.signature)
        changed = [f"{len(self.unfused)} fusion(s) undone" if self.unfused else "fusions kept",
                   f"{len(self.retiled)} of {self.tiled} tiled op(s) re-tiled", f"arena {self.arena_size} B"]
        return f"re-plan for [{shapes}] in {self.ms:.1f} ms: " + ", ".join(changed)

    def as_dict(self) -> dict:
        return {"signature": [list(s) for s in self.signature], "replan_ms": self.ms, "unfused": self.unfused,
                "retiled": self.retiled, "tiled_ops": self.tiled, "arena_size": self.arena_size}


def _changed(old: KernelTiling, new: KernelTiling) -> bool:
    """Whether an op was re-tiled: other blocks or budgets, or the same blocks cutting the work into other units."""
    return old != new or getattr(old, "work_units", None) != getattr(new, "work_units", None)


class Session:
    """A graph compiled once and specialised per input shape signature: GE's dynamic execution plan.

    The passes before the first shape-dependent one (layout, tile, plan, lower) run once on the
    graph as written, `?` dimensions and all; `fuse` decides there, optimistically where a fused
    kernel's guard needs a dimension that is not known yet. When the Runtime binds inputs of a
    new shape signature, GE specialises a copy: shape inference, the fused ops' shape guards
    (`fusion-guards`: a fusion the kernel cannot take at this shape is undone, only there), then
    layout, tiling (ops whose shapes did not change keep their tiling), memory plan and lowering.
    Programs are cached by signature (the plan cache); a signature seen before costs nothing.
    """

    def __init__(self, module: Module, pipeline: str = DEFAULT_PIPELINE, target: Target | str = DEFAULT_TARGET, emit=None,
                 explain: bool = False):
        passes = lowering_pipeline(pipeline)
        KERNELS.load()  # registered now: the compile's host time below counts GE's work, not imports
        cut = next(i for i, p in enumerate(passes) if p.NAME in SHAPE_DEPENDENT)
        self.target = as_target(target)  # a name is loaded once, here
        self.emit = emit
        self.explain = explain
        self.spans: list[Span] = []  # GE's host work, typed spans on GE's track (geir.runtime.trace)
        self.t0 = time.perf_counter()
        self.tiling_memo: dict = {}
        self._records: list = []  # the typed outcomes the passes of the step running now report
        self._last_tilings: dict = {}  # (location, op, n-th there) -> its tiling in the latest plan that had it
        start = time.perf_counter()
        self.generic = self._run(Module([module.graphs[0]], module.file, module.resources), passes[:cut],
                                 "compile").graphs[0]
        # GE's host time: the compile once, and what the latest `program` call cost (0 on a plan-cache hit)
        self.compile_us = (time.perf_counter() - start) * 1e6
        self.last_ge_us = 0.0
        guards = [FusionGuards()] if any(p.NAME == "fuse" for p in passes[:cut]) else []
        self.specialise_passes = guards + passes[cut:]
        self.cache: dict[tuple, Graph] = {}
        self.replans: list[Replan] = []
        self.hits = 0
        self.misses = 0
        self.replan_s = 0.0

    def _run(self, module: Module, passes: list, label: str, verify_each: bool = True) -> Module:
        """Run passes, recording each one and the whole step as GE spans."""
        start = (time.perf_counter() - self.t0) * 1e6
        run_passes(module, passes, self.target, self.emit, self.spans, self.t0, verify_each, explain=self.explain,
                   tiling_memo=self.tiling_memo, records=self._records)
        self.spans.append(Span(GE, label, start, (time.perf_counter() - self.t0) * 1e6, "ge"))
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
            self.last_ge_us = 0.0
            return cached
        start = time.perf_counter()
        try:
            g = bind_shapes(self.generic, sig)
        except DiagnosticError as e:  # a size the signature does not settle: said at its op, as a pass would
            for d in e.diagnostics if self.emit is not None else ():
                self.emit(d)
            raise
        self._records = []
        # the generic graph was verified after every pass; its specialisations are on the hot path of a run
        label = "specialise [" + ", ".join("x".join(map(str, s)) for s in sig) + "]"
        program = self._run(Module([g], "<specialised>"), self.specialise_passes, label,
                            verify_each=False).graphs[0]
        elapsed = time.perf_counter() - start
        self.last_ge_us = elapsed * 1e6
        self.replan_s += elapsed
        self.misses += 1
        self.cache[sig] = program
        self.replans.append(self._replan(sig, elapsed, program))
        self.spans[-1] = attrs.evolve(self.spans[-1], args=self.replans[-1].as_dict())  # what the re-plan changed
        return program

    def _replan(self, sig: tuple, elapsed: float, program: Graph) -> Replan:
        """What this specialisation changed against the previous one (or the first plan)."""
        tilings: dict[tuple[Location, str, int], TilingDecision] = {}
        seen: dict[tuple[Location, str], int] = {}  # ops sharing a location (a fusion undone) are told apart by order
        for d in self._records:
            if isinstance(d, TilingDecision) and d.tiling is not None:
                n = seen[(d.loc, d.op)] = seen.get((d.loc, d.op), -1) + 1
                tilings[(d.loc, d.op, n)] = d
        previous = self._last_tilings
        retiled = tuple(Retiling(d.op, d.loc, previous[key].tiling, d.tiling) for key, d in tilings.items()
                        if key in previous and _changed(previous[key].tiling, d.tiling))
        self._last_tilings.update(tilings)  # an op absent from this plan keeps its last tiling for the next comparison
        unfused = tuple(r for r in self._records if isinstance(r, Unfusion))
        memory = program.attributes.get("memory") or {}
        return Replan(sig, elapsed * 1e3, unfused, retiled, len(tilings), int(memory.get("arena", 0)))

    @property
    def plan_cache(self) -> dict[str, float]:
        """The profile's plan_cache: hits, misses and the milliseconds spent specialising."""
        return {"hits": self.hits, "misses": self.misses, "replan_ms": self.replan_s * 1e3}
