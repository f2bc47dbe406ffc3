"""The matmul kernel's tiling, as CANN's MatMul takes it: Ascend C's `TCubeTiling`.

The fields carry TCubeTiling's names (Ascend C, "Matmul Tiling" / `TCubeTiling` structure):

    single_core_m/n/k   the block of C (and the K it sums) one cube core owns: the 2-D core split
    base_m/n/k          one mmad's block: L0A holds base_m x base_k, L0B base_k x base_n (each ping-pong),
                        L0C the base_m x base_n f32 accumulator
    step_ka/kb          base_k slices of A / B one MTE2 load brings into L1 (L1 caching of K)
    depth_a1/b1         base_k slices of A / B L1 holds: step x 2 when L1 is double-buffered
    step_m/n            base blocks along M / N cached in L1 at once (GEIR's schedule caches one: 1)
    iterate_order       0: the core's base blocks walk M first (the inner loop runs down a column of C),
                        1: N first (along a row of C: one A panel reused, as pto-isa's gemm_performance loops)

The rules follow the fp16 GEMM of pto-isa's `kernels/manual/a2a3/gemm_performance` (README, measured on a
24-core A3): base block 128 x 256 x 64 ("L0A and L0B are explicitly double-buffered with a 32 KiB ping/pong
split"), stepKa = stepKb = 4 ("cache four k blocks at a time"), double buffering in L1, L0A and L0B, and a
2-D split of C over the cores (6144^3: a 4 x 6 grid, singleCoreM 1536, singleCoreN 1024, singleCoreK 6144).
"""

from __future__ import annotations

import attrs

from geir.kernels.tiling import (
    F32_BYTES,
    SMALLEST_BLOCK,
    Budget,
    KernelTiling,
    Miss,
    OpSignature,
    TilingAttrError,
    TilingError,
    Untiled,
    align,
    check_buffers,
    choice,
    fractal,
    halvings,
    never_printed,
    product,
    resized,
    with_shapes,
)
from geir.ops.numerics import broadcast_dims
from geir.target_npu.target import Target
from geir.types import DType, TensorType

# the fp16 base block m x n x k of pto-isa's gemm_performance (and ops-transformer's BMM basic block)
MATMUL_BLOCK = (128, 256, 64)
# bytes of one L0A / L0B ping-pong half (gemm_performance: "a 32 KiB ping/pong split")
L0_HALF = 32 * 1024
STEP_K = 4  # base_k slices per L1 load (gemm_performance: stepKa = stepKb = 4)
BASIC, EPILOGUE, MIX_EPILOGUE = "MatmulBasicBlock", "MatmulEpilogue", "MatmulMixEpilogue"
M_FIRST, N_FIRST = 0, 1


