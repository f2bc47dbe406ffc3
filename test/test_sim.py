"""The simulated chip's mechanics: pipes run in parallel, events order them, buffers have capacities, L2 serves reuse."""

from __future__ import annotations

import numpy as np
import pytest

from geir.target_npu import load_target
from geir.target_npu.sim import Buffer, CapacityError, Cores, GlobalMemory, buffers_of, cube_cycles, spread


def test_pipes_run_in_parallel_and_events_order_them() -> None:
    cores = Cores(2)
    both = np.arange(2)
    load = cores.issue("MTE2", both, np.array([10.0, 20.0]))
    other = cores.issue("VECTOR", both, 5.0)  # independent: starts at 0 beside the load
    compute = cores.issue("CUBE", both, 7.0, after=[load])
    assert list(other) == [5.0, 5.0]
    assert list(compute) == [17.0, 27.0]
    again = cores.issue("MTE2", both, 1.0)  # the pipe is in order: after the first load
    assert list(again) == [11.0, 21.0]
    assert list(cores.busy[0]) == [11.0, 21.0]
    assert cores.finish == 27.0


def test_buffer_overflow_names_buffer_request_and_capacity() -> None:
    ub = Buffer("UB", 1024)
    ub.alloc(1000, "scores")
    with pytest.raises(CapacityError, match=r"UB overflow: output needs 32 bytes, but UB holds 1024 bytes and 1024"):
        ub.alloc(1, "output")


def test_buffers_have_the_targets_capacities() -> None:
    b = buffers_of(load_target("ascend910b"))
    assert b["UB"].capacity == 192 * 1024 and b["L0C"].capacity == 128 * 1024
    assert buffers_of(load_target("ascend310p"))["UB"].capacity == 256 * 1024


def test_reuse_within_l2_is_served_at_the_l2_rate() -> None:
    t = load_target("ascend910b")
    gm = GlobalMemory(t)
    gm.tensor("k", 4)
    first = gm.read("k", np.array([0, 1]), 4096)
    second = gm.read("k", np.array([0, 1]), 4096)
    assert np.all(second < first)  # the second read hits L2
    assert gm.gm_read_bytes == 4 * 4096 and gm.hbm_read_bytes == 2 * 4096


def test_data_evicted_past_l2_capacity_comes_from_hbm_again() -> None:
    gm = GlobalMemory(load_target("ascend310p"))  # 16 MiB L2
    gm.tensor("a", 1)
    gm.tensor("big", 64)
    gm.read("a", np.array([0]), 1024)
    gm.read("big", np.arange(64), 2**20)  # 64 MiB stream evicts it
    before = gm.hbm_read_bytes
    gm.read("a", np.array([0]), 1024)
    assert gm.hbm_read_bytes == before + 1024


def test_data_cores_read_together_is_one_touch_of_the_l2() -> None:
    # the L2 holds lines: 16 cores reading the same 1 MiB block in one request move 16 MiB to the cores but touch
    # 1 MiB of the cache, so the reuse distance of what was read before grows by 1 MiB, not 16
    gm = GlobalMemory(load_target("ascend310p"))  # 16 MiB L2
    gm.tensor("a", 1)
    gm.tensor("shared", 1)
    gm.read("a", np.array([0]), 1024)
    clock = gm.clock
    for _ in range(4):  # 4 x 16 cores x 1 MiB moved, far past the L2, of 1 MiB of distinct data
        gm.read("shared", np.zeros(16, dtype=np.int64), 2**20)
    assert gm.gm_read_bytes == 1024 + 64 * 2**20
    assert gm.clock - clock == 4 * 2**20
    before = gm.hbm_read_bytes
    gm.read("a", np.array([0]), 1024)
    assert gm.hbm_read_bytes == before  # still in the L2


def test_cube_cycles_count_fractals_and_f32_halves_the_rate() -> None:
    t = load_target("ascend910b")
    assert cube_cycles(t, "f16", 128, 64, 128) == 8 * 4 * 8
    assert cube_cycles(t, "f32", 128, 64, 128) == 2 * cube_cycles(t, "f16", 128, 64, 128)


def test_units_are_dealt_in_waves_that_snake_across_the_cores() -> None:
    waves = spread(50, 24)
    assert [len(units) for units, _ in waves] == [24, 24, 2]
    assert list(waves[0][1][:2]) == [0, 1] and list(waves[1][1][:2]) == [23, 22]
    assert list(waves[2][0]) == [48, 49] and list(waves[2][1]) == [0, 1]


def test_a_workspace_gives_back_the_l2_share_it_took_and_no_more() -> None:
    t = load_target("ascend910b")
    gm = GlobalMemory(t)
    gm.workspace("small", 4, 1 << 20)
    assert gm.l2_bytes == t.memory.l2_bytes - (1 << 20)
    gm.workspace("huge", 4, 2 * t.memory.l2_bytes)  # larger than what is left: it takes the rest, all of it
    assert gm.l2_bytes == 0
    gm.release("huge")
    gm.release("small")
    # the L2 is its capacity again: a reuse distance of at least that is a miss whatever ran (runtime/launch_memo)
    assert gm.l2_bytes == t.memory.l2_bytes


@pytest.mark.parametrize("pieces", [1, 2])
def test_a_workspace_move_is_read_pieces_and_write_pieces_to_the_bit(pieces) -> None:
    """GlobalMemory.workspace_move, the CV-split kernels' shortcut for their workspace slots, against the general
    moves on twin memories: the same cycles per row, byte counters, last touches and tensor clock, for writes
    over blocks fresh, hot and evicted; a read that finds a piece evicted is refused (None) and changes nothing."""
    import copy

    target = load_target("ascend910b")
    gm = GlobalMemory(target)
    gm.tensor("w", 64)
    gm.workspace("ws", 16, 16 * 4096)
    rng = np.random.default_rng(3)
    refused = evicted_writes = 0
    for step in range(40):
        rows = rng.choice(16, size=(rng.integers(1, 8), pieces), replace=False)
        nbytes = int(rng.integers(1, 5000))
        write = bool(rng.integers(2))
        if step % 7 == 3:  # other traffic evicts the workspace's lines: some reads must miss
            gm.read("w", np.arange(64), gm.l2_bytes // 32)
        twin = copy.deepcopy(gm)
        written_back = gm.hbm_write_bytes
        got = gm.workspace_move("ws", rows, nbytes, write)
        sizes = np.full(rows.shape, nbytes, dtype=np.int64)
        want = (twin.write_pieces if write else twin.read_pieces)("ws", rows, sizes)
        if got is None:
            assert not write and np.any(want > target.memory.dma_latency_cycles + pieces * nbytes
                                        / target.memory.l2_read_bytes_per_cycle)
            gm = twin  # the general move's effect stands
            refused += 1
            continue
        evicted_writes += gm.hbm_write_bytes > written_back  # a write over blocks that had left the L2
        assert np.array_equal(np.full(len(rows), got), want)
        for a, b in ((gm.gm_read_bytes, twin.gm_read_bytes), (gm.gm_write_bytes, twin.gm_write_bytes),
                     (gm.hbm_read_bytes, twin.hbm_read_bytes), (gm.hbm_write_bytes, twin.hbm_write_bytes),
                     (gm.clock, twin.clock), (gm.tensor_clock["ws"], twin.tensor_clock["ws"])):
            assert a == b
        assert np.array_equal(gm.last_touch["ws"], twin.last_touch["ws"])
    assert refused and evicted_writes  # both cases were met
