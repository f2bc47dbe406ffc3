"""Timing-only launches timed once: a launch's timing is a function of what it reads, so an identical
launch is replayed instead of timed again.

A kernel launch is timed in a frame of its own (its cores all idle at cycle 0; `Cores.place` puts
it on the timeline). What its timing model reads is then: the kernel op (name, attributes, operand
and result types), its tiling, the number of cores, whether pipes are recorded or waits counted,
and, in global memory, the L2 residency of the tensors it touches (each block's reuse distance,
`GlobalMemory.clock - last_touch`, and each tensor's size). Two launches that agree on all of that
take the same cycles, move the same bytes and leave the tensors they touch in the same state, to
the last bit.

A reuse distance of at least the L2's capacity is a miss whatever it is (the distance only grows until the block
is touched again, and the L2 never holds more than its capacity), so the memo keys every such distance as the
capacity itself: a block last touched a step ago and one never touched read alike. That is what lets a 7B model's
32 layers replay one another when each layer's paged attention reads a key-tile table that the step before did
not: layer i's tensors are cold by more than the L2 in every layer, each by its own number of bytes. A replayed
launch leaves its cold blocks at the capacity's distance (the state differs from a timed run's only in distances
no launch can tell apart). A transformer's 32 layers launch the same kernels on tensors in the same residency
state, so a timing-only run of the whole model times each distinct launch once.

A full run computes values and needs each kernel's arithmetic, so only timing-only runs use this.
`test/test_launch_memo.py` checks replayed runs against runs that time every launch.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import re
from typing import Any, Hashable

import attrs
import numpy as np

from geir.ir import Operation
from geir.kernels import KERNELS
from geir.kernels.base import KernelStats, LaunchContext, PipeWaits, no_bytes
from geir.kernels.tiling import KernelTiling
from geir.target_npu.residency import Deferred, Residencies, SparseResidency
from geir.target_npu.sim import GlobalMemory, PipeInterval


@attrs.frozen
class _Blocks:
    """A tensor's per-block residency relative to the byte clock (GlobalMemory.clock - last_touch), kept as the
    value most blocks share and the blocks that differ: a KV pool of millions of blocks of which a step touches a
    few is a few numbers here, not a copy of the pool's block count (a memo entry is kept for the whole run)."""

    count: int
    background: np.generic  # the last block's value, in the array's dtype (a pool's tail: no step touched it)
    where: np.ndarray  # the blocks whose value differs, ascending
    values: np.ndarray
    # key()'s value, made once: a key read again hashes the same bytes objects (Python keeps their hashes)
    _key: Any = attrs.field(default=None, eq=False, repr=False)
    _integral: bool | None = attrs.field(default=None, eq=False, repr=False)  # integral()'s, made once

    @classmethod
    def of(cls, relative: np.ndarray) -> _Blocks:
        """The compact form of a relative residency array (lossless, its dtype kept)."""
        if not relative.size:
            return cls(0, relative.dtype.type(0), np.empty(0, np.int64), relative[:0])
        background = relative[-1]
        where = np.flatnonzero(relative != background)
        return cls(len(relative), background, where, relative[where])

    def key(self) -> Hashable:
        if self._key is None:
            if not self.where.size:  # touched all at once (or never): one value says it, not every block's
                key = (self.count, float(self.background))
            else:
                key = (self.count, self.background.tobytes(), self.where.tobytes(), self.values.tobytes())
            object.__setattr__(self, "_key", key)
        return self._key

    def integral(self) -> bool:
        """Whether every value is a whole number below 2**53 (distances in bytes are), so that adding a whole
        number of bytes to it, or taking it from a clock, is exact in float64."""
        if self._integral is None:
            vals = np.append(self.values, self.background)
            whole = bool(np.all(np.abs(vals) < 2.0 ** 53) and np.all(vals == np.round(vals)))
            object.__setattr__(self, "_integral", whole)
        return self._integral

    def absolute(self, clock: float) -> np.ndarray:
        """The last touches these relative values give at `clock` (GlobalMemory.last_touch's form, its dtype)."""
        out = np.full(self.count, clock - self.background)
        out[self.where] = clock - self.values
        return out


