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


class RepeatFeatures(torch.nn.Module):
    """GPT-J's sin and cos: each of the rotary features repeated twice, over a sequence of run-time length."""

    def forward(self, x):
        return torch.repeat_interleave(x[:, :, None, :], 2, 3) * 3.0


def test_repeat_interleave_beside_a_run_time_dimension():
    from torch.export import Dim

    module = from_module(RepeatFeatures(), (_randn(1, 5, 4),), dynamic_shapes=({1: Dim("S")},))
    session = Session(Module([module.graph()], module.file, module.resources))
    name = session.generic.args[0].name
    assert session.generic.args[0].type.shape == (1, None, 4)
    for length in (5, 11):  # one import, two lengths
        x = _randn(1, length, 4, seed=length).numpy()
        out = run_program(session.program({name: x.shape}), {name: x}, module.resources).outputs[0]
        np.testing.assert_array_equal(out, np.repeat(x[:, :, None, :], 2, axis=3) * 3.0)  # numpy's repeat


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


class Router(torch.nn.Module):
    """An MoE router: the two best experts per token and their softmax weights."""

    def forward(self, logits):
        weights, experts = torch.topk(logits.softmax(-1), 2, dim=-1)
        return weights, experts


@pytest.mark.parametrize("path", PATHS)
def test_topk_picks_the_best_experts_with_their_indices(path, tmp_path):
    logits = _randn(5, 8, seed=5)
    weights, experts = run_on_npu(Router(), (logits,), path, tmp_path)[0]
    probs = torch.softmax(logits.double(), -1).numpy()
    want = np.argsort(-probs, axis=-1, kind="stable")[:, :2]  # the oracle: numpy's sort of float64 probabilities
    np.testing.assert_array_equal(experts, want)
    np.testing.assert_allclose(weights, np.take_along_axis(probs, want, -1), rtol=1e-5)


def test_topk_ties_keep_the_lower_index_and_k_past_the_axis_is_refused():
    from geir.parser import parse
    from geir.verifier import verify_module

    text = ("ge.graph @main(%x: tensor<2x4xf32>) -> (tensor<2x2xf32>, tensor<2x2xi64>) {\n"
            "  %v, %i = ge.topk %x {k = 2}\n  ge.return %v, %i\n}\n")
    op = next(o for o in parse(text).graphs[0].ops if o.name == "ge.topk")
    values, indices = op.compute(np.array([[1, 3, 3, 0], [2, 2, 2, 2]], np.float32))
    assert indices.tolist() == [[1, 2], [0, 1]] and values.tolist() == [[3, 3], [2, 2]]
    errors = []
    verify_module(parse(text.replace("k = 2", "k = 5").replace("2x2x", "2x5x")), errors.append)
    assert any("topk k = 5 exceeds dimension 1 = 4" in d.message for d in errors), [d.message for d in errors]


def _topk_op(rows: int, cols: int, dtype: str, k: int, largest: bool = True):
    """One parsed ge.topk over the last axis of a rows x cols tensor."""
    from geir.parser import parse

    text = (f"ge.graph @main(%x: tensor<{rows}x{cols}x{dtype}>) -> (tensor<{rows}x{k}x{dtype}>, "
            f"tensor<{rows}x{k}xi64>) {{\n  %v, %i = ge.topk %x {{k = {k}, largest = {str(largest).lower()}}}\n"
            f"  ge.return %v, %i\n}}\n")
    return next(o for o in parse(text).graphs[0].ops if o.name == "ge.topk")


def test_topk_orders_nan_above_every_number_and_integers_without_overflow():
    x = np.array([[1, np.nan, 3, np.inf, 0], [-np.inf, 2, np.nan, -1, np.nan]], np.float32)
    for largest in (True, False):
        values, _ = _topk_op(2, 5, "f32", 3, largest).compute(x)
        want = torch.topk(torch.from_numpy(x), 3, largest=largest).values.numpy()  # torch: NaN is the largest
        np.testing.assert_array_equal(values, want)
    low = np.iinfo(np.int64).min
    ints = np.array([[low, 7, -1, 7, 0]], np.int64)
    values, indices = _topk_op(1, 5, "i64", 5).compute(ints)
    assert values.tolist() == [sorted(ints[0].tolist(), reverse=True)]  # -x would wrap at the minimum
    assert indices.tolist() == [[1, 3, 4, 2, 0]]  # ties in index order


def test_constant_of_shape_of_a_run_time_shape(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from geir.frontends.onnx import import_onnx

    graph = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("ConstantOfShape", ["s"], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [2.5])),
         helper.make_node("Add", ["x", "c"], ["y"])],
        "bart_mask", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    module, weights = import_onnx(str(path))
    assert [a.type.shape for a in module.graph().args] == [(None, 4)]
    session = Session(Module([module.graph()], module.file, weights))
    for batch in (3, 5):  # each run-time shape sized when its signature binds
        x = np.arange(batch * 4, dtype=np.float32).reshape(batch, 4)
        program = session.program({"x": x.shape})
        np.testing.assert_array_equal(run_program(program, {"x": x}, weights).outputs[0], x + 2.5)


