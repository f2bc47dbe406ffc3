"""canonicalize: algebraic identities that make the graph smaller without changing its values."""

from __future__ import annotations

import math

import numpy as np

from geir.attributes import DenseAttr
from geir.ir import Module, Operation, Value
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.pattern import Match, Miss, Pattern, Rewriter, apply_patterns_greedily, constant_splat


class _ForwardOperand(Pattern):
    """`op(x, c)` -> x where the constant c is the op's identity and the result type is x's own."""

    # operand positions that may hold the identity constant (the other operand is forwarded)
    IDENTITY: int | float = 0
    SIDES: tuple[int, ...] = (0, 1)

    def match(self, op: Operation) -> Match | None:
        for side in self.SIDES:
            other = op.operands[1 - side]
            if self.is_identity(constant_splat(op.operands[side]), op) and other.type == op.result.type:
                return Match(op, keep=other)
        return None

    def is_identity(self, value, op: Operation) -> bool:
        return value is not None and value == self.IDENTITY

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        rw.replace(m.root, [m.keep])


class AddZero(_ForwardOperand):
    """x + 0 -> x for integers, x + (-0.0) -> x for floats (x + 0.0 turns -0.0 into +0.0, so it stays)."""

    NAME, ROOT, IDENTITY = "add-zero", "ge.add", 0

    def is_identity(self, value, op: Operation) -> bool:
        if value is None or value != 0:
            return False
        return not op.result.type.dtype.is_float or math.copysign(1.0, value) < 0


class SubZero(_ForwardOperand):
    """x - 0 -> x"""

    NAME, ROOT, IDENTITY, SIDES = "sub-zero", "ge.sub", 0, (1,)


class MulOne(_ForwardOperand):
    """x * 1 -> x"""

    NAME, ROOT, IDENTITY = "mul-one", "ge.mul", 1


class DivOne(_ForwardOperand):
    """x / 1 -> x"""

    NAME, ROOT, IDENTITY, SIDES = "div-one", "ge.div", 1, (1,)


class NegNeg(Pattern):
    """-(-x) -> x"""

    NAME, ROOT = "neg-neg", "ge.neg"

    def match(self, op: Operation) -> Match | None:
        inner = op.operands[0].owner
        if inner is not None and inner.name == "ge.neg":
            return Match(op, x=inner.operands[0])
        return None

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        rw.replace(m.root, [m.x])


class CastToSame(Pattern):
    """cast x to its own dtype -> x"""

    NAME, ROOT = "cast-same", "ge.cast"

    def match(self, op: Operation) -> Match | None:
        x = op.operands[0]
        return Match(op) if x.type is not None and x.type == op.result.type else None

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        rw.replace(m.root, [m.root.operands[0]])


class TransposeTranspose(Pattern):
    """transpose(transpose(x, p), q) -> transpose(x, p∘q), or x when that is the identity."""

    NAME, ROOT = "transpose-transpose", "ge.transpose"

    def match(self, op: Operation) -> Match | None:
        inner = op.operands[0].owner
        if inner is None or inner.name != "ge.transpose":
            return None
        composed = [inner.perm[p] for p in op.perm]
        return Match(op, x=inner.operands[0], perm=composed)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        _replace_with_transpose(m.root, m.x, m.perm, rw)


class IdentityTranspose(Pattern):
    """transpose(x, [0, 1, ...]) -> x"""

    NAME, ROOT = "identity-transpose", "ge.transpose"

    def match(self, op: Operation) -> Match | None:
        return Match(op) if list(op.perm) == list(range(len(op.perm))) else None

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        rw.replace(m.root, [m.root.operands[0]])


class UnitAxesTranspose(Pattern):
    """transpose(x, p) -> reshape(x) when p moves only axes of size 1: the other axes keep their order, so the
    elements keep theirs in memory (a decode step's [B, 1, N, D] <-> [B, N, 1, D] head transpose is a view)."""

    NAME, ROOT = "unit-axes-transpose", "ge.transpose"

    def match(self, op: Operation) -> Match | Miss | None:
        x, t = op.operands[0], op.result.type
        if x.type is None or t is None or x.type.format != "ND":
            return None
        moved = [p for p in op.perm if x.type.shape[p] != 1]  # a `?` axis counts as one that may be longer
        if moved != sorted(moved) or list(op.perm) == list(range(len(op.perm))):
            return None
        if sum(d is None for d in t.shape) > 1:
            return Miss(f"the transpose moves only axes of size 1, but its result {t} has more than one dynamic "
                        "axis, which a reshape cannot name")
        return Match(op, x=x, shape=[-1 if d is None else d for d in t.shape])

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = m.root
        rw.replace(op, rw.create("ge.reshape", [m.x], {"shape": m.shape}, [op.result.type], before=op))


