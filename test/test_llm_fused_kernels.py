"""The rotary embedding and GLU kernels (issue 28 item 1) against formulas written here: RoPE as a rotation of
complex numbers by the position's angle (half mode pairs feature i with i + r/2, interleaved mode 2i with 2i+1),
SwiGLU/GeGLU from the activations' definitions, all in float64; bit-exact against the op's own semantics; and
their tilings and costs (UB budgets that fit, shrinking, the bytes a launch moves)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from geir.diagnostics import DiagnosticEngine
from geir.kernels import KERNELS, LaunchContext
from geir.kernels.tiling import OpSignature
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.reference import run_op
from geir.target_npu import load_target
from geir.target_npu.sim import PIPE_INDEX, Cores, GlobalMemory

TOL = {"f32": 2e-6, "f16": 2e-3}
NP = {"f32": np.float32, "f16": np.float16}


def _op(text: str):
    """The first op of a one-op graph, tiled for ascend910b (as geopt --passes=tile leaves it)."""
    module = parse(text)
    diags: list = []
    ctx = PassContext(target="ascend910b", diagnostics=DiagnosticEngine(diags.append))
    assert PassManager(complete_pipeline(parse_pipeline("tile"))).run(module, ctx), diags
    return module.graphs[0].ops[0]


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _launch(op, inputs):
    t = load_target("ascend910b")
    ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), [v.name for v in op.operands],
                        [r.name for r in op.results])
    kernel = KERNELS[op.name]
    return kernel.run(op, inputs, kernel.tiling_for(op, inputs, t), ctx)[0], ctx


def _tables(seq: int, r: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """HF's cos/sin tables for positions 0..seq-1 (base 10000): each frequency twice, side by side (half) or
    in adjacent pairs (interleave); and the angles, [seq, r/2]."""
    inv_freq = 1.0 / 10000 ** (np.arange(0, r, 2) / r)
    theta = np.arange(seq)[:, None] * inv_freq[None, :]
    wide = np.concatenate([theta, theta], -1) if mode == "half" else np.repeat(theta, 2, axis=-1)
    return np.cos(wide), np.sin(wide), theta


def _rope_formula(x: np.ndarray, theta: np.ndarray, r: int, mode: str) -> np.ndarray:
    """x's first r features turned by exp(i theta) as complex pairs, the rest unchanged (float64)."""
    x = x.astype(np.float64)
    h = r // 2
    re, im = (x[..., :h], x[..., h:r]) if mode == "half" else (x[..., 0:r:2], x[..., 1:r:2])
    z = (re + 1j * im) * np.exp(1j * theta)
    y = x.copy()
    if mode == "half":
        y[..., :h], y[..., h:r] = z.real, z.imag
    else:
        y[..., 0:r:2], y[..., 1:r:2] = z.real, z.imag
    return y


