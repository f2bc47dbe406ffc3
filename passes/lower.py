"""lower: a tiled, planned graph becomes an `rt.program` the Runtime runs (task-stream IR).

Device memory is one address space in three regions, each 512-byte aligned:

    [ inputs | constants | arena ]

Inputs are copied in by `rt.h2d` on the copy stream (0) each run; constants are uploaded once
when the program is loaded (`rt.const`); every other value lives in the arena at the offset the
`plan` pass chose, except a result the plan put in a donated input's buffer (`mem_operand`: an
update in place of an input nothing else reads), which is launched at that input's offset.
Kernels go on compute streams: an op continues the stream of the first op it depends on unless
another op has already continued it (a fork), in which case it opens a new stream, so
independent branches run on separate streams. Every dependency that crosses streams
becomes an `rt.record` after the producer and an `rt.wait` before the consumer. An op GE placed on
the AI CPU becomes an `rt.launch` with `engine = "aicpu"` on a stream like any other: the streams
order it with the AI Core's launches, and the Runtime runs it on the AI CPU engine.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from geir.builder import create_op
from geir.diagnostics import error
from geir.ir import Graph, Module, Operation, Value
from geir.kernels.tiling import PLAN_ATTRIBUTES
from geir.ops.core import Const
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.placement import AICPU, ENGINE_ATTR, engine_of
from geir.target_npu.target import Target
from geir.traits import Terminator

ALIGN = 512
COPY_STREAM = 0
MAX_COMPUTE_STREAMS = 4


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@attrs.define
class _Builder:
    """Accumulates the rt program's ops and the bookkeeping of streams and events."""

    program: Graph
    value_map: dict[int, Value] = attrs.field(factory=dict)   # graph value -> program value
    stream_of: dict[int, int] = attrs.field(factory=dict)     # producing op -> stream
    continued: set[int] = attrs.field(factory=set)            # ops whose stream someone continued
    event_of: dict[int, int] = attrs.field(factory=dict)      # producing op/value -> recorded event
    waited: set[tuple[int, int]] = attrs.field(factory=set)   # (event, stream) pairs already waited
    next_stream: int = 1
    next_event: int = 0

    def emit(self, name: str, operands: list[Value], attributes: dict[str, Any], result_types: list,
             loc, result_names: list | None = None) -> Operation:
        """Append op `name` to the program."""
        op = create_op(name, operands, result_types, attributes, loc, result_names)
        self.program.append(op)
        return op

    def event_after(self, key: int, stream: int, loc) -> int:
        """The event recorded after the producer `key` on its stream (recorded once)."""
        if key not in self.event_of:
            self.event_of[key] = self.next_event
            self.emit("rt.record", [], {"event": self.next_event, "stream": stream}, [], loc)
            self.next_event += 1
        return self.event_of[key]

    def wait(self, event: int, stream: int, loc) -> None:
        if (event, stream) not in self.waited:
            self.waited.add((event, stream))
            self.emit("rt.wait", [], {"event": event, "stream": stream}, [], loc)


