"""The Runtime: interprets an rt.program, scheduling its copies and kernel launches on streams.

It is the only place tasks are ordered. Each stream is a queue; `rt.record` / `rt.wait` order
streams against each other. Host-device copies run on the copy engine over the host link;
kernels run on the AI cores, one launch at a time, and each kernel times its own tiles on the
cores' pipes. Launches GE placed on the AI CPU (`engine = "aicpu"`) run on the AI CPU engine, one
task at a time beside the AI cores: the op's own numpy semantics on its operands in device memory,
timed by the AI CPU cost model (geir.runtime.aicpu); the streams order them with the AI Core's
launches. Every task and (when asked) every pipe interval is recorded.
"""

from __future__ import annotations

import weakref
from typing import Any, Hashable, Iterable, Mapping

import attrs
import numpy as np

from geir.builder import create_op
from geir.diagnostics import Diagnostic
from geir.ir import Graph, Operation, Value
from geir.kernels import KERNELS
from geir.kernels.base import KernelStats, LaunchContext, PipeWaits, flops_of, measure
from geir.ops.rt import ENGINES
from geir.reference import run_op
from geir.runtime.aicpu import NoAicpu, aicpu_cost, has_semantics
from geir.kernels.tiling import KernelTiling, OpSignature, TilingAttrError
from geir.runtime.device import DeviceFault, DeviceMemory, DeviceTensor, memory_layout
from geir.runtime.launch_memo import LaunchMemo
from geir.target_npu.sim import PIPES, CapacityError, Cores, GlobalMemory
from geir.target_npu.overrides import OverrideError
from geir.target_npu.target import Target, TargetError, load_target
from geir.types import TensorType


class RuntimeFailure(RuntimeError):
    """A program the Runtime cannot run (a missing input, a device fault, a kernel that cannot fit)."""


@attrs.define
class Task:
    """One task as the Runtime ran it, in microseconds of simulated time."""

    kind: str  # "h2d", "d2h", "kernel"
    name: str
    stream: int
    start_us: float
    end_us: float
    # when the Runtime's host thread had submitted it (the device cannot start it before)
    submitted_us: float = 0.0
    # a kernel's launch: the name of its first result, its operand and result types (msprof's op_summary)
    label: str = ""
    inputs: tuple[TensorType, ...] = ()
    outputs: tuple[TensorType, ...] = ()
    # a kernel's engine: "aicore" or "aicpu" (copies run on the copy engine and keep the default)
    engine: str = "aicore"
    # a copy's bytes over the host link (0 for a kernel)
    nbytes: int = 0


@attrs.define
class RunResult:
    """What a run produced: the outputs, every task, every kernel's statistics, the chip's counters."""

    outputs: list[np.ndarray]  # none in a timing-only run
    tasks: list[Task]
    kernels: list[KernelStats]
    cores: Cores
    gm: GlobalMemory
    target: Target
    load_us: float = 0.0
    # every injected fault and how the Runtime recovered from it
    faults: list[dict[str, Any]] = attrs.field(factory=list)
    # timing only: launches replayed from an identical one timed before (geir.runtime.launch_memo)
    replayed: int = 0
    # how the launches reached the device: "single-op" (the host submits each) or "graph" (a captured task
    # graph replayed by one submission); capture_us: the host's time capturing it, on this run (its first)
    launch_mode: str = "single-op"
    capture_us: float = 0.0


LAUNCH_MODES = ("single-op", "graph")


class GraphCaptures:
    """The programs whose task graphs are loaded on the device (ACL Graph's model run instances, captured between
    aclmdlRICaptureBegin and aclmdlRICaptureEnd): a later run replays one with a single aclmdlRIExecuteAsync.
    Share one across the Runtimes of a session so that each program (a plan-cache entry, GE's bucket) is captured
    once."""

    def __init__(self) -> None:
        self._captured: weakref.WeakSet = weakref.WeakSet()

    def capture(self, program: Graph) -> bool:
        """Record `program` as captured; whether this is its first capture."""
        first = program not in self._captured
        self._captured.add(program)
        return first


class RuntimeListener:
    """Told of what the Runtime does, as it does it (as MLIR's RewriterBase::Listener, and GEIR's
    PatternListener for patterns): subclass it and override the hooks wanted; each does nothing here.

    Hooks run in program order, each once per task as the Runtime ran it (a fault's recovery included),
    with the task's modelled times: a progress line, a recorder of the run's timeline, a counter of bytes.
    """

    def run_started(self, program: Graph) -> None:
        """The Runtime starts on `program` (its constants loaded, nothing submitted yet)."""

    def copied(self, task: Task) -> None:
        """A host-device copy ran on the copy engine (`task.kind` "h2d" or "d2h", `task.nbytes` its bytes)."""

    def launched(self, task: Task, stats: KernelStats) -> None:
        """A kernel ran (on the AI cores or the AI CPU): its task on the timeline and its statistics."""

    def resident_from_host(self, name: str, nbytes: int) -> None:
        """A resident input came as a host array, not a DeviceTensor: the model takes its bytes as on the
        device already, but the simulator put them there from the host, off the timeline."""

    def run_finished(self, result: RunResult) -> None:
        """The run is over: everything it did."""


