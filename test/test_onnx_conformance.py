"""ONNX's own backend node tests through geimport + gerun's path, and fusion of the expanded attention cases.

Every case the importer takes (all its ops and dtypes supported) is one test: imported, printed and
parsed back, compiled with the default pipeline and run on the simulated chip, compared with ONNX's
expected outputs at the case's tolerances (geir.frontends.onnx_conformance). The cases it does not
take must be refused as unsupported, never crash. `bench/onnx_conformance.py` prints the per-op table.
"""

from __future__ import annotations

import pytest

pytest.importorskip("onnx")

from geir.frontends.onnx_conformance import (  # noqa: E402
    fuse_attention,
    fusion_goal,
    node_cases,
    refusal,
    run_case,
    widen_head_dim,
)

# cases known to fail, by name -> why (none at present: pytest's strict xfail flags one that starts passing)
KNOWN_FAILURES: dict[str, str] = {}


def _triage() -> tuple[list, list]:
    """(cases the importer takes, cases it refuses as unsupported with the reason)."""
    taken, refused = [], []
    for case in node_cases():
        why = refusal(case)
        if why is None:
            taken.append(case)
        else:
            refused.append((case, why))
    return taken, refused


TAKEN, REFUSED = _triage()
GOALS = [c for c in node_cases() if fusion_goal(c)]


def _param(case, known: dict[str, str]):
    marks = [pytest.mark.xfail(reason=known[case.name], strict=True)] if case.name in known else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c, KNOWN_FAILURES) for c in TAKEN])
def test_node_case(case):
    result = run_case(case)
    assert result.status == "pass", result.detail


def test_refused_cases_are_unsupported_not_errors():
    # most of ONNX's ops are outside GEIR (conv, pooling, strings, float64 ...); each refusal names why
    assert len(TAKEN) > 600 and len(REFUSED) > 0
    for case, e in REFUSED:
        assert e.reason, case.name
        assert e.node is not None or "graph input" in e.reason or "graph output" in e.reason, (case.name, str(e))


def test_all_attention_cases_are_taken():
    attention = [c for c in node_cases() if c.name.startswith("test_attention")]
    refused = {c.name: e for c, e in REFUSED if c.name.startswith("test_attention")}
    # none refused: the cases with softmax_precision = double compute in GEIR's f64 (placed on the AI CPU)
    assert not refused, sorted(refused)
    assert "test_attention_local_window_gqa_rank4_mask" in {c.name for c in TAKEN}
    assert len(attention) > 150


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in GOALS])
def test_expanded_attention_fuses_into_one_flash_attention(case):
    # ONNX's own spelling, as given (head dims of 8 or less are padded to the cube's fractal by the
    # tiling): exactly one ge.flash_attention, and the fused program agrees with ONNX's reference
    count, misses = fuse_attention(case)
    assert count == 1, misses
    result = run_case(case)
    assert result.status == "pass", result.detail


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in GOALS[::8]])
def test_expanded_attention_still_fuses_at_head_dim_16(case):
    # the same graphs widened to a head dim on the fractal: the spelling, not the size, decides
    wide = widen_head_dim(case)
    count, misses = fuse_attention(wide)
    assert count == 1, misses
    assert run_case(wide).status == "pass"
