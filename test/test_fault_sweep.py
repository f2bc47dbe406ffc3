"""Every injected fault of every kind at every task index is recovered with bit-identical results
(spec section 7: reliability), on programs whose plans run kernels in place.

The oracle is the same program run without a fault: recovery must not change a single bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from geir.parser import parse_file, parse
from geir.runtime.interpreter import Runtime
from geir.session import DEFAULT_PIPELINE, NO_FUSE_PIPELINE, compile_module
from geir.target_npu import load_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

INPLACE = """ge.graph @main(%x: tensor<64x256xf32>) -> tensor<64x256xf32> {
  %c = ge.const dense<1.5> : tensor<f32>
  %a = ge.mul %x, %c
  %b = ge.mul %a, %c
  ge.return %b
}
"""


def chain(n: int) -> str:
    """A long elementwise chain: with --no-fuse every op is a kernel writing over its operand."""
    ops = ["%v0 = ge.exp %x"] + [f"%v{i} = ge.{'mul' if i % 3 else 'add'} %v{i - 1}, %c" for i in range(1, n)]
    body = "\n  ".join(ops)
    return (f"ge.graph @main(%x: tensor<32x512xf16>) -> tensor<32x512xf16> {{\n  %c = ge.const dense<0.5> : "
            f"tensor<f16>\n  {body}\n  ge.return %v{n - 1}\n}}\n")


ATTENTION = """ge.graph @main(%q: tensor<1x2x200x64xf16>, %k: tensor<1x2x200x64xf16>, %v: tensor<1x2x200x64xf16>) -> tensor<1x2x200x64xf16> {
  %s = ge.matmul %q, %k {transpose_b = true}
  %c = ge.const dense<0.125> : tensor<f16>
  %t = ge.mul %s, %c
  %p = ge.softmax %t
  %o = ge.matmul %p, %v
  ge.return %o
}
"""

PROGRAMS = {
    "inplace-mul": (lambda: parse(INPLACE), NO_FUSE_PIPELINE),
    "chain-30": (lambda: parse(chain(30)), NO_FUSE_PIPELINE),
    "unfused-attention": (lambda: parse(ATTENTION), NO_FUSE_PIPELINE),
    "fused-attention": (lambda: parse(ATTENTION), DEFAULT_PIPELINE),
    "gpt2-block-unfused": (lambda: parse_file(str(EXAMPLES / "gpt2_block.geir")), NO_FUSE_PIPELINE),
    "gpt2-block": (lambda: parse_file(str(EXAMPLES / "gpt2_block.geir")), DEFAULT_PIPELINE),
}


def _inputs(program) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {a.name: rng.standard_normal(a.type.shape).astype(a.type.dtype.np) for a in program.args}


@pytest.fixture(scope="module", params=sorted(PROGRAMS))
def case(request):
    load, pipeline = PROGRAMS[request.param]
    module = load()
    resources = module.resources
    if not resources and (EXAMPLES / "gpt2_block.npz").exists() and request.param.startswith("gpt2"):
        resources = dict(np.load(EXAMPLES / "gpt2_block.npz"))
    module, _ = compile_module(module, pipeline)
    program = module.graphs[0]
    inputs = _inputs(program)
    runtime = Runtime(load_target("ascend910b"))
    clean = runtime.run(program, inputs, resources)
    return request.param, program, inputs, resources, clean


def _kernels(clean) -> int:
    return len(clean.kernels)


def _transfers(clean) -> int:
    return sum(1 for t in clean.tasks if t.kind in ("h2d", "d2h"))


def test_the_plans_run_kernels_in_place(case):
    name, program, *_ = case
    # the point of the sweep: some launch writes its result over one of its operands
    offsets = {}
    inplace = 0
    for op in program.ops:
        if op.name == "rt.launch":
            operand_offsets = {offsets.get(id(v)) for v in op.operands}
            inplace += any(o in operand_offsets for o in op.offsets)
            for r, o in zip(op.results, op.offsets):
                offsets[id(r)] = o
    if name in ("inplace-mul", "chain-30", "unfused-attention", "gpt2-block-unfused"):
        assert inplace > 0


@pytest.mark.parametrize("kind", ["core", "dma", "ub_overflow"])
def test_every_fault_at_every_index_is_recovered_bit_identically(case, kind):
    name, program, inputs, resources, clean = case
    count = _transfers(clean) if kind == "dma" else _kernels(clean)
    assert count > 0
    for n in range(count):
        hurt = Runtime(load_target("ascend910b"), faults=[(kind, n)]).run(program, inputs, resources)
        for a, b in zip(hurt.outputs, clean.outputs):
            assert a.tobytes() == b.tobytes(), f"{name}: {kind}@{n} changed the results"
        (record,) = hurt.faults
        assert (record["kind"], record["task"]) == (kind, n) and record["recovery"]
