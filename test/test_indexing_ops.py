"""ge.gather, ge.arange, ge.cumsum, ge.isinf and ge.isnan: semantics, kernels and frontend mappings.

Oracles are independent of the code under test: gathers built row by row with Python indexing, numpy's
arange, cumsum, isinf and isnan, analytic byte counts for the gather kernel's global-memory traffic,
torch's own outputs for the PyTorch mappings and ONNX's reference evaluator for the ONNX ones.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from geir.kernels import KERNELS
from geir.kernels.gather_tiling import GatherTiling
from geir.kernels.tiling import OpSignature
from geir.kernels.vector_tiling import ScanTiling
from geir.reference import run_op
from geir.target_npu import load_target
from geir.target_npu.sim import PIPE_INDEX, DeviceFault

from test_kernels import bits_equal, launch, one_op

TARGET = load_target("ascend910b")
LATENCY = TARGET.data["memory"]["dma_latency_cycles"]


def gather_by_rows(table: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray:
    """np.take written out: the slice of `table` along `axis` for each index, stacked in the indices' shape."""
    axis %= table.ndim
    dim = table.shape[axis]
    slices = [table[(slice(None),) * axis + (int(i) if i >= 0 else int(i) + dim,)] for i in indices.reshape(-1)]
    stacked = np.stack(slices, axis=axis) if slices else np.empty(table.shape[:axis] + (0,) + table.shape[axis + 1:],
                                                                 table.dtype)
    return stacked.reshape(table.shape[:axis] + indices.shape + table.shape[axis + 1:])


def _table_and_indices(op, seed=0):
    rng = np.random.default_rng(seed)
    t, i = op.operands[0].type, op.operands[1].type
    table = rng.standard_normal(t.shape).astype(t.dtype.np) if t.dtype.is_float else \
        rng.integers(-1000, 1000, t.shape).astype(t.dtype.np)
    dim = t.shape[op.axis % t.rank]
    return table, rng.integers(-dim, dim, i.shape).astype(i.dtype.np)


# --- semantics -------------------------------------------------------------------------------------------

GATHERS = [
    # (table type, indices type, axis): an embedding, a middle axis, the last axis, a scalar index
    ("1000x64xf16", "4x16xi64", 0),
    ("3x50x7xf32", "5xi32", 1),
    ("2x100xf32", "9x3xi32", -1),
    ("40x8xbf16", "i64", 0),
    ("30x6xi64", "2x2x2xi8", 0),
]


def _gather_op(table: str, indices: str, axis: int):
    tshape = [int(d) for d in table.rsplit("x", 1)[0].split("x")] if "x" in table else []
    ishape = [int(d) for d in indices.rsplit("x", 1)[0].split("x")] if "x" in indices else []
    dtype = table.rsplit("x", 1)[-1]
    a = axis % len(tshape)
    out = tshape[:a] + ishape + tshape[a + 1:]
    otype = "x".join(map(str, out)) + "x" + dtype if out else dtype
    return one_op(f"%y = ge.gather %t, %i {{axis = {axis}}} : tensor<{otype}>",
                  f"%t: tensor<{table}>, %i: tensor<{indices}>")


@pytest.mark.parametrize("case", GATHERS, ids=lambda c: f"{c[0]}[{c[1]}]@{c[2]}")
def test_gather_semantics_and_kernel_equal_rows_picked_one_by_one(case):
    op = _gather_op(*case)
    table, indices = _table_and_indices(op)
    want = gather_by_rows(table, indices, case[2])
    (ref,) = run_op(op, [table, indices])
    assert bits_equal(ref, want)
    (got,), ctx = launch(op, [table, indices])
    assert bits_equal(got, want)
    assert ctx.cores.finish > 0


@pytest.mark.parametrize("case", GATHERS[:3], ids=lambda c: f"{c[0]}[{c[1]}]@{c[2]}")
def test_gather_gm_traffic_is_the_rows_and_their_indices(case):
    op = _gather_op(*case)
    table, indices = _table_and_indices(op)
    axis = case[2] % table.ndim
    rows = math.prod(table.shape[:axis]) * indices.size  # one output row per (leading slab, index)
    row_bytes = math.prod(table.shape[axis + 1:]) * table.itemsize
    _, ctx = launch(op, [table, indices])
    # every gathered row read once, each row's index read once (a tile reads its indices), written once
    assert ctx.gm.gm_read_bytes == rows * row_bytes + rows * indices.itemsize
    assert ctx.gm.gm_write_bytes == rows * row_bytes


