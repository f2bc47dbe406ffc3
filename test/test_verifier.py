"""The verifier's errors (wording and location) and infer-shapes' result types, `?` included."""

from __future__ import annotations

from pathlib import Path

import pytest

from geir import DiagnosticError, parse, print_module, verify_module
from geir.diagnostics import DiagnosticEngine
from geir.passes import PASSES, PassContext, PassManager
from geir.types import parse_type

from helpers import graph_text


def errors(text: str) -> list[tuple[str, int, int]]:
    """Every error the verifier reports for `text` (it must parse), as (message, line, col)."""
    m = parse(text, "v.geir")
    out = []
    ok = verify_module(m, lambda d: out.append((d.message, d.loc.line, d.loc.col)))
    assert ok == (not out)
    return out


def one_error(text: str) -> tuple[str, int, int]:
    errs = errors(text)
    assert len(errs) == 1, errs
    # the default is to raise the first error
    with pytest.raises(DiagnosticError) as e:
        verify_module(parse(text, "v.geir"))
    d = e.value.diagnostics[0]
    assert (d.message, d.loc.line, d.loc.col) == errs[0]
    return errs[0]


def op_error(args: str, line: str, results: str = "tensor<4xf32>") -> str:
    """The message of the one error for a graph whose only op is `line` (returned as the result)."""
    msg, ln, col = one_error(graph_text(f"  {line}\n  ge.return %y", args, results))
    assert (ln, col) == (2, 3), (msg, ln, col)
    return msg


X = "%x: tensor<4xf32>"


# --- structure -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "line, message",
    [
        ("%y = ge.add %x", "ge.add expects 2 operands (a, b), got 1"),
        ("%y = ge.add %x, %x, %x", "ge.add expects 2 operands (a, b), got 3"),
        ("%y = ge.neg %x, %x", "ge.neg expects 1 operand (x), got 2"),
        ("%y = ge.select %x, %x", "ge.select expects 3 operands (cond, a, b), got 2"),
        ("%y = ge.flash_attention %x, %x", "ge.flash_attention expects 3 or 5 operands (q, k, v, mask, pse), got 2"),
        ("%y = ge.flash_attention %x, %x, %x, %x, %x, %x",
         "ge.flash_attention expects 3 or 5 operands (q, k, v, mask, pse), got 6"),
        ("%y = ge.concat {axis = 0}", "ge.concat expects at least 1 operand, got 0"),
        ("%y = ge.const %x dense<1.0> : tensor<4xf32>", "ge.const expects 0 operands (), got 1"),
    ],
)
def test_operand_counts(line, message):
    assert op_error(X, line) == message


def test_missing_attributes():
    assert op_error(X, "%y = ge.cast %x") == "ge.cast needs attribute 'to'"
    assert op_error(X, "%y = ge.reduce_sum %x") == "ge.reduce_sum needs attribute 'axes'"
    assert op_error(X, "%y = ge.transpose %x") == "ge.transpose needs attribute 'perm'"
    assert op_error(X, "%y = ge.concat %x, %x") == "ge.concat needs attribute 'axis'"
    assert op_error(X, "%y = ge.const : tensor<4xf32>") == "ge.const needs attribute 'value'"


@pytest.mark.parametrize(
    "line, message, at",
    [
        ("%y = ge.softmax %x {axis = 1.5}", "attribute 'axis' must be an integer, not the number 1.5", "axis"),
        ("%y = ge.softmax %x {axis = true}", "attribute 'axis' must be an integer, not the boolean true", "axis"),
        ('%y = ge.softmax %x {axis = "0"}', "attribute 'axis' must be an integer, not the string \"0\"", "axis"),
        ("%y = ge.matmul %x, %x {transpose_a = 1}",
         "attribute 'transpose_a' must be true or false, not the integer 1", "transpose_a"),
        ("%y = ge.layer_norm %x, %x, %x {epsilon = true}",
         "attribute 'epsilon' must be a number, not the boolean true", "epsilon"),
        ("%y = ge.cast %x {to = \"f16\"}", "attribute 'to' must be a dtype, not the string \"f16\"", "to"),
        ("%y = ge.transpose %x {perm = 0}", "attribute 'perm' must be a list of integers, not the integer 0", "perm"),
        ("%y = ge.transpose %x {perm = [0.0]}", "attribute 'perm' must be a list of integers, not a list", "perm"),
        ("%y = ge.transpose %x {perm = [true]}", "attribute 'perm' must be a list of integers, not a list", "perm"),
        ("%y = ge.reduce_sum %x {axes = [0], keepdims = {}}",
         "attribute 'keepdims' must be true or false, not a dictionary", "keepdims"),
        ("%y = ge.gelu %x {approximate = f32}", "attribute 'approximate' must be a string, not the dtype f32",
         "approximate"),
        ("%y = ge.flash_attention %x, %x, %x {scale = [1]}", "attribute 'scale' must be a number, not a list", "scale"),
        ("%y = ge.const {value = 1} : tensor<4xf32>", "attribute 'value' must be a dense literal, not the integer 1",
         "value"),
    ],
)
def test_wrong_kind_attributes(line, message, at):
    msg, ln, col = one_error(graph_text(f"  {line}\n  ge.return %y", X))
    assert msg == message
    assert (ln, col) == (2, 3 + line.index(at))


