"""What every kernel shares: the launch context it runs in, its statistics, and the registry by op name.

A kernel computes real numbers with numpy, tile by tile, on arrays standing for the chip's
buffers, and describes its work as instructions on the cores' pipes (geir.target_npu.sim);
the timing follows the same schedule as the numbers. The timing never depends on the values,
so a timing-only launch (`LaunchContext.compute` false) skips the arithmetic and times the same. It never decides *when* anything runs
relative to other tasks: the Runtime orders launches.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Hashable, Iterable, Iterator

import attrs
import numpy as np

from geir.ir import Operation
from geir.opdef import lookup, ops_with_trait
from geir.kernels.tiling import Budget, KernelTiling, Miss, OpSignature, TilingError, Untiled
from geir.registry import Registry
from geir.target_npu.sim import PIPE_INDEX, PIPES, Cores, GlobalMemory, PipeInterval, buffers_of
from geir.target_npu.target import Target
from geir.traits import DataMovement, NoKernel


@attrs.define
class PipeWaits:
    """Cycles each pipe sat idle before its instructions, summed over cores, by what held it back:
    a data flag (an operand was not ready yet) or a free buffer slot (its destination was still in use)."""

    flag: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(PIPES, 0.0))
    slot: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(PIPES, 0.0))


@attrs.define
class LaunchContext:
    """The chip state a kernel launch runs on: its target, the cores' pipes and global memory."""

    target: Target
    cores: Cores
    gm: GlobalMemory
    # names of the operands and results in global memory (for L2 residency and byte counts)
    operand_names: list[str] = attrs.field(factory=list)
    result_names: list[str] = attrs.field(factory=list)
    # a fault the Runtime injects into this launch ("ub_overflow"), or None
    fault: str | None = None
    # where the pipes' idle time is booked (gedoctor asks for it); None: not counted, no cost
    waits: PipeWaits | None = None
    # False: timing only. The kernel issues every instruction as in a full run but skips the arithmetic;
    # its results are uninitialised arrays of the right shape and dtype, which nothing may read
    compute: bool = True
    # the vector units a kernel that deals its tiles to them one by one (VectorLanes) gave work to; 0: not counted
    # (every vector unit of a lane that worked)
    vector_units: int = 0
    # per operand, its values where the host knows them (an input the host copied in this run) and the kernel's
    # schedule reads them (`Kernel.value_depend`: GE's value-depend inputs, as IncreFlashAttention's
    # actual_seq_lengths, which its host tiling reads), else None; known in a timing-only run too
    host_values: tuple = ()


@attrs.define
class KernelStats:
    """What one launch did: when, on how many cores, each pipe's busy cycles, bytes and FLOPs."""

    name: str
    tiling: KernelTiling | None
    start: float
    end: float
    cores: int
    busy: dict[str, float]
    gm_read_bytes: int
    gm_write_bytes: int
    hbm_read_bytes: int
    hbm_write_bytes: int
    flops: float
    # the pipes' idle time by cause, when the Runtime counted it
    waits: PipeWaits | None = None
    # where it ran: "aicore" (a tiled kernel on the AI cores) or "aicpu" (the op's semantics on the AI CPU;
    # `cores` are then AI CPU cores and `busy` is all zero: no AI Core pipe worked)
    engine: str = "aicore"
    # cycles of the launch's head before its first instruction (target.head_cycles of the cores it started),
    # and the cycles its end was held back to the HBM floor (bytes through HBM at the chip's rate); both
    # inside start..end, on no pipe
    head: float = 0.0
    hbm_wait: float = 0.0

    @property
    def cycles(self) -> float:
        return self.end - self.start


