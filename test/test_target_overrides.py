"""What-if chips: a bundled target with named overrides, addressed as `BASE[key=value,...]`.

Oracles: the numbers of the bundled target files (ascend910b.toml: 192 KiB UB, 192 MiB L2, 1.6 TB/s
HBM, 24 cube cores with 2 vector cores each), unit arithmetic done by hand (384 MiB = 384 x 2**20
bytes), the existing error messages of target.py, and the buffers' real capacities as the kernels'
own Budget.overflow reads them.
"""

from __future__ import annotations

import copy
import re

import pytest

from geir.kernels import KERNELS
from geir.kernels.tiling import Miss, OpSignature
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.target_npu.overrides import (OVERRIDE_KEYS, OverrideError, apply_overrides, parse_override, split_spec,
                                       target_spec)
from geir.target_npu.target import TARGET_DIR, Target, TargetError, load_target
from geir.tools.gerun import main as gerun_main
from geir.types import DType, TensorType

KIB, MIB = 1024, 2**20


def t(*shape: int) -> TensorType:
    return TensorType(shape, DType.f16)


def test_a_multiplier_doubles_the_unified_buffer_exactly():
    chip = load_target("ascend910b[ub_bytes=x2]")
    assert chip.buffer_bytes("ub") == 384 * KIB  # the toml's 192 KiB, twice
    assert isinstance(chip.buffer_bytes("ub"), int)
    assert chip.buffer_bytes("l1") == 512 * KIB  # untouched
    assert chip.name == "ascend910b[ub_bytes=393216]"
    assert chip.data["overrides"] == {"ub_bytes": 393216}


def test_l2_in_mib_in_bytes_and_as_a_raw_key_is_one_chip_with_one_name():
    a = load_target("ascend910b[l2_mib=384]")
    b = load_target("ascend910b[l2_bytes=384MiB]")
    c = load_target("ascend910b[memory.l2_mib=384]")
    d = load_target(f"ascend910b[l2_bytes={384 * MIB}]")
    assert a.name == b.name == c.name == d.name == "ascend910b[l2_mib=384]"
    assert a == b == c == d
    assert a.data["memory"]["l2_mib"] == 384 and isinstance(a.data["memory"]["l2_mib"], int)


def test_hbm_bandwidth_in_tb_per_s_and_gb_per_s_is_one_chip():
    a = load_target("ascend910b[hbm_tb_per_s=3.2]")
    b = load_target("ascend910b[hbm_tb_per_s=3200GB/s]")
    c = load_target("ascend910b[hbm_bandwidth=3.2TB/s]")
    assert a.data["memory"]["hbm_tb_per_s"] == 3.2
    assert a.name == b.name == c.name == "ascend910b[hbm_tb_per_s=3.2]"
    # a multiplier of the toml's 1.6 is the decimal 3.2, not 3.2000000000000002
    assert load_target("ascend910b[hbm_tb_per_s=x2]").name == a.name


def test_cube_cores_move_the_paired_vector_cores_unless_given():
    half = load_target("ascend910b[cube_cores=12]")
    assert (half.cube_cores, half.vector_cores) == (12, 24)  # two AIV per AIC on the 910B
    double = load_target("ascend910b[cube_cores=x2]")
    assert (double.cube_cores, double.vector_cores) == (48, 96)
    both = load_target("ascend910b[cube_cores=12,vector_cores=30]")
    assert (both.cube_cores, both.vector_cores) == (12, 30)
    # the 310P's 8 AI cores (one vector unit each) plus its 7 standalone vector cores: the 7 stay
    p = load_target("ascend310p[cube_cores=16]")
    assert (p.cube_cores, p.vector_cores) == (16, 23)


def test_multipliers_on_integer_quantities_stay_integers_or_are_refused():
    chip = load_target("ascend910b[aicpu.cores=x2,dma_latency_cycles=x0.5]")
    assert chip.data["aicpu"]["cores"] == 12 and isinstance(chip.data["aicpu"]["cores"], int)
    latency = chip.data["memory"]["dma_latency_cycles"]
    assert latency == 32 and isinstance(latency, int)
    assert load_target("ascend910b[cube_cores=2x]").cube_cores == 48
    with pytest.raises(TargetError, match="must be a whole number, not 7.2"):
        load_target("ascend910b[cube_cores=x0.3]")  # 24 x 0.3 cube cores
    with pytest.raises(TargetError, match="whole number"):
        load_target("ascend910b[cube_cores=2.5]")