class _Replayed(Deferred):
    """The residency a replayed launch left a tensor: `blocks` at the byte clock `clock`, built as
    `blocks.absolute(clock)` only if something reads it. The memo's own key reads it unbuilt (`relative`): a
    weight a step reads once is never built, though each replay of its matmul leaves one."""

    def __init__(self, blocks: _Blocks, clock: float, seen: _SeenLater | None = None):
        self.blocks, self.clock, self.seen = blocks, clock, seen

    def materialize(self) -> np.ndarray:
        return self.blocks.absolute(self.clock)

    def relative(self, clock: float, cold: int) -> _Blocks:
        """`_relative(clock, self.materialize(), cold)`, to the bit, from the few values that differ; the same
        record read the same number of bytes later (the next layer's twin launch) is derived once (`seen`)."""
        if self.seen is None:
            return self._derived(clock, cold)
        return self.seen.relative(self, clock, cold)

    def _derived(self, clock: float, cold: int) -> _Blocks:
        b = self.blocks
        if not b.count:
            return _relative(clock, self.materialize(), cold)
        # the built array's background and differing values, in its dtype (np.full's and the assignment's)
        background = np.full(1, self.clock - b.background)
        values = (self.clock - b.values).astype(background.dtype)
        top = np.max(np.concatenate([background, values]))
        if clock - top >= cold:  # all cold: _relative's shortcut
            kind = np.result_type(clock, background)
            return _Blocks(b.count, kind.type(cold), np.empty(0, np.int64), np.empty(0, kind))
        now = np.minimum(clock - background, cold)[0]  # the last block's, which is always a background block
        moved = np.minimum(clock - values, cold)
        differ = moved != now
        return _Blocks(b.count, now, b.where[differ], moved[differ])


class _SeenLater:
    """Replayed residencies read later, by (record, bytes since, cold), for the launches that read them: a 7B
    step's 32 layers each replay a launch whose record a later launch reads the same number of bytes on, so
    the relative form is derived once and its key bytes hashed once. Exact because every value involved is a
    whole number of bytes below 2**53 (checked once per record): clock - (clock0 - v) is v + (clock - clock0).
    Bounded (the oldest derivations leave first): a layer's twin comes a few dozen launches later."""

    LIMIT = 1024

    def __init__(self) -> None:
        self.derived: dict[tuple, tuple[_Blocks, _Blocks]] = {}
        self.hits = 0

    def relative(self, replayed: _Replayed, clock: float, cold: int) -> _Blocks:
        b = replayed.blocks
        if not (b.integral() and abs(clock) < 2 ** 53 and abs(replayed.clock) < 2 ** 53
                and float(clock) == round(clock) and float(replayed.clock) == round(replayed.clock)):
            return replayed._derived(clock, cold)
        key = (id(b), clock - replayed.clock, cold)
        got = self.derived.get(key)
        if got is not None and got[0] is b:
            self.hits += 1
            return got[1]
        out = replayed._derived(clock, cold)
        self.derived[key] = (b, out)
        if len(self.derived) > self.LIMIT:
            del self.derived[next(iter(self.derived))]
        return out


@attrs.frozen
class _NameState:
    """One GM name's residency relative to the byte clock (None where the name is unknown)."""

    base: int  # index of the launch's operand or result name it belongs to
    suffix: str  # "" for the name itself, ":q" etc. for a role a kernel tracks under a name of its own
    size: int | None
    clock: float | None  # GlobalMemory.clock - tensor_clock
    blocks: _Blocks | SparseResidency | None  # GlobalMemory.clock - last_touch (runs where the tensor keeps runs)

    def key(self) -> Hashable:
        return (self.base, self.suffix, self.size, self.clock, None if self.blocks is None else self.blocks.key())


@attrs.define
class _Entry:
    """What one timed launch did, relative to its frame and to the byte clock it started at."""

    stats: KernelStats  # start 0, in the launch's own frame
    free: np.ndarray
    busy: np.ndarray
    intervals: list[tuple[PipeInterval, list[str | int]]]  # each with its name as a template (see _template)
    moved: int  # bytes the byte clock advanced
    counters: tuple[int, int, int, int]  # gm and hbm read and write bytes
    after: list[_NameState]  # the touched names' states, relative to the clock after the launch


