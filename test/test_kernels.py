"""The unfused kernels (matmul, vector, data movement): numbers against the reference interpreter,
timing on the pipes, GM bytes against analytic counts, L2 residency of N x N intermediates, capacities."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from geir.diagnostics import DiagnosticEngine
from geir.kernels import KERNELS, LaunchContext
from geir.ops.fused import chainable_ops
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.reference import run_op
from geir.target_npu import load_target
from geir.target_npu.sim import PIPE_INDEX, CapacityError, Cores, GlobalMemory

ELEMENTWISE_OPS = frozenset(chainable_ops())
BF16 = np.dtype(ml_dtypes.bfloat16)
NP = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BF16, "i1": np.dtype(np.bool_),
      "i32": np.dtype(np.int32)}
# kernel vs reference in the same dtype, where tiling changes the order of a summation
TOLERANCE = {"f32": (1e-4, 1e-5), "f16": (1e-2, 1e-3), "bf16": (2e-2, 1e-2)}


def compile_graph(text: str, target: str = "ascend910b", pipeline: str = "tile"):
    """Parse a graph and run the tile pass (infer-shapes first), as geopt would: the ops carry their tiling."""
    module = parse(text)
    diags = []
    ctx = PassContext(target=target, diagnostics=DiagnosticEngine(diags.append))
    assert PassManager(complete_pipeline(parse_pipeline(pipeline))).run(module, ctx), diags
    return module.graphs[0]


def one_op(body: str, args: str, target: str = "ascend910b"):
    """The single op of `ge.graph @main(args) { body }` (its result is returned)."""
    res = body.split("=")[0].strip().split(",")[0]
    rtype = re.search(r"tensor<[^>]*>", body.rsplit(":", 1)[1]).group(0)
    graph = compile_graph(f"ge.graph @main({args}) -> {rtype} {{\n  {body}\n  ge.return {res}\n}}", target)
    return graph.ops[0]


def launch(op, inputs, target: str = "ascend910b", record: bool = False, fault=None):
    """Run the op's kernel on a fresh chip; returns the outputs and the launch context."""
    t = load_target(target)
    ctx = LaunchContext(t, Cores(t.cube_cores, record=record), GlobalMemory(t),
                        [v.name for v in op.operands], [r.name for r in op.results], fault)
    kernel = KERNELS[op.name]
    outs = kernel.run(op, inputs, kernel.tiling_for(op, inputs, t), ctx)
    return outs, ctx


def random_inputs(op, seed: int = 0, positive: bool = False):
    rng = np.random.default_rng(seed)
    out = []
    for v in op.operands:
        dt = v.type.dtype.np
        shape = v.type.shape
        if dt == np.bool_:
            out.append(rng.random(shape) > 0.5)
        elif dt.kind in "iu":
            out.append(rng.integers(-50, 50, shape).astype(dt))
        else:
            x = rng.standard_normal(shape)
            out.append((np.abs(x) + 0.1 if positive else x).astype(dt))
    return out


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == "f" or a.dtype == BF16:
        view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        return np.array_equal(np.ascontiguousarray(a).view(view), np.ascontiguousarray(b).view(view))
    return np.array_equal(a, b)


