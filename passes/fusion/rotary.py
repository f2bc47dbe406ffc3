"""Rotary position embedding written out op by op becomes one `ge.rotary_embedding`.

half rotation (LLaMA, GPT-NeoX):  x * cos + concat(-x[..., h:], x[..., :h]) * sin       (h = d / 2)
interleaved (GPT-J):              x * cos + stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) * sin
partial rotation (GPT-NeoX's rotary_pct, Phi):  concat(rope(x[..., :r]), x[..., r:]) on the last axis
q and k on the same tables:  rope(q), rope(k) -> one rope(q, k) launch (ops-transformer's ApplyRotaryPosEmb)
"""

from __future__ import annotations

from geir.builder import create_op
from geir.ir import Operation, Value
from geir.passes.fusion.match import defining, used_only_by
from geir.passes.fusion.siblings import MergeSiblings
from geir.passes.pattern import Match, Miss, Pattern, Rewriter


def _last_axis_range(s: Operation) -> tuple[Value, int, int, int] | None:
    """(source, start, stop, step) of a slice that cuts only the last axis of a statically sized source."""
    x = s.operands[0]
    rank = x.type.rank
    if len(s.axes) != 1 or rank == 0 or s.axes[0] % rank != rank - 1 or x.type.shape[-1] is None:
        return None
    step = s.steps[0] if s.steps else 1
    start, stop, step = slice(s.starts[0], s.ends[0], step).indices(x.type.shape[-1])
    return x, start, stop, step


def _rotated_half(concat: Operation) -> tuple[Value, list[Operation], str] | str:
    """x and the ops that rotate it when `concat` is concat(-x[..., h:], x[..., :h]) on the last axis, else why not."""
    rank = concat.result.type.rank
    if rank == 0 or concat.axis % rank != rank - 1:
        return f"the rotation's concat joins axis {concat.axis}, not the last axis"
    if len(concat.operands) != 2:
        return f"the rotation's concat joins {len(concat.operands)} pieces, not -x2 and x1"
    neg = defining(concat.operands[0], "ge.neg")
    if neg is None:
        return "the first piece of the rotation's concat is not negated (rotate_half is concat(-x2, x1))"
    second, first = defining(neg.operands[0], "ge.slice"), defining(concat.operands[1], "ge.slice")
    if second is None or first is None:
        return "the rotation's pieces are not slices of one tensor"
    hi, lo = _last_axis_range(second), _last_axis_range(first)
    if hi is None or lo is None or hi[0] is not lo[0]:
        return "the rotation's pieces are not slices of one tensor's last axis"
    x, d = hi[0], hi[0].type.shape[-1]
    h = d // 2
    if d % 2 or lo[1:] != (0, h, 1) or hi[1:] != (h, d, 1):
        return f"the rotation's slices are [{lo[1]}:{lo[2]}] and [{hi[1]}:{hi[2]}], not the halves [0:{h}] and [{h}:{d}]"
    return x, [concat, neg, second, first], "half"


def _unsqueezed_last(v: Value) -> Value | None:
    """y when v is reshape(y) to y's shape with a trailing 1 (torch.stack's unsqueeze)."""
    r = defining(v, "ge.reshape")
    if r is None or r.operands[0].type.shape + (1,) != v.type.shape:
        return None
    return r.operands[0]


def _stacked(v: Value) -> Operation | None:
    """The concat when v is stack((a, b), -1).flatten(-2): reshape(concat(a[..., None], b[..., None], -1))."""
    r = defining(v, "ge.reshape")
    c = defining(r.operands[0], "ge.concat") if r is not None else None
    if c is None or c.result.type.rank < 2 or c.axis % c.result.type.rank != c.result.type.rank - 1:
        return None
    shape = c.result.type.shape
    if c.result.type.shape[-1] != 2 or v.type.shape[:-1] != shape[:-2] or v.type.shape[-1] is None \
            or shape[-2] is None or v.type.shape[-1] != shape[-2] * 2:
        return None
    return c


