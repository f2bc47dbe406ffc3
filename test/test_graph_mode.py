"""Graph mode (issue 29 item 4): a program's launches captured on the device once and replayed with one
submission (ACL Graph: aclmdlRICaptureBegin/End, aclmdlRIExecuteAsync), against single-op launches the host
submits one by one.

Oracles: the submission model's arithmetic (N launches at the target's launch latency each, or one), the
device's idle time as the span less the union of its tasks, and Hugging Face's greedy tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from geir.parser import parse
from geir.runtime.interpreter import GraphCaptures, Runtime
from geir.runtime.profile import device_idle_us, profile
from geir.session import compile_module
from geir.target_npu import load_target

CHIP = load_target("ascend910b")
N = 12
TINY = "ge.graph @main(%v0: tensor<8x16xf32>) -> tensor<8x16xf32> {\n  " + "\n  ".join(
    f"%v{i} = ge.{'exp' if i % 2 else 'neg'} %v{i - 1}" for i in range(1, N + 1)) + f"\n  ge.return %v{N}\n}}\n"


@pytest.fixture(scope="module")
def program():
    return compile_module(parse(TINY, "<tiny>"), "canonicalize,layout,tile,plan,lower", CHIP)[0].graphs[0]


def _launches(result):
    return [t for t in result.tasks if t.kind == "kernel"]


def test_single_op_launches_wait_for_the_host_one_by_one(program):
    result = Runtime(CHIP).run(program, {"v0": np.ones((8, 16), np.float32)})
    submit = CHIP.host.launch_latency_us
    launches = _launches(result)
    assert len(launches) == N and result.launch_mode == "single-op" and result.capture_us == 0
    # the i-th launch is submitted after the copy in and i + 1 submissions
    assert [t.submitted_us for t in launches] == pytest.approx([(i + 2) * submit for i in range(N)])
    # to a femtosecond: the Runtime keeps the device's time in cycles, so a start converted back to us may round
    assert all(t.start_us >= t.submitted_us - 1e-9 for t in launches)


def test_graph_mode_captures_once_and_replays_with_one_submission(program):
    graphs = GraphCaptures()
    x = {"v0": np.ones((8, 16), np.float32)}
    first = Runtime(CHIP, launch_mode="graph", graphs=graphs).run(program, x)
    again = Runtime(CHIP, launch_mode="graph", graphs=graphs).run(program, x)
    single = Runtime(CHIP).run(program, x)
    submit = CHIP.host.launch_latency_us
    # loading it the first time, the host submitted every launch once into the captured graph: GE's host work
    assert first.capture_us == pytest.approx(N * submit) and again.capture_us == 0
    for run in (first, again):
        assert {round(t.submitted_us, 9) for t in _launches(run)} == {round(2 * submit, 9)}  # copy in, one replay
    np.testing.assert_array_equal(again.outputs[0], single.outputs[0])
    # the same kernels, a shorter span: the device no longer waits between launches
    assert [k.cycles for k in again.kernels] == pytest.approx([k.cycles for k in single.kernels])
    assert max(t.end_us for t in again.tasks) < max(t.end_us for t in single.tasks)
    # and the profile says so: the mode, and an idle time that is the span less the union of the tasks
    for run, mode in ((again, "graph"), (single, "single-op")):
        p = profile(run)
        assert p["launch_mode"] == mode
        spans = sorted((t.start_us, t.end_us) for t in run.tasks)
        busy, reach = 0.0, 0.0
        for s, e in spans:
            busy += max(0.0, e - max(s, reach))
            reach = max(reach, e)
        assert p["device_idle_us"] == pytest.approx(max(e for _, e in spans) - busy)
    assert device_idle_us(again) < device_idle_us(single)
    assert profile(first)["host_ge_us"] == pytest.approx(N * submit)  # the capture is GE's host work


def test_an_unknown_launch_mode_is_refused():
    with pytest.raises(ValueError, match="launch mode must be one of single-op, graph"):
        Runtime(CHIP, launch_mode="eager")


def test_gerun_launch_graph_reports_the_mode_and_the_idle_time(tmp_path):
    from geir.tools import gerun

    path = tmp_path / "tiny.geir"
    path.write_text(TINY)
    figures = {}
    for mode in ("single-op", "graph"):
        out = tmp_path / f"{mode}.json"
        assert gerun.main([str(path), "--launch", mode, "--no-fuse", "--profile-json", str(out)]) == 0
        figures[mode] = json.loads(out.read_text())
    assert figures["graph"]["launch_mode"] == "graph" and figures["single-op"]["launch_mode"] == "single-op"
    assert figures["graph"]["device_idle_us"] < figures["single-op"]["device_idle_us"]
    assert figures["graph"]["kernel_time_us"] == pytest.approx(figures["single-op"]["kernel_time_us"])


def test_generate_in_graph_mode_gives_hf_s_tokens_and_shorter_decode_steps():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from geir.frontends.generate import generate

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    runs = {mode: generate(model, ids, 4, launch=mode) for mode in ("single-op", "graph")}
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
    for run in runs.values():
        assert torch.equal(run.tokens, want)
    single, graph = ([s for s in runs[m].steps if s.phase == "decode"] for m in ("single-op", "graph"))
    # the same kernels, fewer waits for the host
    assert [s.kernel_time_us for s in graph] == pytest.approx([s.kernel_time_us for s in single])
    assert all(g.device_us < s.device_us for g, s in zip(graph, single))
    with pytest.raises(ValueError, match="launch must be one of"):
        generate(model, ids, 2, launch="eager")
