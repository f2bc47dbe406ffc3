"""A bounded fuzz campaign of the tools (geir.tools.fuzz), and the harness's judge on what it must flag.

The campaign (about a minute) mutates the example and lit programs and small ONNX models and runs
geopt, gerun, geimport, gedoctor and getune on each, and geserve on mutated request traces and model
configs: none may exit other than 0, 1 or 2, print a traceback or an internal error, or point a
diagnostic outside its input. `bench/fuzz.py` runs long ones.
"""

from __future__ import annotations

import collections

import pytest

from geir.tools import fuzz
from geir.tools.fuzz import Case, campaign, judge, run_case, signature

COUNTS = {"geopt": 2000, "gerun": 200, "geimport": 750, "gedoctor": 100, "getune": 30, "geserve": 24}


class _Campaign:
    """The bounded campaign of one tool (`tool`, set by each subclass below): its COUNTS cases, none a failure."""

    tool = ""

    def test_a_bounded_campaign_finds_nothing(self):
        tool = self.tool
        if tool == "geimport" and not fuzz.onnx_models():
            pytest.skip("no onnx: no models to mutate")
        if tool == "geserve":
            pytest.importorskip("torch")
            pytest.importorskip("transformers")
        outcomes = campaign(list(COUNTS).index(tool), {tool: COUNTS[tool]})
        assert collections.Counter(o.case.tool for o in outcomes) == {tool: COUNTS[tool]}
        failures = [o for o in outcomes if o.problem]
        kinds: dict[str, list] = collections.defaultdict(list)
        for o in failures:
            kinds[signature(o)].append(o)
        report = "\n".join(f"{len(g)} x {kind}\n    {g[0].case.tool} {g[0].case.name} {' '.join(g[0].case.args)}: "
                           f"{g[0].problem}" for kind, g in kinds.items())
        assert not failures, f"{len(failures)} failures, {len(kinds)} distinct:\n{report}"
        # not vacuous: the mutated inputs reach both the tools' successes and their diagnostics
        codes = collections.Counter(o.code for o in outcomes if not o.slow)
        assert codes[0] and codes[1], (tool, codes)


# one class per tool: pytest-xdist's `--dist loadscope` (pyproject) sends each class to a worker as a unit, so the
# campaign, a few minutes on a loaded machine, spreads over the workers instead of ending the run on one
for _tool in COUNTS:
    globals()[f"TestCampaign_{_tool}"] = type(f"TestCampaign_{_tool}", (_Campaign,), {
        "tool": _tool, "__doc__": f"The bounded campaign of {_tool}."})


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


# --- the mutation classes of issue 26: each reaches its tool and is judged ---------------------------------

GRAPH = b"ge.graph @main(%x: tensor<4x16xf32>) -> tensor<4x16xf32> {\n  %y = ge.relu %x\n  ge.return %y\n}\n"


@pytest.mark.parametrize("data", fuzz.damaged_repositories())
def test_a_damaged_repository_is_refused_by_getune(tmp_path, data):
    case = Case("getune", "g.geir", GRAPH, ("--db", "{dir}/planted.sqlite"), (("planted.sqlite", data),))
    outcome = run_case(case, tmp_path)
    assert (outcome.code, outcome.problem) == (1, None)


@pytest.mark.parametrize("spec", fuzz.EXTREME_TARGETS)
def test_an_extreme_what_if_chip_is_a_usage_error(tmp_path, spec):
    outcome = run_case(Case("gerun", "g.geir", GRAPH, ("--target", spec)), tmp_path)
    assert (outcome.code, outcome.problem) == (2, None)


def test_target_file_mutations_reach_the_tools(tmp_path):
    import random

    rng = random.Random(0)
    codes = collections.Counter()
    for _ in range(20):
        case = Case("gerun", "g.geir", GRAPH, ("--timing-only", "--target", "{dir}/chip.toml"),
                    (("chip.toml", fuzz.mutate_target(rng)),))
        outcome = run_case(case, tmp_path)
        assert outcome.problem is None, (case.files[0][1], outcome.problem)
        codes[outcome.code] += 1
    assert codes[2] and set(codes) <= {0, 2}  # the edge values are refused; a few stay within range


def test_program_mutations_of_the_new_classes(tmp_path):
    import random

    rng = random.Random(1)
    seen = set()
    for _ in range(400):
        data = fuzz.mutate(GRAPH, rng)
        seen.update(k for k, marker in (("huge", b"1099511627776"), ("deep", b"_d1099")) if marker in data)
    assert seen == {"huge", "deep"}
    (name, program), *_ = fuzz.lowered([("g.geir", GRAPH)])
    assert name == "g.lowered.geir" and program.startswith(b"rt.program @main")


def test_a_poisoned_entry_reaches_the_tile_pass_and_is_refused(tmp_path, capsys):
    from geir.tools.geopt import main as geopt_main

    small = [c for c in fuzz.corpus() if len(c[1]) < 4000]
    ((name, variants),) = fuzz.poisoned_repositories(small, count=1).items()
    src = tmp_path / name
    src.write_bytes(next(d for n, d in small if n.endswith("/" + name)))
    refusals = []
    for db in variants:
        (tmp_path / "planted.sqlite").write_bytes(db)
        code = geopt_main([str(src), f"--passes=fuse,layout,tile{{db={tmp_path}/planted.sqlite}},plan", "--explain",
                           "-o", str(tmp_path / "out.geir")])
        err = capsys.readouterr().err
        assert "internal error" not in err and "Traceback" not in err
        refusals.append(code == 0 and any(why in err for why in (
            "is not one of the kernel's legal tilings", "entry is not a tiling", "is damaged")))
    # every poison of a tiling field or a time is caught by name (one, a field left out, reads as its default)
    assert len(variants) == len(fuzz.POISONS) and sum(refusals) >= len(variants) - 2, refusals
