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
