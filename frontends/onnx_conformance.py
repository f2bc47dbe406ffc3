"""ONNX's backend node tests run through GEIR: import, print and parse back, compile, run, compare.

`onnx` generates its node test cases in memory (`onnx.backend.test.case.node.collect_testcases`):
a one-node model (or its `_expanded` function body) with inputs and expected outputs. A case runs
the way `geimport` then `gerun` would: the model is imported, printed as GEIR text and parsed back,
compiled by a Runtime session with the default pipeline and run on the simulated chip, and each
output is compared as ONNX's backend runner does (`assert_allclose` at the case's rtol and atol,
with bf16 outputs allowed two bf16 ulps). Shared by test/test_onnx_conformance.py and
bench/onnx_conformance.py.

The node tests feed every input at run time, shapes and axes included, while GEIR needs those at
import time (its reshape, slice and reduce take them as attributes). A case refused only for that
also runs with its integer inputs after the first bound as constants (initializers holding the
case's values), as a graph compiler is given them; such results are marked `bound`.
"""

from __future__ import annotations

import functools
import io
import re
import warnings
from contextlib import redirect_stderr
from typing import Any

import attrs
import numpy as np

from geir.diagnostics import DiagnosticEngine, DiagnosticError
from geir.frontends.onnx import OnnxImportError, import_onnx
from geir.frontends.onnx_node import RUN_TIME_VALUE
from geir.ir import Module
from geir.parser import parse
from geir.printer import print_module
from geir.target_npu.target import DEFAULT_TARGET, Target, as_target
from geir.accuracy import TOLERANCES
from geir.types import DType

# Attention forms outside the fusion goal: a past key/value cache.
_NOT_FUSION_GOALS = re.compile(r"past")


@attrs.frozen
class CaseResult:
    """How one node test case went: "pass", "fail" or "unsupported", with the reason."""

    name: str
    op: str
    status: str
    detail: str = ""
    # run with its integer inputs (shapes, axes, indices) bound as constants
    bound: bool = False


