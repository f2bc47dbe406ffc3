"""The accuracy policy: how a result is judged against the float64 reference (spec section 3).

One home for the tolerances, used by gerun --check, the tests and the ONNX conformance run.
"""

from __future__ import annotations

import numpy as np

from geir.types import DType, TensorType

# element-wise (rtol, atol) per dtype, as torch.compile's accuracy check uses them
TOLERANCES = {DType.f32: (1e-4, 1e-5), DType.f16: (1e-2, 1e-3), DType.bf16: (2e-2, 1e-2)}


def compare(actual: np.ndarray, expected: np.ndarray, t: TensorType) -> tuple[float, float, bool, str]:
    """(max abs error, max rel error, passed, tolerance text) of one result against the float64 reference."""
    a = np.asarray(actual)
    b = np.asarray(expected)
    if t.dtype in TOLERANCES:
        rtol, atol = TOLERANCES[t.dtype]
        a = a.astype(np.float64)
        b = b.astype(np.float64)
        # numpy's allclose rule, with NaN equal to NaN (equal_nan) and infinities equal only to themselves
        finite = np.isfinite(a) & np.isfinite(b)
        same = (np.isnan(a) & np.isnan(b)) | (~finite & (a == b))
        with np.errstate(all="ignore"):
            err = np.where(finite, np.abs(a - b), np.where(same, 0.0, np.inf))
            rel = np.where(err == 0, 0.0, err / np.abs(b))
            rel = np.where(np.isnan(rel), np.inf, rel)
        ok = bool(np.all(np.where(finite, err <= atol + rtol * np.abs(b), same)))
        tol = f"rtol {rtol:g}, atol {atol:g}"
    else:
        err = np.abs(a.astype(np.float64) - b.astype(np.float64))
        with np.errstate(all="ignore"):
            rel = np.where(err == 0, 0.0, err / np.abs(b.astype(np.float64)))
        ok = bool(np.array_equal(a, b.astype(a.dtype)))
        tol = "exact"
    max_abs = float(err.max()) if err.size else 0.0
    max_rel = float(rel.max()) if rel.size else 0.0
    return max_abs, max_rel, ok, tol
