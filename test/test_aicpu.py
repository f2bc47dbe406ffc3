"""GE's engine placement and the AI CPU engine (issue 14, item 3).

Ops the AI Core cannot take (f64 anywhere, an integer matmul the cube has no mode for, an op with no
AI Core kernel) run on the simulated AI CPU with the op's numpy semantics. The oracles are independent
of the code under test: numpy itself for the numbers, the target file's [aicpu] numbers put through the
cost formula its comments state (with GE's block split as CANN's GE source writes it) for the time,
the tasks' own producers for the order.
"""

from __future__ import annotations

import csv
import json
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest

from geir.ir import Operation
from geir.opdef import OPS, op
from geir.parser import parse
from geir.runtime.interpreter import Runtime
from geir.session import DEFAULT_PIPELINE, compile_module
from geir.target_npu import load_target
from geir.tools import gedoctor, geopt, gerun
from geir.types import TensorType

TARGETS = Path(__file__).resolve().parent.parent / "target_npu" / "targets"

F64 = """ge.graph @main(%a: tensor<4xf64>, %b: tensor<4xf64>) -> (tensor<4xf64>, tensor<4xf64>) {
  %c = ge.add %a, %b
  %d = ge.div %c, %b
  %e = ge.exp %d
  ge.return %c, %e
}
"""

MIXED = """ge.graph @main(%a: tensor<64x128xf16>, %b: tensor<128x64xf16>) -> tensor<64x64xf16> {
  %m = ge.matmul %a, %b
  %w = ge.cast %m {to = f64}
  %e = ge.tanh %w
  %n = ge.cast %e {to = f16}
  %r = ge.add %n, %m
  ge.return %r
}
"""

# an f64 op big enough to dominate a small AI Core matmul
SLOW = """ge.graph @main(%a: tensor<256x256xf16>, %b: tensor<256x256xf16>) -> tensor<256x256xf16> {
  %m = ge.matmul %a, %b
  %w = ge.cast %m {to = f64}
  %e = ge.tanh %w
  %n = ge.cast %e {to = f16}
  ge.return %n
}
"""


def _write(tmp_path: Path, text: str, name: str = "g.geir") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _compile(text: str, target: str = "ascend910b"):
    return compile_module(parse(text, "t.geir"), DEFAULT_PIPELINE, target)[0].graphs[0]


# --- numbers --------------------------------------------------------------------------------------

def test_an_f64_graph_runs_via_gerun_with_numpys_exact_results(tmp_path, capsys):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(4), rng.standard_normal(4) + 3.0
    np.savez(tmp_path / "in.npz", a=a, b=b)
    rc = gerun.main([str(_write(tmp_path, F64)), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz"),
                     "--check"])
    assert rc == 0, capsys.readouterr().err
    out = np.load(tmp_path / "out.npz")
    assert out["result0"].dtype == np.float64
    np.testing.assert_array_equal(out["result0"], a + b)  # exact f64 numerics
    np.testing.assert_array_equal(out["result1"], np.exp((a + b) / b))
    assert "PASS (exact)" in capsys.readouterr().out


def test_a_mixed_graph_runs_and_orders_its_tasks_by_their_data():
    program = _compile(MIXED)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 128)).astype(np.float16)
    b = rng.standard_normal((128, 64)).astype(np.float16)
    result = Runtime(load_target("ascend910b")).run(program, {"a": a, "b": b})
    kernels = [t for t in result.tasks if t.kind == "kernel"]
    assert [(t.name, t.engine) for t in kernels] == [
        ("ge.matmul", "aicore"), ("ge.cast", "aicpu"), ("ge.tanh", "aicpu"), ("ge.cast", "aicpu"), ("ge.add", "aicore")]
    # each kernel starts only once every producer of its operands has ended (the launch's operands name them)
    end_of = {t.label: t.end_us for t in result.tasks if t.kind == "kernel"}
    launches = {l.results[0].name: l for l in program.ops if l.name == "rt.launch"}
    for t in kernels:
        for v in launches[t.label].operands:
            if v.name in end_of:
                assert t.start_us >= end_of[v.name] - 1e-9, (t.label, v.name)
    # numpy's answer: an f32-accumulated matmul rounded to f16, tanh in f64, back to f16, plus the matmul
    m = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    want = (np.tanh(m.astype(np.float64)).astype(np.float16).astype(np.float32) + m.astype(np.float32)).astype(np.float16)
    np.testing.assert_allclose(result.outputs[0].astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)


# --- cost -----------------------------------------------------------------------------------------

