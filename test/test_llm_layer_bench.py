"""bench/llm_layer.py's figures for one tiny model (LLaMA, f32), checked against what they must be.

Oracles: the lowered program itself (its `rt.launch` ops that are not views: the kernels launched; one kernel task
of the run per launch; a layer's own kernels are what the run of a model with one layer fewer lacks), the model's
config (one fused attention per layer; four matmuls per layer once q/k/v and gate/up merge, plus the LM head; two
rotations and two add-norms a layer), the raw kernel records of the run (the glue share recomputed from their cycles),
and torch in float64 (the accuracy verdict is geir.accuracy's). A family that stops prints its reason and the
table goes on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("llm_layer", ROOT / "bench" / "llm_layer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def llama(bench):
    return bench.measure("llama", "f32", layers=2, prompt=8)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_kernels_per_layer_are_the_programs_launches(llama, phase):
    run, figures = llama.phases[phase], llama.row[phase]
    launches = [op for op in run.program.ops if op.name == "rt.launch"]
    # every launch of the program is one kernel task of the run
    assert len(launches) == sum(t.kind == "kernel" for t in run.result.tasks)
    # a view (a reshape; a split or slice into runs of its operand's bytes) is an AI Core launch with no tiling: no device work
    is_view = [op.engine != "aicpu" and not op.attr("tiling") for op in launches]
    assert {op.attr("kernel") for op, view in zip(launches, is_view) if view} <= {"ge.reshape", "ge.split", "ge.slice"}
    assert all(k.cycles == 0 and k.cores == 0 for k, view in zip(run.result.kernels, is_view) if view)
    kernels = [op for op, view in zip(launches, is_view) if not view]
    assert figures["kernels"] == len(kernels)
    assert figures["kernels_per_layer"] == pytest.approx(len(kernels) / 2)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_every_layer_attends_once_and_fuses(llama, phase):
    figures = llama.row[phase]
    assert figures["attention_sites"] == 2 and figures["attention_fused"] == 2
    assert "attention_remark" not in figures


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_glue_share_is_the_non_matmul_non_attention_kernel_time(llama, phase):
    kernels = llama.phases[phase].result.kernels
    matmuls = [k for k in kernels if k.name in ("ge.matmul", "ge.fused_matmul")]
    assert len(matmuls) == 4 * 2 + 1  # merged q/k/v, o, merged gate/up, down per layer; the LM head
    total = sum(k.cycles for k in kernels)
    glue = sum(k.cycles for k in kernels if k.name not in ("ge.matmul", "ge.fused_matmul", "ge.flash_attention"))
    share = llama.row[phase]["glue_share"]
    assert 0.0 < share < 1.0
    assert share == pytest.approx(glue / total, rel=1e-9)


def test_both_steps_match_torch(llama):
    for phase in ("prefill", "decode"):
        figures = llama.row[phase]
        assert figures["accurate"], (phase, figures["rms_err"], figures["eager_rms_err"])


def test_a_family_that_stops_says_why_and_the_table_goes_on(bench, monkeypatch, capsys):
    import geir.frontends.generate as generate

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot trace this\nsecond line")

    monkeypatch.setattr(generate, "export_steps", refuse)
    row = bench.measure("llama", "f32").row
    assert not row["runs"] and row["stops"] == "export: RuntimeError: cannot trace this"
    assert bench.main(["--models", "llama", "--dtypes", "f32", "--skip-8b"]) == 0
    out = capsys.readouterr().out
    assert "stops at export: RuntimeError: cannot trace this" in out
    assert "every attention fused, prefill and decode (torch frontend): MISS (0/1 rows: llama f32 did not run)" in out


@pytest.fixture(scope="module")
def llama_one_layer(bench):
    return bench.measure("llama", "f32", layers=1, prompt=8)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_layers_own_kernels_are_what_one_more_layer_adds(llama, llama_one_layer, phase):
    one = llama_one_layer.row[phase]
    figures = llama.row[phase]
    assert figures["layer_kernels"] == figures["kernels"] - one["kernels"]
    own = figures["layer_kernels_by_type"]
    # the config's layer: merged q/k/v, o and down, and the merged gate/up with SwiGLU as its epilogue (no glu
    # launch of its own); q and k rotate, together in one launch; one attention; both residual adds fuse with the
    # norm after them (the second layer's input norm takes the first layer's sum)
    assert own["ge.matmul"] == 3 and own["ge.fused_matmul"] == 1 and "ge.glu" not in own
    assert own["ge.rotary_embedding"] == 1 and own["ge.flash_attention"] == 1
    assert own["ge.add_rms_norm"] == 2 and sum(own.values()) == figures["layer_kernels"]
