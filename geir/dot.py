"""Graphs as Graphviz DOT: one node per op, an edge per use, the ops fusion made filled in its rule's colour.

`to_dot` is a pure function of the graphs and of which ops to mark as fused; `FusionRecorder`
finds those ops while a pipeline runs (as pass-manager hooks), because an op's kind alone does not
say where it came from: `ge.softmax` written by hand and `ge.softmax` made by `fuse` look alike.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from geir.attributes import DenseAttr
from geir.diagnostics import UNKNOWN, Location
from geir.ir import Graph, Module, Operation, Value
from geir.printer import _Namer, format_attr
from geir.types import format_type

# The rule of the `fuse` pass that emits each op kind (each rule emits one kind; a test keeps this in step).
FUSED_KINDS: dict[str, str] = {
    "ge.softmax": "softmax",
    "ge.layer_norm": "layer_norm",
    "ge.rms_norm": "rms_norm",
    "ge.gelu": "gelu",
    "ge.flash_attention": "flash_attention",
    "ge.fused_matmul": "matmul_epilogue",
    "ge.add_rms_norm": "add_rms_norm",
    "ge.add_layer_norm": "add_layer_norm",
    "ge.fused_elementwise": "elementwise",
    "ge.rotary_embedding": "rotary_embedding",
    "ge.glu": "glu",
    "ge.paged_attention": "paged_attention",
    "ge.index_put_pair": "kv_scatter_pair",
    "ge.moe_gating_topk_softmax": "moe_gating",
    "ge.moe_init_routing": "moe_init_routing",
    "ge.moe_finalize_routing": "moe_finalize_routing",
    "ge.rms_norm_add_rms_norm": "rms_norm_add_rms_norm",
}
# Rules of `fuse` that rewrite an op into one of the same kind (attention_native gives an imported
# ge.flash_attention its native operands): they make no kind of their own, so they have no colour.
# (attention_layout gives it the BSND layout; qkv_merge joins sibling matmuls, plain or with their epilogues, into
# one; partial_rotary makes a rotary embedding of only the first rotary_dim features; glu_merged gives a glu the merged
# gate-up tensor; rotary_pair rotates q and k in one rotary embedding; norm_cast makes a norm computed in f32 between
# two casts the norm of the 16-bit tensor, a layer norm as well as an RMS norm; masked_rows has flash_attention zero
# the rows its mask hides wholly; matmul_glu takes a glu into the gate-up matmul as its epilogue; qkv_heads reorders a
# fused q/k/v projection's head-interleaved weight rows so that its pieces are runs of its last axis; matmul_residual
# takes a residual add into a linear layer's epilogue)
REFINING_RULES: dict[str, str] = {"attention_native": "ge.flash_attention", "attention_layout": "ge.flash_attention",
                                  "qkv_merge": "ge.fused_matmul",
                                  "partial_rotary": "ge.rotary_embedding", "glu_merged": "ge.glu",
                                  "rotary_pair": "ge.rotary_embedding", "norm_cast": "ge.rms_norm",
                                  "masked_rows": "ge.flash_attention", "matmul_glu": "ge.fused_matmul",
                                  "qkv_heads": "ge.fused_matmul", "matmul_residual": "ge.fused_matmul"}
# Fill colour of the ops each rule made (ColorBrewer's Set3 pastels: black text stays readable on them).
RULE_COLOURS: dict[str, str] = {
    "flash_attention": "#fdb462",
    "softmax": "#80b1d3",
    "layer_norm": "#b3de69",
    "rms_norm": "#ccebc5",
    "gelu": "#fccde5",
    "matmul_epilogue": "#bebada",
    "add_rms_norm": "#8dd3c7",
    "add_layer_norm": "#bc80bd",
    "elementwise": "#ffffb3",
    "rotary_embedding": "#fb8072",
    "glu": "#ffed6f",
    "paged_attention": "#d9d9d9",
    # Set3 is spent: ColorBrewer's Pastel2 for the rest
    "kv_scatter_pair": "#b3e2cd",
    "moe_gating": "#fdcdac",
    "moe_init_routing": "#cbd5e8",
    "moe_finalize_routing": "#f4cae4",
    "rms_norm_add_rms_norm": "#e6f5c9",
}
ARG_COLOUR, RESULT_COLOUR = "#e0ecf4", "#fee0d2"
MAX_ATTR_CHARS = 48  # an attribute longer than this is cut, so a tiling dictionary does not make a node wide
MAX_ATTR_LINES = 6
MAX_DENSE_ELEMENTS = 8  # larger dense literals are elided to their shape


def quote(text: str) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, line breaks as DOT's centred `\\n`."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n") + '"'


def _cut(text: str, limit: int = MAX_ATTR_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _const_text(value: Any) -> str:
    """A constant's value: small literals in full, larger ones by shape only."""
    if isinstance(value, DenseAttr) and value.values.size > MAX_DENSE_ELEMENTS and value.splat_value() is None:
        shape = "x".join(str(d) for d in value.values.shape)
        return f"dense<...> ({shape}, {value.values.size} elements)"
    return _cut(format_attr(value))


