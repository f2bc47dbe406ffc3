"""A large tensor's per-block L2 residency (GlobalMemory.last_touch) kept as runs of equal last touches.

GlobalMemory keeps one last touch (a byte-clock value, float64) per 512-byte block of each tensor. For an
ordinary tensor that is a numpy array; for a KV pool of tens of GB it would be hundreds of MB of host memory,
most of it saying "never touched". A tensor of more than SPARSE_FROM blocks keeps its residency here instead:
sorted run starts and each run's value, merged where neighbours agree (so the runs are canonical: equal
residencies have equal runs). It is read and written as the array is (`r[blocks]`, `r[blocks] = values`,
`len(r)`), returning the same float64 values to the last bit, so every device time is what the array gives;
host memory is a few numbers per run, whatever the tensor's size.
"""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np

# tensors of more blocks than this (a 512 MiB tensor at 512-byte blocks: its array would take 8 MiB) keep runs
SPARSE_FROM = 1 << 20


class SparseResidency:
    """Per-block last touches of `n` blocks as runs: block b's value is values[i] for starts[i] <= b < starts[i+1]."""

    __slots__ = ("n", "starts", "values")

    def __init__(self, n: int, fill: float, starts: np.ndarray | None = None, values: np.ndarray | None = None):
        self.n = int(n)
        if starts is None:
            self.starts = np.zeros(min(self.n, 1), dtype=np.int64)
            self.values = np.full(len(self.starts), fill, dtype=np.float64)
        else:
            self.starts, self.values = _merged(starts, values)

    def __len__(self) -> int:
        return self.n

    @property
    def runs(self) -> int:
        return len(self.starts)

    def __getitem__(self, idx: Any) -> Any:
        """The values at block ids `idx` (an int array of any shape, or an int), as the array would give them."""
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(self.n))
        if len(self.values) == 1:
            return np.full(np.shape(idx), self.values[0])[()] if np.ndim(idx) else self.values[0]
        return self.values[np.searchsorted(self.starts, idx, side="right") - 1]

    def __setitem__(self, idx: Any, vals: Any) -> None:
        """`array[idx] = vals`: a block listed more than once keeps the last value given (as numpy assigns)."""
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(self.n))
        idx = np.asarray(idx)
        vals = np.broadcast_to(np.asarray(vals, dtype=np.float64), idx.shape).reshape(-1)
        idx = idx.reshape(-1).astype(np.int64)
        if not idx.size:
            return
        idx = np.where(idx < 0, idx + self.n, idx)
        if idx.min() < 0 or idx.max() >= self.n:
            raise IndexError(f"block index out of range for {self.n} blocks")
        order = np.argsort(idx, kind="stable")
        i, v = idx[order], vals[order]
        last = np.ones(len(i), dtype=bool)
        last[:-1] = i[1:] != i[:-1]  # the last of equal ids: the value numpy's assignment leaves
        i, v = i[last], v[last]
        # the assigned blocks as runs [a, b) of value av
        brk = np.ones(len(i), dtype=bool)
        brk[1:] = (i[1:] != i[:-1] + 1) | _differ(v[1:], v[:-1])
        heads = np.flatnonzero(brk)
        a, av = i[heads], v[heads]
        b = i[np.append(heads[1:] - 1, len(i) - 1)] + 1
        # old runs that start outside every new run keep their start; where a new run ends inside an old one,
        # the old value resumes
        k = np.searchsorted(a, self.starts, side="right") - 1
        covered = (k >= 0) & (self.starts < b[np.maximum(k, 0)])
        tails = b[b < self.n]
        tails = tails[~np.isin(tails, a)]
        pos = np.concatenate([self.starts[~covered], a, tails])
        val = np.concatenate([self.values[~covered], av, self[tails] if tails.size else np.empty(0)])
        order = np.argsort(pos, kind="stable")
        pos, val = pos[order], val[order]
        keep = np.ones(len(pos), dtype=bool)
        keep[1:] = pos[1:] != pos[:-1]  # a tail on a kept start: the same old value
        self.starts, self.values = _merged(pos[keep], val[keep])

    def copy(self) -> SparseResidency:
        return SparseResidency(self.n, 0.0, self.starts.copy(), self.values.copy())

    def dense(self) -> np.ndarray:
        """The per-block array (as large as the tensor's block count: for tests and small tensors)."""
        return np.repeat(self.values, np.diff(np.append(self.starts, self.n)))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.dense()
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list[float]:
        return self.dense().tolist()

    def __rsub__(self, clock: float) -> SparseResidency:
        """`clock - r`, block by block (the launch memo's relative form): the same subtraction, per run."""
        return SparseResidency(self.n, 0.0, self.starts, clock - self.values)

    def absolute(self, clock: float) -> SparseResidency:
        """The last touches relative values (`clock - r` taken earlier) give at `clock`."""
        return clock - self

    def key(self) -> Hashable:
        """Everything the values are, hashable (equal residencies give equal keys: the runs are canonical)."""
        return ("runs", self.n, self.starts.tobytes(), self.values.tobytes())

    @property
    def nbytes(self) -> int:
        return self.starts.nbytes + self.values.nbytes

    def resampled(self, n: int) -> SparseResidency:
        """This residency seen on a grid of `n` blocks: block j takes block floor(j * len / n)'s value."""
        return resampled(self, n)


