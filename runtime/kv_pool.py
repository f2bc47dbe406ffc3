"""A paged KV cache's bookkeeping: a pool of fixed-size blocks and a block table per sequence (vLLM's allocator).

The pool holds `num_blocks` blocks of `block_size` token slots each (every layer's keys and values for those
tokens: `bytes_per_token` bytes a token). A sequence's block table grows a block at a time as its tokens
need one, never moving what it has (no copy on growth), and all its blocks go back to the free list when it
finishes or is preempted. Waste is the slots allocated beyond the tokens (at most block_size - 1 per
sequence: the last block's tail), as the PagedAttention paper counts it.
"""

from __future__ import annotations

import attrs


class PoolFull(Exception):
    """The pool has too few free blocks for a request; nothing was allocated."""


@attrs.frozen
class PoolUsage:
    """The pool at one moment: blocks in use, the slots they hold and the tokens stored in them."""

    used_blocks: int
    allocated_slots: int
    token_slots: int
    sequences: int

    @property
    def waste_slots(self) -> int:
        """Slots allocated beyond the tokens."""
        return self.allocated_slots - self.token_slots


class KVBlockPool:
    """Fixed-size KV blocks and a block table per sequence, allocated on demand and freed whole."""

    def __init__(self, num_blocks: int, block_size: int, bytes_per_token: int):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {block_size}")
        if num_blocks < 0 or bytes_per_token < 1:
            raise ValueError(f"a pool needs num_blocks >= 0 and bytes_per_token >= 1, not {num_blocks}, "
                             f"{bytes_per_token}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        # the lowest block ids are handed out first, which keeps tables easy to read: blocks freed (a stack, the
        # last freed first), then the never-used ones from `_fresh` up (not listed: a pool of millions of blocks
        # would take the host as many list entries)
        self._free: list[int] = []
        self._fresh = 0
        self.tables: dict[object, list[int]] = {}
        self.tokens: dict[object, int] = {}
        self.peak_blocks = 0

    @classmethod
    def from_bytes(cls, pool_bytes: int, block_size: int, bytes_per_token: int) -> KVBlockPool:
        """As many whole blocks as `pool_bytes` holds (a partial block's bytes are left unused)."""
        return cls(pool_bytes // (block_size * bytes_per_token), block_size, bytes_per_token)

    @property
    def block_bytes(self) -> int:
        """The device bytes of one block."""
        return self.block_size * self.bytes_per_token

    @property
    def pool_bytes(self) -> int:
        """The device bytes of the whole pool (whole blocks only)."""
        return self.num_blocks * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def used_blocks(self) -> int:
        return self._fresh - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of `tokens` tokens needs."""
        return -(-tokens // self.block_size)

    def fits_ever(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` tokens fits the pool even when it is the only one."""
        return self.blocks_for(tokens) <= self.num_blocks

    def needed(self, seq: object, tokens: int) -> int:
        """New blocks `seq` needs to hold `tokens` tokens (0 when its table already covers them)."""
        return max(0, self.blocks_for(tokens) - len(self.tables.get(seq, ())))

    def can_hold(self, seq: object, tokens: int) -> bool:
        """Whether the free blocks cover what `seq` needs to hold `tokens` tokens."""
        return self.needed(seq, tokens) <= self.free_blocks

    def allocate(self, seq: object, tokens: int) -> list[int]:
        """Grow `seq`'s block table to hold `tokens` tokens (a new sequence gets a table); its earlier blocks stay
        where they are. All or nothing: PoolFull, with nothing allocated, when the free blocks are too few. The
        tokens stored are `store`'s to say (a reservation ahead of them, as static batching makes, is waste)."""
        need = self.needed(seq, tokens)
        if need > self.free_blocks:
            raise PoolFull(f"{seq!r} needs {need} more block(s) of {self.block_size} tokens, {self.free_blocks} free")
        table = self.tables.setdefault(seq, [])
        reused = min(need, len(self._free))
        table.extend(self._free.pop() for _ in range(reused))
        table.extend(range(self._fresh, self._fresh + need - reused))
        self._fresh += need - reused
        self.tokens.setdefault(seq, 0)
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        return table

    def store(self, seq: object, tokens: int) -> None:
        """Record that `seq`'s blocks now hold `tokens` tokens (at most its table's slots)."""
        slots = len(self.tables.get(seq, ())) * self.block_size
        if tokens > slots:
            raise ValueError(f"{seq!r} stores {tokens} tokens in {slots} allocated slots")
        self.tokens[seq] = tokens

    def free(self, seq: object) -> int:
        """Return all of `seq`'s blocks to the pool (it finished, or was preempted); the blocks freed."""
        table = self.tables.pop(seq, [])
        self.tokens.pop(seq, None)
        self._free.extend(reversed(table))
        return len(table)

    def usage(self) -> PoolUsage:
        """The pool now."""
        used = sum(len(t) for t in self.tables.values())
        return PoolUsage(used, used * self.block_size, sum(self.tokens.values()), len(self.tables))
