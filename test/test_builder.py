"""geir.builder: the one primitive that assembles ops, the Builder around it, and the BNSD helper."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from geir import Module, parse, parse_file, print_module, verify_module
from geir.attributes import DenseAttr, DenseResourceAttr
from geir.builder import Builder, clone_graph, create_op, infer_result_types
from geir.diagnostics import Diagnostic, DiagnosticEngine
from geir.ir import Graph, Operation, Value
from geir.opdef import ShapeError
from geir.ops.linalg import bnsd
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.passes.pattern import Rewriter
from geir.printer import print_graph
from geir.types import DType, TensorType

from helpers import graph_text

ROOT = Path(__file__).resolve().parent.parent


def f32(*shape: int) -> TensorType:
    """An f32 tensor type of `shape`."""
    return TensorType(shape, DType.f32)


def run_passes(module: Module, pipeline: str) -> None:
    """Run `pipeline` on `module`; fails the test on any diagnostic."""
    errors: list[Diagnostic] = []
    ctx = PassContext(diagnostics=DiagnosticEngine(errors.append))
    assert PassManager(complete_pipeline(parse_pipeline(pipeline))).run(module, ctx), errors


def assert_uses_consistent(graph: Graph) -> None:
    """Every value's use list holds each live op exactly as often as that op uses the value, and nothing else."""
    ops = graph.ops
    live = {id(op) for op in ops}
    for v in list(graph.args) + [r for op in ops for r in op.results]:
        for user in v.uses:
            assert id(user) in live and not user.erased, f"{v!r} is used by {user}, which is not in the graph"
            assert v.uses.count(user) == user.operands.count(v), f"{v!r}: {user} counted wrongly"
    for op in ops:
        for v in op.operands:
            assert v.uses.count(op) == op.operands.count(v), f"{op} uses {v!r} {op.operands.count(v)} times"


def model_graph() -> Graph:
    """A graph of many op kinds, built with the Builder and every result type inferred."""
    b = Builder()
    x = b.argument(f32(2, 16, 32), "x")
    w = b.argument(f32(32, 32), "w")
    q = b.argument(TensorType((1, 16, 4, 8), DType.f16), "q")  # BSND
    bias = b.constant(np.arange(32, dtype=np.float32) / 32)
    h = b.create("ge.matmul", [x, w], {"transpose_b": True}, hint="h").result
    h = b.create("ge.add", [h, bias], hint="h").result
    gamma, beta = b.constant(1.0, f32(32), name="gamma"), b.constant(0.0, f32(32), name="beta")
    n = b.create("ge.layer_norm", [h, gamma, beta], {"axis": -1, "epsilon": 1e-5}, hint="n").result
    g = b.create("ge.gelu", [n], {"approximate": "tanh"}, hint="g").result
    lo, hi = b.create("ge.split", [g], {"axis": 2, "sizes": [8, 24]}, hint="part").results
    cat = b.create("ge.concat", [hi, lo], {"axis": -1}, hint="cat").result
    t = b.create("ge.transpose", [cat], {"perm": [0, 2, 1]}, hint="t").result
    r = b.create("ge.reshape", [t], {"shape": [64, -1]}).result
    m = b.create("ge.reduce_mean", [r], {"axes": [1], "keepdims": True}, hint="m").result
    sm = b.create("ge.softmax", [r], {"axis": 0}, hint="sm").result
    big = b.create("ge.greater", [sm, m], hint="big").result
    sel = b.create("ge.select", [big, sm, m], hint="sel").result
    sl = b.create("ge.slice", [sel], {"axes": [0], "starts": [0], "ends": [4]}, hint="sl").result
    half = b.create("ge.cast", [sl], {"to": DType.f16}, hint="half").result
    att = b.create("ge.flash_attention", [q, q, q], {"causal": True, "layout": "BSND"}, hint="att").result
    kv = b.resource("kv", TensorType((1, 16, 4, 8), DType.f16), name="kv")
    att2 = b.create("ge.flash_attention", [att, kv, kv], {"scale": 0.5, "layout": "BSND"}, hint="att").result
    return b.finish([half, att2])


