"""geir.frontends.onnx and geimport: small models built with onnx.helper, checked against ONNX's own reference.

Numbers are compared with `onnx.reference.ReferenceEvaluator` on the same model (ONNX's semantics),
structure by the ops the imported graph holds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from geir import parse, print_module  # noqa: E402
from geir.attributes import DenseAttr, DenseResourceAttr  # noqa: E402
from geir.frontends.onnx import OnnxImportError, import_onnx  # noqa: E402
from geir.reference import run_graph  # noqa: E402

BIN = Path(sys.executable).parent
F32 = TensorProto.FLOAT


def model(nodes, inputs, outputs, initializers=(), opset=23):
    """A one-graph model at `opset` of the default domain."""
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def vi(name, shape, dtype=F32):
    return helper.make_tensor_value_info(name, dtype, shape)


def ops(module) -> list[str]:
    return [op.name for op in module.graph().ops]


def check_against_onnx(m, feeds, rtol=1e-5, atol=1e-6):
    """Import `m`, run it with GEIR's reference interpreter and compare with ONNX's reference."""
    module, weights = import_onnx(m)
    graph = module.graph()
    got = run_graph(graph, dict(zip([a.name for a in graph.args], feeds.values())), resources=weights)
    want = ReferenceEvaluator(m).run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float64), np.asarray(w, dtype=np.float64),
                                   rtol=rtol, atol=atol)
    return module, weights


rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


# --- ops and numbers -----------------------------------------------------------------------------------

def test_matmul_add_with_initializers():
    w, bias = randn(8, 32), randn(32)
    m = model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
              [vi("x", [4, 8])], [vi("y", [4, 32])],
              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")])
    module, weights = check_against_onnx(m, {"x": randn(4, 8)})
    assert ops(module) == ["ge.const", "ge.matmul", "ge.const", "ge.add", "ge.return"]
    # both initializers are larger than a literal: dense_resource constants, arrays in the weights
    consts = [op for op in module.graph().ops if op.name == "ge.const"]
    assert all(isinstance(op.value, DenseResourceAttr) for op in consts)
    assert sorted(weights) == ["b", "w"]
    np.testing.assert_array_equal(weights["w"], w)


def test_gemm_trans_b_alpha_beta():
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], transB=1, alpha=0.5, beta=2.0)
    m = model([node], [vi("a", [3, 5]), vi("b", [4, 5]), vi("c", [4])], [vi("y", [3, 4])])
    module, _ = check_against_onnx(m, {"a": randn(3, 5), "b": randn(4, 5), "c": randn(4)})
    matmul = next(op for op in module.graph().ops if op.name == "ge.matmul")
    assert matmul.attr("transpose_b") is True and matmul.attr("transpose_a") is False


def test_layer_normalization_with_statistics_outputs():
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=-1, epsilon=1e-3)
    m = model([node], [vi("x", [2, 3, 8]), vi("s", [8]), vi("b", [8])],
              [vi("y", [2, 3, 8]), vi("mean", [2, 3, 1]), vi("inv", [2, 3, 1])], opset=17)
    module, _ = check_against_onnx(m, {"x": randn(2, 3, 8), "s": randn(8), "b": randn(8)})
    ln = next(op for op in module.graph().ops if op.name == "ge.layer_norm")
    assert ln.attr("epsilon") == pytest.approx(1e-3)


def test_dynamic_dim_from_dim_param():
    # a batch known only at run time: `?` in the argument type, and a reshape that keeps it (0 copies a dim)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([0, 2, 4]))),
             helper.make_node("Reshape", ["r", "shape"], ["y"])]
    m = model(nodes, [vi("x", ["batch", 8])], [vi("y", ["batch", 2, 4])])
    module, _ = import_onnx(m)
    text = print_module(module)
    assert "%x: tensor<?x8xf32>" in text and "-> tensor<?x2x4xf32>" in text
    assert "shape = [-1, 2, 4]" in text
    graph = parse(text).graph()
    for batch in (1, 5):
        x = randn(batch, 8)
        (y,) = run_graph(graph, {"x": x})
        np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(batch, 2, 4))


def test_constant_node_and_shape_arithmetic_fold_away():
    # Shape -> Gather -> Concat -> Reshape on static shapes: one reshape, no shape ops left
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Constant", [], ["i0"], value=numpy_helper.from_array(np.array(0))),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
        helper.make_node("Constant", [], ["rest"], value_ints=[-1]),
        helper.make_node("Concat", ["n1", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Constant", [], ["two"], value_float=2.0),
        helper.make_node("Mul", ["flat", "two"], ["y"]),
    ]
    m = model(nodes, [vi("x", [3, 4, 5])], [vi("y", [3, 20])],
              [numpy_helper.from_array(np.array([0]), "ax")])
    module, weights = check_against_onnx(m, {"x": randn(3, 4, 5)})
    assert ops(module) == ["ge.reshape", "ge.const", "ge.mul", "ge.return"]
    two = module.graph().ops[1]
    assert isinstance(two.value, DenseAttr) and float(two.value.values) == 2.0  # a small literal, not a weight
    assert weights == {}


def test_shape_arithmetic_on_dynamic_axes_stays_in_the_graph_and_serves_every_length():
    # what the dynamo exporter writes for positions and a head split at a run-time length S:
    # Shape -> Gather -> Range -> Gather(table), and Reshape(x, Concat(Shape(x)[:2], [2, 4]))
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Constant", [], ["i1"], value=numpy_helper.from_array(np.array(1))),
        helper.make_node("Gather", ["s", "i1"], ["n"], axis=0),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0))),
        helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array(1))),
        helper.make_node("Range", ["zero", "n", "one"], ["pos"]),
        helper.make_node("Gather", ["table", "pos"], ["emb"], axis=0),
        helper.make_node("Add", ["x", "emb"], ["h"]),
        helper.make_node("Shape", ["h"], ["lead"], end=2),
        helper.make_node("Constant", [], ["heads"], value_ints=[2, 4]),
        helper.make_node("Concat", ["lead", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["h", "target"], ["y"]),
    ]
    table = numpy_helper.from_array(randn(32, 8), "table")
    m = model(nodes, [vi("x", ["B", "S", 8])], [vi("y", ["B", "S", 2, 4])], [table])
    module, weights = import_onnx(m)
    assert module.graph().args[0].type.shape == (None, None, 8)
    assert {"ge.shape_of", "ge.range", "ge.dynamic_reshape"} <= set(ops(module))
    # the head split is typed [?, ?, 2, 4] before any length is known
    assert module.graph().terminator.operands[0].type.shape == (None, None, 2, 4)
    from geir.session import Session, run_program

    session = Session(module)
    evaluator = ReferenceEvaluator(m)
    for shape in ((2, 5, 8), (3, 12, 8), (2, 5, 8)):
        x = randn(*shape)
        program = session.program({"x": x.shape})
        (got,) = run_program(program, {"x": x}, weights).outputs
        np.testing.assert_allclose(got, evaluator.run(None, {"x": x})[0], rtol=1e-6)
    assert session.plan_cache["misses"] == 2 and session.plan_cache["hits"] == 1


def test_scatter_nd_and_scatter_elements_match_onnx():
    nodes = [helper.make_node("ScatterND", ["x", "idx", "upd"], ["y"], reduction="add"),
             helper.make_node("ScatterElements", ["x", "eidx", "eupd"], ["z"], axis=1)]
    idx = numpy_helper.from_array(np.array([[0, 1], [2, 3], [0, 1]]), "idx")  # a repeated pair: both add
    eidx = numpy_helper.from_array(np.array([[3, 0], [1, 2], [0, 3]]), "eidx")
    m = model(nodes, [vi("x", [3, 4]), vi("upd", [3]), vi("eupd", [3, 2])], [vi("y", [3, 4]), vi("z", [3, 4])],
              [idx, eidx], opset=18)
    module, _ = check_against_onnx(m, {"x": randn(3, 4), "upd": randn(3), "eupd": randn(3, 2)})
    assert ops(module).count("ge.index_put") == 1 and ops(module).count("ge.scatter_elements") == 1


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_axes_as_attributes_or_inputs_by_opset(opset):
    # Unsqueeze/Squeeze/ReduceSum took axes as attributes before opset 13, Split its sizes before 13,
    # ReduceMean its axes before 18; Split learnt num_outputs in 18
    as_input = opset >= 13
    inits = [numpy_helper.from_array(np.array([1]), "ax1"), numpy_helper.from_array(np.array([2, 2]), "sizes")]
    axes = {"axes": [1]}
    nodes = [
        helper.make_node("Unsqueeze", ["x", "ax1"] if as_input else ["x"], ["u"], **({} if as_input else axes)),
        helper.make_node("Squeeze", ["u", "ax1"] if as_input else ["u"], ["s"], **({} if as_input else axes)),
        helper.make_node("ReduceSum", ["s", "ax1"] if as_input else ["s"], ["r"], keepdims=1,
                         **({} if as_input else axes)),
        helper.make_node("ReduceMean", ["s", "ax1"] if opset >= 18 else ["s"], ["mean"], keepdims=0,
                         **({} if opset >= 18 else axes)),
        helper.make_node("Split", ["s", "sizes"] if as_input and opset < 18 else ["s"], ["p", "q"], axis=1,
                         **({"num_outputs": 2} if opset >= 18 else {} if as_input else {"split": [2, 2]})),
    ]
    m = model(nodes, [vi("x", [3, 4])], [vi("r", [3, 1]), vi("mean", [3]), vi("p", [3, 2]), vi("q", [3, 2])],
              inits, opset=opset)
    module, _ = check_against_onnx(m, {"x": randn(3, 4)})
    assert "ge.split" in ops(module) and "ge.reduce_sum" in ops(module)


def test_slice_attributes_before_opset_10_and_inputs_after():
    old = model([helper.make_node("Slice", ["x"], ["y"], starts=[1, 0], ends=[3, 100], axes=[0, 1])],
                [vi("x", [4, 5])], [vi("y", [2, 5])], opset=9)
    new = model([helper.make_node("Slice", ["x", "st", "en", "ax"], ["y"])], [vi("x", [4, 5])], [vi("y", [2, 3])],
                [numpy_helper.from_array(np.array(v), n)
                 for v, n in (([1, -4], "st"), ([3, -1], "en"), ([0, 1], "ax"))])
    x = randn(4, 5)
    check_against_onnx(old, {"x": x})
    module, _ = check_against_onnx(new, {"x": x})
    assert ops(module) == ["ge.slice", "ge.return"]


def test_function_bodied_op_is_imported_through_its_body():
    # GEIR has no Softplus; ONNX defines it by a function body of ops GEIR has
    m = model([helper.make_node("Softplus", ["x"], ["y"])], [vi("x", [2, 6])], [vi("y", [2, 6])], opset=22)
    module, _ = check_against_onnx(m, {"x": randn(2, 6)})
    assert {"ge.exp", "ge.log"} <= set(ops(module))


# --- attention -----------------------------------------------------------------------------------------

def attention_model(q_shape, k_shape, v_shape, y_shape, mask_shape=None, mask_dtype=F32, past=None, **attrs):
    inputs = ["Q", "K", "V"] + (["attn_mask"] if mask_shape else [""] if past else [])
    vis = [vi("Q", q_shape), vi("K", k_shape), vi("V", v_shape)]
    if mask_shape:
        vis.append(vi("attn_mask", mask_shape, mask_dtype))
    outputs = ["Y"]
    out_vis = [vi("Y", y_shape)]
    if past:
        inputs += ["past_key", "past_value"]
        vis += [vi("past_key", past), vi("past_value", past)]
        present = past[:2] + [past[2] + k_shape[2]] + past[3:]
        outputs += ["present_key", "present_value"]
        out_vis += [vi("present_key", present), vi("present_value", present)]
    node = helper.make_node("Attention", inputs, outputs, **attrs)
    return model([node], vis, out_vis)


def test_attention_3d_gqa_is_one_flash_attention():
    m = attention_model([2, 4, 64], [2, 6, 32], [2, 6, 32], [2, 4, 64], q_num_heads=4, kv_num_heads=2)
    module, _ = check_against_onnx(m, {"Q": randn(2, 4, 64), "K": randn(2, 6, 32), "V": randn(2, 6, 32)})
    fa = [op for op in module.graph().ops if op.name == "ge.flash_attention"]
    assert len(fa) == 1
    assert fa[0].operands[0].type.shape == (2, 4, 4, 16) and fa[0].operands[1].type.shape == (2, 2, 6, 16)


def test_attention_causal_without_cache_uses_the_flag():
    m = attention_model([1, 2, 4, 16], [1, 2, 6, 16], [1, 2, 6, 16], [1, 2, 4, 16], is_causal=1, scale=0.3)
    module, _ = check_against_onnx(m, {"Q": randn(1, 2, 4, 16), "K": randn(1, 2, 6, 16), "V": randn(1, 2, 6, 16)})
    (fa,) = [op for op in module.graph().ops if op.name == "ge.flash_attention"]
    assert fa.attr("causal") is True and fa.attr("scale") == pytest.approx(0.3) and len(fa.operands) == 3


def test_attention_causal_with_cache_is_an_explicit_bottom_right_mask():
    # with a cache of 3 keys, query i sees keys j <= i + 3: not GEIR's top-left causal = true
    m = attention_model([1, 2, 4, 16], [1, 2, 4, 16], [1, 2, 4, 16], [1, 2, 4, 16], past=[1, 2, 3, 16], is_causal=1)
    feeds = {"Q": randn(1, 2, 4, 16), "K": randn(1, 2, 4, 16), "V": randn(1, 2, 4, 16),
             "past_key": randn(1, 2, 3, 16), "past_value": randn(1, 2, 3, 16)}
    module, _ = check_against_onnx(m, feeds)
    (fa,) = [op for op in module.graph().ops if op.name == "ge.flash_attention"]
    assert fa.attr("causal") is False and len(fa.operands) == 4
    keep = fa.operands[3].owner.value.to_array(fa.operands[3].type)
    np.testing.assert_array_equal(keep, np.arange(7)[None, :] <= np.arange(4)[:, None] + 3)


def test_attention_fully_masked_row_is_zero():
    mask = np.ones((4, 6), dtype=bool)
    mask[2] = False  # query 2 sees no key: ONNX gives zeros there
    m = attention_model([1, 2, 4, 16], [1, 2, 6, 16], [1, 2, 6, 16], [1, 2, 4, 16], mask_shape=[4, 6],
                        mask_dtype=TensorProto.BOOL)
    module, _ = check_against_onnx(m, {"Q": randn(1, 2, 4, 16), "K": randn(1, 2, 6, 16), "V": randn(1, 2, 6, 16),
                                       "attn_mask": mask})
    assert ops(module).count("ge.flash_attention") == 1 and "ge.select" in ops(module)


def test_attention_softcap_is_the_kernel_s_option():
    # checked against ONNX's reference, which caps before the mask as the kernel does; scores large enough to bite
    m = attention_model([1, 2, 4, 16], [1, 2, 6, 16], [1, 2, 6, 16], [1, 2, 4, 16], softcap=2.0, mask_shape=[4, 6])
    module, _ = check_against_onnx(m, {"Q": randn(1, 2, 4, 16) * 4, "K": randn(1, 2, 6, 16) * 4,
                                       "V": randn(1, 2, 6, 16), "attn_mask": randn(4, 6)})
    assert ops(module).count("ge.flash_attention") == 1 and "ge.tanh" not in ops(module)
    (fa,) = [op for op in module.graphs[0].ops if op.name == "ge.flash_attention"]
    assert fa.attr("softcap") == 2.0


# --- errors --------------------------------------------------------------------------------------------

def test_unsupported_op_names_node_and_op():
    m = model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Unique", ["r"], ["v"], name="pick")],
              [vi("x", [4, 8])], [vi("v", [4, 2])])
    with pytest.raises(OnnxImportError) as info:
        import_onnx(m)
    assert info.value.unsupported and info.value.node == "pick" and info.value.op_type == "Unique"
    assert str(info.value).startswith("node 'pick' (Unique): unsupported op")


def test_unsupported_dtype_is_reported_not_crashed():
    # (float64 is GEIR's f64 now, placed on the AI CPU; an unsigned byte still has no GEIR dtype)
    m = model([helper.make_node("Abs", ["x"], ["y"])], [vi("x", [3], TensorProto.UINT8)],
              [vi("y", [3], TensorProto.UINT8)])
    with pytest.raises(OnnxImportError, match="graph input 'x': GEIR has no dtype for uint8") as info:
        import_onnx(m)
    assert info.value.unsupported


def test_import_geir_works_without_onnx():
    code = ("import sys; sys.modules['onnx'] = None\n"
            "import geir, geir.frontends.onnx as f\n"
            "try:\n    f.import_onnx('m.onnx')\nexcept f.OnnxImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "needs the onnx package" in out.stdout


# --- geimport --------------------------------------------------------------------------------------------

def geimport(*args, cwd):
    return subprocess.run([str(BIN / "geimport"), *args], capture_output=True, text=True, cwd=cwd)


def test_geimport_writes_graph_and_weights_that_gerun_runs(tmp_path):
    w = randn(8, 32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Gelu", ["h"], ["y"])]
    onnx.save(model(nodes, [vi("x", [4, 8])], [vi("y", [4, 32])], [numpy_helper.from_array(w, "w")]),
              tmp_path / "m.onnx")
    r = geimport("m.onnx", "-o", "m.geir", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert 'dense_resource<"w">' in (tmp_path / "m.geir").read_text()
    with np.load(tmp_path / "m.npz") as z:
        np.testing.assert_array_equal(z["w"], w)
    x = randn(4, 8)
    np.savez(tmp_path / "in.npz", x=x)
    run = subprocess.run([str(BIN / "gerun"), "m.geir", "--inputs", "in.npz", "-o", "out.npz", "--check"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    with np.load(tmp_path / "out.npz") as z:
        h = x.astype(np.float64) @ w
        from math import erf
        want = 0.5 * h * (1 + np.vectorize(erf)(h / np.sqrt(2)))
        np.testing.assert_allclose(z["result0"], want, rtol=1e-4, atol=1e-5)


def test_geimport_unsupported_op_exit_1_and_no_files(tmp_path):
    m = model([helper.make_node("Unique", ["x"], ["v"], name="pick")], [vi("x", [4, 8])], [vi("v", [4, 2])])
    onnx.save(m, tmp_path / "m.onnx")
    r = geimport("m.onnx", "-o", "m.geir", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith("geimport: error: m.onnx: node 'pick' (Unique): unsupported op")
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "m.geir").exists() and not (tmp_path / "m.npz").exists()


def test_geimport_malformed_file_exit_1_no_traceback_no_files(tmp_path):
    (tmp_path / "bad.onnx").write_bytes(b"this is not a protobuf \xff\xfe")
    r = geimport("bad.onnx", "-o", "out.geir", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith("geimport: error: bad.onnx: not an ONNX model") and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx"]
    usage = geimport("bad.onnx", cwd=tmp_path)
    assert usage.returncode == 2 and "-o" in usage.stderr


# --- malformed and hostile models: an error naming what is wrong, exit 1, never an internal error -----------

def geimport_error(m, tmp_path, capsys, data: bytes | None = None) -> str:
    """geimport's one-line message for a model it must refuse (in-process), after checking the contract."""
    from geir.tools.geimport import main

    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString() if data is None else data)
    assert main([str(path), "-o", str(tmp_path / "m.geir")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err
    assert err.startswith(f"geimport: error: {path}: ") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    return err[len(f"geimport: error: {path}: "):-1]


def test_a_negative_input_dimension_names_the_input(tmp_path, capsys):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, -3])], [vi("y", [2, 3])])
    assert geimport_error(m, tmp_path, capsys) == (
        "graph input 'x' has dimension -3 at axis 1; a dimension is 0 or more (or a dim_param for one known only "
        "at run time)")


