"""The kernels' tiling rules (kernels/*_tiling.py) and the `tile` pass that prints them."""

from __future__ import annotations

import itertools
import re

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geir.diagnostics import Diagnostic, DiagnosticEngine
from geir.parser import parse
from geir.passes import PassContext, PassManager, PipelineError, complete_pipeline, parse_pipeline
from geir.kernels.flash_attention_tiling import FLASH_DECODE, SPLIT_KV, WHOLE_ROW, causal_skipped, choose_flash_tiling, flash_budget
from geir.kernels.matmul_tiling import choose_matmul_tiling
from geir.kernels.tiling import OpSignature, TilingError, Untiled
from geir.kernels.vector_tiling import choose_vector_tiling
from geir.printer import print_module
from geir.runtime.single_launch import launch_us
from geir.target_npu import as_target, available_targets, load_target
from geir.types import DType, TensorType

# The on-chip schedule's rules: chips whose AI core holds cube and vector, and the 910B's numbers modelled so (the
# 910B itself runs the CV-split schedule: test_flash_cv.py)
ONCHIP_910B = "ascend910b[separate_cube_vector=0]"
TARGETS = (ONCHIP_910B, "ascend910a", "ascend310p")
F16, BF16, F32 = DType.f16, DType.bf16, DType.f32


def qkv(sq: int | None, skv: int | None, d: int | None = 128, dtype: DType = F16, b: int = 1, n: int = 8,
        nkv: int | None = None) -> tuple[TensorType, TensorType, TensorType]:
    """BNSD types of q, k, v."""
    q = TensorType((b, n, sq, d), dtype)
    k = TensorType((b, nkv or n, skv, d), dtype)
    return q, k, k


def flash(sq, skv, d=128, dtype=F16, target=ONCHIP_910B, causal=False, buffers=2, **kw):
    return choose_flash_tiling(*qkv(sq, skv, d, dtype, **kw), causal, False, as_target(target), buffers)


def fits(t, target: str) -> bool:
    chip = load_target(target)
    return (t.ub_bytes <= chip.buffer_bytes("ub") and t.l1_bytes <= chip.buffer_bytes("l1")
            and t.l0a_bytes <= chip.buffer_bytes("l0a") and t.l0b_bytes <= chip.buffer_bytes("l0b")
            and t.l0c_bytes <= chip.buffer_bytes("l0c"))


def test_the_three_targets_are_bundled():
    assert set(TARGETS[1:]) | {"ascend910b"} <= set(available_targets())


# --- the template rules -------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("skv", [16, 64, 100, 128])
def test_short_keys_sit_in_one_block_per_row(target, skv):
    t = flash(512, skv, 64, target=target)
    assert (t.template, t.s2, t.segments) == (WHOLE_ROW, skv, 1)
    assert "one block" in t.rule


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s", [1025, 2048, 4096, 8192])
def test_long_keys_split_both_axes_with_s1_64_or_128(target, dtype, d, s):
    t = flash(s, s, d, dtype, target)
    assert t.template == SPLIT_KV and t.s2 == 128 and t.s1 in (64, 128)


@pytest.mark.parametrize("s", [129, 256, 512, 1024])
@pytest.mark.parametrize("d", [64, 128])
def test_medium_keys_use_128_by_128(s, d):
    t = flash(s, s, d)
    assert (t.template, t.s1, t.s2) == (SPLIT_KV, 128, 128)


def test_long_keys_drop_s1_to_64_to_fill_the_cores():
    # one head of 2048 rows: 16 row blocks at s1 = 128 leave 8 of 24 cores idle; 64 gives 32 units
    t = flash(2048, 2048, 128, n=1)
    assert (t.s1, t.work_units, t.cores) == (64, 32, 24)
    assert "16 work units at s1 = 128 become 32 for 24 cores" in t.rule
    # enough heads: 128 stays
    assert flash(2048, 2048, 128, n=8).s1 == 128


def test_query_shorter_than_a_block_is_one_row_block():
    # one row per head leaves 8 units for 24 cores: flash-decoding splits the keys in 3 parts
    t = flash(1, 4096, 128)
    assert (t.template, t.s1, t.segments, t.work_units) == (FLASH_DECODE, 1, 3, 24)


