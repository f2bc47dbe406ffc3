"""The Runtime: interprets an rt.program, scheduling its copies and kernel launches on streams.

It is the only place tasks are ordered. Each stream is a queue; `rt.record` / `rt.wait` order
streams against each other. Host-device copies run on the copy engine over the host link;
kernels run on the AI cores, one launch at a time, and each kernel times its own tiles on the
cores' pipes. Every task and (when asked) every pipe interval is recorded.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import attrs
import numpy as np

from geir.ir import Graph, Operation, Value
from geir.kernels import KERNELS
from geir.kernels.base import KernelStats, LaunchContext, PipeWaits, flops_of, measure
from geir.opdef import lookup
from geir.passes.tiling import smaller_tiling
from geir.runtime.device import DeviceFault, DeviceMemory
from geir.target_npu.sim import CapacityError, Cores, GlobalMemory
from geir.target_npu.target import Target
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


@attrs.define
class RunResult:
    """What a run produced: the outputs, every task, every kernel's statistics, the chip's counters."""

    outputs: list[np.ndarray]
    tasks: list[Task]
    kernels: list[KernelStats]
    cores: Cores
    gm: GlobalMemory
    target: Target
    load_us: float = 0.0
    # every injected fault and how the Runtime recovered from it
    faults: list[dict[str, Any]] = attrs.field(factory=list)


class Runtime:
    """Runs rt.programs on one simulated chip."""

    def __init__(self, target: Target, record_pipes: bool = False, faults: Iterable[tuple[str, int]] = (),
                 count_waits: bool = False):
        self.target = target
        self.record_pipes = record_pipes
        # book every pipe's idle time to the flag or buffer slot it waited for (KernelStats.waits; gedoctor)
        self.count_waits = count_waits
        # faults to inject, each once: ("dma", n) fails the n-th host-device transfer, ("core", n) stops a
        # core during the n-th kernel, ("ub_overflow", n) makes the n-th kernel's tiling not fit (0-based)
        self.faults = {(kind, n) for kind, n in faults}
        host = target.data.get("host", {})
        self.link_bytes_per_us = host.get("pcie_gb_per_s", 32) * 1e3
        self.copy_latency_us = host.get("copy_latency_us", 0.0)
        self.cycles_per_us = target.clock_hz / 1e6

    def run(self, program: Graph, inputs: Mapping[str, np.ndarray],
            resources: Mapping[str, np.ndarray] | None = None) -> RunResult:
        """Load the program's constants, copy the inputs in, run every task, copy the results out."""
        if program.kind != "rt.program":
            raise RuntimeFailure(f"@{program.name} is a {program.kind}, not a lowered rt.program")
        mem = program.attributes["memory"]
        device = DeviceMemory(mem["inputs"] + mem["constants"] + mem["arena"])
        cores = Cores(self.target.cube_cores, record=self.record_pipes)
        gm = GlobalMemory(self.target)
        host: dict[int, np.ndarray] = {}
        where: dict[int, int] = {}  # device value -> offset
        streams: dict[int, float] = {}
        events: dict[int, float] = {}
        copy_free = 0.0
        tasks: list[Task] = []
        kernels: list[KernelStats] = []
        outputs: list[np.ndarray] = []
        load_us = 0.0
        transfers = 0
        faults: list[dict[str, Any]] = []

        for arg in program.args:
            if arg.name not in inputs:
                raise RuntimeFailure(f"no input given for argument '%{arg.name}'")
            host[id(arg)] = _checked_input(arg, inputs[arg.name])

        try:
            for op in program.ops:
                name = op.name
                if name == "rt.const":
                    array = op.compute(dict(resources or {}))
                    device.write(op.offset, op.result.type, array)
                    where[id(op.result)] = op.offset
                    load_us += self._copy_us(op.result.type.nbytes)  # once, when the program loads
                elif name == "rt.h2d":
                    t = op.result.type
                    device.write(op.offset, t, host[id(op.operands[0])])
                    where[id(op.result)] = op.offset
                    gm.forget(_gm_name(op.offset))
                    start = max(streams.get(op.stream, 0.0), copy_free)
                    what = f"copy %{op.operands[0].name} in"
                    copy_free = streams[op.stream] = start + self._transfer_us(t.nbytes, op, what, transfers, faults)
                    transfers += 1
                    tasks.append(Task("h2d", what, op.stream, start, copy_free))
                elif name == "rt.d2h":
                    t = op.result.type
                    host[id(op.result)] = device.read(where[id(op.operands[0])], t)
                    start = max(streams.get(op.stream, 0.0), copy_free)
                    copy_free = streams[op.stream] = start + self._transfer_us(t.nbytes, op, "copy out", transfers,
                                                                               faults)
                    transfers += 1
                    tasks.append(Task("d2h", "copy out", op.stream, start, copy_free))
                elif name == "rt.record":
                    events[op.event] = streams.get(op.stream, 0.0)
                elif name == "rt.wait":
                    if op.event not in events:
                        raise RuntimeFailure(f"{op.loc}: wait for event {op.event}, which nothing recorded before")
                    streams[op.stream] = max(streams.get(op.stream, 0.0), events[op.event])
                elif name == "rt.launch":
                    stats, cores = self._launch_recovering(op, device, where, cores, gm, streams, len(kernels), faults)
                    kernels.append(stats)
                    tasks.append(Task("kernel", stats.name, op.stream, stats.start / self.cycles_per_us,
                                      stats.end / self.cycles_per_us))
                elif name == "rt.return":
                    outputs = [host[id(v)] for v in op.operands]
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
        return RunResult(outputs, tasks, kernels, cores, gm, self.target, load_us, faults)

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

    def _launch_recovering(self, op: Operation, device: DeviceMemory, where: dict[int, int], cores: Cores,
                           gm: GlobalMemory, streams: dict[int, float], index: int,
                           faults: list) -> tuple[KernelStats, Cores]:
        """Launch a kernel, recovering from injected faults; returns its statistics and the cores left.

        - ub_overflow: the tile does not fit at run time; GE provides a smaller tiling (the parallel
          block halved, so results stay bit-identical) and the kernel runs again.
        - core: a core stops during the kernel; its work is re-dispatched over the remaining cores
          (the kernel runs again on them, from when the loss is noticed), which serve from then on.
        """
        if ("ub_overflow", index) in self.faults:
            try:
                self._launch(op, device, where, cores, gm, streams, "ub_overflow")
            except CapacityError as e:
                smaller = smaller_tiling(dict(op.tiling))
                if smaller is None:
                    raise RuntimeFailure(f"{op.loc}: {op.kernel}: {e}; GE has no smaller tiling") from e
                tiling, change = smaller
                op.attributes["tiling"] = tiling
                faults.append({"kind": "ub_overflow", "task": index, "op": op.kernel, "loc": str(op.loc),
                               "recovery": f"GE re-tiled the kernel ({change}) and it ran again", "error": str(e)})
            else:
                raise RuntimeFailure(f"{op.loc}: kernel #{index} ({op.kernel}) ignored the injected ub_overflow")
        if ("core", index) not in self.faults:
            return self._launch(op, device, where, cores, gm, streams), cores
        if cores.count < 2:
            raise RuntimeFailure(f"{op.loc}: the only core stopped during kernel #{index} ({op.kernel})")
        lost = self._launch(op, device, where, cores, gm, streams)  # the attempt whose core dies
        dead = 0  # the core of the kernel's first work unit: every launch uses it
        survivors = without_core(cores, dead)
        stats = self._launch(op, device, where, survivors, gm, streams)
        stats.start = lost.start
        faults.append({"kind": "core", "task": index, "op": op.kernel, "loc": str(op.loc), "core": dead,
                       "recovery": f"core {dead} stopped; its work was re-dispatched to the {survivors.count} "
                                   f"remaining cores", "cost_us": (lost.end - lost.start) / self.cycles_per_us})
        return stats, survivors

    def _launch(self, op: Operation, device: DeviceMemory, where: dict[int, int], cores: Cores, gm: GlobalMemory,
                streams: dict[int, float], fault: str | None = None) -> KernelStats:
        kernel_op = detached_op(op)
        kernel = KERNELS.get(op.kernel)
        if kernel is None:
            raise RuntimeFailure(f"{op.loc}: no kernel implements {op.kernel}")
        args = [device.view(where[id(v)], v.type) for v in op.operands]
        start_cycles = max(streams.get(op.stream, 0.0) * self.cycles_per_us, cores.finish)
        cores.sync_to(start_cycles)
        ctx = LaunchContext(self.target, cores, gm, [_gm_name(where[id(v)]) for v in op.operands],
                            [_gm_name(o) for o in op.offsets], fault, PipeWaits() if self.count_waits else None)
        outs, stats = measure(ctx, op.kernel, dict(op.tiling), flops_of(kernel_op),
                              lambda: kernel.run(kernel_op, args, ctx))
        # results are stored only now: with an in-place plan they may overwrite an operand the kernel read
        for r, offset, array in zip(op.results, op.offsets, outs):
            device.write(offset, r.type, array)
            where[id(r)] = offset
        streams[op.stream] = stats.end / self.cycles_per_us
        return stats


