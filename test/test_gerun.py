"""gerun in-process and as a subprocess: --check, fused vs unfused, output npz, several runs, weights,
profile JSON, Chrome trace, lowered programs, and every error path (exit 1 or 2, no traceback, no file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from geir.runtime.profile import PROFILE_KEYS
from geir.target_npu.sim import PIPES
from geir import accuracy
from geir.tools import gerun as gerun_mod
from geir.tools.geopt import main as geopt_main
from geir.tools.gerun import compare, main
from geir.types import DType, TensorType

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = ROOT / "examples" / "attention.geir"
F16 = (1e-2, 1e-3)


def gerun(argv, capsys):
    """(exit code, stdout, stderr) of an in-process run; argparse's exits count as return codes."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return rc, out, err


def write(tmp_path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def close(a, b, rtol_atol=F16) -> bool:
    rtol, atol = rtol_atol
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return bool(np.all(np.abs(a - b) <= atol + rtol * np.abs(b)))


def attention_inputs(seed: int, s: int = 128) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((1, 8, s, 64)).astype(np.float32) for n in ("q", "k", "v")}


# --- running ---------------------------------------------------------------------------------------------

def test_attention_check_passes(capsys):
    rc, out, err = gerun([ATTENTION, "--check"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("result0: tensor<1x8x128x64xf16>")
    assert lines[1].startswith("check result0 tensor<1x8x128x64xf16>: max err ")
    assert "x tolerance (rtol 0.01, atol 0.001), rms err " in lines[1] and " vs eager " in lines[1]
    assert lines[1].endswith("(limit 2x + atol/10): PASS (element-wise)")
    assert lines[-1] == "check: PASS"


def test_no_fuse_agrees_with_fused(tmp_path, capsys):
    fused, unfused = tmp_path / "f.npz", tmp_path / "u.npz"
    assert gerun([ATTENTION, "--seed", 3, "-o", fused], capsys)[0] == 0
    rc, out, _ = gerun([ATTENTION, "--seed", 3, "--no-fuse", "--check", "-o", unfused], capsys)
    assert rc == 0 and out.splitlines()[-1] == "check: PASS"
    a, b = np.load(fused)["result0"], np.load(unfused)["result0"]
    assert a.dtype == b.dtype == np.float16
    assert close(a, b)
    assert not np.array_equal(a, b) or True  # different kernels; agreement is within tolerance


def test_no_fuse_runs_op_by_op(tmp_path, capsys):
    prof = tmp_path / "p.json"
    assert gerun([ATTENTION, "--no-fuse", "--profile-json", prof], capsys)[0] == 0
    names = [k["name"] for k in json.loads(prof.read_text())["kernels"]]
    assert "ge.flash_attention" not in names and names.count("ge.matmul") == 2 and "ge.softmax" in names
    assert gerun([ATTENTION, "--profile-json", prof], capsys)[0] == 0
    assert [k["name"] for k in json.loads(prof.read_text())["kernels"]] == ["ge.flash_attention"]


def test_output_npz_keys_and_dtypes(tmp_path, capsys):
    f = write(tmp_path, "m.geir", """
ge.graph @main(%x: tensor<4x8xbf16>, %y: tensor<4x8xf32>, %m: tensor<4x8xi1>, %i: tensor<4x8xi32>)
    -> (tensor<4x8xbf16>, tensor<4x8xi1>, tensor<4x8xf32>, tensor<4x8xi32>) {
  %a = ge.add %x, %x
  %g = ge.greater %y, %y
  %s = ge.select %m, %y, %y
  %j = ge.add %i, %i
  ge.return %a, %g, %s, %j
}
""")
    out_path = tmp_path / "out.npz"
    rc, out, err = gerun([f, "--seed", 5, "--check", "-o", out_path], capsys)
    assert rc == 0, err
    z = np.load(out_path)
    assert sorted(z.files) == ["result0", "result1", "result2", "result3"]
    assert z["result0"].dtype == np.float32  # bf16 stored as float32
    assert z["result1"].dtype == np.bool_ and not z["result1"].any()
    assert z["result2"].dtype == np.float32
    assert z["result3"].dtype == np.int32
    assert out.count(": PASS (") == 4
    assert "check result0 tensor<4x8xbf16>: max err " in out and "(rtol 0.02, atol 0.01)" in out
    assert "(limit 3x + atol/10)" in out  # bf16's multiplier
    assert "check result1 tensor<4x8xi1>: PASS (exact)" in out


def test_inputs_from_npz_cast_to_argument_dtype(tmp_path, capsys):
    inputs = attention_inputs(1)
    np.savez(tmp_path / "in.npz", **inputs)  # float32 for f16 arguments
    rc, out, err = gerun([ATTENTION, "--inputs", tmp_path / "in.npz", "--check", "-o", tmp_path / "o.npz"], capsys)
    assert rc == 0, err
    assert out.splitlines()[-1] == "check: PASS"
    q, k, v = (inputs[n].astype(np.float16).astype(np.float64) for n in "qkv")
    s = q @ np.swapaxes(k, -1, -2) * 0.125
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ v
    assert close(np.load(tmp_path / "o.npz")["result0"], ref)


def test_several_inputs_run_in_one_session(tmp_path, capsys):
    for r in range(3):
        np.savez(tmp_path / f"in{r}.npz", **attention_inputs(10 + r))
    many = tmp_path / "many.npz"
    prof = tmp_path / "p.json"
    rc, out, err = gerun([ATTENTION, *sum((["--inputs", tmp_path / f"in{r}.npz"] for r in range(3)), []),
                          "--check", "-o", many, "--profile-json", prof], capsys)
    assert rc == 0, err
    assert sorted(np.load(many).files) == ["run0.result0", "run1.result0", "run2.result0"]
    assert [line.split()[1] for line in out.splitlines() if line.startswith("check run")] == \
        ["run0.result0", "run1.result0", "run2.result0"]
    for r in range(3):  # each run is the run the inputs alone give
        one = tmp_path / f"one{r}.npz"
        assert gerun([ATTENTION, "--inputs", tmp_path / f"in{r}.npz", "-o", one], capsys)[0] == 0
        np.testing.assert_array_equal(np.load(many)[f"run{r}.result0"], np.load(one)["result0"])
    doc = json.loads(prof.read_text())
    assert list(doc)[:len(PROFILE_KEYS)] == list(PROFILE_KEYS) and list(doc)[len(PROFILE_KEYS):] == ["runs"]
    assert len(doc["runs"]) == 3 and all(list(p) == list(PROFILE_KEYS) for p in doc["runs"])
    assert [p["plan_cache"]["hits"] for p in doc["runs"]] == [0, 1, 2]
    assert all(p["plan_cache"]["misses"] == 1 for p in doc["runs"])


def test_several_inputs_with_new_shapes_are_an_error_for_now(tmp_path, capsys):
    np.savez(tmp_path / "a.npz", **attention_inputs(1))
    np.savez(tmp_path / "b.npz", **attention_inputs(2, s=256))
    out_path = tmp_path / "o.npz"
    rc, _, err = gerun([ATTENTION, "--inputs", tmp_path / "a.npz", "--inputs", tmp_path / "b.npz", "-o", out_path],
                       capsys)
    assert rc == 1 and not out_path.exists()
    assert "has shape [1, 8, 256, 64], but %q is tensor<1x8x128x64xf16>" in err


WEIGHTED = """ge.graph @main(%x: tensor<4x16xf32>) -> tensor<4x16xf32> {
  %w = ge.const dense_resource<"w"> : tensor<16xf32>
  %y = ge.mul %x, %w
  %b = ge.const dense_resource<"bias"> : tensor<16xf32>
  %z = ge.add %y, %b
  ge.return %z
}
"""


def test_weights_default_beside_the_file(tmp_path, capsys):
    f = write(tmp_path, "model.geir", WEIGHTED)
    w, b = np.arange(16, dtype=np.float32), np.full(16, 0.5, np.float32)
    np.savez(tmp_path / "model.npz", w=w, bias=b)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    rc, out, err = gerun([f, "--inputs", tmp_path / "in.npz", "--check", "-o", tmp_path / "o.npz"], capsys)
    assert rc == 0, err
    assert out.splitlines()[-1] == "check: PASS"
    np.testing.assert_allclose(np.load(tmp_path / "o.npz")["result0"], x * w + b, rtol=1e-6)
    # --weights names another archive
    np.savez(tmp_path / "other.npz", w=2 * w, bias=b)
    rc, _, err = gerun([f, "--inputs", tmp_path / "in.npz", "--weights", tmp_path / "other.npz", "-o",
                        tmp_path / "o2.npz"], capsys)
    assert rc == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "o2.npz")["result0"], x * 2 * w + b, rtol=1e-6)


