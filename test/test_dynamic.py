"""GE and the Runtime cooperating while a program runs: re-fusion per shape and compile while running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import geir.passes.tile as tile_module
from geir.parser import parse
from geir.reference import run_graph
from geir.session.pipelined import cut_points, partition, run_pipelined
from geir.passes import complete_pipeline, parse_pipeline
from geir.session import Session, bind_shapes, compile_module, run_passes, run_program
from geir.tools.gerun import main as gerun_main

ROOT = Path(__file__).resolve().parent.parent
KV = ROOT / "examples" / "dynamic" / "attention_kv.geir"
F16 = (1e-2, 1e-3)


def close(a, b, rtol_atol=F16) -> bool:
    rtol, atol = rtol_atol
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return bool(np.all(np.abs(a - b) <= atol + rtol * np.abs(b)))


def kv_inputs(sq: int, skv: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 8, sq, 128)).astype(np.float16)
    k, v = (rng.standard_normal((1, 8, skv, 128)).astype(np.float16) for _ in range(2))
    return {"q": q, "k": k, "v": v}


def kernels(program) -> list[str]:
    return [op.attr("kernel") for op in program.ops if op.name == "rt.launch"]


# --- adaptive re-fusion ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kv_module():
    return parse(KV.read_text(), str(KV))


def test_the_generic_graph_is_fused_once(kv_module):
    session = Session(kv_module)
    assert [op.name for op in session.generic.ops if op.name != "ge.const"] == ["ge.flash_attention", "ge.return"]


def test_decode_shapes_stay_fused_on_the_flash_decoding_tiling(kv_module):
    # decode used to be unfused here (8 work units for 24 cores); flash-decoding splits the keys instead
    session = Session(kv_module)
    prefill = session.program({n: a.shape for n, a in kv_inputs(256, 256).items()})
    decode = session.program({n: a.shape for n, a in kv_inputs(1, 1024).items()})
    assert "ge.flash_attention" in kernels(prefill) and kernels(decode) == kernels(prefill)
    first, second = session.replans
    assert first.unfused == [] and second.unfused == []
    (line,) = second.retiled
    assert line.startswith("flash_attention at ") and "attention_kv.geir:" in line
    assert "-> flash-decoding: Sq = 1 leaves 8 work unit(s) for 24 cores: Skv 1024 split in 3 parts" in line


@pytest.mark.parametrize("sq,skv", [(256, 256), (1, 1024), (16, 512)])
def test_each_specialisation_matches_the_reference(kv_module, sq, skv):
    session = Session(kv_module)
    inputs = kv_inputs(sq, skv, seed=sq)
    program = session.program({n: a.shape for n, a in inputs.items()})
    out = run_program(program, inputs).outputs[0]
    ref = run_graph(kv_module.graphs[0], inputs, float64=True)[0]
    assert out.shape == (1, 8, sq, 128)
    assert close(out, ref)


def test_only_ops_whose_shapes_changed_are_tiled_again(kv_module, monkeypatch):
    calls: list[str] = []
    real = tile_module.tile_op

    def counting(op, chip, buffers):
        calls.append(op.name)
        return real(op, chip, buffers)

    monkeypatch.setattr(tile_module, "tile_op", counting)
    session = Session(kv_module)
    session.program({n: a.shape for n, a in kv_inputs(1, 1024).items()})
    first = list(calls)
    calls.clear()
    # a second decode length: the flash_attention's key length changes, nothing stays the same size
    session.program({n: a.shape for n, a in kv_inputs(1, 2048).items()})
    assert len(calls) == len(first)
    calls.clear()
    # the same shapes through another signature object: every tiling comes from the memo
    session.cache.clear()
    session.program({n: a.shape for n, a in kv_inputs(1, 2048).items()})
    assert calls == []
    assert session.replans[-1].retiled == []


def test_a_changed_tiling_is_reported_with_old_and_new(kv_module):
    session = Session(kv_module)
    session.program({n: a.shape for n, a in kv_inputs(1024, 1024).items()})
    session.program({n: a.shape for n, a in kv_inputs(128, 128).items()})
    (line,) = session.replans[-1].retiled
    old, new = line.split(" -> ")
    assert line.startswith("flash_attention at ") and "CV block 128 x 1024" in old and "CV block 128 x 128" in new


def test_a_static_graph_is_guarded_by_fuse_itself():
    def fused(q: str, kv: str) -> list[str]:
        text = KV.read_text().replace("%q: tensor<1x8x?x128xf16>", f"%q: tensor<{q}>") \
            .replace("-> tensor<1x8x?x128xf16>", f"-> tensor<{q}>").replace("tensor<1x8x?x128xf16>", f"tensor<{kv}>")
        module = parse(text, "static.geir")
        run_passes(module, complete_pipeline(parse_pipeline("canonicalize,fuse")), "ascend910b")
        return [op.name for op in module.graphs[0].ops]

    # a head dim no tiling holds fails the guard: fuse leaves the matmuls
    names = fused("1x1x16x2048xf16", "1x1x16x2048xf16")
    assert "ge.flash_attention" not in names and names.count("ge.matmul") == 2
    # decode (one row against 4096 keys) used to fail it too; flash-decoding keeps it fused
    assert "ge.flash_attention" in fused("1x8x1x128xf16", "1x8x4096x128xf16")


def test_gerun_explain_says_what_each_replan_changed(tmp_path, capsys):
    paths = []
    for name, (sq, skv) in {"pre": (256, 256), "dec": (1, 1024)}.items():
        paths.append(tmp_path / f"{name}.npz")
        np.savez(paths[-1], **{k: v.astype(np.float32) for k, v in kv_inputs(sq, skv).items()})
    argv = [str(KV), "--explain", "--check", "--trace", str(tmp_path / "t.json")]
    for p in paths + paths[:1]:
        argv += ["--inputs", str(p)]
    rc = gerun_main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert "re-plan for [1x8x256x128, 1x8x256x128, 1x8x256x128]" in lines[0] and "fusions kept" in lines[0]
    # decode keeps the fusion (it used to be undone) and is re-tiled for flash-decoding
    assert "fusions kept, 1 of 1 tiled op(s) re-tiled" in lines[1]
    assert "-> flash-decoding: " in lines[2]
    assert lines[3].endswith("plan cache hit, no re-plan")
    assert "remark: flash_attention unfused for this shape" not in err
    # the trace: each re-plan on the GE track just before the run it served, saying what changed
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spec = [e for e in events if e.get("tid") == 0 and e.get("pid") == 0 and e.get("ph") == "X"
            and e["name"].startswith("specialise")]
    assert len(spec) == 2 and spec[1]["args"]["retiled"] and spec[1]["args"]["run"] == 1
    runtime1 = [e for e in events if e.get("pid") == 1 and e.get("args", {}).get("run") == 1]
    runtime0 = [e for e in events if e.get("pid") == 1 and e.get("args", {}).get("run") == 0]
    assert max(e["ts"] + e["dur"] for e in runtime0) <= spec[1]["ts"] + 1e-6
    assert spec[1]["ts"] + spec[1]["dur"] <= min(e["ts"] for e in runtime1) + 1e-6


# --- compile while running ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "m.geir"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_model.py"), "--layers", "3", "--seq", "64",
                    "--hidden", "128", "--heads", "2", "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
    module = parse(out.read_text(), str(out))
    weights = dict(np.load(out.with_suffix(".npz")))
    rng = np.random.default_rng(0)
    g = module.graphs[0]
    inputs = {a.name: rng.standard_normal(a.type.shape).astype(a.type.dtype.np) for a in g.args}
    return module, weights, inputs


def test_cuts_fall_where_one_activation_crosses(model):
    module, _, inputs = model
    g = bind_shapes(module.graphs[0], tuple(a.shape for a in inputs.values()))
    cuts = cut_points(g)
    assert len(cuts) >= 3  # at least one per layer boundary
    parts = partition(g, 3)
    assert len(parts) == 3
    for p in parts[1:]:
        assert len(p.args) == 1  # the residual stream
    assert sum(len([o for o in p.ops if o.name not in ("ge.const", "ge.return")]) for p in parts) == \
        len([o for o in g.ops if o.name not in ("ge.const", "ge.return")])


def test_a_partitioned_run_gives_the_same_numbers_as_a_whole_one(model):
    module, weights, inputs = model
    whole = compile_module(parse(Path(module.file).read_text(), module.file), target="ascend910b")[0].graphs[0]
    expected = run_program(whole, inputs, weights).outputs
    run = run_pipelined(module, inputs, weights, parts=3)
    assert len(run.results) == 3
    assert all(close(a, b) for a, b in zip(run.outputs, expected))


def test_overlap_starts_the_first_kernel_before_the_last_part_is_compiled(model):
    module, weights, inputs = model
    run = run_pipelined(module, inputs, weights, parts=3)
    ovl, seq = run.schedule(True), run.schedule(False)
    compiled = [end for _, _, end in ovl.compile_spans]
    assert ovl.time_to_first_kernel_us < compiled[-1] <= seq.time_to_first_kernel_us
    assert seq.compile_hidden_us == 0.0
    # each part runs once compiled and once the part before it is done
    for (_, start, _), ready, prev in zip(ovl.run_spans, compiled, [(None, 0.0, 0.0)] + ovl.run_spans[:-1]):
        assert start == max(ready, prev[2])
    assert ovl.end_to_end_us <= seq.end_to_end_us == pytest.approx(sum(run.compile_us) + sum(run.run_us))
    trace = json.loads(run.trace())["traceEvents"]
    ge = [e for e in trace if e.get("ph") == "X" and e["tid"] == 0]
    rt = [e for e in trace if e.get("ph") == "X" and e["tid"] == 1]
    assert len(ge) == 3 and len(rt) == 3


def test_the_schedule_hides_compile_behind_long_runs_and_says_when_ge_is_the_bottleneck():
    # oracle: the schedule worked by hand. GE 10 us per part; parts of 100 us on the device hide the next compiles
    from geir.session.pipelined import Schedule

    long = Schedule.place(["a", "b", "c"], [10.0, 10.0, 10.0], [100.0, 100.0, 100.0], 1.0, overlap=True)
    assert long.run_spans == [("run a", 10.0, 110.0), ("run b", 110.0, 210.0), ("run c", 210.0, 310.0)]
    assert long.time_to_first_kernel_us == 11.0 and long.compile_hidden_us == 20.0 and long.end_to_end_us == 310.0
    # runs of 1 us cannot hide 10 us compiles: the device waits for GE
    short = Schedule.place(["a", "b", "c"], [10.0, 10.0, 10.0], [1.0, 1.0, 1.0], 0.5, overlap=True)
    assert short.run_spans == [("run a", 10.0, 11.0), ("run b", 20.0, 21.0), ("run c", 30.0, 31.0)]
    assert short.compile_hidden_us == 2.0 and short.end_to_end_us == 31.0
    assert Schedule.place(["a", "b", "c"], [10.0] * 3, [1.0] * 3, 0.5, overlap=False).end_to_end_us == 33.0


def test_gerun_overlap_compile(model, tmp_path, capsys):
    module, weights, inputs = model
    np.savez(tmp_path / "in.npz", **{k: v.astype(np.float32) for k, v in inputs.items()})
    rc = gerun_main([module.file, "--overlap-compile", "3", "--inputs", str(tmp_path / "in.npz"), "--check",
                     "--profile-json", str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "check: PASS" in out and "compile overlap: 3 parts on one timeline; first kernel at" in out
    assert "GE is the bottleneck" in out  # a small model: microseconds of device work, milliseconds of GE
    doc = json.loads((tmp_path / "p.json").read_text())["overlap_compile"]
    assert list(doc)[:4] == ["time_to_first_kernel_us", "compile_hidden_us", "end_to_end_us", "compile_then_run_us"]
    assert doc["parts"] == 3 and doc["time_to_first_kernel_us"] < doc["end_to_end_us"] <= doc["compile_then_run_us"]
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    rc = gerun_main([module.file, "--overlap-compile", "3", "--inject-fault", "dma@0"])
    assert rc == 2