def _replace_with_transpose(op: Operation, x: Value, perm: list[int], rw: Rewriter) -> None:
    if perm == list(range(len(perm))):
        rw.replace(op, [x])
    else:
        rw.replace(op, rw.create("ge.transpose", [x], {"perm": perm}, [op.result.type], before=op))


class ReshapeReshape(Pattern):
    """reshape(reshape(x)) -> reshape(x) to the outer shape."""

    NAME, ROOT = "reshape-reshape", "ge.reshape"

    def match(self, op: Operation) -> Match | None:
        inner = op.operands[0].owner
        if inner is None or inner.name != "ge.reshape":
            return None
        return Match(op, x=inner.operands[0])

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = m.root
        rw.replace(op, rw.create("ge.reshape", [m.x], {"shape": list(op.shape)}, [op.result.type], before=op))


class ReshapeToSame(Pattern):
    """reshape x to the static shape it already has -> x"""

    NAME, ROOT = "reshape-same", "ge.reshape"

    def match(self, op: Operation) -> Match | None:
        x = op.operands[0]
        t = op.result.type
        if x.type is not None and t is not None and x.type.is_static and x.type == t:
            return Match(op)
        return None

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        rw.replace(m.root, [m.root.operands[0]])


class SplatToScalar(Pattern):
    """A constant operand whose elements are all equal becomes a scalar when broadcasting keeps the result shape."""

    NAME, ROOT = "splat-to-scalar", tuple(f"ge.{n}" for n in ("add", "sub", "mul", "div", "max", "min", "pow"))

    def match(self, op: Operation) -> Match | None:
        for side in (0, 1):
            v = op.operands[side]
            value = constant_splat(v)
            other = op.operands[1 - side]
            if value is not None and v.type.rank > 0 and other.type is not None \
                    and other.type.shape == op.result.type.shape:
                return Match(op, side=side, value=value)
        return None

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = m.root
        v = op.operands[m.side]
        scalar = rw.create("ge.const", [], {"value": DenseAttr(np.array(m.value, dtype=v.type.dtype.np))},
                           [v.type.with_shape(())], before=op)
        operands = list(op.operands)
        operands[m.side] = scalar.result
        rw.replace(op, rw.create(op.name, operands, dict(op.attributes), [op.result.type], before=op))


class TransDataPair(Pattern):
    """trans_data(trans_data(x)) -> trans_data(x), or x when it is already in the final format."""

    NAME, ROOT = "trans-data-pair", "ge.trans_data"

    def match(self, op: Operation) -> Match | None:
        x = op.operands[0]
        inner = x.owner
        if x.type is not None and x.type.format == op.dst_format:
            return Match(op, value=x)
        if inner is not None and inner.name == "ge.trans_data":
            source = inner.operands[0]
            if source.type is not None and source.type.format == op.dst_format:
                return Match(op, value=source)
            return Match(op, value=None, source=source)
        return None

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = m.root
        if m.value is not None:
            rw.replace(op, [m.value])
        else:
            rw.replace(op, rw.create("ge.trans_data", [m.source], dict(op.attributes), [op.result.type], before=op))


class ConcatDropEmpty(Pattern):
    """concat with operands of size 0 along its axis -> the concat of the others (one left: that operand); Phi-3's
    partial rotary at factor 1 concatenates the rotated head with an empty pass-through slice"""

    NAME, ROOT = "concat-drop-empty", "ge.concat"

    def match(self, op: Operation) -> Match | None:
        rank = op.result.type.rank if op.result.type is not None else None
        if rank is None or not rank:
            return None
        axis = op.attr("axis") % rank
        kept = [v for v in op.operands if v.type is None or v.type.rank != rank or v.type.shape[axis] != 0]
        if len(kept) == len(op.operands) or not kept:
            return None
        if len(kept) == 1 and kept[0].type != op.result.type:
            return None  # the one left would not stand for the result as it is typed
        return Match(op, kept=kept)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = m.root
        if len(m.kept) == 1:
            rw.replace(op, [m.kept[0]])
        else:
            rw.replace(op, rw.create("ge.concat", m.kept, dict(op.attributes), [op.result.type], before=op))


CANONICAL_PATTERNS: tuple[type[Pattern], ...] = (
    AddZero, SubZero, MulOne, DivOne, NegNeg, CastToSame,
    TransposeTranspose, IdentityTranspose, UnitAxesTranspose, ReshapeReshape, ReshapeToSame, SplatToScalar, TransDataPair,
    ConcatDropEmpty,
)


@register_pass("canonicalize")
class Canonicalize(Pass):
    """Apply the algebraic identities to a fixpoint and drop what became dead."""

    REQUIRES = ("infer-shapes",)

    def run(self, module: Module, ctx: PassContext) -> None:
        patterns = [p() for p in CANONICAL_PATTERNS]
        for g in module.graphs:
            apply_patterns_greedily(g, patterns)