def _ge_block_dim(total: int, cores: int) -> tuple[int, int]:
    """GE's AicpuNodeTaskBase::UpdateBlockDimInfo, line for line: (block_num, block_size)."""
    per_unit = total // min(max(1, cores), total)
    block_size = max(1, min(total, per_unit))
    shard_num = min(2 * cores, math.ceil(total / block_size))
    block_size = math.ceil(total / shard_num)
    return math.ceil(total / block_size), block_size


@pytest.mark.parametrize("target", ["ascend910b", "ascend910a", "ascend310p"])
@pytest.mark.parametrize("n", [4, 1000, 4096])
def test_the_ai_cpu_time_is_the_target_files_formula(target, n):
    spec = tomllib.loads((TARGETS / f"{target}.toml").read_text())["aicpu"]
    program = _compile(f"""ge.graph @main(%a: tensor<{n}xf64>, %b: tensor<{n}xf64>) -> tensor<{n}xf64> {{
  %c = ge.add %a, %b
  ge.return %c
}}
""", target)
    result = Runtime(load_target(target), timing_only=True).run(program, {})
    (task,) = [t for t in result.tasks if t.kind == "kernel"]
    blocks, block = _ge_block_dim(n, spec["cores"])
    waves = math.ceil(blocks / spec["cores"])
    # one add per element; two 8-byte operands in, one 8-byte result out
    per_element = 1 * spec["cycles_per_op"] + 24 / spec["bytes_per_cycle"]
    want = spec["task_overhead_us"] + waves * block * per_element / (spec["clock_ghz"] * 1e3)
    assert task.engine == "aicpu"
    assert task.end_us - task.start_us == pytest.approx(want, rel=1e-9)
    assert result.kernels[0].cores == min(blocks, spec["cores"])


# --- where a user looks ---------------------------------------------------------------------------

def test_profile_trace_and_op_summary_show_the_engine(tmp_path, capsys):
    path = _write(tmp_path, MIXED)
    prof, trace, summary = tmp_path / "p.json", tmp_path / "t.json", tmp_path / "s.csv"
    assert gerun.main([str(path), "--seed", "1", "--profile-json", str(prof), "--trace", str(trace),
                       "--op-summary", str(summary), "--profile"]) == 0
    out = capsys.readouterr().out
    entries = json.loads(prof.read_text())["kernels"]
    assert [(k["name"], k["engine"]) for k in entries] == [
        ("ge.matmul", "aicore"), ("ge.cast", "aicpu"), ("ge.tanh", "aicpu"), ("ge.cast", "aicpu"), ("ge.add", "aicore")]
    assert all(k["mte2_ratio"] == 0 and k["tiling"] == {} for k in entries if k["engine"] == "aicpu")
    assert "engine" in out and out.count(" aicpu") >= 3
    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    (pid,) = [p for p, name in processes.items() if name == "AI CPU"]
    on_track = sorted((e["name"], e["ts"]) for e in events if e["ph"] == "X" and e["pid"] == pid)
    device = sorted((e["name"], e["ts"]) for e in events if e["ph"] == "X" and e["pid"] == 1 and e["cat"] == "kernel"
                    and e["name"] in ("ge.cast", "ge.tanh"))
    assert [n for n, _ in on_track] == ["ge.cast", "ge.cast", "ge.tanh"] and on_track == device
    rows = list(csv.DictReader(summary.open()))
    assert [(r["OP Type"], r["Task Type"]) for r in rows] == [
        ("ge.matmul", "AI_CORE"), ("ge.cast", "AI_CPU"), ("ge.tanh", "AI_CPU"), ("ge.cast", "AI_CPU"),
        ("ge.add", "AI_VECTOR_CORE")]
    for r, k in zip(rows, entries):
        assert float(r["Task Duration(us)"]) == pytest.approx(k["time_us"], abs=1e-3)
        if r["Task Type"] == "AI_CPU":
            assert float(r["aicore_time(us)"]) == 0 and r["Input Data Types"] in ("FLOAT16", "DOUBLE")


