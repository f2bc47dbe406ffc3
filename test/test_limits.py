"""Inputs too large to model or to simulate: a diagnostic at the value, exit 1, never MemoryError or an
overflow (issue: no traceback, no internal error)."""

from __future__ import annotations

import re

from pathlib import Path

import numpy as np
import pytest

from geir.attributes import MAX_LITERAL_RANK, DenseAttr, literal_to_array
from geir.diagnostics import DiagnosticError
from geir.parser import parse
from geir.printer import format_attr
from geir.runtime.device import host_memory_problem
from geir.tools.gedoctor import main as gedoctor_main
from geir.tools.geopt import main as geopt_main
from geir.tools.gerun import main as gerun_main
from geir.types import DType, TensorType
from geir.verifier import MAX_RANK, MAX_TENSOR_BYTES, verify_module

HUGE = """ge.graph @main(%x: tensor<1000000x1000000xf32>) -> tensor<1000000x1000000xf32> {
  %a = ge.exp %x
  ge.return %a
}
"""
OVERFLOW = HUGE.replace("1000000x1000000", "9223372036854775807x2")


def _rank(n: int) -> str:
    t = "tensor<" + "1x" * n + "f32>"
    return f"ge.graph @main(%x: {t}) -> {t} {{\n  %a = ge.exp %x\n  ge.return %a\n}}\n"


def test_a_tensor_larger_than_any_device_is_an_error_at_the_value():
    with pytest.raises(DiagnosticError) as e:
        verify_module(parse(OVERFLOW, "o.geir"))
    d = e.value.diagnostics[0]
    assert (d.loc.line, d.loc.col) == (1, 16)
    assert f"holds {9223372036854775807 * 2 * 4} bytes, more than the {MAX_TENSOR_BYTES}" in d.message


def test_more_dimensions_than_numpy_has_is_an_error():
    verify_module(parse(_rank(MAX_RANK)))
    with pytest.raises(DiagnosticError, match=f"a tensor of rank {MAX_RANK + 1}: at most {MAX_RANK}"):
        verify_module(parse(_rank(MAX_RANK + 1)))


def test_the_host_memory_check_counts_host_and_device_copies():
    graph = parse(HUGE).graphs[0]
    d = host_memory_problem(graph, available=10**12)
    assert d is not None and "needs at least 8000000000000 bytes" in d.message and (d.loc.line, d.loc.col) == (1, 16)
    assert host_memory_problem(graph, available=8 * 10**12) is None


@pytest.mark.parametrize("tool", [gerun_main, gedoctor_main])
def test_a_run_that_cannot_fit_in_host_memory_stops_before_allocating(tool, tmp_path, capsys):
    src = tmp_path / "huge.geir"
    src.write_text(HUGE)
    assert tool([str(src)]) == 1
    err = capsys.readouterr().err
    assert f"{src}:1:16: error: simulating this run needs at least 8000000000000 bytes of host memory" in err
    assert "^" in err and "MemoryError" not in err and "internal error" not in err


# 2^40 elements: within what GEIR models (2^48 bytes), far beyond any host
BIG_ARG = """ge.graph @main(%x: tensor<1099511627776xf16>) -> tensor<1099511627776xf16> {
  %y = ge.relu %x
  ge.return %y
}
"""
BIG_CONST = """ge.graph @main(%x: tensor<4xf16>) -> tensor<1099511627776xf16> {
  %c = ge.const dense<1.0> : tensor<1099511627776xf16>
  %y = ge.relu %c
  ge.return %y
}
"""
GIB = 1 << 30
TWO_TIB = 2 * 1099511627776


TIMING_ONLY = ("a timing-only run of this graph needs at least {} bytes of host memory (each kernel makes its operands "
               "and results as arrays of their full shape), but {} are available; %{} alone holds {} bytes")
FULL = ("simulating this run needs at least {} bytes of host memory ({} for the inputs on the host, {} for the "
        "simulated device's memory), but {} are available; %{} alone holds {} bytes")


