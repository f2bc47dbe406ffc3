"""Runtime listeners and the one typed timeline (geir.runtime.trace) every trace, report and picture renders from.

Oracles: the program's own ops (its launches in order with their kernel names, its copies with the bytes their
types hold); the run's task list for the modelled times; sums of span lengths for the text report.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from geir import parse_file
from geir.runtime.interpreter import Runtime, RuntimeListener
from geir.runtime.trace import GE, RUNS, RUNTIME, Counter, Span, Trace, Track, chrome_trace, format_trace, runs_trace
from geir.session import NO_FUSE_PIPELINE, Session
from geir.target_npu.target import load_target
from geir.tools.gerun import main as gerun_main

ATTENTION = Path(__file__).resolve().parent.parent / "examples" / "attention.geir"


class Recorder(RuntimeListener):
    """Every hook call, in order."""

    def __init__(self):
        self.calls: list[tuple] = []

    def run_started(self, program):
        self.calls.append(("start", program.name))

    def copied(self, task):
        self.calls.append(("copy", task.kind, task.nbytes, task.start_us, task.end_us))

    def launched(self, task, stats):
        self.calls.append(("launch", task.name, task.start_us, task.end_us, stats.name))

    def resident_from_host(self, name, nbytes):
        self.calls.append(("resident", name, nbytes))

    def run_finished(self, result):
        self.calls.append(("finish", len(result.tasks)))


def _attention_program(pipeline=NO_FUSE_PIPELINE):
    module = parse_file(str(ATTENTION))
    session = Session(module, pipeline)
    rng = np.random.default_rng(0)
    inputs = {a.name: rng.standard_normal(a.type.shape).astype(np.float32) for a in module.graph().args}
    return session, session.program({k: v.shape for k, v in inputs.items()}), inputs


@pytest.mark.parametrize("faults", [(), (("core", 1), ("ub_overflow", 2), ("dma", 0))], ids=["clean", "faults"])
def test_a_listener_sees_each_launch_in_order_with_its_modelled_times(faults):
    _, program, inputs = _attention_program()
    recorder = Recorder()
    result = Runtime(load_target("ascend910b"), faults=faults, listeners=[recorder]).run(program, inputs)
    launches = [op.kernel for op in program.ops if op.name == "rt.launch"]
    assert len(launches) >= 4
    seen = [c for c in recorder.calls if c[0] == "launch"]
    # one call per launch of the program, in program order, whatever faults were recovered from
    assert [c[1] for c in seen] == launches and all(c[1] == c[4] for c in seen)
    # its modelled start and end, as the run records them, and the AI cores run one launch at a time
    kernels = [t for t in result.tasks if t.kind == "kernel"]
    assert [(c[2], c[3]) for c in seen] == [(t.start_us, t.end_us) for t in kernels]
    assert all(0 <= c[2] < c[3] for c in seen) and all(a[3] <= b[2] for a, b in zip(seen, seen[1:]))
    # every copy, with the bytes its type holds; the run's start and end around everything
    copies = [c for c in recorder.calls if c[0] == "copy"]
    expected = [("h2d" if op.name == "rt.h2d" else "d2h", op.result.type.nbytes) for op in program.ops
                if op.name in ("rt.h2d", "rt.d2h")]
    assert [(c[1], c[2]) for c in copies] == expected
    assert recorder.calls[0] == ("start", program.name) and recorder.calls[-1] == ("finish", len(result.tasks))
    assert not any(c[0] == "resident" for c in recorder.calls)


def test_a_resident_input_given_from_the_host_is_told_and_a_kept_result_stays_on_the_device():
    from geir.runtime.device import DeviceTensor

    _, program, inputs = _attention_program()
    recorder = Recorder()
    runtime = Runtime(load_target("ascend910b"), listeners=[recorder])
    first = runtime.run(program, inputs, resident=["q"], keep=[0])
    q = program.args[0]
    assert ("resident", "q", q.type.nbytes) in recorder.calls
    assert not any(c[0] == "copy" and c[1] == "d2h" for c in recorder.calls)  # the result stayed there
    (kept,) = first.outputs
    assert isinstance(kept, DeviceTensor) and kept.shape == tuple(program.result_types[0].shape)
    full = runtime.run(program, inputs)
    np.testing.assert_array_equal(kept.read(), full.outputs[0])


def test_gerun_trace_renders_the_one_timeline(tmp_path, capsys):
    trace_path = tmp_path / "t.json"
    assert gerun_main([str(ATTENTION), "--no-fuse", "--trace", str(trace_path)]) == 0
    capsys.readouterr()
    written = json.loads(trace_path.read_text())
    # the same records, made here from a session and a run: GE's spans, then the run, on one clock
    session, program, inputs = _attention_program()
    result = Runtime(load_target("ascend910b"), record_pipes=True).run(program, inputs)
    trace = runs_trace([result], [list(session.spans)])
    ge, runs, submits = trace.on(GE), trace.on(RUNS), trace.on(RUNTIME)
    assert {"canonicalize", "tile", "plan", "lower"} <= {s.name for s in ge}
    assert all(s.kind == "ge" for s in ge) and len(runs) == 1
    assert max(s.end_us for s in ge) <= min(s.start_us for s in submits) + 1e-9 == pytest.approx(runs[0].start_us)
    device = trace.of_kind("h2d", "d2h", "kernel")
    assert len(device) == len(submits) == len(result.tasks)
    assert [s.name for s in trace.of_kind("kernel")] == [op.kernel for op in program.ops if op.name == "rt.launch"]
    assert runs[0].end_us == pytest.approx(runs[0].start_us + max(t.end_us for t in result.tasks))

    def shape(doc):  # what gerun wrote and what the renderer makes of these records: the same events per track
        counts: dict = {}
        for e in doc["traceEvents"]:
            key = (e["ph"], e["pid"], e.get("tid"), e.get("cat"), e["name"])
            counts[key] = counts.get(key, 0) + 1
        return counts

    assert shape(written) == shape(chrome_trace(trace))
    ge_events = [e for e in written["traceEvents"] if e.get("cat") == "ge"]
    first_submit = min(e["ts"] for e in written["traceEvents"] if e.get("cat") == "submit")
    assert ge_events and max(e["ts"] + e["dur"] for e in ge_events) <= first_submit + 1e-6


def test_the_text_report_and_the_chrome_trace_render_the_same_records():
    a, b = Track(5, 0, "req", "request 0"), Track(5, 1, "req", "request 1")
    pool = Track(6, 0, "pool", "pool")
    trace = Trace([Span(a, "prefill", 0.0, 4.0, "step"), Span(b, "prefill", 4.0, 5.5, "step"),
                   Span(a, "decode", 5.5, 6.0, "step", {"token": 7})],
                  [Counter(pool, "pool (blocks)", 0.0, {"used": 2}), Counter(pool, "pool (blocks)", 5.5, {"used": 3})])
    text = format_trace(trace).splitlines()
    row_a = next(line for line in text if "request 0" in line).split()
    assert row_a[-4:] == ["2", f"{4.0 + 0.5:.2f}", "0.00", "6.00"]
    assert any("pool (blocks): used" in line and line.split()[-2:] == ["2", "3"] for line in text)
    doc = chrome_trace(trace, "ms")
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert names == {(5, None): "req", (5, 0): "request 0", (5, 1): "request 1", (6, None): "pool"}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["ts"], e["dur"]) for e in spans] == [(0, 0.0, 4.0), (0, 5.5, 0.5), (1, 4.0, 1.5)]
    assert [e["args"] for e in doc["traceEvents"] if e["ph"] == "C"] == [{"used": 2}, {"used": 3}]
    later = Trace()
    later.extend(trace, 10.0, {"run": 1})
    assert [s.start_us for s in later.spans] == [10.0, 14.0, 15.5] and later.spans[2].args == {"token": 7, "run": 1}
    assert later.end_us == 16.0
