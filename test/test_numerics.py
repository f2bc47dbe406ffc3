"""Rounding helpers shared by the reference and the kernels agree with numpy's conversions bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geir.ops.numerics import round_in_f32, round_to

EDGES = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 7e4, -7e4, np.inf, -np.inf, np.nan,
                  2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26, 1e-8, 6.1e-5, 0.1, 1 / 3], np.float32)
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16])
def test_round_in_f32_matches_two_conversions_on_edges(dt) -> None:
    with np.errstate(over="ignore"):
        assert _same_bits(round_in_f32(EDGES, dt), EDGES.astype(dt).astype(np.float32))


@settings(max_examples=300, deadline=None)
@given(st.lists(floats32, min_size=1, max_size=64))
def test_round_in_f32_matches_two_conversions(values) -> None:
    x = np.array(values, dtype=np.float32)
    with np.errstate(over="ignore"):
        for dt in (np.float16, ml_dtypes.bfloat16):
            assert _same_bits(round_in_f32(x, dt), x.astype(dt).astype(np.float32))


@settings(max_examples=300, deadline=None)
@given(st.lists(floats32, min_size=1, max_size=64))
def test_round_to_f16_matches_numpy(values) -> None:
    x = np.array(values, dtype=np.float32)
    with np.errstate(over="ignore"):
        got, want = round_to(x, np.float16), x.astype(np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)) or \
        np.all((got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(got) & np.isnan(want)))


def test_round_in_f32_is_exact_on_every_float_around_the_f16_subnormal_edge():
    # every f32 from 2^-16 to 2^-13: subnormal f16s, the smallest normal binade and the switch between them
    lo, hi = np.array([2.0**-16, 2.0**-13], np.float32).view(np.uint32)
    x = np.arange(lo, hi + 1, dtype=np.uint32).view(np.float32)
    want = x.astype(np.float16).astype(np.float32)
    assert _same_bits(round_in_f32(x, np.float16), want)
    assert _same_bits(round_in_f32(x, np.float16, probabilities=True), want)
    assert _same_bits(round_in_f32(-x[::-1], np.float16), -want[::-1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1.0, width=32) | st.just(float("nan")), min_size=1, max_size=64),
       st.booleans())
def test_round_in_f32_of_probabilities_matches_two_conversions(values, transposed) -> None:
    x = np.array(values, dtype=np.float32)
    x = np.stack([x, x * np.float32(1e-5)])  # the second row is mostly f16 subnormals
    x = x.T if transposed else x  # a strided view is rounded as well
    assert _same_bits(round_in_f32(x, np.float16, probabilities=True), x.astype(np.float16).astype(np.float32))
