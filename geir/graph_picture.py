"""Graphs as a PNG drawn with matplotlib, no Graphviz needed: what `geopt --dot` writes beside its DOT file.

`graph_picture` lays the graphs out (a pure function: each op one row below the lowest of its
operands, the ops of a row side by side, the ops fusion made filled in their rule's colour, as in
the DOT file); `render_png` draws the layout with matplotlib's Agg backend, imported only there, so
GEIR works without the plot extra.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs

from geir.dot import ARG_COLOUR, RESULT_COLOUR, RULE_COLOURS
from geir.ir import Graph, Operation
from geir.printer import _Namer
from geir.types import format_type

PLAIN_COLOUR = "#ffffff"
MAX_LABEL_CHARS = 28  # a node's line longer than this is cut, so a row of nodes stays readable
NODE_W, NODE_H = 1.0, 0.55  # a node's box, in units of the column and row spacing
INCH_PER_COLUMN, INCH_PER_ROW = 2.1, 0.95
MAX_INCHES = 320  # matplotlib's Agg refuses pictures above 2^16 pixels a side
DPI = 72


@attrs.frozen
class PictureNode:
    """One box: an argument, an op or a result, at (column, row) of the layout."""

    label: str
    column: float
    row: int
    fill: str
    kind: str  # "arg", "op" or "result"


@attrs.frozen
class GraphPicture:
    """The layout of one or more graphs side by side: nodes, edges (node indices) and the legend of fusion rules."""

    title: str
    nodes: tuple[PictureNode, ...]
    edges: tuple[tuple[int, int], ...]
    legend: tuple[tuple[str, str], ...]  # (rule, colour) of the rules that made an op here
    columns: float
    rows: int


def _cut(text: str) -> str:
    return text if len(text) <= MAX_LABEL_CHARS else text[: MAX_LABEL_CHARS - 3] + "..."


def _op_label(op: Operation, rule: str | None) -> str:
    kernel = op.attributes.get("kernel") if op.name == "rt.launch" else None
    lines = [op.name + (f" {kernel}" if isinstance(kernel, str) else "")]
    types = [format_type(r.type) for r in op.results if r.type is not None]
    if types:
        lines.append(", ".join(types))
    if rule:
        lines.append(f"[{rule}]")
    return "\n".join(_cut(line) for line in lines)


def graph_picture(graphs: Sequence[Graph], fused: Mapping[Operation, str] | None = None,
                  title: str = "") -> GraphPicture:
    """The layout of the graphs: a row per depth (an op one row below its deepest operand), each graph its own
    columns; ops in `fused` filled in their rule's colour. Depth is found in one pass over the ops in order."""
    fused = fused or {}
    nodes: list[PictureNode] = []
    edges: list[tuple[int, int]] = []
    offset = 0.0
    for graph in graphs:
        names = _Namer(graph)
        placed: list[tuple[str, int, str, str]] = []  # (label, row, fill, kind), columns assigned per row below
        node_of: dict[int, int] = {}  # id(value) -> index into placed
        row_of: dict[int, int] = {}
        graph_edges: list[tuple[int, int]] = []
        for a in graph.args:
            node_of[id(a)] = len(placed)
            row_of[id(a)] = 0
            placed.append((_cut(f"%{names(a)}") + "\n" + _cut(format_type(a.type)), 0, ARG_COLOUR, "arg"))
        ops = graph.ops
        body = ops[:-1] if ops and ops[-1].name == graph.terminator_name else ops
        for op in body:
            row = 1 + max((row_of[id(v)] for v in op.operands if id(v) in row_of), default=0)
            index = len(placed)
            rule = fused.get(op)
            placed.append((_op_label(op, rule), row, RULE_COLOURS.get(rule, "#dddddd") if rule else PLAIN_COLOUR, "op"))
            graph_edges += [(node_of[id(v)], index) for v in op.operands if id(v) in node_of]
            for r in op.results:
                node_of[id(r)] = index
                row_of[id(r)] = row
        if ops and ops[-1].name == graph.terminator_name:
            for i, v in enumerate(ops[-1].operands):
                index = len(placed)
                t = graph.result_types[i] if i < len(graph.result_types) else v.type
                placed.append((f"result {i}\n" + (_cut(format_type(t)) if t else "?"),
                               1 + row_of.get(id(v), 0), RESULT_COLOUR, "result"))
                if id(v) in node_of:
                    graph_edges.append((node_of[id(v)], index))
        # the nodes of a row side by side in program order, each row centred on the graph's widest
        per_row: dict[int, list[int]] = {}
        for i, (_, row, _, _) in enumerate(placed):
            per_row.setdefault(row, []).append(i)
        width = max((len(v) for v in per_row.values()), default=1)
        column: dict[int, float] = {}
        for members in per_row.values():
            start = (width - len(members)) / 2
            for k, i in enumerate(members):
                column[i] = offset + start + k
        base = len(nodes)
        nodes += [PictureNode(label, column[i], row, fill, kind) for i, (label, row, fill, kind) in enumerate(placed)]
        edges += [(base + a, base + b) for a, b in graph_edges]
        offset += width + 1  # a free column between graphs
    used = sorted({fused[op] for graph in graphs for op in graph.ops if op in fused})
    return GraphPicture(title, tuple(nodes), tuple(edges), tuple((r, RULE_COLOURS.get(r, "#dddddd")) for r in used),
                        max(offset - 1, 1.0), 1 + max((n.row for n in nodes), default=0))


def matplotlib_available() -> bool:
    """Whether the `plot` extra (matplotlib) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def render_png(picture: GraphPicture) -> bytes:
    """The picture as PNG bytes (matplotlib's Agg backend, no display): rows top to bottom, edges as arrows."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch, Patch

    width = min(max(4.0, picture.columns * INCH_PER_COLUMN), MAX_INCHES)
    height = min(max(3.0, picture.rows * INCH_PER_ROW + 1.0), MAX_INCHES)
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.01, 0.01, 0.98, 0.94 if picture.title else 0.98))
    ax.set_xlim(-0.6, picture.columns - 0.4)
    ax.set_ylim(picture.rows - 0.4, -0.6)  # row 0 at the top, as Graphviz draws top to bottom
    ax.axis("off")
    for a, b in picture.edges:
        na, nb = picture.nodes[a], picture.nodes[b]
        ax.annotate("", xy=(nb.column, nb.row - NODE_H / 2), xytext=(na.column, na.row + NODE_H / 2),
                    arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 0.8, "shrinkA": 0, "shrinkB": 0})
    for n in picture.nodes:
        ax.add_patch(FancyBboxPatch((n.column - NODE_W / 2, n.row - NODE_H / 2), NODE_W, NODE_H,
                                    boxstyle="round,pad=0.02", facecolor=n.fill, edgecolor="#333333", lw=0.8))
        ax.text(n.column, n.row, n.label, ha="center", va="center", fontsize=7, family="DejaVu Sans")
    if picture.legend:
        ax.legend(handles=[Patch(facecolor=c, edgecolor="#333333", label=r) for r, c in picture.legend],
                  title="fused by the fuse pass", loc="upper right", fontsize=7, title_fontsize=7)
    if picture.title:
        fig.suptitle(picture.title, fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


__all__ = ["GraphPicture", "PictureNode", "graph_picture", "matplotlib_available", "render_png"]
