"""Every figure block in the docs holds what its command prints now (bench/doc_figures.py --check): a figure in
README.md, ARCHITECTURE.md or an example's README is generated, never typed, and a change that moves it fails
here until `python bench/doc_figures.py --write` restates it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "bench" / "doc_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL = _tool()
BLOCKS = [b for path in TOOL.doc_files() for b in TOOL.blocks_of(path)]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_the_figure_is_what_its_command_prints(block):
    assert TOOL.same(block, TOOL.render(block)), f"{block.where} is stale: python bench/doc_figures.py --write"


def test_a_changed_figure_is_caught_and_host_noise_is_bounded(tmp_path):
    exact = TOOL.Block(tmp_path / "x.md", 1, 3, "echo", False, None, "a 1.5 us")
    assert TOOL.same(exact, "a 1.5 us") and not TOOL.same(exact, "a 1.6 us")
    noisy = TOOL.Block(tmp_path / "x.md", 1, 3, "echo", False, 0.5, "took 2.0 s, 3 runs")
    assert TOOL.same(noisy, "took 2.9 s, 3 runs") and not TOOL.same(noisy, "took 4.5 s, 3 runs")
    assert not TOOL.same(noisy, "took 2.0 s, 3 runs, slower")  # the words must match
