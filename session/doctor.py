"""gedoctor's analysis: which layer of the stack to look at first when a program is slow.

The seed article's three questions, asked in its order, each answered with simulated figures:
1. GE fusion: did fusion take effect? Each attention-shaped candidate is fused, or not and why;
   a miss is priced by running one `ge.flash_attention` on the same q, k, v against the time the
   candidate's unfused kernels took in the run.
2. Runtime: did data movement overlap compute? Per kernel: double buffering, msprof's overlap
   ratio and memory_bound, and how long the compute pipes sat idle waiting on data flags or on a
   free buffer slot (the Runtime books every pipe's idle time when the doctor runs it).
3. Kernels: is each near its limit? Achieved FLOP/s against the roofline for its arithmetic
   intensity (geir.runtime.roofline), with its busiest pipe. An op GE placed on the AI CPU (no AI
   Core kernel takes it) has no AI Core kernel to judge: when it costs a large share of the time it
   is the kernel layer's finding, named with GE's reason for the placement and its time.

The culprit is the first layer, in that order, with a finding past its threshold; the finding
that decided it carries the evidence. Before them, on the run's one timeline: GE's host work
(`ge-host`, when the compile or re-plan the run waited for is most of its end-to-end time; the
doctor judges a warm run, a plan-cache hit, unless asked for a cold one) and the Runtime's
submissions (host-bound, when the device sits idle waiting for tasks to be submitted). Host-device
copies of the program's inputs and results are reported with their share of end to end: they
belong to the program's interface (keep inputs resident on the device to save them), not to a
layer's tuning.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from geir.builder import clone_graph
from geir.diagnostics import DiagnosticError, Location
from geir.ir import Graph, Module, Operation
from geir.kernels.base import KernelStats
from geir.parser import parse
from geir.session.fusion_probe import (
    ATTENTION_RULE,
    FUSED_KERNEL,
    Candidate,
    Probe,
    attention_operands,
    attention_region,
    probe_fusion,
)
from geir.runtime.interpreter import RunResult, Runtime, RuntimeFailure
from geir.runtime.profile import kernel_profile, union_us
from geir.runtime.roofline import Roofline, roofline
from geir.passes.placement import Placement
from geir.session.pipeline import compile_module, lowering_pipeline, run_passes
from geir.target_npu.sim import PIPES
from geir.target_npu.target import Target
from geir.types import TensorType
from geir.verifier import infer_types_again


# GE's host work comes first on the timeline: a run that waits for GE cannot be saved by the device
# host-launch: the device waits for the host to submit launch after launch (fusion first: fewer launches)
LAYERS = ("ge-host", "fusion", "host-launch", "runtime", "kernel")
CULPRITS = LAYERS + ("none",)
# GE's host work (a compile or re-plan the run waited for) is the culprit when it takes more than this
# share of the run's end-to-end time: then no device-side improvement can win back much
GE_HOST_SHARE = 0.5
# The Runtime is host-bound when the device sits idle this share of its span with every task
# started the moment it was submitted: the host's submissions, not the device, set the pace
HOST_BOUND_IDLE = 0.5
SEVERITIES = ("high", "medium", "info")

# A fusion miss is the culprit when fusing it would win back at least this share of the device
# time: a tenth is more than run-to-run tuning elsewhere usually recovers, and below it the other
# layers' problems are the bigger ones.
FUSION_MISS_SHARE = 0.10
# Kernels under this share of the device time are listed but not judged: speeding one up by any
# amount changes the program by less than this.
KERNEL_SHARE = 0.10
# The busier compute pipe (cube or vector) idle this share of a kernel's time waiting on data flags
# or buffer slots means data movement was not hidden. Fused FlashAttention on the 910B at the
# spec's overlap sizes waits 10-25 % with double buffering and 50-60 % with one buffer.
COMPUTE_WAIT = 0.35
# msprof's overlap_ratio below this: data movement and compute ran mostly one after the other.
POOR_OVERLAP = 0.2
# memory_bound (mte2 / max(cube, vector)) past this: data movement is the work itself, and overlap
# can hide at most the compute under it: the kernel is bound by memory, judged by its roofline.
MEMORY_DOMINATES = 2.0
# A kernel under this fraction of its roofline is far from its limit: it uses less than half of
# what the chip allows it (the spec asks 60 % of cube peak of its best-tuned kernel).
ROOFLINE_FAR = 0.5
# A pipe this busy is the kernel's own bottleneck: it does not wait, it works.
BUSY_PIPE = 0.75
# A launch whose head (starting its cores: catlass's 20.5 us for every A2 core) is this share of its time has too
# little work per launch: a quarter is where fusing more into it, or starting fewer cores, pays before its schedule.
HEAD_SHARE = 0.25


@attrs.define
class Finding:
    """One observation: its layer, how much it matters, what it says, the numbers behind it, where."""

    layer: str
    kind: str
    severity: str
    message: str
    evidence: dict[str, Any] = attrs.field(factory=dict)
    loc: Location | None = None
    deciding: bool = False

    @property
    def location(self) -> str | None:
        """`file:line:col`, or None where no source position is known."""
        return str(self.loc) if self.loc is not None and self.loc.line else None

    def to_json(self) -> dict[str, Any]:
        """The finding as a plain JSON object (the schema the README documents)."""
        return {"layer": self.layer, "kind": self.kind, "severity": self.severity, "message": self.message,
                "evidence": plain(self.evidence), "location": self.location, "deciding": self.deciding}


@attrs.define
class KernelView:
    """One launched kernel as the doctor sees it: its launch's location, figures and roofline."""

    name: str
    loc: Location | None
    stats: KernelStats
    figures: dict[str, Any]
    roof: Roofline
    share: float  # of the device time
    node: str = ""  # the launch's first result, as GE names a node

    @property
    def on_aicpu(self) -> bool:
        """Whether GE placed it on the AI CPU (no AI Core kernel: no pipes, no roofline to judge)."""
        return self.stats.engine == "aicpu"

    @property
    def time_us(self) -> float:
        return self.figures["time_us"]

    @property
    def label(self) -> str:
        return f"{self.name} at {self.loc}" if self.loc is not None else self.name


