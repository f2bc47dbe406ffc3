"""torch.compile(model, backend="geir"): TorchDynamo's graphs run on the simulated NPU, or eagerly with a warning.

The NPU's results are judged by gerun --check's rule (geir.accuracy), which is torch.compile's own:
element-wise within the dtype's tolerance of the model run in float64, or an RMS error against float64
at most a multiple of that of eager torch in the dtype. Graphs GEIR leaves to eager must give eager's
results exactly.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

# the frontend imports torch (and registers the backend), so it comes after the skip
import geir.frontends.torch  # noqa: E402,F401
from geir.accuracy import compare  # noqa: E402
from geir.frontends import torch_compile  # noqa: E402
from geir.frontends.torch import GeirFallbackWarning  # noqa: E402
from geir.types import DType, TensorType  # noqa: E402


class Attention(nn.Module):
    """Linear + GELU, then two-head softmax attention written out over the result, and a residual."""

    def __init__(self, d: int = 32, heads: int = 2):
        super().__init__()
        self.up = nn.Linear(d, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.d, self.heads = d, heads

    def forward(self, x):
        b, s, _ = x.shape
        h = F.gelu(self.up(x))
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).split(self.d, dim=-1))
        p = torch.softmax(q @ k.transpose(-2, -1) / (self.d // self.heads) ** 0.5, dim=-1)
        return (p @ v).transpose(1, 2).reshape(b, s, self.d) + x


class Cumulative(nn.Module):
    """A supported part, a graph break, then cumprod, which GEIR has no mapping for."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = F.gelu(self.lin(x))
        torch._dynamo.graph_break()
        return torch.cumprod(h, dim=-1) * 0.5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # Dynamo caches compiled frames across tests by code object
    yield
    torch._dynamo.reset()


@pytest.fixture
def graphs(geir_graphs):
    return geir_graphs


def _model(cls, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls().eval()


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_matches_torch(actual: torch.Tensor, model: nn.Module, x: torch.Tensor) -> None:
    """The accuracy rule against the model run in float64, with eager f32 torch as the RMS baseline."""
    with torch.no_grad():
        wide = copy.deepcopy(model).double()(x.double())
        eager = model(x)
    assert actual.dtype == torch.float32 and actual.shape == eager.shape
    verdict = compare(actual.numpy(), wide.numpy(), TensorType(tuple(actual.shape), DType.f32), eager.double().numpy())
    assert verdict.passed, verdict.render("result")


def test_geir_is_a_registered_backend():
    from torch._dynamo.backends.registry import lookup_backend

    assert "geir" in torch._dynamo.list_backends()
    assert lookup_backend("geir") is torch_compile.geir_backend
    torch_compile.register()  # a second registration (an entry point, a re-import) is harmless


def test_linear_gelu_attention_runs_on_the_npu(graphs):
    model = _model(Attention)
    fast = torch.compile(model, backend="geir")
    x = _x(2, 16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GeirFallbackWarning)  # nothing may fall back
        with torch.no_grad():
            out = fast(x)
    assert_matches_torch(out, model, x)
    (graph,) = graphs
    (compiled,) = [c for c in graph.compiled.values() if c is not None]
    assert compiled.last_result is not None  # the simulated NPU ran it
    ops = [op.name for op in compiled.graph.ops]
    assert "ge.flash_attention" in ops and "ge.fused_matmul" in ops  # GE fused what it imported


def test_new_shapes_are_compiled_too(graphs):
    model = _model(Attention)
    fast = torch.compile(model, backend="geir")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GeirFallbackWarning)
        with torch.no_grad():
            for s in (16, 8, 24):  # the second shape makes Dynamo trace with a symbolic length
                x = _x(1, s, 32, seed=s)
                assert_matches_torch(fast(x), model, x)
    ran = [c for g in graphs for c in g.compiled.values() if c is not None and c.last_result is not None]
    assert len(ran) == 3


class Loss(nn.Module):
    """A 0-d result (a loss-like mean) beside a 1-element one."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        return (h * h).mean(), h.sum(dim=(0, 1)).amax(dim=-1, keepdim=True)


def test_a_zero_d_result_comes_back_zero_d_as_in_eager_torch(graphs):
    model = _model(Loss)
    fast = torch.compile(model, backend="geir")
    x = _x(2, 8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GeirFallbackWarning)
        with torch.no_grad():
            got = fast(x)
            eager = model(x)
            wide = copy.deepcopy(model).double()(x.double())
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in eager] == [(), (1,)]
    for g, w, e in zip(got, wide, eager):
        verdict = compare(g.numpy(), w.numpy(), TensorType(tuple(g.shape), DType.f32), e.double().numpy())
        assert verdict.passed, verdict.render("result")
    assert any(c is not None and c.last_result is not None for g in graphs for c in g.compiled.values())


def test_an_unsupported_op_runs_eagerly_with_a_warning_naming_it(graphs):
    model = _model(Cumulative)
    fast = torch.compile(model, backend="geir")
    x = _x(4, 32)
    with pytest.warns(GeirFallbackWarning, match=r"aten\.cumprod\.default .*unsupported op"):
        with torch.no_grad():
            out = fast(x)
    assert_matches_torch(out, model, x)
    # the graph before the break still ran on the NPU
    assert len(graphs) == 2
    on_npu = [g for g in graphs if g.eager_reason is None]
    assert len(on_npu) == 1 and any(c is not None and c.last_result is not None for c in on_npu[0].compiled.values())


def test_autograd_runs_eagerly_with_a_warning():
    model = _model(Attention)
    fast = torch.compile(model, backend="geir")
    x = _x(2, 8, 32)
    with pytest.warns(GeirFallbackWarning, match="inference only"):
        out = fast(x)  # grad mode: the parameters require grad, and the NPU's results would have no grad_fn
    assert out.requires_grad and torch.equal(out, model(x))
    out.sum().backward()
    assert model.up.weight.grad is not None


def test_unknown_options_are_an_error():
    fast = torch.compile(_model(Attention), backend="geir", options={"tagret": "ascend910b"})
    with pytest.raises(Exception, match="takes the options 'target' and 'pipeline', not tagret"):
        with torch.no_grad():
            fast(_x(2, 8, 32))


def test_a_graph_geir_cannot_import_gives_eager_results_exactly(graphs):
    def scan(x):
        return torch.cumprod(x * 2.0, dim=0) + 1.0

    fast = torch.compile(scan, backend="geir")
    x = _x(8, 4)
    with pytest.warns(GeirFallbackWarning, match=r"aten\.cumprod\.default"):
        out = fast(x)
    assert torch.equal(out, torch.cumprod(x * 2.0, dim=0) + 1.0)
    assert torch.equal(fast(x + 1), scan(x + 1))  # later calls run eagerly too, without recompiling
    assert len(graphs) == 1 and graphs[0].compiled == {}
