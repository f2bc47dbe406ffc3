"""FlashAttention's pse bias (issue 28 item 1): softmax(scale * q k^T + pse + mask) v, Bloom's ALiBi attention, as
one kernel option (ops-transformer's FlashAttentionScore `pse` input, pseType 0).

Oracles: the formula in float64 numpy (written here, not the op's compute), judged by the torch.compile rule
against the same formula in the inputs' dtype; the kernel's extra work against an analytic count (one vector pass
over every score tile, and the pse's bytes: one row of the key block per tile for ALiBi's [B, N, 1, Skv]); a tiny
random-init Bloom against torch in float64, and its greedy generate() tokens against Hugging Face's.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from geir.accuracy import compare
from geir.kernels.base import LaunchContext
from geir.kernels.flash_attention import flash_attention_forward
from geir.kernels.flash_attention_tiling import choose_flash_tiling
from geir.parser import parse
from geir.session import compile_module, run_program
from geir.target_npu import load_target
from geir.target_npu.sim import PIPE_INDEX, Cores, GlobalMemory, vector_cycles
from geir.types import DType, TensorType


def _alibi(heads: int, keys: int) -> np.ndarray:
    """ALiBi's bias as Bloom builds it (Press et al.): head h's slope 2^(-8 (h + 1) / N) times the key position."""
    slopes = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    return (slopes[:, None] * np.arange(keys)[None, :])[None, :, None, :]  # [1, N, 1, Skv]


def _formula(q, k, v, pse, mask, scale: float, dtype) -> np.ndarray:
    """The biased attention in `dtype` (float64: the reference), step by step as the definition writes it."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * dtype(scale)
    if pse is not None:
        s = s + pse.astype(dtype)
    if mask is not None:
        s = s + mask.astype(dtype)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.matmul(e / e.sum(axis=-1, keepdims=True), v).astype(dtype)


def _graph(q: tuple, kv: tuple, dt: str, masked: bool) -> str:
    def t(shape):
        return f"tensor<{'x'.join(map(str, shape))}x{dt}>"
    b, n, sq, _ = q
    skv = kv[2]
    mask = f", %m: {t((b, 1, sq, skv))}" if masked else ""
    return (f"ge.graph @main(%q: {t(q)}, %k: {t(kv)}, %v: {t(kv)}{mask}, %pse: {t((1, n, 1, skv))}) -> {t(q)} {{\n"
            f"  %o = ge.flash_attention %q, %k, %v{', %m' if masked else ''}, %pse "
            f"{{scale = 0.125, has_pse = true}}\n  ge.return %o\n}}\n")


@pytest.mark.parametrize("target", ["ascend910b", "ascend910a"])  # the CV-split schedule and the on-chip one
@pytest.mark.parametrize("dt, np_dt", [("f16", np.float16), ("f32", np.float32)])
@pytest.mark.parametrize("q_shape, kv_shape, masked", [
    ((1, 4, 256, 64), (1, 4, 256, 64), True),  # prefill, with a padding mask beside the pse
    ((1, 4, 256, 64), (1, 2, 256, 64), False),  # grouped-query heads, the pse alone (it is the fourth operand)
    ((2, 4, 1, 64), (2, 4, 512, 64), True),  # a decode step: flash-decoding's stacked rows
], ids=["prefill", "gqa-pse-only", "decode"])
def test_the_biased_kernel_is_the_formula(target, dt, np_dt, q_shape, kv_shape, masked):
    rng = np.random.default_rng(5)
    q = rng.standard_normal(q_shape).astype(np_dt)
    k, v = (rng.standard_normal(kv_shape).astype(np_dt) for _ in range(2))
    b, n, sq, _ = q_shape
    skv = kv_shape[2]
    pse = (_alibi(n, skv) * 0.25).astype(np_dt)  # steep enough that the bias moves the answer
    mask = np.where(np.arange(skv) < skv - 7, 0.0, -1e4)[None, None, None, :].repeat(sq, 2).repeat(b, 0) \
        .astype(np_dt) if masked else None
    program = compile_module(parse(_graph(q_shape, kv_shape, dt, masked), "<pse>"), target=target)[0].graphs[0]
    feed = {"q": q, "k": k, "v": v, "pse": pse, **({"m": mask} if masked else {})}
    out = np.asarray(run_program(program, feed, target=target).outputs[0])
    ref = _formula(q, k, v, pse, mask, 0.125, np.float64)
    unbiased = _formula(q, k, v, None, mask, 0.125, np.float64)
    assert np.abs(ref - unbiased).max() > 0.05  # the bias changes the answer: this test can tell
    verdict = compare(out, ref, TensorType(q_shape, DType(dt)), _formula(q, k, v, pse, mask, 0.125, np_dt))
    assert verdict.passed, verdict.render("o")