def _attr_lines(op: Operation, skip: tuple[str, ...] = ()) -> list[str]:
    """`key = value` lines for the op's attributes (but `skip`), each cut to a readable width."""
    attributes = {k: v for k, v in op.attributes.items() if k not in skip}
    lines = []
    if op.name == "ge.fused_elementwise" and isinstance(attributes.get("body"), list):
        steps = [s.get("op", "?").removeprefix("ge.") for s in attributes.pop("body") if isinstance(s, dict)]
        lines.append(_cut("body: " + " -> ".join(steps)))
    if op.name == "rt.launch" and isinstance(attributes.get("kernel"), str):
        lines.append(f"kernel {attributes.pop('kernel')}")
    for key in sorted(attributes):
        lines.append(_cut(f"{key} = {format_attr(attributes[key])}"))
    if len(lines) > MAX_ATTR_LINES:
        lines = lines[: MAX_ATTR_LINES - 1] + [f"(+{len(lines) - MAX_ATTR_LINES + 1} more attributes)"]
    return lines


def op_label(op: Operation, name_of, rule: str | None = None) -> str:
    """The text of an op's node: results and op name, attributes, result types, and the fusion rule."""
    head = op.name
    if op.results:
        head = ", ".join("%" + name_of(r) for r in op.results) + " = " + head
    if op.name in ("ge.const", "rt.const") and "value" in op.attributes:
        head += " " + _const_text(op.attributes["value"])
        body = _attr_lines(op, skip=("value",))
    else:
        body = _attr_lines(op)
    types = [format_type(r.type) for r in op.results if r.type is not None]
    lines = [head, *body]
    if types:
        lines.append(", ".join(types))
    if rule:
        lines.append(f"[fused by {rule}]")
    return "\n".join(lines)


def _operand_role(op: Operation, i: int) -> str:
    """The operand's name in the op's signature (`q`, `mask`, `bias`), or its position when variadic."""
    names = getattr(op, "OPERAND_NAMES", ())
    if i < len(names) and names[i][-1:] not in ("+", "*"):
        return names[i].rstrip("?")
    return str(i)


def _edge_label(value: Value, user: Operation, i: int, name_of) -> str:
    parts = []
    if value.owner is not None and len(value.owner.results) > 1:
        parts.append("%" + name_of(value))
    if len(user.operands) > 1:
        parts.append(_operand_role(user, i))
    return " -> ".join(parts)


def _attrs(**kv: str) -> str:
    return "[" + ", ".join(f"{k}={v}" for k, v in kv.items()) + "]"


def _graph_lines(graph: Graph, prefix: str, cluster: str, fused: Mapping[Operation, str]) -> list[str]:
    names = _Namer(graph)
    node_of: dict[int, str] = {}
    out = [f"  subgraph {quote(cluster)} {{"]
    label = [f"{graph.kind} @{graph.name}"]
    label += [_cut(f"{k} = {format_attr(v)}", 2 * MAX_ATTR_CHARS) for k, v in graph.attributes.items()]
    out.append(f"    label={quote(chr(10).join(label))}; style=rounded; color=gray60;")
    for i, a in enumerate(graph.args):
        node_of[id(a)] = nid = f"{prefix}_arg{i}"
        out.append(f"    {nid} " + _attrs(shape="invhouse", style="filled", fillcolor=quote(ARG_COLOUR),
                                            label=quote(f"%{names(a)}\n{format_type(a.type)}")) + ";")
    ops = graph.ops
    body = ops[:-1] if ops and ops[-1].name == graph.terminator_name else ops
    records: dict[Any, str] = {}
    edges: list[str] = []
    for j, op in enumerate(body):
        nid = f"{prefix}_op{j}"
        rule = fused.get(op)
        style = {"label": quote(op_label(op, names, rule))}
        if rule:
            style.update(style=quote("rounded,filled,bold"), fillcolor=quote(RULE_COLOURS.get(rule, "#dddddd")),
                         tooltip=quote(f"{op.name} made by the fuse pass's {rule} rule"))
        out.append(f"    {nid} {_attrs(**style)};")
        for r in op.results:
            node_of[id(r)] = nid
        for i, v in enumerate(op.operands):
            label = _edge_label(v, op, i, names)
            edges.append(f"    {node_of[id(v)]} -> {nid}" + (f" {_attrs(label=quote(label))}" if label else "") + ";")
        # events order the streams of an rt.program: draw each record -> wait as a dashed edge
        if op.name == "rt.record":
            records[op.attributes.get("event")] = nid
        elif op.name == "rt.wait" and op.attributes.get("event") in records:
            edges.append(f"    {records[op.attributes['event']]} -> {nid} "
                         + _attrs(style="dashed", color="gray50", label=quote(f"event {op.attributes['event']}")) + ";")
    if ops and ops[-1].name == graph.terminator_name:
        for i, v in enumerate(ops[-1].operands):
            rid = f"{prefix}_res{i}"
            t = graph.result_types[i] if i < len(graph.result_types) else v.type
            out.append(f"    {rid} " + _attrs(shape="house", style="filled", fillcolor=quote(RESULT_COLOUR),
                                                label=quote(f"result {i}\n{format_type(t) if t else '?'}")) + ";")
            edges.append(f"    {node_of[id(v)]} -> {rid};")
    out += edges
    out.append("  }")
    return out


