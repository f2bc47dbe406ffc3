"""norm_cast (issue 28): cast_h(norm(cast_f32(x_h))) run as the norm of the 16-bit tensor, and with the residual add
before it, as add_rms_norm.

Oracles: the unfused program (the casts and the f32 norm as their own kernels, the fold disabled): the fold only moves
where the casts happen (16-bit norms compute in f32 and round once), so the results are bit-identical; the
kernels launched, against the graph: the two casts of each norm gone, and the residual add inside the second.
"""

from __future__ import annotations

import numpy as np
import pytest

from geir.parser import parse
from geir.session import compile_module, run_program

DEFAULT = "conv2d-im2col,canonicalize,cse,fuse,layout,tile,plan,lower"
UNFOLDED = "conv2d-im2col,canonicalize,cse,fuse{disable=norm_cast},layout,tile,plan,lower"

# Hugging Face's decoder residual stream in f16 as the torch frontend brings it in: each norm computed in f32 between
# two casts, its weight of ones folded away (a gamma of ones), one norm after an add of the residual
TEXT = """
ge.graph @residual_norms(%x: tensor<{r}x{c}x{dt}>, %r: tensor<{r}x{c}x{dt}>) -> (tensor<{r}x{c}x{dt}>, tensor<{r}x{c}x{dt}>, tensor<{r}x{c}x{dt}>) {{
  %x32 = ge.cast %x {{to = f32}}
  %g = ge.const dense<1.0> : tensor<{c}xf32>
  %n = ge.rms_norm %x32, %g {{epsilon = 1e-6}}
  %n16 = ge.cast %n {{to = {dt}}}
  %h = ge.add %r, %n16
  %h32 = ge.cast %h {{to = f32}}
  %g2 = ge.const dense<[{gamma}]> : tensor<{c}xf32>
  %m = ge.rms_norm %h32, %g2 {{epsilon = 1e-5}}
  %m16 = ge.cast %m {{to = {dt}}}
  ge.return %n16, %h, %m16
}}
"""


def _run(pipeline: str, text: str, feed: dict[str, np.ndarray]):
    program = compile_module(parse(text, "<norm-cast>"), pipeline)[0].graphs[0]
    return program, run_program(program, feed)


@pytest.mark.parametrize("dt, np_dt", [("f16", np.float16), ("bf16", None)])
@pytest.mark.parametrize("rows, cols", [(3, 64), (16, 4096), (5, 1000)])
def test_the_folded_norms_are_bit_identical_to_the_casts_around_f32_norms(dt, np_dt, rows, cols):
    if np_dt is None:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        np_dt = ml_dtypes.bfloat16
    rng = np.random.default_rng(rows * cols)
    gamma = ", ".join(str(float(v)) for v in (rng.integers(-8, 9, cols) / 4.0))  # exact in f16 and bf16
    text = TEXT.format(r=rows, c=cols, dt=dt, gamma=gamma)
    feed = {"x": rng.standard_normal((rows, cols)).astype(np_dt), "r": rng.standard_normal((rows, cols)).astype(np_dt)}
    fused, got = _run(DEFAULT, text, feed)
    plain, want = _run(UNFOLDED, text, feed)
    kernels = [[op.attr("kernel") for op in p.ops if op.name == "rt.launch"] for p in (fused, plain)]
    assert kernels[0] == ["ge.rms_norm", "ge.add_rms_norm"]  # the 4 casts gone, the add inside the second norm
    assert sorted(kernels[1]) == sorted(["ge.cast"] * 4 + ["ge.rms_norm"] * 2 + ["ge.add"])
    for a, b in zip(got.outputs, want.outputs):
        assert a.dtype == b.dtype == np_dt
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
