"""The matmul kernel's tiling (ops-transformer's BMM base blocks): m x n x k blocks fitted to L0A, L0B, L0C, L1, UB."""

from __future__ import annotations

import attrs

from geir.kernels.tiling import (
    F32_BYTES,
    SMALLEST_BLOCK,
    Budget,
    KernelTiling,
    Miss,
    OpSignature,
    TilingError,
    Untiled,
    align,
    as_target,
    check_buffers,
    choice,
    fractal,
    halve,
    halvings,
    never_printed,
    product,
    resized,
    with_shapes,
)
from geir.ops.numerics import broadcast_dims
from geir.target_npu.target import Target
from geir.types import TensorType

# matmul basic block m x n x k (ops-transformer BMM basic block 128 x 256 x 64)
MATMUL_BLOCK = (128, 256, 64)
BASIC, EPILOGUE = "MatmulBasicBlock", "MatmulEpilogue"


@attrs.frozen
class MatmulTiling(KernelTiling):
    """A cube base block m x n x k, its buffers and budgets; MatmulEpilogue when a bias or activation follows."""

    TEMPLATES = (BASIC, EPILOGUE)

    template: str
    m: int
    n: int
    k: int
    buffers: int
    cores: int
    ub_bytes: int  # 0 without an activation: FIXP drains L0C straight to GM
    l1_bytes: int
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int
    # how many output tiles there are (None: a dimension is dynamic); part of the choice, not of the attribute
    work_units: int | None = never_printed(None)
    rule: str = never_printed("")

    @property
    def blocks(self) -> dict[str, int]:
        """The base block by name."""
        return {"m": self.m, "n": self.n, "k": self.k}


