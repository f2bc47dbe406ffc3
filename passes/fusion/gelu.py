"""GELU written out becomes `ge.gelu`.

erf form:  0.5 * x * (1 + erf(x / sqrt(2)))          (or x * 0.7071...; factors in any order)
tanh form: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))   (x^3 as pow or products)
           or with x factored out of the bracket, as Bloom writes it (transformers' bloom_gelu_forward):
           0.5 * x * (1 + tanh(sqrt(2/pi) * x * (1 + 0.044715 * x^2)))
"""

from __future__ import annotations

import math

from geir.ir import Operation, Value
from geir.passes.fusion.match import close, defining, scalar_constant
from geir.passes.pattern import Match, Miss, Pattern, Rewriter


def _product(v: Value, ops: list[Operation], top: bool = True) -> tuple[float, list[Value]]:
    """v as a product: (constant factor, other factors in order), looking through single-use muls below the top.

    A loop with its own stack, not recursion: a chain of thousands of muls is a graph's depth, not a limit."""
    const, factors = 1.0, []
    stack: list[tuple[Value, bool]] = [(v, top)]
    while stack:
        u, top = stack.pop()
        c = scalar_constant(u)
        if c is not None:
            const *= c
            continue
        op = defining(u, "ge.mul")
        if op is None or (not top and len(u.users()) != 1):
            factors.append(u)
            continue
        if not top:
            ops.append(op)
        stack += [(op.operands[1], False), (op.operands[0], False)]  # the left factor first
    return const, factors


def _power_of(factors: list[Value], x: Value, ops: list[Operation]) -> int | None:
    """n when the factors multiply to x^n (x, x*x, pow(x, k)), else None."""
    n = 0
    for f in factors:
        if f is x:
            n += 1
            continue
        p = defining(f, "ge.pow")
        k = scalar_constant(p.operands[1]) if p is not None else None
        if p is None or p.operands[0] is not x or k is None or k != int(k):
            return None
        ops.append(p)
        n += int(k)
    return n


class FuseGelu(Pattern):
    """0.5 * x * (1 + erf(x / sqrt 2)) or its tanh approximation -> ge.gelu."""

    NAME, ROOT, BENEFIT, EXPLAIN = "gelu", "ge.mul", 33, True

    def match(self, root: Operation) -> Match | Miss | None:
        users = root.result.users()
        if len(root.result.uses) == 1 and users[0].name == "ge.mul":
            return None  # the product goes on above this mul: its top is the candidate
        ops: list[Operation] = []
        const, factors = _product(root.result, ops)
        one_plus = None
        for f in factors:
            add = defining(f, "ge.add")
            if add is None:
                continue
            for side in (0, 1):
                if close(scalar_constant(add.operands[side]), 1.0, 1e-6) and defining(add.operands[1 - side], "ge.erf", "ge.tanh"):
                    one_plus = (f, add, add.operands[1 - side].owner)
        if one_plus is None:
            return None  # no 1 + erf(...) / 1 + tanh(...) factor: not a GELU candidate
        f, add, fn = one_plus
        rest = [g for g in factors if g is not f]
        if len(rest) != 1:
            return Miss(f"the product has {len(rest)} factors besides (1 + {fn.name[3:]}(...)), not just x")
        x = rest[0]
        if not close(const, 0.5):
            return Miss(f"the constant factor is {const:g}, not 0.5")
        ops += [add, fn]
        arg_ops: list[Operation] = []
        if fn.name == "ge.erf":
            approximate = "none"
            why = self._erf_argument(fn.operands[0], x, arg_ops)
        else:
            approximate = "tanh"
            why = self._tanh_argument(fn.operands[0], x, arg_ops)
        if why is not None:
            return Miss(why)
        if any(len(o.result.users()) != 1 for o in ops + arg_ops):
            return Miss("an intermediate of the GELU is also used elsewhere; fusing would drop it")
        if x.type != root.result.type:
            return Miss(f"the result {root.result.type} is not shaped like the input {x.type}")
        return Match(root, x=x, approximate=approximate)

    @staticmethod
    def _erf_argument(arg: Value, x: Value, ops: list[Operation]) -> str | None:
        d = defining(arg, "ge.div")
        if d is not None and d.operands[0] is x:
            ops.append(d)
            c = scalar_constant(d.operands[1])
            return None if close(c, math.sqrt(2)) else "erf's argument is not x / sqrt(2)"
        const, factors = _product(arg, ops, top=False) if defining(arg, "ge.mul") else (1.0, [arg])
        if factors == [x] and close(const, 1 / math.sqrt(2)):
            return None
        return "erf's argument is not x / sqrt(2)"

    @staticmethod
    def _tanh_argument(arg: Value, x: Value, ops: list[Operation]) -> str | None:
        c1, factors = _product(arg, ops, top=False)
        if not close(c1, math.sqrt(2 / math.pi)):
            return f"tanh's argument is scaled by {c1:g}, not sqrt(2/pi)"
        # x + c x^3, or x * (1 + c x^2): the same polynomial with x factored out (Bloom's spelling)
        factored = len(factors) == 2 and any(f is x for f in factors)
        if factored:
            power = 2
            inner = defining(factors[1] if factors[0] is x else factors[0], "ge.add")
        else:
            power = 3
            inner = defining(factors[0], "ge.add") if len(factors) == 1 else None
        if inner is None:
            return "tanh's argument is not sqrt(2/pi) * (x + 0.044715 * x^3)"
        ops.append(inner)
        for side in (0, 1):
            term = inner.operands[side]
            if close(scalar_constant(term), 1.0, 1e-6) if factored else term is x:
                c2, cube = _product(inner.operands[1 - side], ops, top=False)
                if _power_of(cube, x, ops) == power:
                    return None if close(c2, 0.044715) else f"the cubic coefficient is {c2:g}, not 0.044715"
        return "tanh's argument is not sqrt(2/pi) * (x + 0.044715 * x^3)"

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        rw.replace(m.root, rw.create("ge.gelu", [m.x], {"approximate": m.approximate}, before=m.root))
