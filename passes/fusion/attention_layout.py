"""The transposes around attention folded into `ge.flash_attention`'s layout.

Models written for torch keep activations [B, S, N, D] (the projection's output viewed as heads) and transpose q, k
and v to [B, N, S, D] for attention, and its output back. The kernel reads BSND itself (layout = "BSND": a head's
row of D elements every N * D, which the cost model charges as the same bytes, one DMA each tile: it charges bytes,
not bursts, and the rows are D * itemsize bytes, whole 32-byte UB blocks for D >= 16 in 16-bit floats), so the
four copies go away.

Two rules: `attention_layout` drops the transposes feeding q, k and v (and the one after the output); and a quiet
enabling rewrite sinks a head transpose below the elementwise ops, slices, concats and rotary embeddings between it
and attention (LLaMA's rotary embedding sits between the q/k transposes and attention) or the transpose that undoes it, so the
transposes meet attention, or each other, and vanish. It sinks only where every path from the op leads there.
"""

from __future__ import annotations

from geir.ir import Operation, Value
from geir.ops.fused import chainable_ops
from geir.passes.fusion.match import defining, named
from geir.passes.pattern import Match, Miss, Pattern, Rewriter

HEADS = [0, 2, 1, 3]  # [B, S, N, D] <-> [B, N, S, D]: its own inverse
_ELEMENTWISE = chainable_ops() + ("ge.fused_elementwise",)
# ge.rotary_embedding works along the last axis alone, which the head transpose keeps: it sinks as elementwise ops do
_SINKABLE = _ELEMENTWISE + ("ge.slice", "ge.concat", "ge.rotary_embedding")
_DEPTH = 16


def _head_transpose(v: Value) -> Operation | None:
    """The transpose defining `v` when it swaps the head and sequence axes of a rank-4 tensor."""
    t = defining(v, "ge.transpose")
    return t if t is not None and list(t.perm) == HEADS else None


def _reaches_attention(v: Value, depth: int = _DEPTH) -> bool:
    """Every use of `v` leads, through ops a head transpose sinks below, to a BNSD attention's q, k or v, or to a
    head transpose (which the sunk one cancels)."""
    if depth == 0 or not v.uses:
        return False
    for u in v.users():
        if u.name == "ge.flash_attention":
            if u.layout != "BNSD" or any(o is v for o in u.operands[3:]):
                return False
        elif u.name == "ge.transpose":
            if list(u.perm) != HEADS:
                return False
        elif u.name not in _SINKABLE or len(u.results) != 1 or not _reaches_attention(u.result, depth - 1):
            return False
    return True


def _swappable(v: Value) -> bool:
    """Whether `v`, broadcast against a rank-4 operand, swaps its head and sequence axes by a reshape (one of them
    is 1 there), with a static shape to name."""
    t = v.type
    if t is None or t.rank > 4 or not t.is_static:
        return False
    padded = (1,) * (4 - t.rank) + tuple(t.shape)
    return padded[1] == 1 or padded[2] == 1


class SinkHeadTranspose(Pattern):
    """op(transpose(x), ...) -> transpose(op(x, ...)) for elementwise ops, slices and concats on the way to
    attention; transpose(transpose(x)) -> x."""

    NAME, ROOT, BENEFIT, EXPLAIN = "head_transpose_sink", _SINKABLE + ("ge.transpose",), 4, False

    def match(self, op: Operation) -> Match | Miss | None:
        if op.name == "ge.transpose":
            inner = _head_transpose(op.operands[0])
            return Match(op, x=inner.operands[0]) if inner is not None and list(op.perm) == HEADS else None
        if not any(_head_transpose(v) is not None for v in op.operands):
            return None
        if len(op.results) != 1 or op.result.type is None or op.result.type.rank != 4:
            return None
        if op.name in ("ge.slice", "ge.concat"):
            if not all(_head_transpose(v) is not None for v in op.operands):
                return None
        elif not all(_head_transpose(v) is not None or _swappable(v) for v in op.operands):
            return None
        if not _reaches_attention(op.result):
            return None
        return Match(op)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        op = m.root
        if op.name == "ge.transpose":
            rw.replace(op, [m.x])
            return
        operands = []
        for v in op.operands:
            t = _head_transpose(v)
            if t is not None:
                operands.append(t.operands[0])
            elif v.type.rank == 0:
                operands.append(v)
            else:
                padded = (1,) * (4 - v.type.rank) + tuple(v.type.shape)
                shape = [padded[i] for i in HEADS]
                operands.append(rw.create("ge.reshape", [v], {"shape": shape}, before=op).result)
        attributes = dict(op.attributes)
        if op.name == "ge.slice":
            attributes["axes"] = [HEADS[a % 4] for a in op.axes]
        elif op.name == "ge.concat":
            attributes["axis"] = HEADS[op.axis % 4]
        inner = rw.create(op.name, operands, attributes, before=op)
        rw.replace(op, rw.create("ge.transpose", inner.results, {"perm": HEADS}, before=op))


class FoldAttentionTransposes(Pattern):
    """flash_attention(transpose(q), transpose(k), transpose(v)) [-> transpose] -> flash_attention{layout = BSND}."""

    NAME, ROOT, BENEFIT, EXPLAIN = "attention_layout", "ge.flash_attention", 4, True

    def match(self, fa: Operation) -> Match | Miss | None:
        if fa.layout != "BNSD":
            return None
        if not any(_head_transpose(v) is not None for v in fa.operands[:3]):
            return None  # no head transpose to fold: not a candidate
        found = []
        for what, v in zip("qkv", fa.operands[:3]):
            t = _head_transpose(v)
            if t is None:
                source = "an argument of the graph" if v.owner is None else named(v.owner)
                return Miss(f"{what} comes from {source}, not from a transpose of [B, S, N, D] heads")
            found.append(t.operands[0])
        return Match(fa, inputs=found)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        fa = m.root
        attributes = dict(fa.attributes, layout="BSND")
        new = rw.create("ge.flash_attention", [*m.inputs, *fa.operands[3:]], attributes, before=fa)
        # the output back in BNSD for whoever reads it: a transpose that the sink rule cancels against the
        # model's own transpose back to [B, S, N, D]
        rw.replace(fa, rw.create("ge.transpose", new.results, {"perm": HEADS}, before=fa))
