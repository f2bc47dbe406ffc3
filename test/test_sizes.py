"""Sizes known only at run time: the ops that read shapes and take sizes from tensors, judged against numpy,
what their shape rules tell before the run, and a dynamic-shape program served at several shapes.

Oracles: numpy's arange, reshape, slicing, broadcast_to and advanced indexing (torch.gather for
gather_elements); ONNX's Reshape rule (0 copies a dimension, -1 is inferred) written out here.
"""

from __future__ import annotations

import numpy as np
import pytest

from geir.builder import Builder, create_op
from geir.diagnostics import DiagnosticError
from geir.ir import Module, Value
from geir.opdef import ShapeError
from geir.parser import parse
from geir.reference import run_op
from geir.session import Session, run_program
from geir.types import DType, TensorType

RNG = np.random.default_rng(0)


def run(name: str, arrays: list[np.ndarray], **attrs) -> np.ndarray:
    """Op `name` on arrays through the reference interpreter (its types from the arrays)."""
    operands = [Value(TensorType(a.shape, DType.from_numpy(a.dtype))) for a in arrays]
    op = create_op(name, operands, [], attrs)
    (t,) = [op.infer(*[v.type for v in operands])]
    return run_op(op, arrays, result_types=[t])[0]


def i64(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# --- each op's numbers --------------------------------------------------------------------------------

def test_dim_and_shape_of_read_the_shape():
    x = np.zeros((3, 5, 7), np.float32)
    assert run("ge.dim", [x], axis=1) == 5 and run("ge.dim", [x], axis=-1) == 7
    assert run("ge.shape_of", [x]).tolist() == [3, 5, 7]


@pytest.mark.parametrize("start,limit,delta", [(0, 7, 1), (2, 11, 3), (5, -4, -2), (3, 3, 1), (0.5, 2.0, 0.25)])
def test_range_is_numpys_arange(start, limit, delta):
    dtype = np.float32 if isinstance(start, float) else np.int64
    got = run("ge.range", [np.array(v, dtype) for v in (start, limit, delta)])
    np.testing.assert_array_equal(got, np.arange(start, limit, delta, dtype=dtype))


def _onnx_reshape(x: np.ndarray, shape: list[int], allowzero: bool) -> np.ndarray:
    """ONNX's Reshape rule: 0 copies the input's dimension (unless allowzero), -1 takes what is left."""
    target = [x.shape[i] if s == 0 and not allowzero else s for i, s in enumerate(shape)]
    return x.reshape(target)


@pytest.mark.parametrize("shape,allowzero", [([0, -1, 4], False), ([6, 0, 2], False), ([3, 8], True), ([-1], True)])
def test_dynamic_reshape_follows_onnx(shape, allowzero):
    x = RNG.standard_normal((6, 2, 2)).astype(np.float32)
    if allowzero and 0 in shape:
        pytest.skip("a zero-size target")
    got = run("ge.dynamic_reshape", [x, i64(*shape)], allowzero=allowzero)
    np.testing.assert_array_equal(got, _onnx_reshape(x, shape, allowzero))


@pytest.mark.parametrize("starts,ends,axes", [([1], [4], [0]), ([0, -3], [2, 100], [0, 1]), ([-2], [-1], [1])])
def test_dynamic_slice_is_numpy_slicing(starts, ends, axes):
    x = RNG.standard_normal((5, 6)).astype(np.float32)
    index = [slice(None)] * 2
    for s, e, a in zip(starts, ends, axes):
        index[a] = slice(s, e)
    got = run("ge.dynamic_slice", [x, i64(*starts), i64(*ends)], axes=axes)
    np.testing.assert_array_equal(got, x[tuple(index)])


@pytest.mark.parametrize("xshape,shape", [((3, 1), (2, 1, 4)), ((1,), (5,)), ((2, 3), (1, 1))])
def test_dynamic_broadcast_is_onnx_expand(xshape, shape):
    x = RNG.standard_normal(xshape).astype(np.float32)
    got = run("ge.dynamic_broadcast", [x, i64(*shape)])
    np.testing.assert_array_equal(got, x * np.ones(shape, np.float32))  # Expand broadcasts both ways


def test_index_is_numpys_advanced_indexing():
    x = RNG.standard_normal((4, 5, 6)).astype(np.float32)
    i, j = i64([3], [-4], [0]), i64(1, -1)  # broadcast to 3x2; negatives count from the end
    np.testing.assert_array_equal(run("ge.index", [x, i, j], axis=0), x[i, j])
    np.testing.assert_array_equal(run("ge.index", [x, i, j], axis=1), x[:, i, j])
    with pytest.raises(IndexError, match="^index 5 is out of range for axis 1 of size 5"):
        run("ge.index", [x, i64(0), i64(5)], axis=0)


def test_gather_elements_is_torch_gather():
    torch = pytest.importorskip("torch")
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    index = RNG.integers(-5, 5, size=(2, 4))  # fewer rows and columns than x, as torch.gather allows
    got = run("ge.gather_elements", [x, index], axis=1)
    want = torch.gather(torch.from_numpy(x), 1, torch.from_numpy(np.where(index < 0, index + 5, index))).numpy()
    np.testing.assert_array_equal(got, want)


# --- what a shape rule tells before the run -----------------------------------------------------------

def _sized(shape: tuple) -> tuple[Builder, Value]:
    b = Builder()
    return b, b.argument(TensorType(shape, DType.f32), "x")


def test_a_reshape_reads_the_sizes_the_graph_tells_and_cancels_its_own_run_time_dim():
    b, x = _sized((2, None, 4, 16))
    shape = b.create("ge.shape_of", [x]).result
    seq = b.create("ge.slice", [shape], {"axes": [0], "starts": [1], "ends": [2]}).result
    head = b.constant(i64(16))
    minus = b.constant(i64(-1))
    flat = b.create("ge.concat", [minus, seq, head], {"axis": 0}).result
    r = b.create("ge.transpose", [x], {"perm": [0, 1, 2, 3]}).result  # another value: its `?` is not x's
    assert b.create("ge.dynamic_reshape", [x, flat]).result.type.shape == (8, None, 16)  # (2*4*16*S) / (S*16)
    assert b.create("ge.dynamic_reshape", [r, flat]).result.type.shape == (None, None, 16)
    with pytest.raises(ShapeError, match="more than one -1"):
        b.create("ge.dynamic_reshape", [x, b.constant(i64(-1, -1))])


def test_a_broadcast_to_its_own_run_time_size_keeps_it_and_a_range_of_one_is_unknown():
    b, x = _sized((1, None))
    shape = b.create("ge.shape_of", [x]).result
    assert b.create("ge.dynamic_broadcast", [x, shape]).result.type.shape == (1, None)
    dim = b.create("ge.dim", [x], {"axis": 1}).result
    zero, one = b.constant(np.array(0, np.int64)), b.constant(np.array(1, np.int64))
    assert b.create("ge.range", [zero, dim, one]).result.type.shape == (None,)
    ten = b.constant(np.array(10, np.int64))
    three = b.constant(np.array(3, np.int64))
    assert b.create("ge.range", [zero, ten, three]).result.type.shape == (4,)  # 0 3 6 9


# --- one compile, several shapes ----------------------------------------------------------------------

PROGRAM = """
ge.graph @positions(%x: tensor<2x?x8xf32>, %table: tensor<64x8xf32>) -> tensor<2x?x8xf32> {
  %s = ge.dim %x {axis = 1}
  %zero = ge.const dense<0> : tensor<i64>
  %one = ge.const dense<1> : tensor<i64>
  %pos = ge.range %zero, %s, %one
  %emb = ge.gather %table, %pos {axis = 0}
  %y = ge.add %x, %emb
  ge.return %y
}
"""


def test_a_dynamic_program_is_compiled_once_and_its_sizes_evaluated_per_signature():
    module = parse(PROGRAM, "positions.geir")
    table = RNG.standard_normal((64, 8)).astype(np.float32)
    session = Session(module)
    for n in (5, 17, 5, 40):
        x = RNG.standard_normal((2, n, 8)).astype(np.float32)
        program = session.program({"x": x.shape, "table": table.shape})
        assert "ge.range" not in [op.name for op in program.ops] and "ge.dim" not in [op.name for op in program.ops]
        got = np.asarray(run_program(program, {"x": x, "table": table}).outputs[0])
        np.testing.assert_allclose(got, x + table[:n], rtol=1e-6)
    assert session.plan_cache["misses"] == 3 and session.plan_cache["hits"] == 1


def test_a_size_that_depends_on_data_is_an_error_at_the_op_when_the_shapes_bind():
    module = parse("""
ge.graph @data_sized(%n: tensor<i64>) -> tensor<?xi64> {
  %zero = ge.const dense<0> : tensor<i64>
  %one = ge.const dense<1> : tensor<i64>
  %r = ge.range %zero, %n, %one
  ge.return %r
}
""", "data.geir")
    session = Session(module, pipeline="canonicalize")
    with pytest.raises(DiagnosticError) as e:
        session.program({"n": ()})
    text = str(e.value)
    assert "data.geir:5:" in text and "ge.range" in text and "depends on tensor data" in text


def test_gerun_says_where_a_data_dependent_size_is_and_serves_a_dynamic_program(tmp_path, capsys):
    from geir.tools import gerun

    sized = tmp_path / "data.geir"
    sized.write_text("""ge.graph @data_sized(%n: tensor<i64>) -> tensor<?xi64> {
  %zero = ge.const dense<0> : tensor<i64>
  %one = ge.const dense<1> : tensor<i64>
  %r = ge.range %zero, %n, %one
  ge.return %r
}
""")
    np.savez(tmp_path / "n.npz", n=np.array(5))
    assert gerun.main([str(sized), "--inputs", str(tmp_path / "n.npz")]) == 1
    err = capsys.readouterr().err
    assert f"{sized}:4:3: error: ge.range: its result tensor<?xi64> still has a run-time dimension" in err
    assert "  %r = ge.range %zero, %n, %one\n  ^" in err
    program = tmp_path / "positions.geir"
    program.write_text(PROGRAM)
    table = RNG.standard_normal((64, 8)).astype(np.float32)
    feeds = []
    for n in (3, 11):
        np.savez(tmp_path / f"in{n}.npz", x=np.zeros((2, n, 8), np.float32), table=table)
        feeds += ["--inputs", str(tmp_path / f"in{n}.npz")]
    out = tmp_path / "y.npz"
    assert gerun.main([str(program), *feeds, "--output", str(out)]) == 0
    results = np.load(out)
    shapes = sorted(tuple(results[k].shape) for k in results.files)
    assert shapes == [(2, 3, 8), (2, 11, 8)]
    for k in results.files:  # zeros + table rows: each run's positions are 0 .. its length - 1
        n = results[k].shape[1]
        np.testing.assert_allclose(results[k], np.broadcast_to(table[:n], (2, n, 8)), rtol=1e-6)


def test_an_index_out_of_range_on_the_ai_cpu_is_a_device_fault_at_the_op(tmp_path, capsys):
    from geir.tools import gerun

    path = tmp_path / "put.geir"
    path.write_text("""ge.graph @main(%x: tensor<3x1x4xf32>) -> tensor<3x1x4xf32> {
  %s = ge.const dense<[3]> : tensor<1xi64>
  %v = ge.const dense<1.0> : tensor<f32>
  %y = ge.index_put %x, %v, %s {axis = 1, accumulate = true}
  ge.return %y
}
""")
    assert gerun.main([str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:4:3: device fault: ge.index_put on the AI CPU: index 3 is out of range for axis 1 of size 1" in err
    assert "internal error" not in err and "Traceback" not in err


def test_an_index_out_of_range_in_the_scatter_kernel_is_a_device_fault_at_the_op(tmp_path, capsys):
    from geir.tools import gerun

    path = tmp_path / "put.geir"
    path.write_text("""ge.graph @main(%x: tensor<3x1x4xf32>) -> tensor<3x1x4xf32> {
  %s = ge.const dense<[3]> : tensor<1xi64>
  %v = ge.const dense<1.0> : tensor<f32>
  %y = ge.index_put %x, %v, %s {axis = 1}
  ge.return %y
}
""")
    assert gerun.main([str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:4:3: device fault: index_put index 3 is out of range for axis 1 of size 1" in err
    assert "internal error" not in err and "Traceback" not in err