class Runtime:
    """Runs rt.programs on one simulated chip."""

    def __init__(self, target: Target, record_pipes: bool = False, faults: Iterable[tuple[str, int]] = (),
                 count_waits: bool = False, timing_only: bool = False,
                 memo: bool | LaunchMemo = True, listeners: Iterable[RuntimeListener] = (),
                 launch_mode: str = "single-op", graphs: GraphCaptures | None = None):
        if launch_mode not in LAUNCH_MODES:
            raise ValueError(f"launch mode must be one of {', '.join(LAUNCH_MODES)}, not {launch_mode!r}")
        self.target = target
        # "graph": the program's launches are a task graph captured on the device once (per program, in `graphs`)
        # and replayed by one submission, as ACL Graph (torchair's reduce-overhead, vllm-ascend's decode) does;
        # "single-op": the host submits every launch, `launch_latency_us` each
        self.launch_mode = launch_mode
        self.graphs = graphs if graphs is not None else GraphCaptures()
        # told of every task as it runs (geir.runtime.interpreter.RuntimeListener)
        self.listeners = list(listeners)
        # timing only: every task is timed as in a full run, but no value is computed or copied, so inputs
        # and weights may be absent and the run has no outputs (the simulated figures are the full run's)
        self.timing_only = timing_only
        self.record_pipes = record_pipes
        # book every pipe's idle time to the flag or buffer slot it waited for (KernelStats.waits; gedoctor)
        self.count_waits = count_waits
        # faults to inject, each once: ("dma", n) fails the n-th host-device transfer, ("core", n) stops a
        # core during the n-th kernel, ("ub_overflow", n) makes the n-th kernel's tiling not fit (0-based)
        self.faults = {(kind, n) for kind, n in faults}
        self.link_bytes_per_us = target.host.pcie_gb_per_s * 1e3
        self.copy_latency_us = target.host.copy_latency_us
        # the host's cost of submitting one task (a copy or a launch) to a stream, one after another
        self.submit_us = target.host.launch_latency_us
        self.cycles_per_us = target.clock_hz / 1e6
        # timing only: the launches timed so far, replayed where a launch reads the same (geir.runtime.launch_memo);
        # kept across runs, so a session's later steps replay what earlier ones timed (pass one LaunchMemo to
        # several Runtimes to share it; memo=False times every launch)
        self.memo = None if not timing_only or memo is False else (memo if isinstance(memo, LaunchMemo) else LaunchMemo())
        self._host_known: dict[int, np.ndarray] = {}  # the run's host-known inputs by their device copy (run())

    def run(self, program: Graph, inputs: Mapping[str, np.ndarray],
            resources: Mapping[str, np.ndarray] | None = None, resident: Iterable[str] = (),
            keep: Iterable[int] = ()) -> RunResult:
        """Load the program's constants, copy the inputs in, run every task, copy the results out.

        Time 0 is when the Runtime starts submitting: its host thread submits the tasks in program
        order, `launch_latency_us` each, and no task starts on the device before it was submitted.
        Inputs named in `resident` are already on the device (a cache kept there between calls):
        they are neither submitted nor copied again; an input given as a DeviceTensor is resident.
        Results whose positions are in `keep` stay on the device for a later call (a KV cache): no
        copy out; they come back as DeviceTensors, to be passed to a later run as resident inputs.
        """
        resident = set(resident) | {n for n, v in inputs.items() if isinstance(v, DeviceTensor)}
        kept = {id(v) for i, v in enumerate(program.terminator.operands) if i in set(keep)}
        if program.kind != "rt.program":
            raise RuntimeFailure(f"@{program.name} is a {program.kind}, not a lowered rt.program")
        layout = memory_layout(program)
        if layout is None:
            raise RuntimeFailure(f"{program.loc}: rt.program @{program.name} has no memory layout: attribute "
                                 f"memory = {{inputs = N, constants = N, arena = N}} gives its sizes in bytes")
        try:
            device = DeviceMemory(sum(layout.values()), backed=not self.timing_only)
        except MemoryError:
            raise RuntimeFailure(
                f"this host cannot hold the {sum(layout.values())} bytes of device memory @{program.name} computes "
                f"its numbers in (inputs {layout['inputs']}, constants {layout['constants']}, arena "
                f"{layout['arena']}): run it timing only, which holds no bytes, or with smaller inputs") from None
        cores = Cores(self.target.cube_cores, record=self.record_pipes)
        gm = GlobalMemory(self.target)
        host: dict[int, np.ndarray] = {}
        where: dict[int, int] = {}  # device value -> offset
        streams: dict[int, float] = {}
        events: dict[int, float] = {}
        copy_free = 0.0
        aicpu_free = 0.0  # when the AI CPU engine is done with the tasks given it so far
        submitted = 0.0  # the Runtime's host thread: when it has submitted the tasks so far
        tasks: list[Task] = []
        kernels: list[KernelStats] = []
        outputs: list[np.ndarray] = []
        load_us = 0.0
        transfers = 0
        faults: list[dict[str, Any]] = []
        graph = self.launch_mode == "graph"
        capture_us = 0.0
        if graph and self.graphs.capture(program):
            # loading the program captures it: the host submits every launch once into the model run instance,
            # which executes nothing then. That is host work when GE loads the program (once per program: a
            # plan-cache entry), before the run, as a compile is: RunResult.capture_us, not this run's span
            capture_us = self.submit_us * sum(1 for op in program.ops if op.name == "rt.launch")
        replay_pending = graph  # graph mode: the launches reach the device with one submission, the first
        # timing only, a run identical to one timed before (same program, same inputs on the device, the same
        # values where a kernel's timing reads them): its tasks as that run left them (launch_memo.RunMemo)
        run_key = self._run_key(program, inputs, resident, keep, capture_us) if self._runs_memoised() else None
        if run_key is not None:
            again = self.memo.runs.replay(run_key, self.memo)
            if again is not None:
                return again
        hits, stored = (self.memo.hits, self.memo.stored) if self.memo is not None else (0, 0)

        def submit_launch() -> None:
            """The host's submission before a launch: each one's own, or the replay's once in graph mode."""
            nonlocal submitted, replay_pending
            if not graph:
                submitted += self.submit_us
            elif replay_pending:  # aclmdlRIExecuteAsync: the device's task scheduler dispatches the rest
                # (each launch still pays its head on the device; no cited figure for a gap between tasks)
                submitted += self.submit_us
                replay_pending = False

        def copy_task(kind: str, what: str, op: Operation) -> None:
            """Submit a host-device copy and run it on the copy engine, after its stream and the copy before it."""
            nonlocal submitted, copy_free, transfers
            submitted += self.submit_us
            start = max(streams.get(op.stream, 0.0), copy_free, submitted)
            cost = self._transfer_us(op.result.type.nbytes, op, what, transfers, faults)
            copy_free = streams[op.stream] = start + cost
            transfers += 1
            tasks.append(Task(kind, what, op.stream, start, copy_free, submitted, nbytes=op.result.type.nbytes))
            for listener in self.listeners:
                listener.copied(tasks[-1])

        tilings = self._tilings(program)
        # the inputs' values the host holds (given as host arrays: not a resident DeviceTensor), by the device copy
        # each goes to: a kernel's value-depend operands read them on the host, in a timing-only run too
        self._host_known = {}
        for op in program.walk("rt.h2d"):
            value = inputs.get(op.operands[0].name) if op.operands[0].name not in resident else None
            if isinstance(value, np.ndarray):
                self._host_known[id(op.result)] = value
        for arg in program.args if not self.timing_only else ():
            if arg.name not in inputs:
                raise RuntimeFailure(f"no input given for argument '%{arg.name}'")
            host[id(arg)] = _checked_input(arg, inputs[arg.name])
            if arg.name in resident and not isinstance(host[id(arg)], DeviceTensor):
                for listener in self.listeners:
                    listener.resident_from_host(arg.name, arg.type.nbytes)
        for listener in self.listeners:
            listener.run_started(program)

        try:
            for op in program.ops:
                name = op.name
                if name == "rt.const":
                    if not self.timing_only:
                        device.write(op.offset, op.result.type, op.compute(dict(resources or {})))
                    where[id(op.result)] = op.offset
                    load_us += self._copy_us(op.result.type.nbytes)  # once, when the program loads
                elif name == "rt.h2d":
                    t = op.result.type
                    value = host.get(id(op.operands[0]))
                    if isinstance(value, DeviceTensor):
                        value.place(device, op.offset)  # on the device already: no host bytes
                    elif not self.timing_only:
                        device.write(op.offset, t, value)
                    where[id(op.result)] = op.offset
                    if op.operands[0].name in resident:
                        continue  # on the device since an earlier call: its bytes (and L2 state) stay
                    gm.forget(_gm_name(op.offset))
                    copy_task("h2d", f"copy %{op.operands[0].name} in", op)
                elif name == "rt.d2h":
                    if id(op.result) in kept:  # stays on the device for the next call: a handle, no host copy
                        if not self.timing_only:  # the device bytes themselves, as they are when the run ends
                            host[id(op.result)] = DeviceTensor(op.result.type,
                                                               device.view(where[id(op.operands[0])], op.result.type))
                        continue
                    if not self.timing_only:
                        host[id(op.result)] = device.read(where[id(op.operands[0])], op.result.type)
                    copy_task("d2h", "copy out", op)
                elif name == "rt.record":
                    events[op.event] = streams.get(op.stream, 0.0)
                elif name == "rt.wait":
                    if op.event not in events:
                        raise RuntimeFailure(f"{op.loc}: wait for event {op.event}, which nothing recorded before")
                    streams[op.stream] = max(streams.get(op.stream, 0.0), events[op.event])
                elif name == "rt.launch" and op.engine == AICPU:
                    submit_launch()
                    streams[op.stream] = max(streams.get(op.stream, 0.0), submitted)
                    stats = self._aicpu_launch(op, device, where, gm, streams, aicpu_free, len(kernels), faults)
                    aicpu_free = stats.end / self.cycles_per_us
                    kernels.append(stats)
                    tasks.append(Task("kernel", stats.name, op.stream, stats.start / self.cycles_per_us,
                                      stats.end / self.cycles_per_us, submitted, op.results[0].name or "",
                                      tuple(v.type for v in op.operands), tuple(r.type for r in op.results), AICPU))
                    for listener in self.listeners:
                        listener.launched(tasks[-1], stats)
                elif name == "rt.launch":
                    submit_launch()
                    streams[op.stream] = max(streams.get(op.stream, 0.0), submitted)
                    stats, cores = self._launch_recovering(op, tilings[id(op)], device, where, cores, gm, streams,
                                                           len(kernels), faults)
                    kernels.append(stats)
                    tasks.append(Task("kernel", stats.name, op.stream, stats.start / self.cycles_per_us,
                                      stats.end / self.cycles_per_us, submitted, op.results[0].name or "",
                                      tuple(v.type for v in op.operands), tuple(r.type for r in op.results)))
                    for listener in self.listeners:
                        listener.launched(tasks[-1], stats)
                elif name == "rt.return":
                    # timing only: no values, no outputs
                    outputs = [] if self.timing_only else [host[id(v)] for v in op.operands]
                else:
                    raise RuntimeFailure(f"{op.loc}: the Runtime cannot run {name}")
        except DeviceFault as e:
            raise RuntimeFailure(f"{op.loc}: device fault: {e}") from None
        except CapacityError as e:  # a tile that does not fit its buffer at run time
            raise RuntimeFailure(f"{op.loc}: {op.attr('kernel') or op.name}: {e}") from e
        missed = sorted(f for f in self.faults if not any((r["kind"], r["task"]) == f for r in faults))
        if missed:
            kind, n = missed[0]
            count = transfers if kind == "dma" else len(kernels)
            raise RuntimeFailure(f"cannot inject {kind}@{n}: the program has only {count} "
                                 f"{'transfers' if kind == 'dma' else 'kernel launches'}")
        replayed = self.memo.hits - hits if self.memo is not None else 0
        result = RunResult(outputs, tasks, kernels, cores, gm, self.target, load_us, faults, replayed,
                           self.launch_mode, capture_us)
        if run_key is not None:  # a later identical run replays every launch this one replayed or stored
            self.memo.runs.store(run_key, result, replayed + self.memo.stored - stored)
        for listener in self.listeners:
            listener.run_finished(result)
        return result

    def _runs_memoised(self) -> bool:
        """Whether whole runs are replayed: timing only with a memo, no fault to inject, no listener to tell of
        each task as it runs (a replayed run runs none)."""
        return self.memo is not None and self.memo.whole_runs and not self.faults and not self.listeners

    def _run_key(self, program: Graph, inputs: Mapping[str, Any], resident: set[str], keep: Iterable[int],
                 capture_us: float) -> Hashable:
        """Everything a timing-only run's figures read: the program (its launches and their tilings, decoded once
        per program), the target, how launches reach the device (a first capture included), which inputs are on
        the device already, which results stay there, and what each value-depend launch's timing reads of the
        host's values (Kernel.timing_values: a paged attention's key tiles per row). A timing-only run reads no
        other input value, and each run starts on a fresh chip (Cores, GlobalMemory), so two runs that agree on
        all of that time every task alike, to the last bit."""
        tilings = self._tilings(program)
        depends = self.memo.runs.depends(program, tilings)
        host_known = {}
        for op in program.walk("rt.h2d"):
            value = inputs.get(op.operands[0].name) if op.operands[0].name not in resident else None
            if isinstance(value, np.ndarray):
                host_known[id(op.result)] = value
        values = tuple(KERNELS[kernel].timing_values(tiling, tuple(host_known.get(a) if a is not None else None
                                                                     for a in args))
                       for kernel, tiling, args in depends)
        args = {a.name for a in program.args}
        return (self.memo.runs.pin(program, tilings, self.target), self.launch_mode, capture_us, self.record_pipes,
                self.count_waits, tuple(sorted(resident & args)), tuple(sorted(set(keep))), values)

    def _copy_us(self, nbytes: int) -> float:
        return self.copy_latency_us + nbytes / self.link_bytes_per_us

    def _transfer_us(self, nbytes: int, op: Operation, what: str, index: int, faults: list) -> float:
        """Time of one host-device transfer; an injected DMA fault fails it once and it is retried."""
        once = self._copy_us(nbytes)
        if ("dma", index) not in self.faults:
            return once
        faults.append({"kind": "dma", "task": index, "op": what, "loc": str(op.loc),
                       "recovery": "the transfer failed and was retried", "cost_us": once})
        return 2 * once

    def _tilings(self, program: Graph) -> dict[int, KernelTiling | None]:
        """Every launch's tiling, decoded once from its attribute by its kernel; RuntimeFailure at a bad one."""
        tilings, problems = load_tilings(program, self.target)
        if problems:
            raise RuntimeFailure(f"{problems[0].loc}: {problems[0].message}")
        return tilings

    def _launch_recovering(self, op: Operation, tiling: KernelTiling | None, device: DeviceMemory,
                           where: dict[int, int], cores: Cores, gm: GlobalMemory, streams: dict[int, float],
                           index: int, faults: list) -> tuple[KernelStats, Cores]:
        """Launch a kernel, recovering from injected faults; returns its statistics and the cores left.

        - ub_overflow: the tile does not fit at run time; the kernel provides a smaller tiling (the
          parallel block halved, so results stay bit-identical) and runs again with it (for this run:
          the program keeps the tiling GE chose).
        - core: a core stops during the kernel; its work is re-dispatched over the remaining cores
          (the kernel runs again on them, from when the loss is noticed), which serve from then on.
        """
        if ("ub_overflow", index) in self.faults and tiling is None:
            # a view (a reshape of ND data) keeps no tile on chip: there is nothing to overflow
            faults.append({"kind": "ub_overflow", "task": index, "op": op.kernel, "loc": str(op.loc),
                           "recovery": "the kernel is a view with no tile on chip: nothing to re-tile, it ran as planned"})
        elif ("ub_overflow", index) in self.faults:
            try:
                self._launch(op, tiling, device, where, cores, gm, streams, "ub_overflow")
            except CapacityError as e:
                smaller = KERNELS[op.kernel].shrink(tiling)
                if smaller is None:
                    raise RuntimeFailure(f"{op.loc}: {op.kernel}: {e}; the kernel has no smaller tiling") from e
                tiling = KERNELS[op.kernel].with_budget(smaller[0], _launch_signature(op), self.target)
                change = smaller[1]
                faults.append({"kind": "ub_overflow", "task": index, "op": op.kernel, "loc": str(op.loc),
                               "recovery": f"the kernel was re-tiled ({change}) and ran again", "error": str(e)})
            else:
                raise RuntimeFailure(f"{op.loc}: kernel #{index} ({op.kernel}) ignored the injected ub_overflow")
        if ("core", index) not in self.faults:
            return self._launch(op, tiling, device, where, cores, gm, streams), cores
        if cores.count < 2:
            raise RuntimeFailure(f"{op.loc}: the only core stopped during kernel #{index} ({op.kernel})")
        # the attempt whose core dies: it takes its time, and its results are lost with it
        lost = self._launch(op, tiling, device, where, cores, gm, streams, commit=False)
        dead = 0  # the core of the kernel's first work unit: every launch uses it
        survivors = without_core(cores, dead)
        stats = self._launch(op, tiling, device, where, survivors, gm, streams)
        stats.start = lost.start
        faults.append({"kind": "core", "task": index, "op": op.kernel, "loc": str(op.loc), "core": dead,
                       "recovery": f"core {dead} stopped; its work was re-dispatched to the {survivors.count} "
                                   f"remaining cores", "cost_us": (lost.end - lost.start) / self.cycles_per_us})
        return stats, survivors

    def _aicpu_launch(self, op: Operation, device: DeviceMemory, where: dict[int, int], gm: GlobalMemory,
                      streams: dict[int, float], aicpu_free: float, index: int, faults: list) -> KernelStats:
        """Run one AI CPU task: after its stream and the AI CPU's previous task, the op's semantics on its
        operands in device memory, timed by the AI CPU cost model; results stored when it completes.

        Faults: an AI CPU task keeps no tile on chip (ub_overflow: nothing to re-tile); when an AI CPU core
        stops (core), the lost attempt takes its time and the task runs again on the remaining cores.
        """
        kernel_op = detached_op(op)
        read = sum(v.type.nbytes for v in op.operands)
        written = sum(r.type.nbytes for r in op.results)
        elements = sum(r.type.num_elements for r in op.results)
        flops = flops_of(kernel_op)
        try:
            cost = aicpu_cost(elements, flops, read + written, self.target)
        except NoAicpu as e:
            raise RuntimeFailure(f"{op.loc}: {op.kernel}: {e}") from None
        start_us = max(streams.get(op.stream, 0.0), aicpu_free)
        time_us = cost.time_us
        if ("ub_overflow", index) in self.faults:
            faults.append({"kind": "ub_overflow", "task": index, "op": op.kernel, "loc": str(op.loc),
                           "recovery": "the task runs on the AI CPU with no tile on chip: nothing to re-tile, "
                                       "it ran as planned"})
        if ("core", index) in self.faults:
            spare = self.target.aicpu.cores - 1
            if spare < 1:
                raise RuntimeFailure(f"{op.loc}: the only AI CPU core stopped during kernel #{index} ({op.kernel})")
            again = aicpu_cost(elements, flops, read + written, self.target, cores=spare)
            faults.append({"kind": "core", "task": index, "op": op.kernel, "loc": str(op.loc), "core": 0,
                           "recovery": f"AI CPU core 0 stopped; the task ran again on the {spare} remaining AI CPU "
                                       f"cores", "cost_us": time_us})
            time_us += again.time_us
        outs: list = [None] * len(op.results)  # timing only: no values
        if not self.timing_only:
            args = [device.view(where[id(v)], v.type) for v in op.operands]
            try:
                outs = run_op(kernel_op, args)  # the op's own semantics, each result rounded to its dtype
            except (IndexError, ValueError) as e:  # the data breaks the op (an index out of range): the task fails
                raise RuntimeFailure(f"{op.loc}: device fault: {op.kernel} on the AI CPU: {e}") from None
        for r, offset, array in zip(op.results, op.offsets, outs):
            if array is not None:
                device.write(offset, r.type, array)
            where[id(r)] = offset
            gm.forget(_gm_name(offset))  # new data the AI cores have not read through L2
        # the AI CPU reads and writes global memory past L2 (not modelled): every byte is an HBM byte
        gm.gm_read_bytes += read
        gm.gm_write_bytes += written
        gm.hbm_read_bytes += read
        gm.hbm_write_bytes += written
        end_us = start_us + time_us
        streams[op.stream] = end_us
        cpu = self.cycles_per_us
        return KernelStats(op.kernel, None, start_us * cpu, end_us * cpu, cost.cores, dict.fromkeys(PIPES, 0.0),
                           read, written, read, written, flops, None, AICPU)

    def _launch(self, op: Operation, tiling: KernelTiling | None, device: DeviceMemory, where: dict[int, int],
                cores: Cores, gm: GlobalMemory, streams: dict[int, float], fault: str | None = None,
                commit: bool = True) -> KernelStats:
        """Run one launch on `cores`; with `commit`, store its results in device memory when it completes.

        A launch whose core stops never completes: its results are not stored (`commit=False`), so an
        in-place result cannot overwrite the operand that the re-dispatched launch still has to read.
        """
        kernel_op = self.memo.kernel_op(op) if self.memo is not None else detached_op(op)
        kernel = KERNELS[op.kernel]
        start_cycles = max(streams.get(op.stream, 0.0) * self.cycles_per_us, cores.finish)
        # the launch is timed in a frame of its own, from 0, and then placed at its start on the timeline
        frame = Cores(cores.count, record=cores.record)
        depend = kernel.value_depend(kernel_op)
        host_values = tuple(self._host_known.get(id(v)) if i in depend else None for i, v in enumerate(op.operands))
        ctx = LaunchContext(self.target, frame, gm, [_gm_name(where[id(v)]) for v in op.operands],
                            [_gm_name(o) for o in op.offsets], fault, PipeWaits() if self.count_waits else None,
                            compute=not self.timing_only, host_values=host_values if depend else ())
        # timing only, no faults: a launch identical to one timed before (in what its timing reads) is replayed
        memo = self.memo if self.timing_only and not self.faults else None
        key = memo.key(op, tiling, ctx) if memo is not None else None
        replayed = memo.replay(key, op, ctx) if memo is not None else None
        if replayed is not None:
            outs, stats = replayed
        else:
            before = memo.before(ctx) if memo is not None else None
            args = [device.view(where[id(v)], v.type) for v in op.operands]  # only a timed launch reads them
            outs, stats = measure(ctx, op.kernel, tiling, flops_of(kernel_op),
                                  lambda: kernel.run(kernel_op, args, tiling, ctx))
            if memo is not None:
                memo.store(key, ctx, before, stats)
        cores.place(frame, start_cycles)
        stats.start, stats.end = start_cycles + stats.start, start_cycles + stats.end
        streams[op.stream] = stats.end / self.cycles_per_us
        if not commit:
            return stats
        # results are stored only now: with an in-place plan they may overwrite an operand the kernel read
        for r, offset, array in zip(op.results, op.offsets, outs):
            if not self.timing_only:
                device.write(offset, r.type, array)
            where[id(r)] = offset
        return stats


