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
This is the document's decision only. GEIR's kernel does not yet run the CV-split schedule (issue 17):
the tile pass reports this choice beside the tiling it runs.
"""

from __future__ import annotations

import attrs

from geir.kernels.tiling import align
from geir.types import DType

SAME_AB, S1S2, S1, B_SPLIT = "SameAB", "S1S2", "S1", "B"
S2_BLOCK = 1024  # S2.i of the S1S2 template
CV_BLOCK = 128 * 1024  # score elements of the document's cube result per CV exchange (128 x 1024)
L1_BOUND = 256 * 1024  # bytes: the S1 template's table conditions
PROBS_BOUND = 65536 * 2


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


def a2_template(b: int, n2: int, g: int, s1: int, s2: int, d: int, dtype: DType, vector_cores: int) -> A2Choice:
    """The document's template for attention of B batches, N2 K/V heads with G query heads each, S1 query and S2
    key rows and head dim D, on a chip with this many vector cores."""
    if dtype != DType.f32:
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