def test_missing_weight_names_the_key_and_the_op(tmp_path, capsys):
    f = write(tmp_path, "model.geir", WEIGHTED)
    np.savez(tmp_path / "model.npz", w=np.ones(16, np.float32))
    rc, out, err = gerun([f, "-o", tmp_path / "o.npz"], capsys)
    assert rc == 1 and not (tmp_path / "o.npz").exists()
    header, source, caret = err.rstrip("\n").split("\n")
    line = WEIGHTED.splitlines()[3]
    col = line.index("dense_resource") + 1
    assert header == f"{f}:4:{col}: error: weight 'bias' is not in the weights archive '{tmp_path / 'model.npz'}'"
    assert source == line and caret == " " * (col - 1) + "^"


def test_missing_weights_archive(tmp_path, capsys):
    f = write(tmp_path, "lonely.geir", WEIGHTED)
    rc, _, err = gerun([f], capsys)
    assert rc == 1
    assert "error: no weights archive for dense_resource<\"w\">" in err and "--weights" in err
    rc, _, err = gerun([f, "--weights", tmp_path / "nope.npz"], capsys)
    assert rc == 1 and err.startswith("gerun: error: cannot read weights")


def test_misshaped_weight(tmp_path, capsys):
    f = write(tmp_path, "model.geir", WEIGHTED)
    np.savez(tmp_path / "model.npz", w=np.ones(15, np.float32), bias=np.ones(16, np.float32))
    rc, _, err = gerun([f], capsys)
    assert rc == 1 and "weight 'w' in" in err and "has shape [15], but the constant is tensor<16xf32>" in err