@pytest.mark.parametrize("opset", [0, -1, onnx.defs.onnx_opset_version() + 1, 10**6])
def test_an_opset_outside_the_supported_range_names_it_and_the_range(opset, tmp_path, capsys):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 3])], [vi("y", [2, 3])], opset=opset)
    assert geimport_error(m, tmp_path, capsys) == (
        f"the model imports opset {opset} of the default domain; GEIR reads opsets 1 to "
        f"{onnx.defs.onnx_opset_version()} (those of onnx {onnx.__version__})")


def test_a_model_without_an_opset_for_its_onnx_ops(tmp_path, capsys):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 3])], [vi("y", [2, 3])])
    del m.opset_import[:]
    assert geimport_error(m, tmp_path, capsys).startswith(
        "the model uses ONNX ops but imports no version of the default domain (opset_import)")


def _with_functions(calls: str, *functions: tuple[str, str]):
    """A model whose node calls local function `calls`; each (name, callee) function calls callee."""
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("local", 1)]
    protos = [helper.make_function("local", name, ["a"], ["b"],
                                   [helper.make_node(callee, ["a"], ["b"], domain="local")], opsets)
              for name, callee in functions]
    graph = helper.make_graph([helper.make_node(calls, ["x"], ["y"], domain="local", name="call")], "g",
                              [vi("x", [2, 3])], [vi("y", [2, 3])])
    return helper.make_model(graph, opset_imports=opsets, functions=protos)


