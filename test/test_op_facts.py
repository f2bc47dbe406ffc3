"""What the kernels know about an op lives on the op (issue 27 item 1): a new row-wise op that declares the row
facts is tiled, lowered and run end to end with no kernel edit; one that does not is refused when it is
registered; the facts of the existing ops are the analytic counts of their Ascend C sequences."""

from __future__ import annotations

import numpy as np
import pytest

from geir.kernels import KERNELS
from geir.kernels.vector import elementwise_passes
from geir.ir import Operation
from geir.opdef import OPS, op
from geir.ops.reductions import Reduce
from geir.parser import parse
from geir.session import DEFAULT_PIPELINE, compile_module, run_program
from geir.traits import Elementwise, RowWise


@pytest.fixture
def reduce_min():
    """ge.reduce_min, registered as the existing reductions are (and taken out again after the test)."""
    cls = op("ge.reduce_min")(type("ReduceMin", (Reduce,), {"fn": staticmethod(np.min), "__doc__": "reduce_min",
                                                             "ROW_PASSES": 1, "SEGMENT_STATISTIC": "min"}))
    yield cls
    OPS.pop("ge.reduce_min", None)


@pytest.mark.parametrize("cols", [96, 20000])  # one tile per row, and rows too long for UB: segments merged
def test_a_new_row_op_with_the_facts_runs_end_to_end(reduce_min, cols):
    assert "ge.reduce_min" in KERNELS and type(KERNELS["ge.reduce_min"]).__name__ == "RowKernel"
    text = (f"ge.graph @main(%x: tensor<64x{cols}xf32>) -> tensor<64xf32> {{\n"
            "  %y = ge.reduce_min %x {axes = [1]}\n  ge.return %y\n}\n")
    program = compile_module(parse(text), DEFAULT_PIPELINE)[0].graphs[0]
    launch = next(o for o in program.ops if o.name == "rt.launch")
    assert launch.kernel == "ge.reduce_min"
    x = np.random.default_rng(0).standard_normal((64, cols)).astype(np.float32)
    out = run_program(program, {"x": x}).outputs[0]
    np.testing.assert_array_equal(out, x.min(axis=1))  # numpy's own min is the oracle


def _register_refused(name: str, cls: type, match: str) -> None:
    try:
        with pytest.raises(TypeError, match=match):
            op(name)(cls)
    finally:
        OPS.pop(name, None)


def test_an_op_without_the_facts_its_trait_needs_is_refused_when_registered():
    bare = {"OPERAND_NAMES": ("x",), "compute": lambda self, x: x}
    _register_refused("ge.row_odd", type("RowOdd", (Operation,), {**bare, "TRAITS": (RowWise,)}),
                      "ge.row_odd has the RowWise trait but does not declare ROW_PASSES, ROW_STAT_PASSES, "
                      "SEGMENT_STATISTIC, row_axes")
    _register_refused("ge.odd", type("Odd", (Operation,), {**bare, "TRAITS": (Elementwise,)}),
                      "ge.odd has the Elementwise trait but does not declare VECTOR_PASSES")
    _register_refused("ge.reduce_odd", type("ReduceOdd", (Reduce,), {"SEGMENT_STATISTIC": "median"}),
                      "SEGMENT_STATISTIC 'median' is not one of sum, max, min")
    assert not {"ge.row_odd", "ge.odd", "ge.reduce_odd"} & set(OPS)


def test_the_existing_facts_are_the_ascend_c_sequences():
    # per element: softmax = max, sub, exp, sum, div; layer norm = sum, sub, square, sum, scale, mul, add;
    # rms norm = square, sum, scale, mul; reduce_mean = sum, scale
    rows = {n: (OPS[n].ROW_PASSES, OPS[n].ROW_STAT_PASSES) for n in OPS if OPS[n].has_trait(RowWise)}
    assert rows == {"ge.softmax": (5, 3), "ge.layer_norm": (7, 4), "ge.rms_norm": (4, 2), "ge.reduce_sum": (1, None),
                    "ge.reduce_max": (1, None), "ge.reduce_mean": (2, None)}
    assert [elementwise_passes(f"ge.{n}") for n in ("add", "exp", "pow", "rsqrt", "sigmoid", "silu", "gelu")] == \
        [1, 1, 3, 2, 3, 4, 8]
    assert OPS["ge.softmax"].row_axes({"axis": 1}, 3) == (1,) and OPS["ge.layer_norm"].row_axes({"axis": -2}, 3) \
        == (1, 2) and OPS["ge.rms_norm"].row_axes({}, 4) == (3,)