def test_random_inputs_i1_and_seed(tmp_path, capsys):
    f = write(tmp_path, "sel.geir", """ge.graph @main(%m: tensor<64xi1>, %a: tensor<64xf32>) -> tensor<64xf32> {
  %z = ge.neg %a
  %s = ge.select %m, %a, %z
  ge.return %s
}
""")
    outs = []
    for seed in (7, 7, 8):
        path = tmp_path / f"o{len(outs)}.npz"
        assert gerun([f, "--seed", seed, "--check", "-o", path], capsys)[0] == 0
        outs.append(np.load(path)["result0"])
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])
    rng = np.random.default_rng(7)
    m = rng.random(64) < 0.5
    a = rng.standard_normal(64, dtype=np.float32)
    np.testing.assert_array_equal(outs[0], np.where(m, a, -a))
    assert 0 < m.sum() < 64


# --- profile and trace -----------------------------------------------------------------------------------

def test_profile_json_has_exactly_the_spec_keys(tmp_path, capsys):
    prof = tmp_path / "p.json"
    rc, out, err = gerun([ATTENTION, "--profile", "--profile-json", prof], capsys)
    assert rc == 0, err
    assert "simulated time" in out and "ge.flash_attention" in out
    p = json.loads(prof.read_text())
    assert list(p) == list(PROFILE_KEYS)
    assert p["simulated_time_us"] > 0
    for key in ("mte2_ratio", "cube_ratio", "vec_ratio", "mte3_ratio", "fixp_ratio"):
        assert 0 <= p[key] <= 1, key
    assert 0 <= p["overlap_ratio"] <= 1
    assert p["memory_bound"] >= 0
    assert 0 < p["cube_peak_fraction"] <= 1 and p["tflops"] > 0
    # q, k, v read once and o written once, 1 x 8 x 128 x 64 f16 each; on the 910B's split cube and vector cores
    # each head's one 128 x 128 CV block also writes and reads S (f32), P (f16) and P V (f32) through the workspace
    t = p["kernels"][0]["tiling"]
    assert (t["s1"], t["s2"], t["preload"]) == (128, 128, 2)
    trips = 8 * (128 * 128 * 4 + 128 * 128 * 2 + 128 * 64 * 4)
    assert p["gm_read_bytes"] == 3 * 8 * 128 * 64 * 2 + trips and p["gm_write_bytes"] == 8 * 128 * 64 * 2 + trips
    assert 0 <= p["hbm_read_bytes"] <= p["gm_read_bytes"]
    (k,) = p["kernels"]
    assert k["name"] == "ge.flash_attention" and k["tiling"]["s1"] > 0 and k["time_us"] > 0
    cache = p["plan_cache"]
    assert (cache["hits"], cache["misses"]) == (0, 1) and cache["replan_ms"] > 0 and p["faults"] == []


def test_trace_is_chrome_trace_json(tmp_path, capsys):
    trace = tmp_path / "t.json"
    rc, _, err = gerun([ATTENTION, "--no-fuse", "--trace", trace], capsys)
    assert rc == 0, err
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert threads[(0, 0)] == "GE" and threads[(0, 1)] == "Runtime" and processes[0] == "host"
    core_tracks = {(processes[pid], name) for (pid, tid), name in threads.items() if pid > 1}
    assert {name for _, name in core_tracks} >= {"MTE2", "CUBE", "VECTOR", "MTE3"}
    assert {name for _, name in core_tracks} <= set(PIPES)
    assert len({proc for proc, _ in core_tracks}) > 1 and all(p.startswith("core ") for p, _ in core_tracks)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in spans)
    ge = {e["name"] for e in spans if (e["pid"], e["tid"]) == (0, 0)}
    assert {"canonicalize", "tile", "plan", "lower"} <= ge and "fuse" not in ge
    submits = [e for e in spans if (e["pid"], e["tid"]) == (0, 1)]
    device = [e for e in spans if e["pid"] == 1]
    assert processes[1] == "device" and threads[(1, 0)] == "stream 0 (copies)"
    assert [e["cat"] for e in device].count("kernel") >= 4 and {"h2d", "d2h"} <= {e["cat"] for e in device}
    assert len(submits) == len(device) and all(e["cat"] == "submit" for e in submits)
    # copies on stream 0's track, kernels on the compute streams' tracks
    assert all((e["tid"] == 0) == (e["cat"] != "kernel") for e in device)
    # one axis: GE's work, then the Runtime's submissions, each task after it was submitted
    assert min(e["ts"] for e in submits) >= max(e["ts"] + e["dur"] for e in spans if (e["pid"], e["tid"]) == (0, 0)) - 1e-6
    for e in device:
        assert e["ts"] >= e["args"]["submitted_us"] - 1e-6
    # timestamps in order on every track
    by_track: dict = {}
    for e in spans:
        by_track.setdefault((e["pid"], e["tid"]), []).append(e["ts"])
    assert all(ts == sorted(ts) for ts in by_track.values())
    assert sum(1 for e in spans if e["pid"] > 1) > 10


