"""gedoctor: the crafted programs each point at their layer with the evidence that decided it (fusion:
an attention spelling that cannot fuse, priced against one fused kernel; runtime: the fused kernel
with one buffer; kernel: a vector-bound FlashAttention; none: a well-tuned one), the examples give
valid JSON, the Runtime's wait bookkeeping changes nothing it times, and bad input is a diagnostic."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from geir.diagnostics import SourceManager
from geir.kernels.base import KernelStats
from geir.parser import parse
from geir.session import doctor
from geir.runtime.interpreter import Runtime
from geir.runtime.profile import cube_peak_flops
from geir.runtime.roofline import bandwidths, roofline
from geir.session import DEFAULT_PIPELINE, compile_module
from geir.target_npu.sim import PIPES
from geir.target_npu.target import load_target
from geir.tools.gedoctor import main, report


ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DOCTOR = EXAMPLES / "doctor"
SINGLE_BUFFER = "canonicalize,fuse,layout,tile{buffers=1},plan,lower"
FINDING_KEYS = {"layer", "kind", "severity", "message", "evidence", "location", "deciding"}


def gedoctor(argv, capsys):
    """(exit code, stdout, stderr) of an in-process run; argparse's exits count as return codes."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return rc, out, err


_RUNS: dict[tuple[str, ...], dict] = {}


def diagnosis(argv, capsys) -> dict:
    """The --json verdict of a run (each distinct command runs once per session), checked against the schema."""
    key = tuple(str(a) for a in argv)
    if key not in _RUNS:
        rc, out, err = gedoctor([*argv, "--json"], capsys)
        assert rc == 0, err
        _RUNS[key] = check_schema(json.loads(out))
    return _RUNS[key]


def check_schema(doc: dict) -> dict:
    """The spec's shape and the README's finding schema; exactly one deciding finding unless culprit is none."""
    assert set(doc) == {"culprit", "findings"}
    assert doc["culprit"] in doctor.CULPRITS
    for f in doc["findings"]:
        assert set(f) == FINDING_KEYS
        assert f["layer"] in doctor.LAYERS and f["severity"] in doctor.SEVERITIES
        assert isinstance(f["message"], str) and f["message"] and isinstance(f["evidence"], dict)
        assert f["location"] is None or f["location"].count(":") >= 2
    # layers come in the order the report asks about them
    order = [doctor.LAYERS.index(f["layer"]) for f in doc["findings"]]
    assert order == sorted(order)
    deciding = [f for f in doc["findings"] if f["deciding"]]
    if doc["culprit"] == "none":
        assert not deciding and not any(f["severity"] == "high" for f in doc["findings"])
    else:
        assert len(deciding) == 1 and deciding[0]["layer"] == doc["culprit"] and deciding[0]["severity"] == "high"
        earlier = doctor.LAYERS[:doctor.LAYERS.index(doc["culprit"])]
        assert not any(f["severity"] == "high" for f in doc["findings"] if f["layer"] in earlier)
    return doc


def deciding(doc: dict) -> dict:
    return next(f for f in doc["findings"] if f["deciding"])


def kinds(doc: dict, layer: str) -> list[str]:
    return [f["kind"] for f in doc["findings"] if f["layer"] == layer]


# --- the crafted programs, one per layer -----------------------------------------------------------------

def test_attention_that_cannot_fuse_points_at_fusion(capsys):
    doc = diagnosis([DOCTOR / "fusion_miss.geir"], capsys)
    assert doc["culprit"] == "fusion"
    f = deciding(doc)
    assert f["kind"] == "attention_miss"
    assert f["location"] == f"{DOCTOR / 'fusion_miss.geir'}:12:3"  # the second matmul, where the rule is rooted
    e = f["evidence"]
    assert e["reason"] == "softmax axis is 2, not the last axis"
    assert e["unfused_kernels"] == ["ge.matmul", "ge.mul", "ge.softmax", "ge.matmul"]
    assert e["q"] == e["k"] == e["v"] == "tensor<1x8x1024x64xf16>"
    # the miss is priced: the unfused kernels are all the device time here, and more than the fused kernel
    assert e["unfused_us"] == pytest.approx(e["device_us"])
    assert e["unfused_us"] > e["fused_equivalent_us"] > 0
    assert e["ratio"] == pytest.approx(e["unfused_us"] / e["fused_equivalent_us"])
    assert e["saving_share"] == pytest.approx((e["unfused_us"] - e["fused_equivalent_us"]) / e["device_us"])
    assert e["saving_share"] >= doctor.FUSION_MISS_SHARE


