"""The reference interpreter against independent formulations of every op, in f32, f16, bf16 and float64."""

from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest

from geir import parse
from geir.ops.linalg import FlashAttention
from geir.reference import ReferenceRunError, run_graph, run_op
from geir.verifier import verify_graph

from helpers import graph_text

NP = {
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f32": np.dtype(np.float32),
    "i8": np.dtype(np.int8),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "i1": np.dtype(np.bool_),
}
# (rtol, atol) for a result computed in f32 and rounded to its dtype, against float64 math rounded likewise
TOL = {"f32": (2e-5, 1e-6), "f16": (2e-3, 1e-4), "bf16": (1.6e-2, 1e-3), "f64": (1e-12, 1e-12)}
FLOAT_MODES = ["f32", "f16", "bf16", "f64"]  # f64: float64=True on f32 arguments


def dtype_of(mode: str) -> str:
    return "f32" if mode == "f64" else mode


def rand(rng, shape, dtype: str, low: float | None = None, high: float | None = None) -> np.ndarray:
    if dtype == "i1":
        return rng.random(shape) < 0.5
    if dtype.startswith("i"):
        return rng.integers(-20, 20, shape).astype(NP[dtype])
    base = rng.standard_normal(shape) if low is None else rng.uniform(low, high, shape)
    return np.asarray(base, dtype=np.float32).astype(NP[dtype])


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def build(args: list[tuple[str, str]], line: str, n_results: int = 1, name: str = "main"):
    """A graph of the single op `line` whose results are the graph's results (types from infer-shapes)."""
    arg_text = ", ".join(f"%{n}: {t}" for n, t in args)
    names = ", ".join(f"%r{i}" for i in range(n_results))
    probe = parse(graph_text(f"  {names} = {line}\n  ge.return", arg_text, "()"))
    verify_graph(probe.graphs[0], fill_types=True)
    types = [str(r.type) for r in probe.graphs[0].ops[0].results]
    sig = types[0] if n_results == 1 else "(" + ", ".join(types) + ")"
    g = parse(graph_text(f"  {names} = {line}\n  ge.return {names}", arg_text, sig, name)).graphs[0]
    verify_graph(g)
    return g


def run(args, line, inputs, mode="f32", n_results=1, resources=None):
    g = build(args, line, n_results)
    return run_graph(g, inputs, float64=(mode == "f64"), resources=resources)


def check(got: np.ndarray, expected: np.ndarray, mode: str, result_dtype: str | None = None):
    """Compare one result with float64 `expected` (rounded to the result dtype first)."""
    result_dtype = result_dtype or dtype_of(mode)
    expected = np.asarray(expected)
    if result_dtype in ("i1", "i8", "i32", "i64"):
        assert got.dtype == NP[result_dtype]
        assert got.shape == expected.shape
        assert np.array_equal(got, expected.astype(NP[result_dtype]))
        return
    if mode == "f64":
        assert got.dtype == np.float64, got.dtype
        want = expected
    else:
        assert got.dtype == NP[result_dtype], (got.dtype, result_dtype)
        with np.errstate(over="ignore"):
            want = expected.astype(NP[result_dtype]).astype(np.float64)
    assert got.shape == want.shape
    rtol, atol = TOL[mode if mode == "f64" else result_dtype]
    np.testing.assert_allclose(f64(got), want, rtol=rtol, atol=atol)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# --- elementwise ---------------------------------------------------------------------------

def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


_erf = np.vectorize(math.erf, otypes=[np.float64])

BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: np.where(a >= b, a, b),
    "min": lambda a, b: np.where(a <= b, a, b),
    "pow": lambda a, b: np.exp(b * np.log(a)),  # a > 0 here
}


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary_float(name, mode, rng):
    dt = dtype_of(mode)
    pos = name in ("pow", "div")
    a = rand(rng, (3, 1, 5), dt, 0.5 if pos else None, 2.0 if pos else None)
    b = rand(rng, (4, 1), dt, 0.5 if pos else None, 2.0 if pos else None)
    (got,) = run([("a", f"tensor<3x1x5x{dt}>"), ("b", f"tensor<4x1x{dt}>")], f"ge.{name} %a, %b", {"a": a, "b": b}, mode)
    assert got.shape == (3, 4, 5)
    check(got, BINARY[name](f64(a), f64(b)), mode)


def _trunc_div(a, b):
    out = np.empty(np.broadcast(a, b).shape, dtype=np.int64)
    for idx in np.ndindex(out.shape):
        x, y = int(np.broadcast_to(a, out.shape)[idx]), int(np.broadcast_to(b, out.shape)[idx])
        q = abs(x) // abs(y)
        out[idx] = q if (x >= 0) == (y >= 0) else -q
    return out