@attrs.define
class Diagnosis:
    """The verdict and everything it rests on."""

    culprit: str
    findings: list[Finding]
    kernels: list[KernelView]
    device_us: float
    end_to_end_us: float
    copies_us: float
    target: str  # the chip's name, as the JSON report gives it
    lowered: bool  # the input was an rt.program: no fusion to judge

    def to_json(self) -> dict[str, Any]:
        """Exactly the spec's `{"culprit": ..., "findings": [...]}`."""
        return {"culprit": self.culprit, "findings": [f.to_json() for f in self.findings]}

    def deciding(self) -> Finding | None:
        """The finding that made the culprit (None when the culprit is none)."""
        return next((f for f in self.findings if f.deciding), None)

    def calm(self) -> str:
        """Why no layer stands out (culprit none): the thresholds nothing passed, and the slowest kernel."""
        if not self.kernels:
            return "the program launches no kernel"
        top = max(self.kernels, key=lambda v: v.time_us)
        return (f"no fusion miss costs {100 * FUSION_MISS_SHARE:.0f} % of the device time, no kernel's compute waits "
                f"{100 * COMPUTE_WAIT:.0f} % of its time on data movement, and the slowest kernel ({top.label}, "
                f"{top.time_us:.1f} us) reaches {100 * top.roof.fraction:.0f} % of its roofline "
                f"(under {100 * ROOFLINE_FAR:.0f} % would point at the kernel)")


# --- running ----------------------------------------------------------------------------------------

def specialise(graph: Graph, shapes: Mapping[str, tuple[int, ...]]) -> Graph:
    """A copy of a graph with `?` dimensions fixed to the inputs' shapes (as the Runtime's plan cache does);
    the graph itself when it is static. DiagnosticError when the shapes do not type-check."""
    if all(a.type.is_static for a in graph.args):
        return graph
    g = clone_graph(graph)
    for a in g.args:
        a.type = TensorType(tuple(int(d) for d in shapes[a.name]), a.type.dtype, a.type.format)
    infer_types_again(g)
    return g


def run_counting_waits(program: Graph, inputs: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray],
                       target: Target, launch_mode: str = "single-op") -> RunResult:
    """Run a lowered program with the pipes' idle time booked by cause (KernelStats.waits)."""
    return Runtime(target, count_waits=True, launch_mode=launch_mode).run(program, inputs, weights)