ROPE_CASES = [  # (x shape [B, N, S, D], rotary_dim, mode, tables per head: cos/sin as big as x, not resident)
    ((2, 4, 37, 64), 64, "half", False),
    ((1, 3, 50, 64), 16, "half", False),       # GPT-NeoX's rotary_pct = 0.25
    ((2, 2, 33, 32), 32, "interleave", False),
    ((1, 2, 20, 80), 32, "interleave", True),  # GPT-J's partial rotary_dim, tables streamed
    ((3, 2, 300, 128), 128, "half", True),     # several waves of row tiles
]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("shape, r, mode, per_head", ROPE_CASES)
def test_rotary_kernel_turns_each_pair_by_its_angle(shape, r, mode, per_head, dtype):
    b, n, s, d = shape
    cos, sin, theta = _tables(s, r, mode)
    tshape = (b, n, s, r) if per_head else (1, 1, s, r)
    cos, sin = (np.broadcast_to(t, tshape).astype(NP[dtype]) for t in (cos, sin))
    x = np.random.default_rng(0).standard_normal(shape).astype(NP[dtype])
    ty = lambda shp: f"tensor<{'x'.join(map(str, shp))}x{dtype}>"  # noqa: E731
    op = _op(f"ge.graph @main(%x: {ty(shape)}, %cos: {ty(tshape)}, %sin: {ty(tshape)}) -> {ty(shape)} {{\n"
             f"  %y = ge.rotary_embedding %x, %cos, %sin {{mode = \"{mode}\", rotary_dim = {r}}}\n  ge.return %y\n}}")
    out, ctx = _launch(op, [x, cos, sin])
    want = _rope_formula(x, theta, r, mode)  # the formula from the angles, not from the rounded tables
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)
    np.testing.assert_array_equal(out[..., r:], x[..., r:])  # the passed-through features are copied untouched
    ref = run_op(op, [x, cos, sin])[0]
    assert _bits_equal(out, ref), "the kernel computes the op's semantics"
    assert ctx.gm.gm_write_bytes == x.nbytes  # every row written once
    assert ctx.gm.gm_read_bytes >= x.nbytes + (cos.nbytes + sin.nbytes if per_head else 0)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("qshape, kshape, r, mode", [
    ((1, 4, 200, 64), None, 64, "half"),            # one tensor, the positions over every core
    ((2, 8, 301, 128), (2, 2, 301, 128), 128, "half"),  # q and k in one launch, grouped KV heads, ragged blocks
    ((1, 3, 1000, 80), None, 32, "interleave"),     # partial rotation, several tiles a block
])
def test_rotary_tables_shared_by_the_heads_cross_mte2_once(qshape, kshape, r, mode, dtype):
    """cos/sin [1, 1, S, r] too big to stay resident, S at least the cores: each core turns its block of positions
    in every head with the tables loaded once (ops-transformer's ABA walk), so the launch reads q, k and the two
    tables exactly once each; the results are the op's semantics bit for bit and the angle formula's."""
    s = qshape[2]
    cos, sin, theta = _tables(s, r, mode)
    cos, sin = (np.broadcast_to(t, (1, 1, s, r)).astype(NP[dtype]) for t in (cos, sin))
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(shp).astype(NP[dtype]) for shp in (qshape, kshape) if shp is not None]
    ty = lambda shp: f"tensor<{'x'.join(map(str, shp))}x{dtype}>"  # noqa: E731
    names = ["%q", "%k"][:len(xs)]
    args = ", ".join(f"{n}: {ty(x.shape)}" for n, x in zip(names, xs))
    op = _op(f"ge.graph @main({args}, %cos: {ty(cos.shape)}, %sin: {ty(sin.shape)}) -> "
             f"({', '.join(ty(x.shape) for x in xs)}) {{\n"
             f"  {', '.join(f'%y{i}' for i in range(len(xs)))} = ge.rotary_embedding %q, %cos, %sin"
             f"{', %k' if len(xs) > 1 else ''} {{mode = \"{mode}\", rotary_dim = {r}}}\n"
             f"  ge.return {', '.join(f'%y{i}' for i in range(len(xs)))}\n}}")
    inputs = [xs[0], cos, sin, *xs[1:]]
    t = load_target("ascend910b")
    kernel = KERNELS[op.name]
    tiling = kernel.tiling_for(op, inputs, t)
    assert cos.nbytes * 8 > t.buffer_bytes("ub") and s >= tiling.cores  # streamed tables, a block for every core
    ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), [v.name for v in op.operands],
                        [res.name for res in op.results])
    outs = kernel.run(op, inputs, tiling, ctx)
    assert all(_bits_equal(a, b) for a, b in zip(outs, run_op(op, inputs)))
    for x, got in zip(xs, outs):
        np.testing.assert_allclose(got.astype(np.float64), _rope_formula(x, theta, r, mode), rtol=TOL[dtype],
                                   atol=TOL[dtype] * 4)
    assert ctx.gm.gm_read_bytes == sum(x.nbytes for x in xs) + cos.nbytes + sin.nbytes
    assert ctx.gm.gm_write_bytes == sum(x.nbytes for x in xs)


def test_rotary_vector_time_follows_the_rotated_share_of_the_row():
    """A quarter of the head dim rotated costs the vector unit less than the whole row, more than a copy (the same
    row tiles for both: tables too big to stay resident at either width, so only the instructions per element
    differ)."""
    def vector_cycles(r: int, tiling: dict) -> float:
        shape, tshape = (1, 8, 1024, 128), (1, 1, 1024, r)
        op = _op(f"ge.graph @main(%x: tensor<1x8x1024x128xf16>, %c: tensor<1x1x1024x{r}xf16>, "
                 f"%s: tensor<1x1x1024x{r}xf16>) -> tensor<1x8x1024x128xf16> {{\n"
                 f"  %y = ge.rotary_embedding %x, %c, %s {{rotary_dim = {r}}}\n  ge.return %y\n}}")
        op.attributes["tiling"] = tiling
        rng = np.random.default_rng(1)
        _, ctx = _launch(op, [rng.standard_normal(shape).astype(np.float16),
                              *(rng.standard_normal(tshape).astype(np.float16) for _ in range(2))])
        return float(ctx.cores.busy[PIPE_INDEX["VECTOR"]].sum())

    tiling = {"template": "RotaryEmbedding", "rows": 32, "buffers": 2, "cores": 32, "ub_bytes": 0}
    full, quarter = vector_cycles(128, tiling), vector_cycles(32, tiling)
    # per element of the row: rotated 4 + 2 casts, passed through 1 (module docstring of geir.kernels.rotary)
    assert quarter / full == pytest.approx((32 * 6 + 96 * 1) / (128 * 6), rel=0.05)