@pytest.mark.parametrize("dt", ["i8", "i32", "i64"])
def test_integer_division_truncates_toward_zero(dt, rng):
    a = np.array([7, -7, 7, -7, 6, -6, 0, 1, -1, 19, -19, 5], dtype=NP[dt])
    b = np.array([2, 2, -2, -2, 3, 3, 5, 3, 3, -4, -4, 7], dtype=NP[dt])
    (got,) = run([("a", f"tensor<12x{dt}>"), ("b", f"tensor<12x{dt}>")], "ge.div %a, %b", {"a": a, "b": b})
    assert got.tolist() == [3, -3, -3, 3, 2, -2, 0, 0, 0, -4, 4, 0]
    assert got.dtype == NP[dt]
    # with broadcasting
    x = rand(rng, (4, 6), dt)
    y = np.array([3, -3, 4, -5, 7, -1], dtype=NP[dt])
    (got,) = run([("a", f"tensor<4x6x{dt}>"), ("b", f"tensor<6x{dt}>")], "ge.div %a, %b", {"a": x, "b": y})
    check(got, _trunc_div(x, y), "f32", dt)


@pytest.mark.parametrize("dt", ["i8", "i32", "i64"])
@pytest.mark.parametrize("name", ["add", "sub", "mul", "max", "min"])
def test_binary_integer(name, dt, rng):
    a, b = rand(rng, (2, 5), dt), rand(rng, (5,), dt)
    (got,) = run([("a", f"tensor<2x5x{dt}>"), ("b", f"tensor<5x{dt}>")], f"ge.{name} %a, %b", {"a": a, "b": b})
    ai, bi = a.astype(np.int64), b.astype(np.int64)
    check(got, BINARY[name](ai, bi), "f32", dt)


def test_integer_pow():
    a = np.array([2, -3, 5, 1, 0], dtype=np.int32)
    b = np.array([3, 3, 0, 7, 2], dtype=np.int32)
    (got,) = run([("a", "tensor<5xi32>"), ("b", "tensor<5xi32>")], "ge.pow %a, %b", {"a": a, "b": b})
    assert got.dtype == np.int32 and got.tolist() == [8, -27, 1, 1, 0]


COMPARE = {"greater": lambda a, b: a > b, "less": lambda a, b: a < b, "equal": lambda a, b: a == b}


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", "i32", "i8"])
@pytest.mark.parametrize("name", list(COMPARE))
def test_comparisons(name, dt, rng):
    a = rand(rng, (3, 4), dt)
    b = a.copy()
    b[0] = rand(rng, (4,), dt)  # some equal, some not
    b = b[:, :]
    (got,) = run([("a", f"tensor<3x4x{dt}>"), ("b", f"tensor<3x4x{dt}>")], f"ge.{name} %a, %b", {"a": a, "b": b})
    want = COMPARE[name](a.astype(np.float64), b.astype(np.float64))
    assert got.dtype == np.bool_ and np.array_equal(got, want)
    # broadcasting against a scalar
    s = rand(rng, (), dt)
    (got,) = run([("a", f"tensor<3x4x{dt}>"), ("b", f"tensor<{dt}>")], f"ge.{name} %a, %b", {"a": a, "b": s})
    assert np.array_equal(got, COMPARE[name](a.astype(np.float64), float(s)))


@pytest.mark.parametrize("mode", FLOAT_MODES + ["i32"])
def test_select(mode, rng):
    dt = dtype_of(mode) if mode != "i32" else "i32"
    c = rng.random((4, 1)) < 0.5
    a, b = rand(rng, (3,), dt), rand(rng, (4, 3), dt)
    (got,) = run([("c", "tensor<4x1xi1>"), ("a", f"tensor<3x{dt}>"), ("b", f"tensor<4x3x{dt}>")], "ge.select %c, %a, %b",
                 {"c": c, "a": a, "b": b}, "f64" if mode == "f64" else "f32")
    want = np.empty((4, 3))
    for i in range(4):
        for j in range(3):
            want[i, j] = float(a[j]) if c[i, 0] else float(b[i, j])
    check(got, want, "f64" if mode == "f64" else "f32", dt)


UNARY = {
    "exp": (lambda x: np.exp(x), None),
    "log": (lambda x: np.log(x), (0.1, 4.0)),
    "sqrt": (lambda x: np.sqrt(x), (0.0, 4.0)),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), (0.1, 4.0)),
    "neg": (lambda x: -x, None),
    "abs": (lambda x: np.where(x < 0, -x, x), None),
    "tanh": (lambda x: (np.exp(2 * x) - 1) / (np.exp(2 * x) + 1), None),
    "sigmoid": (_sigmoid, None),
    "relu": (lambda x: np.where(x > 0, x, 0.0), None),
    "silu": (lambda x: x * _sigmoid(x), None),
    "erf": (_erf, None),
}


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_float(name, mode, rng):
    dt = dtype_of(mode)
    fn, domain = UNARY[name]
    x = rand(rng, (4, 6), dt, *(domain or (None, None)))
    (got,) = run([("x", f"tensor<4x6x{dt}>")], f"ge.{name} %x", {"x": x}, mode)
    check(got, fn(f64(x)), mode)


@pytest.mark.parametrize("dt", ["i8", "i32", "i64"])
@pytest.mark.parametrize("name", ["neg", "abs", "relu"])
def test_unary_integer(name, dt, rng):
    x = rand(rng, (10,), dt)
    (got,) = run([("x", f"tensor<10x{dt}>")], f"ge.{name} %x", {"x": x})
    check(got, UNARY[name][0](x.astype(np.int64)), "f32", dt)


