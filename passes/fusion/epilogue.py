"""matmul followed by a bias add and/or an activation becomes one `ge.fused_matmul` (cube + epilogue)."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from geir.attributes import DenseAttr
from geir.ir import Operation, Value
from geir.passes.fusion.match import const_array, defining, named
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.target_npu.target import Target
from geir.types import TensorType

_ACTIVATIONS = ("ge.relu", "ge.gelu", "ge.silu")
_LINEARS = ("ge.matmul", "ge.fused_matmul")


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
                return Miss(why) if why else None
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


def _zero(arr: np.ndarray | None) -> bool:
    return arr is not None and not np.any(arr)


class FuseMatmulResidual(Pattern):
    """linear(x) + r, r shaped as the result -> ge.fused_matmul(x, w, r): the residual is the epilogue's addend.

    catlass's MatmulEpilogue kernel (gemm/kernel/matmul_epilogue.hpp, BlockEpilogue<EpilogueAtlasA2ElemWiseOneSource>
    with TileElemWiseAdd: D = A * B + X) adds a whole source tensor tile by tile as the accumulator drains, as the
    fused matmul's epilogue adds a bias of rows (kernels/matmul.py reads it per output tile); the add's launch and its
    round trip of both terms through GM go. GPT-NeoX's and GPT-J's parallel residual `x + attn + mlp` is the case: the
    down projection takes the attention output as its addend. A linear with a constant bias of its own hands the bias
    to the addend when the addend is another linear with a constant (or no) bias, folded there at compile time (the
    sum of two constant vectors); the sums are then rounded once, in the epilogue's f32, where they were rounded
    twice. Only a linear layer (a weight matrix shared by the batch): a score matmul plus a mask is attention's."""

    # below matmul_epilogue (10), whose bias adds come first, and the add-norm rules (30), which take a residual add
    # that feeds a norm with the norm
    NAME, ROOT, BENEFIT, EXPLAIN = "matmul_residual", "ge.add", 9, True

    def __init__(self, target: Target | None = None, resources: Mapping[str, np.ndarray] | None = None):
        self.resources = resources

    def _linear(self, v: Value) -> Operation | None:
        mm = defining(v, *_LINEARS)
        if mm is None or mm.operands[1].type is None or mm.operands[1].type.rank != 2:
            return None
        if mm.attributes.get("activation", "none") != "none" or mm.attributes.get("glu", "none") != "none":
            return None
        return mm

    def match(self, add: Operation) -> Match | Miss | None:
        out = add.result.type
        candidates = [(side, mm) for side in (1, 0) if (mm := self._linear(add.operands[side])) is not None]
        if not candidates or out is None:
            return None  # no linear layer's result in the sum
        why = None
        for side, mm in candidates:
            r = add.operands[1 - side]
            if r.type is None or r.type != out or mm.results[0].type != out:
                continue  # a term broadcast to the result: a bias (matmul_epilogue's) or no residual
            if len(mm.results[0].uses) != 1:
                why = why or f"the result of {named(mm)} is also read besides {named(add)}; fusing would drop it"
                continue
            bias = mm.operands[2] if len(mm.operands) > 2 else None
            if bias is None or _zero(const_array(bias, self.resources)):
                return Match(add, mm=mm, addend=r, into=None)
            into = self._linear(r)
            if into is None:
                # the epilogue's one addend already holds this linear's bias (matmul_epilogue's fusion): a residual
                # that is not another linear has nothing to fold into, so this is no near miss of this rule, and a
                # remark on every biased linear before a residual (each GPT-2 and BERT layer) would bury real ones
                continue
            b = const_array(bias, self.resources)
            rb = None if len(into.operands) < 3 else const_array(into.operands[2], self.resources)
            if (b is None or len(r.uses) != 1 or (len(into.operands) > 2 and rb is None)
                    or b.ndim > 1 or (rb is not None and rb.ndim > 1)):
                why = why or (f"{named(mm)} has a bias of its own that the addend {named(into)} cannot take (a bias "
                              f"that is not a constant vector, or the addend read elsewhere)")
                continue
            return Match(add, mm=mm, addend=r, into=into, bias=b, into_bias=rb)
        return Miss(why) if why else None

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        mm, addend = m.mm, m.addend
        if m.into is not None:
            into = m.into
            total = m.bias if m.into_bias is None else m.into_bias + m.bias
            t = into.results[0].type
            total = np.asarray(total, dtype=t.dtype.np)
            const = rw.create("ge.const", [], {"value": DenseAttr(np.ascontiguousarray(total))},
                              [TensorType(total.shape, t.dtype)], before=into).result
            attrs = {k: v for k, v in into.attributes.items() if k in ("transpose_a", "transpose_b")}
            folded = rw.create("ge.fused_matmul", [*into.operands[:2], const], attrs, [t], before=into)
            rw.replace(into, folded)
            addend = folded.results[0]
        attrs = {k: v for k, v in mm.attributes.items() if k in ("transpose_a", "transpose_b")}
        op = rw.create("ge.fused_matmul", [*mm.operands[:2], addend], attrs, [m.root.result.type], before=m.root)
        rw.replace(m.root, op)
        rw.erase(mm)