def test_the_fused_equivalent_is_what_the_fixed_spelling_runs(tmp_path, capsys):
    """Softmax over the last axis fuses; its kernel time is what the miss was priced against."""
    text = (DOCTOR / "fusion_miss.geir").read_text().replace("{axis = 2}", "{axis = -1}")
    fixed = tmp_path / "fixed.geir"
    fixed.write_text(text)
    fused = diagnosis([fixed], capsys)
    assert "attention_miss" not in kinds(fused, "fusion") and "fused" in kinds(fused, "fusion")
    (kernel,) = [f for f in fused["findings"] if f["layer"] == "kernel"]
    missed = deciding(diagnosis([DOCTOR / "fusion_miss.geir"], capsys))
    assert kernel["evidence"]["kernel"] == "ge.flash_attention"
    assert kernel["evidence"]["time_us"] == pytest.approx(missed["evidence"]["fused_equivalent_us"])


def test_no_fuse_says_the_pipeline_never_ran_the_rule(capsys):
    doc = diagnosis([DOCTOR / "well_tuned.geir", "--no-fuse"], capsys)
    assert doc["culprit"] == "fusion"
    e = deciding(doc)["evidence"]
    assert "no fuse pass" in e["reason"]
    assert e["unfused_kernels"] == ["ge.matmul", "ge.mul", "ge.softmax", "ge.matmul"]
    # fused, the same example is one kernel and the miss is gone
    fused = diagnosis([DOCTOR / "well_tuned.geir"], capsys)
    assert "attention_miss" not in kinds(fused, "fusion") and fused["culprit"] != "fusion"


def test_single_buffer_points_at_the_runtime(capsys, well_tuned):
    doc = diagnosis([DOCTOR / "well_tuned.geir", f"--passes={SINGLE_BUFFER}"], capsys)
    assert doc["culprit"] == "runtime"
    f = deciding(doc)
    assert f["kind"] == "double_buffering_off" and "double buffering off" in f["message"]
    e = f["evidence"]
    assert e["buffers"] == 1 and e["kernel"] == "ge.flash_attention"
    assert e["compute_wait_flag"] + e["compute_wait_slot"] >= doctor.COMPUTE_WAIT
    assert e["overlap_ratio"] < doctor.POOR_OVERLAP
    # fusion was fine, and the same program double-buffered overlaps: its compute waits far less
    assert "fused" in kinds(doc, "fusion")
    tuned = next(f for f in well_tuned.findings if f.layer == "runtime" and "kernel" in f.evidence)
    t = doctor.plain(tuned.evidence)
    assert t["buffers"] == 2 and t["overlap_ratio"] > e["overlap_ratio"]
    assert t["compute_wait_flag"] + t["compute_wait_slot"] < doctor.COMPUTE_WAIT
    assert t["time_us"] < e["time_us"]
    # the MTE2 queue of the single buffer waits for its only slot; double-buffered loads run ahead
    assert e["mte2_wait_slot"] > t["mte2_wait_slot"]


def test_lowered_single_buffer_program_gives_the_same_verdict(capsys):
    lowered = diagnosis([DOCTOR / "single_buffer.geir"], capsys)
    assert lowered["culprit"] == "runtime"
    assert kinds(lowered, "fusion") == ["not_applicable"]
    graph_route = deciding(diagnosis([DOCTOR / "well_tuned.geir", f"--passes={SINGLE_BUFFER}"], capsys))
    e = deciding(lowered)["evidence"]
    for key in ("time_us", "overlap_ratio", "compute_wait_flag", "compute_wait_slot", "buffers"):
        assert e[key] == pytest.approx(graph_route["evidence"][key]), key
    assert deciding(lowered)["location"].startswith(f"{DOCTOR / 'single_buffer.geir'}:")