def test_a_self_recursive_local_function_names_it(tmp_path, capsys):
    message = geimport_error(_with_functions("Again", ("Again", "Again")), tmp_path, capsys)
    assert message.startswith("node 'call' (Again): in its ONNX function body, ")
    assert message.endswith("model-local function 'Again' is recursive (Again -> Again): its body cannot be imported")


def test_mutually_recursive_local_functions_name_the_cycle(tmp_path, capsys):
    message = geimport_error(_with_functions("Ping", ("Ping", "Pong"), ("Pong", "Ping")), tmp_path, capsys)
    assert message.endswith("model-local function 'Ping' is recursive (Ping -> Pong -> Ping): its body cannot be "
                            "imported")


def _function_chain(n: int):
    """A node calling local function F0, which calls F1, ... F{n}, whose body is one Relu."""
    chain = [(f"F{i}", f"F{i + 1}") for i in range(n)] + [(f"F{n}", "Relu")]
    m = _with_functions("F0", *chain)
    m.functions[-1].node[0].domain = ""
    return m


def test_a_long_chain_of_local_functions_is_refused_not_a_recursion_error(tmp_path, capsys):
    assert ops(import_onnx(_function_chain(10))[0]) == ["ge.relu", "ge.return"]
    assert geimport_error(_function_chain(500), tmp_path, capsys).endswith("function bodies nest more than 64 deep")