class RunMemo:
    """Whole timing-only runs, by everything their figures read (Runtime._run_key): a decode step replayed as its
    captured graph is on real hardware, the same tasks at the same times, without walking its launches again.

    A run is the same launches, in the same order, each on the state the launches before it left, from a fresh
    chip; so a run that agrees with an earlier one on its program and on what each launch's timing reads of the
    inputs (the value-depend operands' timing values; no other input value is read timing only) repeats it task for
    task. The replayed RunResult shares that run's task and statistics records (read them, never change them); its
    GlobalMemory holds the run's byte counters, clock, tensor clocks and sizes, not the per-block residency the run
    left (`last_touch`, empty): that L2 state is the size of the tensors' block counts (hundreds of MB a run for a
    7B model's weights), and nothing reads it once a run is over (the next run starts on a fresh chip)."""

    def __init__(self) -> None:
        self.entries: dict[Hashable, tuple[Any, int]] = {}
        self._depends: dict[int, tuple[Any, Any, tuple]] = {}
        # what run keys name by id (programs, their decoded tilings, targets), held while the memo is: an id never
        # comes back for another object
        self._alive: dict[int, Any] = {}
        self.hits = 0

    def pin(self, *objects: Any) -> tuple[int, ...]:
        """The objects' ids, each object held as long as the memo (so that a key's id stays its object's)."""
        for o in objects:
            self._alive.setdefault(id(o), o)
        return tuple(id(o) for o in objects)

    def depends(self, program: Any, tilings: dict) -> tuple:
        """The program's value-depend launches, once per decoding of its tilings: each one's kernel, tiling and,
        per operand, the id of the value whose host values its timing reads (None for the others)."""
        held = self._depends.get(id(program))
        if held is None or held[0] is not program or held[1] is not tilings:
            from geir.runtime.interpreter import AICPU, detached_op

            out = []
            for op in program.ops:
                if op.name != "rt.launch" or op.engine == AICPU:
                    continue
                depend = KERNELS[op.kernel].value_depend(detached_op(op))
                if depend:
                    out.append((op.kernel, tilings[id(op)],
                                tuple(id(v) if i in depend else None for i, v in enumerate(op.operands))))
            held = self._depends[id(program)] = (program, tilings, tuple(out))
        return held[2]

    def replay(self, key: Hashable, launches: LaunchMemo) -> Any:
        """The RunResult of the run stored under `key`, its launches counted as replayed; None if none was."""
        held = self.entries.get(key)
        if held is None:
            return None
        result, replayable = held
        self.hits += 1
        launches.hits += replayable  # what walking its launches would have counted: each one a replay
        return attrs.evolve(result, outputs=[], tasks=list(result.tasks), kernels=list(result.kernels),
                            faults=[], replayed=replayable, capture_us=result.capture_us)

    def store(self, key: Hashable, result: Any, replayable: int) -> None:
        """Keep a run just timed; `replayable`: its launches that a later identical run would replay."""
        gm = copy.copy(result.gm)
        gm.last_touch = Residencies()
        self.entries[key] = (attrs.evolve(result, gm=gm), replayable)