def test_the_pse_costs_one_vector_pass_and_a_key_row_per_score_tile():
    chip = load_target("ascend910a")  # the on-chip schedule: every score tile's softmax on the AI core's vector unit
    b, n, s, d = 1, 4, 512, 128
    q = np.zeros((b, n, s, d), np.float16)
    pse = np.zeros((1, n, 1, s), np.float16)
    t = TensorType(q.shape, DType.f16)
    tiling = choose_flash_tiling(t, t, t, False, True, chip, mask_itemsize=2)  # the pse's tile in the UB

    def run(bias):
        ctx = LaunchContext(chip, Cores(chip.cube_cores), GlobalMemory(chip), ["q", "k", "v", "pse"], ["o"],
                            compute=False)
        flash_attention_forward(q, q, q, None, False, 0.1, tiling, ctx, pse=bias)
        return float(ctx.cores.busy[PIPE_INDEX["VECTOR"]].sum()), ctx.gm.gm_read_bytes

    (vector, read), (vector0, read0) = run(pse), run(None)
    tiles = b * n * -(-s // tiling.s1) * -(-s // tiling.s2)
    assert vector - vector0 == pytest.approx(float(tiles * vector_cycles(chip, tiling.s1 * tiling.s2 * 4, 1)))
    assert read - read0 == tiles * tiling.s2 * 2  # one f16 row of the key block: the bias is the same for every row


def test_a_pse_flag_without_a_pse_is_refused_where_it_is_written():
    from geir.diagnostics import DiagnosticError

    text = ("ge.graph @main(%q: tensor<1x1x16x16xf32>) -> tensor<1x1x16x16xf32> {\n"
            "  %o = ge.flash_attention %q, %q, %q {has_pse = true}\n  ge.return %o\n}\n")
    with pytest.raises(DiagnosticError, match="has_pse = true names the last operand the pse bias"):
        compile_module(parse(text, "<bad>"))


def test_an_unfused_biased_attention_computes_the_same():
    # the fusion guard expands a ge.flash_attention it cannot run back into primitive ops: the pse comes along
    from geir.ir import Module
    from geir.passes.fusion.guards import decompose_flash_attention
    from geir.passes.pattern import Rewriter
    from geir.reference import run_graph

    q_shape = (1, 4, 32, 16)
    module = parse(_graph(q_shape, q_shape, "f32", True), "<pse>")
    graph = module.graphs[0]
    rng = np.random.default_rng(0)
    feed = {a.name: rng.standard_normal(a.type.shape).astype(np.float32) for a in graph.args}
    fa = next(op for op in graph.ops if op.name == "ge.flash_attention")
    decompose_flash_attention(fa, Rewriter(graph))
    assert "ge.flash_attention" not in [op.name for op in graph.ops]
    (out,) = run_graph(Module([graph]).graphs[0], feed)
    ref = _formula(feed["q"], feed["k"], feed["v"], feed["pse"], feed["m"], 0.125, np.float64)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def _bloom(dtype=None):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=100, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0)
    model = transformers.BloomForCausalLM(cfg).eval()
    return model.to(dtype) if dtype is not None else model