@pytest.mark.parametrize("node, message", [
    (helper.make_node("Softmax", ["x"], ["y"], axis=[1, 2], name="sm"),
     "node 'sm' (Softmax): attribute 'axis' is a list of ints, but Softmax takes an int there"),
    (helper.make_node("Softmax", ["x"], ["y"], axis="one", name="sm"),
     "node 'sm' (Softmax): attribute 'axis' is a string, but Softmax takes an int there"),
    (helper.make_node("Transpose", ["x"], ["y"], perm="ab", name="t"),
     "node 't' (Transpose): attribute 'perm' is a string, but Transpose takes a list of ints there"),
    (helper.make_node("LayerNormalization", ["x", "x"], ["y"], epsilon="ab", name="ln"),
     "node 'ln' (LayerNormalization): attribute 'epsilon' is a string, but LayerNormalization takes a float there"),
    (helper.make_node("Cast", ["x"], ["y"], name="c"),
     "node 'c' (Cast): attribute 'to' is missing, and Cast requires it"),
])
def test_an_attribute_of_the_wrong_type_names_the_node_and_attribute(node, message, tmp_path, capsys):
    m = model([node], [vi("x", [3, 3])], [vi("y", [3, 3])])
    assert geimport_error(m, tmp_path, capsys) == message