def test_rotary_tiling_fits_ub_and_shrinks_to_one_row():
    op = _op("ge.graph @main(%x: tensor<4x32x4096x128xf16>, %c: tensor<1x1x4096x128xf16>, "
             "%s: tensor<1x1x4096x128xf16>) -> tensor<4x32x4096x128xf16> {\n"
             "  %y = ge.rotary_embedding %x, %c, %s {rotary_dim = 128}\n  ge.return %y\n}")
    kernel, target = KERNELS[op.name], load_target("ascend910b")
    sig = OpSignature.of(op)
    tiling = kernel.decode(op.attributes["tiling"])
    budget = kernel.budget(tiling, sig, target)
    assert budget.overflow(target) is None and budget.ub == tiling.ub_bytes
    # one row: x, result and both (streamed: 1 MiB tables do not stay resident) table rows in f16, twice, and the
    # f32 working rows (rotated copy, sum, the row's f32 copy)
    per_row = (2 * 128 + 2 * 128 + 2 * 2 * 128) * 2 + 4 * (2 * 128 + 128)
    assert budget.ub == tiling.rows * per_row
    rows = []
    while (smaller := kernel.shrink(tiling)) is not None:
        tiling = smaller[0]
        rows.append(tiling.rows)
    assert rows[-2:] == [1, 1] and tiling.buffers == 1  # halved to one row, then single-buffered
    for cand in kernel.candidates(sig, target):
        assert kernel.budget(cand, sig, target).overflow(target) is None


def _silu(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))


def _gelu(g: np.ndarray) -> np.ndarray:
    return 0.5 * g * (1.0 + np.vectorize(math.erf)(g / math.sqrt(2.0)))


def _gelu_tanh(g: np.ndarray) -> np.ndarray:
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