# --- dtype ----------------------------------------------------------------------------------------

def test_f32_fits_fewer_elements_than_f16():
    f16, f32 = flash(4096, 4096, 128, F16), flash(4096, 4096, 128, F32)
    assert (f16.s1, f32.s1) == (128, 64)
    assert "UB" in f32.rule and "shrunk to 64 x 128" in f32.rule
    # same block, f32 costs more of every buffer
    a = flash_budget(64, 128, 128, F16, 2, load_target(ONCHIP_910B))
    b = flash_budget(64, 128, 128, F32, 2, load_target(ONCHIP_910B))
    assert b.ub > a.ub and b.l1 == 2 * a.l1


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("s", [64, 512, 4096])
def test_bf16_tiles_like_f16(target, d, s):
    a, b = flash(s, s, d, F16, target), flash(s, s, d, BF16, target)
    assert a.to_attr() == b.to_attr()


# --- budgets --------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [F16, F32])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_every_choice_fits_every_buffer(target, dtype, d):
    chip = load_target(target)
    for sq, skv, causal, buffers in itertools.product((1, 100, 128, 640, 2048, 8192), (16, 100, 128, 640, 2048, 8192),
                                                      (False, True), (1, 2)):
        t = flash(sq, skv, d, dtype, target, causal, buffers)
        assert fits(t, target), (sq, skv, t)
        again = flash_budget(t.s1, t.s2, d, dtype, buffers, chip, causal=causal)
        assert (again.ub, again.l1, again.l0a, again.l0b, again.l0c) == (
            t.ub_bytes, t.l1_bytes, t.l0a_bytes, t.l0b_bytes, t.l0c_bytes)
        if t.template == FLASH_DECODE:  # key parts of whole key blocks, none empty
            blocks = -(-skv // t.s2)
            assert (t.segments - 1) * -(-blocks // t.segments) < blocks
        else:
            assert t.s2 * t.segments >= skv if t.template == WHOLE_ROW else t.segments == 1
        assert t.s1 % 16 == 0 or t.s1 == sq


def test_a_mask_costs_ub_and_can_shrink_the_block():
    q, k, v = qkv(4096, 4096, 128)
    plain = choose_flash_tiling(q, k, v, False, False, as_target(ONCHIP_910B))
    masked = choose_flash_tiling(q, k, v, True, True, as_target(ONCHIP_910B), mask_itemsize=4)
    assert masked.s1 < plain.s1 and fits(masked, ONCHIP_910B)
    assert "UB" in masked.rule


def test_double_buffering_doubles_the_buffers_and_can_shrink_the_block():
    one, two = flash(512, 512, 64, target="ascend910a", buffers=1), flash(512, 512, 64, target="ascend910a")
    assert (one.s1, two.s1) == (128, 64)
    assert (one.buffers, two.buffers) == (1, 2)
    same_one = flash_budget(64, 128, 64, F16, 1, load_target("ascend910a"))
    same_two = flash_budget(64, 128, 64, F16, 2, load_target("ascend910a"))
    assert same_two.l1 == 2 * same_one.l1 and same_two.l0c == 2 * same_one.l0c


def test_targets_differ_where_their_buffers_differ():
    # 910B: 192 KiB UB per vector unit, two vector units share a block's rows; 910A/310P: one 256 KiB UB
    b, a, p = (flash(4096, 4096, 128, target=t) for t in TARGETS)
    assert (b.s1, a.s1, p.s1) == (128, 64, 64)
    assert (b.cores, a.cores, p.cores) == (24, 32, 8)
    # L1: 512 KiB on 910B, 1 MiB on 910A keeps s2 = 128 at D = 512
    assert flash(4096, 4096, 512, target=ONCHIP_910B).s2 < flash(4096, 4096, 512, target="ascend910a").s2


def test_a_row_that_cannot_fit_is_split_into_key_segments():
    t = flash(512, 128, 512, F32)
    assert (t.template, t.segments, t.s2) == (WHOLE_ROW, 4, 32)
    assert "4 key segments combined by log-sum-exp" in t.rule
    assert fits(t, ONCHIP_910B)


@pytest.mark.parametrize("target", TARGETS)
def test_too_large_a_head_dim_names_buffer_request_and_capacity(target):
    with pytest.raises(TilingError) as e:
        flash(1024, 1024, 4096, target=target)
    m = re.search(r"needs (\d+) bytes of (UB|L1|L0A|L0B|L0C), which holds (\d+)", str(e.value))
    assert m, str(e.value)
    need, name, cap = int(m[1]), m[2], int(m[3])
    assert need > cap == load_target(target).buffer_bytes(name.lower())
    assert "s1 = 16, s2 = 16" in str(e.value) and target in str(e.value)


# --- work units, cores, causal ---------------------------------------------------------------------

@pytest.mark.parametrize("b,n,sq,units,cores", [(2, 4, 1000, 64, 24), (1, 2, 256, 4, 4), (1, 8, 128, 8, 8)])
def test_work_units_are_b_n_row_blocks_spread_over_the_cores(b, n, sq, units, cores):
    t = flash(sq, sq, 128, b=b, n=n)
    assert (t.work_units, t.cores) == (units, cores)


def test_grouped_query_heads_count_query_heads():
    assert flash(1024, 1024, 128, n=32, nkv=4).work_units == 32 * 8


def test_causal_skips_fully_masked_blocks():
    t = flash(512, 512, 128, causal=True)
    assert t.skipped_blocks == 6 and t.to_attr()["skipped_blocks"] == 6
    assert flash(512, 512, 128).skipped_blocks == 0
    for sq, skv, s1, s2 in itertools.product((1, 100, 128, 300, 1000), (16, 128, 333, 1024), (64, 128), (32, 128)):
        brute = sum(1 for i in range(0, sq, s1) for j in range(0, skv, s2) if j > min(i + s1, sq) - 1)
        assert causal_skipped(sq, skv, s1, s2) == brute


def test_dynamic_sequences_use_the_largest_bucket():
    t = flash(None, None, 64)
    assert (t.template, t.s2, t.work_units, t.cores) == (SPLIT_KV, 128, None, 24)
    assert "dynamic" in t.rule and "work_units" not in t.to_attr()
    with pytest.raises(Untiled, match="head dim is dynamic"):
        flash(128, 128, None)


def test_layouts_agree():
    q = TensorType((2, 512, 8, 64), F16)
    bsnd = choose_flash_tiling(q, q, q, False, False, as_target(ONCHIP_910B), layout="BSND")
    assert bsnd.to_attr() == flash(512, 512, 64, b=2).to_attr()


def test_buffers_must_be_1_or_2():
    with pytest.raises(ValueError, match="buffers"):
        flash(128, 128, buffers=3)


def test_attribute_keys_start_with_the_spec_order():
    keys = list(flash(4096, 4096).to_attr())
    assert keys[:7] == ["template", "s1", "s2", "d", "buffers", "cores", "ub_bytes"]


# --- matmul and vector kernels -----------------------------------------------------------------------

def test_matmul_base_block_fits_l0_and_differs_by_l0c():
    # pto-isa's gemm_performance (fp16): base 128 x 256 x 64, L0A/L0B halves of 32 KiB, 128 x 256 f32 fills the
    # 910B's 128 KiB L0C (one accumulator); the 910A's 256 KiB holds two
    a, b = TensorType((4096, 4096), F16), TensorType((4096, 4096), F16)
    t910b = choose_matmul_tiling(a, b, load_target("ascend910b"))
    t910a = choose_matmul_tiling(a, b, load_target("ascend910a"))
    assert t910b.blocks == t910a.blocks == {"m": 128, "n": 256, "k": 64}
    assert (t910b.l0c_bytes, t910a.l0c_bytes) == (128 * 256 * 4, 2 * 128 * 256 * 4)
    for t, target in ((t910b, "ascend910b"), (t910a, "ascend910a")):
        chip = load_target(target)
        assert t.l0c_bytes <= chip.buffer_bytes("l0c") and t.l0b_bytes <= chip.buffer_bytes("l0b")
        assert t.l0a_bytes == 2 * 128 * 64 * 2 and t.l0b_bytes == 2 * 64 * 256 * 2  # ping-pong halves
    assert t910b.cores == 24 and t910b.template == "MatmulBasicBlock"


def test_matmul_tiling_is_gemm_performance_s_at_6144():
    # the TCubeTiling table of pto-isa kernels/manual/a2a3/gemm_performance/README.md (24 cube cores, m = k = n = 6144)
    s = TensorType((6144, 6144), F16)
    t = choose_matmul_tiling(s, s, load_target("ascend910b"))
    assert (t.single_core_m, t.single_core_k, t.single_core_n) == (1536, 6144, 1024)
    assert (t.base_m, t.base_k, t.base_n) == (128, 64, 256)
    assert (t.step_m, t.step_ka, t.step_kb, t.step_n) == (1, 4, 4, 1)
    assert (t.depth_a1, t.depth_b1) == (8, 8)  # four k slices, double-buffered
    assert t.l1_bytes == 8 * 128 * 64 * 2 + 8 * 64 * 256 * 2 <= load_target("ascend910b").buffer_bytes("l1")


def test_matmul_order_keeps_the_re_read_panel_in_l2():
    # an LM head (4096 tokens x 128256 vocabulary): walking N first, each core re-reads its B panels once per row of
    # its block, and between two reads the cores touch gm A + gn B panels a wave for sn waves: far more than the
    # 192 MiB L2. M first keeps B and re-reads the (shared) A panels, which fit
    a, b = TensorType((4096, 4096), F16), TensorType((4096, 128256), F16)
    t = choose_matmul_tiling(a, b, load_target("ascend910b"))
    sm, sn = t.single_core_m // t.base_m, t.single_core_n // t.base_n
    gm, gn = -(-4096 // t.single_core_m), -(-128256 // t.single_core_n)
    per_wave = gm * t.base_m * 4096 * 2 + gn * 4096 * t.base_n * 2
    assert sn * per_wave > 192 * 2**20 > sm * per_wave
    assert t.iterate_order == 0 and "M first" in t.rule
    square = choose_matmul_tiling(a, a, load_target("ascend910b"))
    assert square.iterate_order == 1  # both fit: N first, as gemm_performance's loop


def test_a_decode_gemv_spreads_its_columns_over_every_core():
    # one token (M = 1): 4096 columns in base blocks of 256 would keep 16 of 24 cores streaming B
    t = choose_matmul_tiling(TensorType((1, 4096), F16), TensorType((4096, 4096), F16), load_target("ascend910b"))
    blocks = -(-4096 // t.base_n)
    assert t.base_m == 16 and blocks >= 24 and t.cores > 16
    assert t.single_core_n // t.base_n == -(-blocks // 24)  # the busiest core has no more blocks than an even deal
    assert "fewer base blocks" in t.rule


def test_matmul_small_and_f32_and_epilogue():
    # f32: base_k 32; 8 batch items (each its own B: a 2-D B would fold the batch into M) of one 64 x 48 block
    # each would keep 8 of the 24 cores busy. On a chip without a launch head (this 910B with the [overhead]
    # head at 0) smaller blocks spread C over more of them
    a, b = TensorType((8, 64, 32), F32), TensorType((8, 32, 48), F32)
    headless = "ascend910b[overhead.head_full_chip_us=0]"
    t = choose_matmul_tiling(a, b, as_target(headless), transpose_b=False)
    units = 8 * -(-64 // t.base_m) * -(-48 // t.base_n)
    assert t.base_k == 32 and t.base_m <= 64 and t.base_n <= 48 and t.base_m % 16 == 0 and t.base_n % 16 == 0
    assert 8 < units and t.cores == min(units, 24)
    # with the 910B's head (0.28 us a core) the blocks' few cycles of work do not pay for more cores: the rule
    # keeps the 8 blocks, and that launch is the faster one on the 910B
    sig = OpSignature("ge.matmul", (a, b), (TensorType((8, 64, 48), F32),), {})
    few = choose_matmul_tiling(a, b, load_target("ascend910b"), transpose_b=False)
    assert few.cores == 8 and few.work_units == 8
    chip = load_target("ascend910b")
    assert launch_us(sig, few, chip) < launch_us(sig, attrs.evolve(t, rule=""), chip)
    big = choose_matmul_tiling(TensorType((64, 2048, 32), F32), TensorType((64, 32, 48), F32), load_target("ascend910b"))
    assert big.blocks == {"m": 128, "n": 48, "k": 32}  # enough blocks for every core: the shape's own
    for target, template in (("ascend910b", "MatmulMixEpilogue"), ("ascend910a", "MatmulEpilogue")):
        e = choose_matmul_tiling(TensorType((512, 512), F16), TensorType((512, 512), F16), as_target(target),
                                 epilogue=True)
        assert e.template == template and 0 < e.ub_bytes <= load_target(target).buffer_bytes("ub")


def test_vector_tiles_fit_ub_and_spread_over_cores():
    x = TensorType((64, 4096), F16)
    big = TensorType((4096, 4096), F16)
    ew = choose_vector_tiling("ge.exp", [big], [big], load_target("ascend910b"))
    sm = choose_vector_tiling("ge.softmax", [x], [x], load_target("ascend910b"), attributes={"axis": -1})
    assert ew.template == "VectorElementwise" and ew.cores == 48 and ew.ub_bytes <= 192 * 1024
    assert sm.template == "VectorRow" and sm.blocks["cols"] == 4096 and sm.segments == 1


def test_a_small_vector_op_leaves_units_idle_where_their_head_costs_more_than_they_save():
    # 1 MiB in and out: on the 910B each vector unit started costs 0.28 us of launch head (catlass's 20.5 us over
    # 72 cores), more than a share of so few bytes saves; the rule's launch beats the same tiles dealt to all 48
    x = TensorType((64, 4096), F16)
    few = choose_vector_tiling("ge.exp", [x], [x], load_target("ascend910b"))
    assert few.cores < 48 and "launch head" in few.rule
    elems = -(-64 * 4096 // 48 // 16) * 16
    every = attrs.evolve(few, elems=elems, cores=48, work_units=-(-64 * 4096 // elems), rule="")
    sig = OpSignature("ge.exp", (x,), (x,), {})
    chip = load_target("ascend910b")
    assert launch_us(sig, few, chip) < launch_us(sig, every, chip)
    # a chip without a head spreads it over every unit
    assert choose_vector_tiling("ge.exp", [x], [x], load_target("ascend910b[overhead.head_full_chip_us=0]")).cores == 48


def test_a_softmax_row_longer_than_ub_is_segmented():
    x = TensorType((4, 1 << 20), F32)
    t = choose_vector_tiling("ge.softmax", [x], [x], load_target("ascend910b"))
    assert t.segments > 1 and t.blocks["cols"] * t.segments >= 1 << 20
    assert t.ub_bytes <= load_target("ascend910b").buffer_bytes("ub")


# --- the pass ---------------------------------------------------------------------------------------

GRAPH = """
ge.graph @main(%q: tensor<1x8x2048x64xf16>, %x: tensor<16x32xf32>, %w: tensor<32x32xf32>)
    -> (tensor<1x8x2048x64xf16>, tensor<16x32xf32>) {
  %o = ge.flash_attention %q, %q, %q {causal = true}
  %c = ge.const dense<1.0> : tensor<f32>
  %m = ge.matmul %x, %w
  %r = ge.reshape %m {shape = [32, 16]}
  %y = ge.add %m, %c
  ge.return %o, %y
}
"""


def run_tile(pipeline: str, target: str = ONCHIP_910B, explain: bool = False, text: str = GRAPH):
    module = parse(text)
    diags: list[Diagnostic] = []
    ctx = PassContext(target=target, diagnostics=DiagnosticEngine(diags.append), explain=explain)
    ok = PassManager(complete_pipeline(parse_pipeline(pipeline))).run(module, ctx)
    return module, diags, ok


def test_pass_tiles_kernel_ops_only():
    module, diags, ok = run_tile("tile")
    assert ok and not diags
    tiled = {op.name: op.attributes.get("tiling") for op in module.graphs[0].ops}
    assert tiled["ge.flash_attention"]["template"] == SPLIT_KV
    assert tiled["ge.matmul"]["template"] == "MatmulBasicBlock"
    assert tiled["ge.add"]["template"] == "VectorElementwise"
    assert tiled["ge.const"] is None and tiled["ge.reshape"] is None and tiled["ge.return"] is None
    # printed, it parses back to the same text
    text = print_module(module)
    assert print_module(parse(text)) == text


def test_pass_target_option_overrides_the_context():
    by_ctx, _, _ = run_tile("tile", target="ascend310p")
    by_opt, _, _ = run_tile("tile{target=ascend310p}", target="ascend910b")
    fa = lambda m: m.graphs[0].ops[0].attributes["tiling"]  # noqa: E731
    assert fa(by_ctx) == fa(by_opt) and fa(by_ctx)["cores"] == 8
    assert fa(run_tile("tile{buffers=1}")[0])["buffers"] == 1


def test_pass_explains_its_rules_only_under_explain():
    _, quiet, _ = run_tile("tile")
    _, loud, _ = run_tile("tile", explain=True)
    assert not quiet
    fa = [d.message for d in loud if "flash_attention" in d.message]
    assert fa and fa[0].startswith("tile: flash_attention key sequence 2048 > 1024") and "causal skips" in fa[0]
    # the 910B itself: the design document's template (8 heads of 2048 rows: 8*32 = 256 > 48 vector cores)
    _, a2, _ = run_tile("tile", target="ascend910b", explain=True)
    fa = [d.message for d in a2 if "flash_attention" in d.message]
    assert fa[0].startswith("tile: flash_attention S1S2 template: S2 = 2048 > 1024; S1.i = 128 because "
                            "B*N2*G*S1.o = 256 > 48 vector cores; CV block 128 x 1024") and "causal skips" in fa[0]


@pytest.mark.parametrize("pipeline", ["tile{buffers=3}", "tile{buffers=0}", "tile{target=ascend999}"])
def test_pass_refuses_bad_options(pipeline):
    with pytest.raises(PipelineError):
        parse_pipeline(pipeline)


def test_pass_reports_an_impossible_tiling_at_the_op():
    text = """ge.graph @main(%q: tensor<1x1x64x8192xf16>) -> tensor<1x1x64x8192xf16> {
  %o = ge.flash_attention %q, %q, %q
  ge.return %o
}"""
    _, diags, ok = run_tile("tile", text=text)
    assert not ok
    assert diags[0].severity == "error" and diags[0].loc.line == 2 and "which holds" in diags[0].message


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TARGETS + ("ascend910b",)), st.sampled_from([F16, BF16, F32]), st.integers(0, 20000), st.integers(0, 20000),
       st.integers(1, 700), st.booleans(), st.booleans(), st.sampled_from([1, 2]))
def test_any_shape_fits_or_says_which_buffer_overflows(target, dtype, sq, skv, d, causal, has_mask, buffers):
    q, k, v = qkv(sq, skv, d, dtype, b=1, n=4)
    try:
        t = choose_flash_tiling(q, k, v, causal, has_mask, as_target(target), buffers)
    except TilingError as e:
        assert re.search(r"needs \d+ bytes of (UB|L1|L0A|L0B|L0C), which holds \d+", str(e))
        return
    assert fits(t, target) and t.s1 >= 1 and t.s2 >= 1 and t.cores <= load_target(target).cube_cores


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TARGETS), st.sampled_from([F16, F32]), st.integers(1, 5000), st.integers(1, 5000),
       st.integers(1, 5000), st.sampled_from([1, 2]))
def test_matmul_and_vector_tiles_fit(target, dtype, m, k, n, buffers):
    chip = load_target(target)
    a, b, c = TensorType((m, k), dtype), TensorType((k, n), dtype), TensorType((m, n), dtype)
    mm = choose_matmul_tiling(a, b, as_target(target), buffers)
    assert all(getattr(mm, f"{x}_bytes") <= chip.buffer_bytes(x) for x in ("l1", "l0a", "l0b", "l0c"))
    for name, attributes in (("ge.exp", {}), ("ge.softmax", {"axis": -1}), ("ge.reduce_sum", {"axes": [0]})):
        t = choose_vector_tiling(name, [c], [c], as_target(target), buffers, attributes)
        assert t.ub_bytes <= chip.buffer_bytes("ub") and 1 <= t.cores <= chip.vector_cores
