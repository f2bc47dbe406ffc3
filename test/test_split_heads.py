"""split_heads (qkv_merge's companion): a projection split into pieces each viewed as heads and transposed is
transposed once and split on the head axis.

Oracles: the program without it (the split and the three transposes as their own kernels, qkv_merge disabled): only
data moves, so the results are the same bits; the kernels launched, against the graph: one transpose instead of a
split and three transposes (the split on the head axis of a batch of one cuts runs of bytes: a view, no kernel).
"""

from __future__ import annotations

import numpy as np
import pytest

from geir.parser import parse
from geir.session import compile_module, run_program

DEFAULT = "conv2d-im2col,canonicalize,cse,fuse,layout,tile,plan,lower"
WITHOUT = "conv2d-im2col,canonicalize,cse,fuse{disable=qkv_merge},layout,tile,plan,lower"


def _text(b: int, s: int, heads: tuple[int, int, int], d: int, dt: str) -> str:
    total = sum(heads) * d
    ty = lambda n: f"tensor<{b}x{n}x{s}x{d}x{dt}>"  # noqa: E731
    views = "\n".join(f"  %h{i} = ge.reshape %p{i} {{shape = [{b}, {s}, {n}, {d}]}}\n"
                      f"  %t{i} = ge.transpose %h{i} {{perm = [0, 2, 1, 3]}}" for i, n in enumerate(heads))
    return (f"ge.graph @heads(%x: tensor<{b}x{s}x{total}x{dt}>) -> ({', '.join(ty(n) for n in heads)}) {{\n"
            f"  %p0, %p1, %p2 = ge.split %x {{axis = -1, sizes = [{', '.join(str(n * d) for n in heads)}]}}\n"
            f"{views}\n  ge.return %t0, %t1, %t2\n}}\n")


def _kernels(program) -> list[str]:
    return [op.attr("kernel") for op in program.ops if op.name == "rt.launch" and op.attr("tiling")]


@pytest.mark.parametrize("b, s, heads, d, dt", [(1, 37, (4, 2, 2), 16, "f16"), (1, 256, (32, 8, 8), 128, "f16"),
                                                (2, 9, (3, 2, 2), 32, "f32")])
def test_one_transpose_moves_the_same_bits_as_the_split_and_three_transposes(b, s, heads, d, dt):
    text = _text(b, s, heads, d, dt)
    x = np.random.default_rng(s).standard_normal((b, s, sum(heads) * d)).astype(np.float16 if dt == "f16" else
                                                                                 np.float32)
    fused = compile_module(parse(text, "<heads>"), DEFAULT)[0].graphs[0]
    plain = compile_module(parse(text, "<heads>"), WITHOUT)[0].graphs[0]
    got, want = (run_program(p, {"x": x}).outputs for p in (fused, plain))
    for a, w in zip(got, want):
        assert a.dtype == w.dtype and a.shape == w.shape and np.array_equal(a.view(np.uint8), w.view(np.uint8))
    assert sorted(_kernels(plain)) == ["ge.split", "ge.transpose", "ge.transpose", "ge.transpose"]
    # a batch of one: the head split is runs of the transposed bytes (a view); two batches: a copy
    assert sorted(_kernels(fused)) == (["ge.transpose"] if b == 1 else ["ge.split", "ge.transpose"])