def target_mismatch(program: Graph, target: Target) -> Diagnostic | None:
    """An error if the program was lowered for another chip than `target`: its tilings, workspaces and the
    schedules they name hold there only. A program that records no target (written before programs named theirs)
    is taken as lowered for `target` (`no_target_note` says so)."""
    compiled = program.attributes.get("target")
    if not isinstance(compiled, str) or _same_chip(compiled, target):
        return None
    return Diagnostic("error", f"rt.program @{program.name} was lowered for target '{compiled}', not '{target.name}': "
                               f"its tilings and memory plan hold on '{compiled}' only; run it with --target '{compiled}' "
                               f"or compile the ge.graph for '{target.name}'", program.attr_loc("target"))


def no_target_note(program: Graph, target: Target) -> Diagnostic | None:
    """A note when the program records no target: which chip it is taken as lowered for (the run's), else None."""
    if "target" in program.attributes:
        return None
    return Diagnostic("note", f"rt.program @{program.name} records no target (lowered before programs named theirs): "
                              f"taken as lowered for '{target.name}', the target it runs on", program.loc)


def _same_chip(compiled: str, target: Target) -> bool:
    """Whether the target a program records is `target`: the same canonical name (a what-if spec written another
    way loads under its canonical one), or a chip with the same numbers (an override equal to the base's value)."""
    if compiled == target.name:
        return True
    try:
        chip = load_target(compiled)
    except (TargetError, OverrideError):
        return False  # a chip this machine does not know: not the one asked for
    return chip.name == target.name or _numbers(chip) == _numbers(target)