def test_trace_of_several_runs_follows_on(tmp_path, capsys):
    for r in range(2):
        np.savez(tmp_path / f"in{r}.npz", **attention_inputs(r))
    trace = tmp_path / "t.json"
    rc, _, err = gerun([ATTENTION, "--inputs", tmp_path / "in0.npz", "--inputs", tmp_path / "in1.npz",
                        "--trace", trace], capsys)
    assert rc == 0, err
    device = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    kernels = sorted((e for e in device if e["cat"] == "kernel"), key=lambda e: e["ts"])
    assert len(kernels) == 2 and kernels[1]["ts"] > kernels[0]["ts"] + kernels[0]["dur"]
    assert kernels[1]["args"]["run"] == 1


# --- lowered programs ------------------------------------------------------------------------------------

def test_lowered_program_runs_directly(tmp_path, capsys):
    lowered = tmp_path / "x.geir"
    assert geopt_main([str(ATTENTION), "--passes=fuse,lower", "-o", str(lowered)]) == 0
    capsys.readouterr()
    assert lowered.read_text().startswith("rt.program @main(")
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    rc, _, err = gerun([lowered, "--seed", 4, "-o", a], capsys)
    assert rc == 0, err
    assert gerun([ATTENTION, "--passes=fuse,lower", "--seed", 4, "-o", b], capsys)[0] == 0
    np.testing.assert_array_equal(np.load(a)["result0"], np.load(b)["result0"])
    c = tmp_path / "c.npz"
    assert gerun([ATTENTION, "--seed", 4, "-o", c], capsys)[0] == 0  # the default pipeline: same kernel
    assert close(np.load(a)["result0"], np.load(c)["result0"])
    # flags that need the graph
    rc, _, err = gerun([lowered, "--check"], capsys)
    assert rc == 2 and "--check needs the graph" in err
    rc, _, err = gerun([lowered, "--no-fuse"], capsys)
    assert rc == 2 and "already lowered" in err


def test_entry_selects_the_graph(tmp_path, capsys):
    f = write(tmp_path, "two.geir", """ge.graph @a(%x: tensor<4xf32>) -> tensor<4xf32> {
  %y = ge.neg %x
  ge.return %y
}
ge.graph @b(%x: tensor<4xf32>) -> tensor<4xf32> {
  %y = ge.exp %x
  ge.return %y
}
""")
    rc, _, err = gerun([f], capsys)
    assert rc == 1 and "holds several graphs (@a, @b) and none is @main: choose one with --entry" in err
    rc, _, err = gerun([f, "--entry", "c"], capsys)
    assert rc == 1 and "has no graph @c (it holds @a, @b)" in err
    for entry in ("a", "b"):
        rc, out, err = gerun([f, "--entry", entry, "--check"], capsys)
        assert rc == 0 and out.splitlines()[-1] == "check: PASS", err


# --- errors ----------------------------------------------------------------------------------------------

BAD_SYNTAX = "ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {\n  %y = ge.neg %nope\n  ge.return %y\n}\n"