@pytest.mark.parametrize(
    "line, message, at",
    [
        ('%y = ge.gelu %x {approximate = "erf"}', 'attribute \'approximate\' must be "none" or "tanh", not "erf"',
         "approximate"),
        ('%y = ge.flash_attention %x, %x, %x {layout = "NSBD"}',
         'attribute \'layout\' must be "BNSD" or "BSND", not "NSBD"', "layout"),
        ('%y = ge.trans_data %x {dst_format = "NCHW"}', 'attribute \'dst_format\' must be "ND" or "NZ", not "NCHW"',
         "dst_format"),
    ],
)
def test_attribute_choices(line, message, at):
    msg, ln, col = one_error(graph_text(f"  {line}\n  ge.return %y", X))
    assert msg == message and (ln, col) == (2, 3 + line.index(at))


def test_unknown_attribute_at_its_key():
    line = "%y = ge.softmax %x {axis = 0, bogus = 2}"
    msg, ln, col = one_error(graph_text(f"  {line}\n  ge.return %y", X))
    assert msg == "unknown attribute 'bogus' for ge.softmax (it takes axis)"
    assert (ln, col) == (2, 3 + line.index("bogus"))
    msg, _, _ = one_error(graph_text("  %y = ge.neg %x {axis = 0}\n  ge.return %y", X))
    assert msg == "unknown attribute 'axis' for ge.neg (it takes no attributes)"


def test_pass_attributes_are_allowed_on_any_op():
    text = graph_text('  %y = ge.neg %x {mem_offset = [0], tiling = {template = "x"}}\n  ge.return %y', X)
    assert errors(text) == []


@pytest.mark.parametrize(
    "line, message",
    [
        ("%y = ge.const dense<[1.0, 2.0]> : tensor<4xf32>", "dense literal has shape [2] but the result type is tensor<4xf32>"),
        ("%y = ge.const dense<[[1.0], [2.0], [3.0], [4.0]]> : tensor<4xf32>",
         "dense literal has shape [4, 1] but the result type is tensor<4xf32>"),
        ("%y = ge.const dense<1.5> : tensor<4xi32>", "a floating-point literal cannot initialise tensor<4xi32>"),
        ("%y = ge.const dense<[1.0, 0.0]> : tensor<2xi1>", "a floating-point literal cannot initialise tensor<2xi1>"),
        ("%y = ge.const dense<true> : tensor<4xf32>", "a boolean literal cannot initialise tensor<4xf32>"),
        ("%y = ge.const dense<[1.0, 2.0]> : tensor<?xf32>",
         "a dense literal of shape [2] needs a static result type, not tensor<?xf32>"),
        ("%y = ge.const dense<1.0>", "a constant needs its result type, e.g. `: tensor<4xf32>`"),
    ],
)
def test_dense_literal_against_its_type(line, message):
    msg, ln, col = one_error(graph_text(f"  {line}\n  ge.return %x", X))
    assert msg == message and (ln, col) == (2, 3)


def test_dense_literals_that_fit():
    text = graph_text(
        "  %a = ge.const dense<[1, 2, 3, 4]> : tensor<4xf32>\n"
        "  %b = ge.const dense<7> : tensor<2x2xi8>\n"
        "  %c = ge.const dense<[true, false]> : tensor<2xi1>\n"
        "  %d = ge.const dense<[1, 0]> : tensor<2xi1>\n"
        "  %e = ge.const dense<[]> : tensor<0xf16>\n"
        '  %f = ge.const dense_resource<"w"> : tensor<4xf32>\n'
        "  ge.return %x",
        X,
    )
    assert errors(text) == []


def test_integer_literal_out_of_range_for_its_type():
    msg, _, _ = one_error(graph_text("  %y = ge.const dense<[1, 300]> : tensor<2xi8>\n  ge.return %x", X))
    assert "300" in msg and "i8" in msg


@pytest.mark.parametrize(
    "line, declared, inferred",
    [
        ("%y = ge.add %x, %x : tensor<5xf32>", "tensor<5xf32>", "tensor<4xf32>"),
        ("%y = ge.add %x, %x : tensor<4xf16>", "tensor<4xf16>", "tensor<4xf32>"),
        ("%y = ge.add %x, %x : tensor<4x1xf32>", "tensor<4x1xf32>", "tensor<4xf32>"),
        ("%y = ge.greater %x, %x : tensor<4xf32>", "tensor<4xf32>", "tensor<4xi1>"),
        ('%y = ge.trans_data %x {dst_format = "NZ"} : tensor<4xf32>', "tensor<4xf32>", "tensor<4xf32, NZ>"),
    ],
)
def test_result_type_contradictions(line, declared, inferred):
    msg, ln, col = one_error(graph_text(f"  {line}\n  ge.return %x", X))
    assert msg == f"result type {declared} contradicts the inferred type {inferred}" and (ln, col) == (2, 3)


def test_contradiction_on_a_second_result_points_at_it():
    line = "%a, %b = ge.split %x {axis = 0, sizes = [1, 3]} : tensor<1xf32>, tensor<2xf32>"
    msg, ln, col = one_error(graph_text(f"  {line}\n  ge.return %x", X))
    assert msg == "result type tensor<2xf32> contradicts the inferred type tensor<3xf32>"
    assert (ln, col) == (2, 3 + line.index("%b"))


def test_compatible_declared_types_are_accepted():
    text = graph_text(
        "  %a = ge.neg %x : tensor<?xf32>\n"  # less precise than inferred
        "  %b = ge.neg %d : tensor<4xf32>\n"  # more precise than inferred (?)
        "  %c = ge.neg %x : tensor<4xf32, NZ>\n"  # storage formats are the layout pass's choice
        "  ge.return %a",
        "%x: tensor<4xf32>, %d: tensor<?xf32>",
        "tensor<?xf32>",
    )
    assert errors(text) == []