def _numbers(chip: Target) -> dict[str, Any]:
    return {table: values for table, values in chip.data.items() if table != "name"}


@attrs.frozen(eq=False)
class LoadedTilings:
    """A program's launches decoded for one target: each launch's typed tiling and the problems found.

    Kept per program (`load_tilings`) with the launches and tiling attributes it was decoded from, so every
    run of the program, and gerun's check before them, reuses one decoding; a program whose launches or
    tiling attributes were replaced since is decoded again."""

    target: Target
    launches: tuple[tuple[Operation, Any], ...]
    tilings: dict[int, KernelTiling | None]
    problems: list[Diagnostic]

    def holds_for(self, program: Graph, target: Target) -> bool:
        """Whether this decoding is still the program's on `target` (same launches, same tiling attributes)."""
        if target is not self.target and target != self.target:
            return False
        launches = [op for op in program.ops if op.name == "rt.launch"]
        return len(launches) == len(self.launches) and all(
            op is was and op.attributes.get("tiling") is attr for op, (was, attr) in zip(launches, self.launches))


# by program: its decoded launches (weak: a program no longer used takes its decoding with it)
_LOADED: "weakref.WeakKeyDictionary[Graph, LoadedTilings]" = weakref.WeakKeyDictionary()


def load_tilings(program: Graph, target: Target) -> tuple[dict[int, KernelTiling | None], list[Diagnostic]]:
    """Each launch's typed tiling (by id of the launch), decoded by its kernel from the `tiling` attribute once
    per program load (later calls for the same program and target reuse it), and an error at every launch whose
    kernel is unknown, refuses its operands on `target` (a dtype the cube has no mode for), whose tiling
    attribute is malformed or names a schedule `target` cannot run."""
    loaded = _LOADED.get(program)
    if loaded is None or not loaded.holds_for(program, target):
        tilings, problems = _decode_tilings(program, target)
        launches = tuple((op, op.attributes.get("tiling")) for op in program.ops if op.name == "rt.launch")
        loaded = _LOADED[program] = LoadedTilings(target, launches, tilings, problems)
    return loaded.tilings, list(loaded.problems)


