"""What every test run shares: the repository root never becomes an import path.

The source folders sit at the root under names that are not `geir.*` (kernels/, runtime/, ...), and a
root on sys.path makes them importable as top-level packages: transformers then takes our `kernels/` for
Hugging Face's `kernels` package and every later model test fails. A test or a bench script it loads that
puts the root on sys.path fails here, by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _root_on_path() -> list[str]:
    return [p for p in sys.path if p and Path(p).resolve() == ROOT]


@pytest.fixture(autouse=True)
def _repository_root_stays_off_sys_path():
    before = _root_on_path()
    yield
    added = _root_on_path()
    if len(added) > len(before):
        sys.path[:] = [p for p in sys.path if p not in added or p in before]
        pytest.fail(f"this test put the repository root {ROOT} on sys.path: the source folders become top-level "
                    "packages (kernels/ shadows Hugging Face's `kernels`); import geir.* instead")


@pytest.fixture
def geir_graphs(monkeypatch) -> list:
    """Every GeirGraph torch.compile's geir backend makes during the test, to see which graphs reached the NPU."""
    torch_compile = pytest.importorskip("geir.frontends.torch_compile")
    made = []

    class Recorded(torch_compile.GeirGraph):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(torch_compile, "GeirGraph", Recorded)
    return made
