"""Runtime fault recovery: a failed transfer is retried, a stopped core's work moves to the others, a
tile that does not fit is re-tiled by its kernel; results stay bit-identical and every fault is recorded."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from geir.kernels import KERNELS
from geir.kernels.tiling import TilingAttrError
from geir.parser import parse
from geir.runtime.interpreter import Runtime, RuntimeFailure
from geir.runtime.profile import profile
from geir.session import NO_FUSE_PIPELINE, compile_module
from geir.target_npu import load_target
from geir.target_npu.target import TARGET_DIR

UNFUSED = """ge.graph @main(%q: tensor<1x2x200x64xf16>, %k: tensor<1x2x200x64xf16>, %v: tensor<1x2x200x64xf16>) -> tensor<1x2x200x64xf16> {
  %s = ge.matmul %q, %k {transpose_b = true}
  %c = ge.const dense<0.125> : tensor<f16>
  %t = ge.mul %s, %c
  %p = ge.softmax %t
  %o = ge.matmul %p, %v
  ge.return %o
}
"""


@pytest.fixture(scope="module")
def program():
    module, _ = compile_module(parse(UNFUSED), NO_FUSE_PIPELINE)
    return module.graphs[0]


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(7)
    return {n: rng.standard_normal((1, 2, 200, 64)).astype(np.float32) for n in "qkv"}


def _run(program, inputs, faults=(), target="ascend910b"):
    return Runtime(load_target(target), faults=faults).run(program, inputs)


def test_program_has_several_kernels(program) -> None:
    assert [op.kernel for op in program.ops if op.name == "rt.launch"] == ["ge.matmul", "ge.mul", "ge.softmax",
                                                                          "ge.matmul"]


@pytest.mark.parametrize("fault", [("dma", 0), ("dma", 2), ("dma", 3), ("core", 0), ("core", 2),
                                   ("ub_overflow", 0), ("ub_overflow", 1), ("ub_overflow", 2), ("ub_overflow", 3)])
def test_recovery_gives_bit_identical_results(program, inputs, fault) -> None:
    clean = _run(program, inputs)
    hurt = _run(program, inputs, [fault])
    assert np.array_equal(hurt.outputs[0], clean.outputs[0])
    (record,) = hurt.faults
    assert (record["kind"], record["task"]) == fault and record["recovery"]
    assert profile(hurt)["faults"] == hurt.faults
    # a retried copy and a lost kernel attempt cost time; a re-tiled kernel failed before it started
    assert record.get("cost_us", 0) > 0 if fault[0] != "ub_overflow" else "error" in record


def test_a_stopped_core_stays_stopped(program, inputs) -> None:
    hurt = _run(program, inputs, [("core", 1)])
    assert hurt.cores.count == load_target("ascend910b").cube_cores - 1
    assert "re-dispatched to the 23 remaining cores" in hurt.faults[0]["recovery"]


def test_several_faults_in_one_run(program, inputs) -> None:
    clean = _run(program, inputs)
    hurt = _run(program, inputs, [("dma", 1), ("core", 0), ("ub_overflow", 3)])
    assert np.array_equal(hurt.outputs[0], clean.outputs[0])
    assert sorted(f["kind"] for f in hurt.faults) == ["core", "dma", "ub_overflow"]


def test_faults_past_the_program_are_errors(program, inputs) -> None:
    with pytest.raises(RuntimeFailure, match="cannot inject core@9: the program has only 4 kernel launches"):
        _run(program, inputs, [("core", 9)])


def test_the_last_core_stopping_cannot_be_recovered(program, inputs, tmp_path) -> None:
    text = (TARGET_DIR / "ascend910b.toml").read_text()
    one = tmp_path / "one_core.toml"
    one.write_text(text.replace('name = "ascend910b"', 'name = "one_core"').replace("cube = 24", "cube = 1"))
    one_core_program = compile_module(parse(UNFUSED), NO_FUSE_PIPELINE, str(one))[0].graphs[0]
    with pytest.raises(RuntimeFailure, match="the only core stopped during kernel #0"):
        _run(one_core_program, inputs, [("core", 0)], target=str(one))


def test_a_program_lowered_for_another_chip_is_refused(program, inputs) -> None:
    with pytest.raises(RuntimeFailure, match="lowered for target 'ascend910b', not 'ascend910a'"):
        _run(program, inputs, target="ascend910a")


def _tiling(template: str, **blocks):
    """A typed tiling of the kernel whose template this is, with these blocks (the rest filled in)."""
    kernel = next(k for k in [*KERNELS.values(), *(k for _, k in KERNELS.by_trait)] if template in k.TILING.TEMPLATES)
    fields = {f.name: 1 for f in attrs.fields(kernel.TILING) if f.default is attrs.NOTHING}
    return kernel, kernel.TILING(**{**fields, "template": template, "buffers": 2} | blocks)


@pytest.mark.parametrize("tiling, key, value", [
    ({"template": "S1s2Bn2gs1", "s1": 128, "s2": 128, "ub_bytes": 1000}, "s1", 64),
    ({"template": "MatmulBasicBlock", "base_m": 128, "base_n": 128, "base_k": 64, "single_core_m": 128,
      "single_core_n": 128}, "base_m", 64),
    ({"template": "VectorRow", "rows": 6, "cols": 256}, "rows", 3),
    ({"template": "VectorElementwise", "elems": 704}, "elems", 352),
])
def test_shrink_halves_the_parallel_block(tiling, key, value) -> None:
    kernel, typed = _tiling(**tiling)
    shrunk, change = kernel.shrink(typed)
    new = shrunk.to_attr()
    assert new[key] == value and change == f"{key} {tiling[key]} -> {value}"
    assert all(new[k] == v for k, v in tiling.items() if k not in (key, "ub_bytes"))


def test_no_smaller_tiling_below_the_smallest_block() -> None:
    # at the smallest block a double-buffered tiling gives up its second buffer, then there is nothing left
    kernel, typed = _tiling("S1Bn2gs1", s1=16, s2=128)
    single, change = kernel.shrink(typed)
    assert single.buffers == 1 and single.s1 == 16 and change == "buffers 2 -> 1"
    assert kernel.shrink(single) is None
    kernel, typed = _tiling("VectorRow", rows=1, buffers=1)
    assert kernel.shrink(typed) is None
    with pytest.raises(TilingAttrError, match="template 'Unknown' is not one of"):
        KERNELS["ge.flash_attention"].decode({"template": "Unknown", "s1": 16, "s2": 16, "d": 16, "buffers": 2,
                                               "cores": 1, "ub_bytes": 1, "segments": 1, "l1_bytes": 1,
                                               "l0a_bytes": 1, "l0b_bytes": 1, "l0c_bytes": 1})


def test_device_memory_the_host_cannot_allocate_is_a_runtime_failure(program, inputs, monkeypatch) -> None:
    # the simulated device's bytes are the host's: where numpy cannot allocate them, the Runtime says so (which
    # program, how many bytes and why) instead of letting a MemoryError escape; a timing-only run holds none
    import geir.runtime.interpreter as interpreter

    def no_memory(size: int, backed: bool = True):
        if backed:
            raise MemoryError(f"Unable to allocate {size} bytes")
        return real(size, backed)

    real = interpreter.DeviceMemory
    monkeypatch.setattr(interpreter, "DeviceMemory", no_memory)
    with pytest.raises(RuntimeFailure, match=r"this host cannot hold the \d+ bytes of device memory @main computes "
                                             r"its numbers in \(inputs \d+, constants \d+, arena \d+\): run it "
                                             r"timing only"):
        _run(program, inputs)
    assert Runtime(load_target("ascend910b"), timing_only=True).run(program, inputs) is not None
