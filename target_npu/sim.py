"""The simulated chip: per-core pipes timed in parallel, on-chip buffers with real capacities, and
global memory as HBM behind a shared L2.

Kernels describe work as instructions on named pipes; `Cores.issue` times one instruction on
many cores at once (one numpy lane per core), so a kernel runs the same tile step of every
core as one batched operation while every core and pipe still gets its own start and end
times. An instruction starts when its pipe is free and every event it waits for has happened
(the set/wait flags of Ascend C are the end-time arrays passed in `after`).
"""

from __future__ import annotations

from typing import Iterable

import attrs
import numpy as np

from geir.target_npu.residency import Residencies, SparseResidency, residency
from geir.target_npu.target import Target

# AIV_MTE2: on a chip whose cube and vector units are separate cores (Atlas A2), the vector core's own
# GM -> UB engine; a core's MTE2 is then the cube core's (GM -> L1). Elsewhere one MTE2 serves both units.
PIPES = ("MTE2", "MTE1", "CUBE", "FIXP", "VECTOR", "MTE3", "AIV_MTE2", "SCALAR")
PIPE_INDEX = {name: i for i, name in enumerate(PIPES)}


class DeviceFault(RuntimeError):
    """An access the device would fault on: outside its memory, misaligned, or outside the tensor an index
    addresses (a kernel raises it; the Runtime reports it at the launch)."""


class CapacityError(RuntimeError):
    """A tile that does not fit an on-chip buffer: names the buffer, the request and the capacity."""

    def __init__(self, buffer: str, requested: int, capacity: int, used: int, what: str):
        super().__init__(f"{buffer} overflow: {what} needs {requested} bytes, but {buffer} holds {capacity} bytes"
                         f" and {used} are already taken")
        self.buffer, self.requested, self.capacity, self.used = buffer, requested, capacity, used


