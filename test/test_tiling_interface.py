"""The kernels' tiling contract: typed tilings, one buffer model, shrink, candidates, the IR boundary.

Oracles: the buffers' real capacities (target_npu's Buffer allocation), the arithmetic of the
blocks (a halved dimension), bit-identity of results across tilings, and the printed program.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from geir.kernels import KERNELS, LaunchContext
from geir.kernels.tiling import KernelTiling, Miss, OpSignature, TilingAttrError
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.printer import print_module
from geir.target_npu import load_target
from geir.target_npu.sim import Cores, GlobalMemory, buffers_of
from geir.tools.gerun import main as gerun_main
from geir.tools.geopt import main as geopt_main
from geir.types import DType, TensorType

TARGETS = ("ascend910b", "ascend910a", "ascend310p")
F16, F32 = DType.f16, DType.f32


def t(*shape: int, dtype: DType = F16) -> TensorType:
    return TensorType(shape, dtype)


# one op of every kernel family, with the types and attributes its tiling depends on
SIGNATURES = [
    OpSignature("ge.flash_attention", (t(1, 8, 2048, 128), t(1, 8, 2048, 128), t(1, 8, 2048, 128)),
                (t(1, 8, 2048, 128),), {"causal": True}),
    OpSignature("ge.flash_attention", (t(2, 4, 100, 64), t(2, 2, 100, 64), t(2, 2, 100, 64), t(1, 1, 100, 100)),
                (t(2, 4, 100, 64),), {}),
    OpSignature("ge.matmul", (t(4, 300, 512), t(512, 1000)), (t(4, 300, 1000),), {}),
    OpSignature("ge.fused_matmul", (t(256, 768), t(768, 3072), t(3072)), (t(256, 3072),), {"activation": "gelu"}),
    OpSignature("ge.add", (t(64, 4096, dtype=F32), t(4096, dtype=F32)), (t(64, 4096, dtype=F32),), {}),
    OpSignature("ge.softmax", (t(8, 128, 2048),), (t(8, 128, 2048),), {"axis": -1}),
    OpSignature("ge.layer_norm", (t(512, 768), t(768), t(768)), (t(512, 768),), {"epsilon": 1e-5}),
    OpSignature("ge.transpose", (t(8, 128, 64),), (t(128, 8, 64),), {"perm": [1, 0, 2]}),
]
IDS = [f"{s.name[3:]}{i}" for i, s in enumerate(SIGNATURES)]


def fits_on_chip(kernel, tiling: KernelTiling, sig: OpSignature, chip) -> bool:
    """Whether one core's buffers (with their real capacities) can hold the tiling's budget."""
    buffers = buffers_of(chip)
    budget = kernel.budget(tiling, sig, chip)
    try:
        for name in ("ub", "l1", "l0a", "l0b", "l0c"):
            buffers[name.upper()].alloc(getattr(budget, name), "the test")
    except Exception:  # noqa: BLE001 - CapacityError: the budget does not fit
        return False
    return True


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("sig", SIGNATURES, ids=IDS)
def test_the_chosen_tiling_is_typed_fits_and_crosses_the_ir_once(sig, target):
    chip = load_target(target)
    kernel = KERNELS[sig.name]
    tiling = kernel.choose(sig, chip)
    assert isinstance(tiling, kernel.TILING) and attrs.has(type(tiling))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        tiling.buffers = 1  # frozen: nobody downstream edits a tiling in place
    assert fits_on_chip(kernel, tiling, sig, chip)
    # to the IR attribute and back: the same tiling (the rule's prose is not part of the attribute)
    attr = tiling.to_attr()
    assert "rule" not in attr and kernel.decode(attr) == tiling


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("sig", SIGNATURES, ids=IDS)
def test_candidates_are_legal_and_include_the_rules_choice(sig, target):
    chip = load_target(target)
    kernel = KERNELS[sig.name]
    cands = kernel.candidates(sig, chip)
    assert cands and all(fits_on_chip(kernel, c, sig, chip) for c in cands)
    assert kernel.choose(sig, chip) in cands
    assert len(set(map(lambda c: tuple(c.to_attr().items()), cands))) == len(cands)  # no duplicates


@pytest.mark.parametrize("sig", SIGNATURES, ids=IDS)
def test_shrink_halves_the_parallel_block_and_never_asks_for_more(sig):
    chip = load_target("ascend910b")
    kernel = KERNELS[sig.name]
    tiling = kernel.choose(sig, chip)
    shrunk, change = kernel.shrink(tiling)
    (key,) = [k for k, v in tiling.to_attr().items() if k != "ub_bytes" and shrunk.to_attr()[k] != v]
    assert getattr(shrunk, key) == getattr(tiling, key) // 2 and change == f"{key} {getattr(tiling, key)} -> {getattr(shrunk, key)}"
    before, after = kernel.budget(tiling, sig, chip), kernel.budget(shrunk, sig, chip)
    assert all(getattr(after, b) <= getattr(before, b) for b in ("ub", "l1", "l0a", "l0b", "l0c"))


def _run(kernel, op, inputs, tiling, target: str = "ascend910b"):
    chip = load_target(target)
    ctx = LaunchContext(chip, Cores(chip.cube_cores), GlobalMemory(chip),
                        [v.name for v in op.operands], [r.name for r in op.results])
    return kernel.run(op, inputs, tiling, ctx)


def _tiled_op(text: str):
    module = parse(text)
    assert PassManager(complete_pipeline(parse_pipeline("tile"))).run(module, PassContext())
    return module.graphs[0].ops[0]


@pytest.mark.parametrize("body, args", [
    ("%o = ge.flash_attention %q, %k, %v {causal = true} : tensor<1x2x256x64xf16>",
     "%q: tensor<1x2x256x64xf16>, %k: tensor<1x2x256x64xf16>, %v: tensor<1x2x256x64xf16>"),
    ("%o = ge.matmul %q, %w : tensor<300x200xf16>", "%q: tensor<300x128xf16>, %w: tensor<128x200xf16>"),
    ("%o = ge.softmax %q : tensor<300x200xf32>", "%q: tensor<300x200xf32>"),
    ("%o = ge.exp %q : tensor<300x200xf32>", "%q: tensor<300x200xf32>"),
])
def test_a_shrunk_tiling_computes_bit_identical_results(body, args):
    rtype = body.rsplit(": ", 1)[1]
    op = _tiled_op(f"ge.graph @main({args}) -> {rtype} {{\n  {body}\n  ge.return %o\n}}")
    kernel = KERNELS[op.name]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(v.type.shape).astype(v.type.dtype.np) for v in op.operands]
    tiling = kernel.decode(op.attributes["tiling"])
    shrunk, _ = kernel.shrink(tiling)
    (a,), (b,) = _run(kernel, op, inputs, tiling), _run(kernel, op, inputs, shrunk)
    assert a.tobytes() == b.tobytes()


def test_a_kernel_run_without_a_tiling_leaves_the_ir_as_it_was():
    text = """ge.graph @main(%a: tensor<?x64xf16>, %b: tensor<64x96xf16>) -> tensor<?x96xf16> {
  %c = ge.matmul %a, %b
  ge.return %c
}"""
    module = parse(text)
    before = print_module(module)
    op = module.graphs[0].ops[0]
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype(np.float16) for s in ((50, 64), (64, 96)))
    kernel = KERNELS[op.name]
    (out,) = _run(kernel, op, [a, b], kernel.tiling_for(op, [a, b], load_target("ascend910b")))
    assert out.shape == (50, 96) and print_module(module) == before
    assert op.operands[0].type == TensorType((None, 64), F16)


_MATMUL = {"template": "MatmulBasicBlock", "single_core_m": 64, "single_core_n": 64, "single_core_k": 64,
           "base_m": 64, "base_n": 64, "base_k": 64, "step_m": 1, "step_n": 1, "step_ka": 1, "step_kb": 1,
           "depth_a1": 2, "depth_b1": 2, "iterate_order": 1, "buffers": 2, "cores": 1, "ub_bytes": 0, "l1_bytes": 1,
           "l0a_bytes": 1, "l0b_bytes": 1, "l0c_bytes": 1}


def _without(key: str) -> dict:
    return {k: v for k, v in _MATMUL.items() if k != key}


@pytest.mark.parametrize("attr, message", [
    (_without("base_k"), "has no 'base_k'"),
    (_MATMUL | {"base_n": "64"}, "'base_n' must be a non-negative integer"),
    (_MATMUL | {"template": "S1Bn2gs1"}, "template 'S1Bn2gs1' is not one of"),
    (_MATMUL | {"buffers": 3}, "'buffers' must be 1 or 2"),
    (_MATMUL | {"q": 3}, "unknown key 'q'"),
    (_MATMUL | {"step_m": 2}, "step_m = 2"),
    (_MATMUL | {"depth_a1": 3}, "'depth_a1' must be step_ka"),
    (_MATMUL | {"single_core_m": 96}, "'single_core_m' \\(96\\) must be a multiple of 'base_m'"),
    (_MATMUL | {"iterate_order": 2}, "iterate_order must be 0"),
])
def test_a_malformed_tiling_attribute_says_what_is_wrong(attr, message):
    with pytest.raises(TilingAttrError, match=message):
        KERNELS["ge.matmul"].decode(attr)


def test_gerun_reports_a_malformed_tiling_at_its_launch(tmp_path, capsys):
    src = tmp_path / "g.geir"
    src.write_text("""ge.graph @main(%a: tensor<64x64xf16>, %b: tensor<64x64xf16>) -> tensor<64x64xf16> {
  %c = ge.matmul %a, %b
  ge.return %c
}
""")
    lowered = tmp_path / "p.geir"
    assert geopt_main([str(src), "--passes=lower", "-o", str(lowered)]) == 0
    text = lowered.read_text()
    assert " base_k = 64," in text
    bad = tmp_path / "bad.geir"
    bad.write_text(text.replace(" base_k = 64,", " base_k = -64,"))
    capsys.readouterr()
    assert gerun_main([str(bad)]) == 1
    err = capsys.readouterr().err
    line = next(i for i, s in enumerate(bad.read_text().splitlines(), 1) if "base_k = -64," in s)
    assert f"bad.geir:{line}:" in err and "error: the tiling of ge.matmul: 'base_k' must be a non-negative integer, not -64" in err
    assert "^" in err and "Traceback" not in err and "internal error" not in err


def test_the_tile_pass_asks_the_kernel_and_says_why_an_op_stays_untiled():
    sig = OpSignature("ge.matmul", (t(4, 4, dtype=DType.i32), t(4, 4, dtype=DType.i32)), (t(4, 4, dtype=DType.i32),))
    miss = KERNELS["ge.matmul"].choose(sig, load_target("ascend910b"))
    assert isinstance(miss, Miss) and not miss.overflow and "no i32 mode" in miss.reason
    big = OpSignature("ge.flash_attention", (t(1, 1, 64, 65536),) * 3, (t(1, 1, 64, 65536),))
    over = KERNELS["ge.flash_attention"].choose(big, load_target("ascend910b"))
    assert isinstance(over, Miss) and over.overflow and "which holds" in over.reason


def _tiling_classes() -> list[type[KernelTiling]]:
    """Every kernel's tiling class (one per kernel family registered)."""
    return sorted({k.TILING for k in KERNELS.values() if k.TILING is not None}, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _tiling_classes(), ids=lambda c: c.__name__)