def test_vector_bound_kernel_points_at_the_kernel(capsys):
    doc = diagnosis([DOCTOR / "vector_bound.geir"], capsys)
    assert doc["culprit"] == "kernel"
    e = deciding(doc)["evidence"]
    assert e["kernel"] == "ge.flash_attention" and e["roofline_fraction"] < doctor.ROOFLINE_FAR
    assert e["bound"] == "compute" and e["busiest_pipe"] == "VECTOR"
    assert e["cores"] == e["cube_cores"]
    # on the 910B's split cores the softmax's vector work and the AIC's half of the S / P exchange take turns:
    # the finding gives both sides' pipes, and each is busier than the cube
    split = e["cv_split"]
    assert split["cv_block"] == [128, 1024] and split["preload"] == 2
    r = split["pipe_ratios"]
    assert r["VECTOR"] > r["CUBE"] and r[split["exchange_pipe"]] > r["CUBE"]
    assert "Atlas A2 CV split" in deciding(doc)["message"]
    assert "fused" in kinds(doc, "fusion") and "overlap" in kinds(doc, "runtime")


@pytest.fixture(scope="module")
def well_tuned() -> doctor.Diagnosis:
    """The well-tuned program's diagnosis, as gedoctor makes it (random inputs from seed 0), for the JSON
    and the text report alike (it is the slowest program here to simulate)."""
    from geir.tools.gerun import random_inputs

    path = DOCTOR / "well_tuned.geir"
    graph = parse(path.read_text(), str(path)).graph()
    return doctor.diagnose_graph(graph, random_inputs(graph, 0), {}, DEFAULT_PIPELINE, load_target("ascend910b"),
                                 str(path))


def test_well_tuned_attention_is_none(well_tuned):
    doc = check_schema(json.loads(json.dumps(well_tuned.to_json(), allow_nan=False)))
    assert doc["culprit"] == "none"
    (kernel,) = [f for f in doc["findings"] if f["layer"] == "kernel"]
    e = kernel["evidence"]
    assert kernel["kind"] == "near_roofline" and e["roofline_fraction"] >= doctor.ROOFLINE_FAR
    # compute-bound: the roofline is the cube's peak, from the target
    assert e["bound"] == "compute"
    assert e["roofline_tflops"] == pytest.approx(cube_peak_flops(load_target("ascend910b")) / 1e12)
    assert e["achieved_tflops"] == pytest.approx(e["roofline_fraction"] * e["roofline_tflops"])


# --- the text report -------------------------------------------------------------------------------------

def test_text_report_has_the_three_sections_in_order_then_the_verdict(capsys):
    rc, out, err = gedoctor([DOCTOR / "fusion_miss.geir"], capsys)
    assert rc == 0, err
    heads = [out.index(h) for h in ("1. GE fusion", "2. Runtime", "3. Kernels", "Look first at: fusion - ")]
    assert heads == sorted(heads)
    verdict = out[heads[-1]:]
    miss = next(f for f in diagnosis([DOCTOR / "fusion_miss.geir"], capsys)["findings"] if f["kind"] == "attention_miss")
    e = miss["evidence"]
    assert e["ratio"] == pytest.approx(e["unfused_us"] / e["fused_equivalent_us"])
    assert "softmax axis is 2, not the last axis" in verdict and f"{e['ratio']:.2f}x" in verdict
    # the source line of the deciding finding, with a caret under the op
    assert f"{DOCTOR / 'fusion_miss.geir'}:12:3: note: look here\n  %o = ge.matmul %p, %v\n  ^" in out


def test_text_report_of_a_calm_program_says_none(well_tuned):
    out = report(well_tuned, "well_tuned.geir", DEFAULT_PIPELINE, SourceManager())
    last = [line for line in out.splitlines() if line.startswith("Look first at:")]
    assert len(last) == 1 and last[0].startswith("Look first at: none - no layer stands out")
    (kernel,) = [f for f in well_tuned.findings if f.layer == "kernel"]
    assert f"{100 * kernel.evidence['roofline_fraction']:.0f} % of its roofline" in last[0]


# --- the examples ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["attention.geir", "gpt2_block.geir"])
def test_examples_give_valid_json(name, capsys):
    doc = diagnosis([EXAMPLES / name], capsys)
    assert "fused" in kinds(doc, "fusion") and "attention_miss" not in kinds(doc, "fusion")
    assert "host_copies" in kinds(doc, "runtime")


