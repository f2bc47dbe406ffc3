"""A tiling carries its schedule and its target (issue 27 item 2; spec section 8: `rt.program` carries `target`).

Oracles: attention written in float64 numpy, the byte counts of the tensors and of the CV-split workspace's slots
(ops-transformer's FlashAttentionScore design: preload + 1 S and P slots, 2 P V slots per AIC), the number of
launches a program holds, and the target names the command line was given.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from geir.diagnostics import DiagnosticError
from geir.kernels import KERNELS
from geir.kernels.base import Kernel
from geir.parser import parse
from geir.printer import print_module
from geir.runtime.interpreter import RuntimeFailure, Runtime, load_tilings
from geir.session.pipeline import compile_module, run_passes
from geir.passes import complete_pipeline, parse_pipeline
from geir.target_npu import load_target
from geir.tools.gedoctor import main as gedoctor_main
from geir.tools.gerun import main as gerun_main
from geir.verifier import verify_module

ONCHIP_910B = "ascend910b[separate_cube_vector=0]"
B, N, S, D = 1, 8, 128, 64
ATTENTION = f"""
ge.graph @main(%q: tensor<{B}x{N}x{S}x{D}xf16>, %k: tensor<{B}x{N}x{S}x{D}xf16>, %v: tensor<{B}x{N}x{S}x{D}xf16>)
    -> tensor<{B}x{N}x{S}x{D}xf16> {{
  %o = ge.flash_attention %q, %k, %v
  ge.return %o
}}
"""
OUT_BYTES = B * N * S * D * 2  # the attention's f16 output: the only tensor the arena holds besides a workspace


def _inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((B, N, S, D)).astype(np.float16) for name in ("q", "k", "v")}


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(d)) v in float64."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _planned(target: str):
    """The attention graph fused, tiled and planned for `target` (not lowered: its op shows tiling and workspace)."""
    module = parse(ATTENTION)
    run_passes(module, complete_pipeline(parse_pipeline("fuse,tile,plan")), target)
    return module.graphs[0]


def _program(target: str):
    return compile_module(parse(ATTENTION), "fuse,tile,plan", target)[0].graphs[0]


@pytest.mark.parametrize("target", [ONCHIP_910B, "ascend910b", "ascend910a"])
def test_the_schedule_is_the_tilings_and_the_workspace_is_there_iff_it_is_cv_split(target):
    chip = load_target(target)
    graph = _planned(target)
    fa = next(op for op in graph.ops if op.name == "ge.flash_attention")
    tiling = KERNELS["ge.flash_attention"].decode(fa.attributes["tiling"])
    # the schedule was decided for the compile target: CV-split exactly where cube and vector are separate cores
    assert tiling.cv_split == chip.separate_cube_vector
    program = _program(target)
    arena = program.attributes["memory"]["arena"]
    if tiling.cv_split:
        s1, s2, slots = tiling.s1, tiling.s2, tiling.preload + 1
        per_aic = slots * s1 * s2 * 4 + slots * s1 * s2 * 2 + 2 * s1 * tiling.d * 4  # S f32, P f16, P V f32
        assert fa.attributes["workspace"][1] == tiling.cores * per_aic
        assert arena == OUT_BYTES + tiling.cores * per_aic
    else:
        assert "workspace" not in fa.attributes and arena == OUT_BYTES
    assert program.attributes["target"] == chip.name


def test_a_program_lowered_without_split_cores_is_refused_on_the_910b_and_runs_where_it_was_lowered():
    # the probe: lowered for a 910B whose cube and vector share a core (no workspace in the arena), run on
    # the real 910B, whose kernel would time the CV-split schedule with nowhere to put S and P
    program = _program(ONCHIP_910B)
    assert program.attributes["memory"]["arena"] == OUT_BYTES
    with pytest.raises(RuntimeFailure, match=re.escape(f"lowered for target '{ONCHIP_910B}', not 'ascend910b'")):
        Runtime(load_target("ascend910b")).run(program, _inputs())
    inputs = _inputs()
    out = Runtime(load_target(ONCHIP_910B)).run(program, inputs).outputs[0]
    assert np.allclose(out.astype(np.float64), _attention(**inputs), atol=2e-3, rtol=2e-2)


def test_gerun_refuses_another_target_as_a_located_usage_error_naming_both(tmp_path, capsys):
    path = tmp_path / "onchip.geir"
    path.write_text(print_module(compile_module(parse(ATTENTION), "fuse,tile,plan", ONCHIP_910B)[0]))
    assert gerun_main([str(path), "--timing-only"]) == 2  # the program is fine; the command asked for another chip
    err = capsys.readouterr().err
    line = path.read_text().splitlines()[0]
    m = re.match(rf"{re.escape(str(path))}:1:(\d+): error: (.*)", err)
    assert m, err
    assert line[int(m.group(1)) - 1:].startswith("target = ")  # the caret is at the attribute
    assert f"'{ONCHIP_910B}'" in m.group(2) and "'ascend910b'" in m.group(2)
    assert "Traceback" not in err
    # gedoctor, which runs the program too, refuses it alike
    assert gedoctor_main([str(path)]) == 2
    assert capsys.readouterr().err.startswith(m.group(0))
    # the same chip, its what-if spec written another way: it runs
    assert gerun_main([str(path), "--timing-only", "--target", "ascend910b[ separate_cube_vector = 0 ]"]) == 0


def test_a_program_without_a_target_runs_and_says_which_target_it_is_taken_for(tmp_path, capsys):
    text = print_module(compile_module(parse(ATTENTION), "fuse,tile,plan", "ascend910a")[0])
    old = tmp_path / "old.geir"
    old.write_text(re.sub(r', target = "[^"]*"', "", text))
    assert "target" not in old.read_text()
    assert gerun_main([str(old), "--timing-only", "--target", "ascend910a"]) == 0
    err = capsys.readouterr().err
    assert "note: rt.program @main records no target" in err and "taken as lowered for 'ascend910a'" in err


def test_the_target_attribute_round_trips_and_a_malformed_one_is_a_located_error():
    text = print_module(compile_module(parse(ATTENTION), "fuse,tile,plan", ONCHIP_910B)[0])
    assert f'target = "{ONCHIP_910B}"' in text
    again = parse(text)
    assert again.graphs[0].attributes["target"] == ONCHIP_910B and print_module(again) == text
    bad = text.replace(f'target = "{ONCHIP_910B}"', "target = 3")
    with pytest.raises(DiagnosticError) as e:
        verify_module(parse(bad, "bad.geir"))
    d = e.value.diagnostics[0]
    assert "'target' names the chip it was lowered for" in d.message
    assert bad.splitlines()[d.loc.line - 1][d.loc.col - 1:].startswith("target = 3")


MANY = """
ge.graph @main(%x: tensor<64x256xf32>, %w: tensor<256x256xf32>) -> tensor<64x256xf32> {
  %a = ge.matmul %x, %w
  %b = ge.relu %a
  %c = ge.softmax %b {axis = -1}
  %d = ge.matmul %c, %w
  %e = ge.exp %d
  ge.return %e
}
"""


def test_a_programs_tilings_are_decoded_once_per_load_not_per_launch_or_run(monkeypatch):
    program = compile_module(parse(MANY), "tile,plan", "ascend910b")[0].graphs[0]
    launches = [op for op in program.ops if op.name == "rt.launch" and op.attributes.get("tiling")]
    assert len(launches) == 5
    decoded: list[object] = []
    plain = Kernel.decode

    def counting(self, attr, what="tiling"):
        decoded.append(attr)
        return plain(self, attr, what)

    monkeypatch.setattr(Kernel, "decode", counting)
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((64, 256)).astype(np.float32),
              "w": rng.standard_normal((256, 256)).astype(np.float32) / 16}
    runtime = Runtime(load_target("ascend910b"))
    first = runtime.run(program, inputs).outputs[0]
    second = Runtime(load_target("ascend910b")).run(program, inputs).outputs[0]  # another Runtime, the same load
    assert len(decoded) == len(launches)  # each launch's tiling once, over two runs
    assert np.array_equal(first, second)
    # a launch whose tiling attribute was replaced since (another text for it): the program is decoded again
    launches[0].attributes["tiling"] = dict(launches[0].attributes["tiling"])
    load_tilings(program, load_target("ascend910b"))
    assert len(decoded) == 2 * len(launches)