class Kernel:
    """One op family's tiled implementation and its tiling (the TilingInterface GE's `tile` pass asks).

    A kernel declares the ops it implements (`OPS`), its typed tiling class (`TILING`), and the
    functions on it: `choose` (the tiling rule for an op's types and attributes), `budget` (what a
    work unit keeps on chip: the one buffer model, for choosing and for running), `shrink` (a
    smaller tiling with bit-identical results, for recovery), `candidates` (the legal tilings) and
    `check_instance` (a small op the same tiling computes alike, for checking a tuned tiling's numbers).
    `run` computes the op's results for a typed tiling; it reads the op's attributes and never changes the IR.
    """

    OPS: ClassVar[tuple[str, ...]] = ()
    # ops are also this kernel's by a trait they declare (looked up when asked): a new op with it needs no edit here
    TRAIT: ClassVar[type | None] = None
    TILING: ClassVar[type[KernelTiling]] = KernelTiling

    def refuses(self, sig: OpSignature, target: Target) -> str | None:
        """Why this kernel cannot compute the op on these operands at all (a dtype its units lack), or None.

        By default: an operand or result of an element type the AI Core does not compute (f64)."""
        for t in sig.operands + sig.results:
            if t is not None and t.dtype.value not in target.aicore_dtypes:
                return f"the AI Core of {target.name} has no {t.dtype} unit"
        return None

    def value_depend(self, op: Operation) -> tuple[int, ...]:
        """The operands whose values (not only shapes) the launch's schedule reads on the host, as GE's value-depend
        inputs: the Runtime hands their values in `LaunchContext.host_values` where the host knows them. None by
        default."""
        return ()

    def timing_values(self, tiling: KernelTiling | None, host_values: tuple) -> Hashable:
        """What of the value-depend operands' values the launch's timing reads (the launch memo's key): by default
        the values themselves."""
        return tuple(None if v is None else (v.dtype.str, v.shape, v.tobytes()) for v in host_values)

    def shared(self, op: Operation) -> list[tuple[int, int]]:
        """(operand index, result index) of each result that is its operand's memory (an update in place): the
        launch writes only what changes, the result starts from the operand's L2 residency, and GE's memory plan
        gives a donated graph input's result no arena bytes (passes/plan.py). None by default."""
        return []

    def views(self, op: Operation) -> list[tuple[int, int]]:
        """(operand index, result index) of each result that is its operand's bytes unchanged where they lie (a
        reshape of ND data): no launch moves them, and GE's memory plan puts a view of a value that lives in a
        donated graph input's buffer in that buffer too. None by default."""
        return []

    def needs_tiling(self, sig: OpSignature) -> bool:
        """Whether this op becomes a launch that needs a tiling (a reshape of ND data is a view: no)."""
        return True

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> KernelTiling | Miss:
        raise NotImplementedError

    def budget(self, tiling: KernelTiling, sig: OpSignature, target: Target) -> Budget:
        raise NotImplementedError

    def shrink(self, tiling: KernelTiling) -> tuple[KernelTiling, str] | None:
        """A tiling that keeps less on chip and gives bit-identical results, with what changed; None at the smallest."""
        return None

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[KernelTiling]:
        return []

    def workspace_bytes(self, tiling: KernelTiling, sig: OpSignature) -> int:
        """Bytes of GM workspace a launch of this tiling needs beside its operands and results (the memory plan
        reserves them for the launch). By default none."""
        return 0

    def schedule_problem(self, tiling: KernelTiling, target: Target) -> str | None:
        """Why `target` cannot run the schedule `tiling` names (a tiling chosen for another chip), or None."""
        return None

    def check_instance(self, sig: OpSignature, tiling: KernelTiling) -> OpSignature:
        """A small op on which `tiling` does per result element the arithmetic it does on `sig`: where a tuned
        tiling's numbers are checked against the reference before it is stored. By default the op itself."""
        return sig

    def with_budget(self, tiling: KernelTiling, sig: OpSignature, target: Target) -> KernelTiling:
        """`tiling` with the buffer bytes it records (ub_bytes, l1_bytes, ...) recomputed from its blocks."""
        budget = self.budget(tiling, sig, target)
        fields = {f.name for f in attrs.fields(type(tiling))}
        return attrs.evolve(tiling, **{f"{b}_bytes": getattr(budget, b) for b in ("ub", "l1", "l0a", "l0b", "l0c")
                                       if f"{b}_bytes" in fields})

    def decode(self, attr: Any, what: str = "tiling") -> KernelTiling:
        """The typed tiling an IR `tiling` attribute holds (TilingAttrError says what is wrong with it)."""
        return self.TILING.from_attr(attr, what)

    def tiling_for(self, op: Operation, inputs: list[np.ndarray], target: Target) -> KernelTiling | None:
        """The op's tiling attribute, decoded; without one (a kernel run outside a compiled program), the rule's
        choice for these arrays' types (None when the op needs none). The IR is only read."""
        if op.attributes.get("tiling"):
            return self.decode(op.attributes["tiling"])
        sig = OpSignature.of_arrays(op, inputs)
        if not self.needs_tiling(sig):
            return None
        chosen = self.choose(sig, target)
        if isinstance(chosen, Miss):
            raise (TilingError if chosen.overflow else Untiled)(chosen.reason)
        return chosen

    def allocate(self, tiling: KernelTiling, sig: OpSignature, target: Target, what: str) -> None:
        """Allocate one core's buffers for this tiling's budget; CapacityError names the buffer that overflows."""
        allocate(target, self.budget(tiling, sig, target), what)

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: KernelTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        raise NotImplementedError