def _error_cases(tmp_path):
    np.savez(tmp_path / "partial.npz", q=np.zeros((1, 8, 128, 64)), k=np.zeros((1, 8, 128, 64)))
    np.savez(tmp_path / "misshaped.npz", q=np.zeros((1, 8, 128, 64)), k=np.zeros((1, 8, 128, 64)),
             v=np.zeros((1, 8, 64, 64)))
    (tmp_path / "notnpz.npz").write_text("not a zip")
    bad = write(tmp_path, "bad.geir", BAD_SYNTAX)
    lowered = tmp_path / "low.geir"
    geopt_main([str(ATTENTION), "--passes=fuse,lower", "-o", str(lowered)])
    a = str(ATTENTION)
    return [
        (1, [tmp_path / "missing.geir"], "gerun: error: cannot read"),
        (1, [bad], f"{bad}:2:15: error: use of undefined value '%nope'"),
        (2, [a, "--target", "nope"], "unknown target 'nope'"),
        (2, [a, "--passes=nosuchpass"], "--passes:1:1: error: unknown pass 'nosuchpass'"),
        (2, [a, "--passes=lower,cse"], "lower must be the last pass"),
        (2, [a, "--passes=fuse", "--no-fuse"], "not allowed with argument"),
        (2, [a, "--seed", "1", "--inputs", tmp_path / "partial.npz"], "not allowed with argument"),
        (2, [a, "--seed", "x"], "invalid int value"),
        (2, [a, "--bogus-flag"], "unrecognized arguments"),
        (2, [a, "--inject-fault", "disk@1"], "--inject-fault: expected KIND@N"),
        (2, [a, "--inject-fault", "dma@-1"], "--inject-fault: expected KIND@N"),
        (2, [a, "--inject-fault", "core"], "--inject-fault: expected KIND@N"),
        (2, [lowered, "--check"], "--check needs the graph"),
        (1, [a, "--inject-fault", "ub_overflow@5"], "cannot inject ub_overflow@5: the program has only 1 kernel launches"),
        (1, [a, "--inject-fault", "dma@9"], "cannot inject dma@9: the program has only 4 transfers"),
        (1, [a, "--inputs", tmp_path / "partial.npz"], "has no array 'v' for argument %v (it holds k, q)"),
        (1, [a, "--inputs", tmp_path / "misshaped.npz"], "input 'v' in"),
        (1, [a, "--inputs", tmp_path / "nope.npz"], "cannot read inputs"),
        (1, [a, "--inputs", tmp_path / "notnpz.npz"], "cannot read inputs"),
        (1, [a, "--entry", "other"], "has no graph @other"),
    ]


def test_error_paths_exit_1_or_2_without_traceback_or_output(tmp_path, capsys):
    cases = _error_cases(tmp_path)
    capsys.readouterr()
    for code, argv, message in cases:
        outs = [tmp_path / "o.npz", tmp_path / "p.json", tmp_path / "t.json"]
        rc, out, err = gerun([*argv, "-o", outs[0], "--profile-json", outs[1], "--trace", outs[2]], capsys)
        assert rc == code, (argv, err)
        assert message in err, (argv, err)
        assert not any(p.exists() for p in outs), argv
        assert not list(tmp_path.glob(".o.npz.*")) and not list(tmp_path.glob(".p.json.*"))
        if code == 1 and "error:" in err.splitlines()[0] and not err.startswith("gerun:"):
            # a diagnostic in a file: FILE:LINE:COL: error: ..., then the source line and a caret
            assert len(err.rstrip("\n").split("\n")) == 3 and err.rstrip("\n").split("\n")[2].strip() == "^"


@pytest.mark.parametrize("fault", ["dma@0", "dma@3", "core@0", "ub_overflow@0"])
def test_injected_faults_are_recovered_with_identical_results(fault, tmp_path, capsys):
    clean, hurt, prof = tmp_path / "clean.npz", tmp_path / "hurt.npz", tmp_path / "p.json"
    assert gerun([ATTENTION, "-o", clean], capsys)[0] == 0
    rc, _, err = gerun([ATTENTION, "--inject-fault", fault, "-o", hurt, "--profile-json", prof], capsys)
    assert rc == 0, err
    assert np.array_equal(np.load(hurt)["result0"], np.load(clean)["result0"])  # bit-identical
    (record,) = json.loads(prof.read_text())["faults"]
    kind, n = fault.split("@")
    assert record["kind"] == kind and record["task"] == int(n) and record["recovery"]


def test_a_fault_that_cannot_be_recovered_is_an_error(tmp_path, capsys, monkeypatch):
    # the kernel has no smaller tiling to offer when the parallel block is already at its smallest
    from geir.kernels.flash_attention import FlashAttentionKernel

    monkeypatch.setattr(FlashAttentionKernel, "shrink", lambda self, tiling: None)
    out_path = tmp_path / "o.npz"
    rc, out, err = gerun([ATTENTION, "--inject-fault", "ub_overflow@0", "-o", out_path], capsys)
    assert rc == 1 and out == "" and not out_path.exists()
    (line,) = err.splitlines()
    assert "ge.flash_attention: UB overflow" in line and "the kernel has no smaller tiling" in line


