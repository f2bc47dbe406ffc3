"""Which template ops-transformer's FlashAttentionScore runs on Atlas A2 (910B), by its design document's rules.

Source: ops-transformer, `attention/flash_attention_score/docs/FA算子设计介绍.md`, section 5 (多模板设计), read
at hicann/ops-transformer 36c13d0. On A2 the AIC and the AIV are separate cores that exchange S and P
through a workspace in GM, so a CV block is large (S1.i x S2.i, a 128 x 1024 cube result cut into 8 x 1024
f32 vector blocks). Templates are matched from the vector side, highest priority first:

1. TNDSameAB, TND: the variable-length TND layout (GEIR has no TND layout: never chosen here);
2. SameAB: not f32, and S2 >= 512 with D % 16 != 0 or D = 96, or S2 > 1024 with 128 < D < 196;
3. S1S2 (S1s2Bn2gs1): S2 > 1024; S2.i = 1024; S1.i = 64, or 128 when B * N2 * G * S1.o (at 64) exceeds the
   vector cores, so that a short S1 still fills the cores;
4. S1 (S1Bn2gs1): 128 < S2 <= 1024, or a matmul's operands of all heads outgrow L1 (the table's conditions);
   S2 is not split; S1.i is chosen so that S1.i x S2 stays near the document's 512 KiB CV block
   (its exact rule is the tiling code's; GEIR's reading is S1.i x S2 <= 128 x 1024, a multiple of 16);
5. B (Bn2gs1s2_b): otherwise (small S1, S2 and D: the batch is cut across cores).

S2 is never split across cores; decode (flash-decoding) is IncreFlashAttention's, not this document's.

`cv_blocks` turns the document's choice into the blocks GEIR's CV-split schedule runs
(kernels/flash_attention_cv.py): the CV block S1.i x S2.i, the vector sub-block of `v_rows` rows per
AIV (the document's 8 x 1024 f32 = 32 KiB), and `cv_budget`, what an AIC and each of its AIVs keep on
chip for them. Where GEIR differs from the document (SameAB and B are run with the S1S2 / S1 schedule,
which computes the same numbers), `A2Choice.runs` says so.
"""

from __future__ import annotations

import attrs

from geir.kernels.tiling import F32_BYTES, Budget, align, fractal
from geir.target_npu.target import Target
from geir.types import DType

SAME_AB, S1S2, S1, B_SPLIT = "SameAB", "S1S2", "S1", "B"
S2_BLOCK = 1024  # S2.i of the S1S2 template
CV_BLOCK = 128 * 1024  # score elements of the document's cube result per CV exchange (128 x 1024)
L1_BOUND = 256 * 1024  # bytes: the S1 template's table conditions
PROBS_BOUND = 65536 * 2
VECTOR_BLOCK = 32 * 1024  # bytes of f32 scores in one vector sub-block (8 x 1024: the largest UB share)
CUBE_CHUNK = 128  # keys per cube pass of a CV block: an s1 x 128 f32 result fills L0C's half
PRELOAD = 2  # mm1 issued ahead of mm2 ("cube double-issue")
ROW_VECTORS = 3  # running max, running sum, rescale factor: one f32 per row each


@attrs.frozen
class A2Choice:
    """The template the A2 design document picks, the condition that picked it (with the figures), and the CV
    block it implies (None where the document gives none)."""

    template: str
    condition: str
    s1_i: int | None
    s2_i: int | None

    def render(self) -> str:
        block = f"; CV block {self.s1_i} x {self.s2_i}" if self.s1_i and self.s2_i else ""
        return f"{self.template} template: {self.condition}{block}"

    @property
    def runs(self) -> str:
        """Which of GEIR's schedules runs this template, where it is not the template itself."""
        if self.template == SAME_AB:
            return "GEIR has no SameAB kernel: it runs these shapes with the S1S2 / S1 CV-split schedule (same numbers)"
        if self.template == B_SPLIT:
            return "GEIR runs B as the S1 schedule with every query row of a head in one block (one unit per batch and head)"
        return ""


