"""The KV block pool (geir.runtime.kv_pool): blocks on demand, never moved, freed whole; waste by count.

Oracles: ceil(tokens / block_size) blocks per sequence, the pool's blocks = floor(bytes / block bytes), waste =
blocks x block_size - tokens, and a brute-force replay of random grow/free traffic against those formulas.
"""

from __future__ import annotations

import math
import random

import pytest

from geir.runtime.kv_pool import KVBlockPool, PoolFull


def test_the_pool_is_sized_in_whole_blocks_from_its_bytes():
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, f32
    pool = KVBlockPool.from_bytes(20_000, 8, per_token)
    assert pool.block_bytes == 8 * per_token
    assert pool.num_blocks == 20_000 // (8 * per_token) == 4
    assert pool.pool_bytes == 4 * 8 * per_token <= 20_000


def test_a_table_grows_a_block_at_a_time_without_moving_earlier_blocks():
    pool = KVBlockPool(6, 4, 1)
    first = list(pool.allocate("a", 3))
    assert len(first) == 1
    for tokens in range(4, 14):
        table = pool.allocate("a", tokens)
        pool.store("a", tokens)
        assert len(table) == math.ceil(tokens / 4)
        assert table[:len(first)] == first  # growth appends: what was there stays (no copy)
        first = list(table)
    assert pool.used_blocks == 4 and pool.free_blocks == 2
    u = pool.usage()
    assert (u.allocated_slots, u.token_slots, u.waste_slots) == (16, 13, 3)


def test_allocation_is_all_or_nothing_and_freeing_returns_every_block():
    pool = KVBlockPool(3, 4, 1)
    pool.allocate("a", 8)
    with pytest.raises(PoolFull, match="needs 2 more block"):
        pool.allocate("b", 5)
    assert "b" not in pool.tables and pool.used_blocks == 2
    assert not pool.can_hold("b", 5) and pool.can_hold("b", 4)
    assert pool.free("a") == 2 and pool.free_blocks == 3
    assert pool.fits_ever(12) and not pool.fits_ever(13)
    assert pool.peak_blocks == 2


def test_random_traffic_keeps_the_counts_the_formulas_give():
    rng = random.Random(0)
    pool = KVBlockPool(40, 16, 3)
    live: dict[int, int] = {}
    peak = 0
    for step in range(2000):
        if live and rng.random() < 0.2:
            seq = rng.choice(list(live))
            pool.free(seq)
            del live[seq]
        else:
            seq = rng.choice(list(live)) if live and rng.random() < 0.7 else step
            tokens = live.get(seq, 0) + rng.randint(1, 20)
            need = math.ceil(tokens / 16) - math.ceil(live.get(seq, 0) / 16)
            used = sum(math.ceil(t / 16) for t in live.values())
            if need > 40 - used:
                with pytest.raises(PoolFull):
                    pool.allocate(seq, tokens)
                continue
            pool.allocate(seq, tokens)
            pool.store(seq, tokens)
            live[seq] = tokens
        used = sum(math.ceil(t / 16) for t in live.values())
        peak = max(peak, used)
        u = pool.usage()
        assert (u.used_blocks, u.token_slots, u.sequences) == (used, sum(live.values()), len(live))
        assert u.waste_slots == 16 * used - sum(live.values())
        # every block is in exactly one place: a table, the freed blocks or the never-used ones
        owned = [b for t in pool.tables.values() for b in t]
        assert sorted(owned + pool._free + list(range(pool._fresh, 40))) == list(range(40))
    assert pool.peak_blocks == peak


def test_a_reservation_ahead_of_the_tokens_counts_as_waste():
    pool = KVBlockPool(10, 4, 1)
    pool.allocate("static", 20)  # reserved for the longest the sequence may get
    pool.store("static", 6)
    assert pool.usage().waste_slots == 20 - 6
    with pytest.raises(ValueError, match="stores 21 tokens in 20"):
        pool.store("static", 21)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        KVBlockPool(4, 0, 1)