def test_a_buffer_is_a_whole_number_of_ub_blocks():
    chip = load_target(f"ascend910b[ub_bytes={384 * KIB + 32}]")
    assert chip.buffer_bytes("ub") == 384 * KIB + 32 and isinstance(chip.buffer_bytes("ub"), int)
    assert chip.name == f"ascend910b[ub_bytes={384 * KIB + 32}]"
    with pytest.raises(TargetError, match="not a multiple of the 32-byte UB block"):
        load_target("ascend910b[ub_bytes=1000]")


def test_the_base_targets_cached_object_is_unchanged():
    base = load_target("ascend910b")
    before = copy.deepcopy(base.data)
    chip = apply_overrides(base, [("ub_bytes", "x2"), ("cube_cores", "12"), ("l2_mib", "384")])
    load_target("ascend910b[ub_bytes=x4,hbm_tb_per_s=3.2]")
    assert base.data == before and "overrides" not in base.data
    assert load_target("ascend910b") is base and base.buffer_bytes("ub") == 192 * KIB and base.name == "ascend910b"
    assert chip.data["cores"] is not base.data["cores"]


def test_an_unknown_key_names_the_nearest_one():
    with pytest.raises(TargetError, match="did you mean 'ub_bytes'") as e:
        load_target("ascend910b[ub_bytz=x2]")
    assert "cube_cores" in str(e.value)  # the friendly keys are listed
    with pytest.raises(TargetError, match="did you mean 'memory.l2_mib'"):
        load_target("ascend910b[memory.l2_mb=3]")
    with pytest.raises(OverrideError, match="did you mean 'l2_mib'"):
        parse_override("l2_mb=3")


def test_a_zero_buffer_is_refused_with_the_target_files_message():
    with pytest.raises(TargetError, match=r"^ascend910b\[ub_bytes=0\]: \[buffers_kib\] ub must be positive, not 0$"):
        load_target("ascend910b[ub_bytes=0]")
    with pytest.raises(OverrideError, match=r"\[cores\] cube must be positive, not 0"):
        apply_overrides(load_target("ascend910b"), [("cube_cores", "0")])


@pytest.mark.parametrize("spec, message", [
    # astronomically large counts and latencies: refused with the bound and its reason, not a MemoryError
    ("ascend910b[cube_cores=1e12]", "ascend910b[cube_cores=1e12]: [cores] cube must be at most 4096, not "
                                    "1000000000000 (the simulator keeps a timeline per core; the largest Ascend has "
                                    "32 AI cores)"),
    ("ascend910b[cube_cores=x1e30]", "ascend910b[cube_cores=x1e30]: [cores] cube must be at most 4096, not 2.4e+31"),
    ("ascend910b[vector_cores=5000]", "[cores] vector must be at most 4096, not 5000"),
    ("ascend910b[aicpu.cores=2.5]", "ascend910b[aicpu.cores=2.5]: aicpu.cores: [aicpu] cores must be a whole number, "
                                    "not 2.5"),
    ("ascend910b[aicpu.cores=1e15]", "[aicpu] cores must be at most 4096, not 1000000000000000"),
    ("ascend910b[dma_latency_cycles=1e20]", "[memory] dma_latency_cycles must be at most 1000000000, not 1e+20 "
                                            "(longer than any run GEIR simulates)"),
    ("ascend910b[host.launch_latency_us=1e30]", "[host] launch_latency_us must be at most 1000000000, not 1e+30"),
    ("ascend910b[clock_ghz=x1e30]", "[cores] clock_ghz must be at most 1000, not 1.85e+30 (1 THz)"),
    ("ascend910b[ub_bytes=x1e20]", "[buffers_kib] ub must be at most 1073741824, not 1.92e+22"),
    ("ascend910b[fusion.flash_attention_decode_max_q=1e30]", "[fusion] flash_attention_decode_max_q must be at most "
                                                             "2147483648, not 1e+30"),
    ("ascend910b[ub_bytes]", "is not key=value"),
    ("ascend910b[]", "no overrides"),
    ("ascend910b[ub_bytes=abc]", "'abc' is not a number"),
    ("ascend910b[ub_bytes=2KB]", "write KiB"),
    ("ascend910b[ub_bytes=3.2TB/s]", "takes a size in bytes"),
    ("ascend910b[cube_cores=4MiB]", "takes a plain number"),
    ("ascend910b[ub_bytes=x2,ub_bytes=x3]", "overridden twice"),
    ("ascend910b[l2_mib=384,l2_bytes=1GiB]", "overridden twice"),
    ("ascend910b[layout.nd2nz_on_load=1]", "not a number to override"),
    ("ascend91b[ub_bytes=x2]", "unknown target 'ascend91b'; did you mean 'ascend910b'?"),
])
def test_a_malformed_spec_is_a_target_error(spec, message):
    with pytest.raises(TargetError, match=re.escape(message)) as e:
        load_target(spec)
    assert isinstance(e.value, KeyError)  # what the tools already report as a usage error