class ShiftTokensRight(torch.nn.Module):
    """BART's shift_tokens_right: the ids moved one place right, the decoder's start token first, padding kept."""

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 2
        return shifted.masked_fill(shifted == -100, 1)


@pytest.mark.parametrize("path", PATHS)
def test_a_slice_assignment_shifts_the_tokens(path, tmp_path):
    ids = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(6))
    outs, _ = run_on_npu(ShiftTokensRight(), (ids,), path, tmp_path)
    want = np.concatenate([np.full((2, 1), 2), ids.numpy()[:, :-1]], axis=1)  # the shift written out in numpy
    np.testing.assert_array_equal(outs[0], want)


class Flip(torch.nn.Module):
    """torch.flip: the ONNX exporter writes it as a Slice stepping backwards, torch.export as aten.flip."""

    def forward(self, x):
        return torch.flip(x, [0, 2]) * 2.0


@pytest.mark.parametrize("path", PATHS)
def test_flip_is_a_slice_stepping_backwards(path, tmp_path):
    x = _randn(2, 3, 4, seed=7)
    outs, ops = run_on_npu(Flip(), (x,), path, tmp_path)
    assert "ge.slice" in ops
    np.testing.assert_array_equal(outs[0], np.flip(x.numpy(), (0, 2)) * 2.0)  # numpy's flip is the oracle


INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


@pytest.mark.parametrize("starts, ends, axes, steps", [
    ([-1], [INT64_MIN], [1], [-1]),  # the whole axis backwards, as the exporter writes torch.flip
    ([INT64_MAX], [-20], [1], [-2]),  # bounds past both ends
    ([-100], [-100], [1], [-1]),  # ONNX clamps the start to the first element: one element, not none
    ([5, 1], [0, INT64_MAX], [1, 0], [-3, 2]),  # a backward and a forward step on the run-time axis
    ([-1, 0], [INT64_MIN, 7], [0, 1], [-1, 3]),  # backwards along the run-time axis
], ids=["flip", "past-both-ends", "clamped-start", "mixed", "run-time-axis"])
def test_onnx_slice_steps_follow_the_onnx_spec(starts, ends, axes, steps, tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from geir.frontends.onnx import import_onnx

    consts = [numpy_helper.from_array(np.array(v, np.int64), name)
              for v, name in ((starts, "starts"), (ends, "ends"), (axes, "axes"), (steps, "steps"))]
    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])], "slice",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    module, weights = import_onnx(str(path))
    session = Session(Module([module.graph()], module.file, weights))
    x = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    got = run_program(session.program({"x": x.shape}), {"x": x}, weights).outputs[0]
    np.testing.assert_array_equal(got, _slice_by_onnx_spec(x, starts, ends, axes, steps))
    if starts != [-100]:  # there ONNX's reference (numpy's slicing) gives none, against its spec's clamping
        np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, {"x": x})[0])


def _slice_by_onnx_spec(x: np.ndarray, starts, ends, axes, steps) -> np.ndarray:
    """ONNX Slice as its operator spec words it: a negative bound plus the dimension, then clamped to
    [0, dim] (start and end) for a forward step, to [0, dim - 1] (start) and [-1, dim - 1] (end) for a
    backward one; the elements at start, start + step, ... before end."""
    out = x
    for s, e, a, st in zip(starts, ends, axes, steps):
        dim = x.shape[a]
        s, e = (s + dim if s < 0 else s), (e + dim if e < 0 else e)
        if st > 0:
            s, e = min(max(s, 0), dim), min(max(e, 0), dim)
        else:
            s, e = min(max(s, 0), dim - 1), min(max(e, -1), dim - 1)
        out = np.take(out, list(range(s, e, st)), axis=a)
    return out


def test_a_shape_sliced_with_a_step_sizes_what_it_makes(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from geir.frontends.onnx import import_onnx

    consts = [numpy_helper.from_array(np.array(v, np.int64), name)
              for v, name in (([0], "starts"), ([3], "ends"), ([0], "axes"), ([2], "steps"))]
    graph = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Slice", ["s", "starts", "ends", "axes", "steps"], ["every_other"]),  # [batch, 6]
         helper.make_node("ConstantOfShape", ["every_other"], ["y"],
                          value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.5]))],
        "strided_shape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], consts)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    module, weights = import_onnx(str(path))
    session = Session(Module([module.graph()], module.file, weights))
    x = np.zeros((3, 4, 6), np.float32)
    got = run_program(session.program({"x": x.shape}), {"x": x}, weights).outputs[0]
    np.testing.assert_array_equal(got, np.full((3, 6), 1.5, np.float32))  # x.shape[::2] filled, by hand