def to_dot(graphs: Sequence[Graph], fused: Mapping[Operation, str] | None = None, title: str | None = None) -> str:
    """DOT text of the graphs (one cluster each); ops in `fused` are filled and named by the rule that made them."""
    fused = fused or {}
    lines = ["digraph geir {"]
    graph_attrs = {"rankdir": "TB", "fontname": quote("Helvetica"), "newrank": "true"}
    if title:
        graph_attrs.update(label=quote(title), labelloc="t", fontsize="14")
    lines.append("  graph " + _attrs(**graph_attrs) + ";")
    lines.append("  node " + _attrs(shape="box", style="rounded", fontname=quote("Helvetica"), fontsize="10") + ";")
    lines.append("  edge " + _attrs(fontname=quote("Helvetica"), fontsize="9", color="gray30") + ";")
    taken: set[str] = set()
    for g, graph in enumerate(graphs):
        cluster = f"cluster_{graph.name}"
        while cluster in taken:  # two chunks of a split file may both hold @main
            cluster += f"_{g}"
        taken.add(cluster)
        lines += _graph_lines(graph, f"g{g}", cluster, fused)
    used = sorted({fused[op] for graph in graphs for op in graph.ops if op in fused})
    if used:
        lines.append("  subgraph cluster_legend {")
        lines.append(f"    label={quote('fused by the fuse pass')}; style=dashed; color=gray60; fontsize=10;")
        for i, rule in enumerate(used):
            lines.append(f"    legend{i} " + _attrs(label=quote(rule), style=quote("rounded,filled"),
                                                     fillcolor=quote(RULE_COLOURS.get(rule, "#dddddd"))) + ";")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _kind(op: Operation) -> str:
    """The graph op an op stands for: its own name, or the kernel a lowered `rt.launch` runs."""
    kernel = op.attributes.get("kernel") if op.name == "rt.launch" else None
    return kernel if isinstance(kernel, str) else op.name


class FusionRecorder:
    """Pass-manager hooks that remember which ops each `fuse` pass created, and which rule made each.

    An op is remembered by its kind and source location (a rule builds its op at the location of
    the op it replaces), so the mark survives later passes that rebuild the op, and reaches the
    `rt.launch` that `lower` makes of it.
    """

    def __init__(self, fuse_pass: str = "fuse"):
        self.fuse_pass = fuse_pass
        self.made: dict[tuple[str, Location], str] = {}
        self.made_ops: dict[Operation, str] = {}  # ops without a source location (built by a frontend)
        self._before: set[Operation] = set()

    def before(self, p: Any, module: Module) -> None:
        """Hook run before each pass: note the ops that exist before a fuse pass."""
        if p.NAME == self.fuse_pass:
            self._before = set(_ops(module.graphs))  # the ops themselves, so no id is reused meanwhile

    def after(self, p: Any, module: Module) -> None:
        """Hook run after each pass: remember the fused-kind ops a fuse pass created."""
        if p.NAME != self.fuse_pass:
            return
        for op in _ops(module.graphs):
            if op not in self._before and op.name in FUSED_KINDS:
                if op.loc == UNKNOWN:
                    self.made_ops[op] = FUSED_KINDS[op.name]
                else:
                    self.made[(op.name, op.loc)] = FUSED_KINDS[op.name]
        self._before = set()

    def marks(self, graphs: Iterable[Graph]) -> dict[Operation, str]:
        """The ops of these graphs that a fuse pass made, each with its rule."""
        out = {}
        for op in _ops(graphs):
            rule = self.made_ops.get(op) if op.loc == UNKNOWN else self.made.get((_kind(op), op.loc))
            if rule:
                out[op] = rule
        return out


def _ops(graphs: Iterable[Graph]) -> Iterable[Operation]:
    for g in graphs:
        yield from g.ops


def graph_title(source: str, pipeline: str) -> str:
    """The DOT title: the file and the pipeline that produced the graph."""
    return f"{source}  (passes: {pipeline or 'none, as parsed'})"


__all__ = ["FUSED_KINDS", "FusionRecorder", "graph_title", "op_label", "quote", "to_dot"]