@functools.cache
def node_cases() -> tuple[Any, ...]:
    """Every node test case ONNX generates (the generators' numpy warnings silenced)."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tuple(collect_testcases())


def case_op(case: Any) -> str:
    """The op a case tests: its one node's type, or for an `_expanded` case the op its body expands
    (ONNX names the body's values `OP_<case>_expanded_function_...`)."""
    nodes = case.model.graph.node
    if not is_expanded(case):
        return nodes[0].op_type if nodes else "?"
    marker = f"_{case.name.split('_expanded')[0]}_expanded_function_"
    for node in nodes:
        for out in node.output:
            if marker in out:
                return out.split(marker)[0]
    return nodes[0].op_type if nodes else "?"


def is_expanded(case: Any) -> bool:
    return "_expanded" in case.name


def fusion_goal(case: Any) -> bool:
    """An `_expanded` attention case that should fuse into one flash_attention (a softcap included): no cache, and
    no intermediate returned besides Y (a qk_matmul_output output keeps the scores alive)."""
    return (case.name.startswith("test_attention") and is_expanded(case) and len(case.model.graph.output) == 1
            and not _NOT_FUSION_GOALS.search(case.name))


def import_case(case: Any) -> tuple[Module, dict[str, np.ndarray]]:
    """The case's model as geimport writes it: imported, printed and parsed back (OnnxImportError passes through)."""
    module, weights = import_onnx(case.model)
    text = print_module(module)
    return parse(text, f"{case.name}.geir"), weights


def bind_int_inputs(case: Any) -> Any | None:
    """The case with its integer inputs after the first made initializers holding the case's values;
    None when there are none to bind or the first input would be bound too (nothing left to run)."""
    import copy

    from onnx import numpy_helper

    values = [_array(x) for x in case.data_sets[0][0]]
    inputs = list(case.model.graph.input)
    bind = [i for i, x in enumerate(values) if i > 0 and x.dtype.kind in "iu"]
    if not bind or not inputs or values[0].dtype.kind in "iu":
        return None
    model = type(case.model)()
    model.CopyFrom(case.model)
    del model.graph.input[:]
    model.graph.input.extend(vi for i, vi in enumerate(inputs) if i not in bind)
    model.graph.initializer.extend(numpy_helper.from_array(values[i], inputs[i].name) for i in bind)
    bound = copy.copy(case)
    bound.model = model
    bound.data_sets = [([x for i, x in enumerate(values) if i not in bind], case.data_sets[0][1])]
    return bound


def refusal(case: Any) -> OnnxImportError | None:
    """Why GEIR does not take the case (as given, or with its integer inputs bound), or None when it does.

    Only refusals as unsupported count: a malformed-model error or a crash is left to the run.
    """
    try:
        import_onnx(case.model)
        return None
    except OnnxImportError as e:
        if not e.unsupported:
            return None
        bound = bind_int_inputs(case) if RUN_TIME_VALUE in e.reason else None
        if bound is None:
            return e
        try:
            import_onnx(bound.model)
            return None
        except OnnxImportError as again:
            return again if again.unsupported else None
    except Exception:  # noqa: BLE001 - a crash is the run's to report
        return None


def run_case(case: Any, target: Target | str = DEFAULT_TARGET, bind: bool = True) -> CaseResult:
    """Import, compile and run one case on the simulated chip; compare with ONNX's expected outputs."""
    target = as_target(target)
    op = case_op(case)
    try:
        module, weights = import_case(case)
    except OnnxImportError as e:
        bound = bind_int_inputs(case) if bind and e.unsupported and RUN_TIME_VALUE in e.reason else None
        if bound is not None:
            result = run_case(bound, target, bind=False)
            if result.status != "unsupported":
                return attrs.evolve(result, name=case.name, op=op, bound=True)
        return CaseResult(case.name, op, "unsupported" if e.unsupported else "fail", str(e))
    try:
        outputs = _run(module, weights, [_array(x) for x in case.data_sets[0][0]], target)
    except DiagnosticError as e:
        return CaseResult(case.name, op, "fail", f"compile: {e}")
    except Exception as e:  # noqa: BLE001 - a failed run is a failed case, whatever raised it
        return CaseResult(case.name, op, "fail", f"run: {type(e).__name__}: {e}")
    problem = compare(outputs, [_array(x) for x in case.data_sets[0][1]], case.rtol, case.atol)
    return CaseResult(case.name, op, "fail" if problem else "pass", problem or "")


def _array(x: Any) -> np.ndarray:
    """A case's input or expected output as an array (some cases hold TensorProtos)."""
    from onnx import TensorProto, numpy_helper

    return numpy_helper.to_array(x) if isinstance(x, TensorProto) else np.asarray(x)


def _run(module: Module, weights: dict[str, np.ndarray], values: list[np.ndarray], target: Target) -> list[np.ndarray]:
    """What gerun does with a ge.graph: a Runtime session (default pipeline), one run."""
    from geir.runtime.interpreter import Runtime
    from geir.session import Session

    session = Session(module, target=target)
    graph = session.generic
    inputs = {}
    for arg, x in zip(graph.args, values):  # the model's inputs, in order
        with np.errstate(all="ignore"):
            inputs[arg.name] = np.asarray(x).astype(arg.type.dtype.np)
    program = session.program({k: v.shape for k, v in inputs.items()})
    with redirect_stderr(io.StringIO()):
        return list(Runtime(target).run(program, inputs, weights).outputs)


def compare(outputs: list[np.ndarray], expected: list[np.ndarray], rtol: float, atol: float) -> str | None:
    """Why the outputs differ from the expected ones as ONNX's backend runner judges, or None."""
    if len(outputs) != len(expected):
        return f"{len(outputs)} outputs, expected {len(expected)}"
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        out, ref = np.asarray(out), np.asarray(ref)
        if out.shape != ref.shape:
            return f"output {i} has shape {list(out.shape)}, expected {list(ref.shape)}"
        if out.dtype != ref.dtype:
            return f"output {i} is {out.dtype}, expected {ref.dtype}"
        tol = rtol
        if out.dtype.name == "bfloat16":
            tol = max(rtol, 2.0 ** -6)  # two bf16 ulps, as ONNX's runner allows
            out, ref = out.astype(np.float32), ref.astype(np.float32)
        elif out.dtype == np.float16:
            # two f16 ulps likewise: ONNX's expected f16 outputs come from f16 arithmetic step by step,
            # GEIR computes in f32 and rounds once (closer to the exact result, up to 2 ulps apart)
            tol = max(rtol, 2.0 ** -9)
        try:
            np.testing.assert_allclose(out, ref, rtol=tol, atol=atol)
        except AssertionError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip().startswith(("Mismatched", "Max"))]
            return f"output {i}: " + "; ".join(lines)
    return None


