"""layout changes storage formats only: values are unchanged and every cube operand gets the format its target wants."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from geir.diagnostics import DiagnosticEngine
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.passes.layout import CUBE_OPS
from geir.reference import run_graph
from geir.tools.geopt import split_chunks

SOURCES = [Path(__file__).parent / "lit" / "passes" / name for name in ("layout.geir", "fuse-rules.geir")]


def _graphs() -> list[str]:
    return [text for path in SOURCES for text, _ in split_chunks(path.read_text(), True)]


def _run(text: str, pipeline: str, target: str):
    module = parse(text)
    errors = []
    ctx = PassContext(target=target, diagnostics=DiagnosticEngine(errors.append))
    assert PassManager(complete_pipeline(parse_pipeline(pipeline))).run(module, ctx), errors
    return module.graphs[0]


@pytest.mark.parametrize("target", ["ascend910b", "ascend910a", "ascend310p"])
@pytest.mark.parametrize("index", range(len(_graphs())))
def test_layout_keeps_values_and_formats_cube_operands(target: str, index: int) -> None:
    text = _graphs()[index]
    before = parse(text).graphs[0]
    after = _run(text, "fuse,layout", target)
    rng = np.random.default_rng(index)
    inputs = {a.name: rng.standard_normal(a.type.shape) for a in before.args}
    for a, b in zip(run_graph(before, inputs, float64=True), run_graph(after, inputs, float64=True)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    nd2nz = target == "ascend910b"
    for op in after.ops:
        if op.name in CUBE_OPS:
            for v in op.operands[:2]:
                source = v.owner.operands[0] if v.owner is not None and v.owner.name == "ge.trans_data" else v
                weight = source.owner is not None and source.owner.name == "ge.const"
                want = "NZ" if weight or not nd2nz else "ND"
                assert v.type.format == want, (op, v)
        elif op.name != "ge.trans_data":
            assert all(v.type.format == "ND" for v in op.operands), op
    # conversions never stack: no trans_data feeds another
    assert not any(op.name == "ge.trans_data" and op.operands[0].owner is not None
                   and op.operands[0].owner.name == "ge.trans_data" for op in after.ops)
