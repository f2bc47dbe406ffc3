"""One modelled timeline (issue 13): the Runtime's host submissions, the copies and the kernels on one
clock, the profile's split of where the time went, and inputs kept on the device between calls.

Oracles: the target file's numbers (a copy costs copy_latency_us + bytes / the link rate; each task
submitted costs launch_latency_us of host time) and the kernels' own cycle counts.
"""

from __future__ import annotations

import numpy as np
import pytest

from geir.parser import parse
from geir.runtime.interpreter import Runtime
from geir.runtime.profile import PROFILE_KEYS, profile
from geir.session import DEFAULT_PIPELINE, compile_module
from geir.target_npu import load_target

# the first kernel needs only %x; %w is large and copied after it
TWO_INPUTS = """ge.graph @main(%x: tensor<64x256xf16>, %w: tensor<2048x2048xf16>) -> (tensor<64x256xf16>, tensor<2048x2048xf16>) {
  %a = ge.exp %x
  %b = ge.neg %w
  ge.return %a, %b
}
"""


def _program(text: str):
    return compile_module(parse(text, "t.geir"), DEFAULT_PIPELINE, "ascend910b")[0].graphs[0]


def _inputs(program):
    rng = np.random.default_rng(0)
    return {a.name: rng.standard_normal(a.type.shape).astype(a.type.dtype.np) for a in program.args}


def test_copies_and_submissions_follow_the_target_file():
    target = load_target("ascend910b")
    host = target.data["host"]
    program = _program(TWO_INPUTS)
    result = Runtime(target).run(program, _inputs(program))
    copies = [t for t in result.tasks if t.kind != "kernel"]
    nbytes = {"copy %x in": 64 * 256 * 2, "copy %w in": 2048 * 2048 * 2}
    for t in copies:
        if t.name in nbytes:
            expected = host["copy_latency_us"] + nbytes[t.name] / (host["pcie_gb_per_s"] * 1e3)
            assert t.end_us - t.start_us == pytest.approx(expected)
    # the host submits one task after another; none starts on the device before it was submitted
    submitted = [t.submitted_us for t in sorted(result.tasks, key=lambda t: t.submitted_us)]
    assert submitted == pytest.approx([host["launch_latency_us"] * (i + 1) for i in range(len(result.tasks))])
    assert all(t.start_us >= t.submitted_us - 1e-9 for t in result.tasks)  # to the cycle the Runtime counts in


def test_a_kernel_starts_once_its_own_inputs_are_in_while_later_copies_go_on():
    program = _program(TWO_INPUTS)
    result = Runtime(load_target("ascend910b")).run(program, _inputs(program))
    x_in = next(t for t in result.tasks if t.name == "copy %x in")
    w_in = next(t for t in result.tasks if t.name == "copy %w in")
    exp = next(t for t in result.tasks if t.kind == "kernel")
    assert exp.start_us >= x_in.end_us
    assert exp.start_us < w_in.end_us  # it did not wait for the copy it does not need
    assert exp.stream != w_in.stream


def test_the_profile_splits_where_the_time_went():
    target = load_target("ascend910b")
    program = _program(TWO_INPUTS)
    result = Runtime(target).run(program, _inputs(program))
    p = profile(result, host_ge_us=1234.5)
    assert list(p)[:5] == ["simulated_time_us", "kernel_time_us", "transfer_time_us", "host_ge_us", "end_to_end_us"]
    assert list(p) == list(PROFILE_KEYS)
    kernel_us = sum(k.cycles for k in result.kernels) / target.clock_hz * 1e6
    assert p["kernel_time_us"] == pytest.approx(kernel_us)
    assert p["kernel_time_us"] == pytest.approx(sum(k["time_us"] for k in p["kernels"]))
    assert p["transfer_time_us"] == pytest.approx(sum(t.end_us - t.start_us for t in result.tasks if t.kind != "kernel"))
    assert p["host_ge_us"] == 1234.5
    assert p["end_to_end_us"] == pytest.approx(1234.5 + p["simulated_time_us"])
    assert 0 <= p["mte1_ratio"] <= 1


def test_a_resident_input_is_not_copied_again():
    target = load_target("ascend910b")
    program = _program(TWO_INPUTS)
    inputs = _inputs(program)
    cold = Runtime(target).run(program, inputs)
    warm = Runtime(target).run(program, inputs, resident={"w"})
    assert [t.name for t in warm.tasks if t.kind == "h2d"] == ["copy %x in"]
    assert all(np.array_equal(a, b) for a, b in zip(cold.outputs, warm.outputs))
    saved = 2048 * 2048 * 2 / (target.data["host"]["pcie_gb_per_s"] * 1e3) + target.data["host"]["copy_latency_us"]
    assert profile(cold)["transfer_time_us"] - profile(warm)["transfer_time_us"] == pytest.approx(saved)


def test_gerun_resident_inputs_are_not_copied(tmp_path, capsys):
    import json

    from geir.tools import gerun

    path = tmp_path / "two.geir"
    path.write_text(TWO_INPUTS)
    cold, warm = tmp_path / "cold.json", tmp_path / "warm.json"
    assert gerun.main([str(path), "--profile-json", str(cold)]) == 0
    assert gerun.main([str(path), "--profile-json", str(warm), "--resident", "w*"]) == 0
    a, b = json.loads(cold.read_text()), json.loads(warm.read_text())
    assert b["transfer_time_us"] < a["transfer_time_us"] and b["kernel_time_us"] == pytest.approx(a["kernel_time_us"])
    assert gerun.main([str(path), "--resident", "nothing"]) == 2
    assert "--resident nothing: no argument of @main matches" in capsys.readouterr().err
