"""A gated linear unit written out, act(gate) * up (LLaMA's SwiGLU MLP, GeGLU), becomes one `ge.glu`.

It runs before the matmul epilogue rule, so the gate's activation is not taken into the gate matmul
while the product that needs it stays a separate kernel.
"""

from __future__ import annotations

from geir.ir import Operation
from geir.passes.fusion.match import defining
from geir.passes.pattern import Match, Miss, Pattern, Rewriter

_GATES = ("ge.silu", "ge.gelu")


def _activation(op: Operation) -> str:
    if op.name == "ge.gelu":
        return "gelu_tanh" if op.approximate == "tanh" else "gelu"
    return "silu"


class FuseGlu(Pattern):
    """silu(gate) * up (SwiGLU) or gelu(gate) * up (GeGLU) -> ge.glu."""

    NAME, ROOT, BENEFIT, EXPLAIN = "glu", "ge.mul", 30, True

    def match(self, mul: Operation) -> Match | Miss | None:
        for side in (0, 1):
            act = defining(mul.operands[side], *_GATES)
            if act is None:
                continue
            gate, up = act.operands[0], mul.operands[1 - side]
            if up is mul.operands[side]:
                return Miss(f"the product squares the {act.name[3:]} output; there is no separate up projection")
            if len(act.result.uses) != 1:
                return Miss(f"the {act.name[3:]} result is also used elsewhere; fusing would drop it")
            if gate.type.dtype != up.type.dtype:
                return Miss(f"the gate {gate.type} and the up projection {up.type} differ in dtype")
            if gate.type.shape != mul.result.type.shape:
                return Miss(f"the gate {gate.type} is broadcast to the product {mul.result.type}")
            return Match(mul, gate=gate, up=up, activation=_activation(act))
        return None

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = rw.create("ge.glu", [m.gate, m.up], {"activation": m.activation}, before=m.root)
        rw.replace(m.root, op)