def _gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
def test_gelu(approximate, mode, rng):
    dt = dtype_of(mode)
    x = rand(rng, (5, 7), dt) * 3
    attr = f' {{approximate = "{approximate}"}}' if approximate else ""
    (got,) = run([("x", f"tensor<5x7x{dt}>")], f"ge.gelu %x{attr}", {"x": x}, mode)
    check(got, _gelu(f64(x), approximate or "none"), mode)


def test_gelu_variants_differ():
    x = np.linspace(-3, 3, 13).astype(np.float32)
    (exact,) = run([("x", "tensor<13xf32>")], "ge.gelu %x", {"x": x}, "f64")
    (approx,) = run([("x", "tensor<13xf32>")], 'ge.gelu %x {approximate = "tanh"}', {"x": x}, "f64")
    assert 1e-5 < np.max(np.abs(exact - approx)) < 1e-2


# --- cast ----------------------------------------------------------------------------------

def test_cast_float_to_int_truncates_toward_zero():
    x = np.array([2.7, -2.7, 0.5, -0.5, 3.0, -3.0, 100.9], dtype=np.float32)
    for dt in ("i8", "i32", "i64"):
        (got,) = run([("x", "tensor<7xf32>")], f"ge.cast %x {{to = {dt}}}", {"x": x})
        assert got.dtype == NP[dt]
        assert got.tolist() == [math.trunc(float(v)) for v in x]


def test_cast_between_floats_rounds_to_nearest(rng):
    x = rand(rng, (64,), "f32") * 10
    for dt in ("f16", "bf16"):
        (got,) = run([("x", "tensor<64xf32>")], f"ge.cast %x {{to = {dt}}}", {"x": x})
        assert got.dtype == NP[dt]
        # nearest representable value: no other element of the narrow type is closer
        g = f64(got)
        step = np.spacing(np.abs(g).astype(np.float16 if dt == "f16" else np.float32)).astype(np.float64)
        if dt == "bf16":
            step = 2.0 ** (np.floor(np.log2(np.abs(g))) - 7)
        assert np.all(np.abs(g - f64(x)) <= step / 2 + 1e-12)
    (back,) = run([("x", "tensor<64xf16>")], "ge.cast %x {to = f32}", {"x": x.astype(np.float16)})
    assert back.dtype == np.float32 and np.array_equal(back, x.astype(np.float16).astype(np.float32))


def test_cast_bool_and_int():
    x = np.array([0.0, 1.5, -2.0, 0.0, 1e-30], dtype=np.float32)
    (got,) = run([("x", "tensor<5xf32>")], "ge.cast %x {to = i1}", {"x": x})
    assert got.dtype == np.bool_ and got.tolist() == [False, True, True, False, True]
    b = np.array([True, False, True])
    (got,) = run([("x", "tensor<3xi1>")], "ge.cast %x {to = bf16}", {"x": b})
    assert got.dtype == NP["bf16"] and f64(got).tolist() == [1.0, 0.0, 1.0]
    i = np.array([-5, 0, 7, 1 << 20], dtype=np.int32)
    (got,) = run([("x", "tensor<4xi32>")], "ge.cast %x {to = f32}", {"x": i})
    assert got.dtype == np.float32 and got.tolist() == [-5.0, 0.0, 7.0, float(1 << 20)]
    (got,) = run([("x", "tensor<4xi32>")], "ge.cast %x {to = i64}", {"x": i})
    assert got.dtype == np.int64 and got.tolist() == i.tolist()


def test_cast_in_float64_mode():
    x = np.array([0.1, -2.7, 1000.3], dtype=np.float32)
    (got,) = run([("x", "tensor<3xf32>")], "ge.cast %x {to = i32}", {"x": x}, "f64")
    assert got.dtype == np.int32 and got.tolist() == [0, -2, 1000]
    (got,) = run([("x", "tensor<3xf32>")], "ge.cast %x {to = f16}", {"x": x}, "f64")
    # the float64 reference keeps full precision through float casts
    assert got.dtype == np.float64 and np.array_equal(got, f64(x))


# --- reductions, softmax, norms ------------------------------------------------------------

def _reduce(x, axes, keepdims, kind):
    axes = tuple(a % x.ndim for a in axes)
    out_shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    out = np.zeros(out_shape)
    groups: dict = {}
    for idx in np.ndindex(x.shape):
        key = tuple(0 if i in axes else v for i, v in enumerate(idx))
        groups.setdefault(key, []).append(float(x[idx]))
    for key, vals in groups.items():
        out[key] = {"sum": sum(vals), "max": max(vals), "mean": sum(vals) / len(vals)}[kind]
    if not keepdims:
        out = out.reshape(tuple(d for i, d in enumerate(x.shape) if i not in axes))
    return out


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("kind", ["sum", "max", "mean"])
@pytest.mark.parametrize("axes, keepdims", [([1], False), ([0, -1], True), ([2], True), ([0, 1, 2], False)])
def test_reductions(kind, axes, keepdims, mode, rng):
    dt = dtype_of(mode)
    x = rand(rng, (3, 4, 5), dt)
    kd = " , keepdims = true" if keepdims else ""
    (got,) = run([("x", f"tensor<3x4x5x{dt}>")], f"ge.reduce_{kind} %x {{axes = {axes}{kd}}}", {"x": x}, mode)
    check(got, _reduce(f64(x), axes, keepdims, kind), mode)


