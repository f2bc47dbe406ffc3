"""Property tests: random valid programs round-trip; random byte mutations never crash the toolchain."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from geir import DiagnosticError, parse, print_module, verify_module
from geir.diagnostics import DiagnosticEngine
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.tools.geopt import main as geopt_main

from helpers import module_sig
from helpers.programs import programs

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _run_passes(module, pipeline: str) -> bool:
    return PassManager(complete_pipeline(parse_pipeline(pipeline))).run(
        module, PassContext(diagnostics=DiagnosticEngine(lambda d: None)))


@settings(max_examples=150, **SETTINGS)
@given(programs())
def test_random_programs_round_trip(text):
    m = parse(text)
    assert verify_module(m)  # the generator only writes valid programs
    printed = print_module(m)
    again = parse(printed)
    assert print_module(again) == printed  # a fixed point
    assert module_sig(again) == module_sig(m)  # and the same program
    # after infer-shapes every op carries its types, and printing is still a fixed point
    assert _run_passes(again, "infer-shapes")
    inferred = print_module(again)
    assert print_module(parse(inferred)) == inferred
    for g in again.graphs:
        for op in g.ops:
            assert all(r.type is not None for r in op.results)


MUTATION_BYTES = [b"\0", b"\xff", b"\xc3", b"\xe2\x82", b"{", b"}", b"[", b"]", b"(", b")", b"<", b">", b"%", b"@",
                  b",", b"=", b":", b"-", b"?", b"x", b"\"", b"\\", b"\n", b"//", b"dense<", b"tensor<", b"->",
                  b"ge.", b"1e999", b"-1", b"0", b"nan", b"\xf0\x9f\x98\x80", b"\\ud800"]


@st.composite
def mutated(draw):
    data = bytearray(draw(programs(max_ops=6)).encode())
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["insert", "delete", "replace", "duplicate", "byte"]))
        pos = draw(st.integers(0, len(data)))
        if kind == "insert":
            data[pos:pos] = draw(st.sampled_from(MUTATION_BYTES))
        elif kind == "byte":
            data[pos:pos] = bytes([draw(st.integers(0, 255))])
        elif kind == "delete":
            data[pos:pos + draw(st.integers(1, 8))] = b""
        elif kind == "replace" and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        else:
            end = min(len(data), pos + draw(st.integers(1, 20)))
            data[pos:pos] = data[pos:end]
    return bytes(data)


def _check_no_crash(data: bytes) -> None:
    try:
        m = parse(data, "m.geir")
    except DiagnosticError as e:
        assert e.diagnostics and all(d.loc.line >= 1 and d.loc.col >= 1 for d in e.diagnostics)
        return
    try:
        verify_module(m)
    except DiagnosticError:
        return
    printed = print_module(m)
    again = parse(printed)
    assert print_module(again) == printed
    _run_passes(again, "canonicalize,cse,dce")


@settings(max_examples=150, **SETTINGS)
@given(mutated())
@example(b"ge.graph @main() -> () {\n  ge.return\n}\n\0")
@example(b"ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {\n  %y = ge.neg %x {a = \"\\ud800\"}\n  ge.return %x\n}")
@example(b"ge.graph @main() -> () attributes " + b"{a = " * 5000 + b"1" + b"}" * 5000 + b" {\n  ge.return\n}")
@example(b"ge.graph @m(%x: tensor<4xf32>) -> tensor<4xf32> {\n  %y = ge.const dense<1e999> : tensor<f16>\n"
         b"  ge.return %x\n}")
def test_mutated_programs_parse_or_diagnose(data):
    _check_no_crash(data)


@settings(max_examples=20, **SETTINGS)
@given(mutated(), st.sampled_from(["", "--passes=infer-shapes", "--passes=canonicalize,cse,dce"]))
def test_geopt_on_mutated_files(data, passes):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "in.geir")
        out_path = os.path.join(d, "out.geir")
        with open(path, "wb") as f:
            f.write(data)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = geopt_main([path, "-o", out_path] + ([passes] if passes else []))
        assert rc in (0, 1)
        assert "Traceback" not in err.getvalue()
        if rc == 0:
            assert err.getvalue() == ""
            text = open(out_path, encoding="utf-8").read()
            assert print_module(parse(text)) == text
        else:
            assert not os.path.exists(out_path)
            assert err.getvalue().startswith(path + ":")