def test_return_against_the_signature():
    msg, ln, col = one_error(graph_text("  ge.return %x, %x", X))
    assert msg == "ge.return gives 2 values but graph '@main' returns 1" and (ln, col) == (2, 3)
    msg, _, _ = one_error(graph_text("  ge.return", X))
    assert msg == "ge.return gives 0 values but graph '@main' returns 1"
    msg, _, _ = one_error(graph_text("  ge.return %x", X, "tensor<4xf16>"))
    assert msg == "result 0 has type tensor<4xf32> but graph '@main' returns tensor<4xf16>"
    msg, _, _ = one_error(graph_text("  ge.return %x, %y", "%x: tensor<4xf32>, %y: tensor<3xf32>",
                                     "(tensor<4xf32>, tensor<4xf32>)"))
    assert msg == "result 1 has type tensor<3xf32> but graph '@main' returns tensor<4xf32>"
    # `?` on either side is compatible
    assert errors(graph_text("  ge.return %x", "%x: tensor<?xf32>", "tensor<4xf32>")) == []
    assert errors(graph_text("  ge.return %x", X, "tensor<?xf32>")) == []


def test_return_placement():
    msg, ln, col = one_error("ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {\n  %y = ge.neg %x\n}\n")
    assert msg == "graph '@main' must end with ge.return" and (ln, col) == (2, 3)
    msg, ln, col = one_error("ge.graph @g() -> () {\n}\n")
    assert msg == "graph '@g' must end with ge.return" and (ln, col) == (1, 10)
    errs = errors(graph_text("  ge.return %x\n  %y = ge.neg %x", X))
    assert ("ge.return must be the last op of its graph", 2, 3) in errs


def test_split_result_count():
    msg = op_error(X, "%y = ge.split %x {axis = 0, sizes = [2, 2]}")
    assert msg == "split into 2 pieces must have 2 results, has 1"
    assert op_error(X, "%y = ge.split %x {axis = 0, sizes = []}") == "split needs at least one size"
    assert op_error(X, "%y = ge.split %x {axis = 0, sizes = [-1]}") == "split sizes [-1] must not be negative"


def test_all_errors_are_reported_without_cascades():
    text = graph_text(
        "  %a = ge.matmul %x, %x\n"  # rank error
        "  %b = ge.neg %a\n"  # depends on %a: not reported again
        "  %c = ge.softmax %x {axis = 3}\n"  # axis error
        "  %d = ge.add %x, %x : tensor<5xf32>\n"
        "  ge.return %x",
        X,
    )
    errs = errors(text)
    assert [(ln, col) for _, ln, col in errs] == [(2, 3), (4, 3), (5, 3)]
    assert errs[0][0].startswith("matmul operands need rank 2 or more")
    assert errs[1][0] == "axis 3 is out of range for rank 1"


