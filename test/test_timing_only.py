"""A timing-only run (`Runtime(timing_only=True)`, `gerun --timing-only`) times exactly what a full run
times: every task, every pipe interval and every profile figure are identical, on programs that
reach every kernel family (attention with and without masks, matmuls with epilogues, row ops
segmented and not, copies, views), fused and unfused.

The oracle is the full run of the same program: the kernels' timing never reads a value.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from geir.parser import parse, parse_file
from geir.runtime.interpreter import Runtime, RuntimeFailure
from geir.runtime.profile import profile
from geir.session import DEFAULT_PIPELINE, NO_FUSE_PIPELINE, compile_module
from geir.target_npu import load_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# a layer norm over rows too long for UB (segmented), a reduction over a leading axis, a concat
ROWS = """ge.graph @main(%x: tensor<4x40000xf32>, %g: tensor<40000xf32>, %b: tensor<40000xf32>, %y: tensor<8x16x32xf16>) -> (tensor<4x40000xf32>, tensor<16x32xf16>, tensor<16x64xf16>) {
  %n = ge.layer_norm %x, %g, %b {axis = -1, epsilon = 1.0e-05}
  %s = ge.reduce_sum %y {axes = [0], keepdims = false}
  %t = ge.transpose %s {perm = [1, 0]}
  %c = ge.concat %t, %t {axis = 1}
  %r = ge.reshape %c {shape = [16, 64]}
  ge.return %n, %s, %r
}
"""

# an embedding lookup (whole rows, and rows too long for UB in pieces), running sums over several tiles
# of steps and along the last axis, an arange and the float tests
INDEXING = """ge.graph @main(%w: tensor<500x96xf16>, %ids: tensor<4x33xi64>, %long: tensor<6x70000xf32>, %j: tensor<5xi32>, %m: tensor<3000x40xf32>, %n: tensor<2x77xi64>) -> (tensor<4x33x96xf16>, tensor<5x70000xf32>, tensor<3000x40xf32>, tensor<2x77xi64>, tensor<3000xi32>, tensor<3000x40xi1>, tensor<4x33x96xi1>) {
  %e = ge.gather %w, %ids {axis = 0}
  %g = ge.gather %long, %j {axis = 0}
  %c = ge.cumsum %m {axis = 0, exclusive = true}
  %p = ge.cumsum %n {axis = 1, reverse = true}
  %a = ge.arange {start = 0, limit = 3000, dtype = i32}
  %nan = ge.isnan %m
  %inf = ge.isinf %e
  ge.return %e, %g, %c, %p, %a, %nan, %inf
}
"""

# ops GE places on the AI CPU (f64, and an i32 matmul the cube has no mode for) between AI Core kernels
AICPU = """ge.graph @main(%a: tensor<64x128xf16>, %b: tensor<128x64xf16>, %i: tensor<16x32xi32>, %j: tensor<32x8xi32>) -> (tensor<64x64xf16>, tensor<16x8xi32>) {
  %m = ge.matmul %a, %b
  %w = ge.cast %m {to = f64}
  %e = ge.tanh %w
  %n = ge.cast %e {to = f16}
  %r = ge.add %n, %m
  %k = ge.matmul %i, %j
  ge.return %r, %k
}
"""

PROGRAMS = [
    ("attention.geir", DEFAULT_PIPELINE), ("attention.geir", NO_FUSE_PIPELINE),
    ("gpt2_block.geir", DEFAULT_PIPELINE), ("gpt2_block.geir", NO_FUSE_PIPELINE),
    ("attention/additive_mask.geir", DEFAULT_PIPELINE), ("attention/bool_mask.geir", DEFAULT_PIPELINE),
    ("attention/causal.geir", DEFAULT_PIPELINE), ("attention/gqa.geir", DEFAULT_PIPELINE),
    ("doctor/single_buffer.geir", None), ("doctor/vector_bound.geir", DEFAULT_PIPELINE),
    ("tour/step4_tiling.geir", DEFAULT_PIPELINE), (ROWS, DEFAULT_PIPELINE), (INDEXING, DEFAULT_PIPELINE),
    (AICPU, DEFAULT_PIPELINE),
]


def _program(source: str, pipeline: str | None):
    module = parse(source, "inline.geir") if source.startswith("ge.graph") else parse_file(str(EXAMPLES / source))
    weights = EXAMPLES / Path(source).with_suffix(".npz") if not source.startswith("ge.graph") else None
    resources = dict(np.load(weights)) if weights is not None and weights.exists() else {}
    if pipeline is not None:
        module = compile_module(module, pipeline, "ascend910b")[0]
    return module.graphs[0], resources


def _figures(result) -> str:
    tasks = [(t.kind, t.name, t.stream, t.start_us, t.end_us, t.engine) for t in result.tasks]
    pipes = [(iv.name, iv.pipe, iv.cores.tolist(), np.asarray(iv.start).tolist(), np.asarray(iv.end).tolist())
             for iv in result.cores.intervals]
    return json.dumps([profile(result), tasks, pipes, result.load_us], sort_keys=True, default=str)


@pytest.mark.parametrize("source, pipeline", PROGRAMS, ids=[p[0][:24] + (" no-fuse" if p[1] == NO_FUSE_PIPELINE
                                                                          else "") for p in PROGRAMS])
def test_timing_only_times_what_the_full_run_times(source, pipeline):
    program, resources = _program(source, pipeline)
    rng = np.random.default_rng(0)
    inputs = {a.name: rng.standard_normal(a.type.shape).astype(a.type.dtype.np) for a in program.args}
    target = load_target("ascend910b")
    full = Runtime(target, record_pipes=True).run(program, inputs, resources)
    timed = Runtime(target, record_pipes=True, timing_only=True).run(program, {}, {})
    assert full.outputs and not timed.outputs
    assert full.kernels, "the program launches kernels"
    assert _figures(timed) == _figures(full)


def test_timing_only_needs_neither_inputs_nor_weights():
    # gpt2_block's weights are dense_resource constants: a full run without them is refused
    program, _ = _program("gpt2_block.geir", DEFAULT_PIPELINE)
    target = load_target("ascend910b")
    with pytest.raises(RuntimeFailure, match="no input given"):
        Runtime(target).run(program, {}, {})
    assert Runtime(target, timing_only=True).run(program, {}, {}).kernels


HOST_MEASURED = {"host_ge_us", "end_to_end_us", "plan_cache"}  # GE's real host time: differs run to run


def test_gerun_timing_only_profile_equals_the_full_runs(tmp_path, capsys):
    from geir.tools import gerun

    model = str(EXAMPLES / "gpt2_block.geir")
    full, timed = tmp_path / "full.json", tmp_path / "timed.json"
    assert gerun.main([model, "--profile-json", str(full)]) == 0
    assert gerun.main([model, "--timing-only", "--profile-json", str(timed), "--weights", str(tmp_path / "none.npz")]) == 0
    assert "no values computed" in capsys.readouterr().out
    a, b = json.loads(full.read_text()), json.loads(timed.read_text())
    assert a.keys() == b.keys()
    assert {k: v for k, v in a.items() if k not in HOST_MEASURED} == {k: v for k, v in b.items() if k not in HOST_MEASURED}


@pytest.mark.parametrize("flag", [["--output", "out.npz"], ["--check"]])
def test_gerun_timing_only_refuses_what_needs_values(flag, tmp_path, capsys):
    from geir.tools import gerun

    assert gerun.main([str(EXAMPLES / "attention.geir"), "--timing-only", *flag]) == 2
    assert "--timing-only computes no values" in capsys.readouterr().err


def test_a_model_from_a_hugging_face_config_runs_timing_only(tmp_path):
    # the config's numbers become the graph's shapes; prefill with SDPA attention, then one decode step
    import subprocess
    import sys

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
                                  "num_hidden_layers": 2, "torch_dtype": "float16", "model_type": "llama"}))
    make = [sys.executable, str(EXAMPLES / "make_model.py"), "--config", str(config), "--no-weights"]
    prefill, decode = tmp_path / "prefill.geir", tmp_path / "decode.geir"
    subprocess.run(make + ["--seq", "256", "--attention", "sdpa", "-o", str(prefill)], check=True, capture_output=True)
    subprocess.run(make + ["--decode", "512", "-o", str(decode)], check=True, capture_output=True)
    target = load_target("ascend910b")
    p_prog = compile_module(parse_file(str(prefill)), DEFAULT_PIPELINE, "ascend910b")[0].graphs[0]
    assert [a.type.shape for a in p_prog.args] == [(1, 256, 256)]
    flash = [op for op in p_prog.ops if op.name == "rt.launch" and op.kernel == "ge.flash_attention"]
    assert len(flash) == 2 and all(op.attrs.get("causal") for op in flash)
    mlp = [op for op in p_prog.ops if op.name == "rt.launch" and op.results[0].type.shape[-1] == 688]
    assert len(mlp) == 2  # the config's intermediate_size
    d_prog = compile_module(parse_file(str(decode)), DEFAULT_PIPELINE, "ascend910b")[0].graphs[0]
    assert [a.type.shape for a in d_prog.args] == [(1, 1, 256)] + [(1, 4, 512, 64)] * 4
    assert len(d_prog.result_types) == 1 + 4
    for program in (p_prog, d_prog):
        assert Runtime(target, timing_only=True).run(program, {}, {}).kernels


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 1, 6), (2, 3, 4, 5), (1, 9, 1)])
def test_timing_only_results_are_laid_out_as_real_ones_and_hold_no_bytes(shape):
    from geir.kernels.base import no_bytes, no_bytes_c

    real = np.empty(shape, np.float16)  # the oracle: a real result's layout
    fake = no_bytes_c(shape, np.float16)
    assert fake.shape == shape and fake.strides == real.strides and not fake.flags.writeable
    # a copy kernel times a slice by its contiguity: every slice of the fake lays out as the real one's
    for axis in range(len(shape)):
        for lo, hi in [(0, 1), (0, shape[axis]), (1, shape[axis])]:
            cut = (slice(None),) * axis + (slice(lo, hi),)
            assert fake[cut].flags.c_contiguous == real[cut].flags.c_contiguous, (axis, lo, hi)
    holder = fake.base
    while not isinstance(holder, np.ndarray):  # as_strided's wrapper, then the one element behind it
        holder = holder.base
    assert holder.nbytes == np.dtype(np.float16).itemsize
    stand = no_bytes(shape, np.float32)
    assert stand.shape == shape and not any(stand.strides) and not stand.flags.writeable


def test_an_unbacked_device_view_of_a_pool_larger_than_the_host_holds_no_bytes():
    from geir.runtime.device import DeviceMemory
    from geir.types import DType, TensorType

    pool = TensorType(((60 << 30) // (32 * 128 * 2), 32, 128), DType.f16)  # 60 GiB of f16 keys
    device = DeviceMemory(pool.nbytes + 4096, backed=False)
    view = device.view(4096, pool)
    assert view.shape == pool.shape and view.dtype == np.float16 and not any(view.strides)