def test_tilings_are_built_with_keyword_fields_only(cls):
    # the printed field order is not a constructor's order: a positional call is refused, whatever the class
    fields = [f for f in attrs.fields(cls) if f.default is attrs.NOTHING]
    assert fields and all(f.kw_only for f in attrs.fields(cls))
    with pytest.raises(TypeError):
        cls(*range(len(fields)))


def test_the_fields_row_gather_and_scan_tilings_share_are_declared_once():
    from geir.kernels.gather_tiling import GatherTiling
    from geir.kernels.tiling import RowBlockTiling
    from geir.kernels.vector_tiling import RowTiling, ScanTiling

    shared = ("template", "rows", "cols", "buffers", "cores", "ub_bytes", "work_units", "rule")
    assert tuple(f.name for f in attrs.fields(RowBlockTiling)) == shared
    for cls in (RowTiling, ScanTiling, GatherTiling):
        assert issubclass(cls, RowBlockTiling) and "rows" not in cls.__dict__.get("__annotations__", {})
    # the printed order stays the attribute's: the shared blocks first, then a row tiling's segments
    row = RowTiling(segments=2, ub_bytes=4096, cores=3, buffers=2, cols=64, rows=8, template="VectorRow")
    assert list(row.to_attr()) == ["template", "rows", "cols", "buffers", "cores", "ub_bytes", "segments"]
    assert RowTiling.from_attr(row.to_attr()) == row


def test_matmul_candidates_vary_the_tcubetiling_fields_getune_tunes():
    # issue 25: getune's candidates follow TCubeTiling's fields: the k slices an L1 load caches (stepKa / stepKb),
    # the order the cores walk C (iterateOrder) and the base block, with it the 2-D core split
    from geir.kernels.matmul_tiling import M_FIRST, N_FIRST
    chip = load_target("ascend910b")
    sig = OpSignature("ge.matmul", (TensorType((4096, 4096), DType("f16")),) * 2,
                      (TensorType((4096, 4096), DType("f16")),), {})
    kernel = KERNELS["ge.matmul"]
    rules, cands = kernel.choose(sig, chip), kernel.candidates(sig, chip)
    assert rules.step_ka == rules.step_kb == 4
    assert {c.step_ka for c in cands} >= {1, 2, 4} and all(c.step_ka == c.step_kb for c in cands)
    assert {c.iterate_order for c in cands} == {M_FIRST, N_FIRST}
    assert len({(c.base_m, c.base_n, c.base_k) for c in cands}) > 1
    assert len({(c.single_core_m, c.single_core_n) for c in cands}) > 1