def _hidden(model):
    """The Bloom model's last hidden state from (input_ids, attention_mask): the module the tests export."""
    torch = pytest.importorskip("torch")

    class Hidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, mask):
            return self.m.transformer(input_ids=ids, attention_mask=mask).last_hidden_state

    return Hidden(model)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_bloom_attention_fuses_with_its_alibi_as_the_pse_and_equals_torch(dtype):
    torch = pytest.importorskip("torch")
    from geir.frontends.torch import from_module
    from geir.frontends.torch_builder import to_numpy
    from geir.ir import Module
    from geir.session import Session

    torch_dtype = {"f32": torch.float32, "f16": torch.float16}[dtype]
    model = _bloom(torch_dtype)

    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # the second row ends in padding: ALiBi's positions come from the mask's cumsum
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = from_module(_hidden(model), (ids, mask))
    session = Session(Module([module.graph()], module.file, module.resources))
    attention = [op for op in session.generic.ops if op.name == "ge.flash_attention"]
    assert len(attention) == model.config.n_layer  # every layer's attention fused
    assert all(op.attr("has_pse") and op.pse.type.shape == (2, 4, 1, 12) for op in attention)
    assert "ge.softmax" not in [op.name for op in session.generic.ops]
    feed = {a.name: to_numpy(x) for a, x in zip(session.generic.args, (ids, mask))}
    program = session.program({k: v.shape for k, v in feed.items()})
    actual = np.asarray(run_program(program, feed, module.resources).outputs[0], dtype=np.float64)
    with torch.no_grad():
        eager = _hidden(model)(ids, mask).float().numpy()
        reference = _hidden(_bloom(torch.float64))(ids, mask).numpy()
    keep = mask.numpy().astype(bool)  # padded positions' hidden states are garbage in torch too
    verdict = compare(actual[keep], reference[keep], TensorType(actual[keep].shape, DType(dtype)), eager[keep])
    assert verdict.passed, verdict.render("last_hidden_state")


def test_bloom_through_the_onnx_exporter_fuses_and_equals_torch(tmp_path):
    # the dynamo exporter's Bloom keeps the probabilities [B, N, S, L] to a 4-D second matmul: the scores lift alone
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    import contextlib
    import io
    import logging

    from geir.frontends.onnx import import_onnx
    from geir.ir import Module
    from geir.session import Session

    model = _bloom()

    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 8, dtype=torch.long)
    out = tmp_path / "bloom.onnx"
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(_hidden(model), (ids, mask), dynamo=True).save(str(out))
    module, weights = import_onnx(str(out))
    session = Session(Module([module.graph()], module.file, weights))
    attention = [op for op in session.generic.ops if op.name == "ge.flash_attention"]
    assert len(attention) == model.config.n_layer and all(op.attr("has_pse") for op in attention)
    feed = {a.name: x.numpy() for a, x in zip(session.generic.args, (ids, mask))}
    program = session.program({k: v.shape for k, v in feed.items()})
    actual = np.asarray(run_program(program, feed, weights).outputs[0], dtype=np.float64)
    with torch.no_grad():
        eager = _hidden(model)(ids, mask).numpy()
        reference = _hidden(_bloom(torch.float64))(ids, mask).numpy()
    verdict = compare(actual, reference, TensorType(actual.shape, DType.f32), eager)
    assert verdict.passed, verdict.render("last_hidden_state")