def test_gedoctor_names_the_ai_cpu_op_that_costs_most(tmp_path, capsys):
    path = _write(tmp_path, SLOW)
    prof = tmp_path / "p.json"
    assert gerun.main([str(path), "--seed", "0", "--profile-json", str(prof)]) == 0
    tanh_us = next(k["time_us"] for k in json.loads(prof.read_text())["kernels"] if k["name"] == "ge.tanh")
    capsys.readouterr()
    assert gedoctor.main([str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["culprit"] == "kernel"
    (deciding,) = [f for f in d["findings"] if f["deciding"]]
    assert deciding["kind"] == "aicpu_op" and deciding["evidence"]["kernel"] == "ge.tanh"
    assert deciding["evidence"]["time_us"] == pytest.approx(tanh_us)
    assert "ge.tanh (%e) runs on the AI CPU" in deciding["message"] and "no f64 unit" in deciding["message"]
    assert deciding["location"].endswith("g.geir:4:3")


# --- ops without an AI Core kernel ----------------------------------------------------------------

@pytest.fixture
def kernelless_ops():
    """Two ops with no AI Core kernel, registered for one test: one with numpy semantics, one without."""

    @op("ge.test_cumsum")
    class CumSum(Operation):
        """A running sum along the last axis (numpy's cumsum): no AI Core kernel implements it."""

        OPERAND_NAMES = ("x",)

        def infer(self, x: TensorType) -> TensorType:
            return x

        def compute(self, x: np.ndarray) -> np.ndarray:
            return np.cumsum(x, axis=-1, dtype=x.dtype)

    @op("ge.test_opaque")
    class Opaque(Operation):
        """An op with a shape rule and nothing else: no kernel, no semantics."""

        OPERAND_NAMES = ("x",)

        def infer(self, x: TensorType) -> TensorType:
            return x

    yield
    del OPS["ge.test_cumsum"], OPS["ge.test_opaque"]


def test_an_op_without_an_ai_core_kernel_runs_on_the_ai_cpu(kernelless_ops, tmp_path, capsys):
    path = _write(tmp_path, """ge.graph @main(%x: tensor<3x5xf32>) -> tensor<3x5xf32> {
  %s = ge.test_cumsum %x
  ge.return %s
}
""")
    assert geopt.main([str(path), "--passes=tile", "--explain"]) == 0
    err = capsys.readouterr().err
    assert "g.geir:2:3: remark: place: ge.test_cumsum (%s) on the AI CPU: no AI Core kernel implements ge.test_cumsum" in err
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    np.savez(tmp_path / "in.npz", x=x)
    assert gerun.main([str(path), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "o.npz")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "o.npz")["result0"], np.cumsum(x, axis=-1))


def test_an_op_with_no_kernel_and_no_semantics_is_an_error_at_the_op(kernelless_ops, tmp_path, capsys):
    path = _write(tmp_path, """ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %y = ge.test_opaque %x
  ge.return %y
}
""")
    for tool in (geopt.main, gerun.main):
        argv = [str(path), "--passes=tile"] if tool is geopt.main else [str(path), "--seed", "0"]
        assert tool(argv) == 1
        err = capsys.readouterr().err
        assert (f"{path}:2:3: error: ge.test_opaque (%y) cannot run: no AI Core kernel implements ge.test_opaque, "
                f"and it has no numpy semantics for the AI CPU") in err
        assert "  %y = ge.test_opaque %x\n  ^" in err and "Traceback" not in err


def test_an_ai_cpu_launch_with_a_tiling_or_an_unknown_engine_does_not_verify(tmp_path, capsys):
    program = """rt.program @main(%a: tensor<4xf64>) -> tensor<4xf64> attributes {memory = {inputs = 512, constants = 0, arena = 512}, streams = 2} {
  %a.dev = rt.h2d %a {offset = 0, stream = 0} : tensor<4xf64>
  %c = rt.launch %a.dev {engine = "ENGINE", kernel = "ge.exp", offsets = [512], stream = 0} : tensor<4xf64>
  %0 = rt.d2h %c {stream = 0} : tensor<4xf64>
  rt.return %0
}
"""
    for engine, message in (("gpu", "rt.launch engine 'gpu' is not one of aicore, aicpu"),
                            ('aicpu", tiling = {elems = 32}, x = "', "on the AI CPU takes no tiling")):
        path = _write(tmp_path, program.replace("ENGINE", engine).replace(', x = ""', ""), "p.geir")
        assert geopt.main([str(path)]) == 1
        err = capsys.readouterr().err
        assert f"{path}:3:3: error:" in err and message in err


def test_a_stopped_ai_cpu_core_reruns_the_task_with_identical_results():
    program = _compile(F64)
    rng = np.random.default_rng(1)
    inputs = {"a": rng.standard_normal(4), "b": rng.standard_normal(4) + 3.0}
    target = load_target("ascend910b")
    clean = Runtime(target).run(program, inputs)
    hit = Runtime(target, faults=[("core", 1), ("ub_overflow", 2)]).run(program, inputs)
    for x, y in zip(clean.outputs, hit.outputs):
        np.testing.assert_array_equal(x, y)
    assert [f["kind"] for f in hit.faults] == ["core", "ub_overflow"]
    assert hit.kernels[1].cycles > clean.kernels[1].cycles
