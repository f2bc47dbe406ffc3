"""What every test run shares: the repository root never becomes an import path.

The source folders sit at the root under names that are not `geir.*` (kernels/, runtime/, ...), and a
root on sys.path makes them importable as top-level packages: transformers then takes our `kernels/` for
Hugging Face's `kernels` package and every later model test fails. A test or a bench script it loads that
puts the root on sys.path fails here, by name.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
# the names of BLAS_THREADS this suite set (workers inherit the controller's environment, and this with it)
PINNED = "GEIR_SUITE_PINNED_THREADS"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, one BLAS and OpenMP thread per process (workers and the tools they start inherit it).

    The workers already fill the cores; a BLAS call that also splits across them oversubscribes the machine and
    OpenBLAS's threads spin waiting for each other (two processes of 512 x 64 x 1024 attention tiles at once
    measured 3.5x slower with 2 threads each than with 1 on a 2-core machine). A value set in the environment
    wins. The thread count can move a float's last bits (a matmul's blocking follows it), so the figures' commands
    run without the pin, as a user runs them: the fixture below.
    """
    if getattr(config.option, "numprocesses", None) and PINNED not in os.environ:
        pinned = [name for name in BLAS_THREADS if name not in os.environ]
        for name in pinned:
            os.environ[name] = "1"
        os.environ[PINNED] = ",".join(pinned)


@pytest.fixture
def threads_as_a_user_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The BLAS and OpenMP thread counts of the environment the suite was started in (the pin above undone)."""
    for name in filter(None, os.environ.get(PINNED, "").split(",")):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(PINNED, raising=False)


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


@pytest.fixture
def last_hidden():
    """Wraps a Hugging Face base model as the module the tests export: (input_ids, attention_mask) to its last
    hidden state."""
    torch = pytest.importorskip("torch")

    class Hidden(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    return Hidden