def test_bloom_greedy_tokens_equal_hugging_faces_generate():
    torch = pytest.importorskip("torch")
    from geir.frontends.torch import generate

    model = _bloom()
    ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(3))
    run = generate(model, ids, 6, buckets="pow2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              pad_token_id=0)
    assert torch.equal(run.tokens, want)


def _bloom_decode_step(torch, dtype):
    """Bloom's decode step as generate() runs it: the step module, its arguments (one token after an 8-token
    prompt, the cache the prefill step made), and the last logits of torch in float64 and in `dtype`."""
    from geir.frontends.generate import _StepModule

    model = _bloom({"f32": torch.float32, "f16": torch.float16}[dtype])
    ids = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    prompt_mask = torch.zeros(1, 9, dtype=torch.long)
    prompt_mask[:, :8] = 1
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, *cache = _StepModule(model, True)(ids[:, :8], prompt_mask, torch.arange(8), torch.arange(8)[None])
        args = (ids[:, 8:], torch.ones(1, 9, dtype=torch.long), torch.tensor([8]), torch.tensor([[8]]), *cache)
        reference = _bloom(torch.float64)(input_ids=ids).logits[:, -1].numpy()
        eager = model(input_ids=ids).logits[:, -1].double().numpy()
    return model, _StepModule(model, False), args, reference, eager


def _judged(actual, reference, eager, dtype):
    actual = np.asarray(actual, dtype=np.float64)
    verdict = compare(actual, reference, TensorType(actual.shape, DType(dtype)), eager)
    assert verdict.passed, verdict.render("decode logits")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_bloom_decode_step_fuses_every_attention_and_equals_torch(dtype):
    # a decode step's q is one token, [B, 1, N, D]: its size-1 transpose is a view, so q reaches the [B*N, 1, D]
    # matmul as a reshape of [B, 1, N, D], which the rule lifts to [B, N, 1, D] (a view) as it does k and v
    torch = pytest.importorskip("torch")
    from geir.frontends.generate import export_steps
    from geir.frontends.torch_builder import to_numpy
    from geir.session import Session

    model, _, args, reference, eager = _bloom_decode_step(torch, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, decode = export_steps(model, args[0].new_ones(1, 8), torch.ones(1, 8, dtype=torch.long), 9)
    m = decode.module
    session = Session(m)
    attention = [op for op in session.generic.ops if op.name == "ge.flash_attention"]
    assert len(attention) == model.config.n_layer and all(op.attr("has_pse") for op in attention)
    assert all(op.operands[0].type.shape == (1, 4, 1, 16) for op in attention)  # q lifted to [B, N, 1, D]
    assert "ge.softmax" not in [op.name for op in session.generic.ops]
    feed = {a.name: to_numpy(x) for a, x in zip(session.generic.args, args)}
    program = session.program({k: v.shape for k, v in feed.items()})
    _judged(run_program(program, feed, m.resources).outputs[0], reference, eager, dtype)


def test_bloom_decode_step_fuses_under_torch_compile(geir_graphs):
    torch = pytest.importorskip("torch")
    from geir.frontends import torch_compile

    made = geir_graphs
    model, step, args, reference, eager = _bloom_decode_step(torch, "f32")
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", torch_compile.GeirFallbackWarning)  # nothing may fall back
            with torch.no_grad():
                out = torch.compile(step, backend="geir")(*args)
    finally:
        torch._dynamo.reset()
    compiled = [c for g in made for c in g.compiled.values() if c is not None]
    assert sum(op.name == "ge.flash_attention" for c in compiled for op in c.graph.ops) == model.config.n_layer
    _judged(out[0].numpy(), reference, eager, "f32")


def test_bloom_decode_step_through_the_onnx_exporter_fuses_and_equals_torch(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    import contextlib
    import io
    import logging

    from geir.frontends.onnx import import_onnx
    from geir.ir import Module
    from geir.session import Session

    model, step, args, reference, eager = _bloom_decode_step(torch, "f32")
    out = tmp_path / "bloom_decode.onnx"
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(step, args, dynamo=True).save(str(out))
    module, weights = import_onnx(str(out))
    session = Session(Module([module.graph()], module.file, weights))
    attention = [op for op in session.generic.ops if op.name == "ge.flash_attention"]
    assert len(attention) == model.config.n_layer and all(op.attr("has_pse") for op in attention)
    feed = {a.name: x.numpy() for a, x in zip(session.generic.args, args)}
    program = session.program({k: v.shape for k, v in feed.items()})
    _judged(run_program(program, feed, weights).outputs[0], reference, eager, "f32")