def _rotated_pairs(flatten: Operation, stack: Operation) -> tuple[Value, list[Operation], str] | str:
    """x and the ops that rotate it when `flatten` is stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    (GPT-J's rotate_every_two), else why not."""
    pieces = [_unsqueezed_last(v) for v in stack.operands]
    if len(pieces) != 2 or None in pieces:
        return "the rotation's stack does not join two pieces of the pairs"
    neg = defining(pieces[0], "ge.neg")
    if neg is None:
        return "the first piece of the rotation's stack is not negated (rotate_every_two is stack(-x_odd, x_even))"
    odd, even = defining(neg.operands[0], "ge.slice"), defining(pieces[1], "ge.slice")
    hi, lo = (_last_axis_range(odd) if odd is not None else None), (_last_axis_range(even) if even is not None else None)
    if hi is None or lo is None or hi[0] is not lo[0]:
        return "the rotation's pieces are not strided slices of one tensor's last axis"
    x, d = hi[0], hi[0].type.shape[-1]
    if d % 2 or lo[1:] != (0, d, 2) or hi[1:] != (1, d, 2):
        return (f"the rotation's slices are [{lo[1]}:{lo[2]}:{lo[3]}] and [{hi[1]}:{hi[2]}:{hi[3]}], not the pairs "
                f"[0:{d}:2] and [1:{d}:2]")
    return x, [flatten, stack, stack.operands[0].owner, neg, odd, stack.operands[1].owner, even], "interleave"


class FuseRotaryEmbedding(Pattern):
    """x * cos + rotate_half(x) * sin -> ge.rotary_embedding{mode = "half"}; with GPT-J's rotate_every_two, mode
    "interleave"."""

    NAME, ROOT, BENEFIT, EXPLAIN = "rotary_embedding", "ge.add", 30, True

    def match(self, add: Operation) -> Match | Miss | None:
        for side in (0, 1):
            by_sin = defining(add.operands[side], "ge.mul")
            by_cos = defining(add.operands[1 - side], "ge.mul")
            if by_sin is None or by_cos is None:
                continue
            for rside in (0, 1):
                rotated = by_sin.operands[rside]
                if defining(rotated, "ge.concat") or _stacked(rotated) is not None:
                    return self._match(add, by_cos, by_sin, rotated, by_sin.operands[1 - rside])
        return None

    def _match(self, add: Operation, by_cos: Operation, by_sin: Operation, rotated: Value,
               sin: Value) -> Match | Miss:
        stacked = _stacked(rotated)
        found = _rotated_half(rotated.owner) if stacked is None else _rotated_pairs(rotated.owner, stacked)
        if isinstance(found, str):
            return Miss(found)
        x, rotation, mode = found
        if x not in by_cos.operands:
            return Miss("the other product does not multiply the rotated tensor (x * cos)")
        cos = by_cos.operands[1] if by_cos.operands[0] is x else by_cos.operands[0]
        inner = [by_cos, by_sin, *rotation]
        if any(len(o.result.uses) != 1 for o in inner):
            return Miss("an intermediate of the rotary embedding is also used elsewhere; fusing would drop it")
        attributes = {"mode": mode, "rotary_dim": x.type.shape[-1]}
        out = create_op("ge.rotary_embedding", [], [], attributes).infer(x.type, cos.type, sin.type)  # ShapeError: a miss
        if out != add.result.type:
            return Miss(f"the result {add.result.type} is not shaped like the input {x.type}")
        return Match(add, operands=[x, cos, sin], attributes=attributes, inner=inner)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        rw.replace(m.root, rw.create("ge.rotary_embedding", m.operands, m.attributes, before=m.root))
        for op in m.inner:  # users first: x is then used by the new op alone, which the partial rule checks
            rw.erase(op)


