"""A split whose pieces are runs of its operand's bytes (only axes of size 1 before the cut axis: a decode step's
q/k/v out of the merged projection) is a view, as torch's split returns views: no tiling, no device work, the pieces
numpy's split of the operand. A split of a tensor with rows before the cut moves strided bytes and stays a copy.

Oracles: numpy's split for the numbers; for the cost, the bytes a copy must move (the operand once in, the pieces
once out) against the view's none.
"""

from __future__ import annotations

import numpy as np
import pytest

from geir.parser import parse
from geir.session import compile_module, run_program


def _compiled_run(text: str, shape: tuple[int, ...], seed: int):
    """Compile a one-op graph, run it on a random f32 `x` of `shape`: its launch, its kernel record, x, outputs."""
    program = compile_module(parse(text, "<view>"))[0].graphs[0]
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    result = run_program(program, {"x": x})
    (launch,) = [op for op in program.ops if op.name == "rt.launch"]
    (kernel,) = result.kernels
    return launch, kernel, x, result.outputs


def _split(shape: tuple[int, ...], axis: int, sizes: list[int]):
    cut = list(shape)
    pieces = []
    for n in sizes:
        cut[axis] = n
        pieces.append(f"tensor<{'x'.join(map(str, cut))}xf32>")
    names = ", ".join(f"%p{i}" for i in range(len(sizes)))
    text = (f"ge.graph @main(%x: tensor<{'x'.join(map(str, shape))}xf32>) -> ({', '.join(pieces)}) {{\n"
            f"  {names} = ge.split %x {{axis = {axis}, sizes = {sizes}}}\n  ge.return {names}\n}}\n")
    launch, kernel, x, outputs = _compiled_run(text, shape, seed=0)
    want = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    for got, piece in zip(outputs, want):
        np.testing.assert_array_equal(np.asarray(got), piece)
    return launch, kernel, x


@pytest.mark.parametrize("shape, axis, sizes", [((1, 1, 128), -1, [64, 32, 32]), ((1, 256), 1, [128, 128]),
                                                ((1, 4, 16), 1, [1, 3])])
def test_a_split_into_runs_of_bytes_is_a_view(shape, axis, sizes):
    launch, kernel, _ = _split(shape, axis, sizes)
    assert not launch.attr("tiling")
    assert kernel.cycles == 0 and kernel.cores == 0 and kernel.gm_write_bytes == 0


def test_a_split_with_rows_before_the_cut_is_a_copy():
    launch, kernel, x = _split((2, 128), 1, [64, 64])
    assert launch.attr("tiling") and kernel.cycles > 0
    assert kernel.gm_read_bytes == x.nbytes and kernel.gm_write_bytes == x.nbytes


def _slice(shape: tuple[int, ...], axis: int, start: int, end: int, step: int = 1):
    out = list(shape)
    out[axis] = len(range(start, end, step))
    t = lambda s: f"tensor<{'x'.join(map(str, s))}xf32>"  # noqa: E731
    text = (f"ge.graph @main(%x: {t(shape)}) -> {t(out)} {{\n"
            f"  %y = ge.slice %x {{axes = [{axis}], starts = [{start}], ends = [{end}], steps = [{step}]}}\n"
            f"  ge.return %y\n}}\n")
    launch, kernel, x, outputs = _compiled_run(text, shape, seed=1)
    index = [slice(None)] * len(shape)
    index[axis] = slice(start, end, step)
    np.testing.assert_array_equal(np.asarray(outputs[0]), x[tuple(index)])
    return launch, kernel


@pytest.mark.parametrize("shape, axis, start, end", [((1, 1, 128), 2, 64, 96), ((1, 256), 1, 0, 128),
                                                     ((1, 4, 16), 1, 1, 3)])
def test_a_slice_that_is_one_run_of_bytes_is_a_view(shape, axis, start, end):
    """Phi-3's q/k/v of a decode step out of its fused projection: a slice of one run of bytes, a view (torch's
    slice is one too)."""
    launch, kernel = _slice(shape, axis, start, end)
    assert not launch.attr("tiling")
    assert kernel.cycles == 0 and kernel.cores == 0 and kernel.gm_write_bytes == 0


@pytest.mark.parametrize("shape, axis, start, end, step", [((2, 128), 1, 0, 64, 1), ((1, 128), 1, 0, 128, 2),
                                                           ((1, 4, 16), 2, 0, 8, 1)])
def test_a_strided_slice_is_a_copy(shape, axis, start, end, step):
    """Rows before the cut, a step, or a cut before whole axes: the bytes are not one run, the slice moves them."""
    launch, kernel = _slice(shape, axis, start, end, step)
    assert launch.attr("tiling") and kernel.cycles > 0 and kernel.gm_write_bytes > 0
