"""A bounded fuzz campaign of the tools (geir.tools.fuzz), and the harness's judge on what it must flag.

The campaign (about a minute) mutates the example and lit programs and small ONNX models and runs
geopt, gerun, geimport, gedoctor and getune on each: none may exit other than 0, 1 or 2, print a traceback
or an internal error, or point a diagnostic outside its input. `bench/fuzz.py` runs long ones.
"""

from __future__ import annotations

import collections

import pytest

from geir.tools import fuzz
from geir.tools.fuzz import Case, campaign, judge, run_case, signature

COUNTS = {"geopt": 4000, "gerun": 400, "geimport": 1500, "gedoctor": 200, "getune": 60}


def test_a_bounded_campaign_finds_nothing():
    outcomes = campaign(0, COUNTS)
    ran = {tool: n for tool, n in COUNTS.items() if tool != "geimport" or fuzz.onnx_models()}
    assert collections.Counter(o.case.tool for o in outcomes) == ran
    failures = [o for o in outcomes if o.problem]
    kinds: dict[str, list] = collections.defaultdict(list)
    for o in failures:
        kinds[signature(o)].append(o)
    report = "\n".join(f"{len(g)} x {kind}\n    {g[0].case.tool} {g[0].case.name} {' '.join(g[0].case.args)}: "
                       f"{g[0].problem}" for kind, g in kinds.items())
    assert not failures, f"{len(failures)} failures, {len(kinds)} distinct:\n{report}"
    # not vacuous: the mutated inputs reach both the tools' successes and their diagnostics
    for tool in ran:
        codes = collections.Counter(o.code for o in outcomes if o.case.tool == tool and not o.slow)
        assert codes[0] and codes[1], (tool, codes)


CASE = Case("geopt", "t.geir", b"ge.graph @main() -> () {\n  ge.return\n}\n")


@pytest.mark.parametrize("code, err, problem", [
    (0, "", None),
    (1, "t.geir:2:3: error: something\n  ge.return\n  ^\n", None),
    (2, "geopt: error: unknown pass 'x'\n", None),
    (1, "other.geir:90:1: error: a diagnostic about another file\n", None),
    (1, "t.geir:4:1: error: just past the last line's end\n", None),
    (3, "", "exit code 3"),
    (None, "", "exit code None"),
    (1, "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: x\n", "a Python traceback"),
    (1, "geopt: error: internal error: KeyError: 'x' (set GEIR_TRACEBACK=1 to see where)\n",
     "an internal error: geopt: error: internal error: KeyError: 'x' (set GEIR_TRACEBACK=1 to see where)"),
    (1, "t.geir:9:1: error: past the end\n", "a diagnostic at 9:1, outside the input (4 lines)"),
    (1, "t.geir:2:40: error: past the line\n", "a diagnostic at 2:40, outside the input (4 lines)"),
    (1, "t.geir:0:0: error: before the start\n", "a diagnostic at 0:0, outside the input (4 lines)"),
])
def test_the_judge_flags_what_breaks_the_contract(code, err, problem):
    assert judge(CASE, code, err) == problem


def test_an_exception_out_of_a_tool_is_a_failure(tmp_path, monkeypatch):
    def explode(argv: list[str]) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(fuzz, "_tool_main", lambda tool: explode)
    outcome = run_case(CASE, tmp_path)
    assert outcome.problem == "raised RuntimeError: boom" and signature(outcome) == "geopt: raised RuntimeError: boom"


def test_a_real_tool_run_is_judged(tmp_path):
    assert run_case(CASE, tmp_path).problem is None
    bad = run_case(Case("geopt", "t.geir", b"ge.graph @main() -> () {\n  ge.retur\n}\n"), tmp_path)
    assert bad.code == 1 and bad.problem is None