def test_reduce_sum_integer(rng):
    x = rand(rng, (3, 4), "i32")
    (got,) = run([("x", "tensor<3x4xi32>")], "ge.reduce_sum %x {axes = [1]}", {"x": x})
    assert got.dtype == np.int32 and got.tolist() == [sum(int(v) for v in row) for row in x]
    (got,) = run([("x", "tensor<3x4xi32>")], "ge.reduce_max %x {axes = [0], keepdims = true}", {"x": x})
    assert got.tolist() == [[max(int(x[i, j]) for i in range(3)) for j in range(4)]]


def _softmax(x, axis):
    x = np.moveaxis(x, axis, -1)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        e = np.array([math.exp(v - max(row)) for v in row])
        out[idx] = e / e.sum()
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("axis", [None, -1, 0, 1])
def test_softmax(axis, mode, rng):
    dt = dtype_of(mode)
    x = rand(rng, (3, 5, 4), dt) * 4
    attr = f" {{axis = {axis}}}" if axis is not None else ""
    (got,) = run([("x", f"tensor<3x5x4x{dt}>")], f"ge.softmax %x{attr}", {"x": x}, mode)
    check(got, _softmax(f64(x), -1 if axis is None else axis), mode)


def test_softmax_large_values_do_not_overflow():
    x = np.array([[1000.0, 1001.0, 999.0]], dtype=np.float32)
    (got,) = run([("x", "tensor<1x3xf32>")], "ge.softmax %x", {"x": x})
    check(got, _softmax(f64(x), -1), "f32")


def _layer_norm(x, gamma, beta, axis, eps):
    axis %= x.ndim
    lead = x.shape[:axis]
    flat = x.reshape(lead + (-1,))
    out = np.empty_like(flat)
    for idx in np.ndindex(lead):
        row = flat[idx]
        mean = sum(row) / len(row)
        var = sum((v - mean) ** 2 for v in row) / len(row)
        out[idx] = (row - mean) / math.sqrt(var + eps)
    return out.reshape(x.shape) * gamma + beta


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("axis, eps", [(None, None), (-1, 1e-3), (1, 1e-5)])
def test_layer_norm(axis, eps, mode, rng):
    dt = dtype_of(mode)
    x = rand(rng, (2, 3, 8), dt) * 2 + 1
    pshape = (8,) if axis in (None, -1) else (3, 8)
    gamma, beta = rand(rng, pshape, dt), rand(rng, pshape, dt)
    pt = "x".join(map(str, pshape))
    attrs = []
    if axis is not None:
        attrs.append(f"axis = {axis}")
    if eps is not None:
        attrs.append(f"epsilon = {eps}")
    attr = " {" + ", ".join(attrs) + "}" if attrs else ""
    (got,) = run([("x", f"tensor<2x3x8x{dt}>"), ("g", f"tensor<{pt}x{dt}>"), ("b", f"tensor<{pt}x{dt}>")],
                 f"ge.layer_norm %x, %g, %b{attr}", {"x": x, "g": gamma, "b": beta}, mode)
    check(got, _layer_norm(f64(x), f64(gamma), f64(beta), -1 if axis is None else axis, 1e-5 if eps is None else eps),
          mode)


def test_layer_norm_epsilon_matters():
    x = np.array([[0.0, 0.01]], dtype=np.float32)
    g, b = np.ones(2, np.float32), np.zeros(2, np.float32)
    args = [("x", "tensor<1x2xf32>"), ("g", "tensor<2xf32>"), ("b", "tensor<2xf32>")]
    (small,) = run(args, "ge.layer_norm %x, %g, %b {epsilon = 1e-9}", {"x": x, "g": g, "b": b}, "f64")
    (large,) = run(args, "ge.layer_norm %x, %g, %b {epsilon = 1.0}", {"x": x, "g": g, "b": b}, "f64")
    check(small, _layer_norm(f64(x), 1.0, 0.0, -1, 1e-9), "f64")
    check(large, _layer_norm(f64(x), 1.0, 0.0, -1, 1.0), "f64")


def _rms_norm(x, gamma, eps):
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        out[idx] = row / math.sqrt(sum(v * v for v in row) / len(row) + eps)
    return out * gamma


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("eps", [None, 1e-2])
def test_rms_norm(eps, mode, rng):
    dt = dtype_of(mode)
    x, gamma = rand(rng, (3, 2, 16), dt), rand(rng, (16,), dt)
    attr = f" {{epsilon = {eps}}}" if eps is not None else ""
    (got,) = run([("x", f"tensor<3x2x16x{dt}>"), ("g", f"tensor<16x{dt}>")], f"ge.rms_norm %x, %g{attr}",
                 {"x": x, "g": gamma}, mode)
    check(got, _rms_norm(f64(x), f64(gamma), 1e-6 if eps is None else eps), mode)


# --- matmul --------------------------------------------------------------------------------