def without_core(cores: Cores, dead: int) -> Cores:
    """The cores that remain when one stops, keeping each survivor's pipe timeline."""
    keep = [c for c in range(cores.count) if c != dead]
    rest = Cores(len(keep), record=cores.record)
    rest.free = cores.free[:, keep].copy()
    rest.busy = cores.busy[:, keep].copy()
    rest.intervals = cores.intervals
    return rest


def detached_op(launch: Operation) -> Operation:
    """The ge op a launch runs, rebuilt with typed operands and results so its kernel and semantics apply."""
    from geir.builder import create_op

    attributes = dict(launch.attrs)
    if launch.tiling:
        attributes["tiling"] = dict(launch.tiling)
    operands = [Value(v.type, v.name) for v in launch.operands]
    return create_op(launch.kernel, operands, [r.type for r in launch.results], attributes, launch.loc,
                     [r.name for r in launch.results])


def _gm_name(offset: int) -> str:
    # residency in L2 follows the memory location: a tensor written where another was is new data
    return f"@{offset}"


def _checked_input(arg: Value, array: Any) -> np.ndarray:
    a = np.asarray(array)
    t: TensorType = arg.type
    if a.shape != t.shape:
        raise RuntimeFailure(f"input '%{arg.name}' has shape {list(a.shape)}, but the program takes {t}")
    return a.astype(t.dtype.np, copy=False)
