"""Paged attention on the simulated NPU: FlashAttention over the keys and values a block table names in the pool.

A work unit's key tile is `blocks_per_tile` whole blocks of the pool (kernels/paged_attention_tiling.py): MTE2 reads
each block's rows of its K/V head, block_size x D elements, from wherever the table puts the block, so a tile moves
the bytes of its blocks and nothing else, the same bytes the dense kernel moves for a tile of that many keys. The
tile order, the online softmax and the flash-decoding combine are FlashAttention's (kernels/flash_attention.py),
over the same s1, s2 and key parts, so a paged call's numbers equal the dense kernel's on the gathered blocks bit
for bit. Keys past a row's `actual_seq_lengths_kv` are masked on chip from the lengths (no mask tensor is read).

The lengths are a value-depend input, as IncreFlashAttention's actual_seq_lengths are (its host tiling reads
them; vllm-ascend passes them as a host list, attn_metadata.seq_lens, beside the block table, and in graph mode
updates them in the captured task before each replay): where the host knows them (an input it copied in), each
row's work units stop after the key tiles its length spans, so a row reads and computes its own blocks, not the
table's width. Where they are computed on the device, the kernel reads every tile of the table (and masks).
"""

from __future__ import annotations

import attrs
import numpy as np

from geir.ir import Operation
from geir.kernels import paged_attention_tiling as rules
from geir.kernels.base import Kernel, LaunchContext, no_bytes, register_kernel
from geir.kernels.flash_attention import flash_attention_forward, schedule_problem
from geir.kernels.flash_attention_tiling import workspace_bytes
from geir.kernels.paged_attention_tiling import PagedTiling
from geir.kernels.tiling import Budget, Miss, OpSignature, cube_refuses
from geir.target_npu.residency import covered, residency
from geir.target_npu.sim import GlobalMemory
from geir.target_npu.target import Target