def _matmul(a, b, ta=False, tb=False):
    if ta:
        a = np.swapaxes(a, -1, -2)
    if tb:
        b = np.swapaxes(b, -1, -2)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = np.broadcast_to(a, batch + a.shape[-2:])
    b = np.broadcast_to(b, batch + b.shape[-2:])
    out = np.zeros(batch + (a.shape[-2], b.shape[-1]))
    for idx in np.ndindex(batch):
        for i in range(a.shape[-2]):
            for j in range(b.shape[-1]):
                out[idx + (i, j)] = sum(a[idx + (i, k)] * b[idx + (k, j)] for k in range(a.shape[-1]))
    return out


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize(
    "ashape, bshape, ta, tb",
    [
        ((4, 6), (6, 3), False, False),
        ((6, 4), (6, 3), True, False),
        ((4, 6), (3, 6), False, True),
        ((6, 4), (3, 6), True, True),
        ((2, 1, 4, 6), (3, 6, 5), False, False),  # batch broadcasting
        ((4, 6), (2, 5, 6), False, True),
    ],
)
def test_matmul(ashape, bshape, ta, tb, mode, rng):
    dt = dtype_of(mode)
    a, b = rand(rng, ashape, dt), rand(rng, bshape, dt)
    attrs = []
    if ta:
        attrs.append("transpose_a = true")
    if tb:
        attrs.append("transpose_b = true")
    attr = " {" + ", ".join(attrs) + "}" if attrs else ""
    ta_s, tb_s = "x".join(map(str, ashape)), "x".join(map(str, bshape))
    (got,) = run([("a", f"tensor<{ta_s}x{dt}>"), ("b", f"tensor<{tb_s}x{dt}>")], f"ge.matmul %a, %b{attr}",
                 {"a": a, "b": b}, mode)
    check(got, _matmul(f64(a), f64(b), ta, tb), mode)


@pytest.mark.parametrize("dt, big, n", [("f16", 2048.0, 16), ("bf16", 256.0, 16)])
def test_half_precision_matmul_accumulates_in_f32(dt, big, n):
    # big + 1 is not representable in the narrow type: a narrow accumulator would stay at `big`
    a = np.array([[big] + [1.0] * n], dtype=np.float32).astype(NP[dt])
    b = np.ones((n + 1, 1), dtype=np.float32).astype(NP[dt])
    (got,) = run([("a", f"tensor<1x{n + 1}x{dt}>"), ("b", f"tensor<{n + 1}x1x{dt}>")], "ge.matmul %a, %b",
                 {"a": a, "b": b})
    assert got.dtype == NP[dt]
    assert float(got[0, 0]) == big + n


def test_matmul_integer(rng):
    a, b = rand(rng, (3, 4), "i32"), rand(rng, (4, 2), "i32")
    (got,) = run([("a", "tensor<3x4xi32>"), ("b", "tensor<4x2xi32>")], "ge.matmul %a, %b", {"a": a, "b": b})
    assert got.dtype == np.int32
    assert got.tolist() == [[sum(int(a[i, k]) * int(b[k, j]) for k in range(4)) for j in range(2)] for i in range(3)]


# --- data movement -------------------------------------------------------------------------

@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", "i32", "i1"])
def test_transpose(dt, rng):
    x = rand(rng, (2, 3, 4), dt)
    (got,) = run([("x", f"tensor<2x3x4x{dt}>")], "ge.transpose %x {perm = [2, 0, 1]}", {"x": x})
    assert got.shape == (4, 2, 3) and got.dtype == NP[dt]
    for i, j, k in np.ndindex(4, 2, 3):
        assert got[i, j, k] == x[j, k, i]


@pytest.mark.parametrize("shape, spec", [([4, 6], (4, 6)), ([-1, 3], (8, 3)), ([2, -1, 2], (2, 6, 2)), ([24], (24,))])
def test_reshape(shape, spec, rng):
    x = rand(rng, (2, 3, 4), "f32")
    (got,) = run([("x", "tensor<2x3x4xf32>")], f"ge.reshape %x {{shape = {shape}}}", {"x": x})
    assert got.shape == spec
    assert list(got.ravel()) == list(x.ravel())  # row-major order kept


def test_reshape_dynamic_input(rng):
    x = rand(rng, (5, 4), "f16")
    (got,) = run([("x", "tensor<?x4xf16>")], "ge.reshape %x {shape = [-1, 2]}", {"x": x})
    assert got.shape == (10, 2) and got.dtype == np.float16 and list(got.ravel()) == list(x.ravel())


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis, rng):
    a, b, c = rand(rng, (2, 3), "bf16"), rand(rng, (2, 3), "bf16"), rand(rng, (2, 3), "bf16")
    (got,) = run([("a", "tensor<2x3xbf16>"), ("b", "tensor<2x3xbf16>"), ("c", "tensor<2x3xbf16>")],
                 f"ge.concat %a, %b, %c {{axis = {axis}}}", {"a": a, "b": b, "c": c})
    if axis == 0:
        want = [list(r) for r in a] + [list(r) for r in b] + [list(r) for r in c]
    else:
        want = [list(a[i]) + list(b[i]) + list(c[i]) for i in range(2)]
    assert got.dtype == NP["bf16"] and f64(got).tolist() == f64(np.array(want, dtype=NP["bf16"])).tolist()


