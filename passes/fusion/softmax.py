"""`exp(x - max(x)) / sum(exp(x - max(x)))` written out becomes one `ge.softmax`."""

from __future__ import annotations

from geir.ir import Operation
from geir.passes.fusion.match import defining, is_last_axis, used_only_by
from geir.passes.pattern import Match, Miss, Pattern, Rewriter


class DecomposedSoftmax(Pattern):
    """div(exp(x - reduce_max(x)), reduce_sum(exp(...))) over the last axis -> softmax(x)."""

    NAME, ROOT, BENEFIT, EXPLAIN = "softmax", "ge.div", 40, True

    def match(self, div: Operation) -> Match | Miss | None:
        e = defining(div.operands[0], "ge.exp")
        if e is None:
            return None  # not a softmax candidate: the numerator is no exponential
        s = defining(div.operands[1], "ge.reduce_sum")
        if s is None or s.operands[0] is not e.result:
            return Miss("the denominator is not reduce_sum of the numerator's exponentials")
        rank = e.result.type.rank
        if not is_last_axis(s.axes, rank):
            return Miss(f"the sum runs over axes {s.axes}, not the last axis")
        if not s.keepdims:
            return Miss("the sum drops its axis (keepdims = false), so it does not broadcast back")
        if not used_only_by(e.result, div, s):
            return Miss("the exponentials are used outside the softmax")
        if not used_only_by(s.result, div):
            return Miss("the sum of exponentials is used outside the softmax")
        x = e.operands[0]
        sub = defining(x, "ge.sub")
        m = defining(sub.operands[1], "ge.reduce_max") if sub is not None else None
        # exp(x - max(x)) is the stable spelling of softmax(x); exp of anything else is softmax of that
        if m is not None and m.operands[0] is sub.operands[0] and is_last_axis(m.axes, rank) and m.keepdims \
                and used_only_by(x, e):
            x = sub.operands[0]
        if x.type.dtype != div.result.type.dtype or x.type.shape != div.result.type.shape:
            return Miss(f"the softmax input {x.type} does not match the result {div.result.type}")
        return Match(div, x=x)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        rw.replace(m.root, rw.create("ge.softmax", [m.x], {"axis": -1}, before=m.root))
