"""The gated linear unit kernel (`ge.glu`: act(gate) * up), as ops-transformer's SwiGlu runs it: flat tiles of
the gate and up streamed through UB together, `elems` a tile per vector unit.

    per tile   MTE2 the gate and up tiles (from one merged tensor: its two halves, each a strided read), VECTOR the activation's sequence on the gate (the same instruction
               count the activation's own kernel issues) and one Mul, MTE3 the product; 2 UB slots overlap.

The numbers are the op's own `compute` on each wave's tiles, rounded once to the result dtype.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from geir.ir import Operation
from geir.kernels.base import LaunchContext, register_kernel
from geir.kernels.data_movement import FlatTiledKernel, UbSlots, VectorLanes, check_fault, flat_pieces, gm_read, \
    gm_tensor, gm_write, result_dtype, share_pieces
from geir.kernels.tiling import (
    F32_BYTES,
    Budget,
    KernelTiling,
    Miss,
    OpSignature,
    TilingError,
    Untiled,
    align,
    check_buffers,
    choice,
    cut_leading,
    product,
    units_worth_starting,
)
from geir.kernels.vector import CAST_PASSES, elementwise_passes
from geir.kernels.vector_tiling import ELEMENTWISE, VectorTiling
from geir.ops.glu import GATE_ACTIVATIONS, halves
from geir.ops.numerics import round_to
from geir.target_npu.target import Target
from geir.types import DType

MUL_PASSES = 1


def glu_passes(activation: str, half: bool) -> int:
    """VECTOR instructions per element: the activation's sequence, the Mul, and the 16-bit casts."""
    return elementwise_passes(GATE_ACTIVATIONS[activation][0]) + MUL_PASSES + (CAST_PASSES if half else 0)


def _per_elem(sig: OpSignature, buffers: int) -> int:
    """UB bytes per element of a tile: gate, up and result double-buffered, and the f32 working copies (the
    activation's result, and up's f32 copy where 16-bit floats are computed)."""
    if any(t is None for t in sig.operands + sig.results):
        raise Untiled("its types are unknown")
    half = any(t.dtype in (DType.f16, DType.bf16) for t in sig.operands)
    streamed = sum(t.dtype.itemsize for t in (*sig.operands, *sig.results))
    if len(sig.operands) == 1:  # one merged operand: its gate and up tiles both stream
        streamed += sig.operands[0].dtype.itemsize
    return streamed * buffers + F32_BYTES * (2 if half else 1)