def test_split(rng):
    x = rand(rng, (3, 7), "i32")
    outs = run([("x", "tensor<3x7xi32>")], "ge.split %x {axis = 1, sizes = [2, 0, 5]}", {"x": x}, n_results=3)
    assert [o.shape for o in outs] == [(3, 2), (3, 0), (3, 5)]
    assert outs[0].tolist() == [list(r[:2]) for r in x]
    assert outs[2].tolist() == [list(r[2:]) for r in x]
    outs = run([("x", "tensor<3x7xi32>")], "ge.split %x {axis = -2, sizes = [1, 2]}", {"x": x}, n_results=2)
    assert outs[0].tolist() == [list(x[0])] and outs[1].tolist() == [list(x[1]), list(x[2])]


@pytest.mark.parametrize(
    "axes, starts, ends, index",
    [
        ([1], [2], [5], (slice(None), slice(2, 5))),
        ([-1, 0], [-3, 1], [100, 3], (slice(1, 3), slice(-3, 100))),
        ([0], [-100], [-1], (slice(-100, -1),)),
        ([1], [5], [2], (slice(None), slice(5, 2))),
    ],
)
def test_slice(axes, starts, ends, index, rng):
    x = rand(rng, (4, 8), "f32")
    (got,) = run([("x", "tensor<4x8xf32>")], f"ge.slice %x {{axes = {axes}, starts = {starts}, ends = {ends}}}", {"x": x})
    want = [list(r) for r in x]
    rows = range(4)[index[0]]
    cols = range(8)[index[1]] if len(index) > 1 else range(8)
    assert got.tolist() == [[want[i][j] for j in cols] for i in rows]


def test_trans_data_keeps_values(rng):
    x = rand(rng, (16, 16), "f16")
    (got,) = run([("x", "tensor<16x16xf16>")], 'ge.trans_data %x {dst_format = "NZ"}', {"x": x})
    assert got.dtype == np.float16 and np.array_equal(got, x)


# --- constants and graphs ------------------------------------------------------------------

def test_constants(rng):
    text = graph_text(
        "  %a = ge.const dense<0.1> : tensor<2x3xf16>\n"
        "  %b = ge.const dense<[[1, 2, 3], [4, 5, 6]]> : tensor<2x3xf32>\n"
        "  %c = ge.const dense<[true, false, true]> : tensor<3xi1>\n"
        "  %d = ge.const dense<-7> : tensor<i8>\n"
        "  ge.return %a, %b, %c, %d",
        "",
        "(tensor<2x3xf16>, tensor<2x3xf32>, tensor<3xi1>, tensor<i8>)",
    )
    a, b, c, d = run_graph(parse(text).graphs[0], {})
    assert a.dtype == np.float16 and a.shape == (2, 3) and np.all(a == np.float16(0.1))
    assert b.dtype == np.float32 and b.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert c.dtype == np.bool_ and c.tolist() == [True, False, True]
    assert d.dtype == np.int8 and d.shape == () and int(d) == -7
    a64, *_ = run_graph(parse(text).graphs[0], {}, float64=True)
    assert a64.dtype == np.float64 and np.all(a64 == float(np.float16(0.1)))


def test_dense_resource_constants():
    text = graph_text(
        '  %w = ge.const dense_resource<"layer.0/w"> : tensor<2x2xf16>\n'
        "  %y = ge.matmul %x, %w\n"
        "  ge.return %y",
        "%x: tensor<1x2xf16>",
        "tensor<1x2xf16>",
    )
    g = parse(text).graphs[0]
    w = np.array([[1.0, 2.0], [3.0, 0.1]], dtype=np.float32)  # cast to the constant's dtype
    x = np.array([[2.0, -1.0]], dtype=np.float16)
    (got,) = run_graph(g, {"x": x}, resources={"layer.0/w": w})
    w16 = w.astype(np.float16).astype(np.float64)
    assert got.dtype == np.float16
    check(got, np.array([[2 * w16[0, 0] - w16[1, 0], 2 * w16[0, 1] - w16[1, 1]]]), "f16")
    (got64,) = run_graph(g, {"x": x}, float64=True, resources={"layer.0/w": w})
    assert got64.dtype == np.float64
    np.testing.assert_allclose(got64, [[2 * w16[0, 0] - w16[1, 0], 2 * w16[0, 1] - w16[1, 1]]], rtol=1e-15)
    with pytest.raises(ReferenceRunError, match="layer.0/w"):
        run_graph(g, {"x": x})
    with pytest.raises(ReferenceRunError, match="layer.0/w"):
        run_graph(g, {"x": x}, resources={"other": w})


def test_run_op_directly():
    g = parse(graph_text('  %w = ge.const dense_resource<"w"> : tensor<3xi32>\n  %y = ge.add %x, %w\n  ge.return %y',
                         "%x: tensor<3xi32>", "tensor<3xi32>")).graphs[0]
    const, add, _ = g.ops
    (w,) = run_op(const, [], resources={"w": np.array([1.0, 2.0, 3.0])})
    assert w.dtype == np.int32 and w.tolist() == [1, 2, 3]
    (y,) = run_op(add, [np.array([10, 20, 30], np.int32), w])
    assert y.tolist() == [11, 22, 33]
    # a result whose type is not written comes back as computed unless result_types says otherwise
    (z,) = run_op(add, [np.array([1.5], np.float32), np.array([1.0], np.float32)], result_types=[None])
    assert z.tolist() == [2.5]