def diagnose_graph(graph: Graph, inputs: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray],
                   pipeline: str, target: Target, file: str = "<input>", cold: bool = False,
                   launch_mode: str = "single-op") -> Diagnosis:
    """Compile a ge.graph with the pipeline, run it, and judge the layers.

    `cold`: the run is the first request, which waits for GE's compile (measured host time); else a
    warm run (a plan-cache hit), with the compile reported beside it.
    DiagnosticError for a graph GE rejects, RuntimeFailure for a run that fails.
    """
    g = specialise(graph, {k: np.shape(v) for k, v in inputs.items()})
    probe = probe_fusion(g, pipeline, target, file, weights)
    start = time.perf_counter()
    records: list = []  # the passes' typed outcomes: GE's engine placements among them
    module = run_passes(Module([clone_graph(g)], file, dict(weights)), lowering_pipeline(pipeline), target,
                        verify_each=False, records=records)
    compile_us = (time.perf_counter() - start) * 1e6
    program = module.graphs[0]
    result = run_counting_waits(program, inputs, weights, target, launch_mode)
    cache: dict[tuple[str, ...], float | str] = {}

    def fused_equivalent(q: TensorType, k: TensorType, v: TensorType) -> float | str:
        key = (str(q), str(k), str(v))
        if key not in cache:
            cache[key] = fused_attention_us(q, k, v, pipeline, target)
        return cache[key]

    placements = [r for r in records if isinstance(r, Placement)]
    return judge(program, result, probe, fused_equivalent, compile_us if cold else 0.0, compile_us, placements)


def diagnose_program(program: Graph, inputs: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray],
                     target: Target, launch_mode: str = "single-op") -> Diagnosis:
    """Run an already lowered rt.program and judge the Runtime and the kernels (fusion is behind it)."""
    return judge(program, run_counting_waits(program, inputs, weights, target, launch_mode), None, None)


def fused_attention_us(q: TensorType, k: TensorType, v: TensorType, pipeline: str, target: Target) -> float | str:
    """Simulated device time (us) of one ge.flash_attention on q, k, v of these types, compiled with the
    same pipeline and run on random inputs; or the reason there is no such kernel."""
    out = TensorType(tuple(q.shape[:-1]) + (v.shape[-1],), q.dtype)
    if not q.shape[-1]:
        return "its head dim is 0 (no scale 1/sqrt(head dim) to compare with)"
    scale = 1.0 / math.sqrt(q.shape[-1])
    text = (f"ge.graph @main(%q: {q}, %k: {k}, %v: {v}) -> {out} {{\n"
            f"  %o = ge.flash_attention %q, %k, %v {{scale = {scale!r}}}\n  ge.return %o\n}}\n")
    try:
        module, _ = compile_module(parse(text, "<fused attention>"), pipeline, target)
        rng = np.random.default_rng(0)
        inputs = {a.name: rng.standard_normal(a.type.shape, dtype=np.float32).astype(a.type.dtype.np)
                  for a in module.graphs[0].args}
        result = Runtime(target).run(module.graphs[0], inputs)
    except DiagnosticError as e:
        return "; ".join(d.message for d in e.diagnostics) or "it does not compile"
    except RuntimeFailure as e:
        return str(e)
    return sum(k.cycles for k in result.kernels) / result.target.clock_hz * 1e6


# --- judging ----------------------------------------------------------------------------------------

def kernel_views(program: Graph, result: RunResult) -> list[KernelView]:
    """Every launched kernel with its launch's location (launches and kernels run in program order)."""
    launches = [op for op in program.ops if op.name == "rt.launch"]
    matched = len(launches) == len(result.kernels)
    locs: list[Location | None] = [op.loc for op in launches] if matched else [None] * len(result.kernels)
    nodes = [op.results[0].name or "" if op.results else "" for op in launches] if matched else [""] * len(locs)
    device = sum(k.cycles for k in result.kernels)
    return [KernelView(k.name, loc, k, kernel_profile(k, result.target), roofline(k, result.target),
                       k.cycles / device if device else 0.0, node)
            for k, loc, node in zip(result.kernels, locs, nodes, strict=True)]


FusedEquivalent = Callable[[TensorType, TensorType, TensorType], "float | str"]


def judge(program: Graph, result: RunResult, probe: Probe | None,
          fused_equivalent: FusedEquivalent | None, host_ge_us: float = 0.0,
          compile_us: float | None = None, placements: list[Placement] | None = None) -> Diagnosis:
    """The layers' findings for a run (which waited `host_ge_us` for GE), and the culprit; `placements` are
    GE's engine decisions (for the reason an op runs on the AI CPU)."""
    views = kernel_views(program, result)
    device_us = sum(v.time_us for v in views)
    copies_us = sum(t.end_us - t.start_us for t in result.tasks if t.kind in ("h2d", "d2h"))
    end_us = max((t.end_us for t in result.tasks), default=0.0)
    timeline = timeline_findings(result, host_ge_us, compile_us, device_us, copies_us, end_us)
    misses = attention_misses(probe, views) if probe is not None else []
    # kernels a fusion would replace: their own problems come after the fusion's
    absorbed = {id(v): m.loc for m in misses for v in m.kernels}
    if probe is None:
        fusion = [Finding("fusion", "not_applicable", "info",
                          "not applicable: the input is an already lowered rt.program; fusion happened before it "
                          "(run gedoctor on the ge.graph it was lowered from to judge fusion)")]
    else:
        fusion = fusion_findings(probe, views, device_us, misses, fused_equivalent)
    ge_host = [f for f in timeline if f.layer == "ge-host"]
    submissions = [f for f in timeline if f.layer != "ge-host"]
    findings = ge_host + fusion + submissions + runtime_findings(views, result.target, device_us, copies_us, end_us, absorbed) + \
        kernel_findings(views, result.target, absorbed) + aicpu_findings(views, result.target, device_us, placements)
    culprit = decide(findings)
    return Diagnosis(culprit, findings, views, device_us, end_us, copies_us, result.target.name, probe is None)