def test_gpt2_block_lists_every_kernel_that_matters(capsys):
    doc = diagnosis([EXAMPLES / "gpt2_block.geir"], capsys)
    judged = [f["evidence"]["kernel"] for f in doc["findings"] if f["layer"] == "kernel"]
    assert judged and all(f["evidence"]["device_share"] >= doctor.KERNEL_SHARE
                          for f in doc["findings"] if f["layer"] == "kernel")
    assert "ge.fused_matmul" in judged


# --- the analysis's pieces -------------------------------------------------------------------------------

def _stats(name: str, cycles: float, flops: float, gm_read: int, gm_write: int, hbm_read: int) -> KernelStats:
    busy = dict.fromkeys(PIPES, 0.0)
    return KernelStats(name, {}, 0.0, cycles, 24, busy, gm_read, gm_write, hbm_read, gm_write, flops)


def test_roofline_takes_the_highest_floor_from_the_target():
    t = load_target("ascend910b")
    peak = cube_peak_flops(t)
    gm_bw, hbm_bw = bandwidths(t, "ge.matmul")
    assert gm_bw == t.data["memory"]["gm_read_bytes_per_cycle_l2"] * t.cube_cores * t.clock_hz
    assert hbm_bw == min(t.data["memory"]["hbm_tb_per_s"] * 1e12,
                         t.data["memory"]["gm_read_bytes_per_cycle_hbm"] * t.cube_cores * t.clock_hz)
    seconds = 1e-4
    cycles = seconds * t.clock_hz
    # compute-bound: half the peak's FLOPs in the time, little traffic
    r = roofline(_stats("ge.matmul", cycles, 0.5 * peak * seconds, 1000, 1000, 0), t)
    assert r.bound == "compute" and r.fraction == pytest.approx(0.5)
    # HBM-bound: reads that missed L2 at a quarter of the HBM bandwidth; writes (write-back) are no floor
    nbytes = int(0.25 * hbm_bw * seconds)
    r = roofline(_stats("ge.matmul", cycles, 1e3, nbytes, nbytes, nbytes), t)
    assert r.bound == "HBM" and r.fraction == pytest.approx(0.25, rel=1e-6)
    assert r.roof_tflops == pytest.approx(r.intensity_hbm * hbm_bw / 1e12)
    # a vector kernel streams through every vector unit's port
    gm_vec, _ = bandwidths(t, "ge.softmax")
    assert gm_vec == pytest.approx(gm_bw * t.data["cores"]["vector_per_cube"])


def test_counting_waits_changes_no_number_and_no_time():
    text = (DOCTOR / "vector_bound.geir").read_text().replace("1x24x2048x64", "1x8x256x64")
    module, _ = compile_module(parse(text, "w.geir"), DEFAULT_PIPELINE)
    program = module.graphs[0]
    rng = np.random.default_rng(1)
    inputs = {a.name: rng.standard_normal(a.type.shape).astype(np.float16) for a in program.args}
    plain = Runtime(load_target("ascend910b")).run(program, inputs)
    counted = Runtime(load_target("ascend910b"), count_waits=True).run(program, inputs)
    assert [k.end for k in plain.kernels] == [k.end for k in counted.kernels]
    assert [k.busy for k in plain.kernels] == [k.busy for k in counted.kernels]
    assert all(np.array_equal(a, b) for a, b in zip(plain.outputs, counted.outputs))
    assert plain.kernels[0].waits is None
    (k,) = counted.kernels
    # every booked wait is idle time of its pipe: busy + waits never exceed the pipe's span on the cores
    for p in PIPES:
        assert k.busy[p] + k.waits.flag[p] + k.waits.slot[p] <= k.cycles * k.cores * (1 + 1e-9)
    assert k.waits.flag["CUBE"] > 0


# --- bad input and usage ---------------------------------------------------------------------------------

def test_missing_file_is_exit_1(tmp_path, capsys):
    rc, out, err = gedoctor([tmp_path / "nope.geir"], capsys)
    assert rc == 1 and not out and err.startswith("gedoctor: error: cannot read")


def test_syntax_error_is_a_diagnostic_with_a_caret(tmp_path, capsys):
    bad = tmp_path / "bad.geir"
    bad.write_text("ge.graph @main(%q: tensor<4xf16>) -> tensor<4xf16> {\n  %r = ge.exp %qq\n  ge.return %r\n}\n")
    rc, out, err = gedoctor([bad], capsys)
    assert rc == 1 and not out
    assert err.startswith(f"{bad}:2:15: error: use of undefined value '%qq'")
    assert err.splitlines()[-1].strip() == "^"


