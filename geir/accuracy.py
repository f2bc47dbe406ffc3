"""The accuracy policy: how a result is judged against the float64 reference (spec section 3).

One home for the tolerances and the rule, used by gerun --check, the tests and the ONNX conformance run.
The rule is torch.compile's accuracy check (`torch._dynamo.utils.same` with `fp64_ref`): a float result
passes when it is element-wise within its dtype's (rtol, atol) of the float64 reference, or when its RMS
error against float64 is at most RMS_MULTIPLIERS[dtype] times the RMS error of the same program run
eagerly in its own precision (`geir.reference`'s eager mode), plus atol / 10. Element-wise tolerances
alone fail correct programs: where the program rounds much (an unscaled f16 score matrix, long f32 sums)
even its eager run misses them. Other dtypes (integers, booleans, f64) must match exactly.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from geir.types import DType, TensorType

# element-wise (rtol, atol) per dtype, as torch.compile's accuracy check uses them
TOLERANCES = {DType.f32: (1e-4, 1e-5), DType.f16: (1e-2, 1e-3), DType.bf16: (2e-2, 1e-2)}

# how many times the eager baseline's RMS error a result may have (the spec's figures): bf16's 8-bit
# mantissa makes the baseline's own error noisy, so it gets 3x (torch's same() gives f16 3x as well)
RMS_MULTIPLIERS = {DType.f32: 2.0, DType.f16: 2.0, DType.bf16: 3.0}

ELEMENTWISE, RMS_RULE, EXACT = "element-wise", "rms rule", "exact"


@attrs.frozen
class Accuracy:
    """How one result compares with the float64 reference: the verdict and the figures that decided it."""

    type: TensorType
    passed: bool
    # the criterion that passed (ELEMENTWISE, RMS_RULE or EXACT); None when the result failed
    criterion: str | None
    rtol: float
    atol: float
    # max over elements of |a - b| / (atol + rtol |b|): within the element-wise tolerance at 1 or less
    max_err: float
    # elements outside the element-wise tolerance (exact dtypes: elements that differ)
    mismatched: int
    # RMS error against float64 and that of the eager baseline; None for exact dtypes, and the
    # baseline's also when there was none
    rms_err: float | None = None
    eager_rms_err: float | None = None
    multiplier: float | None = None

    @property
    def exact(self) -> bool:
        """Whether the result was judged for an exact match (integers, booleans, f64)."""
        return self.rms_err is None

    def render(self, name: str) -> str:
        """One line: `NAME TYPE: figures: PASS (criterion)` or `...: FAIL`."""
        verdict = f"PASS ({self.criterion})" if self.passed else "FAIL"
        if self.exact:
            figures = "" if self.passed else f"{self.mismatched} element(s) differ: "
            return f"{name} {self.type}: {figures}{verdict}"
        baseline = (f"vs eager {self.eager_rms_err:.1e} (limit {self.multiplier:g}x + atol/10)"
                    if self.eager_rms_err is not None else "(no eager baseline)")
        max_err = f"{self.max_err:.2g}x" if math.isfinite(self.max_err) else "inf x"
        return (f"{name} {self.type}: max err {max_err} tolerance (rtol {self.rtol:g}, atol {self.atol:g}), "
                f"rms err {self.rms_err:.1e} {baseline}: {verdict}")


def compare(actual: np.ndarray, expected: np.ndarray, t: TensorType, eager: np.ndarray | None = None) -> Accuracy:
    """Judge one result of type `t` against the float64 reference `expected`, with `eager` the eager baseline.

    In a float result NaN equals NaN and an infinity only itself; without a baseline only the element-wise
    criterion can pass.
    """
    a = np.asarray(actual)
    b = np.asarray(expected)
    if t.dtype not in TOLERANCES:
        same = np.asarray(a == b.astype(a.dtype))
        mismatched = int(same.size - np.count_nonzero(same))
        return Accuracy(t, not mismatched, EXACT if not mismatched else None, 0.0, 0.0,
                        0.0 if not mismatched else math.inf, mismatched)
    rtol, atol = TOLERANCES[t.dtype]
    a, b = a.astype(np.float64), b.astype(np.float64)
    err, same = _errors(a, b)
    finite = np.isfinite(b)
    with np.errstate(all="ignore"):
        bound = atol + rtol * np.abs(b)
        within = np.where(finite, err <= bound, same)
        ratio = np.where(finite, err / bound, np.where(same, 0.0, np.inf))
    mismatched = int(within.size - np.count_nonzero(within))
    max_err = float(ratio.max()) if ratio.size else 0.0
    rms_err = _rms(err)
    multiplier = RMS_MULTIPLIERS[t.dtype]
    eager_rms_err = _rms(_errors(np.asarray(eager).astype(np.float64), b)[0]) if eager is not None else None
    if not mismatched:
        criterion = ELEMENTWISE
    # a baseline that is not finite (eager overflowed where float64 did not) vouches for nothing
    elif (eager_rms_err is not None and math.isfinite(eager_rms_err)
          and rms_err <= multiplier * eager_rms_err + atol / 10):
        criterion = RMS_RULE
    else:
        criterion = None
    return Accuracy(t, criterion is not None, criterion, rtol, atol, max_err, mismatched, rms_err, eager_rms_err,
                    multiplier)


def _errors(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """|a - b| per element (0 where both are NaN or the same infinity, inf where only one is finite or both
    are infinities that differ), and where both are the same non-finite value."""
    finite = np.isfinite(a) & np.isfinite(b)
    same = (np.isnan(a) & np.isnan(b)) | (~finite & (a == b))
    with np.errstate(all="ignore"):
        err = np.where(finite, np.abs(a - b), np.where(same, 0.0, np.inf))
    return err, same


def _rms(err: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(err)))) if err.size else 0.0
