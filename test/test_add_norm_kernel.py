"""The residual add + norm kernels (ge.add_rms_norm, ge.add_layer_norm) and flash_attention's BSND layout with a
mask, against numpy formulas written here; the fused kernel's GM traffic against the analytic count."""

from __future__ import annotations

import numpy as np
import pytest

from geir.diagnostics import DiagnosticEngine
from geir.kernels import KERNELS, LaunchContext
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.target_npu import load_target
from geir.target_npu.sim import Cores, GlobalMemory

TOLERANCE = {"f32": (1e-5, 1e-5), "f16": (1e-2, 1e-3)}
NP = {"f32": np.float32, "f16": np.float16}


def _tiled(text: str):
    """The graph after the tile pass (each op carries its tiling)."""
    module = parse(text)
    diags = []
    ctx = PassContext(target="ascend910b", diagnostics=DiagnosticEngine(diags.append))
    assert PassManager(complete_pipeline(parse_pipeline("tile"))).run(module, ctx), diags
    return module.graphs[0]


def _launch(op, inputs):
    t = load_target("ascend910b")
    ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), [v.name for v in op.operands],
                        [r.name for r in op.results])
    kernel = KERNELS[op.name]
    return kernel.run(op, inputs, kernel.tiling_for(op, inputs, t), ctx), ctx


def _add_norm_graph(kind: str, shape: tuple[int, ...], dtype: str) -> str:
    t = f"tensor<{'x'.join(map(str, shape))}x{dtype}>"
    p = f"tensor<{shape[-1]}x{dtype}>"
    if kind == "rms":
        params, args, attrs = f"%g: {p}", "%g", "{epsilon = 1e-6}"
        op = "ge.add_rms_norm"
    else:
        params, args, attrs = f"%g: {p}, %b: {p}", "%g, %b", "{epsilon = 1e-5}"
        op = "ge.add_layer_norm"
    return (f"ge.graph @main(%x: {t}, %r: {t}, {params}) -> ({t}, {t}) {{\n"
            f"  %h, %n = {op} %x, %r, {args} {attrs} : {t}, {t}\n  ge.return %h, %n\n}}")


def _formula(kind: str, x, r, g, b=None):
    """The residual sum (rounded to the input dtype, as the unfused add stores it) and its norm, in float64."""
    s = (x.astype(np.float64) + r.astype(np.float64)).astype(x.dtype).astype(np.float64)
    if kind == "rms":
        return s, s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-6) * g
    d = s - s.mean(axis=-1, keepdims=True)
    return s, d / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + 1e-5) * g + b


