"""The printer: one canonical form, print(parse(t)) a fixed point, and dense values that read back exactly."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from geir import parse, print_module
from geir.attributes import DenseAttr, DenseResourceAttr, format_float
from geir.builder import create_op
from geir.ir import Graph, Value
from geir.printer import format_attr, format_dense, print_graph, print_op
from geir.types import DType, TensorType

from helpers import graph_text, module_sig


def roundtrip(text: str) -> str:
    m = parse(text)
    printed = print_module(m)
    again = parse(printed)
    assert print_module(again) == printed, "printing is not a fixed point"
    assert module_sig(again) == module_sig(m), "parse(print(x)) differs from x"
    return printed


def test_canonical_form_of_a_messy_graph():
    text = (
        "// comment\n"
        "ge.graph   @main( %q :tensor<1x8x128x64xf16>,%k: tensor<1x8x128x64xf16 , ND> )->tensor<1x8x128x128xf16>{\n"
        "  %s=ge.matmul %q,%k{transpose_b=true,transpose_a = false}:tensor<1x8x128x128xf16>   // trailing\n"
        "\n\n  ge.return %s }"
    )
    expected = (
        "ge.graph @main(%q: tensor<1x8x128x64xf16>, %k: tensor<1x8x128x64xf16>) -> tensor<1x8x128x128xf16> {\n"
        "  %s = ge.matmul %q, %k {transpose_a = false, transpose_b = true} : tensor<1x8x128x128xf16>\n"
        "  ge.return %s\n"
        "}\n"
    )
    assert roundtrip(text) == expected


def test_canonical_form_of_every_construct():
    text = (
        'ge.graph @g(%a: tensor<?x4xbf16, NZ>, %b: tensor<i1>) -> (tensor<?x4xbf16, NZ>, tensor<2xf32>) '
        'attributes {z = 1, a = {y = [1, 2.5], "x y" = "s\\n"}} {\n'
        "  %c = ge.const dense<[1.0, 2.5]> : tensor<2xf32>\n"
        '  %w = ge.const dense_resource<"w.q"> : tensor<2xf32>\n'
        '  %p, %r = ge.split %c {sizes = [1, 1], axis = 0, tiling = {template = "t", s1 = 128}}\n'
        "  %t = ge.cast %b {to = f16}\n"
        "  ge.return %a, %c\n"
        "}\n"
        "ge.graph @h() -> () {\n  ge.return\n}\n"
    )
    expected = (
        'ge.graph @g(%a: tensor<?x4xbf16, NZ>, %b: tensor<i1>) -> (tensor<?x4xbf16, NZ>, tensor<2xf32>) '
        'attributes {z = 1, a = {y = [1, 2.5], "x y" = "s\\n"}} {\n'
        "  %c = ge.const dense<[1.0, 2.5]> : tensor<2xf32>\n"
        '  %w = ge.const dense_resource<"w.q"> : tensor<2xf32>\n'
        '  %p, %r = ge.split %c {axis = 0, sizes = [1, 1], tiling = {template = "t", s1 = 128}}\n'
        "  %t = ge.cast %b {to = f16}\n"
        "  ge.return %a, %c\n"
        "}\n"
        "\n"
        "ge.graph @h() -> () {\n  ge.return\n}\n"
    )
    assert roundtrip(text) == expected


@pytest.mark.parametrize(
    "value, text",
    [
        (True, "true"),
        (False, "false"),
        (0, "0"),
        (-12, "-12"),
        (0.125, "0.125"),
        (1e-5, "1e-05"),
        (2.0, "2.0"),
        (-0.0, "-0.0"),
        (1e300, "1e+300"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (math.nan, "nan"),
        ("BNSD", '"BNSD"'),
        ('a"b\\c\n', '"a\\"b\\\\c\\n"'),
        ("caf\u00e9", '"caf\u00e9"'),
        (DType.bf16, "bf16"),
        ([0, 1, 3, 2], "[0, 1, 3, 2]"),
        ([], "[]"),
        ([[1], [2.0, "x"]], '[[1], [2.0, "x"]]'),
        ({"offset": 0, "size": 512}, "{offset = 0, size = 512}"),
        ({"b": 1, "a": 2}, "{b = 1, a = 2}"),  # nested dictionaries keep their order
        ({"a key": 1}, '{"a key" = 1}'),
        (DenseAttr(np.array(0.5)), "dense<0.5>"),
        (DenseAttr(np.array([[1, 2], [3, 4]])), "dense<[[1, 2], [3, 4]]>"),
        (DenseAttr(np.array([True, False])), "dense<[true, false]>"),
        (DenseResourceAttr("wq"), 'dense_resource<"wq">'),
    ],
)
def test_format_attr(value, text):
    assert format_attr(value) == text


@pytest.mark.parametrize("value", [0.1, 1 / 3, 1e-300, 5e-324, 1.7976931348623157e308, 123456789.0, 1e16, -2.5e-7])
def test_format_float_round_trips(value):
    s = format_float(value)
    assert float(s) == value
    assert "." in s or "e" in s
    assert s == repr(value) or s == repr(value) + ".0"


def test_float_attributes_round_trip_through_text():
    text = graph_text("  %y = ge.layer_norm %x, %x, %x {epsilon = 1e-05, axis = -1}\n  ge.return %y")
    printed = roundtrip(text)
    assert "{axis = -1, epsilon = 1e-05}" in printed
    op = parse(printed).graphs[0].ops[0]
    assert op.attributes["epsilon"] == 1e-5 and type(op.attributes["epsilon"]) is float


def test_splat_printing():
    # an array whose elements are all equal prints as a splat, and means the same constant
    assert format_dense(np.array([[2.0, 2.0], [2.0, 2.0]])) == "2.0"
    assert format_dense(np.array([3, 3, 3])) == "3"
    assert format_dense(np.array([1.0, 2.0])) == "[1.0, 2.0]"
    assert format_dense(np.array([np.nan, np.nan])) == "nan"
    text = graph_text("  %c = ge.const dense<[[7.0, 7.0], [7.0, 7.0]]> : tensor<2x2xf32>\n  ge.return %x")
    assert "dense<7.0> : tensor<2x2xf32>" in roundtrip(text)


def test_splat_keeps_signed_zeros_apart():
    # 0.0 and -0.0 compare equal but are different constants (1/x tells them apart)
    values = np.array([0.0, -0.0], dtype=np.float32)
    text = format_dense(values)
    assert text == "[0.0, -0.0]"
    assert format_dense(np.array([-0.0, -0.0])) == "-0.0"


def _dense_roundtrip(values: np.ndarray, dtype: str) -> np.ndarray:
    n = values.size
    text = format_dense(values)
    m = parse(f"ge.graph @main() -> tensor<{n}x{dtype}> {{\n  %c = ge.const dense<{text}> : tensor<{n}x{dtype}>\n"
              f"  ge.return %c\n}}\n")
    op = m.graphs[0].ops[0]
    return op.value.to_array(op.result.type)


@pytest.mark.parametrize("dtype, np_dtype", [("f16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_every_half_precision_value_reads_back_bit_exactly(dtype, np_dtype):
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(np_dtype)
    back = _dense_roundtrip(values, dtype)
    assert back.dtype == np.dtype(np_dtype)
    nan = np.isnan(values.astype(np.float32))
    assert np.isnan(back.astype(np.float32))[nan].all()
    mismatched = np.nonzero((back.view(np.uint16) != bits) & ~nan)[0]
    assert mismatched.size == 0, [(values[i], back[i]) for i in mismatched[:5]]


def test_random_f32_values_read_back_bit_exactly():
    rng = np.random.default_rng(1234)
    bits = rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32)
    bits[:6] = [0x00000000, 0x80000000, 0x00000001, 0x7F7FFFFF, 0xFF800000, 0x3DCCCCCD]  # 0, -0, min, max, -inf, 0.1
    values = bits.view(np.float32)
    back = _dense_roundtrip(values, "f32")
    nan = np.isnan(values)
    assert ((back.view(np.uint32) == bits) | nan).all()


def _significant_digits(s: str) -> int:
    mantissa = s.lstrip("-").split("e")[0].replace(".", "").lstrip("0").rstrip("0")
    return max(len(mantissa), 1)


@pytest.mark.parametrize("np_dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_narrow_floats_print_the_shortest_text(np_dtype):
    rng = np.random.default_rng(7)
    with np.errstate(over="ignore"):
        values = (rng.standard_normal(400) * np.exp(rng.uniform(-20, 20, 400))).astype(np_dtype)
    values = values[np.isfinite(values.astype(np.float32))]
    for v in values:
        other = 0.5 if v != np_dtype(0.5) else 0.25  # a second element, so this is not printed as a splat
        s = format_dense(np.array([v, other], dtype=np_dtype))[1:].split(",")[0]
        assert np_dtype(float(s)) == v, (v, s)
        if float(v).is_integer():
            continue
        d = _significant_digits(s)
        # no decimal with fewer significant digits names the same element
        if d > 1:
            shorter = f"{float(v):.{d - 2}e}"
            assert np_dtype(float(shorter)) != v, (v, s, shorter)
    # the f32 text of 0.1 is "0.1", not the double nearest the f32 value
    assert format_dense(np.array([0.1, 0.2], dtype=np.float32)) == "[0.1, 0.2]"
    assert format_dense(np.array([0.1, 0.2], dtype=np.float16)) == "[0.1, 0.2]"
    assert format_dense(np.array([0.1, 0.2], dtype=ml_dtypes.bfloat16)) == "[0.1, 0.2]"


def test_narrow_floats_special_values():
    for np_dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        v = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 65504.0, 1e-7], dtype=np_dtype)
        text = format_dense(v)
        items = text[1:-1].split(", ")
        assert items[:5] == ["inf", "-inf", "nan", "-0.0", "0.0"]
        for item in items:
            assert "." in item or "e" in item or item in ("inf", "-inf", "nan")


def test_a_folded_f16_constant_prints_and_reads_back():
    # IR that passes build holds narrow arrays; printing them gives the same constant after a re-parse
    x = Value(TensorType((3,), DType.f16), "x")
    values = np.array([0.1, -2.0, 1e-4], dtype=np.float16)
    const = create_op("ge.const", [], [TensorType((3,), DType.f16)], {"value": DenseAttr(values)}, result_names=["c"])
    add = create_op("ge.add", [x, const.result], [None], result_names=["y"])
    ret = create_op("ge.return", [add.result], [])
    g = Graph("main", [x], [TensorType((3,), DType.f16)], [const, add, ret])
    text = print_graph(g)
    assert text == (
        "ge.graph @main(%x: tensor<3xf16>) -> tensor<3xf16> {\n"
        "  %c = ge.const dense<[0.1, -2.0, 0.0001]> : tensor<3xf16>\n"
        "  %y = ge.add %x, %c\n"
        "  ge.return %y\n"
        "}\n"
    )
    back = parse(text).graphs[0].ops[0]
    assert np.array_equal(back.value.to_array(back.result.type).view(np.uint16), values.view(np.uint16))


def test_unnamed_values_get_fresh_names_that_do_not_clash():
    x = Value(TensorType((2,), DType.f32), "0")
    ops = []
    prev = x
    for _ in range(3):
        op = create_op("ge.neg", [prev], [TensorType((2,), DType.f32)])
        ops.append(op)
        prev = op.result
    ops[1].results[0].name = "1"
    ret = create_op("ge.return", [prev], [])
    g = Graph("main", [x], [TensorType((2,), DType.f32)], ops + [ret])
    text = print_graph(g)
    assert text == (
        "ge.graph @main(%0: tensor<2xf32>) -> tensor<2xf32> {\n"
        "  %2 = ge.neg %0 : tensor<2xf32>\n"
        "  %1 = ge.neg %2 : tensor<2xf32>\n"
        "  %3 = ge.neg %1 : tensor<2xf32>\n"
        "  ge.return %3\n"
        "}\n"
    )
    assert print_module(parse(text)) == text


def test_types_print_only_when_all_results_have_one():
    text = graph_text("  %y = ge.neg %x\n  %z = ge.neg %y : tensor<4xf32>\n  ge.return %z")
    printed = roundtrip(text)
    assert "  %y = ge.neg %x\n" in printed and "  %z = ge.neg %y : tensor<4xf32>\n" in printed


def test_print_op_without_a_namer():
    op = parse(graph_text("  %y = ge.softmax %x {axis = 0} : tensor<4xf32>\n  ge.return %y")).graphs[0].ops[0]
    assert print_op(op) == "%y = ge.softmax %x {axis = 0} : tensor<4xf32>"


def test_examples_round_trip():
    from pathlib import Path

    for path in sorted((Path(__file__).parent.parent / "examples").glob("*.geir")):
        roundtrip(path.read_text())


def test_empty_constants_of_any_rank_round_trip():
    # a pass may build an empty constant of rank 2; `dense<[]>` must read back as that constant
    x = Value(TensorType((0, 3), DType.f32), "x")
    const = create_op("ge.const", [], [TensorType((0, 3), DType.f32)],
                      {"value": DenseAttr(np.zeros((0, 3), np.float32))}, result_names=["c"])
    ret = create_op("ge.return", [const.result], [])
    text = print_graph(Graph("main", [x], [TensorType((0, 3), DType.f32)], [const, ret]))
    assert "%c = ge.const dense<[]> : tensor<0x3xf32>" in text
    m = parse(text)
    from geir import verify_module

    assert verify_module(m)
    back = m.graphs[0].ops[0]
    assert back.value.to_array(back.result.type).shape == (0, 3)


STR_TEXT = (
    "ge.graph @main(%x: tensor<4x64xf32>) -> tensor<4x64xf32> {\n"
    "  %w = ge.const dense_resource<\"w\"> : tensor<64x64xf32>\n"
    "  %b = ge.const dense<[1.0, 2.0, 3.0, 4.0]> : tensor<4x1xf32>\n"
    "  %y = ge.matmul %x, %w : tensor<4x64xf32>\n"
    "  %z = ge.add %y, %b : tensor<4x64xf32>\n"
    "  ge.return %z\n"
    "}\n"
    "\n"
    "ge.graph @other(%a: tensor<2xf16>) -> tensor<2xf16> {\n"
    "  %n = ge.neg %a : tensor<2xf16>\n"
    "  ge.return %n\n"
    "}\n"
)


def test_str_of_a_module_or_graph_is_its_ir_text():
    # as MLIR's and xDSL's Python bindings do: str() is the printer's text, and it parses back
    m = parse(STR_TEXT)
    assert str(m) == print_module(m) == STR_TEXT
    assert str(parse(str(m))) == str(m)
    assert [str(g) for g in m.graphs] == [print_graph(g) for g in m.graphs]
    assert str(m.graph()) == STR_TEXT.split("\n\n")[0] + "\n"
    assert str(m.graph().ops[2]) == "%y = ge.matmul %x, %w : tensor<4x64xf32>"
    assert f"{m}" == STR_TEXT  # formatting uses it too


def test_repr_of_a_module_is_short_and_never_dumps_weights():
    m = parse(STR_TEXT)
    m.resources["w"] = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    m.resources["big"] = np.zeros((1024, 1024), np.float32)
    r = repr(m)
    assert r == "<Module @main, @other: 2 graphs, 7 ops, 2 resources>"
    assert repr(m.graph()) == "<ge.graph @main: 1 arg, 5 ops>"
    assert repr(Graph("g", [], [])) == "<ge.graph @g: 0 args, 0 ops>"
    assert len(repr(parse(STR_TEXT.split("\n\n")[0]))) < 40
