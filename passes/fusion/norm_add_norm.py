"""A sandwich norm's output norm feeding the residual add + next norm becomes one `ge.rms_norm_add_rms_norm`.

Gemma2's layer normalises each block's output before its residual add (post_attention_layernorm,
post_feedforward_layernorm) and the sum again before the next block (pre_feedforward_layernorm, the next
layer's input_layernorm). After add_rms_norm the pair reads

    n = rms_norm(o, g1);  s, y = add_rms_norm(h, n, g2)

two row kernels over the same rows, the first writing `n` only for the second to read it back. ops-nn's
AddRmsNorm (norm/add_rms_norm) computes x1 + x2 and its RmsNorm in one pass over a row tile, writing both;
normalising x2 on the row tile it has just loaded (its RmsNorm, norm/rms_norm) is the same row-local vector work
on the same AIV, so the pair is one kernel: x1, x2 in; the sum and its norm out.
"""

from __future__ import annotations

from geir.ir import Operation
from geir.passes.fusion.match import defining, named
from geir.passes.pattern import Match, Miss, Pattern, Rewriter


class FuseRmsNormAddRmsNorm(Pattern):
    """add_rms_norm(x1, rms_norm(x2, g1), g2) -> ge.rms_norm_add_rms_norm(x1, x2, g1, g2), both results kept."""

    NAME, ROOT, EXPLAIN = "rms_norm_add_rms_norm", "ge.add_rms_norm", True
    BENEFIT = 29  # below add_rms_norm (30), which makes the op it roots at

    def match(self, root: Operation) -> Match | Miss | None:
        x1, x2 = root.operands[:2]
        norms = [(i, defining(v, "ge.rms_norm")) for i, v in enumerate((x1, x2))]
        norms = [(i, n) for i, n in norms if n is not None]
        if not norms:
            return None  # neither addend is a norm's result: a plain residual add + norm
        # the addend that is a norm read only here (the add commutes: either side may be it)
        for i, norm in reversed(norms):
            if len(norm.result.uses) == 1:
                return Match(root, norm=norm, residual=(x2, x1)[i])
        i, norm = norms[-1]
        other = next(u for u in norm.result.users() if u is not root)
        return Miss(f"{named(norm)} is also read by {named(other)}: the fused kernel writes only the sum and its norm")

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        root, norm = m.root, m.norm
        x2, x2_gamma = norm.operands
        attributes = {"epsilon": root.attr("epsilon"), "x2_epsilon": norm.attr("epsilon")}
        fused = rw.create("ge.rms_norm_add_rms_norm", [m.residual, x2, x2_gamma, root.operands[2]], attributes,
                          [r.type for r in root.results], before=root, loc=root.loc)
        rw.replace(root, fused)
        rw.erase(norm)