def test_failed_check_exits_1_and_writes_nothing(tmp_path, capsys, monkeypatch):
    # no element-wise slack, and no more RMS error allowed than none at all
    monkeypatch.setitem(gerun_mod.TOLERANCES, DType.f16, (0.0, 0.0))
    monkeypatch.setitem(accuracy.RMS_MULTIPLIERS, DType.f16, 0.0)
    out_path = tmp_path / "o.npz"
    rc, out, err = gerun([ATTENTION, "--no-fuse", "--check", "-o", out_path], capsys)
    assert rc == 1 and not out_path.exists()
    assert "(rtol 0, atol 0), rms err " in out and "(limit 0x + atol/10): FAIL" in out
    assert out.splitlines()[-1].startswith("check: FAIL")


def test_unwritable_output_is_an_error(tmp_path, capsys):
    (tmp_path / "dir.npz").mkdir()
    rc, _, err = gerun([ATTENTION, "-o", tmp_path / "dir.npz"], capsys)
    assert rc == 1 and err.startswith("gerun: error: cannot write")
    assert [p.name for p in tmp_path.iterdir()] == ["dir.npz"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("extra", [[], ["--overlap-compile", "2"]])
def test_an_output_that_fails_at_the_end_replaces_no_other_and_deletes_nothing(tmp_path, capsys, extra):
    # /dev/full passes the check before the run (a writable device) and fails only when written
    keep, trace = tmp_path / "keep.npz", tmp_path / "t.json"
    keep.write_bytes(b"the results of an earlier run")
    graph = ROOT / "examples" / "gpt2_block.geir" if extra else ATTENTION
    rc, out, err = gerun([graph, *extra, "-o", keep, "--trace", trace, "--profile-json", "/dev/full"], capsys)
    assert rc == 1 and "result0" in out  # the run itself went through
    assert err.splitlines() == ["gerun: error: cannot write '/dev/full': No space left on device"]
    assert keep.read_bytes() == b"the results of an earlier run"
    assert os.listdir(tmp_path) == ["keep.npz"]  # no trace, no temporary


def test_an_onnx_model_runs_through_the_onnx_frontend_as_gedoctor_reads_it(tmp_path, capsys):
    pytest.importorskip("onnx")
    model, inputs = ROOT / "examples" / "onnx" / "attention.onnx", ROOT / "examples" / "onnx" / "attention_inputs.npz"
    out = tmp_path / "o.npz"
    rc, stdout, err = gerun([model, "--inputs", inputs, "--check", "-o", out], capsys)
    assert rc == 0, err
    assert stdout.splitlines()[-1] == "check: PASS"
    # the oracle: the model as onnx's own reference evaluator runs it
    from onnx.reference import ReferenceEvaluator

    with np.load(inputs) as z, np.load(out) as got:
        (want,) = ReferenceEvaluator(str(model)).run(None, {"x": z["x"]})
        assert close(got["result0"], want, (1e-4, 1e-5))
    rc, _, err = gerun([model, "--weights", inputs], capsys)
    assert rc == 2 and "an ONNX model carries its own weights" in err


@pytest.mark.parametrize("name, data, kind", [
    ("w.npz", None, "a zip archive (an .npz? arrays go to --inputs or --weights)"),
    ("m.geir", bytes(range(256)) * 4, "a binary file"),
])
def test_a_binary_file_is_one_error_line_that_echoes_none_of_its_bytes(tmp_path, capsys, name, data, kind):
    f = tmp_path / name
    f.write_bytes(data if data is not None else (ROOT / "examples" / "gpt2_block.npz").read_bytes()[:20000])
    rc, out, err = gerun([f], capsys)
    assert rc == 1 and out == ""
    assert err == (f"{f}: error: {kind}, not GEIR text (a .geir file is UTF-8 text; an ONNX model is read by its "
                   f".onnx suffix)\n")
    rc, _, err2 = run_geopt([f], capsys)
    assert rc == 1 and err2 == err.replace("gerun", "geopt")


def run_geopt(argv, capsys):
    rc = geopt_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_pickled_npz_gets_geirs_own_words_not_numpys(tmp_path, capsys):
    pickled = tmp_path / "p.npz"
    np.savez(pickled, q=np.array([{"a": 1}], dtype=object))
    for flag in ("--inputs", "--weights"):
        rc, out, err = gerun([ATTENTION, flag, pickled], capsys)
        assert rc == 1 and out == ""
        assert "allow_pickle" not in err and err.count("\n") == 1
        assert err.startswith(f"gerun: error: cannot read {flag.strip('-')} '{pickled}': it holds an object array "
                              f"(pickled Python objects), which GEIR never loads")


def test_internal_errors_are_one_line(tmp_path, capsys, monkeypatch):
    def boom(*a, **k):
        raise ZeroDivisionError("oops")

    monkeypatch.setattr(gerun_mod, "outputs_npz", boom)
    monkeypatch.delenv("GEIR_TRACEBACK", raising=False)
    rc, _, err = gerun([ATTENTION, "-o", tmp_path / "o.npz"], capsys)
    assert rc == 1 and err.splitlines() == ["gerun: error: internal error: ZeroDivisionError: oops (set "
                                            "GEIR_TRACEBACK=1 to see where)"]


# --- check arithmetic and progress ------------------------------------------------------------------------

def test_compare_uses_the_allclose_rule():
    t = TensorType((3,), DType.f16)
    b = np.array([1.0, 0.0, -2.0])
    assert compare(np.array([1.0105, 0.0009, -2.02]), b, t).passed  # |a - b| <= 1e-3 + 1e-2 * |b|
    assert not compare(np.array([1.0115, 0.0, -2.0]), b, t).passed
    assert not compare(np.array([1.0, 0.0011, -2.0]), b, t).passed
    verdict = compare(np.array([1.05, 0.0, -2.0]), b, TensorType((3,), DType.f32))
    assert not verdict.passed and verdict.max_err == pytest.approx(0.05 / (1e-5 + 1e-4))
    assert (verdict.rtol, verdict.atol, verdict.mismatched) == (1e-4, 1e-5, 1)
    # NaN where the reference has NaN is equal; NaN elsewhere fails; same-signed infinities are equal
    nan_ref = np.array([np.nan, np.inf, 1.0])
    assert compare(np.array([np.nan, np.inf, 1.0], np.float32), nan_ref, TensorType((3,), DType.f32)).passed
    assert not compare(np.array([np.nan, np.inf, np.nan], np.float32), nan_ref, TensorType((3,), DType.f32)).passed
    assert not compare(np.array([np.nan, -np.inf, 1.0], np.float32), nan_ref, TensorType((3,), DType.f32)).passed
    assert compare(np.array([1, 2], np.int32), np.array([1, 2]), TensorType((2,), DType.i32)).passed
    assert not compare(np.array([1, 3], np.int32), np.array([1, 2]), TensorType((2,), DType.i32)).passed


def test_progress_line_only_on_a_terminal(tmp_path, capsys, monkeypatch):
    chain = "\n".join(f"  %y{i} = ge.{'neg' if i % 2 else 'exp'} %y{i - 1}" for i in range(1, 8))
    f = write(tmp_path, "chain.geir", "ge.graph @main(%y0: tensor<64xf32>) -> tensor<64xf32> {\n" + chain +
              "\n  ge.return %y7\n}\n")
    rc, _, err = gerun([f, "--no-fuse"], capsys)
    assert rc == 0 and err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    rc, _, err = gerun([f, "--no-fuse"], capsys)
    assert rc == 0 and "\r" in err and "7/7" in err and err.endswith("\r\033[K")


def test_subprocess_run_is_quiet_and_writes_the_npz(tmp_path):
    out_path = tmp_path / "o.npz"
    done = subprocess.run([sys.executable, "-m", "geir.tools.gerun", str(ATTENTION), "--seed", "2", "--check",
                           "-o", str(out_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress line into a pipe
    assert done.stdout.splitlines()[-1] == "check: PASS"
    z = np.load(out_path)
    assert z.files == ["result0"] and z["result0"].shape == (1, 8, 128, 64) and z["result0"].dtype == np.float16
    bad = subprocess.run([sys.executable, "-m", "geir.tools.gerun", str(ATTENTION), "--inject-fault", "x@1"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_passes_get_lower_at_the_end(tmp_path, capsys):
    prof = tmp_path / "p.json"
    rc, out, err = gerun([ATTENTION, "--passes=", "--check", "--profile-json", prof], capsys)  # only what lower needs
    assert rc == 0 and out.splitlines()[-1] == "check: PASS", err
    assert "ge.flash_attention" not in [k["name"] for k in json.loads(prof.read_text())["kernels"]]
    rc, out, err = gerun([ATTENTION, "--passes=canonicalize,fuse", "--check", "--profile-json", prof], capsys)
    assert rc == 0 and out.splitlines()[-1] == "check: PASS", err
    assert [k["name"] for k in json.loads(prof.read_text())["kernels"]] == ["ge.flash_attention"]
    rc, _, err = gerun([ATTENTION, "--passes=tile{buffers=3}"], capsys)
    assert rc == 2 and "buffers" in err


def test_a_dynamic_graph_is_specialised_per_shape_and_cached(tmp_path, capsys):
    f = write(tmp_path, "dyn.geir", """ge.graph @main(%q: tensor<1x2x?x64xf16>, %k: tensor<1x2x?x64xf16>, %v: tensor<1x2x?x64xf16>) -> tensor<1x2x?x64xf16> {
  %s = ge.matmul %q, %k {transpose_b = true}
  %p = ge.softmax %s
  %o = ge.matmul %p, %v
  ge.return %o
}
""")
    rng = np.random.default_rng(3)
    paths = []
    for i, s in enumerate((128, 2048, 512, 2048)):
        paths.append(tmp_path / f"in{i}.npz")
        np.savez(paths[-1], **{n: rng.standard_normal((1, 2, s, 64)).astype(np.float32) for n in "qkv"})
    prof, out_path = tmp_path / "p.json", tmp_path / "o.npz"
    argv = [f, "--check", "--profile-json", prof, "-o", out_path]
    for p in paths:
        argv += ["--inputs", p]
    rc, out, err = gerun(argv, capsys)
    assert rc == 0, err
    assert out.splitlines()[-1] == "check: PASS"
    doc = json.loads(prof.read_text())
    assert [r["plan_cache"]["misses"] for r in doc["runs"]] == [1, 2, 3, 3]
    assert [r["plan_cache"]["hits"] for r in doc["runs"]] == [0, 0, 0, 1]
    outputs = np.load(out_path)
    assert [outputs[f"run{i}.result0"].shape[2] for i in range(4)] == [128, 2048, 512, 2048]


def test_inputs_a_dynamic_graph_cannot_take_are_an_error(tmp_path, capsys):
    f = write(tmp_path, "dyn.geir", "ge.graph @main(%x: tensor<?x4xf32>) -> tensor<?x4xf32> {\n"
                                    "  %y = ge.exp %x\n  ge.return %y\n}\n")
    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 5), np.float32))
    rc, _, err = gerun([f, "--inputs", tmp_path / "bad.npz"], capsys)
    assert rc == 1 and "has shape [3, 5]" in err and "Traceback" not in err


# --- bf16 inputs as numpy stores them -------------------------------------------------------------------

BF16_GRAPH = """
ge.graph @main(%x: tensor<4x8xbf16>, %y: tensor<4x8xbf16>) -> (tensor<4x8xbf16>, tensor<4x8xbf16>) {
  %s = ge.add %x, %y
  %p = ge.mul %x, %y
  ge.return %s, %p
}
"""


def test_bf16_inputs_saved_by_np_savez_run_as_bf16(tmp_path, capsys):
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((4, 8)).astype(np.float32).astype(bf16) for _ in range(2))
    np.savez(tmp_path / "raw.npz", x=x, y=y)
    assert np.load(tmp_path / "raw.npz")["x"].dtype == np.dtype("V2")  # what np.savez makes of bf16
    np.savez(tmp_path / "f32.npz", x=x.astype(np.float32), y=y.astype(np.float32))
    f = write(tmp_path, "m.geir", BF16_GRAPH)
    results = {}
    for name in ("raw", "f32"):
        rc, out, err = gerun([f, "--inputs", tmp_path / f"{name}.npz", "--check", "-o", tmp_path / f"{name}_out.npz"],
                             capsys)
        assert rc == 0 and err == "" and "check: PASS" in out
        with np.load(tmp_path / f"{name}_out.npz") as z:
            results[name] = [z["result0"], z["result1"]]
    # numpy on the same values: one op each, exact in f32 and rounded once to bf16
    xf, yf = x.astype(np.float32), y.astype(np.float32)
    want = [(xf + yf).astype(bf16).astype(np.float32), (xf * yf).astype(bf16).astype(np.float32)]
    for got in results.values():
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("graph, array, message", [
    # 2-byte void stands for bf16 only
    ("ge.graph @main(%x: tensor<4x8xf16>) -> tensor<4x8xf16> {\n  ge.return %x\n}\n", np.zeros((4, 8), "V2"),
     "input 'x' in '{npz}' holds |V2 data, which no GEIR dtype stands for"),
    # and bf16 is 2 bytes wide: other void widths are no bf16
    ("ge.graph @main(%x: tensor<4x8xbf16>) -> tensor<4x8xbf16> {\n  ge.return %x\n}\n", np.zeros((4, 8), "V4"),
     "input 'x' in '{npz}' holds |V4 data, which no GEIR dtype stands for"),
])
def test_void_inputs_that_are_not_bf16_are_errors(tmp_path, capsys, graph, array, message):
    f = write(tmp_path, "m.geir", graph)
    npz = tmp_path / "in.npz"
    np.savez(npz, x=array)
    rc, out, err = gerun([f, "--inputs", npz], capsys)
    assert rc == 1 and err == f"gerun: error: {message.format(npz=npz)}\n"


def test_gedoctor_takes_bf16_inputs_as_numpy_stores_them(tmp_path, capsys):
    import ml_dtypes

    from geir.tools.gedoctor import main as gedoctor_main

    f = write(tmp_path, "m.geir", BF16_GRAPH)
    x = np.ones((4, 8), ml_dtypes.bfloat16)
    np.savez(tmp_path / "raw.npz", x=x, y=x)
    assert gedoctor_main([str(f), "--inputs", str(tmp_path / "raw.npz"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["culprit"] and "error" not in err
