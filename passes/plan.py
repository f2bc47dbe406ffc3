"""plan: the device-memory plan of a graph, one arena with an offset for every intermediate result.

Where tensors live:
- Graph inputs are the caller's buffers (the Runtime binds them); they are not in the arena and
  the graph never writes into them, with one exception: a donated, in-place operand. A result that
  its op's kernel declares to be its operand's memory (`Kernel.shared`: an update in place, as
  ge.index_put's `in_place`, which serve sets on a KV pool it donates to the step) whose operand is
  a graph input used by that op alone lives in the input's buffer: it takes no arena bytes, its
  `mem_offset` entry is -1 and `mem_operand` names, per result, the operand whose buffer it is
  (-1 for a result in the arena). Anything else the input feeds would read the bytes the update
  overwrote, so an input with another user (ge.return included) is never taken. A view of such a
  result (`Kernel.views`: a reshape of ND data reads the bytes where they lie) is in the same buffer,
  its `mem_operand` naming the viewed operand.
- Constants live in the Runtime's read-only constant store, uploaded once and shared by every
  run and every re-plan; they are not in the arena either and carry no `mem_offset`.
- Every other op result lives in the arena, from the op that produces it to its last use. Graph
  outputs are used by `ge.return`, so they stay live to the end of the graph and nothing
  overwrites them once produced; the Runtime copies them out after the run. An output that is
  an input or a constant is served from there.

Each tensor takes its byte size rounded up to `alignment` (512, the HBM block), at an offset that
is a multiple of it. An elementwise op's result may take the slot of an operand in place when they
have the same element count, element size and format and the operand dies at that op (it is
neither a graph input nor a constant, and nothing later reads it). Offsets are chosen greedily by
size (largest first, each into the best-fitting gap among the placed tensors whose lifetimes
overlap its own), as TensorFlow Lite's arena planner does.

A launch that needs a GM workspace (FlashAttention's CV-split schedule on Atlas A2: S and P between the
cube and vector cores) gets it in the arena too, live only while its op runs, printed as `workspace =
[offset, bytes]` on the op.

`arena_lower_bound` is the most bytes, at aligned sizes, that the arena holds live at any one op
(a tensor in place of its operand counts once), so no plan of these tensors with this alignment
can be smaller and `arena_size / arena_lower_bound` measures the placement alone.

A graph whose arena would hold a tensor with a `?` dimension is not planned: the pass leaves it
without plan attributes and says so in an --explain remark; the Runtime plans it per input shape.
"""

from __future__ import annotations

import attrs
import numpy as np

from geir.ir import Graph, Module, Operation, Value
from geir.kernels.base import KERNELS
from geir.kernels.tiling import OpSignature, TilingAttrError
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.traits import InPlaceCapable


# the largest alignment an option may ask for: 1 GiB, far above any hardware block
MAX_ALIGNMENT = 1 << 30


def _values(graph: Graph) -> list[Value]:
    return list(graph.args) + [r for op in graph.ops for r in op.results]


class UnplannableError(ValueError):
    """A tensor the arena would hold has no static size; `value` is the first such tensor."""

    def __init__(self, value: Value):
        super().__init__(f"%{value.name or '?'} has a dynamic shape ({value.type})")
        self.value = value


@attrs.frozen
class MemoryPlan:
    """Arena offsets, aligned sizes and [first, last] op-index lifetimes of the arena's tensors."""

    offsets: dict[Value, int]
    sizes: dict[Value, int]
    lifetimes: dict[Value, tuple[int, int]]
    inplace: dict[Value, Value]  # result -> the operand whose slot it took
    arena_size: int
    arena_lower_bound: int
    alignment: int
    # by op index, the ops whose launch needs a GM workspace: (offset, aligned bytes), live while the op runs
    workspaces: dict[int, tuple[int, int]] = attrs.field(factory=dict)
    # results that live in a donated graph input's buffer, not in the arena: result -> that input
    donated: dict[Value, Value] = attrs.field(factory=dict)

    @property
    def ratio(self) -> float:
        """arena_size / arena_lower_bound (1.0 for an empty arena)."""
        return self.arena_size / self.arena_lower_bound if self.arena_lower_bound else 1.0


