"""Attention over keys and values gathered from a block pool becomes ge.paged_attention (FIA with a block table).

A paged KV cache written in torch reads a row's keys as `pool.view(num_blocks, block_size, Nkv, D)[block_table]`,
reshaped to [B, blocks x block_size, Nkv, D] and transposed to [B, Nkv, L, D] (then repeated per group of query
heads, HF's `repeat_kv`) before `scaled_dot_product_attention`. Imported, that is a `ge.gather` of the pool's blocks
by the table, views, and a `ge.flash_attention`: the gather copies every block the batch names into a dense tensor
each step. The rule hands the pool and the table to `ge.paged_attention`, whose kernel reads the blocks in place
(kernels/paged_attention.py); the gathers and their copies are left without users. Numbers are unchanged: the paged
op's semantics is flash_attention's over the same gathered keys (geir/ops/paged.py).
"""

from __future__ import annotations

import numpy as np

from geir.ir import Operation, Value
from geir.passes.fusion.match import const_array, defining
from geir.passes.pattern import Match, Miss, Pattern, Rewriter

_RESHAPES = ("ge.reshape", "ge.dynamic_reshape")


def _same(a, b) -> bool:
    """Two dimensions that may be equal (either unknown, or the same size)."""
    return a is None or b is None or a == b


def _ungrouped(v: Value) -> tuple[Value, int]:
    """k or v repeated per group of query heads ([B, Nkv, 1, L, D] x ones, reshaped to [B, Nkv * G, L, D]): the
    [B, Nkv, L, D] tensor and G; anything else is (v, 1)."""
    outer = defining(v, *_RESHAPES)
    copies = defining(outer.operands[0], "ge.mul") if outer is not None else None
    if copies is None or copies.result.type.rank != 5:
        return v, 1
    a, b = copies.operands
    ones = lambda x: (arr := const_array(x)) is not None and arr.size > 0 and bool(np.all(arr == 1))  # noqa: E731
    one = a if ones(b) else b if ones(a) else None
    inner = defining(one, *_RESHAPES) if one is not None else None
    if inner is None or one.type.rank != 5 or one.type.shape[2] != 1 or inner.operands[0].type.rank != 4:
        return v, 1
    group = copies.result.type.shape[2]
    return (inner.operands[0], group) if group and group > 1 else (v, 1)


def _block_read(v: Value) -> tuple[Value, Value, int] | str | None:
    """For keys read through a block table ([B, Nkv, L, D] = transpose(reshape(gather(blocks, table)))): (the
    [num_blocks, block_size, Nkv, D] blocks, the table, the group of query heads per K/V head); a reason when
    the read is only partly that; None when no gather of blocks is in sight."""
    x, group = _ungrouped(v)
    t = defining(x, "ge.transpose")
    flat = defining(t.operands[0], *_RESHAPES) if t is not None else None
    gather = defining(flat.operands[0], "ge.gather") if flat is not None else None
    if gather is None:
        return None
    if list(t.attr("perm")) != [0, 2, 1, 3]:
        return f"the gathered keys are transposed by {list(t.attr('perm'))}, not [0, 2, 1, 3] to [B, Nkv, L, D]"
    blocks, table = gather.operands[:2]
    if gather.attr("axis") % max(blocks.type.rank, 1) != 0 or blocks.type.rank != 4 or table.type.rank != 2:
        return "the gather does not take whole blocks [num_blocks, block_size, Nkv, D] by a [B, max_blocks] table"
    b, nblk, bs, nkv, d = gather.result.type.shape
    fb, fl, fn, fd = flat.result.type.shape if flat.result.type.rank == 4 else (None,) * 4
    if flat.result.type.rank != 4 or not (_same(fb, b) and _same(fn, nkv) and _same(fd, d)) or (
            None not in (fl, nblk, bs) and fl != nblk * bs):
        return (f"the gathered blocks {gather.result.type} are reshaped to {flat.result.type}, not to "
                f"[B, max_blocks x block_size, Nkv, D]")
    return blocks, table, group


class PagedAttentionRead(Pattern):
    """A `ge.flash_attention` whose keys and values are gathered from a block pool by one block table becomes a
    `ge.paged_attention` over the pool (viewed as FIA's [num_blocks, block_size, Nkv * D]) and the table."""

    NAME, ROOT, BENEFIT, EXPLAIN = "paged_attention", "ge.flash_attention", 18, True

    def match(self, fa: Operation) -> Match | Miss | None:
        q, k, v = fa.operands[:3]
        mask = fa.operands[3] if len(fa.operands) > 3 else None
        read_k, read_v = _block_read(k), _block_read(v)
        if read_k is None and read_v is None:
            return None  # keys from anywhere else: not a paged read
        for what, read in (("keys", read_k), ("values", read_v)):
            if read is None:
                return Miss(f"the {what} are not gathered from a block pool as the "
                            f"{'values' if what == 'keys' else 'keys'} are")
            if isinstance(read, str):
                return Miss(f"{what}: {read}")
        (kb, k_table, k_group), (vb, v_table, v_group) = read_k, read_v
        if k_table is not v_table:
            return Miss("the keys and values are gathered by different block tables")
        if k_group != v_group:
            return Miss(f"k and v are repeated for grouped-query heads differently ({k_group} and {v_group})")
        if fa.attr("layout") != "BNSD" or fa.attr("softcap"):
            return Miss("the attention is not BNSD without a softcap (what ge.paged_attention takes)")
        # the blocks' count may be a run-time size (serve's pools, of any size); their size and width may not.
        # ge.paged_attention's shape rule checks that the counts agree once GE specialises the plan
        if (not all(_same(a, b) for a, b in zip(kb.type.shape[:2], vb.type.shape[:2]))
                or None in kb.type.shape[1:] + vb.type.shape[1:]):
            return Miss(f"the key and value pools {kb.type} and {vb.type} are not the same blocks of a static size")
        nkv = kb.type.shape[2]
        n = q.type.shape[1]
        # repeated per group (or, once attention_native dropped the copies, grouped by flash_attention itself)
        if n is not None and (n != nkv * k_group if k_group > 1 else n % nkv):
            return Miss(f"{n} query heads are not a whole group per each of the pool's {nkv} K/V heads")
        return Match(fa, q=q, k_blocks=kb, v_blocks=vb, table=k_table, mask=mask, kv_heads=nkv)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        pools = []
        for blocks in (m.k_blocks, m.v_blocks):
            nb, bs, nkv, d = blocks.type.shape
            pools.append(rw.create("ge.reshape", [blocks], {"shape": [-1 if nb is None else nb, bs, nkv * d]}, before=m.root).result)
        attrs = {"num_key_value_heads": m.kv_heads, "causal": m.root.attr("causal")}
        if m.root.attr("scale") is not None:
            attrs["scale"] = m.root.attr("scale")
        operands = [m.q, *pools, m.table] + ([m.mask] if m.mask is not None else [])
        op = rw.create("ge.paged_attention", operands, attrs, [m.root.result.type], before=m.root)
        rw.replace(m.root, op)