def decide(findings: list[Finding]) -> str:
    """The first layer, in the seed article's order, with a finding past its threshold (marked deciding)."""
    for layer in LAYERS:
        high = [f for f in findings if f.layer == layer and f.severity == "high"]
        if high:
            max(high, key=lambda f: f.evidence.get("stake_us", 0.0)).deciding = True
            return layer
    return "none"


def _key(loc: Location | None) -> tuple | None:
    return None if loc is None else (loc.file, loc.line, loc.col)


def _pipeline_skips(probe: Probe, rule: str) -> str:
    """Why a rule that matches did not fuse in this compile: the pipeline did not run it."""
    if probe.fuse_pass is None:
        return "the pipeline has no fuse pass (--no-fuse, or --passes without fuse)"
    if not probe.rule_runs(rule):
        return f"the pipeline's fuse pass does not run the {rule} rule ({probe.fuse_pass.text()})"
    return f"the {rule} rule matches this graph on its own, but not after the passes before fuse in this pipeline"


@attrs.define
class AttentionMiss:
    """An attention candidate the run did not fuse: where, why, its ops, and the kernels they became."""

    loc: Location
    reason: str
    region: list[Operation]
    kernels: list[KernelView]


def _by_loc(views: list[KernelView]) -> dict[tuple | None, list[KernelView]]:
    out: dict[tuple | None, list[KernelView]] = {}
    for v in views:
        out.setdefault(_key(v.loc), []).append(v)
    return out


def _fused_at(c: Candidate, by_loc: dict[tuple | None, list[KernelView]]) -> list[KernelView]:
    """The fused kernel a candidate became in the run (a launch of it at the candidate's location)."""
    return [v for v in by_loc.get(_key(c.loc), []) if v.name == FUSED_KERNEL[c.rule]]


def attention_misses(probe: Probe, views: list[KernelView]) -> list[AttentionMiss]:
    """Every attention candidate that is not a fused kernel in the run, with its ops' kernels (by location)."""
    by_loc = _by_loc(views)
    out = []
    for c in probe.candidates:
        if c.rule != ATTENTION_RULE or _fused_at(c, by_loc):
            continue
        region = attention_region(c.root, probe.graph) if c.root is not None else []
        kernels = [v for key in dict.fromkeys(_key(op.loc) for op in region) for v in by_loc.get(key, [])]
        out.append(AttentionMiss(c.loc, c.reason or f"{_pipeline_skips(probe, c.rule)}, so the rule never ran",
                                 region, kernels))
    return out


def fusion_findings(probe: Probe, views: list[KernelView], device_us: float, misses: list[AttentionMiss],
                    fused_equivalent: FusedEquivalent | None) -> list[Finding]:
    """Layer 1: each attention-shaped candidate fused or not, a miss priced against one fused kernel;
    then the other rules' misses, briefly."""
    by_loc = _by_loc(views)
    out: list[Finding] = []
    attention = [c for c in probe.candidates if c.rule == ATTENTION_RULE]
    for c in attention:
        fused = _fused_at(c, by_loc)
        if fused:
            t = sum(v.time_us for v in fused)
            out.append(Finding("fusion", "fused", "info",
                               f"attention fused into one ge.flash_attention ({t:.1f} us, "
                               f"{100 * t / device_us if device_us else 0:.0f} % of device time)",
                               {"rule": ATTENTION_RULE, "kernel_us": t}, c.loc))
    out += [_attention_miss(m, device_us, fused_equivalent) for m in misses]
    out.sort(key=lambda f: (f.loc.line, f.loc.col) if f.loc is not None else (0, 0))
    if not attention:
        direct = [v for v in views if v.name == FUSED_KERNEL[ATTENTION_RULE]]
        if direct:
            t = sum(v.time_us for v in direct)
            out.append(Finding("fusion", "fused", "info",
                               f"attention is written as ge.flash_attention already ({len(direct)} kernel(s), "
                               f"{t:.1f} us): nothing left for fusion to do", {"kernel_us": t},
                               direct[0].loc))
        else:
            out.append(Finding("fusion", "no_candidate", "info",
                               "no attention-shaped candidate: nothing in the graph looks like softmax(q k^T) v"))
    # the other rules: their misses, and matches this pipeline did not fuse, in brief
    for c in probe.candidates:
        if c.rule == ATTENTION_RULE:
            continue
        if not c.matched:
            out.append(Finding("fusion", "other_miss", "info", f"{c.rule} not fused: {c.reason}",
                               {"rule": c.rule, "reason": c.reason}, c.loc))
    unfused = [c for c in probe.candidates if c.rule != ATTENTION_RULE and c.matched and not probe.rule_runs(c.rule)]
    if unfused:
        rules = sorted({c.rule for c in unfused})
        out.append(Finding("fusion", "rules_not_run", "medium",
                           f"{len(unfused)} other fusion(s) this graph allows did not happen ({', '.join(rules)}): "
                           f"{_pipeline_skips(probe, rules[0])}",
                           {"rules": rules, "count": len(unfused), "locations": [str(c.loc) for c in unfused]}))
    return out


