"""The parser: every attribute kind, source locations, and each diagnostic's wording and position."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest

from geir import DiagnosticError, parse
from geir.attributes import DenseAttr, DenseResourceAttr
from geir.ir import Module
from geir.types import DType, TensorType

from helpers import graph_text

HEAD = "ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {\n"


def diag(text: str | bytes, file: str = "f.geir"):
    """(message, line, col, notes) of the single error parsing `text` raises."""
    with pytest.raises(DiagnosticError) as e:
        parse(text, file)
    (d,) = e.value.diagnostics
    assert d.severity == "error"
    assert d.loc.file == file
    return d.message, d.loc.line, d.loc.col, [(n.message, n.loc.line, n.loc.col) for n in d.notes]


def col_of(line: str, needle: str, nth: int = 0) -> int:
    """1-based column of the nth occurrence of needle in line."""
    i = -1
    for _ in range(nth + 1):
        i = line.index(needle, i + 1)
    return i + 1


def only_op(text: str, index: int = 0):
    return parse(text).graphs[0].ops[index]


# --- attributes ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("42", 42),
        ("-7", -7),
        ("+5", 5),
        ("9223372036854775807", 2**63 - 1),
        ("-9223372036854775808", -2**63),
        ("0.125", 0.125),
        ("1e-5", 1e-5),
        ("1E5", 1e5),
        ("-2.5e+3", -2500.0),
        ("1.", 1.0),
        ("inf", math.inf),
        ("-inf", -math.inf),
        ("true", True),
        ("false", False),
        ('"BNSD"', "BNSD"),
        ('""', ""),
        ('"tab\\there \\"q\\" \\u00e9"', 'tab\there "q" \u00e9'),
        ('"caf\u00e9 \u4e2d"', "caf\u00e9 \u4e2d"),
        ("f16", DType.f16),
        ("bf16", DType.bf16),
        ("f32", DType.f32),
        ("i8", DType.i8),
        ("i32", DType.i32),
        ("i64", DType.i64),
        ("i1", DType.i1),
        ("[]", []),
        ("[0, 1, 3, 2]", [0, 1, 3, 2]),
        ("[[1], [2, [3.5, true]], \"s\"]", [[1], [2, [3.5, True]], "s"]),
        ("{}", {}),
        ("{offset = 0, size = 512}", {"offset": 0, "size": 512}),
        ('{outer = {inner = [1, 2], "quoted key" = f16}}', {"outer": {"inner": [1, 2], "quoted key": DType.f16}}),
    ],
)
def test_attribute_values(text, expected):
    op = only_op(graph_text(f"  %y = ge.softmax %x {{a = {text}}}\n  ge.return %y"))
    got = op.attributes["a"]
    assert got == expected
    assert type(got) is type(expected) or (isinstance(expected, list) and isinstance(got, list)) or (
        isinstance(expected, dict) and isinstance(got, dict)
    )


def test_bool_is_not_int_and_float_is_not_int():
    op = only_op(graph_text("  %y = ge.softmax %x {a = true, b = 1, c = 1.0}\n  ge.return %y"))
    assert op.attributes["a"] is True
    assert type(op.attributes["b"]) is int
    assert type(op.attributes["c"]) is float


def test_nan_attribute():
    op = only_op(graph_text("  %y = ge.softmax %x {a = nan, b = -nan}\n  ge.return %y"))
    assert math.isnan(op.attributes["a"]) and math.isnan(op.attributes["b"])


def test_keywords_may_be_keys():
    op = only_op(graph_text('  %y = ge.softmax %x {inf = 1, nan = 2, true = 3, f16 = 4, "a b" = 5}\n  ge.return %y'))
    assert op.attributes == {"inf": 1, "nan": 2, "true": 3, "f16": 4, "a b": 5}


def test_dense_attribute_values():
    text = graph_text(
        "  %a = ge.const dense<0.125> : tensor<f16>\n"
        "  %b = ge.const dense<[[1.0, 2.0], [3.0, 4.0]]> : tensor<2x2xf32>\n"
        "  %c = ge.const dense<[true, false]> : tensor<2xi1>\n"
        "  %d = ge.const dense<[1, -2, 3]> : tensor<3xi32>\n"
        '  %e = ge.const dense_resource<"wq"> : tensor<4xf32>\n'
        "  %f = ge.const dense<[]> : tensor<0xf32>\n"
        "  %g = ge.const dense<-inf> : tensor<2xf32>\n"
        "  ge.return %x"
    )
    ops = parse(text).graphs[0].ops
    a, b, c, d, e, f, g = (op.attributes["value"] for op in ops[:7])
    assert isinstance(a, DenseAttr) and a.is_splat and a.values.dtype == np.float64 and a.values[()] == 0.125
    assert b.values.shape == (2, 2) and b.values.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert c.values.dtype == np.bool_ and c.values.tolist() == [True, False]
    assert d.values.dtype.kind == "i" and d.values.tolist() == [1, -2, 3]
    assert e == DenseResourceAttr("wq")
    assert f.values.shape == (0,)
    assert g.is_splat and g.values[()] == -math.inf
    assert a.to_array(TensorType((), DType.f16)).dtype == np.float16
    assert g.to_array(TensorType((2,), DType.f32)).tolist() == [-math.inf, -math.inf]


def test_dense_inside_an_attribute_dictionary():
    op = only_op(graph_text('  %y = ge.softmax %x {w = dense<[1.5, 2.5]>, r = dense_resource<"k">}\n  ge.return %y'))
    assert op.attributes["w"] == DenseAttr(np.array([1.5, 2.5]))
    assert op.attributes["r"] == DenseResourceAttr("k")


def test_graph_attributes_and_signatures():
    text = (
        "ge.graph @main(%a: tensor<2xf32>, %b: tensor<?x3xbf16, NZ>) -> (tensor<2xf32>, tensor<?x3xbf16, NZ>) "
        "attributes {arena_size = 1024, note = \"x\"} {\n"
        "  ge.return %a, %b\n}\n"
        "ge.graph @other() -> () {\n  ge.return\n}\n"
    )
    m = parse(text)
    g, h = m.graphs
    assert g.name == "main" and h.name == "other"
    assert [a.type for a in g.args] == [TensorType((2,), DType.f32), TensorType((None, 3), DType.bf16, "NZ")]
    assert g.result_types == [TensorType((2,), DType.f32), TensorType((None, 3), DType.bf16, "NZ")]
    assert g.attributes == {"arena_size": 1024, "note": "x"}
    assert h.result_types == [] and h.args == []
    assert m.graph() is g and m.graph("other") is h


def test_module_graph_selection():
    one = parse("ge.graph @only() -> () {\n  ge.return\n}\n")
    assert one.graph().name == "only"
    two = parse("ge.graph @a() -> () {\n  ge.return\n}\nge.graph @b() -> () {\n  ge.return\n}\n")
    with pytest.raises(KeyError):
        two.graph()
    assert two.graph("b").name == "b"


def test_value_names_and_use_lists():
    text = graph_text(
        "  %0 = ge.neg %x\n  %a.b-c$_1 = ge.add %0, %0\n  %t = ge.mul %a.b-c$_1, %x\n  ge.return %t"
    )
    g = parse(text).graphs[0]
    neg, add, mul, ret = g.ops
    assert [r.name for r in neg.results] == ["0"]
    assert add.operands == [neg.result, neg.result]
    assert neg.result.uses == [add, add]
    assert neg.result.users() == [add]
    assert g.args[0].users() == [neg, mul]
    assert ret.operands == [mul.result]
    assert add.result.name == "a.b-c$_1"
    assert mul.result.owner is mul and mul.result.index == 0


def test_bytes_input_and_comments_and_free_whitespace():
    text = (
        b"// leading comment\n"
        b"ge.graph   @main ( %x :tensor<4xf32> )->tensor<4xf32>{ // trailing\n"
        b"\t%y=ge.neg %x:tensor<4xf32>\r\n"
        b"  ge.return\n   %y }"
    )
    g = parse(text).graphs[0]
    assert [op.name for op in g.ops] == ["ge.neg", "ge.return"]
    assert g.ops[0].result.type == TensorType((4,), DType.f32)


def test_result_types_are_optional():
    g = parse(graph_text("  %y = ge.neg %x\n  ge.return %y")).graphs[0]
    assert g.ops[0].result.type is None


# --- locations -----------------------------------------------------------------------------

def test_locations_of_ops_values_and_attributes():
    lines = [
        "ge.graph @main(%x: tensor<4x6xf32>, %w: tensor<6xf32>) -> (tensor<4x2xf32>, tensor<4x4xf32>) {",
        "  // a comment line",
        "  %c = ge.const dense<1.0> : tensor<f32>",
        "    %lo, %hi = ge.split %x {axis = 1, sizes = [2, 4]}",
        "  %s = ge.softmax %hi {axis = -1}",
        "  ge.return %lo, %s",
        "}",
    ]
    m = parse("\n".join(lines) + "\n", "loc.geir")
    g = m.graphs[0]
    assert (g.loc.file, g.loc.line, g.loc.col) == ("loc.geir", 1, col_of(lines[0], "@main"))
    x, w = g.args
    assert (x.loc.line, x.loc.col) == (1, col_of(lines[0], "%x"))
    assert (w.loc.line, w.loc.col) == (1, col_of(lines[0], "%w"))
    const, split, softmax, ret = g.ops
    assert (const.loc.line, const.loc.col) == (3, col_of(lines[2], "%c"))
    assert (const.attr_loc("value").line, const.attr_loc("value").col) == (3, col_of(lines[2], "dense<"))
    assert (split.loc.line, split.loc.col) == (4, col_of(lines[3], "%lo"))
    lo, hi = split.results
    assert (lo.loc.line, lo.loc.col) == (4, col_of(lines[3], "%lo"))
    assert (hi.loc.line, hi.loc.col) == (4, col_of(lines[3], "%hi"))
    assert (split.attr_loc("axis").line, split.attr_loc("axis").col) == (4, col_of(lines[3], "axis"))
    assert (split.attr_loc("sizes").line, split.attr_loc("sizes").col) == (4, col_of(lines[3], "sizes"))
    assert (softmax.attr_loc("axis").line, softmax.attr_loc("axis").col) == (5, col_of(lines[4], "axis"))
    # an op without results is located at its name
    assert (ret.loc.line, ret.loc.col) == (6, col_of(lines[5], "ge.return"))
    # an attribute not written falls back to the op's location
    assert softmax.attr_loc("nothing") == softmax.loc


def test_line_offset_shifts_lines():
    text = graph_text("  %y = ge.neg %z\n  ge.return %y")
    _, line, col, _ = diag(text)
    assert (line, col) == (2, 15)
    with pytest.raises(DiagnosticError) as e:
        parse(text, "f.geir", line_offset=10)
    assert (e.value.diagnostics[0].loc.line, e.value.diagnostics[0].loc.col) == (12, 15)
    g = parse(graph_text("  ge.return %x"), "f.geir", line_offset=5).graphs[0]
    assert g.loc.line == 6 and g.ops[0].loc.line == 7


# --- diagnostics ---------------------------------------------------------------------------

def test_undefined_value_at_its_use():
    line = "  %y = ge.add %x, %nope"
    msg, ln, col, notes = diag(HEAD + line + "\n  ge.return %y\n}")
    assert msg == "use of undefined value '%nope'"
    assert (ln, col) == (2, col_of(line, "%nope")) and notes == []


def test_value_of_another_graph_is_undefined():
    text = HEAD + "  %y = ge.neg %x\n  ge.return %y\n}\nge.graph @g() -> tensor<4xf32> {\n  ge.return %y\n}\n"
    msg, ln, col, _ = diag(text)
    assert msg == "use of undefined value '%y'" and (ln, col) == (6, 13)


def test_use_before_definition_is_undefined():
    lines = ["  %a = ge.neg %b", "  %b = ge.neg %x", "  ge.return %a"]
    msg, ln, col, _ = diag(HEAD + "\n".join(lines) + "\n}")
    assert msg == "use of undefined value '%b'" and (ln, col) == (2, col_of(lines[0], "%b"))


def test_redefinition_of_a_result_with_note():
    lines = ["  %y = ge.neg %x", "  %z = ge.neg %y", "  %y = ge.abs %x", "  ge.return %y"]
    msg, ln, col, notes = diag(HEAD + "\n".join(lines) + "\n}")
    assert msg == "redefinition of value '%y'"
    assert (ln, col) == (4, 3)
    assert notes == [("previously defined here", 2, 3)]


def test_redefinition_of_an_argument_with_note():
    line = "ge.graph @main(%x: tensor<4xf32>, %x: tensor<4xf32>) -> () {"
    msg, ln, col, notes = diag(line + "\n  ge.return\n}")
    assert msg == "redefinition of value '%x'"
    assert (ln, col) == (1, col_of(line, "%x", 1))
    assert notes == [("previously defined here", 1, col_of(line, "%x"))]


def test_redefinition_of_an_argument_by_a_result():
    msg, ln, col, notes = diag(HEAD + "  %x = ge.neg %x\n  ge.return %x\n}")
    assert msg == "redefinition of value '%x'" and (ln, col) == (2, 3)
    assert notes == [("previously defined here", 1, 16)]


def test_redefinition_within_one_op():
    line = "  %y, %y = ge.split %x {axis = 0, sizes = [2, 2]}"
    msg, ln, col, notes = diag(HEAD + line + "\n  ge.return %y\n}")
    assert msg == "redefinition of value '%y'"
    assert (ln, col) == (2, col_of(line, "%y", 1))
    assert notes == [("previously defined here", 2, 3)]


def test_redefinition_of_a_graph_with_note():
    text = "ge.graph @g() -> () {\n  ge.return\n}\n\nge.graph @g() -> () {\n  ge.return\n}\n"
    msg, ln, col, notes = diag(text)
    assert msg == "redefinition of graph '@g'"
    assert (ln, col) == (5, 10) and notes == [("previously defined here", 1, 10)]


def test_same_value_name_in_two_graphs_is_fine():
    text = "ge.graph @a(%x: tensor<f32>) -> tensor<f32> {\n  ge.return %x\n}\n" \
           "ge.graph @b(%x: tensor<f32>) -> tensor<f32> {\n  ge.return %x\n}\n"
    assert [g.name for g in parse(text).graphs] == ["a", "b"]


@pytest.mark.parametrize(
    "name, suggestion",
    [
        ("ge.softmx", "ge.softmax"),
        ("ge.addd", "ge.add"),
        ("ge.matmull", "ge.matmul"),
        ("ge.flash_atention", "ge.flash_attention"),
    ],
)
def test_unknown_op_with_suggestion(name, suggestion):
    line = f"  %y = {name} %x"
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %y\n}")
    assert msg == f"unknown op '{name}'; did you mean '{suggestion}'?"
    assert (ln, col) == (2, col_of(line, name))


def test_unknown_op_without_a_close_match():
    msg, ln, col, _ = diag(HEAD + "  %y = zz.qqqqqqqq %x\n  ge.return %y\n}")
    assert msg == "unknown op 'zz.qqqqqqqq'" and (ln, col) == (2, 8)


def test_unknown_dtype_in_a_type():
    line = "ge.graph @main(%x: tensor<4x?xf33>) -> tensor<4xf32> {"
    msg, ln, col, _ = diag(line + "\n  ge.return %x\n}")
    assert msg.startswith("unknown dtype 'f33'")
    assert (ln, col) == (1, col_of(line, "f33"))


def test_unknown_dtype_in_a_result_type():
    line = "  %y = ge.neg %x : tensor<4xfp32>"
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %y\n}")
    assert msg.startswith("unknown dtype 'fp32'") and (ln, col) == (2, col_of(line, "fp32"))


@pytest.mark.parametrize("word", ["f33", "bf17", "i128", "f63"])
def test_unknown_dtype_in_an_attribute(word):
    line = f"  %y = ge.cast %x {{to = {word}}}"
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %y\n}")
    assert msg == f"unknown dtype '{word}' (expected one of f16, bf16, f32, f64, i8, i32, i64, i1)"
    assert (ln, col) == (2, col_of(line, word))


def test_bad_dimension_and_format_locations():
    line = "ge.graph @main(%x: tensor<4xqx8xf32>) -> tensor<4xf32> {"
    msg, ln, col, _ = diag(line + "\n  ge.return %x\n}")
    assert "bad dimension 'q'" in msg and (ln, col) == (1, col_of(line, "q"))
    line = "ge.graph @main(%x: tensor<4xf32, XY>) -> tensor<4xf32> {"
    msg, ln, col, _ = diag(line + "\n  ge.return %x\n}")
    assert "unknown storage format 'XY'" in msg and (ln, col) == (1, col_of(line, "XY"))


def test_unknown_bare_word_value():
    line = "  %y = ge.softmax %x {a = infinity}"
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %y\n}")
    assert msg.startswith("unknown attribute value 'infinity'") and (ln, col) == (2, col_of(line, "infinity"))


def test_lexical_error():
    line = "  %y = ge.neg %x #"
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %y\n}")
    assert msg.startswith("unexpected character '#'")
    assert (ln, col) == (2, col_of(line, "#"))


def test_lexical_error_on_a_non_ascii_character_counts_characters():
    line = "  %y = ge.neg %x // caf\u00e9\n  %z = ge.neg %y \u00a7"
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %y\n}")
    assert msg.startswith("unexpected character '\u00a7'") and (ln, col) == (3, len("  %z = ge.neg %y ") + 1)


TERMINAL_NAME = re.compile(r"\b(?:[A-Z][A-Z0-9]*_[A-Z0-9_]+|LSQB|RSQB|LBRACE|RBRACE|COMMA|COLON|EQUAL|LPAR|RPAR|MORETHAN)\b|\$END")


@pytest.mark.parametrize(
    "line, found, expected_words",
    [
        ("  %y = ge.add %x, %x tensor<4xf32>", "tensor", ["','", "':'", "'{'"]),
        ("  %y = ge.add %x, %x {a 1}", "1", ["'='"]),
        ("  %y = ge.add %x, %x {a = [1, 2}", "}", ["','", "']'"]),
        ("  %y = ge.add %x, %x {a = }", "}", ["a number", "a string", "'['"]),
        ("  %y = ge.add %x, %x : 4", None, ["a type like tensor<4xf32>"]),
        ("  %y = = ge.add %x", "=", ["an op name like ge.add"]),
        ("  %y ge.add %x", "ge.add", ["'='"]),
    ],
)
def test_syntax_errors_say_what_was_expected_in_words(line, found, expected_words):
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %y\n}")
    assert not TERMINAL_NAME.search(msg), msg
    assert "expected" in msg
    for w in expected_words:
        assert w in msg, (w, msg)
    assert ln == 2
    if found is not None:
        assert f"found '{found}'" in msg or f"unexpected character '{found}'" in msg
        start = line.index(found, line.index("ge.") if found != "=" else line.index("=") + 1)
        assert col == start + 1


def test_syntax_error_in_the_graph_head():
    line = "ge.graph main() -> () {"
    msg, ln, col, _ = diag(line + "\n  ge.return\n}")
    assert msg == "expected a graph name like @main, found 'main'" and (ln, col) == (1, 10)
    line = "ge.graph @main(%x: tensor<4xf32>) {"
    msg, ln, col, _ = diag(line + "\n  ge.return\n}")
    assert msg == "expected '->', found '{'" and (ln, col) == (1, col_of(line, "{"))


def test_stray_closing_brace():
    msg, ln, col, _ = diag(HEAD + "  ge.return %x\n} }")
    assert msg == "expected a graph (ge.graph or rt.program) or the end of the input, found '}'" and (ln, col) == (3, 3)


def test_unexpected_end_of_input():
    text = HEAD + "  %y = ge.neg %x\n  ge.return %y\n"
    msg, ln, col, _ = diag(text)
    assert msg.startswith("unexpected end of input; expected ")
    assert "'}'" in msg and not TERMINAL_NAME.search(msg)
    assert ln == 3 and col == len("  ge.return %y") + 1


@pytest.mark.parametrize("text", ["", "   \n\n", "// only a comment\n"])
def test_empty_input(text):
    msg, ln, col, _ = diag(text)
    assert msg.startswith("expected a graph") and (ln, col) == (1, 1)


def test_invalid_utf8_at_the_offending_byte():
    data = HEAD.encode() + b"  // ok\n  %y = ge.neg %x // bad \xff here\n  ge.return %y\n}"
    msg, ln, col, _ = diag(data)
    assert msg == "input is not valid UTF-8 (byte 0xff)"
    assert (ln, col) == (3, len("  %y = ge.neg %x // bad ") + 1)


def test_invalid_utf8_column_counts_characters_before_it():
    # the column is in characters, like every other column, so the caret lines up under the bad byte
    data = HEAD.encode() + "  // caf\u00e9 ".encode() + b"\xc3(\n  ge.return %x\n}"
    msg, ln, col, _ = diag(data)
    assert msg == "input is not valid UTF-8 (byte 0xc3)"
    assert (ln, col) == (2, len("  // caf\u00e9 ") + 1)


def test_truncated_utf8_sequence_at_end_of_file():
    data = HEAD.encode() + b"  ge.return %x\n}\n// \xe2\x82"
    msg, ln, col, _ = diag(data)
    assert msg == "input is not valid UTF-8 (byte 0xe2)" and (ln, col) == (4, 4)


def test_nul_byte():
    line = "  %y = ge.neg\0 %x"
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %y\n}")
    assert msg == "unexpected NUL byte" and (ln, col) == (2, col_of(line, "\0"))
    msg, ln, col, _ = diag((HEAD + "  ge.return %x\n}\n\0").encode())
    assert msg == "unexpected NUL byte" and (ln, col) == (4, 1)


def test_lone_surrogate_escape_is_an_error():
    # it could never be written out as UTF-8 again
    line = '  %y = ge.softmax %x {a = "\\ud800"}'
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %y\n}")
    assert "surrogate" in msg and (ln, col) == (2, col_of(line, '"'))
    # a proper pair is fine
    op = only_op(graph_text('  %y = ge.softmax %x {a = "\\ud83d\\ude00"}\n  ge.return %y'))
    assert op.attributes["a"] == "\U0001F600"


@pytest.mark.parametrize(
    "line, message, at",
    [
        ('  %y = ge.softmax %x {a = "\\q"}', "bad escape in string", '"'),
        ("  %y = ge.softmax %x {a = 1, a = 2}", "attribute 'a' is given twice", "a = 2"),
        ("  %y = ge.add %x, %x dense<1.0>", "ge.add does not take a value; only ge.const does", "dense<"),
        ("  %y = ge.const dense<1.0> {value = dense<2.0>} : tensor<4xf32>",
         "the value is given twice: inline and as an attribute", "dense<"),
        ("  %y = ge.const dense<[[1.0, 2.0], [3.0]]> : tensor<4xf32>",
         "dense literal is ragged: its rows have different shapes", "dense<"),
        ("  %y = ge.const dense<[true, 1]> : tensor<4xf32>", "dense literal mixes booleans and numbers", "dense<"),
        ("  %y = ge.const dense<[1, 9223372036854775808]> : tensor<4xf32>",
         "integer literal 9223372036854775808 does not fit in 64 bits "
         "(from -9223372036854775808 to 9223372036854775807)", "9223"),
        ("  %y = ge.const dense<[1, 99999999999999999999]> : tensor<4xf32>",
         "integer literal has 20 digits; at most 19 fit in 64 bits", "9999"),
        ('  %y = ge.const dense<"a"> : tensor<4xf32>',
         "a dense literal holds numbers, true/false, or nested lists of them", "dense<"),
        ("  %y, %z = ge.add %x, %x", "ge.add produces 1 result, but 2 names are bound", "%y"),
        ("  %y = ge.return %x", "ge.return produces no results", "%y"),
        ("  ge.neg %x", "ge.neg produces 1 result; name it, as in `%r = ge.neg ...`", "ge.neg"),
        ("  %y = ge.neg %x : tensor<4xf32>, tensor<4xf32>", "ge.neg has 1 result but 2 types", "tensor"),
    ],
)
def test_parser_checks(line, message, at):
    msg, ln, col, _ = diag(HEAD + line + "\n  ge.return %x\n}")
    assert msg == message
    assert (ln, col) == (2, col_of(line, at))


def test_return_type_contradicting_its_operand():
    line = "  ge.return %x : tensor<4xf16>"
    msg, ln, col, _ = diag(HEAD + line + "\n}")
    assert msg == "return type tensor<4xf16> contradicts the operand's type tensor<4xf32>"
    assert (ln, col) == (2, col_of(line, "tensor"))


def test_return_type_matching_is_accepted():
    g = parse(HEAD + "  ge.return %x : tensor<4xf32>\n}").graphs[0]
    assert g.ops[0].operands == [g.args[0]]


# --- absurd input --------------------------------------------------------------------------

def _timed_diag(text: str):
    t0 = time.perf_counter()
    with pytest.raises(DiagnosticError) as e:
        parse(text)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5, f"took {elapsed:.1f}s"
    (d,) = e.value.diagnostics
    return d


def test_deeply_nested_unclosed_lists():
    prefix = "  %y = ge.softmax %x {a = "
    d = _timed_diag(HEAD + prefix + "[" * 100_000 + "\n  ge.return %y\n}")
    assert d.loc.line in (2, 3)


def test_deeply_nested_closed_lists():
    prefix = "  %y = ge.softmax %x {a = "
    d = _timed_diag(HEAD + prefix + "[" * 100_000 + "1" + "]" * 100_000 + "}\n  ge.return %y\n}")
    assert "nest" in d.message
    assert d.loc.line == 2
    assert (HEAD + prefix + "[" * 100_000).split("\n")[1][d.loc.col - 1] == "["


def test_deeply_nested_dense_literal():
    prefix = "  %c = ge.const dense<"
    d = _timed_diag(HEAD + prefix + "[" * 100_000 + "1.0" + "]" * 100_000 + "> : tensor<1xf32>\n  ge.return %x\n}")
    assert "nest" in d.message and d.loc.line == 2


@pytest.mark.parametrize("depth", [100, 2000, 30_000])
def test_deeply_nested_dictionaries(depth):
    # nested dictionaries must be refused like nested lists, or printing them would overflow the stack
    head = "ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> attributes "
    d = _timed_diag(head + "{a = " * depth + "1" + "}" * depth + " {\n  ge.return %x\n}")
    assert "nest" in d.message and d.loc.line == 1


def test_moderate_nesting_is_accepted():
    nested = "[" * 20 + "1" + "]" * 20
    dicts = "{a = " * 20 + "1" + "}" * 20
    op = only_op(graph_text(f"  %y = ge.softmax %x {{l = {nested}, d = {dicts}}}\n  ge.return %y"))
    v = op.attributes["l"]
    for _ in range(19):
        v = v[0]
    assert v == [1]


def test_parse_result_is_a_module():
    m = parse(graph_text("  ge.return %x"), "name.geir")
    assert isinstance(m, Module) and m.file == "name.geir"
