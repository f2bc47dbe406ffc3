"""The host's cores for a kernel's arithmetic: independent pieces of one launch computed on several threads at once.

A kernel's numpy arithmetic runs on the host, where numpy's elementwise passes use one core and only its BLAS calls
use more. Pieces that are independent (FlashAttention's query-row chunks, each writing its own rows) can instead run
one per host core: numpy releases the GIL inside its loops, so the passes then overlap. OMP_NUM_THREADS, where set,
caps the lanes as it caps torch's threads (the test suite sets it to 1 in each of its worker processes).

BLAS is held to one thread for the whole section, with one lane or many. Its own threads competing with the lanes'
halve the speed instead of doubling it, and its result may depend on its thread count: OpenBLAS picks another kernel
for some shapes when it has more threads ((512 x 952) @ (952 x 64) in f32 differs in the last bits). Held to one, a
kernel's numbers are the same whatever the number of lanes or the host's cores: every piece runs the same numpy calls
on the same operand shapes as it would alone.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from threadpoolctl import ThreadpoolController

T = TypeVar("T")

# one section at a time: BLAS's thread count is the process's, so a second section waits rather than restore that count
# under the first
_section = threading.Lock()


def host_lanes() -> int:
    """How many lanes a split runs at most: OMP_NUM_THREADS where it is set to a count (as torch takes its intra-op
    threads from it), else the host cores this process may run on (its CPU affinity where the OS says)."""
    wish = os.environ.get("OMP_NUM_THREADS", "").strip()
    if wish.isdigit() and int(wish) > 0:
        return int(wish)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@functools.cache
def _blas() -> ThreadpoolController:
    """The BLAS libraries loaded in this process (numpy's among them), to hold to one thread during a split."""
    return ThreadpoolController()


def run_split(pieces: Sequence[T], work: Callable[[int, Sequence[T]], None], workers: int | None = None) -> int:
    """Calls `work(lane, pieces[lane::n])` for lanes 0..n-1, each lane on a thread of its own, BLAS held to one
    thread; returns n.

    n is `workers` (default: host_lanes()) but at most one lane per piece; with one lane every piece runs here
    in order. `work` must keep its lanes apart (a lane's own scratch buffers, disjoint results). Every lane runs in
    the caller's context (its numpy errstate). An exception in any lane is raised here once every lane has stopped.
    """
    n = max(1, min(host_lanes() if workers is None else workers, len(pieces)))
    with _section, _blas().limit(limits=1, user_api="blas"):
        if n == 1:
            work(0, pieces)
            return 1
        with ThreadPoolExecutor(n - 1) as pool:
            # each lane in a copy of the caller's context: numpy's errstate lives there (a thread starts without it)
            others = [pool.submit(contextvars.copy_context().run, work, lane, pieces[lane::n]) for lane in range(1, n)]
            work(0, pieces[0::n])
            for f in others:
                f.result()
    return n
