"""msprof's op_summary table (`geir.runtime.op_summary`, `gerun --op-summary`) against independent oracles:
msprof's documented Atlas A2 PipeUtilization header, the kernels' own statistics (KernelStats), the
profile's per-kernel figures, a matmul whose cube cycles are counted by hand from its tiling, and
gerun's command line (the file written, refusals with exit 2)."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np
import pytest

from geir.parser import parse, parse_file
from geir.runtime.interpreter import Runtime
from geir.runtime.op_summary import OP_SUMMARY_COLUMNS, op_summary_rows, op_summary_rows_of_runs, render_csv
from geir.runtime.profile import kernel_profile
from geir.session import DEFAULT_PIPELINE, NO_FUSE_PIPELINE, compile_module
from geir.target_npu import load_target
from geir.tools.gerun import main as gerun_main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
ATTENTION = EXAMPLES / "attention.geir"

# msprof's op_summary columns for Atlas A2 with --aic-metrics=PipeUtilization, in msprof's order, written
# out from msprof's documentation (op_summary and PipeUtilization pages) and its exported files
DOCUMENTED_HEADER = [
    "Device_id", "Model ID", "Task ID", "Stream ID", "Op Name", "OP Type", "OP State", "Task Type",
    "Task Start Time(us)", "Task Duration(us)", "Task Wait Time(us)", "Block Dim", "Mix Block Dim", "HF32 Eligible",
    "Input Shapes", "Input Data Types", "Input Formats", "Output Shapes", "Output Data Types", "Output Formats",
    "Context ID", "aicore_time(us)", "aic_total_cycles", "aic_mac_time(us)", "aic_mac_ratio", "aic_scalar_time(us)",
    "aic_scalar_ratio", "aic_mte1_time(us)", "aic_mte1_ratio", "aic_mte2_time(us)", "aic_mte2_ratio",
    "aic_fixpipe_time(us)", "aic_fixpipe_ratio", "aic_icache_miss_rate", "aiv_time(us)", "aiv_total_cycles",
    "aiv_vec_time(us)", "aiv_vec_ratio", "aiv_scalar_time(us)", "aiv_scalar_ratio", "aiv_mte2_time(us)",
    "aiv_mte2_ratio", "aiv_mte3_time(us)", "aiv_mte3_ratio", "aiv_icache_miss_rate", "cube_utilization(%)",
]
# what the simulation does not have: written N/A in every row
NOT_SIMULATED = ["Model ID", "OP State", "Context ID", "aic_scalar_time(us)", "aic_scalar_ratio",
                 "aic_icache_miss_rate", "aiv_scalar_time(us)", "aiv_scalar_ratio", "aiv_icache_miss_rate"]
RATIOS = [c for c in DOCUMENTED_HEADER if c.endswith("_ratio") and c not in NOT_SIMULATED]
ROUNDING = 5e-4 + 1e-9  # the CSV writes us and ratios to 3 decimals, as msprof does

# edge blocks in every dimension (200 = 128 + 72, 300 = 2 x 128 + 44, 500 = 7 x 64 + 52): fractals round up
MATMUL = """ge.graph @main(%a: tensor<200x500xf16>, %b: tensor<500x300xf16>) -> tensor<200x300xf16> {
  %c = ge.matmul %a, %b
  ge.return %c
}
"""

PROGRAMS = [
    ("attention.geir", DEFAULT_PIPELINE, "ascend910b"), ("attention.geir", NO_FUSE_PIPELINE, "ascend910b"),
    ("gpt2_block.geir", DEFAULT_PIPELINE, "ascend910b"), ("gpt2_block.geir", NO_FUSE_PIPELINE, "ascend910b"),
    ("attention/causal.geir", DEFAULT_PIPELINE, "ascend910b"), ("gpt2_block.geir", DEFAULT_PIPELINE, "ascend910a"),
]


def _run(source: str, pipeline: str, target: str = "ascend910b"):
    """A timing-only run of a compiled example (the simulated figures are the full run's)."""
    module = parse(source, "m.geir") if source.startswith("ge.graph") else parse_file(str(EXAMPLES / source))
    program = compile_module(module, pipeline, target)[0].graphs[0]
    return Runtime(load_target(target), timing_only=True).run(program, {}, {})


def _table(text: str) -> tuple[list[str], list[dict[str, str]]]:
    header = next(csv.reader(io.StringIO(text)))
    return header, list(csv.DictReader(io.StringIO(text)))


def _device_kernels(result) -> list:
    """The launches that ran on cores (a view keeps none busy and is no device task)."""
    return [k for k in result.kernels if k.cores > 0]


# --- the table's shape -------------------------------------------------------------------------------------

def test_header_is_msprofs_documented_list():
    assert list(OP_SUMMARY_COLUMNS) == DOCUMENTED_HEADER
    header, rows = _table(render_csv(op_summary_rows(_run("attention.geir", DEFAULT_PIPELINE))))
    assert header == DOCUMENTED_HEADER and rows


@pytest.mark.parametrize("source, pipeline, target", PROGRAMS,
                         ids=[f"{s}-{'nofuse' if p == NO_FUSE_PIPELINE else 'fuse'}-{t}" for s, p, t in PROGRAMS])
def test_one_row_per_kernel_task_in_launch_order(source, pipeline, target):
    result = _run(source, pipeline, target)
    _, rows = _table(render_csv(op_summary_rows(result)))
    kernels = _device_kernels(result)
    assert [r["OP Type"] for r in rows] == [k.name for k in kernels]
    assert not any(r["Op Name"] in ("copy out",) or r["Op Name"].startswith("copy %") for r in rows)
    for r in rows:
        for column in NOT_SIMULATED:
            assert r[column] == "N/A", column
        assert r["HF32 Eligible"] == "NO" and r["Device_id"] == "0"
    # (stream, task id) names a task once, as on a real device
    assert len({(r["Stream ID"], r["Task ID"]) for r in rows}) == len(rows)


@pytest.mark.parametrize("source, pipeline, target", PROGRAMS,
                         ids=[f"{s}-{'nofuse' if p == NO_FUSE_PIPELINE else 'fuse'}-{t}" for s, p, t in PROGRAMS])
def test_times_come_from_the_kernels_statistics(source, pipeline, target):
    result = _run(source, pipeline, target)
    clock = load_target(target).clock_hz
    _, rows = _table(render_csv(op_summary_rows(result)))
    kernel_tasks = [t for t, k in zip([t for t in result.tasks if t.kind == "kernel"], result.kernels) if k.cores]
    previous_end = None
    for r, k, task in zip(rows, _device_kernels(result), kernel_tasks):
        duration = k.cycles / clock * 1e6
        assert float(r["Task Duration(us)"]) == pytest.approx(duration, abs=ROUNDING)
        assert float(r["Task Start Time(us)"]) == pytest.approx(task.start_us, abs=ROUNDING)
        start, wait = float(r["Task Start Time(us)"]), float(r["Task Wait Time(us)"])
        assert wait >= 0
        if previous_end is None:
            assert wait == 0  # msprof: the first task has no task before it
        else:
            assert start >= previous_end - 3 * ROUNDING  # kernels run one at a time
            assert wait == pytest.approx(max(start - previous_end, 0.0), abs=3 * ROUNDING)
        previous_end = start + float(r["Task Duration(us)"])
    starts = [float(r["Task Start Time(us)"]) for r in rows]
    assert starts == sorted(starts)


def test_rows_wait_exactly_from_the_previous_kernels_end():
    rows = op_summary_rows(_run("gpt2_block.geir", NO_FUSE_PIPELINE))
    assert rows[0].task_wait_us == 0
    for before, row in zip(rows, rows[1:]):
        assert row.task_start_us >= before.task_start_us
        assert row.task_wait_us == max(row.task_start_us - (before.task_start_us + before.task_duration_us), 0.0)


# --- cores and ratios --------------------------------------------------------------------------------------

@pytest.mark.parametrize("source, pipeline, target", PROGRAMS,
                         ids=[f"{s}-{'nofuse' if p == NO_FUSE_PIPELINE else 'fuse'}-{t}" for s, p, t in PROGRAMS])
def test_ratios_agree_with_the_profile_and_block_dim_with_the_cores(source, pipeline, target):
    result = _run(source, pipeline, target)
    chip = load_target(target)
    per_cube = chip.data["cores"]["vector_per_cube"]
    rows = op_summary_rows(result)
    _, cells = _table(render_csv(rows))
    for row, cell, k in zip(rows, cells, _device_kernels(result)):
        p = kernel_profile(k, chip)
        for column in RATIOS:
            assert 0.0 <= float(cell[column]) <= 1.0, column
        cube = k.busy["CUBE"] > 0 or k.busy["MTE1"] > 0 or k.busy["FIXP"] > 0
        vector = k.busy["VECTOR"] > 0 or k.busy["MTE3"] > 0
        # the pipes' ratios, each on the kind of core that has the pipe
        assert row.aic_mac_ratio == pytest.approx(p["cube_ratio"])
        assert row.aic_fixpipe_ratio == pytest.approx(p["fixp_ratio"])
        assert row.aic_mte1_ratio == pytest.approx(k.busy["MTE1"] / (k.cycles * k.cores))
        assert row.aiv_vec_ratio == pytest.approx(p["vec_ratio"])
        assert row.aiv_mte3_ratio == pytest.approx(p["mte3_ratio"])
        # one MTE2 per core group: the cube core's when the kernel feeds the cube, else the vector cores'; a kernel
        # whose vector cores load on their own (the CV-split FlashAttention) has both
        if k.busy.get("AIV_MTE2", 0.0) > 0:
            assert (row.aic_mte2_ratio, row.aiv_mte2_ratio) == pytest.approx(
                (p["mte2_ratio"], p["aiv_mte2_ratio"]))
        else:
            assert (row.aic_mte2_ratio, row.aiv_mte2_ratio) == pytest.approx(
                (p["mte2_ratio"], 0.0) if cube else (0.0, p["mte2_ratio"]))
        assert float(cell["aic_mac_ratio"]) == pytest.approx(p["cube_ratio"], abs=ROUNDING)
        assert float(cell["aiv_vec_ratio"]) == pytest.approx(p["vec_ratio"], abs=ROUNDING)
        if per_cube == 1:  # each AI core holds both units
            assert (cell["Task Type"], int(cell["Block Dim"]), int(cell["Mix Block Dim"])) == ("AI_CORE", k.cores, 0)
        elif cube and vector:
            assert (cell["Task Type"], int(cell["Block Dim"]), int(cell["Mix Block Dim"])) == \
                ("MIX_AIC", k.cores, k.cores * per_cube)
        elif cube:
            assert (cell["Task Type"], int(cell["Block Dim"]), int(cell["Mix Block Dim"])) == ("AI_CORE", k.cores, 0)
        else:  # the vector cores: two to each lane of the simulated chip
            assert (cell["Task Type"], int(cell["Block Dim"]), int(cell["Mix Block Dim"])) == \
                ("AI_VECTOR_CORE", k.cores * per_cube, 0)
        aic = k.cores if (cube or per_cube == 1) else 0
        assert int(cell["aic_total_cycles"]) == round(k.cycles * aic)
        assert row.cube_utilization_pct == pytest.approx(100 * aic / chip.cube_cores if k.busy["CUBE"] else 0.0)


def test_fused_attention_is_a_mix_task_on_the_910b():
    rows = op_summary_rows(_run("attention.geir", DEFAULT_PIPELINE))
    (fa,) = [r for r in rows if r.op_type == "ge.flash_attention"]
    assert fa.task_type == "MIX_AIC" and fa.mix_block_dim == 2 * fa.block_dim > 0
    assert fa.aic_mac_ratio > 0 and fa.aiv_vec_ratio > 0 and fa.aic_mte1_ratio > 0


def test_a_matmul_keeps_the_cube_busy_for_its_fractal_count():
    # the oracle: the cube's cycles counted from the tiling, one 16 x 16 x 16 fractal a cycle (f16),
    # every output block x every k step; cores used: one unit per cube core while units last
    result = _run(MATMUL, DEFAULT_PIPELINE)
    (k,) = _device_kernels(result)
    t = k.tiling
    M, K, N = 200, 500, 300
    fm, fk, fn = load_target("ascend910b").data["cube"]["f16"]
    cycles = 0
    for m0 in range(0, M, t.base_m):
        for n0 in range(0, N, t.base_n):
            for k0 in range(0, K, t.base_k):
                mm, kk, nn = min(t.base_m, M - m0), min(t.base_k, K - k0), min(t.base_n, N - n0)
                cycles += math.ceil(mm / fm) * math.ceil(kk / fk) * math.ceil(nn / fn)
    units = math.ceil(M / t.base_m) * math.ceil(N / t.base_n)
    cores = min(units, 24)
    (row,) = op_summary_rows(result)
    assert (row.task_type, row.block_dim, row.mix_block_dim) == ("AI_CORE", cores, 0)
    expected = cycles / (k.cycles * cores)
    assert 0 < expected < 1
    assert row.aic_mac_ratio == pytest.approx(expected, rel=1e-12)
    assert row.aic_mac_time_us == pytest.approx(cycles / cores / 1.85e9 * 1e6, rel=1e-12)
    (cell,) = _table(render_csv([row]))[1]
    assert cell["aic_mac_ratio"] == f"{expected:.3f}"
    assert float(cell["cube_utilization(%)"]) == pytest.approx(100 * cores / 24, abs=ROUNDING)
    assert cell["aiv_vec_ratio"] == "0.000" and cell["aiv_total_cycles"] == "0"


# --- several runs ------------------------------------------------------------------------------------------

def test_several_runs_follow_one_another_on_one_timeline():
    first, second = _run("attention.geir", NO_FUSE_PIPELINE), _run("attention.geir", DEFAULT_PIPELINE)
    rows = op_summary_rows_of_runs([first, second])
    one, two = op_summary_rows(first), op_summary_rows(second)
    assert [r.op_name for r in rows] == [r.op_name for r in one + two]
    span = max(t.end_us for t in first.tasks)
    later = rows[len(one):]
    assert [r.task_start_us for r in later] == pytest.approx([span + r.task_start_us for r in two])
    assert later[0].task_wait_us == pytest.approx(
        later[0].task_start_us - (one[-1].task_start_us + one[-1].task_duration_us))
    starts = [r.task_start_us for r in rows]
    assert starts == sorted(starts)
    assert len({(r.stream_id, r.task_id) for r in rows}) == len(rows)  # task ids keep counting per stream


# --- gerun --op-summary ------------------------------------------------------------------------------------

def gerun(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = gerun_main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def test_gerun_writes_the_table(tmp_path, capsys):
    out = tmp_path / "op_summary.csv"
    rc, _, err = gerun([ATTENTION, "--no-fuse", "--op-summary", out], capsys)
    assert rc == 0, err
    header, rows = _table(out.read_text())
    assert header == DOCUMENTED_HEADER
    assert [r["OP Type"] for r in rows] == ["ge.transpose", "ge.matmul", "ge.mul", "ge.softmax", "ge.matmul"]


def test_gerun_with_several_inputs_writes_one_table(tmp_path, capsys):
    rng = np.random.default_rng(0)
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **{n: rng.standard_normal((1, 8, 128, 64)).astype(np.float32) for n in ("q", "k", "v")})
    out = tmp_path / "op_summary.csv"
    rc, _, err = gerun([ATTENTION, "--inputs", inputs, "--inputs", inputs, "--op-summary", out], capsys)
    assert rc == 0, err
    _, rows = _table(out.read_text())
    assert [r["OP Type"] for r in rows] == ["ge.flash_attention"] * 2
    assert float(rows[1]["Task Start Time(us)"]) > float(rows[0]["Task Start Time(us)"]) + \
        float(rows[0]["Task Duration(us)"])


@pytest.mark.parametrize("flags", [["--op-summary", "{geir}"],
                                   ["--op-summary", "{dir}/t.json", "--trace", "{dir}/t.json"]])
def test_gerun_refuses_an_op_summary_onto_an_input_or_another_output(tmp_path, capsys, flags):
    geir = tmp_path / "a.geir"
    geir.write_text(ATTENTION.read_text())
    rc, out, err = gerun([geir, *[f.format(geir=geir, dir=tmp_path) for f in flags]], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("gerun: error: ") and "are the same file" in err and "--op-summary" in err
    assert geir.read_text() == ATTENTION.read_text() and sorted(p.name for p in tmp_path.iterdir()) == ["a.geir"]


def test_gerun_op_summary_to_an_unwritable_path_is_an_error_and_writes_nothing(tmp_path, capsys):
    # as for every gerun output: a path that cannot be written is an error at the end (exit 1), no file
    (tmp_path / "dir.csv").mkdir()
    rc, _, err = gerun([ATTENTION, "--op-summary", tmp_path / "dir.csv", "-o", tmp_path / "o.npz"], capsys)
    assert rc == 1 and err.startswith("gerun: error: cannot write")
    rc, _, err = gerun([ATTENTION, "--op-summary", tmp_path / "no" / "such" / "dir.csv"], capsys)
    assert rc == 1 and err.startswith("gerun: error: cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.csv"]


def test_gerun_overlap_compile_lists_every_parts_kernels(tmp_path, capsys):
    out = tmp_path / "op_summary.csv"
    rc, _, err = gerun([EXAMPLES / "gpt2_block.geir", "--overlap-compile", "3", "--op-summary", out], capsys)
    assert rc == 0, err
    _, rows = _table(out.read_text())
    starts = [float(r["Task Start Time(us)"]) for r in rows]
    assert len(rows) > 3 and starts == sorted(starts)
    assert all(float(r["Task Wait Time(us)"]) >= 0 for r in rows)


def test_rows_name_the_node_and_its_tensors_as_msprof_does():
    # oracle: the program's own launch, its operand and result types, in msprof's spelling
    program = compile_module(parse(MATMUL, "mm.geir"), DEFAULT_PIPELINE, "ascend910b")[0].graphs[0]
    launch = next(op for op in program.ops if op.name == "rt.launch")
    rng = np.random.default_rng(0)
    inputs = {a.name: rng.standard_normal(a.type.shape).astype(a.type.dtype.np) for a in program.args}
    (row,) = op_summary_rows(Runtime(load_target("ascend910b")).run(program, inputs))
    assert row.op_name == launch.results[0].name == "c" and row.op_type == "ge.matmul"
    assert row.input_shapes == "200,500;500,300" and row.output_shapes == "200,300"
    assert row.input_dtypes == "FLOAT16;FLOAT16" and row.output_dtypes == "FLOAT16"
    formats = {"ND": "ND", "NZ": "FRACTAL_NZ"}
    assert row.input_formats == ";".join(formats[v.type.format] for v in launch.operands)