@register_kernel
class PagedAttentionKernel(Kernel):
    """FIA with a block table: FlashAttention's templates over whole blocks of the KV pool."""

    OPS = ("ge.paged_attention",)
    TILING = PagedTiling

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> PagedTiling | Miss:
        return rules.choose(sig, target, buffers)

    def refuses(self, sig: OpSignature, target: Target) -> str | None:
        return cube_refuses(sig.operands[:3], target)

    def budget(self, tiling: PagedTiling, sig: OpSignature, target: Target) -> Budget:
        return rules.budget(tiling, sig, target)

    def value_depend(self, op: Operation) -> tuple[int, ...]:
        return (4,) if op.actual_seq_lengths_kv is not None else ()

    def timing_values(self, tiling: PagedTiling | None, host_values: tuple) -> tuple:
        """The key tiles each row reads: rows of other lengths that span the same tiles time alike."""
        lengths = host_values[4] if len(host_values) > 4 else None
        if lengths is None or tiling is None:
            return super().timing_values(tiling, host_values)
        return tuple(-(-np.asarray(lengths, dtype=np.int64).reshape(-1) // tiling.s2))

    def schedule_problem(self, tiling: PagedTiling, target: Target) -> str | None:
        return schedule_problem(tiling.as_flash(), target)

    def workspace_bytes(self, tiling: PagedTiling, sig: OpSignature) -> int:
        return workspace_bytes(tiling.as_flash(), sig)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: PagedTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        q = inputs[0]
        if ctx.compute:
            # the blocks the table names, in its order: what MTE2 reads block by block (a view of the pool's bytes)
            k, v, mask = op.dense(*inputs)
        else:  # timing only: the table's values are stand-ins, never read; the shapes are what is timed
            k, v, mask = _shapes_only(op, inputs)
        names = ctx.operand_names
        mask_name = names[len(inputs) - 1] if op.mask is not None and len(names) == len(inputs) else None
        tiles = read_tiles(ctx, tiling, k.shape[2])
        # K and V are judged in L2 by the pool slots the table names, not by the pool's latest touch anywhere
        views = [None if len(names) <= i or names[i] is None else
                 _TileView(ctx.gm, names[i], _tile_slots(inputs[3], inputs[i].shape, tiling, ctx.compute),
                           inputs[i].shape[0] * inputs[i].shape[1], k.shape[1]) for i in (1, 2)]
        flash_ctx = attrs.evolve(ctx, operand_names=[names[0], *(w.name if w else None for w in views), mask_name])
        out = flash_attention_forward(q, k, v, mask, op.causal, op.as_flash_attention().effective_scale(q.shape[-1]),
                                      tiling.as_flash(), flash_ctx, kv_tiles=tiles)
        for w in views:
            if w is not None:
                w.commit(ctx.gm)
        return [out]


def _tile_slots(table: np.ndarray, pool_shape: tuple[int, ...], tiling: PagedTiling, known: bool) -> np.ndarray:
    """[B, key tiles, s2]: the pool slots (block x block_size + offset) each row's key tile reads through its table
    (`known`: the table's values; timing only they are stand-ins, and row b reads blocks b x width on, in order, as
    index_put's stand-in positions write slots from 0 on). Columns past the table's width repeat its last one."""
    blocks, bs = pool_shape[0], pool_shape[1]
    b, width = table.shape
    if known:
        ids = np.asarray(table, dtype=np.int64) % max(blocks, 1)
    else:
        ids = (np.arange(b * width, dtype=np.int64).reshape(b, width)) % max(blocks, 1)
    nk = -(-width // tiling.blocks_per_tile)
    cols = np.minimum(np.arange(nk * tiling.blocks_per_tile), width - 1).reshape(nk, tiling.blocks_per_tile)
    slots = ids[:, cols, None] * bs + np.arange(bs)  # [B, nk, blocks a tile, bs]
    return slots.reshape(b, nk, -1)


class _TileView:
    """A K or V pool seen on the kernel's grid of key tiles (B x Nkv x tiles, FlashAttention's K/V blocks): each
    tile's L2 residency is the oldest last touch of the pool slots its row's table names (so a tile is served from
    L2 only if every slot of it is), and once the kernel has read it, those slots take the tile's touch. The pool's
    own residency, on whatever grid its writer left it, is seen per slot (`covered`: never optimistic)."""

    def __init__(self, gm: GlobalMemory, pool: str, slots: np.ndarray, total: int, heads: int):
        self.pool, self.name, self.slots, self.heads = pool, f"{pool}:paged", slots, heads
        self.known = known = gm.last_touch.get(pool)
        self.per_slot = (residency(total, gm.tensor_clock.get(pool, -np.inf)) if known is None
                         else covered(known, total))
        self.before = np.asarray(self.per_slot[slots]).min(axis=-1)  # [B, tiles]
        gm.tensor_clock[self.name] = gm.tensor_clock.get(pool, -np.inf)
        if pool in gm.sizes:
            gm.sizes[self.name] = gm.sizes[pool]
        gm.last_touch[self.name] = np.repeat(self.before[:, None, :], heads, axis=1).reshape(-1)

    def commit(self, gm: GlobalMemory) -> None:
        """The tiles' touches back into the pool's slots (a tile the kernel did not read leaves its slots alone)."""
        b, nk = self.slots.shape[:2]
        after = np.asarray(gm.last_touch[self.name]).reshape(b, self.heads, nk).min(axis=1)
        if gm.last_touch.get(self.pool) is not self.known:  # one pool as both K and V: the other view committed
            self.per_slot = gm.last_touch[self.pool]
        read = after != self.before
        if read.any():
            rows, tiles = np.nonzero(read)
            self.per_slot[self.slots[rows, tiles].reshape(-1)] = np.repeat(after[rows, tiles], self.slots.shape[2])
        gm.last_touch[self.pool] = self.per_slot
        gm.tensor_clock[self.pool] = gm.tensor_clock[self.name]
        del gm.last_touch[self.name]


def read_tiles(ctx: LaunchContext, tiling: PagedTiling, keys: int) -> np.ndarray | None:
    """Per batch row, the key tiles its actual length spans (at most the table's), where the host knows the lengths
    (`value_depend`); None: every row reads the whole table."""
    lengths = ctx.host_values[4] if len(ctx.host_values) > 4 else None
    if lengths is None:
        return None
    spans = -(-np.clip(np.asarray(lengths, dtype=np.int64).reshape(-1), 0, keys) // tiling.s2)
    return spans


def _shapes_only(op: Operation, inputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Dense keys and values, and a mask, of the shapes a paged call attends over, holding no bytes (timing only:
    the gathered keys of a long table would otherwise take the host as much memory as the blocks they name)."""
    q, kc, vc, table = inputs[:4]
    nkv, length = op.num_key_value_heads, table.shape[1] * kc.shape[1]
    k = no_bytes((q.shape[0], nkv, length, kc.shape[2] // nkv), kc.dtype)
    v = no_bytes((q.shape[0], nkv, length, vc.shape[2] // nkv), vc.dtype)
    masks = [x for x in inputs[4:] if not np.issubdtype(x.dtype, np.integer)]
    shape = (q.shape[0], q.shape[1], q.shape[2], length)
    if masks:
        return k, v, no_bytes(shape, masks[0].dtype)
    return k, v, (np.broadcast_to(np.bool_(True), shape) if len(inputs) > 4 else None)
