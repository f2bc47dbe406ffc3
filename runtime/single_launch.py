"""One kernel launch on its own, on a fresh simulated chip: what a tuner times and checks a candidate tiling on.

Like an operator tuned standalone (CANN AOE's op tuning, msKPP), the launch starts with the chip idle and
its operands in HBM, not in L2: a figure of the kernel and its tiling alone, comparable between
candidates. How a tiling does inside a program (with the L2 its neighbours leave behind) is measured by
running the program.
"""

from __future__ import annotations

import zlib

import attrs
import numpy as np

from geir.accuracy import Accuracy, compare
from geir.builder import create_op
from geir.ir import Operation, Value
from geir.kernels import KERNELS, LaunchContext
from geir.kernels.base import KernelStats, flops_of, measure
from geir.kernels.tiling import KernelTiling, OpSignature
from geir.reference import run_op
from geir.runtime.device import stand_in
from geir.target_npu.sim import Cores, GlobalMemory
from geir.target_npu.target import Target
from geir.types import TensorType


def op_of(sig: OpSignature) -> Operation:
    """A detached op with the signature's operand and result types and attributes."""
    operands = [Value(t, f"arg{i}") for i, t in enumerate(sig.operands)]
    return create_op(sig.name, operands, list(sig.results), dict(sig.attributes))


def _context(target: Target, op: Operation, compute: bool) -> LaunchContext:
    return LaunchContext(target, Cores(target.cube_cores), GlobalMemory(target),
                         [f"arg{i}" for i in range(len(op.operands))], [f"out{i}" for i in range(len(op.results))],
                         compute=compute)


def time_launch(sig: OpSignature, tiling: KernelTiling, target: Target) -> KernelStats:
    """The statistics of one timing-only launch of the op with this tiling on an idle chip (operands in HBM)."""
    op = op_of(sig)
    kernel = KERNELS[sig.name]
    ctx = _context(target, op, compute=False)
    args = [stand_in(t) for t in sig.operands]
    _, stats = measure(ctx, sig.name, tiling, flops_of(op), lambda: kernel.run(op, args, tiling, ctx))
    return stats


def time_warm_launch(sig: OpSignature, tiling: KernelTiling, target: Target, warmups: int = 1) -> KernelStats:
    """The statistics of a launch that follows `warmups` launches of the same op on the same operands, back to back
    on one chip: a benchmark loop's steady state, each call finding in the L2 what the calls before it left there."""
    op = op_of(sig)
    kernel = KERNELS[sig.name]
    ctx = _context(target, op, compute=False)
    args = [stand_in(t) for t in sig.operands]
    stats = None
    for _ in range(warmups + 1):
        ctx.cores.sync_to(ctx.cores.finish)  # the next call starts when the last one is done, as a stream runs them
        _, stats = measure(ctx, sig.name, tiling, flops_of(op), lambda: kernel.run(op, args, tiling, ctx))
    return stats


def launch_us(sig: OpSignature, tiling: KernelTiling, target: Target) -> float:
    """Simulated microseconds of one launch of the op with this tiling on an idle chip."""
    return time_launch(sig, tiling, target).cycles / (target.clock_hz / 1e6)


@attrs.frozen
class NumericsCheck:
    """How a tiling's results compared with the float64 reference on a check instance of the op."""

    instance: OpSignature
    results: tuple[Accuracy, ...]
    seed: int
    failure: str | None = None  # why the kernel did not run on the instance at all

    @property
    def passed(self) -> bool:
        return self.failure is None and all(a.passed for a in self.results)

    def render(self) -> str:
        shapes = ", ".join(str(t) for t in self.instance.operands)
        verdicts = self.failure or "; ".join(a.render(f"result{i}") for i, a in enumerate(self.results))
        return f"checked on ({shapes}), seed {self.seed}: {verdicts}"


def check_numerics(sig: OpSignature, tiling: KernelTiling, target: Target, seed: int | None = None) -> NumericsCheck:
    """Run the tiling on the kernel's check instance of the op with random inputs (a seed fixed by the op, unless
    given) and judge each result against the float64 reference, the eager run its baseline (spec section 3)."""
    kernel = KERNELS[sig.name]
    small = kernel.check_instance(sig, tiling)
    seed = zlib.crc32(repr(small.key).encode()) if seed is None else seed
    rng = np.random.default_rng(seed)
    inputs = [_random(t, rng) for t in small.operands]
    op = op_of(small)
    ctx = _context(target, op, compute=True)
    types = [r.type for r in op.results]
    try:
        actual = kernel.run(op, inputs, tiling, ctx)
    except Exception as e:  # noqa: BLE001 - a tiling the kernel cannot run is a check it fails, with the reason
        return NumericsCheck(small, (), seed, f"the kernel failed: {type(e).__name__}: {e}")
    expected = run_op(op, inputs, float64=True, result_types=types)
    eager = run_op(op, inputs, result_types=types)
    return NumericsCheck(small, tuple(compare(a, e, t, b) for a, e, t, b in zip(actual, expected, types, eager)), seed)


def _random(t: TensorType, rng: np.random.Generator) -> np.ndarray:
    """Inputs of a tensor type: standard normal floats, random booleans, and zeros for integers (a valid index into
    any axis; no tiling changes how an integer is computed)."""
    if t.dtype.is_float:
        return rng.standard_normal(t.shape).astype(t.dtype.np)
    if t.dtype.np == np.bool_:
        return rng.random(t.shape) < 0.5
    return np.zeros(t.shape, dtype=t.dtype.np)