class Deferred:
    """A tensor's residency that is not built until something reads it (a launch replayed by the Runtime's memo
    leaves the residency it records for every tensor it touched, and most are never read again in the run)."""

    def materialize(self) -> np.ndarray | SparseResidency:
        raise NotImplementedError


class Residencies(dict):
    """GlobalMemory.last_touch: each tensor's per-block residency by name, a Deferred one built on first read (so
    every reader sees an array or runs, never the deferral); `peek` gives a value as stored, deferred or not."""

    def __getitem__(self, name: str) -> np.ndarray | SparseResidency:
        value = dict.__getitem__(self, name)
        if isinstance(value, Deferred):
            value = self._built(name, value)
        return value

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def pop(self, name: str, *default: Any) -> Any:
        value = dict.pop(self, name, *default)
        return value.materialize() if isinstance(value, Deferred) else value

    def values(self) -> Any:
        return [self[k] for k in self]

    def items(self) -> Any:
        return [(k, self[k]) for k in self]

    def peek(self, name: str) -> Any:
        """The stored value: maybe a Deferred (for a reader that can use it unbuilt); None where there is none."""
        return dict.get(self, name)

    def _built(self, name: str, value: Deferred) -> np.ndarray | SparseResidency:
        built = value.materialize()
        dict.__setitem__(self, name, built)
        return built


def _differ(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Whether float64 values differ to the bit (so -0.0 and 0.0 differ, and a NaN equals itself)."""
    return x.view(np.int64) != y.view(np.int64)


def _merged(starts: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs with neighbours of equal value merged (the canonical form)."""
    starts, values = np.asarray(starts, dtype=np.int64), np.asarray(values, dtype=np.float64)
    if len(starts) < 2:
        return starts.copy(), values.copy()
    keep = np.ones(len(starts), dtype=bool)
    keep[1:] = _differ(values[1:], values[:-1])
    return starts[keep], values[keep]


def residency(blocks: int, fill: float) -> np.ndarray | SparseResidency:
    """A fresh per-block residency of `blocks` blocks all at `fill`: an array, or runs past SPARSE_FROM blocks."""
    if blocks > SPARSE_FROM:
        return SparseResidency(blocks, fill)
    return np.full(blocks, fill)


def resampled(last: np.ndarray | SparseResidency, n: int) -> np.ndarray | SparseResidency:
    """`last` seen on a grid of `n` blocks: block j takes block floor(j * len(last) / n)'s value (runs past
    SPARSE_FROM blocks, built from `last`'s runs without listing the blocks)."""
    size = len(last)
    if n <= SPARSE_FROM and not isinstance(last, SparseResidency):
        return last[(np.arange(n) * size) // n]
    if isinstance(last, SparseResidency):
        starts, values = last.starts, last.values
    else:
        starts, values = _merged(np.arange(size), last)
    if n <= SPARSE_FROM:
        return last[(np.arange(n) * size) // n]
    # j lands in the run starting at s where s <= floor(j size / n), i.e. from j = ceil(s n / size) on
    new = np.unique((starts * n + size - 1) // size) if size else np.zeros(0, dtype=np.int64)
    new = new[new < n]
    return SparseResidency(n, 0.0, new, values[np.searchsorted(starts, (new * size) // n, side="right") - 1])


def covered(last: np.ndarray | SparseResidency, n: int) -> np.ndarray | SparseResidency:
    """`last` seen on a grid of `n` blocks cut over the same bytes, never optimistic: block j covers old blocks
    [floor(j len / n), ceil((j + 1) len / n)) and takes the oldest last touch among them (it is served from L2
    only if all of its bytes are). Runs past SPARSE_FROM blocks, built from `last`'s runs without listing blocks."""
    size = len(last)
    if isinstance(last, SparseResidency):
        starts, values = last.starts, last.values
    else:
        starts, values = _merged(np.arange(size), np.asarray(last, dtype=np.float64))
    if not size or not n:
        return residency(n, -np.inf)
    # the value changes only at a new block whose range meets an old run's boundary s: the first block that may
    # reach s (floor(s n / len)) and the first wholly past s - 1 (ceil(s n / len)); between those it is constant
    bounds = starts[1:]
    cand = np.unique(np.concatenate([[0], (bounds * n) // size, -(-(bounds * n) // size)]))
    cand = cand[cand < n]
    lo = (cand * size) // n
    hi = np.minimum(np.maximum(lo + 1, -(-((cand + 1) * size) // n)), size)
    first = np.searchsorted(starts, lo, side="right") - 1
    last_run = np.searchsorted(starts, hi - 1, side="right") - 1
    # ranges of neighbouring candidates share at most one run (last_run[k] <= first[k + 1]), so one reduceat over
    # [first, last_run + 1) pairs gives each range's minimum (the slots between pairs are dropped)
    edges = np.empty(2 * len(cand), dtype=np.int64)
    edges[0::2], edges[1::2] = first, last_run + 1
    mins = np.minimum.reduceat(np.append(values, np.inf), edges)[0::2]
    if n > SPARSE_FROM:
        return SparseResidency(n, 0.0, cand, mins)
    return np.repeat(mins, np.diff(np.append(cand, n)))