def test_a_wrong_attribute_type_before_the_op_existed_is_still_named(tmp_path, capsys):
    node = helper.make_node("LayerNormalization", ["x", "x"], ["y"], epsilon="ab", name="ln")
    m = model([node], [vi("x", [3, 3])], [vi("y", [3, 3])], opset=11)  # LayerNormalization came in opset 17
    assert "attribute 'epsilon' is a string, but LayerNormalization takes a float there" in geimport_error(
        m, tmp_path, capsys)


def test_a_missing_required_attribute_of_an_old_opset(tmp_path, capsys):
    m = model([helper.make_node("Slice", ["x"], ["y"], ends=[2], name="s")], [vi("x", [4])], [vi("y", [2])], opset=9)
    assert geimport_error(m, tmp_path, capsys) == (
        "node 's' (Slice): attribute 'starts' is missing, and Slice requires it")


def test_a_string_that_is_not_utf8_names_the_field(tmp_path, capsys):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 3])], [vi("y", [2, 3])])
    data = m.SerializeToString().replace(b"Relu", b"R\x9clu")
    assert geimport_error(m, tmp_path, capsys, data) == (
        "not an ONNX model: model.graph.node[0].op_type is not valid UTF-8 text")


def test_split_into_more_parts_than_outputs_is_refused_before_listing_them(tmp_path, capsys):
    node = helper.make_node("Split", ["x"], ["a", "b"], axis=0, num_outputs=2**40, name="s")
    m = model([node], [vi("x", [4, 2])], [vi("a", [2, 2]), vi("b", [2, 2])], opset=18)
    assert geimport_error(m, tmp_path, capsys) == (
        "node 's' (Split): Split into 1099511627776 parts but the node has 2 outputs")


