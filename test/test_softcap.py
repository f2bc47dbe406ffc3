"""FlashAttention's logit softcap (issue 28 item 1): softmax(c * tanh(scale * q k^T / c) + mask) v, Gemma 2's
attention, as one kernel option.

Oracles: the formula in float64 numpy (written here, not the op's compute), judged by the torch.compile rule
against the same formula in the inputs' dtype; the kernel's extra vector work against an analytic count (two
multiplies and ge.tanh's passes over every score tile); a tiny random-init Gemma 2 against torch in float64.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from geir.accuracy import compare
from geir.kernels.base import LaunchContext
from geir.kernels.flash_attention import flash_attention_forward
from geir.kernels.flash_attention_tiling import choose_flash_tiling
from geir.opdef import lookup
from geir.parser import parse
from geir.session import compile_module, run_program
from geir.target_npu import load_target
from geir.target_npu.sim import PIPE_INDEX, Cores, GlobalMemory, vector_cycles
from geir.types import DType, TensorType


def _formula(q, k, v, mask, scale: float, cap: float, causal: bool, dtype) -> np.ndarray:
    """The capped attention in `dtype` (float64: the reference), step by step as the definition writes it."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * dtype(scale)
    if cap:
        s = dtype(cap) * np.tanh(s / dtype(cap))
    if mask is not None:
        s = s + mask.astype(dtype)
    if causal:
        sq, skv = s.shape[-2:]
        s = np.where(np.arange(skv)[None, :] > np.arange(sq)[:, None], -np.inf, s)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.matmul(e / e.sum(axis=-1, keepdims=True), v).astype(dtype)


def _graph(shape: tuple[int, ...], dt: str, cap: float, causal: bool, masked: bool) -> str:
    t = f"tensor<{'x'.join(map(str, shape))}x{dt}>"
    mt = f"tensor<1x1x{shape[2]}x{shape[2]}x{dt}>"
    mask = f", %m: {mt}" if masked else ""
    return (f"ge.graph @main(%q: {t}, %k: {t}, %v: {t}{mask}) -> {t} {{\n"
            f"  %o = ge.flash_attention %q, %k, %v{', %m' if masked else ''} "
            f"{{scale = 0.125, causal = {str(causal).lower()}, softcap = {cap!r}}}\n  ge.return %o\n}}\n")


@pytest.mark.parametrize("target", ["ascend910b", "ascend910a"])  # the CV-split schedule and the on-chip one
@pytest.mark.parametrize("dt, np_dt", [("f16", np.float16), ("f32", np.float32)])
@pytest.mark.parametrize("causal, masked", [(False, True), (True, False)])
def test_the_capped_kernel_is_the_formula(target, dt, np_dt, causal, masked):
    shape = (1, 2, 256, 64)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape).astype(np_dt) * 3 for _ in range(3))  # large scores: the cap bites
    mask = (rng.standard_normal((1, 1, 256, 256)) * 2).astype(np_dt) if masked else None
    program = compile_module(parse(_graph(shape, dt, 2.0, causal, masked), "<softcap>"), target=target)[0].graphs[0]
    feed = {"q": q, "k": k, "v": v, **({"m": mask} if masked else {})}
    out = np.asarray(run_program(program, feed, target=target).outputs[0])
    ref = _formula(q, k, v, mask, 0.125, 2.0, causal, np.float64)
    uncapped = _formula(q, k, v, mask, 0.125, 0.0, causal, np.float64)
    assert np.abs(ref - uncapped).max() > 0.1  # the cap changes the answer: this test can tell
    verdict = compare(out, ref, TensorType(shape, DType(dt)), _formula(q, k, v, mask, 0.125, 2.0, causal, np_dt))
    assert verdict.passed, verdict.render("o")


def test_the_cap_costs_two_multiplies_and_a_tanh_over_every_score_tile():
    chip = load_target("ascend910a")  # the on-chip schedule: every score tile's softmax on the AI core's vector unit
    b, n, s, d = 1, 4, 512, 128
    q = np.zeros((b, n, s, d), np.float16)
    t = TensorType(q.shape, DType.f16)
    tiling = choose_flash_tiling(t, t, t, False, False, chip)

    def vector_busy(cap: float) -> float:
        ctx = LaunchContext(chip, Cores(chip.cube_cores), GlobalMemory(chip), ["q", "k", "v"], ["o"], compute=False)
        flash_attention_forward(q, q, q, None, False, 0.1, tiling, ctx, softcap=cap)
        return float(ctx.cores.busy[PIPE_INDEX["VECTOR"]].sum())

    tiles = b * n * -(-s // tiling.s1) * -(-s // tiling.s2)
    passes = 2 + lookup("ge.tanh").VECTOR_PASSES
    expected = tiles * vector_cycles(chip, tiling.s1 * tiling.s2 * 4, passes)
    assert vector_busy(30.0) - vector_busy(0.0) == pytest.approx(float(expected))


def test_a_negative_cap_is_refused_where_it_is_written():
    text = _graph((1, 1, 16, 16), "f32", -1.0, False, False)
    from geir.diagnostics import DiagnosticError

    with pytest.raises(DiagnosticError, match="softcap must be a finite number >= 0"):
        compile_module(parse(text, "<bad>"))


def test_an_unfused_capped_attention_computes_the_same():
    # the fusion guard expands a ge.flash_attention it cannot run back into primitive ops: the cap comes along
    from geir.ir import Module
    from geir.passes.fusion.guards import decompose_flash_attention
    from geir.passes.pattern import Rewriter
    from geir.reference import run_graph

    shape = (1, 2, 32, 16)
    module = parse(_graph(shape, "f32", 1.5, True, False), "<softcap>")
    graph = module.graphs[0]
    rng = np.random.default_rng(0)
    feed = {a.name: rng.standard_normal(shape).astype(np.float32) * 3 for a in graph.args}
    fa = next(op for op in graph.ops if op.name == "ge.flash_attention")
    decompose_flash_attention(fa, Rewriter(graph))
    assert "ge.tanh" in [op.name for op in graph.ops] and "ge.flash_attention" not in [op.name for op in graph.ops]
    (out,) = run_graph(Module([graph]).graphs[0], feed)
    ref = _formula(feed["q"], feed["k"], feed["v"], None, 0.125, 1.5, True, np.float64)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_gemma2_attention_fuses_with_its_softcap_and_equals_torch(last_hidden):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from geir.frontends.torch import compile as geir_compile

    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    attn_logit_softcapping=1.0, final_logit_softcapping=None, sliding_window=8,
                                    max_position_embeddings=64)
    cfg._attn_implementation = "eager"  # the softcap is eager attention's: what HF runs Gemma 2 with
    model = transformers.Gemma2Model(cfg).eval()

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = geir_compile(last_hidden(model), (ids, mask))
    attention = [op for op in compiled.graph.ops if op.name == "ge.flash_attention"]
    assert len(attention) == cfg.num_hidden_layers
    assert all(op.attr("softcap") == cfg.attn_logit_softcapping for op in attention)
    assert all(op.attr("scale") == pytest.approx(cfg.query_pre_attn_scalar ** -0.5) for op in attention)
    assert "ge.tanh" not in [op.name for op in compiled.graph.ops]
    actual = compiled(ids, mask).numpy()
    with torch.no_grad():
        eager = last_hidden(model)(ids, mask).numpy()
        reference = last_hidden(model.double())(ids, mask).numpy()
    verdict = compare(actual, reference, TensorType(actual.shape, DType.f32), eager)
    assert verdict.passed, verdict.render("last_hidden_state")
    assert math.isfinite(float(np.abs(actual).max()))