def test_plain_names_and_misspellings_behave_as_before():
    assert load_target("ascend910b").name == "ascend910b"
    with pytest.raises(TargetError, match=r"^unknown target 'ascend91b'; did you mean 'ascend910b'\?$"):
        load_target("ascend91b")


def test_parse_override_gives_the_points_of_a_sweep():
    assert parse_override("ub_bytes=x2,384KiB, 1MiB") == ("ub_bytes", ["x2", "384KiB", "1MiB"])
    assert parse_override("memory.l2_mib=384") == ("memory.l2_mib", ["384"])
    for text, message in [("ub_bytes", "needs a value"), ("=3", "no key"), ("ub_bytes=", "empty value"),
                          ("ub_bytes=1,,2", "empty value"), ("clock_ghz=fast", "not a number")]:
        with pytest.raises(OverrideError, match=message):
            parse_override(text)
    assert issubclass(OverrideError, ValueError)


def test_the_name_round_trips_through_split_spec_and_target_spec():
    spec = target_spec("ascend910b", [("ub_bytes", "x2"), ("hbm_bandwidth", "800GB/s"), ("clock_ghz", "1500MHz")])
    assert spec == "ascend910b[ub_bytes=393216,hbm_tb_per_s=0.8,clock_ghz=1.5]"
    base, items = split_spec(spec)
    assert (base, items) == ("ascend910b", [("ub_bytes", "393216"), ("hbm_tb_per_s", "0.8"), ("clock_ghz", "1.5")])
    assert target_spec(base, items) == spec
    assert load_target(spec).name == spec
    assert split_spec("ascend910b") == ("ascend910b", [])
    assert split_spec("chips/my.toml[ub_bytes=x2, l2_mib=384]") == \
        ("chips/my.toml", [("ub_bytes", "x2"), ("l2_mib", "384")])
    assert split_spec("chips[1]/my.toml") == ("chips[1]/my.toml", [])  # a path with brackets of its own


def test_a_raw_dotted_key_overrides_any_number_of_the_target_file():
    chip = load_target("ascend910b[aicpu.cores=12,fusion.flash_attention_decode_max_busy=0.25]")
    assert chip.data["aicpu"]["cores"] == 12
    assert chip.data["fusion"]["flash_attention_decode_max_busy"] == 0.25
    assert chip.name == "ascend910b[aicpu.cores=12,fusion.flash_attention_decode_max_busy=0.25]"
    # a raw key of a quantity with a friendly key is named by the friendly one
    assert load_target("ascend910b[buffers_kib.ub=384]").name == "ascend910b[ub_bytes=393216]"


def test_load_target_caches_a_spec_and_equal_chips_are_one_object():
    a = load_target("ascend910b[ub_bytes=x2,l2_mib=384]")
    assert load_target("ascend910b[ub_bytes=x2,l2_mib=384]") is a
    assert load_target("ascend910b[ub_bytes=393216,l2_mib=384]") is a
    assert isinstance(a, Target) and a.name == "ascend910b[ub_bytes=393216,l2_mib=384]"


def test_a_what_if_chip_overridden_again_keeps_a_name_that_loads_it():
    chip = apply_overrides(load_target("ascend910b[cube_cores=12]"), [("ub_bytes", "x2"), ("cube_cores", "x0.5")])
    assert chip.name == "ascend910b[cube_cores=6,ub_bytes=393216]"
    assert (chip.cube_cores, chip.vector_cores) == (6, 12)
    assert load_target(chip.name) == chip
    stacked = load_target("ascend910b[ub_bytes=x2][ub_bytes=x2]")
    assert stacked.buffer_bytes("ub") == 4 * 192 * KIB and stacked.name == "ascend910b[ub_bytes=786432]"


def test_a_target_file_path_is_a_base(tmp_path):
    path = tmp_path / "mychip.toml"
    path.write_text((TARGET_DIR / "ascend910b.toml").read_text())
    chip = load_target(f"{path}[ub_bytes=x2]")
    assert chip.buffer_bytes("ub") == 384 * KIB and chip.name == f"{path}[ub_bytes=393216]"


