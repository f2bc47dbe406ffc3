"""A projection split into pieces that are each viewed as heads and transposed to [B, N, S, D] is transposed once,
whole, and split on its head axis: split(x, last) -> reshape [B, S, n_i, D] -> transpose [0, 2, 1, 3] per piece
becomes reshape x to [B, S, N, D] (N the pieces' heads together), one transpose to [B, N, S, D], split on axis 1.

The merged q/k/v projection (qkv_merge) of a decoder's prefill is that: its pieces go to the rotary embedding and the
KV-cache scatter, which take [B, N, S, D] (Hugging Face's cache layout), so the head transposes cannot fold into
attention's layout (attention_layout, a higher tier, takes them where they can). Four data movements of the
projection's bytes (the split's copy and three transposes, a launch each) become one: the transpose moves the same
bytes as the split did, and the split on the head axis cuts the result into runs of its bytes (for B = 1), a view.
The values are the same elements moved: nothing is computed. It comes with qkv_merge (passes/fuse.py COMPANIONS),
whose split it serves, and is quiet as the head transpose sink is: it makes no kernel of its own.
"""

from __future__ import annotations

from geir.ir import Operation
from geir.passes.fusion.match import defining, named
from geir.passes.pattern import Match, Miss, Pattern, Rewriter

HEADS = [0, 2, 1, 3]


class SplitHeadsOnce(Pattern):
    """split -> (reshape to heads -> head transpose) per piece  ==>  reshape -> one head transpose -> split."""

    # below attention_layout (4), which folds head transposes into attention where every one reaches it
    NAME, ROOT, BENEFIT, EXPLAIN = "split_heads", "ge.split", 2, False

    def match(self, split: Operation) -> Match | Miss | None:
        x = split.operands[0]
        if x.type is None or x.type.rank != 3 or split.axis % 3 != 2 or len(split.results) < 2:
            return None
        pieces = []
        for piece in split.results:
            users = piece.users()
            view = users[0] if len(users) == 1 and users[0].name == "ge.reshape" else None
            t_users = view.result.users() if view is not None else []
            t = t_users[0] if len(t_users) == 1 and t_users[0].name == "ge.transpose" else None
            if t is None or list(t.perm) != HEADS or view.result.type.rank != 4:
                if not pieces and piece is split.results[0]:
                    return None  # not a split into heads
                what = named(users[0]) if users else "nothing"
                return Miss(f"piece {piece.name} of {named(split)} goes to {what}, not viewed as [B, S, N, D] heads "
                            f"and transposed to [B, N, S, D]")
            pieces.append((view, t))
        shapes = [view.result.type.shape for view, _ in pieces]
        b, s, d = shapes[0][0], shapes[0][1], shapes[0][3]
        if d is None or b is None or any(sh[0] != b or sh[1] != s or sh[3] != d or sh[2] is None for sh in shapes):
            return Miss(f"the pieces of {named(split)} are not heads of one size on the same batch and positions: "
                        f"{', '.join(str(sh) for sh in shapes)}")
        return Match(split, x=x, pieces=pieces, heads=[sh[2] for sh in shapes], b=b, s=s, d=d)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        x, split = m.x, m.root
        n = sum(m.heads)
        bsnd = rw.create("ge.reshape", [x], {"shape": [m.b, -1 if m.s is None else m.s, n, m.d]},
                         [x.type.with_shape((m.b, m.s, n, m.d))], before=split, loc=split.loc).result
        bnsd = rw.create("ge.transpose", [bsnd], {"perm": HEADS}, before=split, loc=split.loc).result
        heads = rw.create("ge.split", [bnsd], {"axis": 1, "sizes": list(m.heads)}, before=split, loc=split.loc)
        for (view, t), piece in zip(m.pieces, heads.results):
            rw.replace(t, [piece])