@attrs.frozen(kw_only=True)
class MatmulTiling(KernelTiling):
    """Ascend C's TCubeTiling for one matmul: core split, base block, L1 steps and depths, iteration order.

    Templates: MatmulBasicBlock (FIXP drains L0C to GM), MatmulEpilogue (a bias/activation applied on the way
    out: the same AI core's vector unit), MatmulMixEpilogue (Atlas A2: the activation runs on the AIC's two
    AIVs, which read the f32 block from a GM workspace: a mixed AIC + AIV kernel).
    A single_core dimension of 0 is decided at launch (the dimension is dynamic when the tiling is chosen).
    """

    TEMPLATES = (BASIC, EPILOGUE, MIX_EPILOGUE)

    template: str
    single_core_m: int
    single_core_n: int
    single_core_k: int
    base_m: int
    base_n: int
    base_k: int
    step_m: int
    step_n: int
    step_ka: int
    step_kb: int
    depth_a1: int
    depth_b1: int
    iterate_order: int
    buffers: int  # L0A / L0B ping-pong (2) or one slot (1); L1 holds depth / step loads
    cores: int
    ub_bytes: int  # 0 without an activation: FIXP drains L0C straight to GM
    l1_bytes: int
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int
    # how many base blocks of C there are (None: a dimension is dynamic); part of the choice, not of the attribute
    work_units: int | None = never_printed(None)
    rule: str = never_printed("")

    def __attrs_post_init__(self) -> None:
        if self.step_m != 1 or self.step_n != 1:
            raise TilingAttrError(f"step_m = {self.step_m}, step_n = {self.step_n}: GEIR's MatMul schedule caches "
                                  "one base block along M and N in L1 (step_m = step_n = 1)")
        if self.iterate_order not in (M_FIRST, N_FIRST):
            raise TilingAttrError(f"iterate_order must be 0 (M first) or 1 (N first), not {self.iterate_order}")
        for name in ("base_m", "base_n", "base_k", "step_ka", "step_kb"):
            if getattr(self, name) < 1:
                raise TilingAttrError(f"'{name}' must be at least 1, not {getattr(self, name)}")
        for step, depth in (("step_ka", "depth_a1"), ("step_kb", "depth_b1")):
            s, d = getattr(self, step), getattr(self, depth)
            if d not in (s, 2 * s):
                raise TilingAttrError(f"'{depth}' must be {step} (one L1 buffer) or 2 x {step} (double-buffered), "
                                      f"not {d} with {step} = {s}")
        for single, base in (("single_core_m", "base_m"), ("single_core_n", "base_n")):
            if getattr(self, single) % getattr(self, base):
                raise TilingAttrError(f"'{single}' ({getattr(self, single)}) must be a multiple of '{base}' "
                                      f"({getattr(self, base)})")

    @property
    def blocks(self) -> dict[str, int]:
        """The base block by name."""
        return {"m": self.base_m, "n": self.base_n, "k": self.base_k}

    @property
    def l1_buffers_a(self) -> int:
        return self.depth_a1 // self.step_ka

    @property
    def l1_buffers_b(self) -> int:
        return self.depth_b1 // self.step_kb


def l0c_slots(m: int, n: int, chip: Target) -> int:
    """Accumulators L0C holds for an m x n base block: two where they fit (the drain of one block overlaps the
    next block's mmad), else one (128 x 256 f32 fills the 910B's 128 KiB L0C, as in gemm_performance)."""
    return 2 if 2 * m * n * F32_BYTES <= chip.buffer_bytes("l0c") else 1