# --- shape rules ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "args, line, message",
    [
        ("%a: tensor<3x4xf32>, %b: tensor<5xf32>", "%y = ge.add %a, %b",
         "shapes 3x4 and 5 do not broadcast: dimension -1 is 4 vs 5"),
        ("%a: tensor<2x3x4xf32>, %b: tensor<5x1x4xf32>", "%y = ge.mul %a, %b",
         "shapes 2x3x4 and 5x1x4 do not broadcast: dimension -3 is 2 vs 5"),
        ("%a: tensor<4xf32>, %b: tensor<4xf16>", "%y = ge.sub %a, %b", "operand dtypes differ: f32 vs f16"),
        ("%a: tensor<4xi32>, %b: tensor<4xf32>", "%y = ge.less %a, %b", "operand dtypes differ: i32 vs f32"),
        ("%c: tensor<4xf32>, %a: tensor<4xf32>", "%y = ge.select %c, %a, %a",
         "condition must be an i1 tensor, not tensor<4xf32>"),
        ("%c: tensor<4xi1>, %a: tensor<4xf32>, %b: tensor<4xi32>", "%y = ge.select %c, %a, %b",
         "operand dtypes differ: f32 vs i32"),
        ("%c: tensor<3xi1>, %a: tensor<4xf32>", "%y = ge.select %c, %a, %a",
         "shapes 3 and 4 do not broadcast: dimension -1 is 3 vs 4"),
        ("%a: tensor<4xi32>", "%y = ge.exp %a", "operand must be a floating-point tensor, not tensor<4xi32>"),
        ("%a: tensor<4xi1>", "%y = ge.gelu %a", "operand must be a floating-point tensor, not tensor<4xi1>"),
        ("%a: tensor<4xi32>", "%y = ge.softmax %a", "operand must be a floating-point tensor, not tensor<4xi32>"),
        ("%a: tensor<4x8xf32>", "%y = ge.softmax %a {axis = -3}", "axis -3 is out of range for rank 2"),
        ("%a: tensor<4x8xf32>", "%y = ge.reduce_max %a {axes = [2]}", "axis 2 is out of range for rank 2"),
        ("%a: tensor<4x8xf32>", "%y = ge.reduce_mean %a {axes = [1, -1]}", "axes [1, -1] name the same axis twice"),
        ("%a: tensor<4x8xf32>, %b: tensor<4x8xf32>", "%y = ge.matmul %a, %b", "matmul contraction dims differ: 8 vs 4"),
        ("%a: tensor<4x8xf32>, %b: tensor<3x9xf32>", "%y = ge.matmul %a, %b {transpose_b = true}",
         "matmul contraction dims differ: 8 vs 9"),
        ("%a: tensor<8x4xf32>, %b: tensor<9x5xf32>", "%y = ge.matmul %a, %b {transpose_a = true}",
         "matmul contraction dims differ: 8 vs 9"),
        ("%a: tensor<8xf32>, %b: tensor<8x4xf32>", "%y = ge.matmul %a, %b",
         "matmul operands need rank 2 or more, got tensor<8xf32> and tensor<8x4xf32>"),
        ("%a: tensor<2x4x8xf32>, %b: tensor<3x8x4xf32>", "%y = ge.matmul %a, %b",
         "shapes 2 and 3 do not broadcast: dimension -1 is 2 vs 3"),
        ("%a: tensor<4x8xf16>, %b: tensor<8x4xf32>", "%y = ge.matmul %a, %b", "operand dtypes differ: f16 vs f32"),
        ("%a: tensor<2x3xf32>", "%y = ge.transpose %a {perm = [0, 0]}",
         "perm [0, 0] is not a permutation of the 2 axes of tensor<2x3xf32>"),
        ("%a: tensor<2x3xf32>", "%y = ge.transpose %a {perm = [1, 0, 2]}",
         "perm [1, 0, 2] is not a permutation of the 2 axes of tensor<2x3xf32>"),
        ("%a: tensor<2x3xf32>", "%y = ge.reshape %a {shape = [-1, -1]}", "reshape shape [-1, -1] has more than one -1"),
        ("%a: tensor<2x3xf32>", "%y = ge.reshape %a {shape = [-2, 3]}",
         "reshape shape [-2, 3] has a negative dimension other than -1"),
        ("%a: tensor<2x3xf32>", "%y = ge.reshape %a {shape = [4, 2]}",
         "cannot reshape tensor<2x3xf32> (6 elements) into [4, 2] (8 elements)"),
        ("%a: tensor<2x3xf32>", "%y = ge.reshape %a {shape = [-1, 4]}",
         "cannot reshape tensor<2x3xf32> into [-1, 4]: 6 elements do not divide by 4"),
        ("%a: tensor<2x3xf32>", "%y = ge.reshape %a {shape = [0, -1]}",
         "cannot reshape tensor<2x3xf32> into [0, -1]: 6 elements do not divide by 0"),
        ("%a: tensor<2x3xf32>, %b: tensor<2x3xf16>", "%y = ge.concat %a, %b {axis = 0}",
         "concat operands must share rank and dtype: tensor<2x3xf32> vs tensor<2x3xf16>"),
        ("%a: tensor<2x3xf32>, %b: tensor<2xf32>", "%y = ge.concat %a, %b {axis = 0}",
         "concat operands must share rank and dtype: tensor<2x3xf32> vs tensor<2xf32>"),
        ("%a: tensor<2x3xf32>, %b: tensor<2x4xf32>", "%y = ge.concat %a, %b {axis = 0}",
         "concat operands differ in dimension 1: 3 vs 4"),
        ("%a: tensor<2x3xf32>", "%y = ge.concat %a {axis = 2}", "axis 2 is out of range for rank 2"),
        ("%a: tensor<2x6xf32>", "%y, %z = ge.split %a {axis = 1, sizes = [2, 3]}",
         "split sizes [2, 3] add up to 5, not dimension 1 = 6"),
        ("%a: tensor<2x6xf32>", "%y, %z = ge.split %a {axis = -3, sizes = [1, 1]}", "axis -3 is out of range for rank 2"),
        ("%a: tensor<2x6xf32>", "%y = ge.slice %a {axes = [0, 1], starts = [0], ends = [1, 1]}",
         "slice axes, starts and ends must have one entry each, got 2, 1, 2"),
        ("%a: tensor<2x6xf32>", "%y = ge.slice %a {axes = [1, -1], starts = [0, 0], ends = [1, 1]}",
         "slice names axis -1 twice"),
        ("%a: tensor<2x6xf32>", "%y = ge.slice %a {axes = [2], starts = [0], ends = [1]}",
         "axis 2 is out of range for rank 2"),
        ("%a: tensor<2x6xf32>, %g: tensor<6xf16>", "%y = ge.layer_norm %a, %g, %g",
         "gamma dtype f16 differs from the input's f32"),
        ("%a: tensor<2x6xf32>, %g: tensor<5xf32>", "%y = ge.layer_norm %a, %g, %g",
         "shapes 2x6 and 5 do not broadcast: dimension -1 is 6 vs 5"),
        ("%a: tensor<2x6xf32>, %g: tensor<6xf32>, %b: tensor<1x2x6xf32>", "%y = ge.layer_norm %a, %g, %b",
         "beta of type tensor<1x2x6xf32> does not broadcast to the input tensor<2x6xf32>"),
        ("%a: tensor<2x6xi32>, %g: tensor<6xi32>", "%y = ge.layer_norm %a, %g, %g",
         "operand must be a floating-point tensor, not tensor<2x6xi32>"),
        ("%a: tensor<2x6xf32>, %g: tensor<6xf32>", "%y = ge.layer_norm %a, %g, %g {axis = 2}",
         "axis 2 is out of range for rank 2"),
        ("%a: tensor<f32>, %g: tensor<f32>", "%y = ge.rms_norm %a, %g", "rms_norm needs an input of rank 1 or more"),
        ("%a: tensor<2x6xf32>, %g: tensor<2x1x6xf32>", "%y = ge.rms_norm %a, %g",
         "gamma of type tensor<2x1x6xf32> does not broadcast to the input tensor<2x6xf32>"),
    ],
)
def test_shape_rule_errors(args, line, message):
    results = "(tensor<4xf32>, tensor<4xf32>)" if line.startswith("%y, %z") else "tensor<4xf32>"
    ret = "  ge.return %y, %z" if line.startswith("%y, %z") else "  ge.return %y"
    msg, ln, col = one_error(graph_text(f"  {line}\n{ret}", args, results))
    assert msg == message and (ln, col) == (2, 3)


