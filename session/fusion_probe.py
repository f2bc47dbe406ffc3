"""What fusion can do to a graph: each fusion candidate (the rule matched, or the reason it did not),
and the ops an attention candidate is made of, so that its kernels can be found in a run.

The probe runs the pipeline's passes up to where fusion happens, then GE's `fuse` pass with every
rule and `--explain` on, on a copy: it sees what the default fusion would see even when the
pipeline fuses nothing (`--no-fuse`) or disables a rule. Whether a candidate was fused in the
actual compile is read off the lowered program (a launch of the fused kernel at the candidate's
location), not assumed from the probe.
"""

from __future__ import annotations

import attrs

from geir.builder import clone_graph
from geir.diagnostics import Location
from geir.ir import Graph, Module, Operation
from geir.ops.core import Const
from geir.passes import complete_pipeline
from geir.passes.fuse import FUSION_RULES, Fuse
from geir.passes.pattern import FusionOutcome
from geir.session.pipeline import lowering_pipeline, run_passes
from geir.target_npu.target import Target
from geir.traits import CubeOp, Normalization
from geir.types import TensorType

# Where fusion stands in GE's pipeline when a pipeline has no fuse pass: before the first of these.
AFTER_FUSION = ("layout", "tile", "plan", "lower")
ATTENTION_RULE = "flash_attention"
# The op each rule's fused result is launched as (a launch of it at the candidate's location = fused).
FUSED_KERNEL = {
    "flash_attention": "ge.flash_attention", "softmax": "ge.softmax", "layer_norm": "ge.layer_norm",
    "rms_norm": "ge.rms_norm", "gelu": "ge.gelu", "matmul_epilogue": "ge.fused_matmul",
    "elementwise": "ge.fused_elementwise",
}
# The most ops an attention spelling has between its two matmuls (written-out softmax, casts, masks, scale).
_MAX_REGION = 64


@attrs.define
class Candidate:
    """One fusion candidate: its rule, where it is rooted, and why the rule did not match (None: it did)."""

    rule: str
    loc: Location
    reason: str | None
    root: Operation | None  # the op the rule is rooted at, in the probe's graph

    @property
    def matched(self) -> bool:
        return self.reason is None


@attrs.define
class Probe:
    """The graph as fusion sees it, every candidate in it, and the pipeline's own fuse pass (None: none)."""

    graph: Graph
    candidates: list[Candidate]
    fuse_pass: Fuse | None

    def rule_runs(self, rule: str) -> bool:
        """Whether the pipeline's fuse pass runs this rule."""
        f = self.fuse_pass
        return f is not None and rule in (f.rules or list(FUSION_RULES)) and rule not in f.disable


def probe_fusion(graph: Graph, pipeline: str, target: Target, file: str = "<input>", resources=None) -> Probe:
    """Run the pipeline up to fusion on a copy, then every fusion rule with --explain; DiagnosticError on bad input."""
    passes = lowering_pipeline(pipeline)
    names = [p.NAME for p in passes]
    fuse = next((p for p in passes if p.NAME == "fuse"), None)
    cut = names.index("fuse") if fuse is not None else next(
        (i for i, n in enumerate(names) if n in AFTER_FUSION), len(names))
    module = Module([clone_graph(graph)], file, resources or {})
    run_passes(module, passes[:cut], target)
    before = clone_graph(module.graphs[0])

    records: list = []
    run_passes(module, complete_pipeline([Fuse()]), target, verify_each=False, records=records)
    at_place = _ops_by_place(before)
    candidates = [Candidate(o.rule, o.loc, o.reason, _root_at(at_place, FUSION_RULES[o.rule].ROOT, o.loc))
                  for o in records if isinstance(o, FusionOutcome)]
    return Probe(before, candidates, fuse)


def _place(loc: Location) -> tuple:
    return (loc.file, loc.line, loc.col)


def _ops_by_place(graph: Graph) -> dict[tuple, list[Operation]]:
    """The graph's ops by source location, in graph order (one pass: a probe looks up every outcome)."""
    index: dict[tuple, list[Operation]] = {}
    for op in graph.ops:
        index.setdefault(_place(op.loc), []).append(op)
    return index


def _root_at(at_place: dict[tuple, list[Operation]], root: str | tuple[str, ...], loc: Location) -> Operation | None:
    """The op a rule is rooted at, found by its location (the last one there, as a rule roots at the end)."""
    names = (root,) if isinstance(root, str) else root
    found = [op for op in at_place.get(_place(loc), ()) if op.name in names]
    return found[-1] if found else None


def _ends_region(op: Operation) -> bool:
    """Whether the walk up from an attention candidate's second matmul stops at `op`: a cube op or a norm."""
    # kernels of their own that fusion never folds into attention; the first matmul is one of them,
    # and the region takes it in
    return op.has_trait(CubeOp) or op.has_trait(Normalization)


def attention_region(root: Operation, graph: Graph) -> list[Operation]:
    """The ops one attention candidate is made of: its second matmul and, going up its probabilities,
    every op up to and including the first matmul (and a transpose feeding it k) whose results feed
    nothing else. These are the ops a fused kernel would replace, in graph order."""
    order = {id(op): i for i, op in enumerate(graph.ops)}
    reached: dict[int, Operation] = {}
    stack = [root.operands[0].owner] if root.operands else []
    while stack and len(reached) < _MAX_REGION:
        op = stack.pop()
        if op is None or isinstance(op, Const) or id(op) in reached or id(op) not in order:
            continue
        if _ends_region(op) and op.name != "ge.matmul":
            continue
        reached[id(op)] = op
        if op.name == "ge.matmul":
            # the first matmul ends the walk; a transpose making k^T for it is attention's too (the fused
            # kernel takes k as it is), but not what produced k
            for v in op.operands[1:]:
                if v.owner is not None and v.owner.name == "ge.transpose":
                    reached[id(v.owner)] = v.owner
            continue
        stack.extend(v.owner for v in op.operands)
    region = {id(root)}
    # consumers before producers, so an op is judged after every op that might use it
    for op in sorted(reached.values(), key=lambda o: -order[id(o)]):
        if all(id(u) in region for r in op.results for u in r.users()):
            region.add(id(op))
    return [op for op in graph.ops if id(op) in region]


def attention_operands(region: list[Operation]) -> tuple[TensorType, TensorType, TensorType] | None:
    """The q, k, v types a fused attention of this region takes ([B, N, S, D] each), or None when the
    region has no first matmul or the shapes are not those of attention."""
    matmuls = [op for op in region if op.name == "ge.matmul"]
    if len(matmuls) < 2:
        return None
    first, second = matmuls[0], matmuls[-1]
    q = _logical(first.operands[0].type, bool(first.attr("transpose_a")))
    kt = first.operands[1].type  # k^T, or k itself with transpose_b
    k = kt if first.attr("transpose_b") else _logical(kt, True)
    v = _logical(second.operands[1].type, bool(second.attr("transpose_b")))
    types = (q, k, v)
    if any(t is None or t.rank != 4 or not t.is_static for t in types):
        return None
    return types


def _logical(t: TensorType | None, swap: bool) -> TensorType | None:
    """A matrix operand's type as the un-transposed matrix (last two axes swapped when `swap`)."""
    if t is None or not swap or t.rank < 2:
        return t
    shape = tuple(t.shape)
    return TensorType(shape[:-2] + (shape[-1], shape[-2]), t.dtype)