def _decode_tilings(program: Graph, target: Target) -> tuple[dict[int, KernelTiling | None], list[Diagnostic]]:
    """`load_tilings` without the reuse: every launch decoded now."""
    tilings: dict[int, KernelTiling | None] = {}
    mismatch = target_mismatch(program, target)
    problems: list[Diagnostic] = [mismatch] if mismatch is not None else []
    for op in program.ops:
        if op.name != "rt.launch":
            continue
        if op.engine == AICPU:
            tilings[id(op)] = None  # the AI CPU runs the op whole, with its numpy semantics
            if not has_semantics(detached_op(op)):
                problems.append(Diagnostic("error", f"{op.kernel} (%{op.results[0].name if op.results else '?'}) "
                                                    f"cannot run on the AI CPU: it has no numpy semantics",
                                           op.attr_loc("kernel")))
            continue
        kernel = KERNELS.get(op.kernel)
        if kernel is None:
            problems.append(Diagnostic("error", f"no kernel implements {op.kernel}", op.attr_loc("kernel")))
            continue
        refusal = kernel.refuses(_launch_signature(op), target)
        if refusal is not None:
            problems.append(Diagnostic("error", f"{op.kernel} cannot run: {refusal} (GE places such an op on the AI "
                                                f"CPU: a launch with engine = \"aicpu\")", op.loc))
            continue
        try:
            tilings[id(op)] = kernel.decode(op.tiling, f"the tiling of {op.kernel}") if op.tiling else None
        except TilingAttrError as e:
            problems.append(Diagnostic("error", str(e), op.attr_loc("tiling")))
            continue
        unrunnable = kernel.schedule_problem(tilings[id(op)], target) if tilings[id(op)] is not None else None
        if unrunnable is not None:
            problems.append(Diagnostic("error", f"{op.kernel} cannot run on {target.name}: {unrunnable}",
                                       op.attr_loc("tiling")))
            continue
        empty = _empty_block(tilings[id(op)], op)
        if empty is not None:
            problems.append(Diagnostic("error", f"the tiling of {op.kernel}: '{empty}' is 0, but the launch's tensors "
                                                f"are not empty: a block must hold at least one element",
                                       op.attr_loc("tiling")))
            continue
        if tilings[id(op)] is None and kernel.needs_tiling(_launch_signature(op)):
            problems.append(Diagnostic("error", f"{op.kernel} has no tiling: run the tile pass before lowering",
                                       op.loc))
    return tilings, problems