Q = "tensor<2x8x16x64xf16>"
KV = "tensor<2x2x32x64xf16>"


@pytest.mark.parametrize(
    "args, extra, message",
    [
        (f"%q: tensor<8x16x64xf16>, %k: {KV}, %v: {KV}", "", "q must have rank 4 (BNSD), got tensor<8x16x64xf16>"),
        (f"%q: {Q}, %k: {KV}, %v: tensor<2x32x64xf16>", "", "v must have rank 4 (BNSD), got tensor<2x32x64xf16>"),
        (f"%q: {Q}, %k: tensor<3x2x32x64xf16>, %v: {KV}", "", "flash_attention batch differ: 2 vs 3"),
        (f"%q: {Q}, %k: tensor<2x2x32x32xf16>, %v: {KV}", "", "flash_attention head dim of q and k differ: 64 vs 32"),
        (f"%q: {Q}, %k: {KV}, %v: tensor<2x2x31x64xf16>", "", "flash_attention key and value sequence differ: 32 vs 31"),
        (f"%q: {Q}, %k: {KV}, %v: tensor<2x4x32x64xf16>", "", "flash_attention key and value heads differ: 2 vs 4"),
        (f"%q: {Q}, %k: tensor<2x3x32x64xf16>, %v: tensor<2x3x32x64xf16>", "",
         "query heads 8 are not a multiple of key/value heads 3"),
        (f"%q: {Q}, %k: {KV}, %v: tensor<2x2x32x64xf32>", "", "operand dtypes differ: f16 vs f32"),
        ("%q: tensor<2x8x16x64xi32>, %k: tensor<2x2x32x64xi32>, %v: tensor<2x2x32x64xi32>", "",
         "q must be a floating-point tensor, not tensor<2x8x16x64xi32>"),
        (f"%q: {Q}, %k: {KV}, %v: {KV}, %m: tensor<16x32xi32>", ", %m", "mask must be i1 or floating-point, not tensor<16x32xi32>"),
        (f"%q: {Q}, %k: {KV}, %v: {KV}, %m: tensor<16x31xf16>", ", %m",
         "mask tensor<16x31xf16> does not broadcast to [B, N, Sq, Skv] = [2, 8, 16, 32]"),
        (f"%q: {Q}, %k: {KV}, %v: {KV}, %m: tensor<1x1x1x16x32xi1>", ", %m",
         "mask tensor<1x1x1x16x32xi1> does not broadcast to [B, N, Sq, Skv] = [2, 8, 16, 32]"),
        (f"%q: {Q}, %k: {KV}, %v: {KV}, %m: tensor<2x8x1x32xi1>", ", %m", None),  # fine: broadcasts
    ],
)
def test_flash_attention_shape_errors(args, extra, message):
    text = graph_text(f"  %y = ge.flash_attention %q, %k, %v{extra}\n  ge.return %y", args, "tensor<2x8x16x64xf16>")
    if message is None:
        assert errors(text) == []
    else:
        msg, ln, col = one_error(text)
        assert msg == message and (ln, col) == (2, 3)


def test_flash_attention_bsnd_error_names_the_layout():
    args = "%q: tensor<2x16x8x64xf16>, %k: tensor<2x32x3x64xf16>, %v: tensor<2x32x3x64xf16>"
    text = graph_text('  %y = ge.flash_attention %q, %k, %v {layout = "BSND"}\n  ge.return %y', args,
                      "tensor<2x16x8x64xf16>")
    assert one_error(text)[0] == "query heads 8 are not a multiple of key/value heads 3"
    args = "%q: tensor<16x8x64xf16>, %k: tensor<2x32x2x64xf16>, %v: tensor<2x32x2x64xf16>"
    text = graph_text('  %y = ge.flash_attention %q, %k, %v {layout = "BSND"}\n  ge.return %y', args,
                      "tensor<2x16x8x64xf16>")
    assert one_error(text)[0] == "q must have rank 4 (BSND), got tensor<16x8x64xf16>"


# --- infer-shapes --------------------------------------------------------------------------

def infer(args: str, line: str, n_results: int = 1) -> list[str]:
    """Run the infer-shapes pass on a graph of one op; the printed result types."""
    names = ", ".join(f"%r{i}" for i in range(n_results))
    text = graph_text(f"  {names} = {line}\n  ge.return", args, "()")
    m = parse(text)
    ctx = PassContext(diagnostics=DiagnosticEngine(lambda d: pytest.fail(f"unexpected diagnostic: {d}")))
    PASSES["infer-shapes"]().run(m, ctx)
    op = m.graphs[0].ops[0]
    return [str(r.type) for r in op.results]


