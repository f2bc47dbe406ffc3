"""ge.conv2d: its numpy semantics against torch, GE's lowering to im2col + matmul run on the simulated NPU,
the frontends' mappings (aten.conv2d / aten.convolution, ONNX Conv) and a small ViT end to end.

torch.nn.functional.conv2d in float64 is the oracle throughout; results are judged by geir.accuracy's rule.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from geir.accuracy import compare
from geir.builder import create_op
from geir.parser import parse
from geir.reference import run_graph, run_op
from geir.session import Session, run_program
from geir.types import DType, TensorType

torch = pytest.importorskip("torch")
F = torch.nn.functional

NP = {DType.f32: np.float32, DType.f16: np.float16, DType.bf16: ml_dtypes.bfloat16}

# (N, C, H, W), (O, C/groups, kH, kW), strides, pads [top, left, bottom, right], dilations, groups, bias
CASES = {
    "patch": ((2, 3, 32, 32), (16, 3, 8, 8), [8, 8], [0, 0, 0, 0], [1, 1], 1, True),
    "patch-leftover": ((1, 3, 19, 21), (8, 3, 4, 4), [4, 4], [0, 0, 0, 0], [1, 1], 1, True),
    "3x3-same": ((2, 4, 9, 9), (6, 4, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 1, True),
    "3x3-stride2-groups": ((2, 4, 9, 10), (6, 2, 3, 3), [2, 2], [1, 1, 1, 1], [1, 1], 2, False),
    "asymmetric-pads": ((1, 2, 7, 8), (3, 2, 3, 2), [2, 3], [0, 2, 1, 0], [1, 1], 1, True),
    "dilated": ((1, 3, 11, 11), (4, 3, 3, 3), [1, 2], [2, 2, 2, 2], [2, 2], 1, True),
    "depthwise": ((2, 4, 6, 6), (4, 1, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 4, True),
    "1x1": ((2, 8, 5, 5), (4, 8, 1, 1), [1, 1], [0, 0, 0, 0], [1, 1], 1, False),
}


def _torch_conv(x, w, b, strides, pads, dilations, groups) -> np.ndarray:
    """The oracle in float64; torch's padding is symmetric, so asymmetric pads go through F.pad first."""
    t = torch.from_numpy(np.asarray(x, dtype=np.float64))
    t = F.pad(t, (pads[1], pads[3], pads[0], pads[2]))
    bias = None if b is None else torch.from_numpy(np.asarray(b, dtype=np.float64))
    return F.conv2d(t, torch.from_numpy(np.asarray(w, dtype=np.float64)), bias, stride=strides,
                    dilation=dilations, groups=groups).numpy()