AICORE, AICPU = ENGINES


def without_core(cores: Cores, dead: int) -> Cores:
    """The cores that remain when one stops, keeping each survivor's pipe timeline."""
    keep = [c for c in range(cores.count) if c != dead]
    rest = Cores(len(keep), record=cores.record)
    rest.free = cores.free[:, keep].copy()
    rest.busy = cores.busy[:, keep].copy()
    rest.intervals = cores.intervals
    return rest


# fields of a tiling that are not blocks: a count of buffers or cores, of key or row segments (0 reads as 1),
# MatMul's iterate_order (0 is M first), the bytes a budget records
_NOT_BLOCKS = ("template", "buffers", "cores", "segments", "iterate_order")


def _empty_block(tiling: KernelTiling | None, launch: Operation) -> str | None:
    """The first block of a tiling that is 0 where the launch's tensors are not empty (its kernel would divide
    by it), or None. A tiling's required fields are its blocks, apart from its buffers, cores and byte counts."""
    if tiling is None or any(not (v.type.num_elements or 0) for v in [*launch.operands, *launch.results]):
        return None  # an empty tensor has empty blocks (the decoder takes 0 for that)
    for f in attrs.fields(type(tiling)):
        if f.default is attrs.NOTHING and f.name not in _NOT_BLOCKS and not f.name.endswith("_bytes"):
            if getattr(tiling, f.name) == 0:
                return f.name
    return None


