"""matmul followed by a bias add and/or an activation becomes one `ge.fused_matmul` (cube + epilogue)."""

from __future__ import annotations

from geir.ir import Operation, Value
from geir.passes.fusion.match import defining
from geir.passes.pattern import Match, Miss, Pattern, Rewriter

_ACTIVATIONS = ("ge.relu", "ge.gelu", "ge.silu")


def _activation_name(op: Operation) -> str:
    if op.name == "ge.gelu":
        return "gelu_tanh" if op.approximate == "tanh" else "gelu"
    return op.name[3:]


def _bias_problem(bias: Value, out: Value) -> str | None:
    """Why `bias` cannot be the epilogue's bias for matmul result `out` (it must vary only along the last axis)."""
    bt, ot = bias.type, out.type
    if bt.dtype != ot.dtype:
        return f"the bias dtype {bt.dtype} differs from the matmul's {ot.dtype}"
    if bt.rank > ot.rank or any(d != 1 for d in bt.shape[:-1]):
        return f"the bias {bt} varies along more than the output's last axis"
    if bt.rank and bt.shape[-1] not in (1, ot.shape[-1]):
        return f"the bias {bt} does not match the output's last axis ({ot.shape[-1]})"
    return None


class FuseMatmulEpilogue(Pattern):
    """act(matmul(a, b) + bias), matmul(a, b) + bias, or act(matmul(a, b)) -> ge.fused_matmul."""

    NAME, ROOT, BENEFIT, EXPLAIN = "matmul_epilogue", ("ge.add",) + _ACTIVATIONS, 10, True

    def match(self, root: Operation) -> Match | Miss | None:
        if root.name == "ge.add":
            users = root.result.users()
            if len(users) == 1 and users[0].name in _ACTIVATIONS:
                return None  # the activation below takes the add with it
            return self._bias_add(root, root, "none")
        x = root.operands[0]
        add = defining(x, "ge.add")
        if add is not None and any(defining(o, "ge.matmul") for o in add.operands):
            if len(x.users()) != 1:
                return Miss("the biased matmul result is also used elsewhere; fusing would drop it")
            return self._bias_add(add, root, _activation_name(root))
        mm = defining(x, "ge.matmul")
        if mm is None:
            return None
        if len(x.users()) != 1:
            return Miss("the matmul result is also used elsewhere; fusing would drop it")
        return Match(root, operands=list(mm.operands), attrs=self._attrs(mm, _activation_name(root)))

    def _bias_add(self, add: Operation, root: Operation, activation: str) -> Match | Miss | None:
        for side in (0, 1):
            mm = defining(add.operands[side], "ge.matmul")
            if mm is None:
                continue
            out, bias = add.operands[side], add.operands[1 - side]
            if len(out.users()) != 1:
                return Miss("the matmul result is also used elsewhere; fusing would drop it")
            why = _bias_problem(bias, out)
            if why is not None:
                return Miss(why)
            return Match(root, operands=[*mm.operands, bias], attrs=self._attrs(mm, activation))
        return None

    @staticmethod
    def _attrs(mm: Operation, activation: str) -> dict:
        attrs = {k: v for k, v in mm.attributes.items() if k in ("transpose_a", "transpose_b")}
        if activation != "none":
            attrs["activation"] = activation
        return attrs

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = rw.create("ge.fused_matmul", m.operands, m.attrs, [m.root.result.type], before=m.root)
        rw.replace(m.root, op)