def test_gather_of_rows_longer_than_ub_moves_them_in_pieces():
    op = one_op("%y = ge.gather %t, %i {axis = 0} : tensor<3x100000xf32>", "%t: tensor<10x100000xf32>, %i: tensor<3xi32>")
    tiling = KERNELS["ge.gather"].decode(op.attributes["tiling"])
    pieces = -(-100000 // tiling.cols)
    assert pieces > 1 and tiling.ub_bytes <= TARGET.buffer_bytes("ub")
    table, indices = _table_and_indices(op)
    (got,), ctx = launch(op, [table, indices])
    assert bits_equal(got, gather_by_rows(table, indices, 0))
    # each piece of a row reads the row's index again
    assert ctx.gm.gm_read_bytes == 3 * 100000 * 4 + pieces * 3 * 4
    assert ctx.gm.gm_write_bytes == 3 * 100000 * 4


def test_gather_pays_a_dma_start_for_every_row():
    # rows of 32 bytes: the transfer is short, so the per-row DMA start dominates MTE2
    op = one_op("%y = ge.gather %t, %i {axis = 0} : tensor<4096x16xf16>", "%t: tensor<100x16xf16>, %i: tensor<4096xi32>")
    table, indices = _table_and_indices(op)
    _, ctx = launch(op, [table, indices])
    # a lane (core) of Cores stands for its vector units working side by side: it is busy as long as its
    # busiest unit, which gathered at least its share of the rows
    per = TARGET.data["cores"]["vector_per_cube"]
    busy = ctx.cores.busy[PIPE_INDEX["MTE2"]]
    assert busy.sum() >= 4096 / per * LATENCY
    assert busy.max() >= KERNELS["ge.gather"].decode(op.attributes["tiling"]).rows * LATENCY


def test_gather_timing_does_not_read_the_indices():
    op = _gather_op(*GATHERS[0])
    table, indices = _table_and_indices(op)
    _, a = launch(op, [table, indices])
    _, b = launch(op, [table, np.zeros_like(indices)])
    assert a.cores.finish == b.cores.finish and np.array_equal(a.cores.busy, b.cores.busy)


def test_gather_index_outside_the_table_is_a_device_fault():
    op = _gather_op("10x4xf32", "3xi64", 0)
    table = np.zeros((10, 4), np.float32)
    for bad in (10, -11):
        with pytest.raises(DeviceFault, match=f"gather index {bad} is out of range for axis 0 of size 10"):
            launch(op, [table, np.array([0, bad, 1])])
        with pytest.raises(IndexError, match=f"gather index {bad} is out of range"):
            run_op(op, [table, np.array([0, bad, 1])])


def test_gather_tiling_is_typed_fits_ub_and_shrinks_to_single_rows():
    op = _gather_op(*GATHERS[0])
    kernel = KERNELS["ge.gather"]
    sig = OpSignature.of(op)
    tiling = kernel.choose(sig, TARGET)
    assert isinstance(tiling, GatherTiling) and kernel.decode(tiling.to_attr()) == tiling
    assert kernel.budget(tiling, sig, TARGET).ub == tiling.ub_bytes <= TARGET.buffer_bytes("ub")
    for candidate in kernel.candidates(sig, TARGET):
        assert kernel.budget(candidate, sig, TARGET).ub <= TARGET.buffer_bytes("ub")
    t = tiling
    while (smaller := kernel.shrink(t)) is not None:
        t = smaller[0]
    assert t.rows == 1 and t.buffers == 1


@pytest.mark.parametrize("start, limit, delta, dtype", [
    (0, 16, 1, "i64"), (5, -7, -3, "i32"), (3, 3, 1, "i64"), (0.0, 1.0, 0.1, "f32"), (1.0, -0.6, -0.5, "f16"),
    (-2.5, 100.0, 0.75, "bf16"),
])
def test_arange_is_numpys(start, limit, delta, dtype):
    op = one_op(f"%y = ge.arange {{start = {start}, limit = {limit}, delta = {delta}, dtype = {dtype}}} : "
                f"tensor<{len(np.arange(start, limit, delta))}x{dtype}>", "")
    want = np.arange(start, limit, delta, dtype=np.float64 if dtype[0] in "fb" else np.int64).astype(
        op.results[0].type.dtype.np)
    (ref,) = run_op(op, [])
    assert bits_equal(ref, want)


@pytest.mark.parametrize("dtype, start, delta", [("i64", 7, 3), ("f32", 7.0, 0.3), ("f16", -7.0, 0.5)])
def test_arange_kernel_writes_numpys_sequence(dtype, start, delta):
    n = 100000  # past const-fold's default max-elements: the kernel runs it
    op = one_op(f"%y = ge.arange {{start = {start}, limit = {start + delta * n}, delta = {delta}, dtype = {dtype}}} : "
                f"tensor<{len(np.arange(start, start + delta * n, delta))}x{dtype}>", "")
    (got,), ctx = launch(op, [])
    assert bits_equal(got, np.arange(start, start + delta * n, delta).astype(op.results[0].type.dtype.np))
    assert ctx.gm.gm_read_bytes == 0 and ctx.gm.gm_write_bytes == got.nbytes


CUMSUMS = [
    # (input type, axis): HF's position ids, several tiles of steps, a middle axis, half precision
    ("2x16xi64", 1), ("20000x3xi32", 0), ("4x300x5xi64", 1), ("6x50xf16", -1), ("5000x9xf32", 0),
]


def _inputs_for(op, seed=0):
    rng = np.random.default_rng(seed)
    t = op.operands[0].type
    if t.dtype.is_float:
        return rng.standard_normal(t.shape).astype(t.dtype.np)
    return rng.integers(-100, 100, t.shape).astype(t.dtype.np)


def _cumsum_op(xtype: str, axis: int, extra: str = ""):
    return one_op(f"%y = ge.cumsum %x {{axis = {axis}{extra}}} : tensor<{xtype}>", f"%x: tensor<{xtype}>")


def _running_sums(x: np.ndarray, axis: int, exclusive: bool, reverse: bool) -> np.ndarray:
    """Integer running sums by definition: element i sums the elements before it (and itself unless exclusive),
    counted from the end when reverse."""
    x = np.moveaxis(x, axis, -1).astype(np.int64)
    n = x.shape[-1]
    out = np.zeros_like(x)
    for i in range(n):
        lo, hi = (i + exclusive, n) if reverse else (0, i + 1 - exclusive)
        out[..., i] = x[..., lo:hi].sum(axis=-1)
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("case", CUMSUMS, ids=lambda c: f"{c[0]}@{c[1]}")
def test_cumsum_kernel_equals_the_reference_and_numpy(case):
    op = _cumsum_op(*case)
    x = _inputs_for(op)
    (ref,) = run_op(op, [x])
    (got,), ctx = launch(op, [x])
    assert bits_equal(got, ref)
    if x.dtype.kind == "i":
        assert np.array_equal(got, np.cumsum(x, axis=case[1], dtype=x.dtype))
    elif x.dtype == np.float32:  # numpy's cumsum adds in order in f32: the kernel carries its sums the same way
        assert bits_equal(got, np.cumsum(x, axis=case[1]))
    assert ctx.gm.gm_read_bytes == x.nbytes and ctx.gm.gm_write_bytes == got.nbytes


def test_cumsum_of_a_long_axis_runs_in_several_tiles():
    op = _cumsum_op("20000x3xi32", 0)
    tiling = KERNELS["ge.cumsum"].decode(op.attributes["tiling"])
    assert isinstance(tiling, ScanTiling) and tiling.rows < 20000


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("case", [("20000x3xi32", 0), ("3x40x7xi64", 1)], ids=["tiles", "middle"])
def test_cumsum_exclusive_and_reverse_are_their_definitions(case, exclusive, reverse):
    op = _cumsum_op(*case, f", exclusive = {str(exclusive).lower()}, reverse = {str(reverse).lower()}")
    x = _inputs_for(op)
    want = _running_sums(x, case[1], exclusive, reverse).astype(x.dtype)
    (ref,) = run_op(op, [x])
    (got,), _ = launch(op, [x])
    assert np.array_equal(ref, want) and np.array_equal(got, want)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("name", ["isinf", "isnan"])
def test_float_tests_are_numpys_on_the_vector_kernel(name, dtype):
    op = one_op(f"%y = ge.{name} %x : tensor<7x300xi1>", f"%x: tensor<7x300x{dtype}>")
    x = np.random.default_rng(0).standard_normal((7, 300))
    x[0, :50], x[1, :50], x[2, :50] = np.inf, -np.inf, np.nan
    x = x.astype(op.operands[0].type.dtype.np)
    want = (np.isinf if name == "isinf" else np.isnan)(x.astype(np.float64))
    (ref,) = run_op(op, [x])
    (got,), _ = launch(op, [x])
    assert got.dtype == np.bool_ and np.array_equal(ref, want) and np.array_equal(got, want)
