"""Structural ops: constants and the graph terminator."""

from __future__ import annotations

import numpy as np

from geir.attributes import DenseAttr, DenseResourceAttr
from geir.ir import Operation, Value
from geir.opdef import Attr, op
from geir.traits import NoKernel, Terminator


@op("ge.const")
class Const(Operation):
    """A constant: `dense<...>` literal or `dense_resource<"key">` from the weights archive."""

    TRAITS = (NoKernel,)
    value = Attr("dense")

    def verify(self) -> str | None:
        t = self.results[0].type
        if t is None:
            return "a constant needs its result type, e.g. `: tensor<4xf32>`"
        if isinstance(self.value, DenseAttr):
            return self.value.check_against(t)
        return None

    def infer(self):
        return self.results[0].type

    def compute(self, resources: dict | None = None) -> np.ndarray:
        """The constant's array; `resources` resolves `dense_resource` keys."""
        t = self.results[0].type
        if isinstance(self.value, DenseResourceAttr):
            if resources is None or self.value.key not in resources:
                raise KeyError(self.value.key)
            return np.asarray(resources[self.value.key]).astype(t.dtype.np, copy=False)
        return self.value.to_array(t)


def literal_array(v: Value) -> np.ndarray | None:
    """The elements of `v` when a valid dense literal defines it (splats broadcast), else None."""
    producer = v.owner
    # a literal its type cannot hold (`dense<[]> : tensor<1xi64>`) has its own error at the constant: the
    # ops that read it see no elements rather than fail on them
    if (isinstance(producer, Const) and isinstance(producer.value, DenseAttr) and v.type is not None
            and producer.value.check_against(v.type) is None):
        return producer.value.to_array(v.type)
    return None


@op("ge.return")
class Return(Operation):
    """The graph's results."""

    OPERAND_NAMES = ("x*",)
    NUM_RESULTS = 0
    TRAITS = (Terminator, NoKernel)

    def infer(self, *types):
        return ()

    def compute(self, *xs):
        return ()
