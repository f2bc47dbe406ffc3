"""Target data files: every bundled target loads; a user's file that is not a target is refused naming
the key (or the TOML position), and the tools say so with exit 2."""

from __future__ import annotations

import pytest

from geir.target_npu.target import TARGET_DIR, TargetError, available_targets, load_target
from geir.tools.gerun import main as gerun_main

GRAPH = """ge.graph @main(%x: tensor<64x256xf32>) -> tensor<64x256xf32> {
  %c = ge.const dense<1.5> : tensor<f32>
  %a = ge.mul %x, %c
  ge.return %a
}
"""


def _variant(tmp_path, name: str, old: str, new: str):
    text = (TARGET_DIR / "ascend910b.toml").read_text()
    assert old in text
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace('name = "ascend910b"', f'name = "{name}"').replace(old, new))
    return str(path)


@pytest.mark.parametrize("name", available_targets())
def test_bundled_targets_load(name):
    t = load_target(name)
    assert t.cube_cores > 0 and t.clock_hz > 0 and t.buffer_bytes("ub") > 0


@pytest.mark.parametrize("old, new, message", [
    ("cube = 24", "cube = 0", r"\[cores\] cube must be positive, not 0"),
    ("clock_ghz = 1.85", "clock_ghz = -1.0", r"\[cores\] clock_ghz must be positive, not -1.0"),
    ("ub = 192\n", "", r"\[buffers_kib\] has no ub"),
    ("hbm_tb_per_s = 1.6", 'hbm_tb_per_s = "fast"', r"\[memory\] hbm_tb_per_s must be a number, not 'fast'"),
    ("f32 = [16, 8, 16]", "f32 = [16, 0]", r"\[cube\] f32 must be three positive integers"),
    ("pcie_gb_per_s = 32", "pcie_gb_per_s = 0", r"\[host\] pcie_gb_per_s must be positive"),
    # once a TypeError, a MemoryError, an OverflowError, or NaN in every figure
    ("cube = 24", "cube = 2.5", r"\[cores\] cube must be a whole number, not 2.5$"),
    ("cores = 6", "cores = 2.5", r"\[aicpu\] cores must be a whole number, not 2.5$"),
    ("cube = 24", "cube = 1000000000000", r"\[cores\] cube must be at most 4096, not 1000000000000 \(the simulator "
                                          r"keeps a timeline per core; the largest Ascend has 32 AI cores\)$"),
    ("vector = 48", "vector = 4097", r"\[cores\] vector must be at most 4096, not 4097"),
    ("clock_ghz = 1.85", "clock_ghz = nan", r"\[cores\] clock_ghz must be a finite number, not nan$"),
    ("clock_ghz = 1.85", "clock_ghz = inf", r"\[cores\] clock_ghz must be a finite number, not inf$"),
    ("dma_latency_cycles = 64", "dma_latency_cycles = 100000000000000000000",
     r"\[memory\] dma_latency_cycles must be at most 1000000000, not 1e\+20 \(longer than any run GEIR simulates\)$"),
    ("copy_latency_us = 10", "copy_latency_us = 1e308", r"\[host\] copy_latency_us must be at most 1000000000, "
                                                        r"not 1e\+308"),
    ("ub = 192", "ub = 1e15", r"\[buffers_kib\] ub must be at most 1073741824, not 1000000000000000 \(1 TiB, more "
                              r"than any tensor a tile could hold\)$"),
    ("flash_attention_decode_max_q = 64", "flash_attention_decode_max_q = nan",
     r"\[fusion\] flash_attention_decode_max_q must be a finite number, not nan$"),
    ("flash_attention_decode_max_busy = 0.5", "flash_attention_decode_max_busy = 2",
     r"\[fusion\] flash_attention_decode_max_busy must be at most 1, not 2 \(a share of the cores\)$"),
    ("f16 = [16, 16, 16]", "f16 = [100000, 16, 16]", r"\[cube\] f16 must be three positive integers \[m, k, n\] of "
                                                     r"at most 1024, not \[100000, 16, 16\]$"),
])
def test_a_bad_quantity_is_named(tmp_path, old, new, message):
    path = _variant(tmp_path, "bad", old, new)
    with pytest.raises(TargetError, match=message):
        load_target(path)