def assert_close(out: np.ndarray, ref: np.ndarray, dtype: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol, atol = TOLERANCE[dtype]
    o, r = out.astype(np.float64), ref.astype(np.float64)
    np.testing.assert_allclose(o, r, rtol=rtol, atol=atol * max(1.0, float(np.abs(r).max(initial=0))))


def check_against_reference(op, inputs, exact: bool, dtype: str = "f32", **kw):
    outs, ctx = launch(op, inputs, **kw)
    refs = run_op(op, inputs)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        if exact:
            assert bits_equal(o, r), (op.name, o.dtype, r.dtype)
        else:
            assert_close(o, r, dtype)
    assert ctx.cores.finish > 0
    return outs, ctx


# --- matmul -----------------------------------------------------------------------------------------

MATMUL_CASES = [
    # (a type, b type, attributes, result type): shapes that are not multiples of the base block
    ("3x200x300", "300x170", "", "3x200x170"),
    ("2x300x130", "2x300x90", "{transpose_a = true}", "2x130x90"),
    ("130x100", "4x250x100", "{transpose_b = true}", "4x130x250"),
    ("2x1x70x40", "3x40x50", "", "2x3x70x50"),                        # batch broadcasting both ways
    ("150x96", "96x200", "", "150x200"),
]


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", MATMUL_CASES, ids=[c[0] + "@" + c[1] for c in MATMUL_CASES])
def test_matmul_matches_reference(case, dtype):
    a, b, attrs, r = case
    op = one_op(f"%c = ge.matmul %a, %b {attrs} : tensor<{r}x{dtype}>",
                f"%a: tensor<{a}x{dtype}>, %b: tensor<{b}x{dtype}>")
    check_against_reference(op, random_inputs(op), exact=False, dtype=dtype)


def test_matmul_of_an_nz_operand_reads_the_same_values():
    op = one_op("%c = ge.matmul %a, %b : tensor<100x200xf16>",
                "%a: tensor<100x64xf16>, %b: tensor<64x200xf16, NZ>")
    check_against_reference(op, random_inputs(op), exact=False, dtype="f16")


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
def test_fused_matmul_epilogue_matches_reference(activation, dtype):
    act = "" if activation == "none" else f', activation = "{activation}"'
    op = one_op(f"%c = ge.fused_matmul %a, %b, %bias {{transpose_b = true{act}}} : tensor<2x150x200x{dtype}>",
                f"%a: tensor<2x150x72x{dtype}>, %b: tensor<200x72x{dtype}>, %bias: tensor<200x{dtype}>")
    check_against_reference(op, random_inputs(op), exact=False, dtype=dtype)


def test_fused_matmul_without_bias_and_with_a_broadcast_bias():
    op = one_op('%c = ge.fused_matmul %a, %b {activation = "relu"} : tensor<130x70xf32>',
                "%a: tensor<130x40xf32>, %b: tensor<40x70xf32>")
    check_against_reference(op, random_inputs(op), exact=False)
    op = one_op("%c = ge.fused_matmul %a, %b, %bias : tensor<130x70xf32>",
                "%a: tensor<130x40xf32>, %b: tensor<40x70xf32>, %bias: tensor<130x1xf32>")
    check_against_reference(op, random_inputs(op), exact=False)


def test_matmul_gm_bytes_are_the_analytic_count():
    # A is read once per output column tile, B once per output row tile, C written once:
    # read = batch * (tn * M*K + tm * K*N) * itemsize, write = batch * M*N * itemsize
    op = one_op("%c = ge.matmul %a, %b : tensor<2x300x500xf16>", "%a: tensor<2x300x200xf16>, %b: tensor<2x200x500xf16>")
    t = op.attributes["tiling"]
    _, ctx = launch(op, random_inputs(op))
    B, M, N, K = 2, 300, 500, 200
    tm, tn = -(-M // t["base_m"]), -(-N // t["base_n"])
    assert tm > 1 and tn > 1  # A and B are each read more than once
    assert ctx.gm.gm_read_bytes == B * (tn * M * K + tm * K * N) * 2
    assert ctx.gm.gm_write_bytes == B * M * N * 2
    # A and B were never seen before: the first read of every byte comes from HBM, the rest from L2
    assert ctx.gm.hbm_read_bytes == B * (M * K + K * N) * 2


def test_a_batched_a_against_one_weight_reads_the_weight_once():
    # A decode step's projection: 8 sequences of one row each against one [K, N] weight. As ATen folds it
    # (matmul's should_fold), the cube runs one [8, K] @ [K, N] problem: B is read once (not once per
    # sequence), A once per column tile, and the numbers are the per-item product's own.
    K, N = 512, 768
    op = one_op(f"%c = ge.matmul %a, %b : tensor<8x1x{N}xf16>", f"%a: tensor<8x1x{K}xf16>, %b: tensor<{K}x{N}xf16>")
    t = op.attributes["tiling"]
    inputs = random_inputs(op)
    (out,), ctx = launch(op, inputs)
    tn = -(-N // t["base_n"])
    assert -(-8 // t["base_m"]) == 1  # the 8 rows share one row block
    assert ctx.gm.gm_read_bytes == (tn * 8 * K + K * N) * 2
    assert ctx.gm.hbm_read_bytes == (8 * K + K * N) * 2
    ref = (inputs[0].astype(np.float64) @ inputs[1].astype(np.float64))
    assert np.allclose(out.astype(np.float64), ref, rtol=2e-2, atol=2e-2)


def test_a2_activation_epilogue_runs_on_the_aivs_through_a_gm_workspace():
    # Atlas A2: the AIC's FIXP writes each f32 block to a workspace, its AIVs read it back (AIV_MTE2), run the
    # activation and store C. Traffic beyond the plain matmul: M x N f32 written and read once; the same numbers
    body, args = ('%c = ge.fused_matmul %a, %b {activation = "gelu"} : tensor<256x512xf16>',
                  "%a: tensor<256x384xf16>, %b: tensor<384x512xf16>")
    M, N, K = 256, 512, 384
    op, plain = one_op(body, args), one_op("%c = ge.matmul %a, %b : tensor<256x512xf16>", args)
    assert op.attributes["tiling"]["template"] == "MatmulMixEpilogue"
    # the plain matmul on the same blocks and core split (the mixed kernel's head of 3 cores an AIC may split
    # C over fewer cores than the plain one's rule would)
    plain.attributes["tiling"] = {**op.attributes["tiling"], "template": "MatmulBasicBlock"}
    inputs = random_inputs(op)
    (out,), ctx = launch(op, inputs)
    _, base = launch(plain, inputs)
    assert ctx.gm.gm_write_bytes - base.gm.gm_write_bytes == M * N * 4
    assert ctx.gm.gm_read_bytes - base.gm.gm_read_bytes == M * N * 4
    assert ctx.cores.busy[PIPE_INDEX["AIV_MTE2"]].sum() > 0 and base.cores.busy[PIPE_INDEX["AIV_MTE2"]].sum() == 0
    on_chip, ctx_a = launch(one_op(body, args, "ascend910a"), inputs, "ascend910a")
    assert bits_equal(out, on_chip[0])
    assert ctx_a.gm.gm_write_bytes == M * N * 2  # one AI core: L0C -> UB on chip, only C leaves it


def _intervals(cores: Cores, pipe: str, core: int) -> list[tuple[float, float]]:
    out = []
    for iv in cores.intervals:
        if iv.pipe == PIPE_INDEX[pipe]:
            hit = np.nonzero(np.asarray(iv.cores) == core)[0]
            out += [(float(iv.start[i]), float(iv.end[i])) for i in hit]
    return out


def test_matmul_loads_overlap_the_cube_with_double_buffering():
    text = ("%c = ge.matmul %a, %b : tensor<256x256xf16>", "%a: tensor<256x1024xf16>, %b: tensor<1024x256xf16>")
    op = one_op(*text)
    assert op.attributes["tiling"]["buffers"] == 2
    assert -(-1024 // op.attributes["tiling"]["base_k"]) > 4  # several k steps
    _, ctx = launch(op, random_inputs(op), record=True)
    loads, cube = _intervals(ctx.cores, "MTE2", 0), _intervals(ctx.cores, "CUBE", 0)
    assert loads and cube
    assert any(s1 < e2 and s2 < e1 for s1, e1 in loads for s2, e2 in cube)
    single = one_op(*text)
    t = single.attributes["tiling"]
    single.attributes["tiling"] = dict(t, buffers=1, depth_a1=t["step_ka"], depth_b1=t["step_kb"])
    _, ctx1 = launch(single, random_inputs(single))
    assert ctx1.cores.finish > ctx.cores.finish  # one buffer: every load waits for the cube to free its slot


def test_matmul_drains_a_block_while_the_cube_computes_the_next_with_two_l0c_accumulators():
    # FIXP drains a finished block from L0C to GM; a 128 x 128 f32 block is half the 910B's 128 KiB L0C, so with two
    # accumulators the next block's mmad runs during the drain, and on a chip whose L0C holds one it waits for it.
    # The second of two calls (its operands warm in the L2), so that the loads do not hide the drain
    text = ("%c = ge.matmul %a, %b : tensor<4096x128xf16>", "%a: tensor<4096x64xf16>, %b: tensor<64x128xf16>")

    def second_call(target: str) -> tuple[float, int]:
        op = one_op(*text, target)
        inputs = random_inputs(op)
        t = load_target(target)
        ctx = LaunchContext(t, Cores(t.cube_cores, record=True), GlobalMemory(t),
                            [v.name for v in op.operands], [r.name for r in op.results])
        kernel = KERNELS[op.name]
        tiling = kernel.tiling_for(op, inputs, t)
        assert (tiling.base_m, tiling.base_n) == (128, 128)
        kernel.run(op, inputs, tiling, ctx)
        start = ctx.cores.finish
        ctx.cores.sync_to(start)
        ctx.cores.intervals.clear()
        kernel.run(op, inputs, tiling, ctx)
        drains, mmads = _intervals(ctx.cores, "FIXP", 0), _intervals(ctx.cores, "CUBE", 0)
        return ctx.cores.finish - start, sum(1 for s1, e1 in drains for s2, e2 in mmads if s1 < e2 and s2 < e1)

    two, overlapped = second_call("ascend910b")
    one, waited = second_call("ascend910b[buffers_kib.l0c=64]")
    assert overlapped > 0 and waited == 0 and one > two


@pytest.mark.parametrize("m, k, n", [(4, 8, 0), (0, 8, 8), (4, 0, 8), (0, 0, 0), (3, 0, 40)])
def test_a_matmul_with_an_empty_dimension_is_tiled_and_gives_numpys_result(m, k, n):
    # an empty C, or a K that sums nothing (C is zeros): the tiling still has a block shape and the kernel runs
    op = one_op(f"%c = ge.matmul %a, %b : tensor<{m}x{n}xf16>", f"%a: tensor<{m}x{k}xf16>, %b: tensor<{k}x{n}xf16>")
    t = op.attributes["tiling"]
    assert min(t["base_m"], t["base_n"], t["base_k"]) >= 16
    a, b = random_inputs(op)
    (out,), _ = launch(op, [a, b])
    assert out.shape == (m, n) and np.array_equal(out, (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16))


@pytest.mark.parametrize("sq, skv", [(16, 0), (0, 16), (0, 0)])
def test_flash_attention_over_no_keys_or_no_queries_matches_torch(sq, skv):
    # no keys: P V sums nothing, O is zeros (torch's SDPA, and softmax over an empty row then an empty matmul)
    torch = pytest.importorskip("torch")
    q_type, kv_type = f"tensor<1x2x{sq}x64xf16>", f"tensor<1x2x{skv}x64xf16>"
    op = one_op(f"%o = ge.flash_attention %q, %k, %v : {q_type}", f"%q: {q_type}, %k: {kv_type}, %v: {kv_type}")
    inputs = random_inputs(op)
    (out,), _ = launch(op, inputs)
    want = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(x.astype(np.float32)) for x in inputs))
    assert out.shape == (1, 2, sq, 64) and np.array_equal(out.astype(np.float32), want.numpy())
    assert np.array_equal(run_op(op, inputs)[0], out)  # the op's numpy semantics agree


# --- elementwise -------------------------------------------------------------------------------------

UNARY = ["exp", "log", "sqrt", "rsqrt", "neg", "abs", "tanh", "sigmoid", "relu", "silu", "erf", "sin", "cos"]
BINARY = ["add", "sub", "mul", "div", "max", "min", "pow"]


def test_every_op_family_has_a_kernel():
    # isinf and isnan, gather, arange and cumsum are tested in test_indexing_ops.py
    tested = {f"ge.{n}" for n in UNARY + BINARY + ["greater", "less", "equal", "select", "cast", "gelu", "isinf", "isnan"]}
    assert tested == ELEMENTWISE_OPS
    others = {"ge.fused_elementwise", "ge.matmul", "ge.fused_matmul", "ge.softmax", "ge.layer_norm", "ge.rms_norm",
              "ge.reduce_sum", "ge.reduce_max", "ge.reduce_mean", "ge.transpose", "ge.reshape", "ge.concat",
              "ge.split", "ge.slice", "ge.trans_data", "ge.gather", "ge.arange", "ge.cumsum"}
    assert all(name in KERNELS for name in ELEMENTWISE_OPS | others)  # by name or by trait (the row ops)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("name", UNARY + ["gelu", "gelu_tanh"])
def test_unary_ops_are_bit_exact(name, dtype):
    attrs = ' {approximate = "tanh"}' if name == "gelu_tanh" else ""
    op = one_op(f"%y = ge.{name.split('_')[0]} %x{attrs} : tensor<5x77x33x{dtype}>", f"%x: tensor<5x77x33x{dtype}>")
    check_against_reference(op, random_inputs(op, positive=name in ("log", "sqrt", "rsqrt")), exact=True)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("name", BINARY + ["greater", "less", "equal"])
@pytest.mark.parametrize("b_shape", ["5x77x33", "77x1", "33", "1"], ids=["full", "column", "row", "scalar"])
def test_binary_ops_with_broadcasting_are_bit_exact(name, dtype, b_shape):
    out = "i1" if name in ("greater", "less", "equal") else dtype
    op = one_op(f"%y = ge.{name} %a, %b : tensor<5x77x33x{out}>",
                f"%a: tensor<5x77x33x{dtype}>, %b: tensor<{b_shape}x{dtype}>")
    check_against_reference(op, random_inputs(op, positive=name == "pow"), exact=True)


def test_select_cast_and_integer_ops_are_bit_exact():
    op = one_op("%y = ge.select %c, %a, %b : tensor<6x50x41xf16>",
                "%c: tensor<6x50x41xi1>, %a: tensor<41xf16>, %b: tensor<6x50x41xf16>")
    check_against_reference(op, random_inputs(op), exact=True)
    for to in ("f16", "bf16", "i32"):
        op = one_op(f"%y = ge.cast %x {{to = {to}}} : tensor<7x300x{to}>", "%x: tensor<7x300xf32>")
        check_against_reference(op, random_inputs(op), exact=True)
    op = one_op("%y = ge.div %a, %b : tensor<40x70xi32>", "%a: tensor<40x70xi32>, %b: tensor<70xi32>")
    a, b = random_inputs(op)
    check_against_reference(op, [a, np.where(b == 0, 7, b).astype(np.int32)], exact=True)


def test_elementwise_over_several_waves():
    op = one_op("%y = ge.add %a, %b : tensor<1000x1000xf32>", "%a: tensor<1000x1000xf32>, %b: tensor<1000xf32>")
    elems = op.attributes["tiling"]["elems"]
    assert -(-10**6 // elems) > 48  # more tiles than vector units
    _, ctx = check_against_reference(op, random_inputs(op), exact=True)
    # the full operand is read once and the result written once; the row stays resident
    assert ctx.gm.gm_write_bytes == 4 * 10**6
    assert 4 * 10**6 <= ctx.gm.gm_read_bytes <= 4 * 10**6 + 48 * 4000


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_fused_elementwise_chain_is_bit_exact(dtype):
    body = ('[{op = "ge.mul", args = [0, 1]}, {op = "ge.add", args = [3, 2]}, '
            '{op = "ge.gelu", args = [4], attrs = {approximate = "tanh"}}, {op = "ge.sub", args = [5, 0]}]')
    op = one_op(f"%y = ge.fused_elementwise %x, %s, %b {{body = {body}}} : tensor<4x50x70x{dtype}>",
                f"%x: tensor<4x50x70x{dtype}>, %s: tensor<4x50x70x{dtype}>, %b: tensor<70x{dtype}>")
    _, ctx = check_against_reference(op, random_inputs(op), exact=True)
    n = 4 * 50 * 70 * NP[dtype].itemsize
    # each input tile is loaded once (the bias row once per vector unit), one store
    assert ctx.gm.gm_write_bytes == n
    assert 2 * n <= ctx.gm.gm_read_bytes <= 2 * n + 48 * 70 * NP[dtype].itemsize


# --- row ops -------------------------------------------------------------------------------------------

ROW_CASES = [
    ("%y = ge.softmax %x : tensor<5x77x300x{t}>", "%x: tensor<5x77x300x{t}>"),
    ("%y = ge.softmax %x {{axis = 1}} : tensor<5x77x30x{t}>", "%x: tensor<5x77x30x{t}>"),
    ("%y = ge.reduce_sum %x {{axes = [-1]}} : tensor<5x77x{t}>", "%x: tensor<5x77x300x{t}>"),
    ("%y = ge.reduce_max %x {{axes = [0, 2], keepdims = true}} : tensor<1x77x1x{t}>", "%x: tensor<5x77x30x{t}>"),
    ("%y = ge.reduce_mean %x {{axes = [1]}} : tensor<5x30x{t}>", "%x: tensor<5x77x30x{t}>"),
    ("%y = ge.layer_norm %x, %g, %b {{epsilon = 1e-5}} : tensor<5x77x300x{t}>",
     "%x: tensor<5x77x300x{t}>, %g: tensor<300x{t}>, %b: tensor<300x{t}>"),
    ("%y = ge.layer_norm %x, %g, %b {{axis = -2, epsilon = 1e-5}} : tensor<5x7x30x{t}>",
     "%x: tensor<5x7x30x{t}>, %g: tensor<7x30x{t}>, %b: tensor<30x{t}>"),
    ("%y = ge.rms_norm %x, %g {{epsilon = 1e-6}} : tensor<5x77x300x{t}>",
     "%x: tensor<5x77x300x{t}>, %g: tensor<300x{t}>"),
    ("%y = ge.rms_norm %x, %g {{epsilon = 1e-6}} : tensor<3x40x100x{t}>",
     "%x: tensor<3x40x100x{t}>, %g: tensor<3x40x100x{t}>"),                   # gamma varies per row
]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", ROW_CASES, ids=[c[0].split()[2] + str(i) for i, c in enumerate(ROW_CASES)])
def test_row_ops_match_reference(case, dtype):
    op = one_op(case[0].format(t=dtype), case[1].format(t=dtype))
    assert op.attributes["tiling"]["template"] == "VectorRow"
    check_against_reference(op, random_inputs(op), exact=False, dtype=dtype)


@pytest.mark.parametrize("case", ROW_CASES[:1] + ROW_CASES[2:6] + ROW_CASES[7:],
                         ids=lambda c: c[0].split()[2])
def test_row_ops_on_segmented_rows_combine_the_segments(case):
    # rows longer than UB are cut in segments; force 3 of them on a small row to check the combination
    op = one_op(case[0].format(t="f32"), case[1].format(t="f32"))
    tiling = op.attributes["tiling"]
    x = op.operands[0].type.shape
    C = x[-1] if op.name != "ge.reduce_max" else x[0] * x[2]
    if op.name == "ge.reduce_mean":
        C = x[1]
    op.attributes["tiling"] = dict(tiling, segments=3, cols=-(-C // 3), rows=4)
    check_against_reference(op, random_inputs(op), exact=False, dtype="f32")


def test_vector_loads_overlap_the_vector_unit_with_double_buffering():
    text = ("%y = ge.softmax %x : tensor<16x100x1024xf16>", "%x: tensor<16x100x1024xf16>")
    op = one_op(*text)
    tiling = op.attributes["tiling"]
    assert tiling["buffers"] == 2 and -(-1600 // tiling["rows"]) > 2 * 48  # several tiles per vector unit
    x = random_inputs(op)
    _, ctx = launch(op, x, record=True)
    loads, vec = _intervals(ctx.cores, "MTE2", 0), _intervals(ctx.cores, "VECTOR", 0)
    assert any(s1 < e2 and s2 < e1 for s1, e1 in loads for s2, e2 in vec)
    op.attributes["tiling"] = dict(tiling, buffers=1)
    _, ctx1 = launch(op, x)
    assert ctx1.cores.finish > ctx.cores.finish


def test_softmax_along_the_last_axis_is_bit_exact():
    op = one_op("%y = ge.softmax %x : tensor<3x100x257xf16>", "%x: tensor<3x100x257xf16>")
    check_against_reference(op, random_inputs(op), exact=True)


# --- data movement ------------------------------------------------------------------------------------

MOVE_CASES = [
    ("%y = ge.transpose %x {{perm = [2, 0, 1]}} : tensor<33x5x77x{t}>", "%x: tensor<5x77x33x{t}>"),
    ("%y = ge.reshape %x {{shape = [5, -1]}} : tensor<5x2541x{t}>", "%x: tensor<5x77x33x{t}>"),
    ("%y = ge.concat %a, %b, %c {{axis = 1}} : tensor<5x90x33x{t}>",
     "%a: tensor<5x77x33x{t}>, %b: tensor<5x1x33x{t}>, %c: tensor<5x12x33x{t}>"),
    ("%y0, %y1, %y2 = ge.split %x {{axis = 2, sizes = [10, 20, 3]}} : tensor<5x77x10x{t}>, tensor<5x77x20x{t}>, "
     "tensor<5x77x3x{t}>", "%x: tensor<5x77x33x{t}>"),
    ("%y = ge.slice %x {{axes = [1, 2], starts = [3, -20], ends = [70, 100]}} : tensor<5x67x20x{t}>",
     "%x: tensor<5x77x33x{t}>"),
    ('%y = ge.trans_data %x {{dst_format = "NZ"}} : tensor<77x33x{t}, NZ>', "%x: tensor<77x33x{t}>"),
]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", MOVE_CASES, ids=lambda c: c[0].split("=")[1].split()[0])
def test_data_movement_is_exact(case, dtype):
    op = one_op(case[0].format(t=dtype), case[1].format(t=dtype))
    outs, ctx = launch(op, random_inputs(op))
    refs = run_op(op, random_inputs(op))
    assert all(bits_equal(np.ascontiguousarray(o), np.ascontiguousarray(r)) for o, r in zip(outs, refs))
    moved = sum(r.nbytes for r in refs)
    if op.name == "ge.reshape":
        assert ctx.gm.gm_read_bytes == ctx.gm.gm_write_bytes == 0 and ctx.cores.finish == 0  # a view
    else:
        assert ctx.gm.gm_read_bytes == ctx.gm.gm_write_bytes == moved and ctx.cores.finish > 0


# --- capacities and faults ----------------------------------------------------------------------------

def test_a_tile_too_large_for_its_buffer_raises_capacity_error():
    op = one_op("%y = ge.softmax %x : tensor<64x4096xf16>", "%x: tensor<64x4096xf16>")
    op.attributes["tiling"] = dict(op.attributes["tiling"], rows=64)
    with pytest.raises(CapacityError, match=r"UB overflow: .* needs \d+ bytes, but UB holds 196608 bytes"):
        launch(op, random_inputs(op))
    op = one_op("%y = ge.add %a, %b : tensor<4096x64xf32>", "%a: tensor<4096x64xf32>, %b: tensor<4096x64xf32>")
    op.attributes["tiling"] = dict(op.attributes["tiling"], elems=65536)
    with pytest.raises(CapacityError, match="UB overflow"):
        launch(op, random_inputs(op))
    op = one_op("%c = ge.matmul %a, %b : tensor<256x256xf16>", "%a: tensor<256x256xf16>, %b: tensor<256x256xf16>")
    op.attributes["tiling"] = dict(op.attributes["tiling"], base_m=256, base_n=256, base_k=256, single_core_m=256,
                                   single_core_n=256)
    # L1 is allocated first: 8 k slices (4 a load, double-buffered) of A and of B, 256 x 256 each in f16
    with pytest.raises(CapacityError, match=rf"L1 overflow: .* needs {8 * 2 * 256 * 256 * 2} bytes, but L1 holds 524288"):
        launch(op, random_inputs(op))


@pytest.mark.parametrize("body, args", [
    ("%c = ge.matmul %a, %b : tensor<64x64xf16>", "%a: tensor<64x64xf16>, %b: tensor<64x64xf16>"),
    ("%y = ge.exp %x : tensor<64x64xf16>", "%x: tensor<64x64xf16>"),
    ("%y = ge.softmax %x : tensor<64x64xf16>", "%x: tensor<64x64xf16>"),
    ("%y = ge.transpose %x {perm = [1, 0]} : tensor<64x64xf16>", "%x: tensor<64x64xf16>"),
])
def test_injected_ub_overflow_raises(body, args):
    op = one_op(body, args)
    with pytest.raises(CapacityError, match="UB overflow"):
        launch(op, random_inputs(op), fault="ub_overflow")


@pytest.mark.parametrize("target", ["ascend910a", "ascend310p"])
def test_other_targets_run_their_tile_pass_choice(target):
    op = one_op("%c = ge.fused_matmul %a, %b, %bias {activation = \"gelu\"} : tensor<3x100x300xf16>",
                "%a: tensor<3x100x64xf16>, %b: tensor<64x300xf16>, %bias: tensor<300xf16>", target)
    check_against_reference(op, random_inputs(op), exact=False, dtype="f16", target=target)
    op = one_op("%y = ge.layer_norm %x, %g, %b : tensor<300x100xf16>",
                "%x: tensor<300x100xf16>, %g: tensor<100xf16>, %b: tensor<100xf16>", target)
    check_against_reference(op, random_inputs(op), exact=False, dtype="f16", target=target)


def test_a_kernel_without_tiling_uses_the_tile_pass_choice():
    op = one_op("%c = ge.matmul %a, %b : tensor<100x300xf16>", "%a: tensor<100x64xf16>, %b: tensor<64x300xf16>")
    op.attributes.pop("tiling")
    check_against_reference(op, random_inputs(op), exact=False, dtype="f16")


# --- unfused attention: the N x N intermediates and L2 --------------------------------------------------

def unfused_attention(S: int, N: int = 8, D: int = 128, seed: int = 0):
    """matmul, softmax, matmul on one chip, op after op; returns the per-op GM deltas and the chip."""
    T, P = f"tensor<1x{N}x{S}x{D}xf16>", f"tensor<1x{N}x{S}x{S}xf16>"
    graph = compile_graph(f"""ge.graph @main(%q: {T}, %k: {T}, %v: {T}) -> {T} {{
  %s = ge.matmul %q, %k {{transpose_b = true}} : {P}
  %p = ge.softmax %s : {P}
  %o = ge.matmul %p, %v : {T}
  ge.return %o
}}""")
    t = load_target("ascend910b")
    cores, gm = Cores(t.cube_cores), GlobalMemory(t)
    rng = np.random.default_rng(seed)
    env = {a.name: (0.3 * rng.standard_normal((1, N, S, D))).astype(np.float16) for a in graph.args}
    deltas = {}
    for op in graph.ops[:-1]:
        before = (gm.hbm_read_bytes, gm.gm_read_bytes, cores.finish)
        cores.sync_to(cores.finish)
        ctx = LaunchContext(t, cores, gm, [v.name for v in op.operands], [r.name for r in op.results])
        kernel, inputs = KERNELS[op.name], [env[v.name] for v in op.operands]
        env[op.results[0].name] = kernel.run(op, inputs, kernel.tiling_for(op, inputs, t), ctx)[0]
        deltas[op.results[0].name] = (gm.hbm_read_bytes - before[0], gm.gm_read_bytes - before[1],
                                      cores.finish - before[2])
    return env, deltas, cores


def test_unfused_attention_small_scores_stay_in_l2():
    env, deltas, _ = unfused_attention(512)
    scores = 8 * 512 * 512 * 2
    assert deltas["p"][1] == scores and deltas["p"][0] == 0      # softmax reads the scores from L2
    assert deltas["o"][0] == 8 * 512 * 128 * 2                    # the second matmul: only v is cold
    q, k, v = (env[n].astype(np.float32) for n in "qkv")
    s = q @ np.swapaxes(k, -1, -2)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(env["o"].astype(np.float32), ref, rtol=1e-2, atol=2e-3)


def test_unfused_attention_large_scores_come_back_from_hbm():
    # 8 x 4096 x 4096 f16 scores are 256 MiB, past the 192 MiB L2: the softmax and the second matmul
    # read them (and the probabilities) back from HBM
    _, deltas, cores = unfused_attention(4096)
    scores = 8 * 4096 * 4096 * 2
    assert deltas["p"][0] >= 0.9 * scores
    assert deltas["o"][0] >= 0.9 * scores
    assert all(d[2] > 0 for d in deltas.values())