def cv_budget(s1: int, s2: int, d: int, v_rows: int, dtype: DType, chip: Target, *, buffers: int = 2,
              causal: bool = False, mask_itemsize: int = 0) -> Budget:
    """What the CV-split schedule keeps on chip for an s1 x s2 CV block: UB is one AIV's (it takes half the rows,
    v_rows at a time), L1 and L0 the AIC's (a CV block's matmuls in passes of CUBE_CHUNK keys); `buffers` 2
    double-buffers every stage so each move overlaps the work on the previous one."""
    fm, fk, _ = fractal(chip, dtype)
    s1, s2, d = align(s1, fm), align(s2, fm), align(d, fm)
    b = dtype.itemsize
    half = -(-s1 // chip.vector_per_cube)
    # UB: S in (f32) and P out (input dtype) of a sub-block, with its mask tiles; the f32 O accumulator of the
    # AIV's rows and one landing buffer for each block's P V
    score = v_rows * s2 * (F32_BYTES + b + (1 if causal else 0) + mask_itemsize) * buffers
    out = half * d * 2 * F32_BYTES
    vectors = ROW_VECTORS * half * chip.memory.ub_block_bytes
    # L1: Q of the block, K chunks for mm1 and P and V chunks for mm2
    chunk = cube_chunk(s1, s2, d, b, buffers, chip)
    l1 = (s1 * d + buffers * chunk * d + buffers * (s1 * chunk + chunk * d)) * b
    kq, kp = _k_pass(s1, chunk, d, fk, b, buffers, chip), _k_pass(s1, d, chunk, fk, b, buffers, chip)
    l0a = max(s1 * kq, s1 * kp) * b * buffers
    l0b = max(kq * chunk, kp * d) * b * buffers
    l0c = max(s1 * chunk, s1 * d) * F32_BYTES * buffers
    return Budget(score + out + vectors, l1, l0a, l0b, l0c)


def cube_chunk(s1: int, s2: int, d: int, itemsize: int, buffers: int, chip: Target) -> int:
    """Keys per cube pass of a CV block: CUBE_CHUNK, halved (to 16) while the pass's L1 operands or its L0C result
    do not fit (a long head dim in f32)."""
    chunk = min(CUBE_CHUNK, align(s2, 16))
    while chunk > 16 and ((s1 * d + buffers * (2 * chunk * d + s1 * chunk)) * itemsize > chip.buffer_bytes("l1")
                          or s1 * chunk * F32_BYTES * buffers > chip.buffer_bytes("l0c")):
        chunk //= 2
    return chunk


def _k_pass(m: int, n: int, k: int, kmin: int, nbytes: int, buffers: int, chip: Target) -> int:
    """The longest contraction pass (k, halved down to kmin) whose L0A (m x pass) and L0B (pass x n) fragments
    fit with their buffers; kmin when none does (the budget then overflows and says so)."""
    c = align(k, kmin)
    while c > kmin and (m * c * nbytes * buffers > chip.buffer_bytes("l0a")
                        or c * n * nbytes * buffers > chip.buffer_bytes("l0b")):
        c = max(kmin, align(c // 2, kmin))
    return c


def workspace_per_core(s1: int, s2: int, d: int, itemsize: int, preload: int) -> int:
    """GM workspace bytes of one AIC and its AIVs: preload + 1 S slots (f32), preload P slots (input dtype) and
    two slots of each block's P V (f32), one per block in flight."""
    return (preload + 1) * s1 * s2 * (F32_BYTES + itemsize) + 2 * s1 * d * F32_BYTES


def vector_rows(s2: int, half_rows: int) -> int:
    """Rows of one vector sub-block: VECTOR_BLOCK bytes of f32 scores (8 rows of 1024), at most the AIV's rows."""
    return max(1, min(half_rows, VECTOR_BLOCK // (align(s2, 16) * F32_BYTES)))

def a2_template(b: int, n2: int, g: int, s1: int, s2: int, d: int, dtype: DType, vector_cores: int,
                same_ab: bool = True) -> A2Choice:
    """The document's template for attention of B batches, N2 K/V heads with G query heads each, S1 query and S2
    key rows and head dim D, on a chip with this many vector cores (`same_ab` False: the first template below
    SameAB, whose blocks GEIR runs SameAB's shapes with)."""
    if dtype != DType.f32 and same_ab:
        if s2 >= 512 and (d % 16 != 0 or d == 96):
            why = f"D = {d} % 16 != 0" if d % 16 else "D = 96"
            return A2Choice(SAME_AB, f"{dtype}, S2 = {s2} >= 512 and {why}", None, None)
        if s2 > 1024 and 128 < d < 196:
            return A2Choice(SAME_AB, f"{dtype}, S2 = {s2} > 1024 and 128 < D = {d} < 196", None, None)
    if s2 > 1024:
        units = b * n2 * g * -(-s1 // 64)
        if units > vector_cores:
            return A2Choice(S1S2, f"S2 = {s2} > 1024; S1.i = 128 because B*N2*G*S1.o = {units} > {vector_cores} "
                                  f"vector cores", 128, S2_BLOCK)
        return A2Choice(S1S2, f"S2 = {s2} > 1024; S1.i = 64 (B*N2*G*S1.o = {units} <= {vector_cores} vector cores)",
                        64, S2_BLOCK)
    size = dtype.itemsize
    as1, as2, ad = align(s1, 16), align(s2, 16), align(d, 16)
    s1_i = max(16, min(as1, (CV_BLOCK // max(as2, 1)) // 16 * 16))
    if 128 < s2 <= 1024:
        return A2Choice(S1, f"128 < S2 = {s2} <= 1024 (S2 not split)", s1_i, s2)
    mm1 = n2 * g * ((as1 + as2) * ad + as2) * size
    mm2 = n2 * g * (as1 + ad) * as2 * size
    probs = n2 * g * as1 * as2 * size
    if mm1 >= L1_BOUND:
        return A2Choice(S1, f"N2*G*((S1 + S2)*D + S2)*{size} = {mm1} bytes >= 256 KiB", s1_i, s2)
    if mm2 >= L1_BOUND:
        return A2Choice(S1, f"N2*G*(S1 + D)*S2*{size} = {mm2} bytes >= 256 KiB", s1_i, s2)
    if probs > PROBS_BOUND:
        return A2Choice(S1, f"N2*G*S1*S2*{size} = {probs} bytes > 128 KiB", s1_i, s2)
    return A2Choice(B_SPLIT, f"S2 = {s2} <= 128 and one batch's heads fit L1 (cut B across cores)", None, None)
