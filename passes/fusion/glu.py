"""A gated linear unit written out, act(gate) * up (LLaMA's SwiGLU MLP, GeGLU), becomes one `ge.glu`.

It runs before the matmul epilogue rule, so the gate's activation is not taken into the gate matmul
while the product that needs it stays a separate kernel.
"""

from __future__ import annotations

from geir.ir import Operation, Value
from geir.passes.fusion.match import defining
from geir.passes.pattern import Match, Miss, Pattern, Rewriter

_GATES = ("ge.silu", "ge.gelu")


def _written_silu(v: Value) -> tuple[Value, list[Operation]] | None:
    """(x, [mul, sigmoid]) when v is x * sigmoid(x) (SiLU as ONNX exporters write it), else None."""
    mul = defining(v, "ge.mul")
    if mul is None:
        return None
    for side in (0, 1):
        sig = defining(mul.operands[side], "ge.sigmoid")
        if sig is not None and sig.operands[0] is mul.operands[1 - side]:
            return sig.operands[0], [mul, sig]
    return None


def _activation(op: Operation) -> str:
    if op.name == "ge.gelu":
        return "gelu_tanh" if op.approximate == "tanh" else "gelu"
    return "silu"


class FuseGlu(Pattern):
    """silu(gate) * up (SwiGLU; silu also as gate * sigmoid(gate)) or gelu(gate) * up (GeGLU) -> ge.glu."""

    NAME, ROOT, BENEFIT, EXPLAIN = "glu", "ge.mul", 30, True

    def match(self, mul: Operation) -> Match | Miss | None:
        if _written_silu(mul.result) is not None:
            return None  # a SiLU itself; the product that uses it is the candidate
        for side in (0, 1):
            act = defining(mul.operands[side], *_GATES)
            written = _written_silu(mul.operands[side]) if act is None else None
            if act is None and written is None:
                continue
            gate, inner = (act.operands[0], [act]) if act is not None else written
            name = act.name[3:] if act is not None else "silu"
            up = mul.operands[1 - side]
            if up is mul.operands[side]:
                return Miss(f"the product squares the {name} output; there is no separate up projection")
            if any(len(o.result.uses) != 1 for o in inner):
                return Miss(f"the {name} result is also used elsewhere; fusing would drop it")
            if gate.type.dtype != up.type.dtype:
                return Miss(f"the gate {gate.type} and the up projection {up.type} differ in dtype")
            if gate.type.shape != mul.result.type.shape:
                return Miss(f"the gate {gate.type} is broadcast to the product {mul.result.type}")
            return Match(mul, gate=gate, up=up, activation=_activation(act) if act is not None else "silu")
        return None

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = rw.create("ge.glu", [m.gate, m.up], {"activation": m.activation}, before=m.root)
        rw.replace(m.root, op)