def _attention_miss(m: AttentionMiss, device_us: float, fused_equivalent: FusedEquivalent | None) -> Finding:
    """A missed attention candidate, priced: its unfused kernels in the run against one fused kernel."""
    loc, reason, region, parts = m.loc, m.reason, m.region, m.kernels
    unfused_us = sum(v.time_us for v in parts)
    evidence: dict[str, Any] = {"rule": ATTENTION_RULE, "reason": reason,
                                "unfused_kernels": [v.name for v in parts], "unfused_us": unfused_us,
                                "device_us": device_us}
    types = attention_operands(region)
    fused = None
    if types is None and sum(op.name == "ge.matmul" for op in region) < 2:
        why = ("the scores or probabilities are needed elsewhere too (a graph result or another op), so a "
               "fused kernel would not replace them")
    elif types is None:
        why = "its q, k, v are not [B, N, S, D] tensors of known shape"
    elif fused_equivalent is None:
        why = "no fused kernel was run to compare"
    else:
        evidence.update(q=str(types[0]), k=str(types[1]), v=str(types[2]))
        fused = fused_equivalent(*types)
        why = fused if isinstance(fused, str) else ("it has no elements: the fused kernel takes no time" if not fused
                                                    else "")
    head = f"attention not fused: {reason}"
    if isinstance(fused, float) and fused > 0 and parts:
        saving = unfused_us - fused
        share = saving / device_us if device_us else 0.0
        evidence.update(fused_equivalent_us=fused, ratio=unfused_us / fused if fused > 0 else None, saving_us=saving,
                        saving_share=share, stake_us=max(saving, 0.0), threshold_share=FUSION_MISS_SHARE)
        severity = "high" if share >= FUSION_MISS_SHARE else "medium"
        message = (f"{head}. Its {len(parts)} unfused kernels ({', '.join(v.name for v in parts)}) take "
                   f"{unfused_us:.1f} us; one ge.flash_attention on the same q, k, v ({types[0]}, no mask) takes "
                   f"{fused:.1f} us: {unfused_us / fused:.2f}x, {saving:.1f} us lost "
                   f"({100 * share:.0f} % of the {device_us:.1f} us device time)")
        return Finding("fusion", "attention_miss", severity, message, evidence, loc)
    evidence["cost_unknown"] = why or "its kernels were not found in the run"
    return Finding("fusion", "attention_miss", "medium",
                   f"{head}. Its cost is not measured: {evidence['cost_unknown']}", evidence, loc)


def pipe_waits(k: KernelStats, pipe: str) -> tuple[float, float]:
    """(flag, slot) idle share of a pipe over the kernel's time on its cores."""
    span = k.cycles * k.cores
    if k.waits is None or span <= 0:
        return 0.0, 0.0
    return k.waits.flag[pipe] / span, k.waits.slot[pipe] / span


def _after_fusion(v: KernelView, absorbed: Mapping[int, Location] | None, severity: str) -> tuple[str, str]:
    """A problem of a kernel that a missed fusion would replace is secondary: (severity, note to add)."""
    loc = (absorbed or {}).get(id(v))
    if loc is None or severity != "high":
        return severity, ""
    return "medium", f" (it belongs to the attention not fused at {loc}: fusing replaces this kernel)"