class FusePartialRotary(Pattern):
    """concat(rotary_embedding(x[..., :r]), x[..., r:]) on the last axis -> ge.rotary_embedding{rotary_dim = r}."""

    NAME, ROOT, BENEFIT, EXPLAIN = "partial_rotary", "ge.concat", 30, True

    def match(self, concat: Operation) -> Match | Miss | None:
        if len(concat.operands) != 2:
            return None
        rope = defining(concat.operands[0], "ge.rotary_embedding")
        if rope is None or len(rope.operands) != 3:
            return None  # not one rotated part joined with the rest
        rank = concat.result.type.rank
        if concat.axis % rank != rank - 1:
            return Miss(f"the concat joins axis {concat.axis}, not the last axis the rotation runs on")
        rotated, passed = defining(rope.operands[0], "ge.slice"), defining(concat.operands[1], "ge.slice")
        lo = _last_axis_range(rotated) if rotated is not None else None
        hi = _last_axis_range(passed) if passed is not None else None
        if lo is None or hi is None or lo[0] is not hi[0]:
            return Miss("the rotated and the passed-through parts are not slices of one tensor's last axis")
        x, d = lo[0], lo[0].type.shape[-1]
        r = rope.rotary_dim
        if lo[1:] != (0, r, 1) or hi[1:] != (r, d, 1):
            return Miss(f"the parts are [{lo[1]}:{lo[2]}] and [{hi[1]}:{hi[2]}], not [0:{r}] and [{r}:{d}]")
        if len(rope.result.uses) != 1 or not used_only_by(rotated.result, rope):
            return Miss("the rotated part is also used elsewhere; fusing would drop it")
        attributes = {"mode": rope.mode, "rotary_dim": r}
        return Match(concat, operands=[x, rope.operands[1], rope.operands[2]], attributes=attributes)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        rw.replace(m.root, rw.create("ge.rotary_embedding", m.operands, m.attributes, before=m.root))


def _table_source(v: Value) -> Value:
    """The value a rotary table is, seen through reshapes that keep its type (a sunk transpose leaves some)."""
    while (r := defining(v, "ge.reshape")) is not None and r.operands[0].type == v.type:
        v = r.operands[0]
    return v


def _same_table_ropes(v: Value) -> list[Operation]:
    """The one-tensor rotary embeddings whose cos is `v` or a type-keeping reshape of it."""
    found, seen, todo = [], set(), [v]
    while todo:
        for u in todo.pop().users():
            if id(u) in seen:
                continue
            seen.add(id(u))
            if u.name == "ge.rotary_embedding" and len(u.operands) == 3:
                found.append(u)
            elif u.name == "ge.reshape" and u.result.type == v.type:
                todo.append(u.result)
    return found


class MergeRotaryPair(MergeSiblings):
    """rope(q, cos, sin), rope(k, cos, sin) -> one rope(q, cos, sin, k) launch with both results, as
    ops-transformer's ApplyRotaryPosEmb rotates q and k together (torch_npu's npu_apply_rotary_pos_emb): one launch
    head instead of two, and the tables read once. Runs last among the rotary rules (below attention_layout, 4,
    whose head transposes sink through one-tensor rotations)."""

    NAME, ROOT, BENEFIT, EXPLAIN = "rotary_pair", "ge.rotary_embedding", 3, True
    SIBLING = "rotation on these tables"

    def siblings(self, rope: Operation) -> list[Operation]:
        if len(rope.operands) != 3:
            return []  # already a pair
        cos, sin = _table_source(rope.operands[1]), _table_source(rope.operands[2])
        return [o for o in _same_table_ropes(cos) if o is not rope and _table_source(o.operands[2]) is sin]

    def incompatible(self, rope: Operation, other: Operation) -> str | None:
        x, k = rope.operands[0].type, other.operands[0].type
        if (other.mode, other.rotary_dim) != (rope.mode, rope.rotary_dim):
            return (f"has mode {other.mode} and rotary_dim {other.rotary_dim}, this one {rope.mode} and "
                    f"{rope.rotary_dim}")
        if k.dtype != x.dtype or k.shape[-1] != x.shape[-1]:
            return f"turns {k}, this one {x}"
        return None

    def build_pair(self, rope: Operation, other: Operation, rw: Rewriter) -> Operation:
        operands = [rope.operands[0], rope.operands[1], rope.operands[2], other.operands[0]]
        return rw.create("ge.rotary_embedding", operands, dict(rope.attributes),
                         [rope.result.type, other.result.type], before=other)
