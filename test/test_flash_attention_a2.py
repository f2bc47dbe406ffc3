"""The template ops-transformer's FlashAttentionScore picks on Atlas A2, against its design document's conditions.

Oracle: the document's table (attention/flash_attention_score/docs/FA算子设计介绍.md, section 5), its
conditions evaluated by hand on the shapes each one names; and the tile pass's --explain saying it on
the 910B (separate AIC and AIV) and not on the 910A (one AI core holds both).
"""

from __future__ import annotations

import pytest

from geir.kernels.base import KERNELS
from geir.kernels.flash_attention_a2 import a2_template
from geir.kernels.tiling import OpSignature
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.target_npu import load_target
from geir.types import DType, TensorType

F16, BF16, F32 = DType.f16, DType.bf16, DType.f32


@pytest.mark.parametrize("shape, dtype, template, s1_i, s2_i", [
    # SameAB: not f32, S2 >= 512 with D % 16 != 0 (72 = 4 * 16 + 8) or D = 96 ...
    ((1, 8, 1, 2048, 2048, 72), F16, "SameAB", None, None),
    ((1, 8, 1, 512, 512, 96), BF16, "SameAB", None, None),
    # ... or S2 > 1024 with 128 < D < 196
    ((1, 8, 1, 2048, 2048, 160), F16, "SameAB", None, None),
    # f32 never takes SameAB: D = 96, S2 = 512 goes on to S1 (128 < S2 <= 1024)
    ((1, 8, 1, 512, 512, 96), F32, "S1", 256, 512),
    # D = 160 with S2 = 1024 (not > 1024) and D % 16 == 0: S1, S2 not split, S1.i x S2 <= 128 x 1024
    ((1, 8, 1, 1024, 1024, 160), F16, "S1", 128, 1024),
    # S1S2: S2 > 1024; B*N2*G*S1.o at S1.i 64 = 1*8*1*(4096/64) = 512 > 48 vector cores: S1.i = 128
    ((1, 8, 1, 4096, 4096, 128), F16, "S1S2", 128, 1024),
    # 1*1*2*(1024/64) = 32 <= 48: S1.i stays 64
    ((1, 1, 2, 1024, 2048, 128), F16, "S1S2", 64, 1024),
    # S2 <= 128: small heads fit L1: (N2*G*((128+128)*64+128)*2 = 65,792 and (128+64)*128*2*2 = 98,304
    # < 256 KiB, N2*G*128*128*2 = 65,536 <= 128 KiB): the B template
    ((4, 2, 1, 128, 128, 64), F16, "B", None, None),
    # 16 heads: 16*((128+128)*64+128)*2 = 528,384 bytes >= 256 KiB: S1
    ((1, 16, 1, 128, 128, 64), F16, "S1", 128, 128),
])
def test_the_template_follows_the_documents_conditions(shape, dtype, template, s1_i, s2_i):
    b, n2, g, s1, s2, d = shape
    choice = a2_template(b, n2, g, s1, s2, d, dtype, vector_cores=48)
    assert (choice.template, choice.s1_i, choice.s2_i) == (template, s1_i, s2_i), choice.render()


def _remark(target: str, skv: int) -> str:
    text = (f"ge.graph @main(%q: tensor<1x8x4096x128xf16>, %k: tensor<1x8x{skv}x128xf16>) -> tensor<1x8x4096x128xf16> {{\n"
            f"  %o = ge.flash_attention %q, %k, %k\n  ge.return %o\n}}\n")
    module = parse(text)
    remarks = []
    ctx = PassContext(target=target, explain=True)
    ctx.diagnostics.handler = remarks.append
    assert PassManager(complete_pipeline(parse_pipeline("tile"))).run(module, ctx)
    (tile,) = [d.message for d in remarks if d.message.startswith("tile: flash_attention")]
    return tile


def test_explain_names_the_a2_template_on_the_910b_only():
    assert load_target("ascend910b").separate_cube_vector and not load_target("ascend910a").separate_cube_vector
    remark = _remark("ascend910b", 4096)
    assert remark.startswith("tile: flash_attention S1S2 template: S2 = 4096 > 1024; S1.i = 128 because "
                             "B*N2*G*S1.o = 512 > 48 vector cores; CV block 128 x 1024")
    assert "8 x 1024 f32 vector blocks" in remark and "the cube issues 2 mm1 ahead" in remark
    assert "template:" not in _remark("ascend910a", 4096)


# the shapes of the table above, as ge.flash_attention ops on the 910B: the tile pass's tiling carries the template
# the document picks, the condition, and the CV block it runs (SameAB and B with the blocks GEIR runs them with)
@pytest.mark.parametrize("shape, dtype, template, blocks, differs", [
    ((1, 8, 1, 2048, 2048, 72), F16, "SameAB", (128, 1024), "no SameAB kernel"),
    ((1, 8, 1, 512, 512, 96), BF16, "SameAB", (128, 512), "no SameAB kernel"),
    ((1, 8, 1, 512, 512, 96), F32, "S1", (128, 512), ""),
    ((1, 8, 1, 4096, 4096, 128), F16, "S1S2", (128, 1024), ""),
    ((1, 1, 2, 1024, 2048, 128), F16, "S1S2", (64, 1024), ""),
    ((4, 2, 1, 128, 128, 64), F16, "B", (128, 128), "every query row of a head in one block"),
])
def test_the_tile_pass_runs_the_documents_template(shape, dtype, template, blocks, differs):
    b, n2, g, s1, s2, d = shape
    q, k = TensorType((b, n2 * g, s1, d), dtype), TensorType((b, n2, s2, d), dtype)
    sig = OpSignature("ge.flash_attention", (q, k, k), (q,), {})
    tiling = KERNELS["ge.flash_attention"].choose(sig, load_target("ascend910b"))
    assert tiling.cv_split and tiling.design.template == template
    assert tiling.design.condition in tiling.rule
    assert (tiling.s1, tiling.s2) == blocks
    # the document's S1.i of 256 (D = 96, S2 = 512) leaves an AIV's f32 O rows too large for its UB: shrunk, and said
    if tiling.design.s1_i not in (None, tiling.s1):
        assert f"shrunk to S1.i {tiling.s1}" in tiling.rule and "of UB, which holds 196608" in tiling.rule
    assert (differs in tiling.rule) if differs else "GEIR" not in tiling.rule