def timeline_findings(result: RunResult, host_ge_us: float, compile_us: float | None, device_us: float,
                      copies_us: float, span_us: float) -> list[Finding]:
    """The run's one timeline: GE's host work it waited for, and whether the Runtime's submissions set the pace."""
    out: list[Finding] = []
    end_to_end = host_ge_us + span_us
    figures = {"host_ge_us": host_ge_us, "device_span_us": span_us, "kernel_time_us": device_us,
               "transfer_time_us": copies_us, "end_to_end_us": end_to_end}
    if compile_us is not None:
        figures["compile_us"] = compile_us
    if end_to_end and host_ge_us / end_to_end > GE_HOST_SHARE:
        out.append(Finding("ge-host", "ge_host_dominates", "high",
                           f"the run waited {host_ge_us:.0f} us for GE's host work, {100 * host_ge_us / end_to_end:.0f} % "
                           f"of its {end_to_end:.0f} us end to end, against {device_us:.1f} us of kernels: compile once "
                           f"and reuse the plan (a session's plan cache), or give GE less to do per request",
                           {**figures, "stake_us": host_ge_us, "threshold_share": GE_HOST_SHARE}))
    elif compile_us is not None:
        out.append(Finding("ge-host", "compile", "info",
                           f"GE compiled the graph in {compile_us:.0f} us of host time; the doctor judges a warm run "
                           f"(a plan-cache hit, which waits for no compile; --cold judges the first request)", figures))
    # the device's idle time within its span, and the tasks that started the moment they were submitted
    busy = union_us([(t.start_us, t.end_us) for t in result.tasks])
    idle = span_us - busy
    waited = [t for t in result.tasks if t.start_us <= t.submitted_us + 1e-9 and t.submitted_us > 0]
    submit = result.target.host.launch_latency_us
    evidence = {**figures, "device_idle_us": idle, "tasks": len(result.tasks), "tasks_waiting_submission": len(waited),
                "submit_us_per_task": submit, "stake_us": idle, "threshold_idle_share": HOST_BOUND_IDLE}
    if span_us and idle / span_us > HOST_BOUND_IDLE and len(waited) * 2 > len(result.tasks):
        remedy = ("run it in graph mode (--launch graph; generate/serve(launch='graph')): its task graph captured "
                  "on the device once and replayed with one submission, as ACL Graph does"
                  if result.launch_mode == "single-op" else "fewer launches (fusion) or a longer task per launch")
        out.append(Finding("host-launch", "host_bound", "high",
                           f"host-bound: the device sat idle {idle:.1f} of its {span_us:.1f} us waiting for the Runtime "
                           f"to submit tasks ({len(waited)} of {len(result.tasks)} started the moment they were "
                           f"submitted, {submit:g} us each, {result.launch_mode} launches): {remedy}",
                           {**evidence, "launch_mode": result.launch_mode}))
    if end_to_end and copies_us / end_to_end > 0.5:
        out.append(Finding("runtime", "copies_dominate", "medium",
                           f"host-device copies take {copies_us:.1f} us, {100 * copies_us / end_to_end:.0f} % of "
                           f"{end_to_end:.1f} us end to end: the program's inputs and results cross the host link; "
                           f"inputs a session keeps on the device (resident) are not copied again",
                           {**figures, "stake_us": copies_us}))
    return out


