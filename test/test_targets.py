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