def _tiling(elems: int, buffers: int, per_elem: int, total: int | None, chip: Target, rule: str) -> VectorTiling:
    work = None if total is None else -(-total // elems)
    cores = chip.vector_cores if work is None else min(work, chip.vector_cores)
    return VectorTiling(template=ELEMENTWISE, elems=elems, buffers=buffers, cores=cores, ub_bytes=elems * per_elem,
                        work_units=work, rule=rule)


def choose_glu_tiling(sig: OpSignature, chip: Target, buffers: int = 2) -> VectorTiling:
    """A flat UB chunk in whole UB blocks, spread over the vector units worth starting."""
    check_buffers(buffers)
    per_elem = _per_elem(sig, buffers)
    ub, block = chip.buffer_bytes("ub"), chip.memory.ub_block_bytes
    fit = (ub // per_elem) // block * block
    if fit < block:
        raise TilingError(f"no glu tiling fits {chip.name}: {block} elements need {block * per_elem} bytes of UB, "
                          f"which holds {ub}")
    total = product(sig.results[0].shape)
    sizes = [t.nbytes for t in (*sig.operands, *sig.results)]
    units = units_worth_starting(chip, None if None in sizes else sum(sizes), chip.vector_cores)
    elems = fit if total is None else max(block, min(fit, align(-(-total // units), block)))
    tiling = _tiling(elems, buffers, per_elem, total, chip, "")
    work = tiling.work_units
    return attrs.evolve(tiling, rule=f"{elems} elements a tile, {per_elem} UB bytes each with {buffers} buffers; "
                                     f"{'an unknown number of' if work is None else work} work units over "
                                     f"{tiling.cores} cores")


@register_kernel
class GluKernel(FlatTiledKernel):
    """`ge.glu` over the flattened product."""

    OPS = ("ge.glu",)

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> VectorTiling | Miss:
        return choice(lambda: choose_glu_tiling(sig, target, buffers))

    def budget(self, tiling: VectorTiling, sig: OpSignature, target: Target) -> Budget:
        return Budget(tiling.elems * _per_elem(sig, tiling.buffers), 0, 0, 0, 0)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[VectorTiling]:
        """Flat tiles cutting the product into a power of two of pieces or pieces for every vector unit; largest first."""
        try:
            chosen = choose_glu_tiling(sig, target, buffers)
        except (Untiled, TilingError):
            return []
        per_elem, total = _per_elem(sig, buffers), product(sig.results[0].shape)
        if total is None:
            return []
        block = target.memory.ub_block_bytes
        fit = (target.buffer_bytes("ub") // per_elem) // block * block
        pieces = {1 << i for i in range(max(total // block, 1).bit_length())} | {target.vector_cores * m for m in (1, 2, 4)}
        sizes = {max(block, min(fit, align(-(-total // p), block))) for p in pieces} | {chosen.elems}
        return [_tiling(e, buffers, per_elem, total, target, f"candidate {e} elements a tile")
                for e in sorted(sizes, reverse=True)]

    def check_instance(self, sig: OpSignature, tiling: KernelTiling) -> OpSignature:
        """Fewer leading rows: each element is computed alone, whatever tile it falls in."""
        out = sig.results[0]
        return cut_leading(sig, out.rank) if out is not None else sig

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: VectorTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        merged = len(inputs) == 1  # gate and up are the halves of the last axis of one tensor
        gate, up = halves(inputs[0]) if merged else inputs
        shape = np.broadcast_shapes(gate.shape, up.shape)
        total = math.prod(shape)
        out_dt = result_dtype(op, 0, gate.dtype)
        elems = tiling.elems
        self.allocate(tiling, OpSignature.of_arrays(op, inputs), ctx.target,
                      f"{tiling.buffers} x the gate, up and product tiles of {elems} elements and f32 working copies")
        out = np.empty(total, dtype=out_dt)
        if total == 0:
            return [out.reshape(shape)]
        if ctx.compute:  # a broadcast operand is laid out once as the tiles read it
            flats = [np.broadcast_to(a, shape).reshape(-1) for a in (gate, up)]
        gm = ctx.gm
        in_gm = [gm_tensor(gm, n, a.shape, a.dtype.itemsize) for n, a in zip(ctx.operand_names, inputs)]
        out_gm = gm_tensor(gm, ctx.result_names[0], shape, out.dtype.itemsize)
        half = any(a.dtype.name in ("float16", "bfloat16") for a in inputs)
        passes = glu_passes(op.activation, half)
        lanes = VectorLanes(ctx)
        slots = UbSlots(ctx.cores, tiling.buffers, ctx.waits)
        nt = -(-total // elems)
        for wave, on in lanes.waves(nt):
            lo, hi = wave * elems, np.minimum(wave * elems + elems, total)
            if ctx.compute:
                a0, a1 = int(lo[0]), int(hi[-1])
                out[a0:a1] = round_to(op.compute(*[f[a0:a1] for f in flats]), out_dt)
            count = hi - lo
            load = np.zeros(len(wave))
            if merged:  # each half's rows are every other run of the tensor: bytes exact, fractals proportional
                for side in (0, 1):
                    load = load + gm_read(gm, in_gm[0], share_pieces(in_gm[0], 2 * wave + side, 2 * nt, count))
            for a, g in zip(inputs if not merged else (), in_gm):
                pieces = flat_pieces(g, lo, hi) if a.shape == shape else share_pieces(g, wave, nt, count)
                load = load + gm_read(gm, g, pieces)
            store = gm_write(gm, out_gm, flat_pieces(out_gm, lo, hi))
            used = lanes.used(on)
            slots.step(used, lanes.per_lane(on, load), lanes.per_lane(on, lanes.vector(count * F32_BYTES, passes)),
                       lanes.per_lane(on, store), names=("load tiles", "glu", "store tile"))
        return [out.reshape(shape)]