@pytest.mark.parametrize(
    "args, line, expected",
    [
        # broadcasting, `?` included
        ("%a: tensor<3x1x5xf32>, %b: tensor<4x1xf32>", "ge.add %a, %b", "tensor<3x4x5xf32>"),
        ("%a: tensor<f16>, %b: tensor<2x3xf16>", "ge.mul %b, %a", "tensor<2x3xf16>"),
        ("%a: tensor<?x1xf32>, %b: tensor<1x7xf32>", "ge.sub %a, %b", "tensor<?x7xf32>"),
        ("%a: tensor<?x3xf32>, %b: tensor<5x1xf32>", "ge.div %a, %b", "tensor<5x3xf32>"),
        ("%a: tensor<?xf32>, %b: tensor<?xf32>", "ge.max %a, %b", "tensor<?xf32>"),
        ("%a: tensor<1xf32>, %b: tensor<?xf32>", "ge.min %a, %b", "tensor<?xf32>"),
        ("%a: tensor<2x?xbf16>, %b: tensor<bf16>", "ge.pow %a, %b", "tensor<2x?xbf16>"),
        ("%a: tensor<4x1xi32>, %b: tensor<3xi32>", "ge.greater %a, %b", "tensor<4x3xi1>"),
        ("%a: tensor<?xf32>, %b: tensor<1xf32>", "ge.less %a, %b", "tensor<?xi1>"),
        ("%a: tensor<4xi8>, %b: tensor<4xi8>", "ge.equal %a, %b", "tensor<4xi1>"),
        ("%c: tensor<4x1xi1>, %a: tensor<3xf32>, %b: tensor<f32>", "ge.select %c, %a, %b", "tensor<4x3xf32>"),
        ("%c: tensor<?x1xi1>, %a: tensor<1x?xf16>, %b: tensor<1x1xf16>", "ge.select %c, %a, %b", "tensor<?x?xf16>"),
        # unary, gelu, cast
        ("%a: tensor<?x5xf16>", "ge.exp %a", "tensor<?x5xf16>"),
        ("%a: tensor<3xi32>", "ge.neg %a", "tensor<3xi32>"),
        ("%a: tensor<3xi8>", "ge.abs %a", "tensor<3xi8>"),
        ("%a: tensor<3xi64>", "ge.relu %a", "tensor<3xi64>"),
        ("%a: tensor<2x?xbf16>", "ge.silu %a", "tensor<2x?xbf16>"),
        ("%a: tensor<2xf32>", 'ge.gelu %a {approximate = "tanh"}', "tensor<2xf32>"),
        ("%a: tensor<2x?xf32>", "ge.cast %a {to = i32}", "tensor<2x?xi32>"),
        ("%a: tensor<2xi1>", "ge.cast %a {to = bf16}", "tensor<2xbf16>"),
        # reductions and softmax
        ("%a: tensor<2x3x4xf32>", "ge.reduce_sum %a {axes = [1]}", "tensor<2x4xf32>"),
        ("%a: tensor<2x3x4xf32>", "ge.reduce_max %a {axes = [0, -1], keepdims = true}", "tensor<1x3x1xf32>"),
        ("%a: tensor<?x3x?xf16>", "ge.reduce_mean %a {axes = [1]}", "tensor<?x?xf16>"),
        ("%a: tensor<?x3x?xf16>", "ge.reduce_mean %a {axes = [2], keepdims = true}", "tensor<?x3x1xf16>"),
        ("%a: tensor<2x3xf32>", "ge.reduce_sum %a {axes = [0, 1]}", "tensor<f32>"),
        ("%a: tensor<2x3xf32>", "ge.reduce_sum %a {axes = []}", "tensor<2x3xf32>"),
        ("%a: tensor<?x7xbf16>", "ge.softmax %a {axis = 0}", "tensor<?x7xbf16>"),
        ("%a: tensor<2x6xf32>, %g: tensor<6xf32>", "ge.layer_norm %a, %g, %g {epsilon = 1e-6}", "tensor<2x6xf32>"),
        ("%a: tensor<?x6xf16>, %g: tensor<6xf16>", "ge.rms_norm %a, %g", "tensor<?x6xf16>"),
        # matmul: transposes and batch broadcasting
        ("%a: tensor<4x8xf32>, %b: tensor<8x3xf32>", "ge.matmul %a, %b", "tensor<4x3xf32>"),
        ("%a: tensor<8x4xf32>, %b: tensor<8x3xf32>", "ge.matmul %a, %b {transpose_a = true}", "tensor<4x3xf32>"),
        ("%a: tensor<4x8xf32>, %b: tensor<3x8xf32>", "ge.matmul %a, %b {transpose_b = true}", "tensor<4x3xf32>"),
        ("%a: tensor<8x4xf16>, %b: tensor<3x8xf16>", "ge.matmul %a, %b {transpose_a = true, transpose_b = true}",
         "tensor<4x3xf16>"),
        ("%a: tensor<3x1x4x8xf32>, %b: tensor<5x8x2xf32>", "ge.matmul %a, %b", "tensor<3x5x4x2xf32>"),
        ("%a: tensor<4x8xbf16>, %b: tensor<6x8x2xbf16>", "ge.matmul %a, %b", "tensor<6x4x2xbf16>"),
        ("%a: tensor<?x?x8xf32>, %b: tensor<1x8x?xf32>", "ge.matmul %a, %b", "tensor<?x?x?xf32>"),
        ("%a: tensor<4x?xf32>, %b: tensor<8x3xf32>", "ge.matmul %a, %b", "tensor<4x3xf32>"),
        ("%a: tensor<1x8x128x64xf16>, %b: tensor<1x8x128x64xf16>", "ge.matmul %a, %b {transpose_b = true}",
         "tensor<1x8x128x128xf16>"),
        # data movement
        ("%a: tensor<2x?x4xf32>", "ge.transpose %a {perm = [2, 0, 1]}", "tensor<4x2x?xf32>"),
        ("%a: tensor<2x3x4xf32>", "ge.reshape %a {shape = [-1, 4]}", "tensor<6x4xf32>"),
        ("%a: tensor<2x3x4xf32>", "ge.reshape %a {shape = [4, -1, 2]}", "tensor<4x3x2xf32>"),
        ("%a: tensor<?x4xf32>", "ge.reshape %a {shape = [-1, 2]}", "tensor<?x2xf32>"),
        ("%a: tensor<?x4xf32>", "ge.reshape %a {shape = [8, 2]}", "tensor<8x2xf32>"),
        ("%a: tensor<0x4xf32>", "ge.reshape %a {shape = [-1, 4]}", "tensor<0x4xf32>"),
        ("%a: tensor<2x3xf32>", "ge.reshape %a {shape = [6]}", "tensor<6xf32>"),
        ("%a: tensor<2x3xf32>", "ge.concat %a, %a, %a {axis = 0}", "tensor<6x3xf32>"),
        ("%a: tensor<2x3xf32>, %b: tensor<2x5xf32>", "ge.concat %a, %b {axis = -1}", "tensor<2x8xf32>"),
        ("%a: tensor<2x?xf32>, %b: tensor<2x5xf32>", "ge.concat %a, %b {axis = 1}", "tensor<2x?xf32>"),
        ("%a: tensor<?x3xf32>, %b: tensor<2x3xf32>", "ge.concat %a, %b {axis = 1}", "tensor<?x6xf32>"),
        ("%a: tensor<2x10xf32>", "ge.slice %a {axes = [1], starts = [2], ends = [7]}", "tensor<2x5xf32>"),
        ("%a: tensor<2x10xf32>", "ge.slice %a {axes = [-1, 0], starts = [-3, 1], ends = [100, 2]}", "tensor<1x3xf32>"),
        ("%a: tensor<2x10xf32>", "ge.slice %a {axes = [1], starts = [8], ends = [3]}", "tensor<2x0xf32>"),
        ("%a: tensor<?x10xf32>", "ge.slice %a {axes = [0], starts = [0], ends = [1]}", "tensor<?x10xf32>"),
        ("%a: tensor<4x4xf16>", 'ge.trans_data %a {dst_format = "NZ"}', "tensor<4x4xf16, NZ>"),
        ("%a: tensor<4x4xf16, NZ>", 'ge.trans_data %a {dst_format = "ND"}', "tensor<4x4xf16>"),
        # attention: grouped-query heads, BSND, masks, `?`
        ("%q: tensor<2x8x16x64xf16>, %k: tensor<2x2x32x64xf16>, %v: tensor<2x2x32x48xf16>",
         "ge.flash_attention %q, %k, %v {causal = true}", "tensor<2x8x16x48xf16>"),
        ("%q: tensor<2x16x8x64xbf16>, %k: tensor<2x32x2x64xbf16>, %v: tensor<2x32x2x64xbf16>",
         'ge.flash_attention %q, %k, %v {layout = "BSND", scale = 0.125}', "tensor<2x16x8x64xbf16>"),
        ("%q: tensor<1x4x?x64xf16>, %k: tensor<1x1x?x64xf16>, %v: tensor<1x1x?x64xf16>, %m: tensor<?x?xi1>",
         "ge.flash_attention %q, %k, %v, %m", "tensor<1x4x?x64xf16>"),
        ("%q: tensor<?x?x?x?xf32>, %k: tensor<2x2x5x8xf32>, %v: tensor<2x2x5x8xf32>, %m: tensor<1x1x3x5xf32>",
         "ge.flash_attention %q, %k, %v, %m", "tensor<?x?x?x8xf32>"),
    ],
)
def test_infer_shapes(args, line, expected):
    assert infer(args, line) == [expected]