def fuse_attention(case: Any) -> tuple[int, list[str]]:
    """Flash attentions after the default pipeline's canonicalize and fuse, and the reasons of its misses."""
    from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline

    module, _ = import_case(case)
    remarks: list[str] = []
    pm = PassManager(complete_pipeline(parse_pipeline("canonicalize,fuse")))
    pm.run(module, PassContext(target=DEFAULT_TARGET, explain=True,
                               diagnostics=DiagnosticEngine(lambda d: remarks.append(d.message))))
    count = sum(1 for op in module.graph().ops if op.name == "ge.flash_attention")
    return count, [r for r in remarks if r.startswith("flash_attention not fused")]


# the attention tensors whose last axis is a head dim (or heads times one, for 3-D inputs)
_HEAD_DIM_LAST = ("Q", "K", "V", "past_key", "past_value", "present_key", "present_value", "Y")


def head_dim(case: Any) -> int:
    """The query/key head dim of an attention case (3-D inputs: the hidden size over q_num_heads)."""
    q = next(vi for vi in case.model.graph.input if vi.name == "Q")
    dims = [d.dim_value for d in q.type.tensor_type.shape.dim]
    if len(dims) == 4:
        return dims[-1]
    twin = {c.name: c for c in node_cases()}[case.name.split("_expanded")[0]]
    heads = next(a.i for a in twin.model.graph.node[0].attribute if a.name == "q_num_heads")
    return dims[-1] // heads


def widen_head_dim(case: Any, to: int = 16, seed: int = 0) -> Any:
    """The attention case with query/key head dim `to` (ONNX's cases use 8 or less; GEIR fuses from 16).

    The last axis of Q, K, V and the cache (inputs and outputs, and of Y) grows by `to` / head dim; the
    expanded bodies read every size from the inputs' shapes, so they stay valid. Those inputs get new
    random values (uniform in [0, 1) as ONNX's cases draw them, seeded); the expected outputs come
    from ONNX's reference implementation, and the tolerances are gerun --check's element-wise ones for
    the dtype (`geir.accuracy.TOLERANCES`; the fused kernel rounds the probabilities to half precision
    for the cube, as the spec allows). ONNX's outputs are the oracle here, so only the element-wise
    criterion applies: there is no eager baseline to allow an RMS error against.
    """
    import copy

    from onnx.reference import ReferenceEvaluator

    factor = to // head_dim(case)
    model = type(case.model)()
    model.CopyFrom(case.model)
    for vi in list(model.graph.input) + list(model.graph.output):
        if vi.name in _HEAD_DIM_LAST:
            dims = vi.type.tensor_type.shape.dim
            dims[len(dims) - 1].dim_value *= factor
    rng = np.random.default_rng(seed)
    inputs = []
    for vi, x in zip(model.graph.input, case.data_sets[0][0]):
        x = _array(x)
        if vi.name in _HEAD_DIM_LAST:
            shape = x.shape[:-1] + (x.shape[-1] * factor,)
            x = rng.random(shape).astype(x.dtype)
        inputs.append(x)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # fully masked rows make the reference's softmax warn
        expected = ReferenceEvaluator(model).run(None, {vi.name: x for vi, x in zip(model.graph.input, inputs)})
    wide = copy.copy(case)
    wide.model = model
    wide.data_sets = [(inputs, list(expected))]
    dtype = DType.from_numpy(inputs[0].dtype)
    wide.rtol, wide.atol = TOLERANCES.get(dtype, (case.rtol, case.atol))
    return wide