class LaunchMemo:
    """The launches a Runtime has timed, by everything their timing reads; `hits` counts replays; `runs`: whole
    timing-only runs (RunMemo; `whole_runs=False` walks every run's launches)."""

    def __init__(self, whole_runs: bool = True) -> None:
        self.entries: dict[Hashable, _Entry] = {}
        self.whole_runs = whole_runs
        self.runs = RunMemo()
        self.seen = _SeenLater()
        self.stored = 0  # launches kept
        self._static: dict[int, tuple[Operation, Hashable]] = {}
        self._kernel_ops: dict[int, tuple[Operation, Operation]] = {}  # see kernel_op
        self._outs: dict[int, tuple[Operation, tuple[np.ndarray, ...]]] = {}  # see _results
        self._tilings: dict[int, tuple[KernelTiling | None, str]] = {}  # see _tiling_key
        # see _role_names: the tensor_clock dict it indexes, how many of its names, the index
        self._roles: tuple[dict | None, int, dict[str, list[str]]] = (None, 0, {})
        self.hits = 0
        self.misses = 0

    def kernel_op(self, launch: Operation) -> Operation:
        """The ge op the launch runs (interpreter.detached_op), rebuilt once per launch and kept with it: a serve's
        Runtimes walk the same step program's launches thousands of times."""
        from geir.runtime.interpreter import detached_op

        return _made_once(self._kernel_ops, launch, detached_op)

    def key(self, launch: Operation, tiling: KernelTiling | None, ctx: LaunchContext) -> Hashable:
        """Everything the launch's timing reads, as one hashable value."""
        bases = _bases(ctx)
        states = tuple(s.key() for s in self._states(ctx.gm, bases, ctx.target.memory.l2_bytes))
        pattern = tuple(bases.index(n) for n in ctx.operand_names + ctx.result_names)
        # a value-depend operand's values shape the schedule (paged attention's per-row lengths): part of the key
        values = KERNELS[launch.kernel].timing_values(tiling, ctx.host_values) if ctx.host_values else ()
        return (self._static_key(launch), self._tiling_key(tiling), ctx.cores.count, ctx.cores.record,
                ctx.waits is not None, pattern, states, values)

    def replay(self, key: Hashable, launch: Operation, ctx: LaunchContext) -> tuple[list[np.ndarray], KernelStats] | None:
        """The launch's results and statistics as its timed twin left them, applied to ctx; None if none was timed."""
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        gm, frame = ctx.gm, ctx.cores
        frame.free = entry.free.copy()
        frame.busy = entry.busy.copy()
        bases = _bases(ctx)
        frame.intervals = [attrs.evolve(iv, name="".join(p if isinstance(p, str) else bases[p] for p in name))
                           for iv, name in entry.intervals]
        gm.clock += entry.moved
        gm.gm_read_bytes += entry.counters[0]
        gm.gm_write_bytes += entry.counters[1]
        gm.hbm_read_bytes += entry.counters[2]
        gm.hbm_write_bytes += entry.counters[3]
        for s in entry.after:
            name = bases[s.base] + s.suffix
            if s.size is not None:
                gm.sizes[name] = s.size
            if s.clock is not None:
                gm.tensor_clock[name] = gm.clock - s.clock
            if isinstance(s.blocks, _Blocks):
                gm.last_touch[name] = _Replayed(s.blocks, gm.clock, self.seen)
            elif s.blocks is not None:
                gm.last_touch[name] = s.blocks.absolute(gm.clock)
        waits = None
        if entry.stats.waits is not None:
            waits = PipeWaits(dict(entry.stats.waits.flag), dict(entry.stats.waits.slot))
        stats = attrs.evolve(entry.stats, busy=dict(entry.stats.busy), waits=waits)
        return list(self._results(launch)), stats

    def _results(self, launch: Operation) -> tuple[np.ndarray, ...]:
        """A replayed launch's results: arrays of its result types holding no bytes (read-only, so one set per
        launch serves every replay of it; a timing-only run reads their shapes, never their values)."""
        return _made_once(self._outs, launch,
                          lambda op: tuple(no_bytes(r.type.shape, r.type.dtype.np) for r in op.results))

    def before(self, ctx: LaunchContext) -> tuple[int, tuple[int, int, int, int], dict[str, float]]:
        """What `store` compares the launch's effect with: the clock, the counters, every name's clock."""
        gm = ctx.gm
        return gm.clock, _counters(gm), dict(gm.tensor_clock)

    def store(self, key: Hashable, ctx: LaunchContext, before: tuple, stats: KernelStats) -> None:
        """Remember a launch just timed from `before`; one that touched names beyond its own is not kept."""
        gm, frame = ctx.gm, ctx.cores
        clock0, counters0, clocks0 = before
        bases = _bases(ctx)
        after = self._states(gm, bases, ctx.target.memory.l2_bytes)
        mine = {bases[s.base] + s.suffix for s in after}
        if any(n not in mine and gm.tensor_clock[n] != clocks0.get(n) for n in gm.tensor_clock):
            return  # it changed residency this memo does not follow: time such a launch every time
        waits = None
        if stats.waits is not None:
            waits = PipeWaits(dict(stats.waits.flag), dict(stats.waits.slot))
        self.stored += 1
        self.entries[key] = _Entry(attrs.evolve(stats, busy=dict(stats.busy), waits=waits), frame.free.copy(),
                                   frame.busy.copy(), [(iv, _template(iv.name, bases)) for iv in frame.intervals],
                                   gm.clock - clock0,
                                   tuple(b - a for a, b in zip(counters0, _counters(gm))), after)

    def _tiling_key(self, tiling: KernelTiling | None) -> str:
        """repr(tiling), made once per tiling object (a program's tilings are decoded once and read every run): the
        same string object each time, whose hash Python keeps."""
        return _made_once(self._tilings, tiling, repr)

    def _static_key(self, launch: Operation) -> Hashable:
        # offsets and stream place the launch; they do not change its timing (names carry the residency)
        return _made_once(self._static, launch, lambda op: (
            op.kernel, tuple(str(v.type) for v in op.operands), tuple(str(r.type) for r in op.results),
            tuple(sorted((k, repr(v)) for k, v in op.attrs.items()))))


    def _states(self, gm: GlobalMemory, bases: list[str], cold: int) -> list[_NameState]:
        """The residency of every GM name a launch on `bases` may read or write (its roles' names included), each
        distance of `cold` bytes (the L2's capacity) or more kept as `cold`: a miss, whatever it is."""
        out = []
        roles = self._role_names(gm)
        for i, base in enumerate(bases):
            for name in [base, *roles.get(base, ())]:
                clock = gm.tensor_clock.get(name)
                blocks = gm.last_touch.peek(name)  # a replay's deferred residency left unbuilt
                size = gm.sizes.get(name)
                if clock is None and blocks is None and size is None:
                    continue
                out.append(_NameState(i, name[len(base):], size, None if clock is None else min(gm.clock - clock, cold),
                                      None if blocks is None else _relative(gm.clock, blocks, cold)))
        return out

    def _role_names(self, gm: GlobalMemory) -> dict[str, list[str]]:
        """The names kernels track a tensor's roles under (`@offset:q`), by tensor, each tensor's sorted.

        A kernel registers such a name in `tensor_clock` before anything else. The only names ever removed are
        workspaces (GlobalMemory.release), within the launch that registered them, so between launches, where
        keys are taken, the names only grow, in insertion order: the index reads only the names added since it
        last looked. It belongs to one run's GlobalMemory (a new run's starts afresh, whatever its count)."""
        names = gm.tensor_clock
        held, seen, roles = self._roles
        if held is not names or seen > len(names):
            seen, roles = 0, {}
        if seen != len(names):
            for name in itertools.islice(names, seen, None):
                base, sep, _ = name.partition(":")
                if sep:
                    bisect.insort(roles.setdefault(base, []), name)
            self._roles = (names, len(names), roles)
        return roles