# --- create_op: the primitive ------------------------------------------------------------------

def test_create_op_allocates_results_and_registers_uses():
    x = Value(f32(4), "x")
    op = create_op("ge.add", [x, x], result_names=["y"])
    assert op.result.type == f32(4) and op.result.name == "y" and op.result.owner is op and op.result.index == 0
    assert x.uses == [op, op]
    untyped = create_op("ge.neg", [x], [None])
    assert untyped.result.type is None and x.uses.count(untyped) == 1


def test_create_op_refuses_unknown_ops_and_mismatched_names():
    with pytest.raises(KeyError, match="ge.nope"):
        create_op("ge.nope", [])
    with pytest.raises(ValueError, match="1 result type"):
        create_op("ge.neg", [Value(f32(4), "x")], [f32(4)], result_names=["a", "b"])


def test_a_shape_error_names_the_op_and_leaves_the_operands_untouched():
    a, c = Value(f32(2, 3), "a"), Value(f32(4, 5), "c")
    with pytest.raises(ShapeError) as e:
        create_op("ge.matmul", [a, c])
    assert str(e.value) == ("ge.matmul does not type-check on tensor<2x3xf32>, tensor<4x5xf32>: "
                            "matmul contraction dims differ: 3 vs 4")
    assert not a.uses and not c.uses
    b = Builder()
    x = b.argument(f32(2, 3), "x")
    with pytest.raises(ShapeError, match=r"^ge\.add does not type-check on tensor<2x3xf32>, tensor<5xf32>: "):
        b.create("ge.add", [x, b.argument(f32(5), "y")])
    with pytest.raises(ShapeError, match="operand 0 has no type"):
        create_op("ge.neg", [Value(None, "u")])
    assert b.graph.ops == [] and not x.uses


def test_infer_result_types_takes_types_without_operands():
    probe = create_op("ge.split", [], [None, None], {"axis": 0, "sizes": [1, 3]})
    assert infer_result_types(probe, [f32(4, 2)]) == [f32(1, 2), f32(3, 2)]


# --- Builder -----------------------------------------------------------------------------------

def test_built_graphs_print_and_parse_back_to_the_same_text():
    g = model_graph()
    module = Module([g])
    assert verify_module(module)
    text = print_module(module)
    assert "%part_0, %part_1 = ge.split %g {axis = 2, sizes = [8, 24]}" in text
    assert '%kv = ge.const dense_resource<"kv"> : tensor<1x16x4x8xf16>' in text
    assert "%h_1 = ge.add %h, %0" in text  # a hint taken is made unique; an unnamed constant prints numbered
    back = parse(text)
    assert verify_module(back) and print_module(back) == text
    assert print_graph(clone_graph(g)) == text


def test_inferred_result_types_equal_what_infer_shapes_gives():
    g = model_graph()
    built = [[r.type for r in op.results] for op in g.ops]
    module = parse(print_graph(g))
    for op in module.graph().ops:
        if op.name != "ge.const":  # a constant's type is part of it
            for r in op.results:
                r.type = None
    run_passes(module, "infer-shapes")
    assert [[r.type for r in op.results] for op in module.graph().ops] == built


def test_fresh_names_are_unique_and_valid():
    g = parse(graph_text("  %y = ge.neg %x\n  ge.return %y")).graph()
    b = Builder(g)
    assert b.fresh_name("y") == "y_1" and b.fresh_name("y") == "y_2" and b.fresh_name("x") == "x_1"
    assert b.fresh_name("a b/c") == "a_b_c" and b.fresh_name("") == "v"
    b.set_insertion_point_before(g.ops[0])
    op = b.create("ge.abs", [g.args[0]], result_names=["z"])
    assert b.fresh_name("z") == "z_1"  # exact names count as taken
    assert [o.name for o in g.ops] == ["ge.abs", "ge.neg", "ge.return"] and op.result.name == "z"
    uses = list(g.args[0].uses)
    with pytest.raises(ValueError, match="not both"):
        b.create("ge.abs", [g.args[0]], hint="w", result_names=["w"])
    assert g.args[0].uses == uses