class Convolution1d(torch.nn.Module):
    """aten.convolution on [N, C, L], as torch's decompositions leave conv1d."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(_randn(5, 3, 3, seed=8))

    def forward(self, x):
        return torch.ops.aten.convolution(x, self.w, None, [2], [1], [1], False, [0], 1)


def test_a_1d_aten_convolution_runs_as_conv1d_does(tmp_path):
    x = _randn(2, 3, 9, seed=9)
    outs, _ = run_on_npu(Convolution1d().eval(), (x,), "torch", tmp_path)
    w = Convolution1d().w.detach().double()
    want = torch.nn.functional.conv1d(x.double(), w, stride=2, padding=1).numpy()  # torch in float64
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)


class ExpertOrder(torch.nn.Module):
    """An MoE layer's dispatch: the token slots ordered by the expert they go to (torch.sort), and argsort."""

    def forward(self, experts, scores):
        ordered, slots = torch.sort(experts, dim=-1, stable=True)
        return ordered, slots, torch.argsort(scores, dim=0, descending=True)


def test_sort_and_argsort_order_as_a_stable_sort(tmp_path):
    experts = torch.randint(0, 4, (2, 12), generator=torch.Generator().manual_seed(10))  # many equal keys
    scores = _randn(6, 3, seed=11)
    ordered, slots, ranked = run_on_npu(ExpertOrder(), (experts, scores), "torch", tmp_path)[0]
    want = np.argsort(experts.numpy(), axis=-1, kind="stable")  # numpy's stable sort is the oracle
    np.testing.assert_array_equal(slots, want)
    np.testing.assert_array_equal(ordered, np.take_along_axis(experts.numpy(), want, -1))
    np.testing.assert_array_equal(ranked, np.argsort(-scores.double().numpy(), axis=0, kind="stable"))


def _hf_model(kind: str) -> tuple[torch.nn.Module, tuple]:
    """A tiny random-init Hugging Face model (no download) returning its last hidden state, and its input."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(12))
    if kind == "whisper":  # the encoder: two 1-D convolutions over the mel frames
        cfg = transformers.WhisperConfig(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                         decoder_attention_heads=4, num_mel_bins=8, max_source_positions=16,
                                         vocab_size=100, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                         decoder_start_token_id=0)
        model, args = transformers.WhisperModel(cfg).get_encoder(), (_randn(1, 8, 32, seed=13),)
    elif kind == "gptj":  # interleaved rotary: x[..., ::2], repeat_interleave of sin and cos
        cfg = transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, vocab_size=100,
                                      bos_token_id=0, eos_token_id=0)
        model, args = transformers.GPTJModel(cfg), (ids,)
    else:  # Bloom: ALiBi scores by baddbmm
        cfg = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=100)
        model, args = transformers.BloomModel(cfg), (ids,)

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x).last_hidden_state

    return Hidden().eval(), args


@pytest.mark.parametrize("kind", ["gptj", "bloom", "whisper"])
def test_tiny_hugging_face_models_import_and_match_torch(kind, tmp_path):
    model, args = _hf_model(kind)
    outs, _ = run_on_npu(model, args, "torch", tmp_path)
    with torch.no_grad():
        want = model.double()(*(a.double() if a.is_floating_point() else a for a in args)).numpy()  # float64
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-4)


def test_bart_shift_tokens_right_imports_as_written():
    transformers = pytest.importorskip("transformers")
    from transformers.models.bart.modeling_bart import shift_tokens_right

    class Shift(torch.nn.Module):
        def forward(self, ids):
            return shift_tokens_right(ids, 1, 2)  # pad 1, decoder start 2

    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(14))
    ids[1, -2:] = -100  # labels' ignored positions become padding
    outs, _ = run_on_npu(Shift(), (ids,), "torch", None)
    want = np.concatenate([np.full((2, 1), 2), ids.numpy()[:, :-1]], axis=1)  # the shift written out in numpy
    np.testing.assert_array_equal(outs[0], np.where(want == -100, 1, want))


def test_flip_along_a_run_time_axis(tmp_path):
    from torch.export import Dim

    module = from_module(Flip(), (_randn(2, 3, 4),), dynamic_shapes=({2: Dim("L")},))
    session = Session(Module([module.graph()], module.file, module.resources))
    name = session.generic.args[0].name
    assert session.generic.args[0].type.shape == (2, 3, None)
    for length in (4, 9):  # one import, two lengths: the backward slice's end is before the first of any
        x = _randn(2, 3, length, seed=length).numpy()
        out = run_program(session.program({name: x.shape}), {name: x}, module.resources).outputs[0]
        np.testing.assert_array_equal(out, np.flip(x, (0, 2)) * 2.0)
