"""Gated linear units (Shazeer 2020, "GLU Variants Improve Transformer") as one op: act(gate) * up, the
product a LLaMA-style MLP feeds its down projection (SwiGLU: silu; GeGLU: gelu), as ops-transformer's
SwiGlu / GeGluV2 and torch_npu's `npu_swiglu` compute it: from the two matmul results, or from one tensor whose
last axis holds gate then up (the merged gate-up matmul's output, which `npu_swiglu(x, dim=-1)` halves itself)."""

from __future__ import annotations

import numpy as np

from geir.builder import create_op
from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.numerics import broadcast_dims, require_float, work
from geir.traits import Elementwise, Fused, InPlaceCapable
from geir.types import TensorType

# activation name -> the op (and attributes) whose semantics it is
GATE_ACTIVATIONS = {"silu": ("ge.silu", {}), "gelu": ("ge.gelu", {"approximate": "none"}),
                    "gelu_tanh": ("ge.gelu", {"approximate": "tanh"})}


@op("ge.glu")
class Glu(Operation):
    """act(gate) * up elementwise (numpy broadcasting), the activation's f32 result multiplied before one rounding;
    with one operand, gate and up are its last axis's first and second halves."""

    OPERAND_NAMES = ("gate", "up?")
    # elementwise (element i of the product from element i of each operand), but fused: no chain nests it
    TRAITS = (Elementwise, InPlaceCapable, Fused)
    VECTOR_PASSES = None  # the activation's passes and the multiply, counted by its own kernel (kernels/glu.py)
    activation = Attr(str, default="silu", choices=tuple(GATE_ACTIVATIONS))

    def infer(self, gate: TensorType, up: TensorType | None = None) -> TensorType:
        require_float(gate, "gate")
        if up is None:
            if not gate.rank:
                raise ShapeError(f"the merged gate and up {gate} have no last axis to halve")
            last = gate.shape[-1]
            if last is not None and last % 2:
                raise ShapeError(f"the merged gate and up {gate} need an even last axis to halve")
            return gate.with_shape(gate.shape[:-1] + (None if last is None else last // 2,))
        if gate.dtype != up.dtype:
            raise ShapeError(f"gate {gate} and up {up} differ in dtype")
        return TensorType(broadcast_dims(gate.shape, up.shape), gate.dtype)

    def activation_op(self) -> Operation:
        """A detached op of the gate's activation (its semantics are the ones `compute` applies)."""
        name, attributes = GATE_ACTIVATIONS[self.activation]
        return create_op(name, [], [], attributes)

    def compute(self, gate: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
        if up is None:
            gate, up = halves(gate)
        return self.activation_op().compute(work(gate)) * work(up)


def halves(merged: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gate and up halves of a merged gate-up tensor's last axis (views)."""
    half = merged.shape[-1] // 2
    return merged[..., :half], merged[..., half:]