@pytest.mark.parametrize("tool, text, argv, where, message", [
    (tool, BIG_ARG, argv, (1, 16), TIMING_ONLY.format(TWO_TIB, GIB, "x", TWO_TIB))
    for tool, argv in [("gerun", ("--timing-only",)), ("getune", ())]
] + [
    (tool, BIG_CONST, argv, (2, 3), TIMING_ONLY.format(TWO_TIB, GIB, "c", TWO_TIB))
    for tool, argv in [("gerun", ("--timing-only",)), ("getune", ())]
] + [
    # a constant is in the simulated device's memory too (once it skipped the check)
    (tool, BIG_CONST, (), (2, 3), FULL.format(TWO_TIB + 16, 8, TWO_TIB + 8, GIB, "c", TWO_TIB))
    for tool in ("gerun", "gedoctor")
])
def test_a_2_to_the_40_tensor_is_refused_before_allocation_in_every_tool(tool, text, argv, where, message, tmp_path,
                                                                         capsys, monkeypatch):
    from geir.tools.getune import main as getune_main

    if tool == "getune":  # timing-only, on the candidates and the whole graph
        argv = ("--workers", "0", "--db", str(tmp_path / "db.sqlite"))
    monkeypatch.setattr("geir.runtime.device.host_bytes_available", lambda: GIB)
    src = tmp_path / "big.geir"
    src.write_text(text)
    main = {"gerun": gerun_main, "gedoctor": gedoctor_main, "getune": getune_main}[tool]
    assert main([str(src), *argv]) == 1
    out, err = capsys.readouterr()
    line, col = where
    assert out == "" and err.startswith(f"{src}:{line}:{col}: error: {message}\n{text.splitlines()[line - 1]}\n"
                                        f"{' ' * (col - 1)}^\n")


@pytest.mark.parametrize("text", [OVERFLOW, _rank(70)])
def test_geopt_and_gerun_report_unmodellable_types(text, tmp_path, capsys):
    src = tmp_path / "t.geir"
    src.write_text(text)
    for tool, argv in ((geopt_main, [str(src), "--passes=plan"]), (gerun_main, [str(src)])):
        assert tool(argv) == 1
        err = capsys.readouterr().err
        assert f"{src}:1:16: error:" in err and "Traceback" not in err and "internal error" not in err


WEIGHTED = """ge.graph @main(%x: tensor<4x20xDT>) -> tensor<4x20xDT> {
  %w = ge.const dense_resource<"w"> : tensor<4x20xDT>
  %a = ge.add %x, %w
  ge.return %a
}
"""


def _weights_run(tmp_path, capsys, array, dtype="f16", save=None):
    import numpy as np

    src = tmp_path / "w.geir"
    src.write_text(WEIGHTED.replace("DT", dtype))
    if save is None:
        np.savez(tmp_path / "w.npz", w=array)
    else:
        save(tmp_path / "w.npz", array)
    rc = gerun_main([str(src), "-o", str(tmp_path / "out.npz")])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("make, message", [
    (lambda np: np.ones((4, 20)) + 1j, "is complex (complex128): GEIR has no complex dtype"),
    (lambda np: np.full((4, 20), "ab"), "holds <U2 data, which no GEIR dtype stands for"),
    (lambda np: np.zeros((4, 20), dtype=[("a", "f4"), ("b", "i4")]), "which no GEIR dtype stands for"),
])
def test_weights_no_dtype_stands_for_are_errors_at_the_constant(tmp_path, capsys, make, message):
    import numpy as np

    rc, err = _weights_run(tmp_path, capsys, make(np))
    assert rc == 1 and "w.geir:2:17: error: weight 'w'" in err and message in err
    assert not (tmp_path / "out.npz").exists()


def test_a_narrowing_weight_cast_is_a_warning(tmp_path, capsys):
    import numpy as np

    rc, err = _weights_run(tmp_path, capsys, np.full((4, 20), 1.0 + 2.0 ** -20))
    assert rc == 0 and "w.geir:2:17: warning: weight 'w' in" in err and "is float64: rounded to f16" in err


def test_bf16_weights_as_numpy_stores_them(tmp_path, capsys):
    import ml_dtypes
    import numpy as np

    w = (np.arange(80).reshape(4, 20) / 8).astype(ml_dtypes.bfloat16)
    rc, err = _weights_run(tmp_path, capsys, w, dtype="bf16")
    assert rc == 0 and err == ""
    assert np.load(tmp_path / "w.npz")["w"].dtype.kind == "V"  # what np.savez wrote: raw 2-byte void


def test_an_npy_renamed_npz_is_not_an_archive(tmp_path, capsys):
    import numpy as np

    def save_npy(path, array):
        with open(path, "wb") as f:
            np.save(f, array)

    rc, err = _weights_run(tmp_path, capsys, np.ones((4, 20), np.float16), save=save_npy)
    assert rc == 1 and "is not an npz archive" in err