def test_run_graph_inputs():
    g = parse(graph_text("  %y = ge.neg %x\n  ge.return %y, %x", "%x: tensor<?x2xf16>",
                         "(tensor<?x2xf16>, tensor<?x2xf16>)")).graphs[0]
    x = np.array([[0.1, 1e-8], [60000.0, -2.0]])  # float64 in, cast to the argument's f16
    y, same = run_graph(g, {"x": x})
    assert y.dtype == np.float16 and same.dtype == np.float16
    with np.errstate(over="ignore"):
        x16 = x.astype(np.float16)
    assert np.array_equal(same, x16) and np.array_equal(y, -x16)
    y64, same64 = run_graph(g, {"x": x}, float64=True)
    assert same64.dtype == np.float64 and np.array_equal(same64, x16.astype(np.float64))
    with pytest.raises(ReferenceRunError, match="no input given for argument '%x'"):
        run_graph(g, {})
    with pytest.raises(ReferenceRunError, match="has shape"):
        run_graph(g, {"x": np.zeros((2, 3))})
    with pytest.raises(ReferenceRunError, match="has shape"):
        run_graph(g, {"x": np.zeros((2,))})


def test_a_chain_of_ops_with_untyped_results(rng):
    text = graph_text(
        "  %kt = ge.transpose %k {perm = [1, 0]}\n"
        "  %s = ge.matmul %q, %kt\n"
        "  %c = ge.const dense<0.5> : tensor<f32>\n"
        "  %ss = ge.mul %s, %c\n"
        "  %p = ge.softmax %ss\n"
        "  %o = ge.matmul %p, %k\n"
        "  %r = ge.reduce_sum %o {axes = [1]}\n"
        "  ge.return %r, %o",
        "%q: tensor<3x4xf32>, %k: tensor<5x4xf32>",
        "(tensor<3xf32>, tensor<3x4xf32>)",
    )
    q, k = rand(rng, (3, 4), "f32"), rand(rng, (5, 4), "f32")
    r, o = run_graph(parse(text).graphs[0], {"q": q, "k": k})
    p = _softmax(_matmul(f64(q), f64(k), tb=True) * 0.5, -1)
    check(o, _matmul(p, f64(k)), "f32")
    check(r, o.astype(np.float64).sum(axis=1), "f32")


# --- flash attention -----------------------------------------------------------------------

