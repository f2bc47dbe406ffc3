"""Ops real decoder models need that the frontends did not take (issue 28 item 2), each imported the way users
feed it: through torch.export (geir.frontends.torch) and through torch's ONNX dynamo exporter (geir.frontends.onnx),
run on the simulated NPU and compared with torch's own result, computed here (the oracle)."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from geir.frontends.torch import from_module  # noqa: E402
from geir.frontends.torch_builder import to_numpy  # noqa: E402
from geir.ir import Module  # noqa: E402
from geir.session import Session, run_program  # noqa: E402


def _imported(model: torch.nn.Module, args: tuple, path: str, tmp_path):
    if path == "torch":
        module = from_module(model, args)
        return module, module.resources
    pytest.importorskip("onnxscript")
    from geir.frontends.onnx import import_onnx

    out = tmp_path / "model.onnx"
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, dynamo=True).save(str(out))
    return import_onnx(str(out))


def run_on_npu(model: torch.nn.Module, args: tuple, path: str, tmp_path) -> tuple[list[np.ndarray], list[str]]:
    """The model's outputs computed on the simulated NPU, and the ops of its imported graph."""
    module, weights = _imported(model, args, path, tmp_path)
    graph = module.graph()
    ops = [op.name for op in graph.ops]
    session = Session(Module([graph], module.file, weights))
    feed = {a.name: to_numpy(x) for a, x in zip(session.generic.args, args)}
    program = session.program({k: v.shape for k, v in feed.items()})
    return run_program(program, feed, weights).outputs, ops


PATHS = ["torch", "onnx"]


class Strided(torch.nn.Module):
    """GPT-J's interleaved rotary halves: the even and the odd features, x[..., ::2] and x[..., 1::2]."""

    def forward(self, x):
        return x[..., ::2] * 2.0 + x[..., 1::2]


@pytest.mark.parametrize("path", PATHS)
def test_a_strided_slice_takes_every_other_feature(path, tmp_path):
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    outs, ops = run_on_npu(Strided(), (x,), path, tmp_path)
    assert "ge.slice" in ops
    want = x.numpy()[..., 0::2] * 2.0 + x.numpy()[..., 1::2]
    np.testing.assert_allclose(outs[0], want, rtol=1e-6, atol=1e-6)
