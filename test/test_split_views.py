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


def _split(shape: tuple[int, ...], axis: int, sizes: list[int]):
    cut = list(shape)
    pieces = []
    for n in sizes:
        cut[axis] = n
        pieces.append(f"tensor<{'x'.join(map(str, cut))}xf32>")
    names = ", ".join(f"%p{i}" for i in range(len(sizes)))
    text = (f"ge.graph @main(%x: tensor<{'x'.join(map(str, shape))}xf32>) -> ({', '.join(pieces)}) {{\n"
            f"  {names} = ge.split %x {{axis = {axis}, sizes = {sizes}}}\n  ge.return {names}\n}}\n")
    program = compile_module(parse(text, "<split>"))[0].graphs[0]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    result = run_program(program, {"x": x})
    (launch,) = [op for op in program.ops if op.name == "rt.launch"]
    (kernel,) = result.kernels
    want = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    for got, piece in zip(result.outputs, want):
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