def test_infer_shapes_split():
    assert infer("%a: tensor<2x6xf32>", "ge.split %a {axis = 1, sizes = [1, 2, 3]}", 3) == [
        "tensor<2x1xf32>", "tensor<2x2xf32>", "tensor<2x3xf32>"]
    assert infer("%a: tensor<?x?xf16>", "ge.split %a {axis = -1, sizes = [4, 4]}", 2) == [
        "tensor<?x4xf16>", "tensor<?x4xf16>"]


def test_infer_shapes_const_keeps_its_type():
    assert infer("%a: tensor<2xf32>", "ge.const dense<[1, 2]> : tensor<2xi32>") == ["tensor<2xi32>"]


def test_infer_shapes_propagates_question_marks_through_a_chain():
    text = graph_text(
        "  %kt = ge.transpose %k {perm = [0, 1, 3, 2]}\n"
        "  %s = ge.matmul %q, %kt\n"
        "  %c = ge.const dense<0.125> : tensor<f16>\n"
        "  %ss = ge.mul %s, %c\n"
        "  %p = ge.softmax %ss\n"
        "  %o = ge.matmul %p, %v\n"
        "  %r = ge.reshape %o {shape = [-1, 64]}\n"
        "  %n = ge.reduce_sum %r {axes = [0], keepdims = true}\n"
        "  ge.return %n",
        "%q: tensor<1x8x?x64xf16>, %k: tensor<1x8x?x64xf16>, %v: tensor<1x8x?x64xf16>",
        "tensor<1x64xf16>",
    )
    m = parse(text)
    ok = PassManager([PASSES["infer-shapes"]()]).run(m, PassContext())
    assert ok
    printed = print_module(m)
    expected_types = {
        "%kt": "tensor<1x8x64x?xf16>",
        "%s": "tensor<1x8x?x?xf16>",
        "%ss": "tensor<1x8x?x?xf16>",
        "%p": "tensor<1x8x?x?xf16>",
        "%o": "tensor<1x8x?x64xf16>",
        "%r": "tensor<?x64xf16>",
        "%n": "tensor<1x64xf16>",
    }
    for name, t in expected_types.items():
        assert f"  {name} = " in printed
        line = next(ln for ln in printed.splitlines() if ln.startswith(f"  {name} = "))
        assert line.endswith(f" : {t}"), line
    # after infer-shapes every op but the return carries its types, and printing is a fixed point
    for ln in printed.splitlines()[1:-2]:
        assert " : tensor<" in ln
    assert print_module(parse(printed)) == printed