def test_bad_inputs_archive_is_exit_1(tmp_path, capsys):
    npz = tmp_path / "in.npz"
    np.savez(npz, q=np.zeros((1, 8, 128, 64)))
    rc, _, err = gedoctor([EXAMPLES / "attention.geir", "--inputs", npz], capsys)
    assert rc == 1 and "has no array 'k'" in err


@pytest.mark.parametrize("argv, message", [
    (["--passes=fuse,tilee"], "unknown pass 'tilee'"),
    (["--target", "ascend999"], "unknown target 'ascend999'"),
    (["--passes=lower,fuse"], "lower must be the last pass"),
    (["--no-fuse", "--passes=fuse"], "not allowed with argument"),
])
def test_bad_usage_is_exit_2(argv, message, capsys):
    rc, out, err = gedoctor([EXAMPLES / "attention.geir", *argv], capsys)
    assert rc == 2 and not out and message in err


def test_passes_on_a_lowered_program_is_exit_2(capsys):
    rc, _, err = gedoctor([DOCTOR / "single_buffer.geir", "--no-fuse"], capsys)
    assert rc == 2 and "already lowered" in err


def test_onnx_without_the_frontend_is_a_clean_error(tmp_path, capsys, monkeypatch):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"\x08\x07")
    monkeypatch.setitem(sys.modules, "geir.frontends.onnx", None)  # as if the frontend or onnx were missing
    rc, out, err = gedoctor([model], capsys)
    assert rc == 1 and not out and err.startswith("gedoctor: error: cannot read ONNX models here")


def test_onnx_model_through_the_frontend(tmp_path, capsys):
    frontend = pytest.importorskip("geir.frontends.onnx")
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    shape = [1, 8, 256, 64]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, shape) for n in "qkv"]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    graph = helper.make_graph(nodes, "attention", inputs,
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT16, shape)])
    path = tmp_path / "attention.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert hasattr(frontend, "import_onnx")
    doc = check_schema(json.loads(gedoctor([path, "--json"], capsys)[1]))
    # the model's ops are located in its text as imported (geimport writes the same lines)
    located = [f["location"] for f in doc["findings"] if f["location"]]
    assert located and all(loc.startswith(f"{path} (as imported):") for loc in located)


def test_installed_command_runs_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "geir.tools.gedoctor", str(EXAMPLES / "attention.geir"), "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    check_schema(json.loads(proc.stdout))


def _onnx_model(path: Path, nodes, x_shape, y_shape, initializers=()) -> Path:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, y_shape)],
                              list(initializers))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_an_onnx_op_no_tiling_takes_is_an_error_at_its_line_as_imported(tmp_path, capsys):
    pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    # Expand is imported as one concat of 10000 copies: more operands than a concat tiling fits in UB
    shape = numpy_helper.from_array(np.array([10000, 1], np.int64), "shape")
    path = _onnx_model(tmp_path / "expand.onnx", [helper.make_node("Expand", ["x", "shape"], ["y"])], [1, 1],
                       [10000, 1], [shape])
    rc, out, err = gedoctor([path], capsys)
    assert rc == 1 and not out and "internal error" not in err
    lines = err.splitlines()
    assert lines[0].startswith(f"{path} (as imported):2:3: error: no concat tiling fits ascend910b")
    assert lines[1].startswith("  %y = ge.concat %x, %x, ") and lines[2] == "  ^"


def test_gedoctor_on_a_20000_node_import(tmp_path, capsys):
    """A long exported chain: the import, every walk over the graph, the fusion probe and the report are iterative."""
    pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    from geir.tools.geimport import main as geimport_main

    nodes, prev = [], "x"
    for i in range(20_000):
        nodes.append(helper.make_node("Add", [prev, "one"], [f"v{i}"]) if i % 2 == 0
                     else helper.make_node("Relu", [prev], [f"v{i}"]))
        prev = f"v{i}"
    path = _onnx_model(tmp_path / "chain.onnx", nodes, [4, 4], [4, 4],
                       [numpy_helper.from_array(np.ones((4, 4), np.float32), "one")])
    # a walk that recursed along the chain would need thousands of frames: a few hundred more than now must do
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + 300)
    try:
        assert geimport_main([str(path), "-o", str(tmp_path / "chain.geir")]) == 0
        rc, out, err = gedoctor([tmp_path / "chain.geir", "--json"], capsys)
    finally:
        sys.setrecursionlimit(limit)
    assert rc == 0 and "Error" not in err, err
    doc = check_schema(json.loads(out))
    # hundreds of tiny fused chains, one launch each: the device waits for the Runtime's submissions
    assert doc["culprit"] == "host-launch" and deciding(doc)["kind"] == "host_bound"
    located = [f["location"] for f in doc["findings"] if f["location"]]
    assert all(loc.startswith(f"{tmp_path / 'chain.geir'}:") for loc in located)