def matmul_budget(m: int, n: int, k: int, itemsize: int, buffers: int, chip: Target, *, epilogue: bool = False,
                  bias: bool = False, depth_a: int | None = None, depth_b: int | None = None) -> Budget:
    """What one cube core keeps on chip for an m x n x k base block with L1 holding depth_a / depth_b k slices.

    L0A / L0B hold `buffers` base slices of A and B, L0C one or two f32 accumulators (`l0c_slots`). An epilogue
    runs on the vector units, each taking its share of the rows as an f32 tile plus the rounded result.
    """
    depth_a = buffers if depth_a is None else depth_a
    depth_b = buffers if depth_b is None else depth_b
    rows = -(-m // chip.vector_per_cube)
    ub = rows * n * (F32_BYTES + itemsize) * buffers if epilogue else 0
    l1 = (depth_a * m * k + depth_b * k * n) * itemsize + (n * itemsize if bias else 0)
    return Budget(ub, l1, m * k * itemsize * buffers, k * n * itemsize * buffers,
                  m * n * F32_BYTES * l0c_slots(m, n, chip))


def tiling_budget(t: MatmulTiling, itemsize: int, chip: Target, *, epilogue: bool, bias: bool) -> Budget:
    """The buffers one cube core of this tiling asks for."""
    return matmul_budget(t.base_m, t.base_n, t.base_k, itemsize, t.buffers, chip, epilogue=epilogue, bias=bias,
                         depth_a=t.depth_a1, depth_b=t.depth_b1)


def _dims(a: TensorType, b: TensorType, transpose_a: bool, transpose_b: bool) -> tuple:
    M, K = (a.shape[-1], a.shape[-2]) if transpose_a else (a.shape[-2], a.shape[-1])
    N = b.shape[-2] if transpose_b else b.shape[-1]
    return M, N, K


def folds_batch(a_shape: tuple, b_shape: tuple, transpose_a: bool) -> bool:
    """Whether A's batch is folded into its rows: B is one matrix for every batch item and A's rows are
    contiguous, so [batch.., M, K] @ [K, N] is one [batch * M, K] @ [K, N] problem that reads B once, not once
    per batch item (ATen's `_matmul_impl` folds so, `should_fold`; a batched decode step's projections, whose
    M is 1 per sequence, stop wasting the cube's rows and re-reading the weight for every sequence)."""
    return len(b_shape) == 2 and len(a_shape) > 2 and not transpose_a


def fold_batch(a: TensorType, b: TensorType, transpose_a: bool) -> TensorType:
    """A as the kernel sees it: its batch folded into its rows where `folds_batch` says so (a `?` batch or row
    count folds to `?`), else A itself."""
    if not folds_batch(a.shape, b.shape, transpose_a):
        return a
    return TensorType((product(a.shape[:-1]), a.shape[-1]), a.dtype)


@attrs.frozen
class CoreSplit:
    """How C's base blocks are dealt to the cube cores: a grid of gm x gn blocks of C per batch item, each
    single_core_m x single_core_n (batch items dealt whole when there are at least as many as cores)."""

    grid_m: int
    grid_n: int
    single_core_m: int
    single_core_n: int


def core_split(batch: int, M: int, N: int, base_m: int, base_n: int, cores: int, block_cycles: float = 0.0,
               head_cycles: float = 0.0) -> CoreSplit:
    """The 2-D split of C over the cores: the grid that leaves the busiest core the fewest base blocks, then the
    smallest A + B panels per core (single_core_m + single_core_n: gemm_performance's 4 x 6 grid at 6144^3),
    then the fewer grid rows. Where a core's launch head (`head_cycles` each) is dear against a base block's work
    (`block_cycles`), the grid minimises the busiest core's blocks plus the head of the cores started: a small
    matmul leaves cores idle rather than pay their head (catlass: balance parallelism against the head)."""
    tm, tn = -(-M // base_m), -(-N // base_n)
    if batch >= cores or tm * tn == 0:
        return CoreSplit(1, 1, tm * base_m, tn * base_n)
    per_item = max(cores // max(batch, 1), 1)
    best = None
    for gm in range(1, min(tm, per_item) + 1):
        for gn in range(1, min(tn, per_item // gm) + 1):
            sm, sn = -(-tm // gm), -(-tn // gn)
            busiest = sm * sn if not head_cycles else sm * sn * block_cycles + head_cycles * batch * gm * gn
            key = (busiest, sm * base_m + sn * base_n, gm)
            if best is None or key < best[0]:
                best = (key, gm, gn, sm, sn)
    _, gm, gn, sm, sn = best
    return CoreSplit(-(-tm // sm), -(-tn // sn), sm * base_m, sn * base_n)


def l2_order(batch: int, M: int, N: int, K: int, base_m: int, base_n: int, split: CoreSplit, itemsize: int,
             chip: Target) -> tuple[int, str]:
    """The iteration order that keeps the operand a core re-reads in the L2 (an L2-aware order).

    Walking N first, a core keeps its A panel (base_m x K) and re-reads each B panel (K x base_n) of its block
    once per row of its block: a B panel comes back after sn waves, and in each wave the cores touch about
    gm A panels and gn B panels (cores of one grid row share their A panel, of one grid column their B panel).
    If that much data between two reads of a panel exceeds the L2, every re-read comes from HBM (the byte
    clock of target_npu/sim.py). M first is the mirror image. The order whose re-reads stay in the L2 wins (N first, as gemm_performance's loop, when
    both do); if neither does, the one that re-reads fewer bytes from HBM.
    """
    l2 = chip.memory.l2_bytes
    tm, tn = -(-M // base_m), -(-N // base_n)
    sm, sn = max(split.single_core_m // base_m, 1), max(split.single_core_n // base_n, 1)
    a_panel, b_panel = base_m * K * itemsize, K * base_n * itemsize
    per_wave = min(batch, chip.cube_cores) * (split.grid_m * a_panel + split.grid_n * b_panel)
    # bytes re-read from HBM: N first re-reads B panels for every row after the first, M first A panels
    n_first = 0 if sn * per_wave < l2 or tm <= 1 else batch * (tm - 1) * tn * b_panel
    m_first = 0 if sm * per_wave < l2 or tn <= 1 else batch * (tn - 1) * tm * a_panel
    if n_first <= m_first:
        why = "N first" if not n_first else f"N first (M first would re-read {m_first / 2**20:.0f} MiB from HBM)"
        return N_FIRST, why
    return M_FIRST, (f"M first: walking N first, a B panel comes back after {sn * per_wave / 2**20:.0f} MiB of "
                     f"other data, more than the {l2 / 2**20:.0f} MiB L2 holds")


def _spread(pm: int, pn: int, fm: int, fk: int, fn: int, M: int, N: int, K: int, kg: int, batch: int, itemsize: int,
            chip: Target, head: float = 0.0) -> tuple[int, int]:
    """A base block m x n for a C with fewer base blocks of pm x pn than cores (small shapes, decode's GEMV-like
    rows): the one that gives the launch the least estimated time, base blocks per core times a block's larger of
    its cube cycles and its MTE2 cycles (its A and B panels at a core's HBM rate, the operands being cold, plus a
    DMA start per load), plus the head (`head` cycles a core) of the cores it starts. Smaller blocks spread C over
    more cores; each costs more loads, more bytes per FLOP and its head."""
    rate, latency = chip.memory.hbm_read_bytes_per_cycle, chip.memory.dma_latency_cycles

    def block(m: int, n: int) -> float:
        cube = -(-m // fm) * -(-n // fn) * -(-K // fk)
        return max(cube, 2 * -(-K // kg) * latency + (m + n) * K * itemsize / rate)

    # the head decides only where starting every core costs more than the largest block's work; below that, the
    # estimate's error (whole blocks per core, each core's HBM share) is larger than the head it would weigh
    if head * chip.cube_cores < block(pm, pn):
        head = 0.0
    best = None
    for m in halvings(pm, fm):
        for n in halvings(pn, fn):
            units = batch * -(-M // m) * -(-N // n)
            busiest = -(-units // chip.cube_cores) * block(m, n) + head * min(units, chip.cube_cores)
            if best is None or busiest < best[0]:
                best = (busiest, m, n)
    return best[1], best[2]


def choose_matmul_tiling(a: TensorType, b: TensorType, chip: Target, buffers: int = 2, *,
                         transpose_a: bool = False, transpose_b: bool = False, epilogue: bool = False,
                         bias: bool = False) -> MatmulTiling:
    """TCubeTiling by gemm_performance's rules: the base block (128 x 256 x 64 for 16-bit types, fitted to
    L0A / L0B halves of 32 KiB and to L0C; shrunk to small M, N, K), four k slices per L1 load, double buffers,
    the 2-D core split, N first unless that re-reads from HBM what M first keeps in the L2 (`l2_order`).

    `epilogue`: an activation runs on the vector units (on Atlas A2's separate AIVs through a GM workspace:
    MatmulMixEpilogue); `bias`: a bias row is staged in L1 and added as L0C drains.
    """
    check_buffers(buffers)
    fm, fk, fn = fractal(chip, a.dtype)
    a = fold_batch(a, b, transpose_a)
    M, N, K = _dims(a, b, transpose_a, transpose_b)
    nb = a.dtype.itemsize
    half = L0_HALF if buffers == 2 else 2 * L0_HALF
    # at least one fractal each: a dimension of 0 (an empty C, or a K that sums nothing) still has a block shape
    pm, pn, pk = (p if dim is None else min(p, max(f, align(dim, f)))
                  for p, dim, f in zip(MATMUL_BLOCK, (M, N, K), (fm, fn, fk)))
    pk = min(pk, max(fk, half // (pn * nb) // fk * fk))  # f32 halves base_k: 32 x 256 x 4 bytes fill a half
    batch = product(broadcast_dims(a.shape[:-2], b.shape[:-2]))
    few = None not in (batch, M, N, K) and batch * -(-M // pm) * -(-N // pn) < chip.cube_cores
    if few:
        pm, pn = _spread(pm, pn, fm, fk, fn, M, N, K, pk * STEP_K, batch, nb, chip,
                         _block_and_head(pm, pn, K, a.dtype, epilogue, chip)[1])
    first_miss = None
    last = None
    for m in halvings(pm, fm):
        for n in halvings(pn, fn):
            for k in halvings(pk, fk):
                step = max(1, min(STEP_K, -(-K // k) if K else 1))
                while True:
                    budget = matmul_budget(m, n, k, nb, buffers, chip, epilogue=epilogue, bias=bias,
                                           depth_a=step * buffers, depth_b=step * buffers)
                    miss = budget.overflow(chip)
                    if miss is None or step == 1:
                        break
                    step //= 2
                if miss is not None:
                    first_miss = first_miss or (m, n, k, miss)
                    last = (m, n, k, miss)
                    continue
                tiling = _tiling(m, n, k, step, buffers, epilogue, bias, budget, a, b, M, N, K, chip)
                rule = (f"TCubeTiling: base block {m} x {n} x {k} ({a.dtype}, L0A/L0B {buffers} slot"
                        f"{'s' * (buffers > 1)} each)")
                if few:
                    rule += (f"; C has fewer base blocks of {MATMUL_BLOCK[0]} x {MATMUL_BLOCK[1]} than cores: "
                             f"{pm} x {pn} gives the least estimated cube and MTE2 time of the busiest core plus the "
                             f"launch head of the cores it starts")
                if first_miss:
                    pm_, pn_, pk_, (buf, need, cap) = first_miss
                    rule += f"; {pm_} x {pn_} x {pk_} needs {need} bytes of {buf}, which holds {cap} on {chip.name}"
                rule += (f"; stepKa = stepKb = {step} k slices per L1 load, depth {tiling.depth_a1}"
                         f" ({'double-buffered' if buffers == 2 else 'one buffer'})")
                if tiling.single_core_m:
                    rule += (f"; cores split C {tiling.single_core_m} x {tiling.single_core_n} each"
                             f" (singleCoreK {tiling.single_core_k})")
                work = tiling.work_units
                rule += (f"; {'an unknown number of' if work is None else work} base blocks over "
                         f"{tiling.cores} cores, {tiling.rule}")
                if tiling.template == MIX_EPILOGUE:
                    rule += "; the activation on the AIC's two AIVs through a GM workspace (mixed AIC + AIV kernel)"
                return attrs.evolve(tiling, rule=rule)
    m, n, k, (buf, need, cap) = last
    raise TilingError(f"no matmul tiling fits {chip.name}: even {m} x {n} x {k} needs {need} bytes of {buf}, "
                      f"which holds {cap}")


def _template(epilogue: bool, bias: bool, chip: Target) -> str:
    if epilogue and chip.separate_cube_vector:
        return MIX_EPILOGUE
    return EPILOGUE if epilogue or bias else BASIC


def _tiling(m: int, n: int, k: int, step: int, buffers: int, epilogue: bool, bias: bool, budget: Budget,
            a: TensorType, b: TensorType, M, N, K, chip: Target, order: int | None = None) -> MatmulTiling:
    """The tiling of these blocks on this problem (its `rule` says the order and why; `order` None: l2_order)."""
    batch = product(broadcast_dims(a.shape[:-2], b.shape[:-2]))
    dynamic = None in (batch, M, N)
    work = None if dynamic else batch * -(-M // m) * -(-N // n)
    split = CoreSplit(0, 0, 0, 0) if dynamic else core_split(batch, M, N, m, n, chip.cube_cores,
                                                             *_block_and_head(m, n, K, a.dtype, epilogue, chip))
    cores = chip.cube_cores if dynamic else max(min(batch * split.grid_m * split.grid_n, chip.cube_cores), 1)
    why = "N first"
    if order is None:
        order, why = (N_FIRST, why) if dynamic or K is None else l2_order(batch, M, N, K, m, n, split, a.dtype.itemsize,
                                                                          chip)
    return MatmulTiling(template=_template(epilogue, bias, chip), single_core_m=split.single_core_m,
                        single_core_n=split.single_core_n, single_core_k=0 if K is None else K, base_m=m, base_n=n,
                        base_k=k, step_m=1, step_n=1, step_ka=step, step_kb=step, depth_a1=step * buffers,
                        depth_b1=step * buffers, iterate_order=order, buffers=buffers, cores=cores,
                        ub_bytes=budget.ub, l1_bytes=budget.l1, l0a_bytes=budget.l0a, l0b_bytes=budget.l0b,
                        l0c_bytes=budget.l0c, work_units=work, rule=why)


def _block_and_head(m: int, n: int, K: int | None, dtype: DType, epilogue: bool, chip: Target) -> tuple[float, float]:
    """(cycles of one base block over the whole K: its cube work or its A and B panels at the L2 rate, whichever is
    longer; the head of starting one more AIC, with its AIVs where the epilogue runs on them), for core_split."""
    if K is None:
        return 0.0, 0.0
    fm, fk, fn = fractal(chip, dtype)
    cube = -(-m // fm) * -(-K // fk) * -(-n // fn)
    load = (m + n) * K * dtype.itemsize / chip.memory.l2_read_bytes_per_cycle
    started = 1 + (chip.vector_per_cube if _template(epilogue, False, chip)
                   == MIX_EPILOGUE else 0)
    return max(cube, load), chip.head_cycles(started)


# --- the kernel's tiling interface (geir.kernels.base.Kernel) ----------------------------------------

def _problem(sig: OpSignature) -> tuple[TensorType, TensorType, bool, bool, bool, bool]:
    """a and b types, transposes, whether an activation (or a glu) runs on the vector units and whether a bias is
    added."""
    a, b = sig.operands[:2]
    bias = len(sig.operands) > 2
    epilogue = sig.attr("activation", "none") != "none" or sig.attr("glu", "none") != "none"
    return a, b, bool(sig.attr("transpose_a", False)), bool(sig.attr("transpose_b", False)), epilogue, bias


def choose(sig: OpSignature, chip: Target, buffers: int = 2) -> MatmulTiling | Miss:
    """The rules' TCubeTiling for one matmul or fused_matmul, or why there is none."""
    a, b, ta, tb, epilogue, bias = _problem(sig)
    return choice(lambda: choose_matmul_tiling(a, b, chip, buffers, transpose_a=ta, transpose_b=tb,
                                               epilogue=epilogue, bias=bias))


def budget(tiling: MatmulTiling, sig: OpSignature, chip: Target) -> Budget:
    """What one cube core of this tiling keeps on chip for this op."""
    a, _, _, _, epilogue, bias = _problem(sig)
    return tiling_budget(tiling, a.dtype.itemsize, chip, epilogue=epilogue, bias=bias)


def shrink(tiling: MatmulTiling) -> tuple[MatmulTiling, str] | None:
    """Less on chip, the same k order, bit-identical results: fewer output rows per base block (base_m halved),
    then fewer k slices per L1 load, then single buffers."""
    if tiling.base_m // 2 >= SMALLEST_BLOCK:
        return attrs.evolve(tiling, base_m=tiling.base_m // 2), f"base_m {tiling.base_m} -> {tiling.base_m // 2}"
    if tiling.step_ka > 1 or tiling.step_kb > 1:
        sa, sb = max(tiling.step_ka // 2, 1), max(tiling.step_kb // 2, 1)
        return (attrs.evolve(tiling, step_ka=sa, step_kb=sb, depth_a1=tiling.l1_buffers_a * sa,
                             depth_b1=tiling.l1_buffers_b * sb), f"step_ka {tiling.step_ka} -> {sa}")
    if tiling.buffers == 2:
        return (attrs.evolve(tiling, buffers=1, depth_a1=tiling.step_ka, depth_b1=tiling.step_kb),
                "buffers 2 -> 1")
    return None


def candidates(sig: OpSignature, chip: Target, buffers: int = 2) -> list[MatmulTiling]:
    """The rules' own base block with fewer k slices per load and with the other order; then base blocks of
    fractal multiples up to twice gemm_performance's that fit the buffers (largest first), each with the rules'
    L1 step and order."""
    a, b, ta, tb, epilogue, bias = _problem(sig)
    try:
        fm, fk, fn = fractal(chip, a.dtype)
    except Untiled:
        return []
    a = fold_batch(a, b, ta)
    M, N, K = _dims(a, b, ta, tb)
    if None in (M, N, K):
        return []
    nb = a.dtype.itemsize

    def make(m: int, n: int, k: int, step: int, order: int | None, what: str) -> MatmulTiling | None:
        step = max(1, min(step, -(-K // k) if K else 1))
        bud = matmul_budget(m, n, k, nb, buffers, chip, epilogue=epilogue, bias=bias, depth_a=step * buffers,
                            depth_b=step * buffers)
        if bud.overflow(chip) is not None:
            return None
        t = _tiling(m, n, k, step, buffers, epilogue, bias, bud, a, b, M, N, K, chip, order)
        return attrs.evolve(t, rule=f"candidate {what}")

    out = []
    rules = choice(lambda: choose_matmul_tiling(a, b, chip, buffers, transpose_a=ta, transpose_b=tb,
                                                epilogue=epilogue, bias=bias))
    if isinstance(rules, MatmulTiling):
        m, n, k = rules.base_m, rules.base_n, rules.base_k
        for step in (1, 2):
            if step < rules.step_ka:
                out.append(make(m, n, k, step, rules.iterate_order, f"the rules' block, {step} k slices a load"))
        other = M_FIRST if rules.iterate_order == N_FIRST else N_FIRST
        out.append(make(m, n, k, rules.step_ka, other, f"the rules' block, {'N' if other else 'M'} first"))
    for m in halvings(min(2 * MATMUL_BLOCK[0], align(M, fm)), fm):
        for n in halvings(min(2 * MATMUL_BLOCK[1], align(N, fn)), fn):
            for k in halvings(min(2 * MATMUL_BLOCK[2], align(K, fk)), fk):
                out.append(make(m, n, k, STEP_K, None, f"base block {m} x {n} x {k}"))
    return [t for t in out if t is not None]


def check_instance(sig: OpSignature, tiling: MatmulTiling) -> OpSignature:
    """One batch, and at most two base blocks of output rows and columns: each output element still sums its
    whole K in the tiling's base_k blocks, so its numbers are those of the whole op."""
    a, b, ta, tb, _, bias = _problem(sig)
    out = sig.results[0]
    folded = folds_batch(a.shape, b.shape, ta)
    if folded:  # the instance of the folded problem the kernel runs
        a = fold_batch(a, b, ta)
        out = None if out is None else TensorType((product(out.shape[:-1]), out.shape[-1]), out.dtype)
    M, N, _ = _dims(a, b, ta, tb)
    if None in (M, N) or a.rank < 2 or b.rank < 2:
        return sig
    m2, n2 = min(M, 2 * tiling.base_m), min(N, 2 * tiling.base_n)

    def one_batch(t: TensorType) -> TensorType:
        return TensorType((1,) * (t.rank - 2) + tuple(t.shape[-2:]), t.dtype)

    a2 = resized(one_batch(a), -1 if ta else -2, m2)
    b2 = resized(one_batch(b), -2 if tb else -1, n2)
    operands = [a2, b2]
    if bias:
        c = sig.operands[2]
        if folded and c.rank >= 2 and any(d != 1 for d in c.shape[:-1]):  # a bias of rows: the folded rows'
            c = TensorType((M, c.shape[-1]), c.dtype)
        c2 = TensorType((1,) * max(c.rank - 2, 0) + tuple(c.shape[-2:]), c.dtype) if c.rank > 2 else c
        if c2.rank >= 1 and c2.shape[-1] == N:
            c2 = resized(c2, -1, n2)
        if c2.rank >= 2 and c2.shape[-2] == M:
            c2 = resized(c2, -2, m2)
        operands.append(c2)
    glu = sig.attr("glu", "none") != "none"  # its result has half the product's columns
    results = [None if out is None else resized(resized(one_batch(out), -2, m2), -1, n2 // 2 if glu else n2)]
    return with_shapes(sig, operands, results)