@attrs.define
class Buffer:
    """One on-chip buffer of a core (UB, L1, L0A, L0B, L0C): allocations must fit its capacity."""

    name: str
    capacity: int
    used: int = 0
    peak: int = 0

    def alloc(self, nbytes: int, what: str) -> int:
        """Reserve `nbytes` (32-byte aligned) and return the offset; CapacityError past the capacity."""
        nbytes = -(-nbytes // 32) * 32
        if self.used + nbytes > self.capacity:
            raise CapacityError(self.name, nbytes, self.capacity, self.used, what)
        offset = self.used
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return offset

    def reset(self) -> None:
        self.used = 0


@attrs.define
class PipeInterval:
    """What one instruction did on one pipe of several cores (for the trace)."""

    pipe: int
    name: str
    cores: np.ndarray
    start: np.ndarray
    end: np.ndarray


class Cores:
    """Timing state of every core's pipes, in cycles; instructions are issued for many cores at once."""

    def __init__(self, count: int, record: bool = False):
        self.count = count
        self.free = np.zeros((len(PIPES), count))
        self.busy = np.zeros((len(PIPES), count))
        self.record = record
        self.intervals: list[PipeInterval] = []

    def issue(self, pipe: str, cores: np.ndarray, cost: np.ndarray | float, after: Iterable[np.ndarray] = (),
              name: str = "") -> np.ndarray:
        """Run one instruction on `pipe` of each core in `cores`; returns its end times (an event to wait on)."""
        p = PIPE_INDEX[pipe]
        start = self.free[p, cores]
        for event in after:
            start = np.maximum(start, event)
        end = start + cost
        self.free[p, cores] = end
        self.busy[p, cores] += cost
        if self.record:
            self.intervals.append(PipeInterval(p, name, cores, start, end))
        return end

    def now(self, cores: np.ndarray) -> np.ndarray:
        """When every pipe of these cores is idle."""
        return self.free[:, cores].max(axis=0)

    def sync_to(self, t: float) -> None:
        """No pipe starts before `t` (a kernel launch after the previous one finished)."""
        np.maximum(self.free, t, out=self.free)

    def place(self, frame: "Cores", start: float) -> None:
        """Put a launch timed in a frame of its own (cores like these, every pipe free at 0) on this
        timeline at `start`, when every pipe here is idle. A launch timed from 0 takes the same cycles
        wherever it lands, to the last bit, so the Runtime may time one launch once for many places."""
        self.free = start + frame.free
        self.busy += frame.busy
        if self.record:
            self.intervals.extend(PipeInterval(i.pipe, i.name, i.cores, start + i.start, start + i.end)
                                  for i in frame.intervals)

    @property
    def finish(self) -> float:
        return float(self.free.max()) if self.count else 0.0


class GlobalMemory:
    """HBM behind the shared L2, tracked per block of each tensor.

    A block is served from L2 when fewer bytes than the L2's capacity have moved since it was
    last touched (its reuse distance: exact for LRU when every byte moved is distinct, and never
    optimistic otherwise). Misses are read at the HBM rate, which the cores missing together share.
    """

    def __init__(self, target: Target):
        mem = target.memory
        self.l2_bytes = mem.l2_bytes
        self.l2_rate = mem.l2_read_bytes_per_cycle
        self.hbm_rate = mem.hbm_read_bytes_per_cycle
        self.chip_hbm_rate = mem.hbm_bytes_per_s / target.clock_hz  # bytes per cycle, whole chip
        self.latency = mem.dma_latency_cycles
        self.clock = 0  # bytes moved so far: the reuse-distance clock
        # runs for a tensor of many blocks; a launch memo's replay may defer one (built when read)
        self.last_touch: Residencies = Residencies()
        self.tensor_clock: dict[str, int] = {}  # when each tensor was last touched, whatever its blocks
        self.sizes: dict[str, int] = {}  # bytes of each tensor, where declared
        self.gm_read_bytes = 0
        self.gm_write_bytes = 0
        self.hbm_read_bytes = 0
        self.hbm_write_bytes = 0
        self.scratch: set[str] = set()  # kernels' workspaces: rewritten in place while the L2 holds them
        self.held: dict[str, int] = {}  # each workspace's share of the L2, given back when it is released

    def workspace(self, name: str, blocks: int, nbytes: int) -> None:
        """Register a kernel's GM workspace of `blocks` blocks and `nbytes` bytes, never touched yet.

        A workspace is a few slots rewritten over and over: its traffic touches no more than `nbytes` distinct
        bytes, so it does not advance the reuse-distance clock (which counts distinct bytes); while it is in
        use its lines hold that much of the L2, which holds that much less of everything else."""
        self.last_touch[name] = residency(blocks, -np.inf)
        self.tensor_clock[name] = -np.inf
        self.scratch.add(name)
        self.sizes[name] = nbytes
        self.held[name] = min(nbytes, self.l2_bytes)  # no more than the L2 has left: all of it
        self.l2_bytes -= self.held[name]

    def release(self, name: str) -> None:
        """A workspace's launch is over: its L2 share returns to the other tensors."""
        self.scratch.discard(name)
        # what it took, not its size: a workspace larger than the L2 took the L2, and the L2 never grows past it
        self.l2_bytes += self.held.pop(name, 0)
        self.sizes.pop(name, None)
        self.last_touch.pop(name, None)
        self.tensor_clock.pop(name, None)

    def tensor(self, name: str, blocks: int, resident: bool = False) -> None:
        """Register a fresh tensor cut into `blocks` blocks; `resident` when it was just written to L2."""
        self.last_touch[name] = residency(blocks, self.clock if resident else -np.inf)
        self.tensor_clock[name] = self.clock if resident else -np.inf

    def forget(self, name: str) -> None:
        """New contents arrived from outside the chip (a host copy): none of it is in L2."""
        self.last_touch.pop(name, None)
        self.tensor_clock[name] = -np.inf

    def ensure(self, name: str, blocks: int) -> None:
        """Register a tensor cut into `blocks` blocks, keeping what is known of its residency.

        Kernels cut tensors into blocks of their own; between kernels residency is kept per tensor
        (when it was last written or read), so the next kernel starts from that.
        """
        known = self.last_touch.get(name)
        if known is None or len(known) != blocks:
            self.last_touch[name] = residency(blocks, self.tensor_clock.get(name, -np.inf))

    def declare(self, name: str, nbytes: int) -> None:
        """The size of a tensor in global memory (the Runtime declares each operand and result)."""
        self.sizes[name] = nbytes

    def read_pieces(self, name: str, blocks: np.ndarray, nbytes: np.ndarray,
                    key: np.ndarray | None = None) -> np.ndarray:
        """Cycles for each core to read its pieces: row i lists core i's block ids and bytes (0 = no piece).

        A piece is an L2 hit when fewer distinct bytes than the L2 holds were touched since its block was last
        touched (the byte clock; an LRU cache's reuse distance in bytes); cores with the same `key` read the
        same data together: the first brings it in, the others hit, and the clock counts it once.
        Misses run at the HBM rate, which the cores missing together share.
        """
        last = self.last_touch[name]
        valid = nbytes > 0
        hit = (self.clock - last[blocks]) < self.l2_bytes
        first = first_of_key(key, None) if key is not None and len(key) > 1 else None  # None: no two share
        if first is not None:
            first = first[0]
            hit |= ~first[:, None]
        miss = np.where(valid & ~hit, nbytes, 0).sum(axis=1)
        total = nbytes.sum(axis=1)
        hbm_rate = min(self.hbm_rate, self.chip_hbm_rate / max(int(np.count_nonzero(miss)), 1))
        cost = np.where(total > 0, self.latency, 0) + (total - miss) / self.l2_rate + miss / hbm_rate
        moved = int(total.sum())
        self.gm_read_bytes += moved
        self.hbm_read_bytes += int(miss.sum())
        if name not in self.scratch:
            # the L2 holds lines, not requests: data several cores read together is touched once
            self.clock += moved if first is None else int(total[first].sum())
        last[blocks[valid]] = self.clock
        self.tensor_clock[name] = self.clock
        return cost

    def write_pieces(self, name: str, blocks: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Cycles for each core to write its pieces (rows as in read_pieces).

        Writes land in L2 and are written back to HBM. A tensor larger than the L2 cannot stay
        there: its lines are written back as it streams out, so it is written at the HBM rate,
        which the writing cores share (L2 is a write-back cache; CANN's L2 cache docs). A workspace
        block rewritten while its dirty lines are still in L2 replaces them there: only a block
        written for the first time, or after it left the L2, adds a write-back to HBM.
        """
        total = nbytes.sum(axis=1)
        moved = int(total.sum())
        self.gm_write_bytes += moved
        if name in self.scratch:
            last = self.last_touch[name]
            gone = (self.clock - last[blocks]) >= self.l2_bytes
            self.hbm_write_bytes += int(np.where((nbytes > 0) & gone, nbytes, 0).sum())
        else:
            self.hbm_write_bytes += moved
            self.clock += moved
        if name in self.last_touch:
            self.last_touch[name][blocks[nbytes > 0]] = self.clock
        self.tensor_clock[name] = self.clock
        rate = self.l2_rate
        if name not in self.scratch and self.sizes.get(name, 0) > self.l2_bytes:
            rate = min(self.hbm_rate, self.chip_hbm_rate / max(int(np.count_nonzero(total)), 1))
        return np.where(total > 0, self.latency, 0) + total / rate

    def workspace_move(self, name: str, blocks: np.ndarray, nbytes: int, write: bool) -> float | None:
        """Cycles of each row's move of a workspace (`blocks` [rows, pieces], every piece `nbytes` > 0): the cost
        write_pieces, or read_pieces where every piece is in the L2, gives each row, with the same effect on the
        counters and the residency, bit for bit; None for a read of which some piece has left the L2 (call
        read_pieces then). A workspace's slots are rewritten block after block in one launch: its moves are the
        CV-split kernels' most frequent, and a row's cost is one number. None also for a workspace kept as runs.
        """
        if name not in self.scratch or nbytes <= 0:
            raise ValueError(f"workspace_move: {name} is not a workspace, or its pieces hold {nbytes} bytes")
        last = self.last_touch.get(name)
        if last.__class__ is not np.ndarray:  # kept as runs (a workspace of more than 2**20 blocks)
            return None
        since = self.clock - last[blocks]
        pieces = blocks.size
        if write:
            self.gm_write_bytes += pieces * nbytes
            self.hbm_write_bytes += int(np.count_nonzero(since >= self.l2_bytes)) * nbytes
        else:
            if pieces and since.max() >= self.l2_bytes:
                return None
            self.gm_read_bytes += pieces * nbytes
        last[blocks] = self.clock
        self.tensor_clock[name] = self.clock
        # read_pieces' latency + (total - 0) / l2_rate + 0 / hbm_rate, write_pieces' latency + total / l2_rate: the
        # same float sums
        return self.latency + (blocks.shape[1] * nbytes) / self.l2_rate

    def transfer(self, moves: list[Transfer]) -> list[np.ndarray]:
        """Cycles of every mover in every event of `moves` ([events, movers] each; idle movers' entries are
        0), exactly as read_pieces / write_pieces would cost them one event at a time in order.

        The byte clock is known before any hit is judged (an event moves its bytes whatever hits), so
        each event's clock is a cumulative sum. Each set may be moved by at most one event of a call
        (otherwise a later event would have to see the earlier one's touch), and every tensor by at
        most one Transfer of a call; the caller makes its calls small enough for that.
        """
        n = 1 + max(int(m.at[-1]) for m in moves)
        moved_at = np.zeros(n, dtype=np.int64)  # distinct bytes each event touches: what advances the clock
        totals, firsts = [], []
        for m in moves:
            # bytes as floats: integers well below 2**53 are exact, and the costs divide them as floats anyway
            total = m.sets[0].pool.ftotal[m.ids]
            if m.active is not None:
                total = np.where(m.active, total, 0.0)
            first = None if m.write else self._first(m)
            totals.append(total)
            firsts.append(first)
            moved_at[m.at] = _first_only(total, first).sum(axis=1)
        after = self.clock + np.cumsum(moved_at)
        before = after - moved_at
        out = []
        for m, total, first in zip(moves, totals, firsts):
            pool, ids, active = m.sets[0].pool, m.ids, m.active
            moved = int(total.sum())
            # np.where(total > 0, latency, 0) as read_pieces adds it; where every mover moves bytes, the latency
            dense = active is None and pool.all_moved
            lat = self.latency if dense else np.where(total > 0, self.latency, 0)
            if m.write:
                self.gm_write_bytes += moved
                self.hbm_write_bytes += moved
                big = [self.sizes.get(s.name, 0) > self.l2_bytes for s in m.sets]
                if any(big):
                    count = np.maximum(np.count_nonzero(total, axis=1), 1)
                    hbm = np.minimum(self.hbm_rate, self.chip_hbm_rate / count)
                    rate = np.where(np.resize(big, len(count)), hbm, self.l2_rate)[:, None]
                    out.append(lat + total / rate)
                else:
                    out.append(lat + total / self.l2_rate)
            else:
                clock = before[m.at][:, None]
                miss_set = (clock - pool.seen[ids]) >= self.l2_bytes
                if first is not None:
                    if first.shape[0] == ids.shape[0]:
                        miss_set &= first
                    else:  # one row per set, the same every turn
                        view = miss_set.reshape(-1, *first.shape)
                        view &= first
                miss = np.where(miss_set, total, 0.0)
                cold = pool.any_mixed and self._cold(pool, ids, first, clock, miss)
                # movers that miss: where every one moves bytes, those whose set missed
                count = (miss_set if dense and not cold else miss > 0).sum(axis=1)
                rate = np.minimum(self.hbm_rate, self.chip_hbm_rate / np.maximum(count, 1))[:, None]
                out.append(lat + (total - miss) / self.l2_rate + miss / rate)
                self.gm_read_bytes += moved
                self.hbm_read_bytes += int(miss.sum())
            end = after[m.at]
            if active is None:
                pool.seen[ids] = end[:, None]
                if pool.any_mixed:
                    pool.mixed[ids] = False
            else:
                pool.seen[ids[active]] = np.broadcast_to(end[:, None], ids.shape)[active]
                if pool.any_mixed:
                    pool.mixed[ids[active]] = False
            R = len(m.sets)
            for r, s in enumerate(m.sets):  # each tensor's last event of the call
                self.tensor_clock[s.name] = int(end[(len(end) - 1 - r) // R * R + r])
        self.clock = int(after[-1])
        return out

    @staticmethod
    def _first(m: Transfer) -> np.ndarray | None:
        """Whether each mover is the first of its key in its event: [events, movers], [sets, movers] (the same
        every turn), or None (all are)."""
        if m.key is None:
            return m.active
        R = len(m.sets)
        if m.active is None:
            rows = [first_of_key(k, None) for k in m.key]
            if all(r is None for r in rows):
                return None
            first = np.ones((R, len(m.key[0])), dtype=bool)
            for r, row in enumerate(rows):
                if row is not None:
                    first[r] = row[0]
            return first
        first = np.empty(m.active.shape, dtype=bool)
        for r, k in enumerate(m.key):
            first[r::R] = first_of_key(k, m.active[r::R])
        return first

    def _cold(self, pool: SetPool, ids: np.ndarray, first: np.ndarray | None, clock: np.ndarray,
              miss: np.ndarray) -> bool:
        """The first touch of sets whose pieces differ: judged piece by piece, as read_pieces does (into
        `miss`); whether there was any."""
        cold = pool.mixed[ids]
        if first is not None:
            if first.shape[0] == ids.shape[0]:
                cold &= first
            else:
                cold.reshape(-1, *first.shape)[...] &= first
        if not cold.any():
            return False
        e, i = np.nonzero(cold)
        pid = ids[e, i]
        part = np.searchsorted(pool.start, pid, side="right") - 1
        for p in np.unique(part):
            sel = part == p
            sets = pool.parts[p]
            blocks, nbytes = sets.pieces(pid[sel] - sets.base)
            piece_hit = (clock[e[sel]] - sets.init[blocks]) < self.l2_bytes
            miss[e[sel], i[sel]] = np.where((nbytes > 0) & ~piece_hit, nbytes, 0).sum(axis=1)
        return True

    def hbm_floor_cycles(self, read: int, written: int, touched: int) -> float:
        """The fewest cycles in which a launch's HBM traffic passes at the chip's rate: the reads that missed the
        L2, and the writes it forced back: as many written bytes as the bytes it touched exceed the L2 by (a
        write-back cache keeps the rest dirty, to be written back later)."""
        forced = min(written, max(0, touched - self.l2_bytes))
        return (read + forced) / self.chip_hbm_rate

    def read(self, name: str, blocks: np.ndarray, nbytes: int | np.ndarray) -> np.ndarray:
        """Cycles for each core to read one block each (block ids per core); counts GM and HBM bytes."""
        sizes = (np.full(blocks.shape, nbytes, dtype=np.int64) if isinstance(nbytes, (int, np.integer))
                 else np.broadcast_to(np.asarray(nbytes, dtype=np.int64), blocks.shape))
        return self.read_pieces(name, blocks[:, None], sizes[:, None], key=blocks)

    def write(self, name: str, blocks: np.ndarray, nbytes: int | np.ndarray) -> np.ndarray:
        """Cycles for each core to write one block each."""
        sizes = np.broadcast_to(np.asarray(nbytes, dtype=np.int64), blocks.shape)
        return self.write_pieces(name, blocks[:, None], sizes[:, None])


def _first_only(total: np.ndarray, first: np.ndarray | None) -> np.ndarray:
    """`total` [events, movers] where the mover is the first of its key (GlobalMemory._first's shapes), else 0."""
    if first is None:
        return total
    if first.shape[0] == total.shape[0]:
        return np.where(first, total, 0.0)
    return np.where(first[np.arange(total.shape[0]) % first.shape[0]], total, 0.0)


@attrs.define
class Transfer:
    """Reads (or writes) of BlockSets, one per event, for `GlobalMemory.transfer`.

    Event e moves sets of `sets[e % len(sets)]`: several tensors' tiles may take turns (A then B in every
    k step); their BlockSets share one SetPool. `ids[e, i]` is the set mover i moves in event e, as an id
    into the pool (`BlockSets.base` + the set's own id); `at[e]` is the event's place in the order of all
    the call's events (increasing); `active[e, i]` whether mover i takes part in event e (None: all do;
    an idle mover's id is ignored). `key[e % len(sets)][i]` (reads only): movers with equal keys move the
    same set in every event both take part in, together (read_pieces' `key`: the first of them brings it
    into L2, the others hit); None: each mover alone.
    """

    sets: list["BlockSets"]
    ids: np.ndarray
    at: np.ndarray
    write: bool = False
    key: list[np.ndarray] | None = None
    active: np.ndarray | None = None


def first_of_key(key: np.ndarray, active: np.ndarray | None) -> np.ndarray | None:
    """Whether each mover is the first active one of its key in its event: [events, movers], or with every
    mover active [1, movers]; None where all are."""
    if active is None:  # the same movers every event: a few dozen at most, plain Python is cheapest
        keys = key.tolist()
        if len(set(keys)) == len(keys):
            return None
        lead: dict = {}
        return np.array([[lead.setdefault(k, i) == i for i, k in enumerate(keys)]])
    order = np.argsort(key, kind="stable")
    ks = key[order]
    lead = np.ones(len(key), dtype=bool)
    lead[1:] = ks[1:] != ks[:-1]
    # per event, the first active mover of each key group (groups are contiguous in `order`)
    act = active[:, order]
    seen = np.cumsum(act, axis=1)
    group = np.cumsum(lead) - 1
    starts = np.nonzero(lead)[0]
    before = seen[:, starts] - act[:, starts]  # active movers of earlier groups
    first_sorted = act & (seen - before[:, group] == 1)
    first = np.empty_like(first_sorted)
    first[:, order] = first_sorted
    return first


class BlockSets:
    """Disjoint sets of one GM tensor's blocks, each always moved whole: the tiles a launch moves.

    Row j of `blocks` / `nbytes` lists set j's pieces as read_pieces takes them (0 bytes: padding).
    Because the sets are disjoint and moved whole, all the pieces of a set share one last touch once
    the launch has moved it, and `GlobalMemory.transfer` judges its L2 residency once per set; before
    that each piece keeps the last touch it had when the sets were made (a set whose pieces differ
    there is `mixed`, judged piece by piece the first time). The tensor's `last_touch` is brought up
    to date by `commit`, which the launch calls when it is done with the tensor (until then nothing
    else may move it). Subclasses lay the sets out without listing their pieces (`pieces`, `commit`).
    """

    def __init__(self, gm: GlobalMemory, name: str, blocks: np.ndarray | None = None,
                 nbytes: np.ndarray | None = None):
        self.name = name
        self.init = gm.last_touch[name]
        self.pool, self.base = None, 0  # set by the SetPool the launch puts it in
        if blocks is None:
            return
        self.blocks, self.nbytes = blocks, nbytes
        valid = nbytes > 0
        flat = blocks[valid]
        self.disjoint = bool(flat.size == 0 or np.bincount(flat).max() <= 1)
        touch = self.init[blocks]
        lo = np.where(valid, touch, np.inf).min(axis=1, initial=np.inf)
        hi = np.where(valid, touch, -np.inf).max(axis=1, initial=-np.inf)
        self.settle(nbytes.sum(axis=1), lo, hi)

    def settle(self, total: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Each set's bytes and the earliest and latest last touch of its pieces (inf, -inf: it has none)."""
        self.total = total
        self.all_moved = bool(total.min(initial=1) > 0)  # every set moves bytes: a DMA's latency applies to all
        self.mixed = lo < hi
        self.any_mixed = bool(self.mixed.any())
        self.seen = np.where(self.mixed, np.nan, hi)  # when the set was last touched

    def pieces(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The block ids and bytes of these sets' pieces, [set, piece] (0 bytes: padding)."""
        return self.blocks[ids], self.nbytes[ids]

    def commit(self, gm: GlobalMemory) -> None:
        """Write the sets' last touches into the tensor's per-block residency (sets never moved keep theirs)."""
        rows = ~self.mixed
        valid = self.nbytes[rows] > 0
        gm.last_touch[self.name][self.blocks[rows][valid]] = np.broadcast_to(self.seen[rows, None], valid.shape)[valid]


class SetPool:
    """The BlockSets of one launch in one id space: their per-set state lives in shared arrays, so one
    Transfer can move several tensors' tiles (the BlockSets keep views of their part)."""

    def __init__(self, parts: list[BlockSets | None]):
        self.parts = [p for p in parts if p is not None]
        sizes = [len(p.total) for p in self.parts]
        self.start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.total = np.concatenate([p.total for p in self.parts])
        self.ftotal = self.total.astype(np.float64)
        self.seen = np.concatenate([p.seen for p in self.parts])
        self.mixed = np.concatenate([p.mixed for p in self.parts])
        for p, lo, hi in zip(self.parts, self.start[:-1], self.start[1:]):
            p.pool, p.base = self, int(lo)
            p.total, p.seen, p.mixed = self.total[lo:hi], self.seen[lo:hi], self.mixed[lo:hi]
        self.all_moved = all(p.all_moved for p in self.parts)
        self.any_mixed = any(p.any_mixed for p in self.parts)

    def commit(self, gm: GlobalMemory) -> None:
        """Every part's commit (the launch is done with its tensors)."""
        for p in self.parts:
            p.commit(gm)


def whole_sums(busy: np.ndarray, added: float) -> bool:
    """Whether adding whole-number costs summing to at most `added` to these busy counters is exact in any
    order: every counter a whole number and every partial sum below 2**53 (float64 integers are exact)."""
    return bool(np.all(busy == np.floor(busy))) and float(np.abs(busy).max(initial=0.0)) + added < 2.0**52


def cube_cycles(target: Target, dtype: str, m: int, k: int, n: int) -> float:
    """Cycles of one core's cube for an m x k by k x n matmul: fractal count at the dtype's MACs per cycle."""
    fm, fk, fn = target.cube_fractal(dtype)
    return float(-(-m // fm) * -(-k // fk) * -(-n // fn))


def vector_cycles(target: Target, nbytes: int | np.ndarray, instructions: int = 1) -> np.ndarray | float:
    """Cycles of one core's vector units for `instructions` passes over `nbytes` of operands."""
    per_cycle = target.vector_bytes_per_cycle * target.vector_per_cube
    return instructions * np.ceil(np.asarray(nbytes) / per_cycle)


def local_copy_cycles(target: Target, nbytes: int) -> float:
    """Cycles to move data between on-chip buffers (MTE1, FIXP): the on-chip rate from the target data."""
    return float(np.ceil(nbytes / target.memory.onchip_bytes_per_cycle))


def buffers_of(target: Target) -> dict[str, Buffer]:
    """Fresh buffers of one core with the target's capacities."""
    return {name.upper(): Buffer(name.upper(), target.buffer_bytes(name)) for name in ("ub", "l1", "l0a", "l0b", "l0c")}


def spread(units: int, cores: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Work units dealt to cores in waves of one unit per core: (unit ids, core ids) per wave.

    Waves alternate direction (a snake), so units that cost more at one end of a wave (the long
    rows of a causal attention) do not all land on the same cores.
    """
    waves = []
    for w, first in enumerate(range(0, units, cores)):
        ids = np.arange(first, min(first + cores, units))
        on = np.arange(len(ids)) if w % 2 == 0 else np.arange(cores - 1, cores - 1 - len(ids), -1)
        waves.append((ids, on))
    return waves
