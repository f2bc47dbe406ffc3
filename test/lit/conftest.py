"""Run the lit + FileCheck suite under plain `pytest`: every `.geir` test here is one pytest item.

lit runs once per session, over exactly the files pytest collected, with a JSON report; each item
then passes or fails with lit's own output for its file (the RUN lines as executed, the exit
codes, FileCheck's complaint). `python -m lit` does not work with the PyPI `lit` (it has no
`__main__`), so lit is started as `python -c "import lit.main; lit.main.main()"` with the Python
running pytest, which need not have its bin folder on PATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

LIT_DIR = Path(__file__).resolve().parent
SUITE_NAME = "GEIR"
# folders beside the tests that hold helpers, not tests (lit.cfg.py excludes the same)
EXCLUDED_DIRS = {"Inputs", "__pycache__"}
# lit's result codes: which count as passing, and which as skipped
PASSING = {"PASS", "XFAIL", "FLAKYPASS"}
SKIPPED = {"UNSUPPORTED", "SKIPPED", "EXCLUDED"}

_RESULTS = pytest.StashKey[dict]()


def _is_lit_test(path: Path) -> bool:
    if path.suffix != ".geir":
        return False
    rel = path.resolve().relative_to(LIT_DIR)
    return not any(part in EXCLUDED_DIRS for part in rel.parts[:-1])


def pytest_collect_file(parent: pytest.Collector, file_path: Path):
    if _is_lit_test(file_path):
        return LitFile.from_parent(parent, path=file_path)
    return None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config):
    # lit.cfg.py is lit's, not a test module; Inputs/ holds helper files
    if collection_path.name == "lit.cfg.py" or collection_path.name in EXCLUDED_DIRS:
        return True
    return None


class LitFile(pytest.File):
    """A `.geir` lit test file; it holds one item, the test itself."""

    def collect(self):
        yield LitItem.from_parent(self, name="lit")


class LitItem(pytest.Item):
    """One lit test; its verdict comes from the session's single lit run."""

    def runtest(self) -> None:
        rel = self.path.resolve().relative_to(LIT_DIR).as_posix()
        results = _session_results(self.session) or _run_lit([str(self.path)])
        result = results.get(rel)
        if result is None:
            raise LitFailure(f"lit reported no result for {rel}", results.get("<lit>", ""))
        code = result["code"]
        if code in SKIPPED:
            pytest.skip(f"lit: {code}")
        if code not in PASSING:
            raise LitFailure(f"lit: {code}: {SUITE_NAME} :: {rel}", result.get("output", ""))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, LitFailure):
            head, output = excinfo.value.args
            return f"{head}\n{output}".rstrip()
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"lit: {self.path.relative_to(LIT_DIR).as_posix()}"


class LitFailure(Exception):
    """A lit test that did not pass: a headline and lit's output for it."""


def _session_results(session: pytest.Session) -> dict[str, dict]:
    """Run lit once over every collected lit test (on first use) and return the results by path."""
    stash = session.config.stash
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # under pytest-xdist each worker collects every file but runs only its share: lit runs per file
        return {}
    if _RESULTS not in stash:
        paths = sorted({str(item.path) for item in session.items if isinstance(item, LitItem)})
        stash[_RESULTS] = _run_lit(paths)
    return stash[_RESULTS]


def _run_lit(paths: list[str]) -> dict[str, dict]:
    with tempfile.TemporaryDirectory(prefix="geir-lit-report-") as tmp:
        report = Path(tmp) / "lit.json"
        cmd = [
            sys.executable, "-c", "import sys, lit.main; sys.exit(lit.main.main())",
            "--output", str(report), "--no-progress-bar", "-q", *paths,
        ]
        env = dict(os.environ)
        env.pop("LIT_OPTS", None)  # the report must cover every test, whatever the caller's settings
        done = subprocess.run(cmd, cwd=LIT_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace")
        if not report.exists():
            # lit itself failed (not installed, a broken lit.cfg.py): every item shows why
            return {"<lit>": f"$ {' '.join(cmd)}\n(exit {done.returncode})\n{done.stdout}"}
        data = json.loads(report.read_text())
    prefix = f"{SUITE_NAME} :: "
    results: dict[str, dict] = {"<lit>": done.stdout}
    for test in data.get("tests", []):
        name = test["name"]
        if name.startswith(prefix):
            results[name[len(prefix):]] = test
    return results
