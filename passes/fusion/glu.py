"""A gated linear unit written out, act(gate) * up (LLaMA's SwiGLU MLP, GeGLU), becomes one `ge.glu`.

It runs before the matmul epilogue rule, so the gate's activation is not taken into the gate matmul
while the product that needs it stays a separate kernel.
"""

from __future__ import annotations

from geir.ir import Operation, Value
from geir.passes.fusion.match import defining, named
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


class GluFromMergedMatmul(Pattern):
    """glu(split(x)[0], split(x)[1]) -> glu(x) when the two halves of x's last axis are gate and up (the merged
    gate-up matmul's output): the kernel reads both halves itself, as `npu_swiglu(x, dim=-1)` does, so the split's
    copy kernel goes away."""

    # below qkv_merge (5): the split it undoes is the one that merge leaves after the gate-up matmul
    NAME, ROOT, BENEFIT, EXPLAIN = "glu_merged", "ge.glu", 4, True

    def match(self, glu: Operation) -> Match | Miss | None:
        if len(glu.operands) != 2:
            return None  # already reads one merged tensor
        split = defining(glu.operands[0], "ge.split")
        if split is None or defining(glu.operands[1], "ge.split") is not split:
            return None
        x = split.operands[0]
        if x.type is None or not x.type.rank or split.axis not in (-1, x.type.rank - 1):
            return Miss(f"{named(split)} cuts axis {split.axis} of {x.type}, not the last one the kernel halves")
        if len(split.sizes) != 2 or split.sizes[0] != split.sizes[1]:
            return Miss(f"{named(split)} cuts sizes {list(split.sizes)}, not two equal halves")
        if list(split.results) != list(glu.operands):
            return Miss(f"the gate and up are {named(split)}'s pieces in another order")
        if any(len(r.uses) != 1 for r in split.results):
            return Miss(f"a piece of {named(split)} is also used elsewhere; its copy stays")
        return Match(glu, x=x)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        glu = m.root
        rw.replace(glu, rw.create("ge.glu", [m.x], dict(glu.attributes), [glu.result.type], before=glu))
