"""Inputs too large to model or to simulate: a diagnostic at the value, exit 1, never MemoryError or an
overflow (issue: no traceback, no internal error)."""

from __future__ import annotations

import pytest

from geir.diagnostics import DiagnosticError
from geir.parser import parse
from geir.runtime.device import host_memory_problem
from geir.tools.gedoctor import main as gedoctor_main
from geir.tools.geopt import main as geopt_main
from geir.tools.gerun import main as gerun_main
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


@pytest.mark.parametrize("text", [OVERFLOW, _rank(70)])
def test_geopt_and_gerun_report_unmodellable_types(text, tmp_path, capsys):
    src = tmp_path / "t.geir"
    src.write_text(text)
    for tool, argv in ((geopt_main, [str(src), "--passes=plan"]), (gerun_main, [str(src)])):
        assert tool(argv) == 1
        err = capsys.readouterr().err
        assert f"{src}:1:16: error:" in err and "Traceback" not in err and "internal error" not in err