def _arrays(case: str, dtype: DType, seed: int = 0):
    xs, ws, strides, pads, dilations, groups, has_bias = CASES[case]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(xs).astype(NP[dtype])
    w = (rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(NP[dtype])
    b = rng.standard_normal(ws[0]).astype(NP[dtype]) if has_bias else None
    return x, w, b, strides, pads, dilations, groups


def _type(a: np.ndarray, dtype: DType) -> TensorType:
    return TensorType(a.shape, dtype)


@pytest.mark.parametrize("dtype", [DType.f32, DType.f16, DType.bf16])
@pytest.mark.parametrize("case", list(CASES))
def test_compute_matches_torch(case, dtype):
    x, w, b, strides, pads, dilations, groups = _arrays(case, dtype)
    operands = [x, w] + ([b] if b is not None else [])
    want = _torch_conv(x, w, b, strides, pads, dilations, groups)
    op = create_op("ge.conv2d", [], [None], {"strides": strides, "pads": pads, "dilations": dilations,
                                            "groups": groups})
    t = op.infer(*(_type(a, dtype) for a in operands))
    assert t.shape == want.shape
    (got,) = run_op(op, operands, result_types=[t])
    assert got.dtype == NP[dtype]
    (eager,) = run_op(op, operands, result_types=[t])
    verdict = compare(got, want, t, eager)
    assert verdict.passed, verdict.render("conv2d")
    if dtype is not DType.f32:
        # accumulated in f32 and rounded once: as close to float64 as the dtype allows, element-wise
        assert verdict.criterion == "element-wise", verdict.render("conv2d")


def _graph_text(case: str, dtype: DType, batch: str | None = None) -> str:
    xs, ws, strides, pads, dilations, groups, has_bias = CASES[case]
    x, w, _, _, _, _, _ = _arrays(case, dtype)
    want = _torch_conv(x, w, None, strides, pads, dilations, groups)
    d = dtype.name
    n = batch or str(xs[0])
    shape = lambda s: "x".join(map(str, s))  # noqa: E731
    args = f"%x: tensor<{n}x{shape(xs[1:])}x{d}>, %w: tensor<{shape(ws)}x{d}>"
    operands = "%x, %w"
    if has_bias:
        args += f", %b: tensor<{ws[0]}x{d}>"
        operands += ", %b"
    return (f"ge.graph @main({args}) -> tensor<{n}x{shape(want.shape[1:])}x{d}> {{\n"
            f"  %y = ge.conv2d {operands} {{strides = {strides}, pads = {pads}, dilations = {dilations}, "
            f"groups = {groups}}}\n"
            f"  ge.return %y\n}}\n")


@pytest.mark.parametrize("dtype", [DType.f32, DType.f16])
@pytest.mark.parametrize("case", list(CASES))
def test_lowered_conv_runs_on_the_npu_and_matches_torch(case, dtype):
    """GE lowers every case to the cube; the program the Runtime runs equals torch within the accuracy rule."""
    x, w, b, strides, pads, dilations, groups = _arrays(case, dtype, seed=1)
    module = parse(_graph_text(case, dtype), "conv.geir")
    session = Session(module, explain=True)
    assert not [op for op in session.generic.ops if op.name == "ge.conv2d"]
    assert any(op.name in ("ge.matmul", "ge.fused_matmul") for op in session.generic.ops)
    inputs = {"x": x, "w": w} | ({"b": b} if b is not None else {})
    program = session.program({k: v.shape for k, v in inputs.items()})
    launched = {op.attr("kernel") for op in program.ops if op.name == "rt.launch"}
    assert "ge.conv2d" not in launched and launched & {"ge.matmul", "ge.fused_matmul"}
    got = run_program(program, inputs).outputs[0]
    want = _torch_conv(x, w, b, strides, pads, dilations, groups)
    t = TensorType(want.shape, dtype)
    eager = run_graph(parse(_graph_text(case, dtype), "conv.geir").graphs[0], inputs)[0]
    verdict = compare(got, want, t, eager)
    assert verdict.passed, verdict.render("conv2d")


@pytest.mark.parametrize("case", ["patch", "3x3-same", "3x3-stride2-groups"])
def test_a_run_time_batch_is_lowered_too(case):
    """A `?` batch: the patch path reshapes with -1, the window path broadcasts its zero slabs to the batch."""
    x, w, b, strides, pads, dilations, groups = _arrays(case, DType.f32, seed=2)
    session = Session(parse(_graph_text(case, DType.f32, batch="?"), "conv.geir"))
    assert not [op for op in session.generic.ops if op.name == "ge.conv2d"]
    inputs = {"x": x, "w": w} | ({"b": b} if b is not None else {})
    for batch in (1, 3):
        xb = np.concatenate([x] * 2)[:batch]
        xb[0, 0, 0, 0] = np.nan  # a NaN stays in the windows that see it: the zero slabs are not 0 * x
        feed = inputs | {"x": xb}
        got = run_program(session.program({k: v.shape for k, v in feed.items()}), feed).outputs[0]
        want = _torch_conv(xb, w, b, strides, pads, dilations, groups)
        assert compare(got, want, TensorType(want.shape, DType.f32)).passed


def test_a_conv_that_is_not_lowered_says_why_and_keeps_its_compute():
    text = ("ge.graph @main(%x: tensor<1x2x?x8xf32>, %w: tensor<3x2x3x3xf32>) -> tensor<1x3x?x8xf32> {\n"
            "  %y = ge.conv2d %x, %w {pads = [1, 1, 1, 1]}\n"
            "  ge.return %y\n}\n")
    remarks = []
    session = Session(parse(text, "c.geir"), emit=remarks.append, explain=True)
    assert [op.name for op in session.generic.ops] == ["ge.conv2d", "ge.return"]
    (why,) = [d.message for d in remarks if "conv2d" in d.message]
    assert why.startswith("conv2d not lowered to matmul: ") and "known only at run time" in why
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((1, 2, 5, 8)).astype(np.float32), rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    got = run_graph(parse(text, "c.geir").graphs[0], {"x": x, "w": w}, float64=True)[0]
    np.testing.assert_allclose(got, _torch_conv(x, w, None, [1, 1], [1, 1, 1, 1], [1, 1], 1), rtol=1e-12, atol=1e-12)


# --- the torch frontend: aten.conv2d / aten.convolution ---------------------------------------------------

class _Convs(torch.nn.Module):
    """Three convolutions in a row: strided and padded, grouped and dilated with padding="same", a patchify."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.b = torch.nn.Conv2d(8, 8, (3, 2), padding="same", dilation=2, groups=2, bias=False)
        self.c = torch.nn.Conv2d(8, 4, 4, stride=4)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))


def test_torch_convolutions_import_lower_and_match_torch():
    from geir.frontends.torch import compile as geir_compile

    torch.manual_seed(0)
    model = _Convs().eval()
    x = torch.randn(2, 3, 32, 32)
    compiled = geir_compile(model, (x,))
    imported = [op for op in compiled.module.graph().ops if op.name == "ge.conv2d"]
    assert [(op.strides, op.pads, op.dilations, op.groups) for op in imported] == [
        ([2, 2], [1, 1, 1, 1], [1, 1], 1), ([1, 1], [2, 1, 2, 1], [2, 2], 2), ([4, 4], [0, 0, 0, 0], [1, 1], 1)]
    assert not [op for op in compiled.graph.ops if op.name == "ge.conv2d"]
    actual = compiled(x).detach().numpy()
    with torch.no_grad():
        eager = model(x).numpy()
        reference = model.double()(x.double()).numpy()
    verdict = compare(actual, reference, TensorType(actual.shape, DType.f32), eager)
    assert verdict.passed, verdict.render("convs")


def test_torch_conv_of_an_unbatched_image():
    from geir.frontends.torch import compile as geir_compile

    torch.manual_seed(1)
    conv = torch.nn.Conv2d(2, 3, 3, padding=1).eval()
    x = torch.randn(2, 6, 6)
    actual = geir_compile(conv, (x,))(x).detach().numpy()
    with torch.no_grad():
        reference = conv.double()(x.double()).numpy()
    np.testing.assert_allclose(actual, reference, rtol=1e-4, atol=1e-5)


class _Convolution(torch.nn.Module):
    """aten.convolution written directly (what decompositions leave of conv1d, conv_transpose2d, ...)."""

    def __init__(self, weight: tuple[int, ...], transposed: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(*weight))
        self.transposed = transposed

    def forward(self, x):
        n = x.dim() - 2
        return torch.ops.aten.convolution(x, self.w, None, [1] * n, [0] * n, [1] * n, self.transposed, [0] * n, 1)


@pytest.mark.parametrize("weight, x, transposed, words", [
    ((3, 2, 3, 3, 3), (1, 2, 8, 8, 8), False, "a 3-D convolution"),
    ((2, 3, 3, 3), (1, 2, 8, 8), True, "a transposed convolution"),
], ids=["3-d", "transposed"])
def test_torch_convolutions_geir_cannot_take_are_named(weight, x, transposed, words):
    from geir.frontends.torch import TorchImportError, compile as geir_compile

    with pytest.raises(TorchImportError, match=rf"aten\.convolution\.default at node 'convolution'.*: {words}"):
        geir_compile(_Convolution(weight, transposed).eval(), (torch.randn(*x),))


# --- the ONNX frontend: Conv ------------------------------------------------------------------------------

ONNX_CASES = {  # attributes, X, W shapes; the oracle is torch on explicitly padded input
    "strided-bias": ({"strides": [2, 2], "pads": [1, 0, 2, 1]}, (2, 3, 9, 8), (4, 3, 3, 3), True),
    "groups-dilations": ({"group": 2, "dilations": [2, 1]}, (1, 4, 9, 9), (6, 2, 3, 3), False),
    "same-upper": ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (1, 2, 7, 8), (3, 2, 4, 3), True),
    "same-lower": ({"auto_pad": "SAME_LOWER"}, (1, 2, 6, 6), (3, 2, 2, 2), False),
    "patch": ({"strides": [4, 4], "kernel_shape": [4, 4]}, (2, 3, 16, 16), (8, 3, 4, 4), True),
}


def _same_pads(attrs, xs, ws):
    """ONNX's auto_pad SAME_*, spelled out from the operator's definition (output = ceil(in / stride))."""
    strides = attrs.get("strides", [1, 1])
    totals = [max(0, (-(-n // s) - 1) * s + k - n) for n, k, s in zip(xs[2:], ws[2:], strides)]
    before = [t // 2 if attrs["auto_pad"] == "SAME_UPPER" else t - t // 2 for t in totals]
    return before + [t - f for t, f in zip(totals, before)]


@pytest.mark.parametrize("case", list(ONNX_CASES))
def test_onnx_conv_imports_lowers_and_matches_torch(case):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from geir.frontends.onnx import import_onnx

    attrs, xs, ws, has_bias = ONNX_CASES[case]
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32), \
        rng.standard_normal(ws[0]).astype(np.float32)
    pads = _same_pads(attrs, xs, ws) if "auto_pad" in attrs else attrs.get("pads", [0, 0, 0, 0])
    want = _torch_conv(x, w, b if has_bias else None, attrs.get("strides", [1, 1]), pads,
                       attrs.get("dilations", [1, 1]), attrs.get("group", 1))
    inits = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if has_bias else [])
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if has_bias else []), ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    module, weights = import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]))
    assert [op.name for op in module.graph().ops if op.name not in ("ge.const", "ge.return")] == ["ge.conv2d"]
    module.resources = weights
    session = Session(module)
    assert not [op for op in session.generic.ops if op.name == "ge.conv2d"]
    got = run_program(session.program({"x": xs}), {"x": x}, weights).outputs[0]
    assert compare(got, want, TensorType(want.shape, DType.f32)).passed
    assert onnx is not None


def test_onnx_conv_of_another_rank_is_a_clear_import_error():
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from geir.frontends.onnx import OnnxImportError, import_onnx

    node = helper.make_node("Conv", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 2, 8, 8, 8)),
                                            helper.make_tensor_value_info("w", TensorProto.FLOAT, (3, 2, 3, 3, 3))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(OnnxImportError, match="Conv.*a 3-D Conv"):  # (1-D is a unit-height 2-D one: test_llm_ops)
        import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]))


# --- ViT: the patch embedding on the cube, every attention fused --------------------------------------------

class _ViT(torch.nn.Module):
    """ViTModel from `pixel_values`: its last hidden state and its pooled output."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        out = self.model(pixel_values=pixel_values)
        return out.last_hidden_state, out.pooler_output


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_small_vit_compiles_with_every_attention_fused_and_matches_torch(attention):
    transformers = pytest.importorskip("transformers")
    import warnings

    from geir.frontends.torch import compile as geir_compile

    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, image_size=32, patch_size=8)
    config._attn_implementation = attention
    model = _ViT(transformers.ViTModel(config).eval())
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = geir_compile(model, (x,))
    assert [op.name for op in compiled.module.graph().ops].count("ge.conv2d") == 1
    names = [op.name for op in compiled.graph.ops]
    assert names.count("ge.flash_attention") == config.num_hidden_layers, names
    assert "ge.conv2d" not in names and "ge.softmax" not in names
    # every projection took its bias as an epilogue and q, k, v merged into one (qkv_merge): per layer qkv, the
    # output and the MLP's two; plus the patch embedding's and the pooler's
    assert names.count("ge.fused_matmul") == 4 * config.num_hidden_layers + 2
    actual = [t.detach().numpy() for t in compiled(x)]
    with torch.no_grad():
        eager = [t.numpy() for t in model(x)]
        reference = [t.numpy() for t in model.double()(x.double())]
    for name, a, e, r in zip(("last_hidden_state", "pooler_output"), actual, eager, reference):
        verdict = compare(a, r, TensorType(a.shape, DType.f32), e)
        assert verdict.passed, verdict.render(name)