def test_constants():
    b = Builder()
    c = b.constant(np.array([[1, 2]], dtype=np.int32), name="c")
    assert c.type == TensorType((1, 2), DType.i32) and c.owner.value == DenseAttr(np.array([[1, 2]], np.int32))
    s = b.constant(0.5, DType.bf16)
    assert s.type == TensorType((), DType.bf16)
    splat = b.constant(DenseAttr(np.array(2.0)), f32(3, 3))
    assert splat.owner.value.is_splat and splat.type == f32(3, 3)
    w = b.resource("layer.0.w", f32(8, 8), name="layer.0.w")
    assert w.owner.value == DenseResourceAttr("layer.0.w") and w.name == "layer.0.w"
    # a literal of a dtype GEIR lacks needs its type; a Python float is numpy's float64, GEIR's f64 (AI CPU)
    with pytest.raises(ValueError, match="complex128"):
        b.constant(0.5j)
    assert b.constant(0.5).type == TensorType((), DType.f64)
    b.finish([c, s, splat, w])
    assert verify_module(Module([b.graph]))


def test_finish_returns_at_the_end_whatever_the_insertion_point():
    b = Builder(Graph("f", [], []))
    x = b.argument(f32(4), "x")
    y = b.create("ge.exp", [x], hint="y").result
    b.set_insertion_point_before(y.owner)
    z = b.create("ge.neg", [x], hint="z").result
    g = b.finish([y, z])
    assert [op.name for op in g.ops] == ["ge.neg", "ge.exp", "ge.return"]
    assert g.result_types == [f32(4), f32(4)] and g.terminator.operands == [y, z]
    assert_uses_consistent(g)


def test_inserting_before_an_anchor_keeps_use_lists_consistent():
    g = parse(graph_text("  %a = ge.exp %x : tensor<4xf32>\n  %b = ge.add %a, %a : tensor<4xf32>\n"
                         "  %c = ge.mul %b, %a : tensor<4xf32>\n  ge.return %c")).graph()
    exp, add, mul, ret = g.ops
    a = exp.result
    b = Builder(g)
    b.set_insertion_point_before(add)
    n = b.create("ge.neg", [a], hint="n").result
    twice = b.create("ge.mul", [n, n], hint="twice").result
    add.set_operand(1, twice)  # %b = ge.add %a, %twice
    mul.set_operand(1, n)
    assert [op.name for op in g.ops] == ["ge.exp", "ge.neg", "ge.mul", "ge.add", "ge.mul", "ge.return"]
    assert a.uses.count(add) == 1 and n.uses.count(twice.owner) == 2
    assert_uses_consistent(g)
    back = parse(print_graph(g))
    assert verify_module(back) and print_module(back) == print_graph(g)


def test_rewritten_graphs_keep_use_lists_consistent():
    for path in ("examples/attention.geir", "examples/gpt2_block.geir"):
        module = parse_file(str(ROOT / path))
        run_passes(module, "fuse,canonicalize,cse")
        assert any(op.name == "ge.flash_attention" for op in module.graph().ops)
        assert_uses_consistent(module.graph())


def test_a_rewriter_that_fails_to_build_leaves_no_use_behind():
    g = parse(graph_text("  %y = ge.neg %x\n  ge.return %y", "%x: tensor<4xf32>")).graph()
    x = g.args[0]
    rw = Rewriter(g)
    with pytest.raises(ShapeError, match="ge.matmul"):
        rw.create("ge.matmul", [x, x], before=g.ops[0])
    assert x.uses == [g.ops[0]] and not rw.touched


