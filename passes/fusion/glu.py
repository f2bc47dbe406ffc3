"""A gated linear unit written out, act(gate) * up (LLaMA's SwiGLU MLP, GeGLU), becomes one `ge.glu`.

It runs before the matmul epilogue rule, so the gate's activation is not taken into the gate matmul
while the product that needs it stays a separate kernel.
"""

from __future__ import annotations

from geir.ir import Operation, Value
from geir.passes.fusion.match import defining, named
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.types import DType

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


class FuseMatmulGlu(Pattern):
    """glu(matmul(a, b)) with one merged operand -> fused_matmul(a, b) {glu}: the gate-up matmul with the gated linear
    unit as its epilogue on the f32 product (torch_npu's fused "gate-up + SwiGLU", ops-transformer's
    grouped_matmul_swiglu_quant), so the glu's own launch and the product's round trip through GM go away."""

    # below glu_merged (4), which gives the glu the merged gate-up product this rule takes into the matmul
    NAME, ROOT, BENEFIT, EXPLAIN = "matmul_glu", "ge.glu", 3, True

    def match(self, glu: Operation) -> Match | Miss | None:
        if len(glu.operands) != 1:
            return None  # gate and up from two tensors: not one product's halves
        x = glu.operands[0]
        mm = defining(x, "ge.matmul", "ge.fused_matmul")
        if mm is None:
            between = x.owner
            if between is not None and between.operands and defining(between.operands[0], "ge.matmul",
                                                                      "ge.fused_matmul"):
                return Miss(f"{named(between)} lies between the matmul and the glu")
            return None
        if len(x.uses) != 1:
            return Miss(f"the result of {named(mm)} is also used elsewhere; fusing would drop it")
        if mm.name == "ge.fused_matmul":
            if mm.activation != "none" or mm.glu != "none":
                return Miss(f"{named(mm)} already has an epilogue ({mm.activation if mm.glu == 'none' else 'glu'})")
            if len(mm.operands) > 2:
                return Miss(f"{named(mm)} adds a bias, which the glu epilogue does not take")
        if x.type is None or x.type.dtype not in (DType.f16, DType.bf16, DType.f32):
            return Miss(f"{named(mm)} computes in {None if x.type is None else x.type.dtype}, not a cube dtype")
        attrs = {k: v for k, v in mm.attributes.items() if k in ("transpose_a", "transpose_b")}
        return Match(glu, operands=list(mm.operands[:2]), attrs={**attrs, "glu": glu.activation})

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        glu = m.root
        rw.replace(glu, rw.create("ge.fused_matmul", m.operands, m.attrs, [glu.result.type], before=glu))

