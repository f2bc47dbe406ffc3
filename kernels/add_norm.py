"""AddRmsNorm / AddLayerNorm: a residual add and the norm of its sum in one pass over the rows, both written.

Tiles are whole rows (RowTiling: `rows` rows of `cols` elements, in `segments` pieces when a row does not fit UB),
chosen by the row rule of kernels/vector_tiling.py with every operand and both results streamed through UB
(gamma / beta resident when small). Per tile of whole rows:

    MTE2 the rows of x1 and x2 (+ streamed gamma / beta); VECTOR the add and the norm (the op's ROW_PASSES);
    MTE3 the rows of the sum and of the normalised value.

A segmented row takes two passes: the statistics pass loads each segment of x1 and x2, adds them, stores the sum
segment and accumulates the statistics (the op's ROW_STAT_PASSES); the apply pass reads each sum segment back from GM
and stores the normalised segment. The numbers are the op's own `compute` (geir/ops/fused.py), whole rows at a time.

ge.rms_norm_add_rms_norm (x2 normalised before the add) runs the same loop with x2's norm on the row tile first
(its ROW_PASSES count both norms); a segmented row first reads x2's segments for their statistics (the op's
PRE_STAT_PASSES), then runs the statistics and apply passes above.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from geir.kernels import vector_tiling as tiling_rules
from geir.kernels.base import Kernel, LaunchContext, register_kernel
from geir.kernels.data_movement import (
    UbSlots,
    VectorLanes,
    check_fault,
    flat_pieces,
    gm_read,
    gm_tensor,
    gm_write,
    rect_pieces,
    share_pieces,
    result_dtype,
)
from geir.kernels.tiling import Budget, Miss, OpSignature, choice
from geir.kernels.vector_tiling import RowTiling
from geir.ir import Operation
from geir.opdef import lookup
from geir.ops.numerics import round_to
from geir.target_npu.target import Target

# 16-bit floats are cast to f32 on the way in and back on the way out (as the row kernels count them)
CAST_PASSES = 2


def _as_norm(sig: OpSignature) -> OpSignature:
    """The signature the row rule reads: the norm's name (which says the reduced axes), every operand and result
    of the fused op (so both inputs and both results count as streamed)."""
    return attrs.evolve(sig, name=lookup(sig.name).NORM)


@register_kernel
class AddNormKernel(Kernel):
    """Residual add + RMS / layer norm over the last axis (the trailing axes for layer norm), rows a tile."""

    OPS = ("ge.add_rms_norm", "ge.add_layer_norm", "ge.rms_norm_add_rms_norm")
    TILING = RowTiling

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> RowTiling | Miss:
        return choice(lambda: tiling_rules.choose_row_tiling(_as_norm(sig), target, buffers))

    def budget(self, tiling: RowTiling, sig: OpSignature, target: Target) -> Budget:
        return tiling_rules.row_budget(tiling, _as_norm(sig), target)

    def shrink(self, tiling: RowTiling) -> tuple[RowTiling, str] | None:
        return tiling_rules.shrink_rows(tiling)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[RowTiling]:
        return tiling_rules.row_candidates(_as_norm(sig), target, buffers)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: RowTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        x1 = inputs[0]
        rank = x1.ndim
        first = op.attr("axis") % rank if op.name == "ge.add_layer_norm" else rank - 1
        R, C = math.prod(x1.shape[:first]), math.prod(x1.shape[first:])
        dts = [result_dtype(op, i, x1.dtype) for i in (0, 1)]
        self.allocate(tiling, OpSignature.of_arrays(op, inputs), ctx.target,
                      f"{tiling.rows} rows of {tiling.cols} elements: {tiling.buffers} x the streamed tiles")
        if ctx.compute:
            outs = [round_to(np.asarray(a), dt) for a, dt in zip(op.compute(*inputs), dts)]
        else:
            outs = [np.empty(x1.shape, dtype=dt) for dt in dts]
        if R and C:
            self._time(op, ctx, inputs, outs, R, C, tiling)
        return outs

    def _time(self, op: Operation, ctx: LaunchContext, inputs: list[np.ndarray], outs: list[np.ndarray], R: int,
              C: int, tiling: RowTiling) -> None:
        """The tile loop's pipes: loads, vector passes and stores per wave of row tiles."""
        gm, lanes = ctx.gm, VectorLanes(ctx)
        x1 = inputs[0]
        tensors = [gm_tensor(gm, n, a.shape, a.dtype.itemsize) for n, a in zip(ctx.operand_names, inputs)]
        sum_gm, norm_gm = (gm_tensor(gm, n, a.shape, a.dtype.itemsize) for n, a in zip(ctx.result_names, outs))
        ub = ctx.target.buffer_bytes("ub")
        # gamma / beta smaller than the rows and small enough stay resident (loaded once per unit), as the rule counts
        streamed = [g for g, a in zip(tensors, inputs) if a.shape == x1.shape]
        resident = [g for g, a in zip(tensors[2:], inputs[2:]) if a.shape != x1.shape and a.nbytes * 8 <= ub]
        streamed += [g for g, a in zip(tensors[2:], inputs[2:]) if a.shape != x1.shape and a.nbytes * 8 > ub]
        half = any(np.dtype(a.dtype).name in ("float16", "bfloat16") for a in [x1, *outs])
        casts = CAST_PASSES if half else 0
        tr, segments = tiling.rows, max(tiling.segments, 1)
        seg = -(-C // segments)
        nt = -(-R // tr)
        slots = UbSlots(ctx.cores, tiling.buffers, ctx.waits)
        cls = type(op)

        def pieces(g, r0, r1, c0, c1, part):
            if g.size != R * C:  # a resident parameter, read whole
                return flat_pieces(g, np.zeros_like(r0), np.full_like(r0, g.size))
            if C == g.cols:  # one trailing axis: the [R, C] view is the matrix view, a segment a rectangle of it
                return rect_pieces(g, r0, r1, c0, c1)
            if c0 == 0 and c1 == C:
                return flat_pieces(g, r0 * C, r1 * C)
            # a segment of rows over several trailing axes: its share of the tensor's pieces, as the row kernels count
            return share_pieces(g, part, nt * segments, (r1 - r0) * (c1 - c0))

        def moved(on, tensors_, r0, r1, c0, c1, part=0, write=False):
            cost = 0.0
            for g in tensors_:
                p = pieces(g, r0, r1, c0, c1, part)
                cost = cost + (gm_write(gm, g, p) if write else gm_read(gm, g, p))
            return lanes.per_lane(on, cost)

        ready0 = None
        for wave, on in lanes.waves(nt):
            used = lanes.used(on)
            if ready0 is None:  # resident parameters: each unit loads them once before its first tile
                ready0 = np.zeros(ctx.cores.count)
                if resident:
                    ready0[used] = slots.step(used, moved(on, resident, np.zeros_like(wave), np.ones_like(wave), 0, 0),
                                              names=("load resident parameters", "", ""))
            r0 = wave * tr
            r1 = np.minimum(r0 + tr, R)
            rows = r1 - r0
            name = op.name[3:]
            if segments == 1:
                vec = lanes.per_lane(on, lanes.vector(rows * C * 4, cls.ROW_PASSES + casts))
                slots.step(used, moved(on, streamed, r0, r1, 0, C), vec,
                           moved(on, [sum_gm, norm_gm], r0, r1, 0, C, write=True),
                           after=[ready0[used]], names=("load rows", name, "store rows"))
                continue
            for s in range(segments if cls.PRE_STAT_PASSES else 0):  # x2's statistics, when x2 is normalised first
                c0, c1 = s * seg, min((s + 1) * seg, C)
                # x2 cast in (16-bit), nothing stored
                vec = lanes.per_lane(on, lanes.vector(rows * (c1 - c0) * 4, cls.PRE_STAT_PASSES + casts // 2))
                slots.step(used, moved(on, [tensors[1]], r0, r1, c0, c1, wave * segments + s), vec,
                           after=[ready0[used]], names=("load x2 segment", f"{name} x2 statistics", ""))
            for s in range(segments):  # statistics: add, store the sum, accumulate
                c0, c1 = s * seg, min((s + 1) * seg, C)
                vec = lanes.per_lane(on, lanes.vector(rows * (c1 - c0) * 4,
                                                      cls.ROW_STAT_PASSES - cls.PRE_STAT_PASSES + casts))
                slots.step(used, moved(on, streamed, r0, r1, c0, c1, wave * segments + s), vec,
                           moved(on, [sum_gm], r0, r1, c0, c1, wave * segments + s, write=True), after=[ready0[used]],
                           names=("load segments", f"{name} add and statistics", "store sum segment"))
            for s in range(segments):  # apply: the sum read back, normalised, stored
                c0, c1 = s * seg, min((s + 1) * seg, C)
                vec = lanes.per_lane(on, lanes.vector(rows * (c1 - c0) * 4, cls.ROW_PASSES - cls.ROW_STAT_PASSES + casts))
                slots.step(used, moved(on, [sum_gm], r0, r1, c0, c1, wave * segments + s), vec,
                           moved(on, [norm_gm], r0, r1, c0, c1, wave * segments + s, write=True),
                           names=("load sum segment", f"{name} apply", "store segment"))