def test_infer_shapes_reports_errors_through_the_pass_manager():
    text = graph_text("  %y = ge.matmul %a, %b\n  ge.return %y", "%a: tensor<4x8xf32>, %b: tensor<9x3xf32>",
                      "tensor<4x3xf32>")
    got = []
    ok = PassManager([PASSES["infer-shapes"]()]).run(parse(text, "p.geir"), PassContext(
        diagnostics=DiagnosticEngine(got.append)))
    assert not ok
    assert [(d.severity, d.message, d.loc.line, d.loc.col) for d in got][0] == (
        "error", "matmul contraction dims differ: 8 vs 9", 2, 3)


def test_inferred_types_agree_with_parse_type():
    # the printed types read back as the same TensorType
    for t in ("tensor<2x?xbf16>", "tensor<f32>", "tensor<1x3x1xf32>", "tensor<4x4xf16, NZ>"):
        assert str(parse_type(t)) == t


@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "rsqrt", "neg", "abs", "tanh", "sigmoid", "relu", "silu",
                                  "erf", "gelu"])
@pytest.mark.parametrize("t", ["tensor<?x3xf16>", "tensor<bf16>", "tensor<2x?x?xf32, NZ>"])
def test_infer_shapes_unary(name, t):
    # the shape (with its `?`) and dtype pass through; the storage format is the layout pass's choice
    assert infer(f"%a: {t}", f"ge.{name} %a") == [t.replace(", NZ", "")]


# --- a launch is checked as the kernel op it runs --------------------------------------------------------

SINGLE_BUFFER = (Path(__file__).resolve().parent.parent / "examples" / "doctor" / "single_buffer.geir").read_text()
LAUNCH = SINGLE_BUFFER.splitlines()[18]


@pytest.mark.parametrize("old, new, message", [
    ("} : tensor<1x24x2048x128xf16>", "} : tensor<1x24x0x128xf16>",
     "result type tensor<1x24x0x128xf16> contradicts the inferred type tensor<1x24x2048x128xf16>"),
    ("causal = false", "causal = 3",
     "rt.launch of ge.flash_attention: attribute 'causal' must be true or false, not the integer 3"),
    ("layout = \"BNSD\"", "layout = \"BNSD\", window = 4",
     "rt.launch of ge.flash_attention: unknown attribute 'window' in attrs"),
    ("%q.dev, %k.dev, %v.dev", "%q.dev, %k.dev",
     "rt.launch of ge.flash_attention: ge.flash_attention expects 3 or 5 operands (q, k, v, mask, pse), got 2"),
    ("kernel = \"ge.flash_attention\"", "kernel = \"ge.neg\"", "rt.launch of ge.neg: ge.neg expects 1 operand"),
])
def test_a_launch_that_contradicts_its_kernel_op_is_an_error_at_it(old, new, message):
    assert old in LAUNCH
    with pytest.raises(DiagnosticError) as e:
        verify_module(parse(SINGLE_BUFFER.replace(LAUNCH, LAUNCH.replace(old, new)), "p.geir"))
    d = e.value.diagnostics[0]
    assert d.message.startswith(message) and (d.loc.line, d.loc.col) == (19, 3)


@pytest.mark.parametrize("old, new, line", [
    # a copy's two sides are one tensor: the Runtime writes the host array into a view of the declared type
    ("%k: tensor<1x24x2048x128xf16>", "%k: tensor<1x12x2048x128xf16>", 12),
    ("%0 = rt.d2h %o {stream = 0} : tensor<1x24x2048x128xf16>", "%0 = rt.d2h %o {stream = 0} : tensor<1x24x2048x128xf32>", 22),
])
def test_a_copy_that_changes_its_tensor_is_an_error_at_it(old, new, line):
    assert old in SINGLE_BUFFER
    text = SINGLE_BUFFER.replace(old, new)
    if "f32" in new:
        text = text.replace("-> tensor<1x24x2048x128xf16> attributes", "-> tensor<1x24x2048x128xf32> attributes")
    with pytest.raises(DiagnosticError) as e:
        verify_module(parse(text, "p.geir"))
    d = e.value.diagnostics[0]
    assert "contradicts the inferred type" in d.message and d.loc.line == line, d