def align(nbytes: int, alignment: int) -> int:
    """`nbytes` rounded up to a multiple of `alignment`."""
    return -(-nbytes // alignment) * alignment


def _can_take_slot(op: Operation, x: Value, r: Value) -> bool:
    """Whether result `r` of `op` may overwrite its operand `x` element by element."""
    a, b = x.type, r.type
    return (op.has_trait(InPlaceCapable) and a.num_elements == b.num_elements
            and a.dtype.itemsize == b.dtype.itemsize and a.format == b.format)


def _donated(op: Operation, j: int, donated: dict[Value, Value]) -> Value | None:
    """The graph input whose buffer result `j` of `op` is, or None: the op's kernel declares the result its
    operand's memory (an update in place) and that operand is a graph input nothing else uses; or the result is a
    view of a value already in an input's buffer (`donated`: value -> input), whose bytes it reads where they lie."""
    kernel = KERNELS.get(op.name)
    if kernel is None:
        return None
    for i, k in kernel.views(op):
        if k == j and i < len(op.operands) and op.operands[i] in donated:
            return donated[op.operands[i]]
    for i, k in kernel.shared(op):
        if k != j or i >= len(op.operands):
            continue
        x, r = op.operands[i], op.results[j]
        alone = all(u is op for u in x.uses) and sum(v is x for v in op.operands) == 1
        if (x.owner is None and x.uses and alone and x.type is not None and x.type.is_static
                and x.type.nbytes == r.type.nbytes):
            return x
    return None


def _operand_index(op: Operation, arg: Value | None, donated: dict[Value, Value]) -> int:
    """The position among the operands of `op` of the one whose buffer is graph input `arg` (the input itself, or
    a value the plan put in its buffer), -1 for None."""
    return -1 if arg is None else next(i for i, x in enumerate(op.operands) if x is arg or donated.get(x) is arg)


def plan_memory(graph: Graph, alignment: int = 512, inplace: bool = True) -> MemoryPlan:
    """Plan the arena of `graph` (types inferred); raises UnplannableError on a dynamic-shape tensor."""
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, not {alignment}")
    ops = graph.ops
    index = {id(op): i for i, op in enumerate(ops)}
    lifetimes: dict[Value, tuple[int, int]] = {}
    sizes: dict[Value, int] = {}
    slot: dict[Value, int] = {}  # value -> buffer number
    buf_values: list[list[Value]] = []
    buf_start: list[int] = []
    buf_end: list[int] = []
    buf_size_ws: dict[int, int] = {}
    inplace_of: dict[Value, Value] = {}
    donated: dict[Value, Value] = {}
    for i, op in enumerate(ops):
        if op.name == "ge.const":
            continue
        for j, r in enumerate(op.results):
            if r.type is None or not r.type.is_static:
                raise UnplannableError(r)
            arg = _donated(op, j, donated) if inplace else None
            if arg is not None:  # updated where the input is: no arena bytes
                donated[r] = arg
                continue
            end = max((index[id(u)] for u in r.uses), default=i)
            lifetimes[r] = (i, end)
            sizes[r] = align(r.type.nbytes, alignment)
            taken = None
            if inplace and len(op.results) == 1:
                taken = next((x for x in op.operands
                              if x in slot and lifetimes[x][1] == i and _can_take_slot(op, x, r)), None)
            if taken is None:
                slot[r] = len(buf_values)
                buf_values.append([r])
                buf_start.append(i)
                buf_end.append(end)
            else:
                b = slot[r] = slot[taken]
                del slot[taken]  # the slot now belongs to r: nothing else may take it from `taken`
                buf_values[b].append(r)
                buf_end[b] = end
                inplace_of[r] = taken
    workspaces: dict[int, int] = {}  # op index -> its workspace's buffer
    for i, op in enumerate(ops):
        need = workspace_of(op)
        if need:  # the launch's workspace lives while the op runs, beside its operands and results
            workspaces[i] = len(buf_values)
            buf_values.append([])
            buf_start.append(i)
            buf_end.append(i)
            buf_size_ws[len(buf_values) - 1] = align(need, alignment)
    buf_size = [sizes[vs[0]] if vs else buf_size_ws[b] for b, vs in enumerate(buf_values)]
    buf_offset = assign_offsets(buf_size, buf_start, buf_end)
    offsets = {v: buf_offset[b] for b, vs in enumerate(buf_values) for v in vs}
    arena = max((o + s for o, s in zip(buf_offset, buf_size)), default=0)
    ws = {i: (buf_offset[b], buf_size[b]) for i, b in workspaces.items()}
    return MemoryPlan(offsets, sizes, lifetimes, inplace_of, arena,
                      live_bytes_peak(buf_size, buf_start, buf_end), alignment, ws, donated)


def workspace_of(op: Operation) -> int:
    """Bytes of GM workspace the launch of a tiled op needs beside its operands and results (its kernel says)."""
    kernel = KERNELS.get(op.name)
    attr = op.attributes.get("tiling")
    if kernel is None or not attr:
        return 0
    try:
        tiling = kernel.decode(attr)
    except TilingAttrError:
        return 0  # the verifier and the Runtime report a malformed tiling; the plan does not
    return kernel.workspace_bytes(tiling, OpSignature.of(op))


def live_bytes_peak(sizes: list[int], starts: list[int], ends: list[int]) -> int:
    """The most bytes live at one time step; buffer i lives over steps starts[i]..ends[i] inclusive."""
    if not sizes:
        return 0
    delta = np.zeros(max(ends) + 2, dtype=np.int64)
    np.add.at(delta, np.asarray(starts), np.asarray(sizes, dtype=np.int64))
    np.add.at(delta, np.asarray(ends) + 1, -np.asarray(sizes, dtype=np.int64))
    return int(np.cumsum(delta).max())


def assign_offsets(sizes: list[int], starts: list[int], ends: list[int], width: int = 16) -> list[int]:
    """Greedy by size, best fit: buffers whose lifetimes overlap get disjoint [offset, offset + size).

    Placed buffers are indexed by `width`-step buckets of time, so finding the ones that overlap
    a buffer costs about its overlaps: O(n log n) plus the overlapping pairs, not O(n^2).
    """
    offsets = [0] * len(sizes)
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], starts[i], -ends[i])):
        size, s, e = sizes[i], starts[i], ends[i]
        if size == 0:
            continue
        spanned = range(s // width, e // width + 1)
        near = {j for b in spanned for j in buckets.get(b, ())}
        busy = sorted((offsets[j], offsets[j] + sizes[j]) for j in near if starts[j] <= e and ends[j] >= s)
        best, best_gap, reach = None, 0, 0  # reach: where everything placed below has ended
        for lo, hi in busy:
            gap = lo - reach
            if gap >= size and (best is None or gap < best_gap):
                best, best_gap = reach, gap
            reach = max(reach, hi)
        offsets[i] = reach if best is None else best
        for b in spanned:
            buckets.setdefault(b, []).append(i)
    return offsets


def _clear(graph: Graph) -> None:
    """Drop a previous plan's attributes."""
    graph.attributes.pop("arena_size", None)
    graph.attributes.pop("arena_lower_bound", None)
    for op in graph.ops:
        op.attributes.pop("mem_offset", None)
        op.attributes.pop("mem_operand", None)
        op.attributes.pop("workspace", None)


@register_pass("plan")
class Plan(Pass):
    """Plan device memory: liveness, in-place reuse, best-fit offsets; prints `mem_offset` and the arena size."""

    REQUIRES = ("infer-shapes",)
    alignment: int = 512
    inplace: bool = True

    def __attrs_post_init__(self) -> None:
        # checked when the pipeline is parsed: the pass manager reports a ValueError as a usage error
        a = self.alignment
        if a < 1 or a > MAX_ALIGNMENT or a & (a - 1):
            raise ValueError(f"option 'alignment' must be a power of two from 1 to {MAX_ALIGNMENT} bytes, not {a}")

    def run(self, module: Module, ctx: PassContext) -> None:
        for g in module.graphs:
            widest = max((v.type.dtype.itemsize for v in _values(g) if v.type is not None), default=1)
            if self.alignment < widest:
                ctx.error(f"plan: alignment {self.alignment} is smaller than the graph's {widest}-byte elements",
                          g.loc)
                return
        for g in module.graphs:
            _clear(g)
            try:
                plan = plan_memory(g, self.alignment, self.inplace)
            except UnplannableError as e:
                ctx.remark(f"plan: not planned: {e}; the Runtime plans this graph once the input shapes are known",
                           e.value.loc)
                continue
            for i, op in enumerate(g.ops):
                if op.results and op.name != "ge.const":
                    op.attributes["mem_offset"] = [plan.offsets.get(r, -1) for r in op.results]
                    if any(r in plan.donated for r in op.results):
                        op.attributes["mem_operand"] = [_operand_index(op, plan.donated.get(r), plan.donated)
                                                       for r in op.results]
                if i in plan.workspaces:
                    op.attributes["workspace"] = list(plan.workspaces[i])
            g.attributes["arena_size"] = plan.arena_size
            g.attributes["arena_lower_bound"] = plan.arena_lower_bound
            ctx.remark(f"plan: arena {plan.ratio:.2f}x the lower bound (arena_size {plan.arena_size} B, "
                       f"arena_lower_bound {plan.arena_lower_bound} B, {len(plan.inplace)} in place"
                       + (f", {len(plan.donated)} in a donated input" if plan.donated else "") + ")", g.loc)