def lower_graph(graph: Graph, target: Target | None = None) -> Graph:
    """The rt.program for a graph that has been tiled and planned (static shapes)."""
    for v in graph.args:
        if not v.type.is_static:
            raise error(f"lower needs static shapes, but %{v.name} is {v.type}; the Runtime specialises dynamic "
                        f"graphs per shape", v.loc)
    if "arena_size" not in graph.attributes:
        raise error("lower needs the memory plan: run the plan pass first", graph.loc)
    args = [Value(a.type, a.name, None, i, a.loc) for i, a in enumerate(graph.args)]
    program = Graph(graph.name, args, list(graph.result_types), [], {}, graph.loc, kind="rt.program")
    b = _Builder(program)

    # inputs, then constants, then the arena
    offset = 0
    input_offset: dict[int, int] = {}  # graph argument -> its device offset
    for a, pa in zip(graph.args, args):
        input_offset[id(a)] = offset
        op = b.emit("rt.h2d", [pa], {"offset": offset, "stream": COPY_STREAM}, [a.type], a.loc, [f"{a.name}.dev"])
        b.value_map[id(a)] = op.result
        b.stream_of[id(op)] = COPY_STREAM
        b.event_after(id(a), COPY_STREAM, a.loc)
        offset += _aligned(a.type.nbytes)
    inputs_size = offset
    for op in graph.ops:
        if isinstance(op, Const):
            r = op.result
            c = b.emit("rt.const", [], {"value": op.value, "offset": offset}, [r.type], op.loc, [r.name])
            b.value_map[id(r)] = c.result
            offset += _aligned(r.type.nbytes)
    constants_size = offset - inputs_size
    arena_base = offset

    pages = _ArenaPages(graph.attributes["arena_size"])
    for op in graph.ops:
        if isinstance(op, Const) or op.has_trait(Terminator):
            continue
        if "mem_offset" not in op.attributes:
            raise error(f"{op.name} has no mem_offset: run the plan pass before lower", op.loc)
        offsets, in_input = _device_offsets(op, arena_base, input_offset)
        stream = _choose_stream(op, b)
        for v in op.operands:
            _wait_for(v, stream, b, op.loc)
        # the plan reuses memory in op order; across streams that order must be enforced: this op
        # writes only after every op on another stream that used the bytes before is done. A result in a
        # donated input's buffer is outside the arena: only this op reads that input, so no one else waits
        for r, offset, slot, inside in zip(op.results, offsets, op.attributes["mem_offset"], in_input):
            if inside:  # a view of it (a reshape) is launched at the same offset
                input_offset[id(r)] = offset
                continue
            for user in pages.take(slot, r.type.nbytes, r, op):
                if b.stream_of.get(id(user)) not in (None, stream):
                    b.wait(b.event_after(id(user), b.stream_of[id(user)], op.loc), stream, op.loc)
        if "workspace" in op.attributes and op.results:
            # the launch's GM workspace: who used those bytes on another stream must be done first
            ws_offset, ws_bytes = op.attributes["workspace"]
            for user in pages.take(ws_offset, ws_bytes, op.results[0], op):
                if b.stream_of.get(id(user)) not in (None, stream):
                    b.wait(b.event_after(id(user), b.stream_of[id(user)], op.loc), stream, op.loc)
        attrs_ = {k: v for k, v in op.attributes.items() if k not in PLAN_ATTRIBUTES and k != ENGINE_ATTR}
        launch_attrs: dict[str, Any] = {"kernel": op.name}
        if engine_of(op) == AICPU:
            # GE placed it on the AI CPU: the Runtime runs the op's semantics there, ordered by the same streams
            launch_attrs["engine"] = AICPU
        launch_attrs.update(offsets=offsets, stream=stream)
        if attrs_:
            launch_attrs["attrs"] = attrs_
        if "tiling" in op.attributes:
            launch_attrs["tiling"] = op.attributes["tiling"]
        launch = b.emit("rt.launch", [b.value_map[id(v)] for v in op.operands], launch_attrs,
                        [r.type for r in op.results], op.loc, [r.name for r in op.results])
        b.stream_of[id(op)] = stream
        for r, pr in zip(op.results, launch.results):
            b.value_map[id(r)] = pr

    ret = graph.ops[-1]
    outs = []
    for v in ret.operands:
        _wait_for(v, COPY_STREAM, b, ret.loc)
        h = b.emit("rt.d2h", [b.value_map[id(v)]], {"stream": COPY_STREAM}, [v.type], ret.loc)
        outs.append(h.result)
    b.emit("rt.return", outs, {}, [], ret.loc)
    program.attributes = {
        "memory": {"inputs": inputs_size, "constants": constants_size, "arena": graph.attributes["arena_size"]},
        "streams": b.next_stream,
    }
    if target is not None:
        # the tilings, the plan's workspaces and the schedules they imply hold on this chip only: the Runtime
        # refuses to run the program on another
        program.attributes["target"] = target.name
    if "arena_lower_bound" in graph.attributes:  # the plan's live-bytes bound, for reports against the arena
        program.attributes["arena_lower_bound"] = graph.attributes["arena_lower_bound"]
    return program