# A big attention: 1 x 8 heads x 8192 x 128, f16, causal
BIG_ATTENTION = OpSignature("ge.flash_attention", (t(1, 8, 8192, 128),) * 3, (t(1, 8, 8192, 128),), {"causal": True})


def test_the_tiling_rule_reads_the_what_if_buffers():
    kernel = KERNELS["ge.flash_attention"]
    base, big = load_target("ascend910b"), load_target("ascend910b[ub_bytes=x2]")
    on_base, on_big = kernel.choose(BIG_ATTENTION, base), kernel.choose(BIG_ATTENTION, big)
    assert not isinstance(on_base, Miss) and not isinstance(on_big, Miss)
    base_budget, big_budget = kernel.budget(on_base, BIG_ATTENTION, base), kernel.budget(on_big, BIG_ATTENTION, big)
    # on the bigger UB the rule's tile fits, within twice the 910B's UB, and is no smaller than on the 910B
    assert big_budget.overflow(big) is None
    assert big_budget.ub <= 2 * 192 * KIB
    assert big_budget.ub >= base_budget.ub
    # a chip with half the UB the 910B's tile asks for: that tile does not fit it (its real capacity says
    # so), and the rule picks a smaller one that does
    cap = base_budget.ub // 2 // 32 * 32
    small = load_target(f"ascend910b[ub_bytes={cap}]")
    assert small.buffer_bytes("ub") == cap
    assert base_budget.overflow(small) == ("UB", base_budget.ub, cap)
    on_small = kernel.choose(BIG_ATTENTION, small)
    assert not isinstance(on_small, Miss) and on_small != on_base
    assert kernel.budget(on_small, BIG_ATTENTION, small).overflow(small) is None


def test_the_tile_pass_takes_a_what_if_chip_as_its_target_option():
    ty = "tensor<1x8x2048x128xf16>"
    text = f"""ge.graph @main(%q: {ty}, %k: {ty}, %v: {ty}) -> {ty} {{
  %o = ge.flash_attention %q, %k, %v {{causal = true}} : {ty}
  ge.return %o
}}"""
    kernel = KERNELS["ge.flash_attention"]
    for spec in ("ascend910b[ub_bytes=x2,l1_bytes=x2]", "ascend910b[ub_bytes=x0.25]"):
        module = parse(text)
        passes = complete_pipeline(parse_pipeline(f"tile{{target={spec}}}"))
        assert PassManager(passes).run(module, PassContext())
        op = module.graphs[0].ops[0]
        tiling = kernel.decode(op.attributes["tiling"])
        chip = load_target(spec)
        assert kernel.budget(tiling, OpSignature.of(op), chip).overflow(chip) is None
        assert tiling == kernel.choose(OpSignature.of(op), chip)  # the pass chose for the what-if chip


def test_every_friendly_key_names_a_quantity_of_the_bundled_targets():
    for name in ("ascend910b", "ascend910a", "ascend310p"):
        data = load_target(name).data
        for key, q in OVERRIDE_KEYS.items():
            if q.dimension == "flag":  # a yes/no of the data file (absent: no), set to what it is
                same = int(bool(data[q.table].get(q.key, False)))
                chip = load_target(f"{name}[{key}={same}]")
                assert bool(chip.data[q.table][q.key]) == bool(same)
                assert {k: v for k, v in chip.data[q.table].items() if k != q.key} == \
                    {k: v for k, v in data[q.table].items() if k != q.key}
                continue
            assert isinstance(data[q.table][q.key], (int, float)), (name, key)
            chip = load_target(f"{name}[{key}=x1]")  # the same numbers under a what-if name
            assert chip.data[q.table] == data[q.table]


def test_the_tools_take_a_what_if_chip_as_target(tmp_path, capsys):
    src = tmp_path / "g.geir"
    src.write_text("""ge.graph @main(%a: tensor<64x64xf16>, %b: tensor<64x64xf16>) -> tensor<64x64xf16> {
  %c = ge.matmul %a, %b
  ge.return %c
}
""")
    assert gerun_main([str(src), "--target", "ascend910b[ub_bytes=x2,cube_cores=12]", "--timing-only"]) == 0
    capsys.readouterr()
    assert gerun_main([str(src), "--target", "ascend910b[ub_bytz=x2]", "--timing-only"]) == 2  # a usage error
    assert "did you mean 'ub_bytes'" in capsys.readouterr().err
