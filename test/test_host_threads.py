"""A kernel's host arithmetic split over the host's cores (geir.host_threads): every piece once, in its lane, BLAS
held to one thread meanwhile, and FlashAttention's numbers the same bits with any number of lanes."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from geir import host_threads
from geir.kernels import flash_attention as fa
from geir.ops.linalg import FlashAttention
from helpers.attention import attention_inputs


def _blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_every_piece_runs_once_in_its_lane_on_a_thread_of_its_own() -> None:
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()
    ready = threading.Barrier(3, timeout=10)  # all three lanes at once: they are on three threads

    def work(lane: int, part) -> None:
        ready.wait()
        with lock:
            seen.extend((lane, piece, threading.get_ident()) for piece in part)

    pieces = list(range(7))
    assert host_threads.run_split(pieces, work, workers=3) == 3
    assert sorted(p for _, p, _ in seen) == pieces
    for lane in range(3):
        assert [p for ln, p, _ in seen if ln == lane] == pieces[lane::3]
    assert len({ident for _, _, ident in seen}) == 3


def test_one_lane_per_piece_at_most_and_one_lane_runs_here() -> None:
    lanes: list[int] = []
    assert host_threads.run_split([1, 2], lambda lane, part: lanes.append(lane), workers=8) == 2
    here: list[int] = []
    assert host_threads.run_split([1, 2, 3], lambda lane, part: here.append(threading.get_ident()), workers=1) == 1
    assert here == [threading.get_ident()]


def test_lanes_follow_omp_num_threads_where_set_else_the_cores_the_process_may_use(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert host_threads.host_lanes() == 3
    assert host_threads.run_split(list(range(5)), lambda lane, part: None) == 3
    for unset in ("", "0", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert host_threads.host_lanes() == len(os.sched_getaffinity(0))


def test_blas_is_held_to_one_thread_inside_and_given_back_after() -> None:
    with threadpool_limits(2, user_api="blas"):
        before = _blas_threads()
        inside: list[list[int]] = []
        host_threads.run_split([0, 1], lambda lane, part: inside.append(_blas_threads()), workers=2)
        assert inside and all(threads == [1] * len(before) for threads in inside)
        assert _blas_threads() == before


def test_lanes_run_under_the_caller_s_numpy_errstate() -> None:
    seen: dict[int, str] = {}
    with np.errstate(over="raise", under="ignore"):
        host_threads.run_split([0, 1, 2], lambda lane, part: seen.update({lane: np.geterr()["over"]}), workers=3)
    assert seen == {0: "raise", 1: "raise", 2: "raise"}


def test_a_lane_s_error_is_raised_once_every_lane_has_stopped() -> None:
    finished: list[int] = []

    def work(lane: int, part) -> None:
        if lane == 1:
            raise ValueError("lane 1 failed")
        finished.append(lane)

    with pytest.raises(ValueError, match="lane 1 failed"):
        host_threads.run_split([0, 1, 2], work, workers=3)
    assert sorted(finished) == [0, 2]


def _flash(lanes: int, monkeypatch) -> np.ndarray:
    # 3000 keys: the last key block is 952 long, a product whose bits OpenBLAS changes with its thread count on
    # this project's hosts; 12 chunks of 512 query rows, enough to take lanes
    q, k, v, _ = attention_inputs(1, 2, 3000, 64, seed=3)
    monkeypatch.setattr(fa, "run_split", lambda pieces, work, workers=None: host_threads.run_split(
        pieces, work, lanes if workers is None else workers))
    return fa._compute(q, k, v, None, False, 1 / 8, 128, 1024, 1)


def test_flash_attention_gives_the_same_bits_with_any_lanes_and_outer_blas_threads(monkeypatch) -> None:
    one = _flash(1, monkeypatch)
    q, k, v, _ = attention_inputs(1, 2, 3000, 64, seed=3)
    ref = FlashAttention("ge.flash_attention", [], [], {"causal": False, "scale": 1 / 8}).compute(
        *(x.astype(np.float64) for x in (q, k, v)))
    np.testing.assert_allclose(one.astype(np.float64), ref, rtol=1e-2, atol=1e-3)
    for lanes in (2, 3):
        assert _flash(lanes, monkeypatch).tobytes() == one.tobytes()
    # whatever BLAS's thread count around the kernel, its numbers are those of one BLAS thread
    for threads in (1, 2):
        with threadpool_limits(threads, user_api="blas"):
            assert _flash(2, monkeypatch).tobytes() == one.tobytes()
            assert _flash(1, monkeypatch).tobytes() == one.tobytes()