def matmul_budget(m: int, n: int, k: int, itemsize: int, buffers: int, chip: Target, *,
                  epilogue: bool = False, bias: bool = False) -> Budget:
    """What one matmul work unit keeps on chip for an m x n x k base block."""
    # L0A/L0B double-buffer the fractal operands, L0C the f32 result; L1 stages both operands (and a
    # bias row). Without an epilogue FIXP writes L0C straight to GM; a bias/activation epilogue runs on
    # the vector units, each taking its share of the rows as an f32 tile plus the rounded result.
    rows = -(-m // chip.data["cores"].get("vector_per_cube", 1))
    ub = rows * n * (F32_BYTES + itemsize) * buffers if epilogue else 0
    l1 = (m * k + k * n) * itemsize * buffers + (n * itemsize if bias else 0)
    return Budget(ub, l1, m * k * itemsize * buffers, k * n * itemsize * buffers, m * n * F32_BYTES * buffers)


def _dims(a: TensorType, b: TensorType, transpose_a: bool, transpose_b: bool) -> tuple:
    M, K = (a.shape[-1], a.shape[-2]) if transpose_a else (a.shape[-2], a.shape[-1])
    N = b.shape[-2] if transpose_b else b.shape[-1]
    return M, N, K


def choose_matmul_tiling(a: TensorType, b: TensorType, chip: Target | str, buffers: int = 2, *,
                         transpose_a: bool = False, transpose_b: bool = False, epilogue: bool = False,
                         bias: bool = False) -> MatmulTiling:
    """A cube base block m x n x k fitting L0A, L0B, L0C (and UB for an epilogue), shrinking k, then n, then m.

    `epilogue`: an activation runs on the vector units (UB holds the f32 tile); `bias`: a bias row is
    staged in L1 and added as L0C drains. Either makes the template MatmulEpilogue.
    """
    check_buffers(buffers)
    chip = as_target(chip)
    fm, fk, fn = fractal(chip, a.dtype)
    M, N, K = _dims(a, b, transpose_a, transpose_b)
    nb = a.dtype.itemsize
    pm, pn, pk = (p if dim is None else min(p, align(dim, f))
                  for p, dim, f in zip(MATMUL_BLOCK, (M, N, K), (fm, fn, fk)))
    first_miss = None
    for m in halvings(pm, fm):
        for n in halvings(pn, fn):
            for k in halvings(pk, fk):
                budget = matmul_budget(m, n, k, nb, buffers, chip, epilogue=epilogue, bias=bias)
                miss = budget.overflow(chip)
                if miss is not None:
                    first_miss = first_miss or (m, n, k, miss)
                    last = (m, n, k, miss)
                    continue
                tiling = _tiling(m, n, k, buffers, epilogue or bias, budget, a, b, M, N, chip, "")
                rule = f"base block {m} x {n} x {k} ({a.dtype}, {buffers} buffers)"
                if first_miss:
                    pm_, pn_, pk_, (buf, need, cap) = first_miss
                    rule += f"; {pm_} x {pn_} x {pk_} needs {need} bytes of {buf}, which holds {cap} on {chip.name}"
                work = tiling.work_units
                rule += f"; {'an unknown number of' if work is None else work} work units over {tiling.cores} cores"
                return attrs.evolve(tiling, rule=rule)
    m, n, k, (buf, need, cap) = last
    raise TilingError(f"no matmul tiling fits {chip.name}: even {m} x {n} x {k} needs {need} bytes of {buf}, "
                      f"which holds {cap}")


def _tiling(m: int, n: int, k: int, buffers: int, epilogue: bool, budget: Budget, a: TensorType, b: TensorType,
            M, N, chip: Target, rule: str) -> MatmulTiling:
    batch = product(broadcast_dims(a.shape[:-2], b.shape[:-2]))
    work = None if None in (batch, M, N) else batch * -(-M // m) * -(-N // n)
    cores = chip.cube_cores if work is None else min(work, chip.cube_cores)
    return MatmulTiling(EPILOGUE if epilogue else BASIC, m, n, k, buffers, cores, budget.ub, budget.l1, budget.l0a,
                        budget.l0b, budget.l0c, work, rule)


# --- the kernel's tiling interface (geir.kernels.base.Kernel) ----------------------------------------

def _problem(sig: OpSignature) -> tuple[TensorType, TensorType, bool, bool, bool, bool]:
    """a and b types, transposes, whether an activation runs on the vector units and whether a bias is added."""
    a, b = sig.operands[:2]
    bias = len(sig.operands) > 2
    epilogue = sig.attr("activation", "none") != "none"
    return a, b, bool(sig.attr("transpose_a", False)), bool(sig.attr("transpose_b", False)), epilogue, bias


def choose(sig: OpSignature, chip: Target, buffers: int = 2) -> MatmulTiling | Miss:
    """The rule's base block for one matmul or fused_matmul, or why there is none."""
    a, b, ta, tb, epilogue, bias = _problem(sig)
    return choice(lambda: choose_matmul_tiling(a, b, chip, buffers, transpose_a=ta, transpose_b=tb,
                                               epilogue=epilogue, bias=bias))


def budget(tiling: MatmulTiling, sig: OpSignature, chip: Target) -> Budget:
    """What one work unit of this base block keeps on chip for this op."""
    a, _, _, _, epilogue, bias = _problem(sig)
    return matmul_budget(tiling.m, tiling.n, tiling.k, a.dtype.itemsize, tiling.buffers, chip,
                         epilogue=epilogue, bias=bias)


def shrink(tiling: MatmulTiling) -> tuple[MatmulTiling, str] | None:
    """Fewer output rows per work unit (m halved): less on chip, the same k order, bit-identical results."""
    return halve(tiling, "m", SMALLEST_BLOCK)


def candidates(sig: OpSignature, chip: Target, buffers: int = 2) -> list[MatmulTiling]:
    """Every base block of fractal multiples up to twice ops-transformer's that fits the buffers."""
    a, b, ta, tb, epilogue, bias = _problem(sig)
    try:
        fm, fk, fn = fractal(chip, a.dtype)
    except Untiled:
        return []
    M, N, K = _dims(a, b, ta, tb)
    if None in (M, N, K):
        return []
    out = []
    for m in halvings(min(2 * MATMUL_BLOCK[0], align(M, fm)), fm):
        for n in halvings(min(2 * MATMUL_BLOCK[1], align(N, fn)), fn):
            for k in halvings(min(2 * MATMUL_BLOCK[2], align(K, fk)), fk):
                bud = matmul_budget(m, n, k, a.dtype.itemsize, buffers, chip, epilogue=epilogue, bias=bias)
                if bud.overflow(chip) is None:
                    out.append(_tiling(m, n, k, buffers, epilogue or bias, bud, a, b, M, N, chip,
                                       f"candidate base block {m} x {n} x {k}"))
    return out


def check_instance(sig: OpSignature, tiling: MatmulTiling) -> OpSignature:
    """One batch, and at most two base blocks of output rows and columns: each output element still sums its
    whole K in the tiling's k blocks, so its numbers are those of the whole op."""
    a, b, ta, tb, _, bias = _problem(sig)
    M, N, _ = _dims(a, b, ta, tb)
    if None in (M, N) or a.rank < 2 or b.rank < 2:
        return sig
    m2, n2 = min(M, 2 * tiling.m), min(N, 2 * tiling.n)

    def one_batch(t: TensorType) -> TensorType:
        return TensorType((1,) * (t.rank - 2) + tuple(t.shape[-2:]), t.dtype)

    a2 = resized(one_batch(a), -1 if ta else -2, m2)
    b2 = resized(one_batch(b), -2 if tb else -1, n2)
    operands = [a2, b2]
    if bias:
        c = sig.operands[2]
        c2 = TensorType((1,) * max(c.rank - 2, 0) + tuple(c.shape[-2:]), c.dtype) if c.rank > 2 else c
        if c2.rank >= 1 and c2.shape[-1] == N:
            c2 = resized(c2, -1, n2)
        if c2.rank >= 2 and c2.shape[-2] == M:
            c2 = resized(c2, -2, m2)
        operands.append(c2)
    out = sig.results[0]
    results = [None if out is None else resized(resized(one_batch(out), -2, m2), -1, n2)]
    return with_shapes(sig, operands, results)