# --- the one timeline: GE's host work and the Runtime's submissions ------------------------------------

def test_a_cold_run_that_waits_for_ge_points_at_ge_host(capsys):
    warm = diagnosis([DOCTOR / "well_tuned.geir"], capsys)
    compile_info = next(f for f in warm["findings"] if f["layer"] == "ge-host")
    assert compile_info["kind"] == "compile" and compile_info["severity"] == "info"
    assert compile_info["evidence"]["host_ge_us"] == 0 and compile_info["evidence"]["compile_us"] > 0
    # the first request of a fresh process: an in-process run would find GE's caches warmed by earlier tests
    done = subprocess.run([sys.executable, "-P", "-m", "geir.tools.gedoctor", str(DOCTOR / "well_tuned.geir"), "--cold",
                           "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cold = check_schema(json.loads(done.stdout))
    f = deciding(cold)
    assert cold["culprit"] == "ge-host" and f["kind"] == "ge_host_dominates"
    e = f["evidence"]
    # oracle: the definition, on the figures the finding reports
    assert e["host_ge_us"] / e["end_to_end_us"] > doctor.GE_HOST_SHARE
    assert e["end_to_end_us"] == pytest.approx(e["host_ge_us"] + e["device_span_us"])


def test_many_tiny_launches_are_host_bound(tmp_path, capsys):
    # 40 elementwise ops on a few hundred bytes, unfused: each kernel takes far less than one submission
    ops = "\n  ".join(f"%v{i} = ge.{'exp' if i % 2 else 'neg'} %v{i - 1}" for i in range(1, 41))
    path = tmp_path / "tiny.geir"
    path.write_text(f"ge.graph @main(%v0: tensor<8x16xf32>) -> tensor<8x16xf32> {{\n  {ops}\n  ge.return %v40\n}}\n")
    doc = diagnosis([path, "--no-fuse"], capsys)
    f = deciding(doc)
    assert doc["culprit"] == "host-launch" and f["kind"] == "host_bound"
    assert "--launch graph" in f["message"] and f["evidence"]["launch_mode"] == "single-op"
    e = f["evidence"]
    assert e["device_idle_us"] / e["device_span_us"] > doctor.HOST_BOUND_IDLE
    # oracle: the device cannot finish before the host has submitted every task, one after another
    assert e["device_span_us"] >= e["tasks"] * e["submit_us_per_task"]
    # in graph mode one submission starts the replay: the device no longer waits for the host
    graph = diagnosis([path, "--no-fuse", "--launch", "graph"], capsys)
    assert graph["culprit"] != "host-launch"
    assert all(f["kind"] != "host_bound" for f in graph["findings"])


def test_a_kernel_mostly_head_is_told_to_do_more_per_launch(tmp_path, capsys):
    # two heads of 128 rows: 2 work units, so 2 AIC and their 4 AIV start, 6 of the 910B's 72 cores: catlass's
    # 20.5 us full-chip head x 6 / 72; the kernel's work is a few microseconds beside it
    path = tmp_path / "tiny.geir"
    path.write_text((DOCTOR / "vector_bound.geir").read_text().replace("1x24x2048x64", "1x2x128x64"))
    doc = diagnosis([path], capsys)
    (kernel,) = [f for f in doc["findings"] if f["layer"] == "kernel" and f["kind"] == "far_from_roofline"]
    assert kernel["evidence"]["head_us"] == pytest.approx(20.5 * 6 / 72)
    assert kernel["evidence"]["head_us"] >= doctor.HEAD_SHARE * kernel["evidence"]["time_us"]
    assert "launch head" in kernel["message"] and "fuse more into it" in kernel["message"]