def test_invalid_toml_says_where(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('name = "x"\n[cores\n')
    with pytest.raises(TargetError, match=r"not a valid target file: .*line 2, column 7"):
        load_target(str(path))


def test_an_unknown_name_suggests_the_nearest():
    with pytest.raises(TargetError, match=r"unknown target 'ascend910c'; did you mean 'ascend910b'"):
        load_target("ascend910c")


def test_gerun_refuses_a_bad_target_file_with_exit_2(tmp_path, capsys):
    src = tmp_path / "g.geir"
    src.write_text(GRAPH)
    path = _variant(tmp_path, "zero", "cube = 24", "cube = 0")
    assert gerun_main([str(src), "--target", path]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"gerun: error: {path}: [cores] cube must be positive, not 0"


def test_a_nan_clock_is_a_usage_error_not_nan_figures(tmp_path, capsys):
    src = tmp_path / "g.geir"
    src.write_text(GRAPH)
    path = _variant(tmp_path, "nan", "clock_ghz = 1.85", "clock_ghz = nan")
    assert gerun_main([str(src), "--target", path, "--profile"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"gerun: error: {path}: [cores] clock_ghz must be a finite number, not nan\n"


# --- the typed Target: its records are the file's numbers, and the chip travels as a Target --------------------

@pytest.mark.parametrize("name", available_targets())
def test_the_target_records_are_the_data_file_s_numbers(name):
    import tomllib

    raw = tomllib.loads((TARGET_DIR / f"{name}.toml").read_text())  # the oracle: the file itself
    t = load_target(name)
    mem = raw["memory"]
    assert t.memory.l2_bytes == mem["l2_mib"] * 2**20
    assert t.memory.l2_read_bytes_per_cycle == mem["gm_read_bytes_per_cycle_l2"]
    assert t.memory.hbm_read_bytes_per_cycle == mem["gm_read_bytes_per_cycle_hbm"]
    assert t.memory.hbm_bytes_per_s == mem["hbm_tb_per_s"] * 1e12
    assert t.memory.ub_block_bytes == mem["ub_block_bytes"]
    assert t.host.launch_latency_us == raw.get("host", {}).get("launch_latency_us", 0.0)
    assert (t.aicpu is None) == ("aicpu" not in raw) and t.has_aicpu == ("aicpu" in raw)
    if t.aicpu is not None:
        assert (t.aicpu.cores, t.aicpu.task_overhead_us) == (raw["aicpu"]["cores"], raw["aicpu"]["task_overhead_us"])
    assert t.fusion.decode_max_q == raw.get("fusion", {}).get("flash_attention_decode_max_q")
    assert t.vector_per_cube == raw["cores"].get("vector_per_cube", 1)
    for mode, fractal in raw["cube"].items():
        assert t.cube_fractal(mode) == tuple(fractal)
    assert t.cube_fractal("i4") is None


def test_a_what_if_chip_s_records_follow_its_overrides():
    t = load_target("ascend910b[dma_latency_cycles=128,pcie_gb_per_s=64]")
    base = load_target("ascend910b")
    assert (t.memory.dma_latency_cycles, t.host.pcie_gb_per_s) == (128, 64)
    assert t.memory.ub_block_bytes == base.memory.ub_block_bytes
    assert t != base and hash(t) != hash(base) and load_target("ascend910b") == base  # a target is its name


def test_the_pass_context_holds_a_target_even_when_given_a_name():
    from geir.passes import PassContext
    from geir.target_npu.target import Target

    assert isinstance(PassContext().target, Target)
    assert PassContext(target="ascend910a").target is load_target("ascend910a")


def test_no_code_outside_the_target_package_reads_a_number_from_the_raw_tables():
    # every number is a typed field of the Target (target_npu/target.py); the raw tables stay for the what-if
    # overrides and for comparing or fingerprinting a chip as a whole
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    reads = re.compile(r"\.data(\[|\.get\()")
    found = []
    for layer in ("geir", "kernels", "runtime", "passes", "session", "frontends", "tools", "bench"):
        for path in (root / layer).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if reads.search(line) and re.search(r"(target|chip)\.data", line):
                    found.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
