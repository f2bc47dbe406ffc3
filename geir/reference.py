"""The reference interpreter: runs a graph op by op with each op's numpy semantics.

This is the single home of what every op computes (the `compute` method of its class);
constant folding, `gerun --check` and kernel tests all call into it. It runs in one of two modes:

- eager (the default): each op in its own precision, as a framework's eager mode runs it. Elementwise
  ops on f16 and bf16 compute in f32 and round to the op's dtype once per op; matmuls and reductions
  (softmax and the norms among them) accumulate in f32 and round the result to the op's dtype; f32
  ops compute in f32 and integers exactly. A fused op is one op, rounded once, except that
  `ge.fused_elementwise` rounds each step as the ops it stands for would. This is both what constant
  folding must produce (the unfolded op's bits) and the baseline whose error `gerun --check` allows
  a result (`geir.accuracy`).
- float64 (`float64=True`): every float value is held in float64 from the inputs on (each first
  cast to its argument's dtype, as the device sees it): the reference a result is judged against.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from geir.ir import Graph, Operation
from geir.ops.numerics import round_to
from geir.ops.core import Const
from geir.traits import Terminator
from geir.types import TensorType
from geir.verifier import inferred_types


class ReferenceRunError(RuntimeError):
    """A graph the reference cannot run (missing input, missing weight, wrong input shape)."""


def run_op(op: Operation, args: list[np.ndarray], float64: bool = False,
           resources: Mapping[str, np.ndarray] | None = None,
           result_types: list[TensorType | None] | None = None) -> list[np.ndarray]:
    """Evaluate one op on arrays, eagerly (results rounded to their result dtypes) or in float64 on request.

    `result_types` stands in for results whose type the IR does not spell out; a result with neither
    comes back as computed.
    """
    if isinstance(op, Const):
        out = [op.compute(dict(resources or {}))]
    else:
        if float64:
            args = [a.astype(np.float64) if _is_float(a) else a for a in args]
        out = op.compute(*args)
        out = list(out) if isinstance(out, tuple) else [out]
    types = result_types or [r.type for r in op.results]
    return [_as_result(a, t, float64) for a, t in zip(out, types)]


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f" or a.dtype.name == "bfloat16"


def _as_result(a: np.ndarray, t: TensorType | None, float64: bool) -> np.ndarray:
    a = np.asarray(a)
    if t is None:
        return a
    if float64 and t.dtype.is_float:
        return a.astype(np.float64, copy=False)
    if a.dtype != t.dtype.np:
        a = round_to(a, t.dtype.np)
    return a


def run_graph(graph: Graph, inputs: Mapping[str, np.ndarray], float64: bool = False,
              resources: Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
    """Run a graph eagerly (or in float64) on named inputs (argument names without `%`); returns its results in order.

    Inputs are cast to each argument's dtype (and then to float64 with `float64=True`).
    """
    inferred = inferred_types(graph)
    env: dict[int, np.ndarray] = {}
    for arg in graph.args:
        if arg.name not in inputs:
            raise ReferenceRunError(f"no input given for argument '%{arg.name}'")
        a = np.asarray(inputs[arg.name])
        t = arg.type
        if len(a.shape) != t.rank or any(d is not None and d != s for d, s in zip(t.shape, a.shape)):
            raise ReferenceRunError(f"input '%{arg.name}' has shape {list(a.shape)}, expected {t}")
        a = a.astype(t.dtype.np)  # the device sees the input in the argument's dtype
        env[id(arg)] = a.astype(np.float64) if float64 and t.dtype.is_float else a
    results: list[np.ndarray] = []
    remaining_uses = {}
    for op in graph.ops:
        for v in op.operands:
            remaining_uses[id(v)] = remaining_uses.get(id(v), 0) + 1
    for op in graph.ops:
        args = [env[id(v)] for v in op.operands]
        if op.has_trait(Terminator):
            results = args
            break
        try:
            types = [r.type or inferred.get(id(r)) for r in op.results]
            outs = run_op(op, args, float64, resources, types)
        except KeyError as e:
            raise ReferenceRunError(f"{op.loc}: weight '{e.args[0]}' is not in the weights archive") from None
        for r, a in zip(op.results, outs):
            env[id(r)] = a
        # free intermediates as soon as their last user ran, so long graphs stay small
        for v in op.operands:
            remaining_uses[id(v)] -= 1
            if remaining_uses[id(v)] == 0:
                env.pop(id(v), None)
    return results