class KernelRegistry(Registry[Kernel]):
    """Op name -> its AI Core kernel: the ops a kernel lists by name, and, looked up when asked (not frozen when
    the kernels are imported), every op with the trait a kernel takes (`Kernel.TRAIT`: a new RowWise op finds the
    row kernel). The built-in kernels are registered on the first lookup (`geir.kernels.load_all`)."""

    def __init__(self, load: Callable[[], None]) -> None:
        super().__init__("kernels", load)
        self.by_trait: list[tuple[type, Kernel]] = []

    def _by_trait(self, name: str) -> Kernel | None:
        cls = lookup(name) if self.by_trait else None
        return next((k for trait, k in self.by_trait if cls is not None and cls.has_trait(trait)), None)

    def __getitem__(self, name: str) -> Kernel:
        self.load()
        found = self._entries.get(name) or self._by_trait(name)
        if found is None:
            raise KeyError(name)
        return found

    def __iter__(self) -> Iterator[str]:
        """The ops with a kernel: those listed by name and those with a kernel's trait now."""
        self.load()
        served = {name for trait, _ in self.by_trait for name in ops_with_trait(trait)}
        return iter(sorted(set(self._entries) | served))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _load_kernels() -> None:
    from geir.kernels import load_all

    load_all()


KERNELS: KernelRegistry = KernelRegistry(_load_kernels)


def register_kernel(cls: type[Kernel]) -> type[Kernel]:
    """Make a kernel class the implementation of the ops it lists, and of every op with its TRAIT."""
    instance = cls()
    for name in cls.OPS:
        KERNELS[name] = instance
    if cls.TRAIT is not None:
        KERNELS.by_trait.append((cls.TRAIT, instance))
    return cls


def no_bytes(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An array of `shape` and `dtype` that holds no bytes (one element broadcast, zero strides): what a timing-only
    launch reads or returns, where only the shape is timed. Read-only, so a kernel that wrote one would say so."""
    return np.broadcast_to(np.zeros((), dtype=dtype), shape)


def no_bytes_c(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A read-only array of `shape` and `dtype` with a C-contiguous array's strides and no bytes behind them: a
    timing-only result whose views a copy kernel times by their layout (a slice's contiguity is read from its
    strides, as on a real result). Its values must never be read: nothing backs them."""
    dtype = np.dtype(dtype)
    strides, step = [], dtype.itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), tuple(shape), tuple(reversed(strides)),
                                           writeable=False)


def measure(ctx: LaunchContext, name: str, tiling: dict[str, Any], flops: float,
            body: Callable[[], list[np.ndarray]]) -> tuple[list[np.ndarray], KernelStats]:
    """Run a kernel body and collect its statistics from the change in the chip's counters.

    The Runtime has synchronised every pipe to the launch time, so the launch starts at `cores.finish`. Two
    costs of the launch as a whole follow the body: its head (the cores it started begin the body that much
    later: every instruction moves by it) and the HBM floor (the launch cannot end before its HBM traffic
    could pass at the chip's rate, however its cores overlapped their moves).
    """
    cores, gm = ctx.cores, ctx.gm
    start = cores.finish
    busy0 = cores.busy.copy()
    first = len(cores.intervals)
    counters0 = (gm.gm_read_bytes, gm.gm_write_bytes, gm.hbm_read_bytes, gm.hbm_write_bytes)
    clock0 = gm.clock
    outputs = body()
    busy = cores.busy - busy0
    counters = (gm.gm_read_bytes, gm.gm_write_bytes, gm.hbm_read_bytes, gm.hbm_write_bytes)
    delta = [b - a for a, b in zip(counters0, counters)]
    worked = busy.sum(axis=0) > 0
    head = ctx.target.head_cycles(started_cores(ctx.target, busy, ctx.vector_units))
    if head:
        _delay(cores, start, head, first, np.flatnonzero(worked))
    floor = start + head + gm.hbm_floor_cycles(delta[2], delta[3], gm.clock - clock0)
    hbm_wait = max(floor - cores.finish, 0.0)
    if hbm_wait:
        cores.sync_to(floor)
    stats = KernelStats(name, tiling, start, cores.finish, int(np.count_nonzero(worked)),
                        dict(zip(PIPES, busy.sum(axis=1).tolist())), *delta, flops, ctx.waits, head=head,
                        hbm_wait=hbm_wait)
    return outputs, stats