def runtime_findings(views: list[KernelView], target: Target, device_us: float, copies_us: float,
                     end_us: float, absorbed: Mapping[int, Location] | None = None) -> list[Finding]:
    """Layer 2: for each kernel that matters, whether its data movement was hidden under compute."""
    out: list[Finding] = []
    for v in sorted(views, key=lambda v: -v.time_us):
        if v.share < KERNEL_SHARE or v.on_aicpu:
            continue  # an AI CPU task moves no data on the AI Core's pipes: nothing to overlap
        k, f = v.stats, v.figures
        compute = max(("CUBE", "VECTOR"), key=lambda p: k.busy[p])
        flag, slot = pipe_waits(k, compute)
        waited = flag + slot
        buffers = k.tiling.buffers if k.tiling else None
        evidence = {
            "kernel": v.name, "time_us": v.time_us, "device_share": v.share, "buffers": buffers,
            "overlap_ratio": f["overlap_ratio"], "memory_bound": f["memory_bound"],
            **{key: f[key] for key in ("mte2_ratio", "cube_ratio", "vec_ratio", "mte3_ratio")},
            "compute_pipe": compute, "compute_wait_flag": flag, "compute_wait_slot": slot,
            "mte2_wait_slot": pipe_waits(k, "MTE2")[1], "stake_us": waited * v.time_us,
            "thresholds": {"compute_wait": COMPUTE_WAIT, "poor_overlap": POOR_OVERLAP,
                           "memory_dominates": MEMORY_DOMINATES},
        }
        idle = (f"{compute} idle {100 * waited:.0f} % of the time waiting (on data flags {100 * flag:.0f} %, on a free "
                f"buffer slot {100 * slot:.0f} %)")
        figures = f"overlap_ratio {f['overlap_ratio']:.2f}, memory_bound {f['memory_bound']:.2f}"
        moves = k.busy["MTE2"] > 0
        if buffers == 1 and moves:
            severe = waited >= COMPUTE_WAIT
            severity, note = _after_fusion(v, absorbed, "high" if severe else "medium")
            out.append(Finding(
                "runtime", "double_buffering_off", severity,
                f"{v.name}: double buffering off (tiling buffers = 1): each load waits for the previous tile's "
                f"slot (MTE2 idle {100 * evidence['mte2_wait_slot']:.0f} % waiting for a free slot), so data movement "
                f"cannot run ahead of compute; {idle}; {figures}"
                + ("" if severe else " (compute barely waits: the single buffer costs little here)") + note,
                evidence, v.loc))
        elif moves and f["overlap_ratio"] < POOR_OVERLAP and waited >= COMPUTE_WAIT \
                and f["memory_bound"] < MEMORY_DOMINATES:
            # on a chip it does not fill, each core has one work unit: too little to overlap anything across
            filled = k.cores >= target.cube_cores
            severity, note = _after_fusion(v, absorbed, "high" if filled else "medium")
            out.append(Finding("runtime", "poor_overlap", severity,
                               f"{v.name}: data movement and compute ran mostly one after the other: {figures}; {idle}"
                               + ("" if filled else f" (on {k.cores} of {target.cube_cores} cores there is little "
                                                    f"work to overlap: see the kernel section)") + note,
                               evidence, v.loc))
        elif moves and f["memory_bound"] >= MEMORY_DOMINATES:
            out.append(Finding("runtime", "memory_bound", "info",
                               f"{v.name}: memory-bound ({figures}): moving data is the work itself and overlap can "
                               f"hide only the compute under it; the kernel section judges its bandwidth",
                               evidence, v.loc))
        else:
            out.append(Finding("runtime", "overlap", "info",
                               f"{v.name}: data movement overlaps compute ({figures}; {idle})",
                               evidence, v.loc))
    out.append(Finding("runtime", "host_copies", "info",
                       f"host-device copies take {copies_us:.1f} us beside {device_us:.1f} us of kernels "
                       f"({end_us:.1f} us of device span)",
                       {"copies_us": copies_us, "device_us": device_us, "end_to_end_us": end_us}))
    return out


def kernel_findings(views: list[KernelView], target: Target,
                    absorbed: Mapping[int, Location] | None = None) -> list[Finding]:
    """Layer 3: each kernel that matters against its roofline."""
    out: list[Finding] = []
    for v in sorted(views, key=lambda v: -v.time_us):
        if v.share < KERNEL_SHARE or v.on_aicpu:
            continue  # judged by aicpu_findings: it has no AI Core roofline
        k, r = v.stats, v.roof
        busiest = max((p for p in PIPES if p != "SCALAR"), key=lambda p: k.busy[p])
        busy = k.busy[busiest] / (k.cycles * k.cores) if k.cycles and k.cores else 0.0
        evidence = {"kernel": v.name, "time_us": v.time_us, "device_share": v.share, **r.evidence(),
                    "busiest_pipe": busiest, "busiest_pipe_ratio": busy, "cores": k.cores,
                    "cube_cores": target.cube_cores, "tiling": k.tiling.to_attr() if k.tiling else {},
                    "stake_us": v.time_us * (1 - min(r.fraction, 1.0)), "threshold_fraction": ROOFLINE_FAR}
        if r.flops > 0:
            where = (f"{r.achieved_tflops:.1f} of {r.roof_tflops:.1f} TFLOP/s, {r.bound}-bound at "
                     + (f"{r.intensity_gm:.1f} FLOP per global-memory byte" if r.intensity_gm else "no memory traffic"))
        else:
            where = f"moves data only; {r.bound}-bound"
        pipe = f"{busiest} {100 * busy:.0f} % busy"
        split = cv_split_schedule(k, target)
        if split:
            evidence["cv_split"] = split
        design = f"; {render_cv_split(split)}" if split else ""
        if r.fraction >= ROOFLINE_FAR:
            out.append(Finding("kernel", "near_roofline", "info", f"{v.name} reaches {100 * r.fraction:.0f} % of "
                                                                  f"its roofline ({where}); busiest pipe {pipe}{design}",
                               evidence, v.loc))
            continue
        head_us = k.head / target.clock_hz * 1e6
        evidence["head_us"] = head_us
        if k.cycles and k.head / k.cycles >= HEAD_SHARE:
            limit = (f"its launch head ({head_us:.1f} us starting its cores) is {100 * k.head / k.cycles:.0f} % of its "
                     f"time: too little work per launch (fuse more into it, or start fewer cores)")
        elif k.cores < target.cube_cores:
            limit = f"it runs on {k.cores} of {target.cube_cores} cores: too little work to fill the chip"
        elif busy >= BUSY_PIPE:
            limit = f"its own work on one pipe limits it ({pipe}): fewer or cheaper instructions there, not overlap"
        else:
            limit = f"its pipes are idle much of the time (the busiest, {pipe})"
        severity, note = _after_fusion(v, absorbed, "high")
        out.append(Finding("kernel", "far_from_roofline", severity,
                           f"{v.name} reaches {100 * r.fraction:.0f} % of its roofline ({where}); {limit}{design}{note}",
                           evidence, v.loc))
    return out