def _relative(clock: int, blocks: np.ndarray | SparseResidency | _Replayed, cold: int) -> _Blocks | SparseResidency:
    """A residency relative to the byte clock, distances past `cold` kept as `cold`, compact: runs stay runs
    (already a few numbers, and canonical: runs made equal by the cut merge)."""
    if isinstance(blocks, _Replayed):
        return blocks.relative(clock, cold)
    if isinstance(blocks, SparseResidency):
        relative = clock - blocks
        return SparseResidency(relative.n, 0.0, relative.starts, np.minimum(relative.values, cold))
    if blocks.size and clock - blocks.max() >= cold:  # all cold (a weight a step ago): one pass, not four
        kind = np.result_type(clock, blocks)
        return _Blocks(len(blocks), kind.type(cold), np.empty(0, np.int64), np.empty(0, kind))
    return _Blocks.of(np.minimum(clock - blocks, cold))


def _made_once(cache: dict[int, tuple[Any, Any]], obj: Any, make: Any) -> Any:
    """make(obj), made once per object and kept with it in `cache` (by id, the object held so its id is never
    another's): for what a launch or its decoded tiling gives every time a run walks it."""
    held = cache.get(id(obj))
    if held is None or held[0] is not obj:
        held = cache[id(obj)] = (obj, make(obj))
    return held[1]


def _bases(ctx: LaunchContext) -> list[str]:
    """The distinct GM names of a launch's operands and results, in order."""
    return list(dict.fromkeys(ctx.operand_names + ctx.result_names))


def _template(name: str, bases: list[str]) -> list[str | int]:
    """A trace label with the launch's GM names (`@offset`) as indices into `bases`, to fill in on replay."""
    index = {n: i for i, n in enumerate(bases)}
    parts: list[str | int] = []
    for piece in _GM_NAME.split(name):
        parts.append(index.get(piece, piece))
    return parts


_GM_NAME = re.compile(r"(@\d+)")


def _counters(gm: GlobalMemory) -> tuple[int, int, int, int]:
    return gm.gm_read_bytes, gm.gm_write_bytes, gm.hbm_read_bytes, gm.hbm_write_bytes