def test_weights_named_like_savez_parameters_survive_geimport(tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from geir.tools.geimport import main as geimport_main

    rng = np.random.default_rng(0)
    inits = {n: rng.standard_normal((4, 8)).astype(np.float32) for n in ("file", "allow_pickle")}
    nodes = [helper.make_node("Add", ["x", "file"], ["y"]), helper.make_node("Add", ["y", "allow_pickle"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 8])],
                              [numpy_helper.from_array(a, n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    assert geimport_main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.geir")]) == 0
    with np.load(tmp_path / "m.npz") as z:
        assert sorted(z.files) == ["allow_pickle", "file"]
        assert all(np.array_equal(z[n], a) for n, a in inits.items())


def _lowered_matmul(tmp_path, old: str, new: str) -> str:
    src = tmp_path / "m.geir"
    src.write_text("""ge.graph @main(%a: tensor<16x16xf16>, %b: tensor<16x16xf16>) -> tensor<16x16xf16> {
  %c = ge.matmul %a, %b
  ge.return %c
}
""")
    out = tmp_path / "p.geir"
    assert geopt_main([str(src), "--passes=lower", "-o", str(out)]) == 0
    text = out.read_text()
    assert old in text
    bad = tmp_path / "bad.geir"
    bad.write_text(text.replace(old, new))
    return str(bad)


def test_a_launch_whose_kernel_rejects_its_operands_is_an_error_at_the_launch(tmp_path, capsys):
    path = _lowered_matmul(tmp_path, "rt.h2d %a {offset = 0, stream = 0} : tensor<16x16xf16>",
                           "rt.h2d %a {offset = 0, stream = 0} : tensor<16x8xf16>")
    capsys.readouterr()
    assert gerun_main([path]) == 1
    err = capsys.readouterr().err
    assert "bad.geir:8:3: error: matmul contraction dims differ: 8" in err and "^" in err


def test_a_launch_the_cube_cannot_compute_is_an_error_before_the_run(tmp_path, capsys):
    path = _lowered_matmul(tmp_path, "tensor<16x16xf16>", "tensor<16x16xi1>")
    capsys.readouterr()
    assert gerun_main([path]) == 1
    err = capsys.readouterr().err
    assert "error: ge.matmul cannot run: the cube of ascend910b has no i1 mode" in err
    assert "internal error" not in err and "KeyError" not in err


@pytest.mark.parametrize("tool", [gerun_main, gedoctor_main])
def test_a_negative_seed_is_a_usage_error(tool, tmp_path, capsys):
    src = tmp_path / "g.geir"
    src.write_text(HUGE.replace("1000000x1000000", "4x4"))
    with pytest.raises(SystemExit) as e:
        tool([str(src), "--seed", "-1"])
    assert e.value.code == 2 and "argument --seed: must be 0 or more, not -1" in capsys.readouterr().err


# --- literals nested deeper than numpy takes, integers longer than 64 bits -------------------------------

def _const(depth: int, element: str = "1.0", shape: str | None = None) -> str:
    """A graph returning a dense literal nested `depth` deep (of `shape`, default all ones) and of its type."""
    t = "tensor<" + (shape if shape is not None else "1x" * depth) + "f32>"
    return (f"ge.graph @main() -> {t} {{\n  %c = ge.const dense<{'[' * depth}{element}{']' * depth}> : {t}\n"
            f"  ge.return %c\n}}\n")


def _geopt(tmp_path, capsys, text: str, *args: str) -> tuple[int, str, str, Path]:
    src = tmp_path / "t.geir"
    src.write_text(text)
    rc = geopt_main([str(src), *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "internal error" not in err
    return rc, out, err, src


@pytest.mark.parametrize("depth", [33, 40, 64])
def test_a_dense_literal_nested_deeper_than_32_is_an_error_at_the_literal(depth, tmp_path, capsys):
    rc, out, err, src = _geopt(tmp_path, capsys, _const(depth))
    assert rc == 1 and not out
    assert err.startswith(f"{src}:2:17: error: dense literal nests more than {MAX_LITERAL_RANK} deep; a literal "
                          f"has at most {MAX_LITERAL_RANK} dimensions\n")
    assert err.splitlines()[2] == " " * 16 + "^"


def test_a_dense_literal_of_32_dimensions_round_trips(tmp_path, capsys):
    text = _const(MAX_LITERAL_RANK, "1.0, 2.0", shape="1x" * (MAX_LITERAL_RANK - 1) + "2x")
    rc, out, _, _ = _geopt(tmp_path, capsys, text)
    assert rc == 0 and out == text
    rc, out, _, _ = _geopt(tmp_path, capsys, _const(MAX_LITERAL_RANK))  # all equal: prints as a splat
    assert rc == 0 and "dense<1.0> : tensor<" + "1x" * MAX_LITERAL_RANK + "f32>" in out


def test_100000_levels_of_literal_are_refused_without_recursion():
    nested: object = 1.0
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(ValueError, match=f"nests more than {MAX_LITERAL_RANK} deep"):
        literal_to_array(nested)


def test_constants_of_more_than_32_dimensions_print_and_are_refused_by_the_verifier():
    values = np.arange(2, dtype=np.float32).reshape((1,) * 39 + (2,))
    assert format_attr(DenseAttr(values)) == "dense<" + "[" * 39 + "[0.0, 1.0]" + "]" * 39 + ">"
    assert format_attr(DenseAttr(np.ones((1,) * 40, np.int64))) == "dense<1>"
    assert DenseAttr(values).splat_value() is None and DenseAttr(np.ones((1,) * 40)).splat_value() == 1.0
    assert DenseAttr(values).check_against(TensorType(values.shape, DType.f32)) == \
        f"a dense literal of rank 40: at most {MAX_LITERAL_RANK} dimensions (a splat takes any)"
    # a splat initialises a tensor of any rank GEIR holds
    assert DenseAttr(np.array(1.0)).check_against(TensorType((1,) * MAX_RANK, DType.f32)) is None


def test_const_fold_leaves_results_no_literal_could_hold(tmp_path, capsys):
    t = "tensor<2x" + "1x" * 40 + "f32>"
    text = (f"ge.graph @main() -> {t} {{\n  %c = ge.const dense<[1.0, 2.0]> : tensor<2xf32>\n"
            f"  %r = ge.reshape %c {{shape = [2{', 1' * 40}]}} : {t}\n  ge.return %r\n}}\n")
    rc, out, _, _ = _geopt(tmp_path, capsys, text, "--passes=const-fold")
    assert rc == 0 and "ge.reshape" in out
    rc, again, _, _ = _geopt(tmp_path, capsys, out)
    assert rc == 0 and again == out


BIG = "9" * 5000


@pytest.mark.parametrize("line, at, message", [
    (f"  %y = ge.softmax %x {{axis = {BIG}}}", "9", "integer literal has 5000 digits; at most 19 fit in 64 bits"),
    ("  %y = ge.softmax %x {axis = -9223372036854775809}", "-",
     "integer literal -9223372036854775809 does not fit in 64 bits (from -9223372036854775808 to "
     "9223372036854775807)"),
    (f"  %y = ge.reshape %x {{shape = [4, 0{BIG}]}}", "0",
     "integer literal has 5000 digits; at most 19 fit in 64 bits"),
    (f"  %y = ge.const dense<[1.0, {BIG}, 2.0]> : tensor<3xf32>", "9",
     "integer literal has 5000 digits; at most 19 fit in 64 bits"),
    (f"  %y = ge.neg %x : tensor<4x{BIG}xf32>", "9", "dimension has 5000 digits; at most 19 fit in 64 bits"),
    ("  %y = ge.neg %x : tensor<9223372036854775808xf32>", "9",
     "dimension 9223372036854775808 does not fit in 64 bits (from 0 to 9223372036854775807)"),
])
def test_integers_longer_than_64_bits_are_errors_at_the_token(line, at, message, tmp_path, capsys):
    text = f"ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {{\n{line}\n  ge.return %x\n}}\n"
    rc, out, err, src = _geopt(tmp_path, capsys, text)
    col = line.index(at) + 1
    assert rc == 1 and not out
    assert err.startswith(f"{src}:2:{col}: error: {message}\n")
    assert err.splitlines()[2] == " " * (col - 1) + "^"


def test_64_bit_integers_at_the_edges_are_taken(tmp_path, capsys):
    text = ("ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> attributes {hi = 9223372036854775807, "
            "lo = -9223372036854775808, zeros = 00000000000000000000000000000001} {\n  ge.return %x\n}\n")
    rc, out, _, _ = _geopt(tmp_path, capsys, text)
    assert rc == 0 and "hi = 9223372036854775807, lo = -9223372036854775808, zeros = 1}" in out


@pytest.mark.parametrize("memory", ["{inpofuts = 37748736, constants = 0, arena = 1024}",
                                    "{inputs = 37748736, constants = -1, arena = 1024}", "5", "[1, 2]"])
@pytest.mark.parametrize("tool", [gerun_main, gedoctor_main])
def test_a_program_without_a_memory_layout_is_refused_before_it_runs(memory, tool, tmp_path, capsys):
    text = (Path(__file__).resolve().parent.parent / "examples" / "doctor" / "single_buffer.geir").read_text()
    layout = re.search(r"memory = (\{inputs = 37748736, constants = 0, arena = \d+\})", text)[1]
    src = tmp_path / "p.geir"
    src.write_text(text.replace(f"memory = {layout}", f"memory = {memory}"))
    assert tool([str(src)]) == 1
    err = capsys.readouterr().err
    assert f"{src}:9:12: rt.program @main has no memory layout: attribute memory = " in err
    assert "internal error" not in err and "Traceback" not in err