def _inputs(kind: str, shape, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    dt = NP[dtype]
    x, r = (rng.standard_normal(shape).astype(dt) for _ in range(2))
    params = [rng.standard_normal(shape[-1]).astype(dt) for _ in range(1 if kind == "rms" else 2)]
    return [x, r, *params]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("shape", [(3, 37, 96), (2, 8000)], ids=["rows", "long-rows"])
def test_add_norm_kernel_matches_the_formula(kind, dtype, shape):
    op = _tiled(_add_norm_graph(kind, shape, dtype)).ops[0]
    tiling = KERNELS[op.name].decode(op.attributes["tiling"])
    # an f32 row of 8000 streams 4 tensors x 4 bytes x 2 buffers = 256 KB through the 910B's 192 KB UB: segments
    assert (tiling.segments > 1) == (shape[-1] == 8000 and dtype == "f32"), tiling
    inputs = _inputs(kind, shape, dtype)
    (total, norm), _ = _launch(op, inputs)
    s, y = _formula(kind, *[a.astype(np.float64) if i > 1 else a for i, a in enumerate(inputs)])
    assert total.dtype == norm.dtype == NP[dtype]
    assert np.array_equal(total.astype(np.float64), s), "the sum is the add's, rounded once"
    rtol, atol = TOLERANCE[dtype]
    np.testing.assert_allclose(norm.astype(np.float64), y, rtol=rtol, atol=atol * max(1.0, np.abs(y).max()))


@pytest.mark.parametrize("shape", [(4, 64, 256), (2, 8000)], ids=["rows", "segmented"])
def test_add_norm_kernel_moves_the_analytic_bytes(shape):
    # whole rows: x1 and x2 in, the sum and the norm out; segmented rows also read the sum back for the apply pass.
    # Only gamma is read beside that (once per vector unit that runs a tile)
    op = _tiled(_add_norm_graph("rms", shape, "f32")).ops[0]
    inputs = _inputs("rms", shape, "f32")
    _, ctx = _launch(op, inputs)
    nbytes = inputs[0].nbytes
    segmented = KERNELS[op.name].decode(op.attributes["tiling"]).segments > 1
    assert segmented == (shape[-1] == 8000)
    assert ctx.gm.gm_write_bytes == 2 * nbytes
    gamma_reads = ctx.gm.gm_read_bytes - (3 if segmented else 2) * nbytes
    assert 0 <= gamma_reads <= load_target("ascend910b").vector_cores * inputs[2].nbytes


def test_the_fused_kernel_is_faster_than_the_add_then_the_norm():
    # the same rows through ge.add and ge.rms_norm: the sum is written, then read back by the norm
    t = "tensor<8x512x1024xf16>"
    unfused = _tiled(f"ge.graph @main(%x: {t}, %r: {t}, %g: tensor<1024xf16>) -> ({t}, {t}) {{\n"
                     f"  %h = ge.add %x, %r : {t}\n  %n = ge.rms_norm %h, %g {{epsilon = 1e-6}} : {t}\n"
                     f"  ge.return %h, %n\n}}")
    inputs = _inputs("rms", (8, 512, 1024), "f16")
    (h,), add_ctx = _launch(unfused.ops[0], inputs[:2])
    _, norm_ctx = _launch(unfused.ops[1], [h, inputs[2]])
    fused = _tiled(_add_norm_graph("rms", (8, 512, 1024), "f16")).ops[0]
    _, ctx = _launch(fused, inputs)
    assert ctx.cores.finish < add_ctx.cores.finish + norm_ctx.cores.finish
    assert ctx.gm.gm_read_bytes + ctx.gm.gm_write_bytes < (
        add_ctx.gm.gm_read_bytes + add_ctx.gm.gm_write_bytes + norm_ctx.gm.gm_read_bytes + norm_ctx.gm.gm_write_bytes)


def test_flash_attention_bsnd_with_a_mask_matches_the_formula():
    B, S, N, NKV, D = 2, 24, 4, 2, 16
    t = lambda n: f"tensor<{B}x{S}x{n}x{D}xf32>"  # noqa: E731
    graph = _tiled(f"ge.graph @main(%q: {t(N)}, %k: {t(NKV)}, %v: {t(NKV)}, %m: tensor<{B}x1x{S}x{S}xi1>) -> {t(N)} {{\n"
                   f"  %o = ge.flash_attention %q, %k, %v, %m {{causal = false, layout = \"BSND\", scale = 0.25}} : {t(N)}\n"
                   f"  ge.return %o\n}}")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, S, N, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, NKV, D)).astype(np.float32) for _ in range(2))
    mask = rng.random((B, 1, S, S)) > 0.3
    mask[..., 0] = True  # every query sees a key
    (out,), _ = _launch(graph.ops[0], [q, k, v, mask])
    # softmax(0.25 q k^T masked) v per head, the query heads 2h and 2h+1 sharing kv head h; in [B, S, N, D]
    qh, kh, vh = (np.swapaxes(a, 1, 2).astype(np.float64) for a in (q, k, v))
    kh, vh = np.repeat(kh, N // NKV, axis=1), np.repeat(vh, N // NKV, axis=1)
    s = np.where(mask, 0.25 * qh @ np.swapaxes(kh, -1, -2), -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    want = np.swapaxes((p / p.sum(axis=-1, keepdims=True)) @ vh, 1, 2)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
