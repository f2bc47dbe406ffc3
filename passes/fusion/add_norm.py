"""A residual add feeding a norm becomes one `ge.add_rms_norm` / `ge.add_layer_norm` with both results: the sum
(which the next residual add reads) and its norm, as ops-transformer's AddRmsNorm / AddLayerNorm compute them in
one pass over the rows instead of writing the sum and reading it back."""

from __future__ import annotations

from geir.ir import Operation
from geir.ops.core import Const
from geir.passes.fusion.match import defining, named
from geir.passes.pattern import Match, Miss, Pattern, Rewriter

_FUSED = {"ge.rms_norm": "ge.add_rms_norm", "ge.layer_norm": "ge.add_layer_norm"}


class _FuseAddNorm(Pattern):
    """norm(a + b) -> ge.add_<norm>(a, b) with the sum as its first result, the norm as its second."""

    EXPLAIN = True
    BENEFIT = 30  # below the norm rules (34, 35), which make the norms it reads

    def match(self, norm: Operation) -> Match | Miss | None:
        add = defining(norm.operands[0], "ge.add")
        if add is None:
            return None  # the norm of something other than a sum: nothing to fuse
        a, b = add.operands
        out = add.result.type
        for v in (a, b):
            if v.type is None or out is None or v.type.shape != out.shape:
                return Miss(f"{named(add)} broadcasts {v.type} to {out}: the fused kernel adds two whole rows")
        if norm.name == "ge.layer_norm" and norm.attr("axis") % max(out.rank, 1) != out.rank - 1:
            return Miss(f"{named(norm)} normalises over axes from {norm.attr('axis')}, not the last axis alone")
        for p in norm.operands[1:]:
            # the fused op takes the add's place (its sum may be read before the norm): its parameters must exist there
            if p.owner is not None and not isinstance(p.owner, Const):
                return Miss(f"the scale of {named(norm)} is computed at run time by {named(p.owner)}, not a constant")
        return Match(norm, add=add, params=list(norm.operands[1:]))

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        norm, add = m.root, m.add
        attributes = {k: v for k, v in norm.attributes.items() if k in ("axis", "epsilon")}
        # constants may be written after the add: a copy of each goes where the fused op does
        params = [p if p.owner is None else rw.create("ge.const", [], dict(p.owner.attributes), [p.type], before=add,
                                                      loc=p.owner.loc).result for p in m.params]
        fused = rw.create(_FUSED[self.ROOT], [*add.operands, *params], attributes,
                          [add.result.type, norm.result.type], before=add, loc=norm.loc)
        rw.replace(norm, [fused.results[1]])
        rw.replace(add, [fused.results[0]])


class FuseAddRmsNorm(_FuseAddNorm):
    """rms_norm(a + b) -> ge.add_rms_norm(a, b)."""

    NAME, ROOT = "add_rms_norm", "ge.rms_norm"


class FuseAddLayerNorm(_FuseAddNorm):
    """layer_norm(a + b) -> ge.add_layer_norm(a, b)."""

    NAME, ROOT = "add_layer_norm", "ge.layer_norm"
