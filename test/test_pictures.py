"""Pictures: `geopt --dot` (the graph as Graphviz DOT, fused ops marked) and `gerun --timeline` (a PNG
of the run). DOT files are checked with a small structural parser here, and by Graphviz's own `dot`
when it is installed; PNGs are read back with matplotlib (those tests skip without the plot extra)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from geir import parse_file
from geir.builder import create_op
from geir.dot import FUSED_KINDS, quote, to_dot
from geir.ir import Graph, Operation, Value
from geir.runtime.interpreter import Runtime
from geir.session import Session
from geir.runtime.timeline import Row, Timeline, busy_fraction, detail_cores, timeline_data
from geir.runtime.trace import runs_trace
from geir.target_npu.sim import PIPES
from geir.target_npu.target import load_target
from geir.tools.geopt import main as geopt_main
from geir.tools.gerun import main as gerun_main
from geir.types import DType, TensorType

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
ATTENTION = EXAMPLES / "attention.geir"
DOT = shutil.which("dot")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_tool(main, argv, capsys):
    """(exit code, stdout, stderr) of an in-process run; argparse's exits count as return codes."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return rc, out, err


# --- a small DOT reader: enough structure to check what geopt writes ------------------------------------

_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<arrow>->)|(?P<id>[A-Za-z_][A-Za-z0-9_.]*|-?\d+(?:\.\d+)?)'
                    r'|(?P<punct>[{}\[\];,=]))', re.DOTALL)


def _unquote(token: str) -> str:
    """A DOT string's text as Graphviz shows it: `\\"` a quote, `\\\\` a backslash, `\\n` a line break."""
    body = token[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "l": "\n", "r": "\n"}.get(m.group(1), m.group(1)), body)


def tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        assert m, f"unexpected DOT text at {pos}: {text[pos:pos + 40]!r}"
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


def read_dot(text: str) -> dict:
    """Nodes (id -> attributes, labels unquoted), edges, clusters; asserts balanced braces and declared endpoints."""
    toks = tokens(text)
    assert toks[:3] == ["digraph", "geir", "{"], toks[:3]
    depth = 0
    nodes: dict[str, dict[str, str]] = {}
    edges: list[tuple[str, str, dict[str, str]]] = []
    clusters: list[str] = []
    i = 0

    def attr_list(j: int) -> tuple[dict[str, str], int]:
        attrs: dict[str, str] = {}
        if j < len(toks) and toks[j] == "[":
            j += 1
            while toks[j] != "]":
                key, eq, value = toks[j], toks[j + 1], toks[j + 2]
                assert eq == "=", toks[j:j + 3]
                attrs[key] = _unquote(value) if value.startswith('"') else value
                j += 3
                if toks[j] in (",", ";"):
                    j += 1
            j += 1
        return attrs, j

    while i < len(toks):
        t = toks[i]
        if t == "{":
            depth += 1
            i += 1
        elif t == "}":
            depth -= 1
            assert depth >= 0, "unbalanced braces"
            i += 1
        elif t == "subgraph":
            name = toks[i + 1]
            clusters.append(_unquote(name) if name.startswith('"') else name)
            i += 2
        elif t in ("graph", "node", "edge", "digraph"):
            if t == "digraph":
                i += 2
                continue
            _, i = attr_list(i + 1)
        elif t == ";":
            i += 1
        elif i + 2 < len(toks) and toks[i + 1] == "=":  # a graph attribute: label="..."
            i += 3
        elif i + 2 < len(toks) and toks[i + 1] == "->":
            attrs, j = attr_list(i + 3)
            edges.append((t, toks[i + 2], attrs))
            i = j
        else:
            attrs, i = attr_list(i + 1)
            assert t not in nodes, f"node {t} declared twice"
            nodes[t] = attrs
    assert depth == 0, "unbalanced braces"
    for a, b, _ in edges:
        assert a in nodes and b in nodes, f"edge {a} -> {b} names an undeclared node"
    return {"nodes": nodes, "edges": edges, "clusters": clusters}


def fused_nodes(dot: dict) -> dict[str, str]:
    """Node id -> the rule named in its label, for every node drawn as fused (filled, not a legend entry)."""
    out = {}
    for nid, attrs in dot["nodes"].items():
        m = re.search(r"\[fused by (\w+)\]", attrs.get("label", ""))
        if m:
            assert "filled" in attrs.get("style", ""), attrs
            out[nid] = m.group(1)
    return out


