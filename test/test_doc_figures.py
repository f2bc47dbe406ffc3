"""Every figure block in the docs holds what its command prints now (bench/doc_figures.py --check): a figure in
README.md, ARCHITECTURE.md or an example's README is generated, never typed, and a change that moves it fails
here until `python bench/doc_figures.py --write` restates it."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "bench" / "doc_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL = _tool()
# a figure's command runs as a user runs it: with the machine's BLAS threads, not the suite's one per worker
pytestmark = pytest.mark.usefixtures("threads_as_a_user_has_them")
# read before any fixture runs: the thread variables the suite set in this worker (conftest.py)
SUITE_PINNED = [n for n in os.environ.get("GEIR_SUITE_PINNED_THREADS", "").split(",") if n]
BLOCKS = [b for path in TOOL.doc_files() for b in TOOL.blocks_of(path)]


class _Figure:
    """The check of one figure block (`block`, set by each subclass below)."""

    block = None

    def test_the_figure_is_what_its_command_prints(self):
        block = self.block
        assert TOOL.same(block, TOOL.render(block)), f"{block.where} is stale: python bench/doc_figures.py --write"


# one class per figure: pytest-xdist's `--dist loadscope` (pyproject) sends each class to a worker as a unit, so the
# figures, which share nothing and each run a bench, spread over the workers instead of ending the run on one
for _block in BLOCKS:
    _name = "TestFigure_" + re.sub(r"\W", "_", _block.where)
    globals()[_name] = type(_name, (_Figure,), {"block": _block, "__doc__": f"The figure at {_block.where}."})


def test_a_figure_command_sees_the_thread_counts_the_suite_was_started_with():
    # under xdist the suite pins one BLAS thread per worker; a figure's command must not inherit that pin
    assert not [n for n in SUITE_PINNED if n in os.environ], SUITE_PINNED
    assert "GEIR_SUITE_PINNED_THREADS" not in os.environ


def test_a_changed_figure_is_caught_and_host_noise_is_bounded(tmp_path):
    exact = TOOL.Block(tmp_path / "x.md", 1, 3, "echo", False, None, "a 1.5 us")
    assert TOOL.same(exact, "a 1.5 us") and not TOOL.same(exact, "a 1.6 us")
    noisy = TOOL.Block(tmp_path / "x.md", 1, 3, "echo", False, 0.5, "took 2.0 s, 3 runs")
    assert TOOL.same(noisy, "took 2.9 s, 3 runs") and not TOOL.same(noisy, "took 4.5 s, 3 runs")
    assert not TOOL.same(noisy, "took 2.0 s, 3 runs, slower")  # the words must match
    verdict = TOOL.Block(tmp_path / "x.md", 1, 3, "echo", False, 0.5, "1.1x MISS (<= 1.0x)")
    assert TOOL.same(verdict, "0.9x PASS (<= 1.0x)")  # a verdict on a host time moves with it
    assert not TOOL.same(TOOL.Block(tmp_path / "x.md", 1, 3, "echo", False, None, "PASS"), "MISS")


def test_a_recorded_block_shows_its_record_and_a_foreign_record_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(TOOL, "RECORDS", tmp_path)
    block = TOOL.Block(ROOT / "x.md", 1, 3, "echo slow", True, None, "", recorded=True)
    with pytest.raises(SystemExit, match="no record of `echo slow`"):
        TOOL.render(block)
    # re-running writes the record: the command, the date, the output
    assert TOOL.render(block, rerun_recorded=True).splitlines()[1:4:2] == ["$ echo slow", "slow"]
    assert TOOL.render(block) == TOOL.render(block, rerun_recorded=True)
    block.record.write_text("$ echo other\n# recorded 2026-12-04\nslow\n")
    with pytest.raises(SystemExit, match="is not the record of `echo slow`"):
        TOOL.render(block)
