"""Ops that fusion creates: a chain of elementwise ops as one vector kernel, matmul with an epilogue.

Both reuse the semantics of the ops they stand for (each step runs that op's own `compute`), so
a fused graph computes what the unfused one did, step for step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from geir.builder import create_op
from geir.ir import Operation
from geir.opdef import OPS, Attr, ShapeError, lookup, op, ops_with_trait
from geir.ops.glu import GATE_ACTIVATIONS
from geir.ops.linalg import Matmul
from geir.ops.numerics import broadcast_dims, round_to, work
from geir.traits import Elementwise, Fused, InPlaceCapable
from geir.types import DType, TensorType


def chainable(kind: Operation | type[Operation]) -> bool:
    """Whether a fused_elementwise body may chain this op (or op kind): elementwise, and not itself fused."""
    return kind.has_trait(Elementwise) and not kind.has_trait(Fused)


def chainable_ops() -> tuple[str, ...]:
    """The names of the op kinds a fused_elementwise body may chain, sorted."""
    return tuple(name for name in ops_with_trait(Elementwise) if chainable(OPS[name]))


def _step_op(step: dict[str, Any]) -> Operation:
    """A detached op standing for one step of a fused body (for its shape rule and semantics)."""
    return create_op(step["op"], [], [], step.get("attrs"))


@op("ge.fused_elementwise")
class FusedElementwise(Operation):
    """A chain of elementwise ops run as one vector kernel.

    `body` lists the steps in order: `{op = "ge.mul", args = [0, 1]}`; argument i < #operands is
    operand i, and #operands + j is the result of step j. The last step is the result.
    """

    OPERAND_NAMES = ("x+",)
    TRAITS = (Elementwise, InPlaceCapable, Fused)
    VECTOR_PASSES = None  # its steps' passes, added up by the kernel
    body = Attr(list)

    def verify(self) -> str | None:
        if not self.body:
            return "fused_elementwise needs at least one step in its body"
        n = len(self.operands)
        for j, step in enumerate(self.body):
            if not isinstance(step, dict) or not isinstance(step.get("op"), str) or not isinstance(step.get("args"), list):
                return f"body step {j} must be a dictionary {{op = \"ge.NAME\", args = [...]}}"
            cls = lookup(step["op"])
            if cls is None or not chainable(cls):
                return f"body step {j}: '{step['op']}' is not an elementwise op"
            arity = len(cls.OPERAND_NAMES)
            if len(step["args"]) != arity:
                return f"body step {j}: {step['op']} takes {arity} argument{'s' * (arity != 1)}, got {len(step['args'])}"
            for a in step["args"]:
                if not isinstance(a, int) or isinstance(a, bool) or not 0 <= a < n + j:
                    return f"body step {j}: argument {a} must name an operand or an earlier step (0..{n + j - 1})"
            attrs = step.get("attrs", {})
            if not isinstance(attrs, dict):
                return f"body step {j}: attrs must be a dictionary"
            for key, spec in cls.ATTRS.items():
                if key in attrs:
                    why = spec.check(attrs[key])
                    if why:
                        return f"body step {j}: {why}"
                elif spec.required:
                    return f"body step {j}: {step['op']} needs attribute '{key}'"
        return None

    def step_types(self, *types: TensorType) -> list[TensorType]:
        """The type of every operand and step value, in body numbering."""
        values = list(types)
        for step in self.body:
            t = _step_op(step).infer(*[values[a] for a in step["args"]])
            values.append(TensorType(t.shape, t.dtype))
        return values

    def infer(self, *types: TensorType) -> TensorType:
        return self.step_types(*types)[-1]

    def compute(self, *xs: np.ndarray) -> np.ndarray:
        # Round each step to its dtype as the unfused graph would, unless the reference runs in
        # float64 (then every step keeps full precision, as unfused ops do there too). The dtypes
        # come from the arrays, since operands written without a type have none in the IR.
        float64 = any(x.dtype == np.float64 for x in xs)
        types = None if float64 else self.step_types(*[TensorType(x.shape, DType.from_numpy(x.dtype)) for x in xs])
        values = list(xs)
        for j, step in enumerate(self.body):
            out = _step_op(step).compute(*[values[a] for a in step["args"]])
            if types is not None:
                out = np.asarray(out).astype(types[len(xs) + j].dtype.np, copy=False)
            values.append(out)
        return values[-1]


ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
GLUS = ("none",) + tuple(GATE_ACTIVATIONS)


@op("ge.fused_matmul")
class FusedMatmul(Matmul):
    """matmul with an epilogue: `act(a @ b + bias)`, the bias and activation applied in f32 before the result is rounded;
    or `glu(a @ b)` (`glu` names the gate's activation): the gated linear unit of the f32 product's two halves of
    the last axis (gate, then up), N/2 columns rounded once (the gate-up matmul with SwiGLU as its epilogue)."""

    OPERAND_NAMES = ("a", "b", "bias?")
    TRAITS = (Fused,)
    activation = Attr(str, default="none", choices=ACTIVATIONS)
    glu = Attr(str, default="none", choices=GLUS)

    def verify(self) -> str | None:
        if self.glu != "none" and (self.activation != "none" or len(self.operands) > 2):
            return "a glu epilogue takes neither an activation nor a bias"
        return super().verify()

    def infer(self, a: TensorType, b: TensorType, bias: TensorType | None = None) -> TensorType:
        out = super().infer(a, b)
        if self.glu != "none":
            return self.glu_op().infer(out)
        if bias is not None:
            if bias.dtype != out.dtype:
                raise ShapeError(f"bias dtype {bias.dtype} differs from the matmul's {out.dtype}")
            if broadcast_dims(out.shape, bias.shape) != out.shape:
                raise ShapeError(f"bias {bias} does not broadcast to the matmul result {out}")
        return out

    def compute(self, a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        return self.epilogue(super().compute(a, b), bias)

    def flops(self) -> float:
        """The cube's work on the whole product: a glu epilogue's result has half its columns."""
        return super().flops() * (2 if self.glu != "none" else 1)

    def glu_op(self) -> Operation:
        """A detached ge.glu of this op's gate activation (its semantics are the glu epilogue's)."""
        return create_op("ge.glu", [], [], {"activation": self.glu})

    def epilogue(self, y: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """Bias add and activation on the f32 product (the matmul kernel runs it on each accumulator tile)."""
        if bias is not None:
            y = y + work(bias)
        if self.glu != "none":
            return self.glu_op().compute(y)
        act = self.activation
        if act == "none":
            return y
        name, attrs = ("ge.gelu", {"approximate": "tanh"}) if act == "gelu_tanh" else (f"ge.{act}", {})
        return _step_op({"op": name, "attrs": attrs}).compute(y)


class _AddNorm(Operation):
    """A residual add and the norm of its sum, both results kept: `(sum, norm(sum))` (ops-transformer's AddRmsNorm /
    AddLayerNorm). The sum is rounded to its dtype before it is normalised, as the unfused add's result is; the
    norm is the norm op's own semantics."""

    TRAITS = (Fused,)
    NUM_RESULTS = 2
    NORM: str = ""
    # Vector instructions per element of a row tile (the row kernels' counting): the add, then the norm's own
    # (rms_norm: square, sum, scale, mul gamma; layer_norm: sum, sub, square, sum, scale, mul gamma, add beta),
    # of which the statistics pass of a segmented row does ROW_STAT_PASSES (the add included).
    ROW_PASSES: int = 0
    ROW_STAT_PASSES: int = 0
    # passes of a segmented row's first read of x2 alone, before the statistics pass (x2 normalised first: its own)
    PRE_STAT_PASSES: int = 0

    def norm_op(self) -> Operation:
        """A detached norm op with this op's attributes, whose semantics the result follows."""
        return create_op(self.NORM, [], [], {k: v for k, v in self.attributes.items() if k in ("axis", "epsilon")})

    def infer(self, x1: TensorType, x2: TensorType, *params: TensorType) -> tuple[TensorType, TensorType]:
        if x1.dtype != x2.dtype:
            raise ShapeError(f"the residual {x2} and the input {x1} differ in dtype")
        # the same shape, a dim one side knows and the other leaves `?` taken as known (as shapes are bound in
        # turn, one operand can learn a dim before the other does)
        if x1.rank != x2.rank or any(a is not None and b is not None and a != b for a, b in zip(x1.shape, x2.shape)):
            raise ShapeError(f"the residual {x2} is not shaped like the input {x1}")
        x = TensorType(tuple(a if a is not None else b for a, b in zip(x1.shape, x2.shape)), x1.dtype)
        y = self.norm_op().infer(x, *params)
        return x, y

    def compute(self, x1: np.ndarray, x2: np.ndarray, *params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        total = _step_op({"op": "ge.add"}).compute(x1, x2)
        if x1.dtype != np.float64:  # the unfused add rounds its result before the norm reads it
            total = round_to(np.asarray(total), x1.dtype)
        return total, self.norm_op().compute(total, *params)


@op("ge.add_rms_norm")
class AddRmsNorm(_AddNorm):
    """`s = x1 + x2; (s, rms_norm(s, gamma))`."""

    OPERAND_NAMES = ("x1", "x2", "gamma")
    NORM = "ge.rms_norm"
    ROW_PASSES, ROW_STAT_PASSES = 5, 3
    epsilon = Attr(float, default=1e-6)


@op("ge.add_layer_norm")
class AddLayerNorm(_AddNorm):
    """`s = x1 + x2; (s, layer_norm(s, gamma, beta))` over the axes from `axis` to the last."""

    OPERAND_NAMES = ("x1", "x2", "gamma", "beta")
    NORM = "ge.layer_norm"
    ROW_PASSES, ROW_STAT_PASSES = 8, 5
    axis = Attr(int, default=-1)
    epsilon = Attr(float, default=1e-5)


@op("ge.rms_norm_add_rms_norm")
class RmsNormAddRmsNorm(_AddNorm):
    """`s = x1 + rms_norm(x2, x2_gamma); (s, rms_norm(s, gamma))`: a sandwich-norm block's output norm, the residual
    add and the next block's input norm in one pass over the rows (Gemma2's post-attention norm, residual add and
    pre-feedforward norm; its post-feedforward norm, residual add and the next layer's input norm). ops-nn's
    AddRmsNorm (norm/add_rms_norm: x1 + x2 and its RmsNorm, both written) with x2 first normalised on the same row
    tile, as its RmsNorm (norm/rms_norm) would. x2's norm is rounded to its dtype before the add, as the unfused
    norm's result is; the rest is ge.add_rms_norm's semantics."""

    OPERAND_NAMES = ("x1", "x2", "x2_gamma", "gamma")
    NORM = "ge.rms_norm"
    # x2's norm (square, sum, scale, mul gamma), then ge.add_rms_norm's 5; a segmented row first reads x2 for its
    # statistics (square, sum: PRE_STAT_PASSES), then applies x2's norm, adds and accumulates the sum's statistics
    # (scale, mul gamma, add, square, sum), then applies the sum's norm (scale, mul gamma)
    ROW_PASSES, ROW_STAT_PASSES, PRE_STAT_PASSES = 9, 7, 2
    epsilon = Attr(float, default=1e-6)
    x2_epsilon = Attr(float, default=1e-6)

    def x2_norm_op(self) -> Operation:
        """A detached ge.rms_norm with x2's epsilon, whose semantics x2's norm follows."""
        return create_op(self.NORM, [], [], {"epsilon": self.x2_epsilon})

    def infer(self, x1: TensorType, x2: TensorType, x2_gamma: TensorType,
              gamma: TensorType) -> tuple[TensorType, TensorType]:
        return super().infer(x1, self.x2_norm_op().infer(x2, x2_gamma), gamma)

    def compute(self, x1: np.ndarray, x2: np.ndarray, x2_gamma: np.ndarray,
                gamma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.x2_norm_op().compute(x2, x2_gamma)
        if x2.dtype != np.float64:  # the unfused norm rounds its result before the add reads it
            n = round_to(np.asarray(n), x2.dtype)
        return super().compute(x1, n, gamma)