# the pipes only a cube core (AIC) has, and those only a vector core (AIV) has; MTE2 is the AIC's, or the AIVs'
# own load engine in a kernel without the cube
AIC_PIPES = ("MTE1", "CUBE", "FIXP")
AIV_PIPES = ("VECTOR", "MTE3", "AIV_MTE2")


def started_cores(target: Target, busy: np.ndarray, vector_units: int = 0) -> int:
    """The cores a launch started, from its pipes' busy cycles ([pipe, lane]): where cube and vector units are
    separate cores (Atlas A2) a lane's AIC if its cube side worked and its AIVs if its vector side did (a vector
    kernel's `vector_units` where it counted them); else the AI cores that worked."""
    worked = busy > 0
    if not target.separate_cube_vector:
        return int(worked.any(axis=0).sum())
    aic = worked[[PIPE_INDEX[p] for p in AIC_PIPES]].any(axis=0)
    aiv = worked[[PIPE_INDEX[p] for p in AIV_PIPES]].any(axis=0) | (worked[PIPE_INDEX["MTE2"]] & ~aic)
    if vector_units and not aic.any():
        return vector_units
    return int(aic.sum() + target.vector_per_cube * aiv.sum())


def _delay(cores: Cores, start: float, head: float, first: int, lanes: np.ndarray) -> None:
    """Move a launch's instructions (issued from `start`, recorded from interval `first`) `head` later, and record
    the head on the started lanes' scalar pipe: no core starts its body before its head is done."""
    cores.free[cores.free > start] += head
    if not cores.record:
        return
    for interval in cores.intervals[first:]:
        interval.start = interval.start + head
        interval.end = interval.end + head
    cores.intervals.insert(first, PipeInterval(PIPE_INDEX["SCALAR"], "head", lanes, np.full(len(lanes), start),
                                               np.full(len(lanes), start + head)))


def issue(cores: Cores, waits: PipeWaits | None, pipe: str, on: np.ndarray, cost: np.ndarray | float,
          flags: Iterable[np.ndarray] = (), slots: Iterable[np.ndarray] = (), name: str = "") -> np.ndarray:
    """`cores.issue` with the events told apart: `flags` (operands ready) and `slots` (a buffer slot free).

    The instruction waits for all of them alike; when `waits` is given, the pipe's idle cycles before it
    are booked to the flags first and whatever the slot alone held back to the slot.
    """
    flags, slots = tuple(flags), tuple(slots)
    if waits is not None:
        free = cores.free[PIPE_INDEX[pipe], on]
        ready = free
        for event in flags:
            ready = np.maximum(ready, event)
        start = ready
        for event in slots:
            start = np.maximum(start, event)
        waits.flag[pipe] += float(np.sum(ready - free))
        waits.slot[pipe] += float(np.sum(start - ready))
    return cores.issue(pipe, on, cost, flags + slots, name=name)


def flops_of(op: Operation) -> float:
    """Floating-point operations an op performs: its own count where it has one (`flops()`: a cube op's
    multiply-adds), none for ops that only move data, else one per result element."""
    if callable(getattr(op, "flops", None)):
        return float(op.flops())
    if op.has_trait(DataMovement) or op.has_trait(NoKernel):
        return 0.0  # moves bytes, computes nothing
    out = op.results[0].type if op.results else None
    return float(out.num_elements or 0) if out is not None else 0.0


def allocate(target: Target, budget: Budget, what: str) -> None:
    """Allocate one core's buffers for a tiling's budget (UB, L1, L0A, L0B, L0C bytes);
    CapacityError names the buffer that overflows. A kernel's budget function is the one model of
    what it keeps on chip, for choosing blocks and for running them."""
    buf = buffers_of(target)
    for name in ("ub", "l1", "l0a", "l0b", "l0c"):
        buf[name.upper()].alloc(getattr(budget, name), what)