def detached_op(launch: Operation) -> Operation:
    """The ge op a launch runs, rebuilt with typed operands and results so its kernel and semantics apply."""
    attributes = dict(launch.attrs)  # the tiling goes to the kernel typed, not as an attribute
    operands = [Value(v.type, v.name) for v in launch.operands]
    return create_op(launch.kernel, operands, [r.type for r in launch.results], attributes, launch.loc,
                     [r.name for r in launch.results])


def _launch_signature(launch: Operation) -> OpSignature:
    """The op signature of a launch's kernel op (its operand and result types, its attributes)."""
    return OpSignature.of(detached_op(launch))


def _gm_name(offset: int) -> str:
    # residency in L2 follows the memory location: a tensor written where another was is new data
    return f"@{offset}"


def _checked_input(arg: Value, array: Any) -> np.ndarray | DeviceTensor:
    t: TensorType = arg.type
    if isinstance(array, DeviceTensor):  # kept on the device by an earlier run: its type must be the argument's
        if array.type != t:
            raise RuntimeFailure(f"input '%{arg.name}' is a {array.type} on the device, but the program takes {t}")
        return array
    a = np.asarray(array)
    if a.shape != t.shape:
        raise RuntimeFailure(f"input '%{arg.name}' has shape {list(a.shape)}, but the program takes {t}")
    return a.astype(t.dtype.np, copy=False)
