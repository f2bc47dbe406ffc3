"""The guided tour (examples/tour/run_tour.py): every step's commands run, and what the tour says each shows holds.

Each step runs once (module fixtures) through run_tour's own step functions, which run the CLIs as
subprocesses; the tests read the facts from the real output and files. The commands quoted in
examples/tour/README.md must be commands the tour ran, so the README cannot drift from it.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from geir.runtime.timeline import matplotlib_available
from geir.target_npu.target import load_target

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "tour" / "run_tour.py"
README = ROOT / "examples" / "tour" / "README.md"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_tour():
    spec = importlib.util.spec_from_file_location("run_tour", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


run_tour = _load_tour()


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    return run_tour.Tour(tmp_path_factory.mktemp("tour"), pictures=matplotlib_available(), echo=lambda text: None)


@pytest.fixture(scope="module")
def step1(tour):
    return run_tour.step1(tour)


@pytest.fixture(scope="module")
def step2(tour):
    return run_tour.step2(tour)


@pytest.fixture(scope="module")
def step3(tour):
    return run_tour.step3(tour)


@pytest.fixture(scope="module")
def step4(tour):
    return run_tour.step4(tour)


@pytest.fixture(scope="module")
def step5(tour):
    return run_tour.step5(tour)


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


# --- step 1: GE and the Runtime at the same time ---------------------------------------------------------

def test_step1_ge_compiles_the_next_part_while_the_runtime_runs(step1):
    o = step1.facts["overlap"]
    assert o["parts"] == 4
    # the first kernel ran before GE had compiled the whole graph
    assert o["first_kernel_us"] < o["compile_us"] <= o["serial_first_kernel_us"]
    assert o["end_to_end_us"] <= o["compile_then_run_us"]
    # a small model: microseconds of device work cannot hide milliseconds of GE, and the tour says so
    assert o["device_us"] < o["compile_us"] and step1.facts["verdict"].startswith("GE is the bottleneck")
    spans = step1.facts["overlap_spans"]
    compiles = [s for s in spans if s["track"] == "GE"]
    runs = [s for s in spans if s["track"] == "Runtime"]
    assert len(compiles) == len(runs) == 4
    # a LLaMA-7B-shaped stack: milliseconds of device work per part, behind which GE's compile hides
    # (how much depends on GE's measured host time, so on the machine's load: only the structure is pinned)
    big = step1.facts["overlap_big"]
    assert big["device_us"] > 100 * o["device_us"]
    assert big["hidden_us"] > 0 and big["end_to_end_us"] < big["compile_then_run_us"]
    assert big["first_kernel_us"] < big["serial_first_kernel_us"]
    assert "check: PASS" in step1.ran[1].stdout


def test_step1_ge_replans_between_the_runtimes_runs(tour, step1):
    story = step1.facts["story"]
    assert [(s["what"], s["run"]) for s in story] == [
        ("compile", None), ("re-plan", 0), ("run", 0), ("re-plan", 1), ("run", 1), ("run", 2)]
    run0, replan1 = story[2], story[3]
    assert replan1["start"] >= run0["end"] - 1e-3  # GE worked after run 0 (to 1 ns), for run 1's new length
    assert story[3]["arena"] > story[1]["arena"]  # 512 tokens need more device memory than 128
    outputs = np.load(tour.file("step1_outputs.npz"))
    assert outputs["run1.result0"].shape == (1, 512, 256)
    assert np.array_equal(outputs["run0.result0"], outputs["run2.result0"])  # the cached plan, the same inputs


def test_step1_draws_the_session(tour, step1):
    pytest.importorskip("matplotlib")
    assert _is_png(tour.file("step1_session.png"))


# --- step 2: fusion -------------------------------------------------------------------------------------

def test_step2_fused_attention_beats_the_op_by_op_graph(tour, step2):
    f = step2.facts
    assert f["kernels"]["fused"] == ["ge.flash_attention"]
    assert f["kernels"]["unfused"] == ["ge.matmul", "ge.mul", "ge.softmax", "ge.matmul"]
    assert f["ratio"] > 1
    fused, unfused = (run_tour.read_json(tour.file(f"step2_{k}.json")) for k in ("fused", "unfused"))
    # op by op, the scores and probabilities go out to HBM; the fused kernel's (through its GM workspace on the
    # 910B's split cores) stay in the L2, rewritten in place
    assert unfused["hbm_write_bytes"] > 2 * fused["hbm_write_bytes"]
    assert "remark: flash_attention fused" in step2.ran[0].stderr
    assert "check: PASS" in step2.ran[0].stdout


def test_step2_a_spelling_that_misses_says_why_and_runs_op_by_op(step2):
    f = step2.facts
    assert f["miss_reasons"] == ["the attention probabilities are also used elsewhere; fusing would drop them"]
    assert f["kernels"]["miss"] == f["kernels"]["unfused"]
    assert f["miss_ratio"] > 1


# --- step 3: the plan adapts --------------------------------------------------------------------------

def test_step3_each_new_shape_is_replanned_and_repeats_hit_the_cache(step3):
    runs = step3.facts["runs"]
    assert [r["replan"] for r in runs] == [True, True, False, True]
    assert step3.facts["plan_cache"]["hits"] == 1 and step3.facts["plan_cache"]["misses"] == 3
    arenas = [r["arena"] for r in runs if r["replan"]]
    # prefill gets its own memory plan; fused decode keeps only O in the arena, at any key length
    assert arenas[0] > arenas[1] == arenas[2]


def test_step3_shows_a_model_generating_text_with_its_plan_cache(step3):
    pytest.importorskip("transformers")
    g = step3.facts["generation"]
    assert g["steps"] == 12 and g["compiles"] == 2 and g["tokens_equal"]
    # the prompt's 16 slots, then decode at 32 slots (17 to 27 tokens): one plan each
    assert g["misses"] == 2 and g["hits"] == 10


def test_step3_decode_shapes_keep_the_fusion_on_the_flash_decoding_tiling(step3):
    # decode used to undo the fusion here; flash-decoding splits its keys over the idle cores instead
    prefill, decode, again, decode_long = step3.facts["runs"]
    assert prefill["kernels"] == again["kernels"] == decode["kernels"] == decode_long["kernels"] == ["ge.flash_attention"]
    assert all(run["fusion"] == "fusions kept" for run in (prefill, decode, decode_long))
    assert decode["retiled"] == 1 and decode_long["retiled"] == 0  # a longer key cache keeps the tiling
    (why,) = step3.facts["retiled"]
    assert "-> flash-decoding: Sq = 1 leaves 8 work unit(s) for 24 cores" in why


def test_the_tour_script_runs_a_step_from_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--step", "3", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "$ gerun examples/dynamic/attention_kv.geir --explain" in proc.stdout
    assert "=> plan cache after the four calls: 1 hit(s), 3 miss(es)" in proc.stdout


def test_a_failing_command_stops_the_tour_with_its_output(tmp_path):
    shown: list[str] = []
    t = run_tour.Tour(tmp_path, pictures=False, echo=shown.append)
    with pytest.raises(run_tour.TourError) as e:
        t.tool("gerun", t.file("missing.geir"))
    assert "'gerun $OUT/missing.geir' exited with 1" in str(e.value)
    assert "gerun: error: cannot read" in str(e.value) and "$OUT/missing.geir" in str(e.value)
    assert shown[0] == "$ gerun $OUT/missing.geir"


# --- step 4: tiling -----------------------------------------------------------------------------------

def test_step4_tilings_follow_dtype_head_dim_length_and_target(step4):
    table = step4.facts["table"]

    def block(graph, target="ascend910b"):
        t = table[graph][target]
        return t["template"], t["s1"], t["s2"], t.get("v_rows")

    base = block("main")
    assert block("f32_d128_s1024") != base  # dtype
    assert block("f16_d256_s1024") != base  # head dim
    assert block("f16_d128_s128") != base  # a short sequence: a CV block of its 128 keys
    assert block("f16_d128_s128", "ascend910a")[0] != block("main", "ascend910a")[0]  # on one core: another template
    assert block("f16_d128_s2048_1head")[1] < base[1]  # few query blocks: smaller s1 to fill the cores
    assert block("main", "ascend910a") != base  # target
    for graph, row in table.items():
        for target, t in row.items():
            assert t["ub_bytes"] <= load_target(target).buffer_bytes("ub"), (graph, target)


def test_step4_long_rows_are_split_into_segments(step4):
    table = step4.facts["table"]
    # the decode step stays fused (it used to be cut, its softmax row segmented): flash-decoding splits
    # its 32768 keys in parts for the cores 8 heads leave idle, 3 on the 910B's 24, 4 on the 910A's 32
    for target, parts in (("ascend910b", 3), ("ascend910a", 4)):
        decode = table["decode_f16_k32768"][target]
        assert (decode["op"], decode["template"], decode["segments"]) == ("ge.flash_attention", "Bn2S2FD", parts)
    # the 910B's CV-split schedule never splits a row's keys (ops-transformer's FA): it takes fewer rows instead
    wide = table["f32_d512_q512_k128"]
    assert wide["ascend910b"].get("segments", 1) == 1 and wide["ascend910b"]["s1"] < 128 and wide["ascend910b"]["preload"]
    assert wide["ascend910a"]["segments"] > 1 and wide["ascend310p"]["segments"] > 1
    # with 8 cube cores, 8 work units keep them all busy: the 310P runs the decode step unsplit
    decode = table["decode_f16_k32768"]["ascend310p"]
    assert decode["op"] == "ge.flash_attention" and decode["template"] == "S1s2Bn2gs1"
    assert step4.facts["segmented_check"]


# --- step 5: the Runtime's overlap -------------------------------------------------------------------------

def test_step5_double_buffering_overlaps_loads_with_compute(tour, step5):
    two, one = step5.facts["profiles"][2], step5.facts["profiles"][1]
    assert two["tiling"]["buffers"] == 2 and one["tiling"]["buffers"] == 1
    assert two["cube_ratio"] > one["cube_ratio"]
    assert two["cube_peak_fraction"] > one["cube_peak_fraction"]
    assert two["overlap_ratio"] > one["overlap_ratio"]
    assert two["kernel_us"] < one["kernel_us"]
    a, b = (np.load(tour.file(f"step5_buffers{n}.npz"))["result0"] for n in (2, 1))
    assert np.array_equal(a, b)  # the same kernel and the same numbers, only the schedule differs


def test_step5_draws_both_timelines(tour, step5):
    pytest.importorskip("matplotlib")
    for name in ("step5_buffers2.png", "step5_buffers1.png", "step5_side_by_side.png"):
        assert _is_png(tour.file(name)), name


# --- the README ---------------------------------------------------------------------------------------

def _without_timeline(command: str) -> str:
    """A command without its --timeline (the tour leaves it out when matplotlib is missing)."""
    return re.sub(r" --timeline \S+", "", command)


def test_the_readme_quotes_only_commands_the_tour_runs(step1, step2, step3, step4, step5):
    ran = {_without_timeline(r.command) for step in (step1, step2, step3, step4, step5) for r in step.ran}
    quoted = [_without_timeline(c) for c in re.findall(r"^\$ (.+)$", README.read_text(), re.MULTILINE)]
    assert quoted, "examples/tour/README.md quotes the tour's commands as '$ command' lines"
    assert set(quoted) <= ran, sorted(set(quoted) - ran)
    assert ran <= set(quoted), sorted(ran - set(quoted))  # and it shows every one of them