def naive_attention(q, k, v, scale=None, mask=None, causal=False, layout="BNSD"):
    q, k, v = f64(q), f64(k), f64(v)
    if layout == "BSND":
        q, k, v = (np.swapaxes(t, 1, 2) for t in (q, k, v))
    b, n, sq, d = q.shape
    nkv, skv = k.shape[1], k.shape[2]
    group = n // nkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    full_mask = None if mask is None else np.broadcast_to(mask, (b, n, sq, skv))
    out = np.zeros((b, n, sq, v.shape[-1]))
    for bi in range(b):
        for h in range(n):
            kh, vh = k[bi, h // group], v[bi, h // group]
            s = scale * (q[bi, h] @ kh.T)
            if full_mask is not None:
                m = full_mask[bi, h]
                s = np.where(m, s, -np.inf) if m.dtype == np.bool_ else s + f64(m)
            if causal:
                for i in range(sq):
                    s[i, i + 1:] = -np.inf
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[bi, h] = (p / p.sum(axis=-1, keepdims=True)) @ vh
    return np.swapaxes(out, 1, 2) if layout == "BSND" else out


def _t(shape, dt):
    return "tensor<" + "x".join(map(str, shape)) + f"x{dt}>"


def attention(mode, qs, ks, vs, rng, attrs="", mask=None, mask_shape=None):
    dt = dtype_of(mode)
    q, k, v = rand(rng, qs, dt), rand(rng, ks, dt), rand(rng, vs, dt)
    args = [("q", _t(qs, dt)), ("k", _t(ks, dt)), ("v", _t(vs, dt))]
    inputs = {"q": q, "k": k, "v": v}
    line = "ge.flash_attention %q, %k, %v"
    if mask is not None:
        mdt = "i1" if mask.dtype == np.bool_ else dt
        if mdt != "i1":
            mask = mask.astype(NP[dt])
        args.append(("m", _t(mask_shape or mask.shape, mdt)))
        inputs["m"] = mask
        line += ", %m"
    (got,) = run(args, line + (f" {{{attrs}}}" if attrs else ""), inputs, mode)
    return got, q, k, v, mask


@pytest.mark.parametrize("mode", FLOAT_MODES)
def test_flash_attention_plain(mode, rng):
    got, q, k, v, _ = attention(mode, (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6), rng)
    check(got, naive_attention(q, k, v), mode)


@pytest.mark.parametrize("mode", FLOAT_MODES)
def test_flash_attention_scale_and_additive_mask(mode, rng):
    mask = rng.standard_normal((5, 7)) * 2
    mask[0, 3] = -np.inf
    got, q, k, v, m = attention(mode, (1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), rng, "scale = 0.3", mask)
    check(got, naive_attention(q, k, v, scale=0.3, mask=m), mode)


@pytest.mark.parametrize("mode", FLOAT_MODES)
def test_flash_attention_boolean_mask(mode, rng):
    mask = rng.random((2, 1, 6, 9)) < 0.6
    mask[..., 0] = True  # no row fully masked
    got, q, k, v, m = attention(mode, (2, 4, 6, 8), (2, 4, 9, 8), (2, 4, 9, 8), rng, "", mask)
    want = naive_attention(q, k, v, mask=m)
    check(got, want, mode)
    # the mask matters: without it the result differs
    assert np.max(np.abs(want - naive_attention(q, k, v))) > 1e-2


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("sq, skv", [(6, 6), (4, 9), (9, 4)])
def test_flash_attention_causal_is_top_left_aligned(sq, skv, mode, rng):
    got, q, k, v, _ = attention(mode, (1, 2, sq, 8), (1, 2, skv, 8), (1, 2, skv, 8), rng, "causal = true")
    want = naive_attention(q, k, v, causal=True)
    check(got, want, mode)
    # row 0 sees key 0 only
    np.testing.assert_allclose(f64(got)[:, :, 0], f64(v)[:, :, 0], rtol=TOL[mode][0] * 2, atol=TOL[mode][1] * 2)


@pytest.mark.parametrize("mode", FLOAT_MODES)
def test_flash_attention_grouped_query_heads(mode, rng):
    got, q, k, v, _ = attention(mode, (2, 6, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), rng, "causal = true")
    check(got, naive_attention(q, k, v, causal=True), mode)
    # query heads 0..2 share key/value head 0: with equal queries they give equal outputs
    q = rand(rng, (1, 4, 3, 8), "f32")
    q[:, 1] = q[:, 0]
    k, v = rand(rng, (1, 2, 5, 8), "f32"), rand(rng, (1, 2, 5, 8), "f32")
    (out,) = run([("q", "tensor<1x4x3x8xf32>"), ("k", "tensor<1x2x5x8xf32>"), ("v", "tensor<1x2x5x8xf32>")],
                 "ge.flash_attention %q, %k, %v", {"q": q, "k": k, "v": v})
    np.testing.assert_allclose(out[:, 0], out[:, 1], rtol=1e-6)
    check(out, naive_attention(q, k, v), "f32")


@pytest.mark.parametrize("mode", FLOAT_MODES)
def test_flash_attention_bsnd(mode, rng):
    mask = rng.standard_normal((1, 4, 5, 7))
    got, q, k, v, m = attention(mode, (2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8), rng,
                                'layout = "BSND", causal = true, scale = 0.5', mask)
    assert got.shape == (2, 5, 4, 8)
    check(got, naive_attention(q, k, v, scale=0.5, mask=m, causal=True, layout="BSND"), mode)


@pytest.mark.parametrize("mode", ["f32", "f16", "f64"])
def test_flash_attention_long_query_covers_the_row_blocks(mode, rng, monkeypatch):
    # blocks of 64 query rows: 1100 rows are more than one block and not a multiple of it
    sq, skv = 1100, 1070
    monkeypatch.setattr(FlashAttention, "REFERENCE_SCORE_ELEMENTS", 2 * skv * 64)
    mask = rng.standard_normal((sq, skv))
    got, q, k, v, m = attention(mode, (1, 2, sq, 8), (1, 1, skv, 8), (1, 1, skv, 8), rng, "causal = true", mask)
    check(got, naive_attention(q, k, v, mask=m, causal=True), mode)


def test_flash_attention_long_query_boolean_mask(rng, monkeypatch):
    monkeypatch.setattr(FlashAttention, "REFERENCE_SCORE_ELEMENTS", 40 * 100)  # blocks of 100 rows
    sq = 2053
    mask = rng.random((1, 1, sq, 40)) < 0.5
    mask[..., 7] = True
    got, q, k, v, m = attention("f32", (1, 1, sq, 4), (1, 1, 40, 4), (1, 1, 40, 4), rng, "", mask)
    check(got, naive_attention(q, k, v, mask=m), "f32")


@pytest.mark.parametrize("mode", ["f32", "f16", "f64"])
@pytest.mark.parametrize("name", list(UNARY) + ["gelu"])
def test_unary_on_scalars(name, mode):
    dt = dtype_of(mode)
    x = np.array(0.75, dtype=NP[dt])
    (got,) = run([("x", f"tensor<{dt}>")], f"ge.{name} %x", {"x": x}, mode)
    assert got.shape == ()
    fn = UNARY[name][0] if name != "gelu" else (lambda v: _gelu(v, "none"))
    check(got, fn(f64(x)), mode)


def test_empty_tensors(rng):
    x = np.zeros((0, 3), np.float32)
    for line in ("ge.exp %x", "ge.erf %x", "ge.gelu %x", "ge.reduce_sum %x {axes = [0]}", "ge.softmax %x"):
        (got,) = run([("x", "tensor<0x3xf32>")], line, {"x": x})
        want_shape = (3,) if "reduce_sum" in line else (0, 3)
        assert got.shape == want_shape
        if "reduce_sum" in line:
            assert got.tolist() == [0.0, 0.0, 0.0]