def test_cloned_graphs_are_independent_and_consistent():
    module = parse_file(str(ROOT / "examples/gpt2_block.geir"))
    g = module.graph()
    copy = clone_graph(g)
    assert print_graph(copy) == print_graph(g)
    originals = {id(v) for op in g.ops for v in op.operands + op.results}
    assert not any(id(v) in originals for op in copy.ops for v in op.operands + op.results)
    assert_uses_consistent(copy)
    assert_uses_consistent(g)


def test_readme_example_runs_and_prints_what_the_readme_shows():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Building graphs in Python: geir.builder\n", 1)[1]
    code, shown = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)[:2]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue() == shown
    assert print_module(parse(shown)) == shown


# --- one way to build an op --------------------------------------------------------------------

SOURCE_DIRS = ("geir", "passes", "runtime", "session", "frontends", "kernels")
# (file, function) that still assemble an op by hand, and why
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}
# use lists are edited (not assembled) by Value.replace_all_uses_with and Operation.set_operand
USE_LIST_EDITS = "geir/ir.py"


def _hand_assembly(path: Path, rel: str) -> list[tuple[str, int, str]]:
    """Where a file assembles an op by hand: (function, line, what)."""
    found = []
    tree = ast.parse(path.read_text(), rel)

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            what = _assembles(child, rel)
            if what:
                found.append((name, child.lineno, what))
            visit(child, name)

    visit(tree, "<module>")
    return found


def _is_none(node: ast.AST) -> bool:
    """The literal None."""
    return isinstance(node, ast.Constant) and node.value is None


def _assembles(node: ast.AST, rel: str) -> str | None:
    """What part of assembling an op `node` does by hand (in file `rel`), or None."""
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id == "Value":
            owner = next((k.value for k in node.keywords if k.arg == "owner"), None)
            if len(node.args) > 2:
                owner = node.args[2]
            if owner is not None and not _is_none(owner):
                return "a result Value made by hand"
        # an op class called with an empty result list: Kind(name, operands, [], attributes, ...)
        # (create_op and Graph take the same shape of arguments legitimately)
        called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        empty_third = len(node.args) >= 4 and isinstance(node.args[2], ast.List) and not node.args[2].elts
        if empty_third and called not in ("create_op", "Graph"):
            return "an op class called directly"
        adds = isinstance(f, ast.Attribute) and f.attr in ("append", "extend", "insert")
        if adds and isinstance(f.value, ast.Attribute):
            if f.value.attr == "results":
                return "results added by hand"
            if f.value.attr == "uses" and rel != USE_LIST_EDITS:
                return "a use registered by hand"
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(t, ast.Attribute) and t.attr == "results" for t in targets):
            return "results assigned by hand"
    return None


def test_ops_are_assembled_only_in_geir_builder():
    found = []
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "geir/builder.py":
                continue
            found += [(rel, func, line, what) for func, line, what in _hand_assembly(path, rel)
                      if (rel, func) not in KNOWN_EXCEPTIONS]
    assert found == []


def test_the_scan_finds_hand_assembly():
    # the exceptions are still there (drop them once they are gone), and each kind of assembly is caught
    for (rel, func) in KNOWN_EXCEPTIONS:
        assert any(f == func for f, _, _ in _hand_assembly(ROOT / rel, rel)), (rel, func)
    sample = '''
def make(cls, x, t):
    op = cls("ge.neg", [x], [], {})
    op.results = [Value(t, None, op, 0)]
    x.uses.append(op)
    op.results.append(Value(t, "y", owner=op))
'''
    tree = ast.parse(sample)
    whats = sorted({w for n in ast.walk(tree) if (w := _assembles(n, "x.py"))})
    assert whats == ["a result Value made by hand", "a use registered by hand", "an op class called directly",
                     "results added by hand", "results assigned by hand"]


