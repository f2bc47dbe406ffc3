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


class RepeatKV(torch.nn.Module):
    """Grouped-query attention's K/V heads repeated for their query heads (Mistral, Qwen2)."""

    def forward(self, x):
        return torch.repeat_interleave(x, 3, dim=1) + 1.0


class Alibi(torch.nn.Module):
    """Bloom's scores: baddbmm of the ALiBi bias with beta 1 and alpha the softmax scale."""

    def forward(self, bias, q, k):
        return torch.baddbmm(bias, q, k, beta=0.5, alpha=0.25)


class Conv1d(torch.nn.Module):
    """Whisper's front end: 1-D convolutions over time, with padding and a stride."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Conv1d(4, 6, 3, padding=1)
        self.second = torch.nn.Conv1d(6, 6, 3, stride=2, padding=1)

    def forward(self, x):
        return self.second(torch.nn.functional.gelu(self.first(x)))


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("path", PATHS)
def test_repeat_interleave_repeats_each_head(path, tmp_path):
    x = _randn(2, 2, 5, 4)
    outs, _ = run_on_npu(RepeatKV(), (x,), path, tmp_path)
    np.testing.assert_array_equal(outs[0], np.repeat(x.numpy(), 3, axis=1) + 1.0)  # numpy's repeat is the oracle


@pytest.mark.parametrize("path", PATHS)
def test_baddbmm_is_the_scaled_bias_plus_the_scaled_product(path, tmp_path):
    bias, q, k = _randn(2, 3, 5, seed=1), _randn(2, 3, 4, seed=2), _randn(2, 4, 5, seed=3)
    outs, _ = run_on_npu(Alibi(), (bias, q, k), path, tmp_path)
    want = 0.5 * bias.double().numpy() + 0.25 * (q.double().numpy() @ k.double().numpy())
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_conv1d_runs_as_a_unit_height_conv2d(path, tmp_path):
    model = Conv1d().eval()
    x = _randn(2, 4, 12, seed=4)
    outs, ops = run_on_npu(model, (x,), path, tmp_path)
    with torch.no_grad():
        want = model.double()(x.double()).numpy()  # torch in float64
    assert outs[0].shape == want.shape == (2, 6, 6)
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-4)