def test_an_expand_of_more_copies_than_a_graph_holds(tmp_path, capsys):
    shape = numpy_helper.from_array(np.array([3, 2, 2**46], np.int64), "shape")
    m = model([helper.make_node("Expand", ["x", "shape"], ["y"], name="e")], [vi("x", [3, 2, 1])],
              [vi("y", [3, 2, 2**46])], [shape])
    assert geimport_error(m, tmp_path, capsys) == (
        f"node 'e' (Expand): cannot broadcast tensor<3x2x1xf32> to 3x2x{2**46}: that is {2**46} copies along axis 2, "
        f"and GEIR writes a broadcast as copies concatenated, at most 65536")


def test_a_pad_larger_than_a_tensor_may_be(tmp_path, capsys):
    pads = numpy_helper.from_array(np.array([0, 2**60, 0, 0], np.int64), "pads")
    m = model([helper.make_node("Pad", ["x", "pads"], ["y"], name="p")], [vi("x", [2, 2])], [vi("y", [2, 2])], [pads])
    assert geimport_error(m, tmp_path, capsys).startswith(
        f"node 'p' (Pad): the padded result: tensor<2x{2**60 + 2}xf32> holds")


def test_an_input_larger_than_a_tensor_may_be(tmp_path, capsys):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2**40, 2**20])], [vi("y", [2**40, 2**20])])
    assert geimport_error(m, tmp_path, capsys).startswith(f"graph input 'x': tensor<{2**40}x{2**20}xf32> holds")


def test_a_constant_of_more_than_32_dimensions_goes_to_the_weights(tmp_path):
    shape = (1,) * 39 + (2,)
    w = numpy_helper.from_array(np.array([1.0, 2.0], np.float32).reshape(shape), "w")
    m = model([helper.make_node("Add", ["x", "w"], ["y"])], [vi("x", list(shape))], [vi("y", list(shape))], [w])
    module, weights = import_onnx(m)
    (const,) = [op for op in module.graph().ops if op.name == "ge.const"]
    assert isinstance(const.value, DenseResourceAttr) and weights["w"].shape == shape
    assert parse(print_module(module))  # and the text parses back