def graphviz_accepts(path: Path) -> str:
    """The SVG Graphviz renders from the file (skipped when `dot` is not installed)."""
    if DOT is None:
        pytest.skip("graphviz's dot is not installed")
    done = subprocess.run([DOT, "-Tsvg", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "Warning" not in done.stderr and "Error" not in done.stderr, done.stderr
    return done.stdout


# --- geopt --dot ---------------------------------------------------------------------------------------------

def test_dot_of_fused_attention_marks_the_flash_attention(tmp_path, capsys):
    out_dot = tmp_path / "after.dot"
    rc, out, err = run_tool(geopt_main, [ATTENTION, "--passes=fuse", "--dot", out_dot], capsys)
    assert rc == 0 and err == ""
    _, plain, _ = run_tool(geopt_main, [ATTENTION, "--passes=fuse"], capsys)
    assert out == plain  # the IR still goes to stdout
    dot = read_dot(out_dot.read_text())
    marked = fused_nodes(dot)
    assert list(marked.values()) == ["flash_attention"]
    (nid,) = marked
    assert "ge.flash_attention" in dot["nodes"][nid]["label"]
    assert "made by the fuse pass's flash_attention rule" in dot["nodes"][nid]["tooltip"]
    assert [a["label"] for n, a in dot["nodes"].items() if n.startswith("legend")] == ["flash_attention"]
    # q, k and v arrive at their operand positions
    assert sorted(e[2].get("label") for e in dot["edges"] if e[1] == nid) == ["k", "q", "v"]
    graphviz_accepts(out_dot)


def test_dot_before_fusion_marks_nothing_and_draws_every_op(tmp_path, capsys):
    out_dot = tmp_path / "before.dot"
    rc, _, _ = run_tool(geopt_main, [ATTENTION, "--dot", out_dot], capsys)
    assert rc == 0
    dot = read_dot(out_dot.read_text())
    assert fused_nodes(dot) == {}  # the hand-written ge.softmax is not something fuse made
    assert not any("filled" in a.get("style", "") and "ge." in a.get("label", "") for a in dot["nodes"].values())
    graph = parse_file(str(ATTENTION)).graph()
    body = graph.ops[:-1]
    ops = [a for n, a in dot["nodes"].items() if "_op" in n]
    assert len(ops) == len(body)
    assert len([n for n in dot["nodes"] if "_arg" in n]) == len(graph.args)
    assert len([n for n in dot["nodes"] if "_res" in n]) == 1
    assert len(dot["edges"]) == sum(len(op.operands) for op in graph.ops)  # one per use, the return's included
    assert any(a["label"].startswith("%p = ge.softmax") for a in ops)
    assert dot["clusters"] == ["cluster_main"]
    graphviz_accepts(out_dot)


def test_dot_marks_each_rule_of_a_gpt2_block(tmp_path, capsys):
    out_dot = tmp_path / "gpt2.dot"
    rc, _, _ = run_tool(geopt_main, [EXAMPLES / "gpt2_block.geir", "--passes=fuse", "--dot", out_dot], capsys)
    assert rc == 0
    rules = sorted(fused_nodes(read_dot(out_dot.read_text())).values())
    # the second layer norm takes the residual add before it in (add_layer_norm)
    assert rules == ["add_layer_norm", "flash_attention", "layer_norm"] + ["matmul_epilogue"] * 4
    graphviz_accepts(out_dot)


def test_dot_marks_follow_the_fused_op_into_the_lowered_program(tmp_path, capsys):
    out_dot = tmp_path / "low.dot"
    rc, _, _ = run_tool(geopt_main, [ATTENTION, "--passes=fuse,lower", "--dot", out_dot], capsys)
    assert rc == 0
    dot = read_dot(out_dot.read_text())
    (nid,) = fused_nodes(dot)
    assert "rt.launch" in dot["nodes"][nid]["label"] and "kernel ge.flash_attention" in dot["nodes"][nid]["label"]
    events = [e for e in dot["edges"] if e[2].get("style") == "dashed"]
    assert events and all(e[2]["label"].startswith("event ") for e in events)
    assert "rt.program @main" in text_of_cluster_label(out_dot.read_text())
    graphviz_accepts(out_dot)


def text_of_cluster_label(text: str) -> str:
    m = re.search(r'subgraph "cluster_main" \{\s*label=("(?:[^"\\]|\\.)*")', text)
    assert m, text[:300]
    return _unquote(m.group(1))


def test_dot_label_escaping_round_trips_quotes_backslashes_and_angle_brackets(tmp_path, capsys):
    src = tmp_path / "q.geir"
    src.write_text('ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {\n'
                   '  %w = ge.const dense_resource<"w\\"<b>\\\\n{x}"> : tensor<4xf32>\n'
                   '  %y = ge.add %x, %w\n  ge.return %y\n}\n')
    out_dot = tmp_path / "q.dot"
    rc, _, _ = run_tool(geopt_main, [src, "--dot", out_dot], capsys)
    assert rc == 0
    expected = '%w = ge.const dense_resource<"w\\"<b>\\\\n{x}">'  # as the IR prints it
    dot = read_dot(out_dot.read_text())
    labels = [a["label"].split("\n")[0] for n, a in dot["nodes"].items() if "_op" in n]
    assert expected in labels
    svg = graphviz_accepts(out_dot)
    texts = [t.text for t in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text")]
    assert expected in texts  # Graphviz shows exactly the IR's text


def test_quote_escapes_for_dot():
    assert quote('a "b" \\c\nd<e>') == '"a \\"b\\" \\\\c\\nd<e>"'


def test_to_dot_escapes_a_string_attribute_with_quotes():
    x = Value(TensorType((4,), DType.f32), "x")
    op = create_op("test.op", [x], [TensorType((4,), DType.f32)], {"note": 'say "hi"\n<there>'},
                   result_names=["y"], op_class=Operation)
    ret = create_op("ge.return", [op.result], [])
    text = to_dot([Graph("main", [x], [TensorType((4,), DType.f32)], [op, ret])])
    dot = read_dot(text)
    (label,) = [a["label"] for n, a in dot["nodes"].items() if "_op" in n]
    assert 'note = "say \\"hi\\"\\n<there>"' in label.split("\n")  # the attribute as the IR prints it


def test_dot_elides_large_constants(tmp_path, capsys):
    out_dot = tmp_path / "causal.dot"
    rc, _, _ = run_tool(geopt_main, [EXAMPLES / "attention" / "causal.geir", "--dot", out_dot], capsys)
    assert rc == 0
    text = out_dot.read_text()
    assert "dense<...> (128x128, 16384 elements)" in text
    assert len(text) < 10_000 and "-inf, -inf" not in text


def test_dot_draws_one_cluster_per_graph(tmp_path, capsys):
    src = tmp_path / "two.geir"
    src.write_text("ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {\n  %y = ge.neg %x\n  ge.return %y\n}\n"
                   "ge.graph @helper(%a: tensor<4xf32>, %b: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {\n"
                   "  %s = ge.add %a, %b\n  ge.return %s, %a\n}\n")
    out_dot = tmp_path / "two.dot"
    rc, _, _ = run_tool(geopt_main, [src, "--dot", out_dot], capsys)
    assert rc == 0
    dot = read_dot(out_dot.read_text())
    assert dot["clusters"] == ["cluster_main", "cluster_helper"]
    assert len([n for n in dot["nodes"] if n.startswith("g1_res")]) == 2
    graphviz_accepts(out_dot)


def test_dot_to_stdout_replaces_the_ir(tmp_path, capsys):
    out_ir = tmp_path / "out.geir"
    rc, out, _ = run_tool(geopt_main, [ATTENTION, "--passes=fuse", "--dot", "-", "-o", out_ir], capsys)
    assert rc == 0
    assert out.startswith("digraph geir {") and "ge.graph @main(" not in out
    assert list(fused_nodes(read_dot(out)).values()) == ["flash_attention"]
    assert out_ir.read_text().startswith("ge.graph @main(")


def test_dot_bad_input_writes_no_file(tmp_path, capsys):
    bad = tmp_path / "bad.geir"
    bad.write_text("ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {\n  %y = ge.neg %nope\n  ge.return %y\n}\n")
    out_dot = tmp_path / "out" / "g.dot"
    out_dot.parent.mkdir()
    rc, _, err = run_tool(geopt_main, [bad, "--passes=fuse", "--dot", out_dot], capsys)
    assert rc == 1 and "error: use of undefined value '%nope'" in err
    assert os.listdir(out_dot.parent) == []  # no file, no temporary left behind
    out_dot.write_text("old")
    rc, _, _ = run_tool(geopt_main, [bad, "--dot", out_dot], capsys)
    assert rc == 1 and out_dot.read_text() == "old"
    rc, _, err = run_tool(geopt_main, [ATTENTION, "--dot", tmp_path], capsys)  # a directory: exit 1, no traceback
    assert rc == 1 and "geopt: error: cannot write" in err


def test_fused_kinds_name_the_fuse_pass_rules():
    from geir.passes.fuse import FUSION_RULES

    from geir.dot import REFINING_RULES

    assert sorted(list(FUSED_KINDS.values()) + list(REFINING_RULES)) == sorted(FUSION_RULES)
    assert all(kind in FUSED_KINDS for kind in REFINING_RULES.values())


# --- gerun --timeline ----------------------------------------------------------------------------------------

def attention_run():
    """One run of examples/attention.geir with pipes recorded, and GE's spans."""
    module = parse_file(str(ATTENTION))
    session = Session(module)
    rng = np.random.default_rng(0)
    inputs = {a.name: rng.standard_normal(a.type.shape).astype(np.float16) for a in module.graph().args}
    program = session.program({k: v.shape for k, v in inputs.items()})
    result = Runtime(load_target("ascend910b"), record_pipes=True).run(program, inputs)
    return program, result, session.spans


def test_timeline_data_has_a_row_for_every_pipe_that_worked():
    program, result, spans = attention_run()
    tl = timeline_data(runs_trace([result], [spans]), result.target, "attention")
    (launch,) = [op for op in program.ops if op.name == "rt.launch"]
    cores = launch.attributes["tiling"]["cores"]
    (kernel,) = result.kernels
    worked = {p for p in PIPES if kernel.busy[p] > 0}
    # the 910B's AIVs load S and P V from the workspace on their own MTE2 (the CV-split FlashAttention)
    assert worked == {"MTE2", "MTE1", "CUBE", "FIXP", "VECTOR", "MTE3", "AIV_MTE2"}
    # and the launch head (catlass's empty-kernel time, in proportion to the cores started) on the scalar pipe
    assert kernel.head > 0
    assert {(r.core, r.lane) for r in tl.core_rows} == {(c, p) for c in range(cores) for p in worked | {"SCALAR"}}
    (head_row, *_) = [r for r in tl.core_rows if r.lane == "SCALAR"]
    assert head_row.end.max() - head_row.start.min() == pytest.approx(kernel.head * 1e6 / result.target.clock_hz)
    us_per_cycle = 1e6 / result.target.clock_hz
    for p in worked:  # the rows hold every busy cycle the kernel counted
        total = sum(r.busy_us for r in tl.core_rows if r.lane == p)
        assert total == pytest.approx(kernel.busy[p] * us_per_cycle, rel=1e-9)
    ((name, start, end),) = tl.kernels
    assert name == "ge.flash_attention" and start < end
    assert all(start - 1e-9 <= r.start.min() and r.end.max() <= end + 1e-9 for r in tl.core_rows)
    streams = {r.lane: r for r in tl.track("Runtime")}
    assert set(streams["stream 0"].kinds) == {"h2d", "d2h"} and streams["stream 1"].kinds == ("kernel",)
    assert tl.simulated_us == pytest.approx(max(t.end_us for t in result.tasks))
    ge = {r.lane: r for r in tl.track("GE")}
    assert "compile" in ge["steps"].names and "fuse" in ge["passes"].names


def test_timeline_data_puts_runs_one_after_another():
    _, first, _ = attention_run()
    _, second, _ = attention_run()
    tl = timeline_data(runs_trace([first, second]), first.target)
    assert len(tl.runs) == 2 and tl.runs[1][0] == pytest.approx(tl.runs[0][1])
    assert len(tl.kernels) == 2 and tl.kernels[1][1] >= tl.runs[1][0]
    assert tl.track("GE") == []


def test_ge_spans_lose_their_idle_gaps():
    spans = [("compile", 0.0, 10.0), ("a", 1.0, 5.0), ("b", 5.0, 9.0), ("specialise", 100.0, 120.0),
             ("c", 101.0, 119.0, {"changed": 1})]
    tl_rows = timeline_data_ge(spans)
    steps, passes = tl_rows["steps"], tl_rows["passes"]
    assert steps.names == ("compile", "specialise")
    assert steps.start.tolist() == [0.0, 10.0] and steps.end.tolist() == [10.0, 30.0]
    assert passes.names == ("a", "b", "c") and passes.start.tolist() == [1.0, 5.0, 11.0]


def timeline_data_ge(spans):
    from geir.runtime.timeline import _ge_rows

    rows, cuts = _ge_rows(spans)
    assert cuts == [10.0]
    return {r.lane: r for r in rows}


def test_busy_fraction_is_the_share_of_cores_busy_per_bin():
    rows = [Row("core 0", "CUBE", "simulated", np.array([0.0]), np.array([2.0]), core=0),
            Row("core 1", "CUBE", "simulated", np.array([1.0, 2.5]), np.array([2.0, 3.0]), core=1)]
    frac = busy_fraction(rows, np.array([0.0, 1.0, 2.0, 3.0, 4.0]), cores=2)
    assert frac.tolist() == pytest.approx([0.5, 1.0, 0.25, 0.0])


def test_detail_cores_are_the_first_ones_and_the_last_to_finish():
    def row(core, end):
        return Row(f"core {core}", "CUBE", "simulated", np.array([0.0]), np.array([end]), core=core)

    tl = Timeline("x", "t", 24, [row(c, 10.0 + (5 if c == 4 else 0)) for c in range(6)], [], [])
    assert detail_cores(tl, limit=3) == [(0, ""), (1, ""), (4, "finished last")]
    assert detail_cores(tl, limit=8) == [(c, "") for c in range(6)]


def test_timeline_png_of_two_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    rng = np.random.default_rng(1)
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **{n: rng.standard_normal((1, 8, 128, 64)).astype(np.float32) for n in "qkv"})
    out_png = tmp_path / "t.png"
    rc, out, err = run_tool(gerun_main, [ATTENTION, "--inputs", inputs, "--inputs", inputs, "--timeline", out_png],
                            capsys)
    assert rc == 0, err
    assert "run1.result0" in out
    data = out_png.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    image = matplotlib.image.imread(str(out_png))
    height, width = image.shape[:2]
    assert width == 1600 and 700 <= height <= 2000
    assert image.shape[2] in (3, 4) and float(image[..., :3].std()) > 0.05  # a picture, not a blank page
    assert sorted(os.listdir(tmp_path)) == ["in.npz", "t.png"]


def test_timeline_without_matplotlib_stops_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    out_png = tmp_path / "t.png"
    rc, out, err = run_tool(gerun_main, [ATTENTION, "--timeline", out_png], capsys)
    assert rc == 1
    assert err == "gerun: error: --timeline needs matplotlib: pip install -e '.[plot]'\n"
    assert out == "" and not out_png.exists()


def test_timeline_bad_input_writes_no_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bad = tmp_path / "bad.geir"
    bad.write_text("ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {\n  %y = ge.neg %nope\n  ge.return %y\n}\n")
    out_png = tmp_path / "t.png"
    rc, _, err = run_tool(gerun_main, [bad, "--timeline", out_png], capsys)
    assert rc == 1 and "use of undefined value '%nope'" in err
    assert not out_png.exists()


# --- the graph as a PNG beside the DOT file (no Graphviz) ------------------------------------------------------

def _colour(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])


def test_geopt_dot_writes_a_png_of_the_same_graph_beside_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from geir.dot import RULE_COLOURS
    from geir.graph_picture import graph_picture

    out_dot, fused = tmp_path / "gpt2.dot", tmp_path / "fused.geir"
    rc, _, err = run_tool(geopt_main, [EXAMPLES / "gpt2_block.geir", "--passes=fuse", "--dot", out_dot, "-o", fused],
                          capsys)
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == ["fused.geir", "gpt2.dot", "gpt2.png"]
    dot = read_dot(out_dot.read_text())
    # the layout holds what the DOT file holds: a node per argument, op and result, an edge per use
    picture = graph_picture([parse_file(str(fused)).graph()])
    assert len(picture.nodes) == len([n for n in dot["nodes"] if not n.startswith("legend")])
    assert len(picture.edges) == len(dot["edges"])
    for a, b in picture.edges:  # every edge points down, from an operand to its user
        assert picture.nodes[a].row < picture.nodes[b].row
    image = matplotlib.image.imread(str(tmp_path / "gpt2.png"))[..., :3]
    assert (tmp_path / "gpt2.png").read_bytes().startswith(PNG_SIGNATURE) and image.shape[1] >= 600
    # each rule that filled a node in the DOT file fills boxes in the picture, in the same colour
    for rule in set(fused_nodes(dot).values()):
        hits = np.all(np.abs(image - _colour(RULE_COLOURS[rule])) < 0.02, axis=-1).sum()
        assert hits > 500, rule


def test_no_png_beside_a_dot_written_to_stdout_or_a_device(tmp_path, capsys):
    rc, out, _ = run_tool(geopt_main, [ATTENTION, "--dot", "-"], capsys)
    assert rc == 0 and out.startswith("digraph")
    rc, _, err = run_tool(geopt_main, [ATTENTION, "--dot", os.devnull], capsys)
    assert rc == 0 and not os.path.exists(os.devnull + ".png") and not Path("/dev/null.png").exists()


def test_geopt_dot_without_matplotlib_writes_the_dot_and_says_why_no_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out_dot = tmp_path / "a.dot"
    rc, _, err = run_tool(geopt_main, [ATTENTION, "--dot", out_dot], capsys)
    assert rc == 0
    assert err == f"geopt: note: no PNG beside {out_dot}: drawing it needs matplotlib: pip install -e '.[plot]'\n"
    assert os.listdir(tmp_path) == ["a.dot"]
