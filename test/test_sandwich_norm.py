"""Gemma2's sandwich norms as one row kernel (issue 28): ge.rms_norm_add_rms_norm, `s = x1 + rms_norm(x2, g1)` and
`rms_norm(s, g2)`, against numpy formulas written here, its GM traffic against the analytic count and its time
against the unfused pair; a tiny random-init Gemma2 fused (every sandwich one kernel) against torch in float64.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from geir.accuracy import compare
from geir.kernels import KERNELS
from geir.target_npu import load_target
from geir.types import DType, TensorType

from test_add_norm_kernel import NP, TOLERANCE, _launch, _tiled

EPS1, EPS2 = 1e-5, 1e-6


def _graph(shape: tuple[int, ...], dtype: str) -> str:
    t = f"tensor<{'x'.join(map(str, shape))}x{dtype}>"
    p = f"tensor<{shape[-1]}x{dtype}>"
    return (f"ge.graph @main(%x: {t}, %o: {t}, %g1: {p}, %g2: {p}) -> ({t}, {t}) {{\n"
            f"  %h, %y = ge.rms_norm_add_rms_norm %x, %o, %g1, %g2 {{epsilon = {EPS2}, x2_epsilon = {EPS1}}}"
            f" : {t}, {t}\n  ge.return %h, %y\n}}")


def _inputs(shape, dtype: str, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = NP[dtype]
    x, o = (rng.standard_normal(shape).astype(dt) for _ in range(2))
    return [x, 3 * o, *(rng.standard_normal(shape[-1]).astype(dt) for _ in range(2))]


def _rms(a, g, eps):
    return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps) * g


def _formula(x, o, g1, g2):
    """The unfused ops in float64, each result rounded to the input dtype as the unfused graph stores it."""
    dt = x.dtype
    f = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    n = _rms(f(o), f(g1), EPS1).astype(dt)
    s = (f(x) + f(n)).astype(dt)
    return f(s), _rms(f(s), f(g2), EPS2)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("shape", [(3, 37, 96), (2, 8000)], ids=["rows", "long-rows"])
def test_sandwich_kernel_matches_the_formula(shape, dtype):
    op = _tiled(_graph(shape, dtype)).ops[0]
    tiling = KERNELS[op.name].decode(op.attributes["tiling"])
    # an f32 row of 8000 streams 4 tensors x 4 bytes x 2 buffers = 256 KB through the 910B's 192 KB UB: segments
    assert (tiling.segments > 1) == (shape[-1] == 8000 and dtype == "f32"), tiling
    inputs = _inputs(shape, dtype)
    (total, norm), _ = _launch(op, inputs)
    s, y = _formula(*inputs)
    assert total.dtype == norm.dtype == NP[dtype]
    rtol, atol = TOLERANCE[dtype]
    # the sum adds x1 to x2's norm rounded once: within one rounding of the formula's (the norm in f32 vs f64)
    np.testing.assert_allclose(total.astype(np.float64), s, rtol=rtol, atol=atol * max(1.0, np.abs(s).max()))
    np.testing.assert_allclose(norm.astype(np.float64), y, rtol=rtol, atol=atol * max(1.0, np.abs(y).max()))


@pytest.mark.parametrize("shape", [(4, 64, 256), (2, 8000)], ids=["rows", "segmented"])
def test_sandwich_kernel_moves_the_analytic_bytes(shape):
    # whole rows: x1 and x2 in, the sum and the norm out. A segmented row reads x2 once more for its statistics and
    # the sum back for the apply pass. Only the gammas are read beside that (once per vector unit that runs a tile)
    op = _tiled(_graph(shape, "f32")).ops[0]
    inputs = _inputs(shape, "f32")
    _, ctx = _launch(op, inputs)
    nbytes = inputs[0].nbytes
    segmented = KERNELS[op.name].decode(op.attributes["tiling"]).segments > 1
    assert segmented == (shape[-1] == 8000)
    assert ctx.gm.gm_write_bytes == 2 * nbytes
    gamma_reads = ctx.gm.gm_read_bytes - (4 if segmented else 2) * nbytes
    assert 0 <= gamma_reads <= load_target("ascend910b").vector_cores * (inputs[2].nbytes + inputs[3].nbytes)


def test_the_sandwich_kernel_is_faster_than_the_norm_then_the_add_norm():
    # the same rows through ge.rms_norm and ge.add_rms_norm: x2's norm is written, then read back
    t, p = "tensor<8x512x1024xf16>", "tensor<1024xf16>"
    unfused = _tiled(f"ge.graph @main(%x: {t}, %o: {t}, %g1: {p}, %g2: {p}) -> ({t}, {t}) {{\n"
                     f"  %n = ge.rms_norm %o, %g1 {{epsilon = 1e-5}} : {t}\n"
                     f"  %h, %y = ge.add_rms_norm %x, %n, %g2 {{epsilon = 1e-6}} : {t}, {t}\n"
                     f"  ge.return %h, %y\n}}")
    x, o, g1, g2 = _inputs((8, 512, 1024), "f16")
    (n,), norm_ctx = _launch(unfused.ops[0], [o, g1])
    _, add_ctx = _launch(unfused.ops[1], [x, n, g2])
    _, ctx = _launch(_tiled(_graph((8, 512, 1024), "f16")).ops[0], [x, o, g1, g2])
    assert ctx.cores.finish < norm_ctx.cores.finish + add_ctx.cores.finish
    moved = lambda c: c.gm.gm_read_bytes + c.gm.gm_write_bytes  # noqa: E731
    assert moved(ctx) < moved(norm_ctx) + moved(add_ctx)


def test_gemma2_sandwich_norms_fuse_and_the_decoder_equals_torch(last_hidden):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from geir.frontends.torch import compile as geir_compile

    layers = 2
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    model = transformers.Gemma2Model(cfg).eval()
    for p in model.parameters():  # Gemma's RMSNorm scales by (1 + w), w initialised to 0: make the scales differ
        if p.ndim == 1:
            torch.nn.init.normal_(p, std=0.5)

    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = geir_compile(last_hidden(model), (ids, mask))
    kinds = [op.name for op in compiled.graph.ops]
    # per layer: post_attention -> residual add -> pre_feedforward, and post_feedforward -> residual add -> the next
    # layer's input norm (the last layer's: the final norm); only the first layer's input norm stays alone
    assert kinds.count("ge.rms_norm_add_rms_norm") == 2 * layers
    assert kinds.count("ge.rms_norm") == 1 and "ge.add_rms_norm" not in kinds
    actual = compiled(ids, mask).numpy()
    with torch.no_grad():
        eager = last_hidden(model)(ids, mask).numpy()
        reference = last_hidden(model.double())(ids, mask).numpy()
    verdict = compare(actual, reference, TensorType(actual.shape, DType.f32), eager)
    assert verdict.passed, verdict.render("last_hidden_state")