def test_torch_exported_transformer_block(tmp_path):
    # a real exporter's output: LayerNorm, a fused qkv Linear, heads split by Reshape/Transpose,
    # causal scaled_dot_product_attention (its mask built by Trilu/Where on shapes), GELU via Erf
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self, d=64, heads=4):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
            self.heads = heads

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(2, 32, 64)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(block, (x,), str(tmp_path / "block.onnx"), opset_version=17, dynamo=False,
                          input_names=["x"], output_names=["y"])
    r = geimport("block.onnx", "-o", "block.geir", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    fused = subprocess.run([str(BIN / "geopt"), "block.geir", "--passes=fuse"], capture_output=True, text=True,
                           cwd=tmp_path)
    assert fused.stdout.count("ge.flash_attention") == 1 and "causal = true" in fused.stdout
    np.savez(tmp_path / "in.npz", x=x.numpy())
    run = subprocess.run([str(BIN / "gerun"), "block.geir", "--inputs", "in.npz", "-o", "out.npz"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    with torch.no_grad():
        want = block(x).numpy()
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_allclose(z["result0"], want, rtol=1e-4, atol=1e-4)


# --- run-time indices, ranges, running sums and float tests ------------------------------------------------

I64 = TensorProto.INT64


def test_gather_with_run_time_indices_is_one_ge_gather():
    # an embedding lookup: the table an initializer, the ids a graph input
    table = randn(50, 8)
    m = model([helper.make_node("Gather", ["w", "ids"], ["e"], axis=0),
               helper.make_node("Gather", ["x", "j"], ["c"], axis=-1)],
              [vi("ids", [2, 5], I64), vi("x", [3, 6]), vi("j", [4], TensorProto.INT32)],
              [vi("e", [2, 5, 8]), vi("c", [3, 4])], [numpy_helper.from_array(table, "w")])
    feeds = {"ids": rng.integers(-50, 50, (2, 5)), "x": randn(3, 6), "j": np.array([5, -1, 0, 2], np.int32)}
    module, _ = check_against_onnx(m, feeds, rtol=0, atol=0)
    assert ops(module).count("ge.gather") == 2 and "ge.slice" not in ops(module)


def test_gather_with_indices_known_at_import_stays_slices():
    m = model([helper.make_node("Gather", ["x", "i"], ["y"], axis=1)], [vi("x", [3, 6])], [vi("y", [3, 2])],
              [numpy_helper.from_array(np.array([2, 3], np.int64), "i")])
    module, _ = check_against_onnx(m, {"x": randn(3, 6)})
    assert "ge.gather" not in ops(module)


@pytest.mark.parametrize("start, limit, delta, dtype", [(0, 10, 3, np.int64), (5, -4, -2, np.int32),
                                                        (0.5, 2.0, 0.25, np.float32)])
def test_range_of_constants_is_a_constant_equal_to_onnx(start, limit, delta, dtype):
    inits = [numpy_helper.from_array(np.array(v, dtype), n) for v, n in ((start, "s"), (limit, "l"), (delta, "d"))]
    n = len(np.arange(start, limit, delta))
    code = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    m = model([helper.make_node("Range", ["s", "l", "d"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])],
              [vi("x", [n], code)], [vi("y", [n], code)], inits)
    module, _ = check_against_onnx(m, {"x": np.ones(n, dtype)}, rtol=0, atol=0)
    assert "ge.arange" not in ops(module)  # folded at import: GEIR's arange evaluated it


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("dtype, axis", [(np.float32, 1), (np.int64, 0), (np.int32, -1)])
def test_cumsum_with_a_constant_axis_matches_onnx(dtype, axis, exclusive, reverse):
    code = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    m = model([helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse)],
              [vi("x", [4, 7], code)], [vi("y", [4, 7], code)],
              [numpy_helper.from_array(np.array(axis, np.int64), "axis")])
    x = randn(4, 7) if dtype == np.float32 else rng.integers(-9, 9, (4, 7)).astype(dtype)
    module, _ = check_against_onnx(m, {"x": x})
    assert ops(module)[0] == "ge.cumsum"


def test_cumsum_with_a_run_time_axis_is_refused_as_unsupported():
    m = model([helper.make_node("CumSum", ["x", "axis"], ["y"])], [vi("x", [4, 7]), vi("axis", [], I64)],
              [vi("y", [4, 7])])
    with pytest.raises(OnnxImportError, match="the axis is computed at run time") as info:
        import_onnx(m)
    assert info.value.unsupported


@pytest.mark.parametrize("positive, negative", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_isinf_sides_and_isnan_match_onnx(positive, negative):
    m = model([helper.make_node("IsInf", ["x"], ["i"], detect_positive=positive, detect_negative=negative),
               helper.make_node("IsNaN", ["x"], ["n"])],
              [vi("x", [6])], [vi("i", [6], TensorProto.BOOL), vi("n", [6], TensorProto.BOOL)])
    x = np.array([1.0, np.inf, -np.inf, np.nan, -0.0, 3e38], np.float32)
    check_against_onnx(m, {"x": x}, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # ONNX's reference softmax of a -inf row
def test_the_dynamo_exporters_softmax_isnan_where_runs():
    # torch.onnx's SDPA spelling guards fully masked rows: Where(IsNaN(softmax), 0, softmax)
    m = model([helper.make_node("Softmax", ["x"], ["p"], axis=-1), helper.make_node("IsNaN", ["p"], ["bad"]),
               helper.make_node("Where", ["bad", "zero", "p"], ["y"])],
              [vi("x", [2, 4])], [vi("y", [2, 4])], [numpy_helper.from_array(np.array(0, np.float32), "zero")])
    x = randn(2, 4)
    x[1] = -np.inf
    check_against_onnx(m, {"x": x})


# --- GatherElements: GEIR's ops, not ONNX's reference evaluator ---------------------------------------------
# (ONNX's reference gathers with np.choose, which takes at most 64 choices: BERT's 64 positions broke the import)

def gather_elements_model(data_shape, index_shape, axis, data=None, index=None, dtype=F32):
    """GatherElements(data, index) + 0 (so the output is a graph op); data and index are initializers when given."""
    nodes = [helper.make_node("GatherElements", ["data", "index"], ["g"], axis=axis)]
    inputs, inits = [], []
    for name, shape, value, t in (("data", data_shape, data, dtype), ("index", index_shape, index, TensorProto.INT64)):
        if value is None:
            inputs.append(vi(name, shape, t))
        else:
            inits.append(numpy_helper.from_array(value, name))
    out_t = dtype
    if not inputs:  # all constant: an argument keeps the graph from folding to nothing
        inputs.append(vi("x", index_shape, dtype))
        nodes.append(helper.make_node("Add" if dtype != TensorProto.BOOL else "Or", ["g", "x"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["g"], ["y"]))
    return model(nodes, inputs, [vi("y", index_shape, out_t)], inits, opset=17)


@pytest.mark.parametrize("n, axis", [(64, 1), (100, 1), (512, 0), (65, -1)])
def test_gather_elements_on_constants_with_64_or_more_positions(n, axis):
    r = np.random.default_rng(n)
    data_shape = (n, 3) if axis == 0 else (3, n)
    index_shape = (7, 3) if axis == 0 else (3, 7)
    data = r.standard_normal(data_shape).astype(np.float32)
    data.flat[0], data.flat[1] = np.inf, np.nan  # picked as they are
    index = r.integers(-n, n, size=index_shape).astype(np.int64)
    index.flat[0], index.flat[1] = 0, 1 - n if axis else 0
    module, weights = import_onnx(gather_elements_model(data_shape, index_shape, axis, data, index))
    assert ops(module) == ["ge.const", "ge.add", "ge.return"]  # folded at import
    x = np.zeros(index_shape, np.float32)
    (got,) = run_graph(module.graph(), {"x": x}, resources=weights)
    want = np.take_along_axis(data, np.where(index < 0, index + n, index), axis=axis)
    assert np.isnan(want).any() and np.isinf(want).any()
    assert np.array_equal(got, want + x, equal_nan=True)


def test_gather_elements_on_run_time_values_stays_in_the_graph():
    n = 80
    r = np.random.default_rng(1)
    module, _ = import_onnx(gather_elements_model((4, n, 2), (4, 9, 2), 1))
    assert "ge.select" in ops(module) and "ge.reduce_sum" in ops(module)
    data = r.standard_normal((4, n, 2)).astype(np.float32)
    index = r.integers(-n, n, size=(4, 9, 2)).astype(np.int64)
    (got,) = run_graph(module.graph(), {"data": data, "index": index})
    assert np.array_equal(got, np.take_along_axis(data, np.where(index < 0, index + n, index), axis=1))


def test_gather_elements_of_booleans_and_a_smaller_index_extent():
    r = np.random.default_rng(2)
    data = r.random((5, 70)) < 0.5
    index = r.integers(0, 70, size=(3, 4)).astype(np.int64)  # 3 of the 5 rows: the data is read where index reaches
    module, weights = import_onnx(gather_elements_model((5, 70), (3, 4), 1, data, index, dtype=TensorProto.BOOL))
    (got,) = run_graph(module.graph(), {"x": np.zeros((3, 4), bool)}, resources=weights)
    assert got.dtype == np.bool_ and np.array_equal(got, np.take_along_axis(data[:3], index, axis=1))


def test_gather_elements_index_out_of_range_is_a_diagnostic():
    data = randn(3, 70)
    index = np.array([[0, 70]] * 3, dtype=np.int64)
    with pytest.raises(OnnxImportError, match=r"\(GatherElements\): index 70 is out of range for axis 1 of size 70"):
        import_onnx(gather_elements_model((3, 70), (3, 2), 1, data, index))


def test_a_failing_reference_evaluation_is_a_diagnostic(tmp_path, capsys):
    # an op GEIR has no converter for, on constants, that ONNX's reference evaluator rejects: one line, exit 1
    # (the determinant of a 2x3 matrix: numpy's det refuses a matrix that is not square)
    nodes = [helper.make_node("Det", ["m"], ["d"]), helper.make_node("Add", ["x", "d"], ["y"])]
    inits = [numpy_helper.from_array(np.ones((2, 3), np.float32), "m")]
    err = geimport_error(model(nodes, [vi("x", [1])], [vi("y", [1])], inits, opset=17), tmp_path, capsys)
    assert "(Det): evaluating it at import time failed" in err and "Traceback" not in err


def test_topk_with_more_than_one_k_is_a_stated_problem_not_an_internal_error():
    # found by the fuzz campaign: a K initializer of two values once failed to unpack inside the converter
    k = numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "k")
    m = model([helper.make_node("TopK", ["x", "k"], ["v", "i"], name="pick")], [vi("x", [4, 8])],
              [vi("v", [4, 2])], [k])
    with pytest.raises(OnnxImportError) as info:
        import_onnx(m)
    assert "internal error" not in str(info.value) and "TopK's K holds one value" in str(info.value)


def test_pad_1_reads_its_paddings_attribute():
    # ONNX's Pad-1 names its pads `paddings` (Pad-2 renamed them `pads`): [begin..., end...] per axis
    padded = model([helper.make_node("Pad", ["x"], ["y"], paddings=[0, 1, 0, 2])], [vi("x", [2, 3])],
                   [vi("y", [2, 6])], opset=1)
    module, _ = import_onnx(padded)
    x = randn(2, 3)
    (y,) = run_graph(module.graph(), {module.graph().args[0].name: x})
    np.testing.assert_array_equal(y, np.pad(x, [(0, 0), (1, 2)]))
    bare = model([helper.make_node("Pad", ["x"], ["y"])], [vi("x", [2, 3])], [vi("y", [2, 3])], opset=1)
    with pytest.raises(OnnxImportError, match="'paddings'"):
        import_onnx(bare)