def test_geir_builder_stays_in_the_core():
    imports = set()
    for node in ast.walk(ast.parse((ROOT / "geir/builder.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            imports.add(node.module)
        elif isinstance(node, ast.Import):
            imports.update(a.name for a in node.names)
    assert imports <= {"__future__", "re", "typing", "numpy", "geir.attributes", "geir.diagnostics", "geir.ir",
                       "geir.opdef", "geir.types"}, imports
    above = ("geir.passes", "geir.kernels", "geir.runtime", "geir.session", "geir.frontends", "geir.tools",
             "geir.target_npu", "torch", "onnx")
    code = ("import sys, geir.builder; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx') "
            f"or m.startswith({above!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_operation_has_no_second_constructor():
    assert not hasattr(Operation, "create")
    import geir.ir

    assert not hasattr(geir.ir, "clone_graph") and not hasattr(geir.ir, "clone_op")


# --- bnsd --------------------------------------------------------------------------------------

def test_bnsd_unpacks_both_layouts():
    t = TensorType((2, 8, 128, 64), DType.f16)
    assert bnsd(t) == bnsd(t, "BNSD") == (2, 8, 128, 64)
    assert bnsd(t, "BSND") == (2, 128, 8, 64)
    assert bnsd(TensorType((1, None, 4, 16), DType.f16), "BSND") == (1, 4, None, 16)
    with pytest.raises(ValueError, match="layout"):
        bnsd(t, "NSBD")


def test_bnsd_is_the_one_helper_that_unpacks_attention_layouts():
    # every other module asks geir.ops.linalg.bnsd instead of writing the BSND swap again
    root = Path(__file__).resolve().parent.parent
    defs = [p for d in ("geir", "passes", "kernels", "runtime", "session", "frontends") for p in (root / d).rglob("*.py")
            if any(isinstance(n, ast.FunctionDef) and n.name == "bnsd" for n in ast.walk(ast.parse(p.read_text())))]
    assert [str(p.relative_to(root)) for p in defs] == ["geir/ops/linalg.py"]


def test_flash_attention_infers_bsnd_results_through_bnsd():
    b = Builder()
    q = b.argument(TensorType((1, 128, 8, 64), DType.f16), "q")  # B, S, N, D
    k = b.argument(TensorType((1, 256, 2, 64), DType.f16), "k")
    out = b.create("ge.flash_attention", [q, k, k], {"layout": "BSND"}).result
    assert out.type == TensorType((1, 128, 8, 64), DType.f16)
    k3 = b.argument(TensorType((1, 256, 3, 64), DType.f16), "k3")
    with pytest.raises(ShapeError, match="query heads 8 are not a multiple of key/value heads 3"):
        b.create("ge.flash_attention", [q, k3, k3], {"layout": "BSND"})


def test_decomposing_bsnd_attention_reads_its_dims_through_bnsd():
    text = graph_text(
        "  %o = ge.flash_attention %q, %k, %k {layout = \"BSND\", causal = true} : tensor<1x32x4x16xf16>\n"
        "  ge.return %o",
        "%q: tensor<1x32x4x16xf16>, %k: tensor<1x48x2x16xf16>", "tensor<1x32x4x16xf16>")
    from geir.passes.fusion.guards import decompose_flash_attention
    from geir.reference import run_graph

    before, after = parse(text), parse(text)
    g = after.graph()
    rw = Rewriter(g)
    decompose_flash_attention(g.ops[0], rw)
    assert not any(op.name == "ge.flash_attention" for op in g.ops)
    assert verify_module(after)
    assert_uses_consistent(g)
    rng = np.random.default_rng(0)
    inputs = {a.name: rng.standard_normal(a.type.shape).astype(np.float16) for a in g.args}
    (want,), (have,) = run_graph(before.graph(), inputs), run_graph(g, inputs)
    np.testing.assert_allclose(have.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-3)