GATES = {"silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh}


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("activation", list(GATES))
@pytest.mark.parametrize("shape", [(2, 16, 128), (3, 77, 1000)])
def test_glu_kernel_is_the_activated_gate_times_up(shape, activation, dtype):
    rng = np.random.default_rng(2)
    gate, up = (rng.standard_normal(shape).astype(NP[dtype]) * 3 for _ in range(2))
    t = f"tensor<{'x'.join(map(str, shape))}x{dtype}>"
    op = _op(f"ge.graph @main(%g: {t}, %u: {t}) -> {t} {{\n"
             f"  %y = ge.glu %g, %u {{activation = \"{activation}\"}}\n  ge.return %y\n}}")
    out, ctx = _launch(op, [gate, up])
    want = GATES[activation](gate.astype(np.float64)) * up.astype(np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * scale)
    ref = run_op(op, [gate, up])[0]
    assert _bits_equal(out, ref), "the kernel computes the op's semantics"
    assert ctx.gm.gm_read_bytes == gate.nbytes + up.nbytes and ctx.gm.gm_write_bytes == out.nbytes


def test_glu_tiling_budgets_what_it_streams():
    op = _op("ge.graph @main(%g: tensor<4096x11008xf16>, %u: tensor<4096x11008xf16>) -> tensor<4096x11008xf16> {\n"
             "  %y = ge.glu %g, %u\n  ge.return %y\n}")
    kernel, target = KERNELS[op.name], load_target("ascend910b")
    sig = OpSignature.of(op)
    tiling = kernel.decode(op.attributes["tiling"])
    budget = kernel.budget(tiling, sig, target)
    # gate, up and the product in f16, double-buffered, and two f32 working copies
    assert budget.ub == tiling.elems * ((2 + 2 + 2) * 2 + 4 * 2) and budget.overflow(target) is None
    assert tiling.elems * ((2 + 2 + 2) * 2 + 4 * 2) * 2 > target.buffer_bytes("ub")  # as many as fit
    for cand in kernel.candidates(sig, target):
        assert kernel.budget(cand, sig, target).overflow(target) is None


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 77, 2000)])
def test_glu_of_a_merged_gate_up_is_torch_swiglu_and_the_split_form_bit_for_bit(shape, dtype):
    """One operand [..., 2h]: silu of its first half times its second, as torch_npu's npu_swiglu(x, dim=-1)
    (torch's silu(chunk 0) * chunk 1 in float64 the oracle), and bit for bit what glu(gate, up) gives from the split
    halves; the kernel reads each half's bytes once."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(shape) * 3).astype(NP[dtype])
    t = f"tensor<{'x'.join(map(str, shape))}x{dtype}>"
    h = shape[-1] // 2
    half_t = f"tensor<{'x'.join(map(str, shape[:-1] + (h,)))}x{dtype}>"
    op = _op(f"ge.graph @main(%x: {t}) -> {half_t} {{\n  %y = ge.glu %x\n  ge.return %y\n}}")
    out, ctx = _launch(op, [x])
    gate, up = torch.from_numpy(x.astype(np.float64)).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).numpy()
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * scale)
    split = _op(f"ge.graph @main(%g: {half_t}, %u: {half_t}) -> {half_t} {{\n"
                f"  %y = ge.glu %g, %u\n  ge.return %y\n}}")
    two, _ = _launch(split, [np.ascontiguousarray(x[..., :h]), np.ascontiguousarray(x[..., h:])])
    assert _bits_equal(out, two)
    assert ctx.gm.gm_read_bytes == x.nbytes and ctx.gm.gm_write_bytes == out.nbytes


def test_glu_of_an_odd_merged_axis_is_a_shape_error():
    from geir.verifier import verify_module

    with pytest.raises(Exception, match="even last axis"):
        module = parse("ge.graph @main(%x: tensor<2x7xf32>) -> tensor<2x3xf32> {\n  %y = ge.glu %x\n  ge.return %y\n}")
        verify_module(module)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("qshape, kshape, r, mode", [
    ((1, 4, 1, 64), (1, 2, 1, 64), 64, "half"),        # a decode step, grouped KV heads
    ((2, 8, 37, 32), (2, 2, 37, 32), 16, "half"),      # a prefill, partial rotation: rows split across tiles
    ((1, 3, 300, 128), (1, 3, 300, 128), 128, "interleave"),  # several waves, q and k meeting inside one
])
def test_rotary_pair_is_each_rotation_bit_for_bit_in_one_launch(qshape, kshape, r, mode, dtype):
    """q and k rotated in one launch: each result is the one-tensor kernel's, bit for bit, and the angle formula's
    within rounding; every row read and written once, the tables no more than the two launches read them."""
    s = qshape[2]
    cos, sin, theta = _tables(s, r, mode)
    cos, sin = (np.broadcast_to(t, (1, 1, s, r)).astype(NP[dtype]) for t in (cos, sin))
    rng = np.random.default_rng(3)
    q, k = (rng.standard_normal(shp).astype(NP[dtype]) for shp in (qshape, kshape))
    ty = lambda shp: f"tensor<{'x'.join(map(str, shp))}x{dtype}>"  # noqa: E731
    tables = f"%cos: {ty(cos.shape)}, %sin: {ty(sin.shape)}"
    pair = _op(f"ge.graph @main(%q: {ty(qshape)}, %k: {ty(kshape)}, {tables}) -> ({ty(qshape)}, {ty(kshape)}) {{\n"
               f"  %a, %b = ge.rotary_embedding %q, %cos, %sin, %k {{mode = \"{mode}\", rotary_dim = {r}}}\n"
               f"  ge.return %a, %b\n}}")
    t = load_target("ascend910b")
    ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), [v.name for v in pair.operands],
                        [res.name for res in pair.results])
    kernel = KERNELS[pair.name]
    qo, ko = kernel.run(pair, [q, cos, sin, k], kernel.tiling_for(pair, [q, cos, sin, k], t), ctx)
    read = 0
    for x, got in ((q, qo), (k, ko)):
        one = _op(f"ge.graph @main(%x: {ty(x.shape)}, {tables}) -> {ty(x.shape)} {{\n"
                  f"  %y = ge.rotary_embedding %x, %cos, %sin {{mode = \"{mode}\", rotary_dim = {r}}}\n"
                  f"  ge.return %y\n}}")
        alone, actx = _launch(one, [x, cos, sin])
        read += actx.gm.gm_read_bytes
        assert _bits_equal(got, alone)
        np.testing.assert_allclose(got.astype(np.float64), _rope_formula(x, theta, r, mode), rtol=TOL[dtype],
                                   atol=TOL[dtype] * 4)
    assert all(_bits_equal(a, b) for a, b in zip((qo, ko), run_op(pair, [q, cos, sin, k])))
    assert ctx.gm.gm_write_bytes == q.nbytes + k.nbytes
    assert q.nbytes + k.nbytes <= ctx.gm.gm_read_bytes <= read


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("activation, transpose_b", [("silu", False), ("gelu_tanh", True)])
def test_matmul_glu_epilogue_is_the_glu_of_the_f32_product_rounded_once(activation, transpose_b, dtype):
    """fused_matmul {glu}: ge.glu's own semantics on the f32 product, rounded once to the dtype. Multiples of 1/64
    make every partial sum exact in f32 (21 bits at most), so the product the oracle hands glu is the accumulator
    whatever the k order, and one that f16 cannot hold (a product rounded first would differ); the result has half
    the product's columns."""
    M, K, N = 70, 96, 2 * 200
    rng = np.random.default_rng(11)
    x = (rng.integers(-127, 128, (M, K)) / 64).astype(NP[dtype])
    w = (rng.integers(-127, 128, (N, K) if transpose_b else (K, N)) / 64).astype(NP[dtype])
    wt = f"tensor<{'x'.join(map(str, w.shape))}x{dtype}>"
    attrs = f'glu = "{activation}"' + (", transpose_b = true" if transpose_b else "")
    op = _op(f"ge.graph @main(%x: tensor<{M}x{K}x{dtype}>, %w: {wt}) -> tensor<{M}x{N // 2}x{dtype}> {{\n"
             f"  %y = ge.fused_matmul %x, %w {{{attrs}}}\n  ge.return %y\n}}")
    out, _ = _launch(op, [x, w])
    product = (x.astype(np.float64) @ (w.T if transpose_b else w).astype(np.float64)).astype(np.float32)
    glu = _op(f"ge.graph @main(%p: tensor<{M}x{N}xf32>) -> tensor<{M}x{N // 2}xf32> {{\n"
              f"  %y = ge.glu %p {{activation = \"{activation}\"}}\n  ge.return %y\n}}")
    want = np.asarray(run_op(glu, [product])[0]).astype(NP[dtype])
    assert _bits_equal(out, want)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_llama_mlp_with_the_swiglu_epilogue_passes_the_torch_compile_rule(dtype):
    """A LLaMA MLP, (silu(x Wg) * (x Wu)) Wd, written on the merged gate-up weight: fuse makes the gate-up matmul
    with SwiGLU as its epilogue, and the two kernels' result passes torch.compile's accuracy rule against torch in
    float64, with torch in the dtype as the eager baseline."""
    torch = pytest.importorskip("torch")
    from geir.accuracy import compare
    from geir.types import DType, TensorType

    S, H, F = 37, 256, 344
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, S, H)).astype(NP[dtype])
    wg, wu = ((rng.standard_normal((H, F)) / math.sqrt(H)).astype(NP[dtype]) for _ in range(2))
    wd = (rng.standard_normal((F, H)) / math.sqrt(F)).astype(NP[dtype])
    wgu = np.concatenate([wg, wu], axis=1)
    module = parse(f"ge.graph @main(%x: tensor<1x{S}x{H}x{dtype}>, %wgu: tensor<{H}x{2 * F}x{dtype}>, "
                   f"%wd: tensor<{F}x{H}x{dtype}>) -> tensor<1x{S}x{H}x{dtype}> {{\n"
                   f"  %m = ge.matmul %x, %wgu\n  %h = ge.glu %m\n  %y = ge.matmul %h, %wd\n  ge.return %y\n}}")
    diags: list = []
    ctx = PassContext(target="ascend910b", diagnostics=DiagnosticEngine(diags.append))
    assert PassManager(complete_pipeline(parse_pipeline("fuse,tile"))).run(module, ctx), diags
    gate_up, down = [op for op in module.graphs[0].ops if op.name != "ge.return"]
    assert (gate_up.name, gate_up.attr("glu"), down.name) == ("ge.fused_matmul", "silu", "ge.matmul")
    h, _ = _launch(gate_up, [x, wgu])
    y, _ = _launch(down, [h, wd])

    def mlp(t: type) -> np.ndarray:
        xt, g, u, d = (torch.from_numpy(a).to(t) for a in (x, wg, wu, wd))
        return ((torch.nn.functional.silu(xt @ g) * (xt @ u)) @ d).numpy()

    verdict = compare(y, mlp(torch.float64), TensorType(y.shape, DType.from_numpy(y.dtype)),
                      mlp(torch.float32 if dtype == "f32" else torch.float16))
    assert verdict.passed, verdict.render("y")