def cv_split_schedule(k: KernelStats, target: Target) -> dict[str, Any] | None:
    """What a FlashAttention launch on split cube and vector cores (Atlas A2) did across the split: its CV block,
    preload, workspace and the pipes on each side of the GM exchange; None for any other launch."""
    t = k.tiling
    if not getattr(t, "cv_split", False) or not k.cycles or not k.cores:
        return None
    ratio = {p: k.busy[p] / (k.cycles * k.cores) for p in ("MTE2", "CUBE", "FIXP", "VECTOR", "AIV_MTE2", "MTE3")}
    exchange = max(("MTE2", "FIXP"), key=ratio.get)
    return {"cv_block": [t.s1, t.s2], "v_rows": t.v_rows, "preload": t.preload,
            "vector_per_cube": target.vector_per_cube, "pipe_ratios": ratio,
            "exchange_pipe": exchange}


def render_cv_split(split: dict[str, Any]) -> str:
    """The CV-split schedule's figures as a sentence for the kernel finding."""
    r = split["pipe_ratios"]
    s1, s2 = split["cv_block"]
    return (f"Atlas A2 CV split: each AIC and its {split['vector_per_cube']} AIVs exchange S and P through GM, "
            f"CV block {s1} x {s2}, cube preload {split['preload']}: AIC MTE2 {100 * r['MTE2']:.0f} %, cube "
            f"{100 * r['CUBE']:.0f} %, FIXP {100 * r['FIXP']:.0f} %, AIV vector {100 * r['VECTOR']:.0f} % busy "
            f"(of the AIC's ends of the exchange through L2, {split['exchange_pipe']} is the busier)")


def aicpu_findings(views: list[KernelView], target: Target, device_us: float,
                   placements: list[Placement] | None = None) -> list[Finding]:
    """Each op GE placed on the AI CPU, with its time; one that costs KERNEL_SHARE of the kernel time or more
    is a kernel-layer problem: the AI Core, far faster, has no kernel that takes it."""
    reasons = {_key(p.loc): p.reason for p in placements or []}
    overhead = (target.aicpu.task_overhead_us if target.aicpu else 0.0)
    out: list[Finding] = []
    for v in sorted((v for v in views if v.on_aicpu), key=lambda v: -v.time_us):
        reason = reasons.get(_key(v.loc)) or "GE placed it there"
        node = f" (%{v.node})" if v.node else ""
        evidence = {"kernel": v.name, "node": v.node, "engine": "aicpu", "reason": reason, "time_us": v.time_us,
                    "device_share": v.share, "aicpu_cores": v.stats.cores, "task_overhead_us": overhead,
                    "stake_us": v.time_us, "threshold_share": KERNEL_SHARE}
        head = (f"{v.name}{node} runs on the AI CPU ({reason}): {v.time_us:.1f} us, {100 * v.share:.0f} % of the "
                f"{device_us:.1f} us of kernel time, on {v.stats.cores} AI CPU cores with {overhead:g} us of dispatch "
                f"per task")
        if v.share >= KERNEL_SHARE:
            out.append(Finding("kernel", "aicpu_op", "high",
                               f"{head}: give it an element type the AI Core computes (f32 for f64 where its "
                               f"precision suffices) or an AI Core kernel, so GE keeps it on the AI Core",
                               evidence, v.loc))
        else:
            out.append(Finding("kernel", "aicpu_op", "info", head, evidence, v.loc))
    return out


def plain(x: Any) -> Any:
    """JSON-ready values: numpy scalars as Python numbers, non-finite floats as null."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