def _device_offsets(op: Operation, arena_base: int, input_offset: dict[int, int]) -> tuple[list[int], list[bool]]:
    """The device offset of each result of `op` (its arena slot, or the buffer of the donated input the plan put it
    in: `mem_operand`) and whether it is in an input's buffer; a malformed plan attribute is an error at the op."""
    slots = op.attributes["mem_offset"]
    in_input = op.attributes.get("mem_operand") or [-1] * len(op.results)
    if not isinstance(slots, list) or not isinstance(in_input, list) or not (
            len(slots) == len(in_input) == len(op.results)) or not all(type(k) is int for k in in_input):
        raise error(f"{op.name}: mem_offset and mem_operand must list one entry per result ({len(op.results)})",
                    op.loc)
    offsets = []
    for r, slot, k in zip(op.results, slots, in_input):
        if k < 0:
            offsets.append(arena_base + slot)
            continue
        x = op.operands[k] if k < len(op.operands) else None
        if x is None or id(x) not in input_offset or x.type.nbytes != r.type.nbytes:
            raise error(f"{op.name}: mem_operand {k} of %{r.name} names no operand of its size in a graph input's "
                        f"buffer: only an input's buffer holds a result outside the arena", op.loc)
        offsets.append(input_offset[id(x)])
    return offsets, [k >= 0 for k in in_input]


class _ArenaPages:
    """Which value last occupied each page of the arena, to find the ops a new occupant must wait for."""

    PAGES = 1024

    def __init__(self, arena_size: int):
        self.page = max(ALIGN, _aligned(-(-arena_size // self.PAGES)))
        self.occupant = np.full(-(-max(arena_size, 1) // self.page) + 1, -1, dtype=np.int64)
        self.values: list[Value] = []

    def take(self, offset: int, nbytes: int, value: Value, writer: Operation) -> list[Operation]:
        """Record `value` at [offset, offset + nbytes); returns the ops that used the earlier occupants."""
        p0, p1 = offset // self.page, -(-(offset + max(nbytes, 1)) // self.page)
        users: dict[int, Operation] = {}
        for index in np.unique(self.occupant[p0:p1]).tolist():
            prev = self.values[index] if index >= 0 else None
            if prev is None or prev is value:
                continue
            if prev.owner is not None and prev.owner is not writer:
                users[id(prev.owner)] = prev.owner
            for u in prev.uses:
                if u is not writer:
                    users[id(u)] = u
        self.occupant[p0:p1] = len(self.values)
        self.values.append(value)
        return list(users.values())


def _choose_stream(op: Operation, b: _Builder) -> int:
    """Continue the stream of the first producing kernel, unless it was continued already (a fork)."""
    for v in op.operands:
        p = v.owner
        if p is not None and id(p) in b.stream_of and not isinstance(p, Const):
            if id(p) not in b.continued:
                b.continued.add(id(p))
                return b.stream_of[id(p)]
            break
    stream = b.next_stream if b.next_stream <= MAX_COMPUTE_STREAMS else 1 + (b.next_stream - 1) % MAX_COMPUTE_STREAMS
    b.next_stream = min(b.next_stream + 1, MAX_COMPUTE_STREAMS + 1)
    return stream


def _wait_for(v: Value, stream: int, b: _Builder, loc) -> None:
    """Make `stream` wait for the producer of `v` when it runs on another stream."""
    p = v.owner
    if p is None:  # a graph input: its copy-in on the copy stream
        key, src = id(v), COPY_STREAM
    elif isinstance(p, Const):
        return  # uploaded at load time
    else:
        key, src = id(p), b.stream_of[id(p)]
    if src != stream:
        b.wait(b.event_after(key, src, loc), stream, loc)


@register_pass("lower")
class Lower(Pass):
    """Turn each tiled, planned graph into an rt.program of copies, launches and events."""

    REQUIRES = ("infer-shapes", "tile", "plan")

    def run(self, module: Module, ctx: PassContext) -> None:
        module.graphs = [lower_graph(g, ctx.target) if g.kind == "ge.graph" else g for g in module.graphs]
