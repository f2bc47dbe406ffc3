"""The tiling contract between GE and the kernels (CANN's op_host tiling functions, MLIR's TilingInterface).

Each kernel owns a typed tiling class and four functions on it (see `geir.kernels.base.Kernel`):
`choose` (the tiling rule for one op's types and attributes on a target: a tiling, or a `Miss`
with the reason), `budget` (the bytes a work unit keeps in each on-chip buffer: the one buffer
model, used to choose blocks and to allocate them when the kernel runs), `shrink` (a tiling that
keeps less on chip and computes bit-identical results: what the Runtime asks for when a tile does
not fit at run time) and `candidates` (every legal tiling, for sweeps).

A tiling crosses into the IR once, as the `tiling = {...}` attribute the `tile` pass prints
(`to_attr`), and comes back once, when the Runtime loads an `rt.program` (`from_attr`, which says
precisely what is wrong with a malformed attribute). Kernels receive the typed value.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import attrs

from geir.ir import Operation
from geir.target_npu.target import Target
from geir.types import DType, TensorType

F32_BYTES = 4
BUFFER_NAMES = {"ub": "UB", "l1": "L1", "l0a": "L0A", "l0b": "L0B", "l0c": "L0C"}
# the attributes GE's tile and plan passes put on an op: where it runs, not what it computes (no part of its signature)
PLAN_ATTRIBUTES = ("tiling", "mem_offset", "mem_operand", "workspace")
SMALLEST_BLOCK = 16  # the least query rows (FlashAttention) or output rows (matmul) a shrunk tiling keeps


class TilingError(ValueError):
    """No tiling fits the target: the message names the buffer, the bytes asked for and its capacity."""


class Untiled(Exception):
    """The op stays untiled for a stated reason (an --explain remark, not an error)."""


class TilingAttrError(ValueError):
    """A `tiling` attribute that does not describe a tiling of its kernel; the message says what is wrong."""


@attrs.frozen
class Miss:
    """Why `choose` gave no tiling: the op stays untiled (a remark), or, with `overflow`, no tiling fits (an error)."""

    reason: str
    overflow: bool = False


def choice(rule: Callable[[], "KernelTiling"]) -> "KernelTiling | Miss":
    """A tiling rule's result, or its Miss: untiled (a remark), or when nothing fits an overflow (an error)."""
    try:
        return rule()
    except Untiled as e:
        return Miss(str(e))
    except TilingError as e:
        return Miss(str(e), overflow=True)


@attrs.frozen
class Budget:
    """Bytes a tile asks of each on-chip buffer."""

    ub: int
    l1: int
    l0a: int
    l0b: int
    l0c: int

    def overflow(self, chip: Target) -> tuple[str, int, int] | None:
        """(buffer name, bytes asked, capacity) of the first buffer that does not hold the tile, or None."""
        for name in BUFFER_NAMES:
            need, cap = getattr(self, name), chip.buffer_bytes(name)
            if need > cap:
                return BUFFER_NAMES[name], need, cap
        return None


@attrs.frozen(eq=False)
class OpSignature:
    """What a tiling depends on: the op's name, operand and result types, and its attributes."""

    name: str
    operands: tuple[TensorType | None, ...]
    results: tuple[TensorType | None, ...]
    attributes: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def of(cls, op: Operation) -> "OpSignature":
        """The signature of an op in a graph (its `tiling` and `mem_offset` are not part of it)."""
        attributes = {k: v for k, v in op.attributes.items() if k not in PLAN_ATTRIBUTES}
        return cls(op.name, tuple(v.type for v in op.operands), tuple(r.type for r in op.results), attributes)

    @classmethod
    def of_arrays(cls, op: Operation, arrays: list[Any]) -> "OpSignature":
        """The signature of an op applied to these arrays (shapes and dtypes from the arrays, never from the IR)."""
        operands = tuple(TensorType(tuple(a.shape), DType.from_numpy(a.dtype)) for a in arrays)
        results = tuple(r.type for r in op.results)
        if any(t is None or not t.is_static for t in results):
            inferred = op.infer(*operands)
            results = inferred if isinstance(inferred, tuple) else (inferred,)
        return cls(op.name, operands, results,
                   {k: v for k, v in op.attributes.items() if k not in PLAN_ATTRIBUTES})

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attributes.get(key, default)

    @property
    def key(self) -> tuple:
        """A hashable key: equal keys get equal tilings (the tile pass memoises by it)."""
        return (self.name, tuple(str(t) for t in self.operands), tuple(str(t) for t in self.results),
                repr(sorted(self.attributes.items())))


def never_printed(default: Any = None) -> Any:
    """A tiling field that is not part of the IR attribute (the rule that chose it, the work units it makes):
    known where the tiling was chosen, absent once decoded, so it does not make two tilings differ."""
    return attrs.field(default=default, eq=False, metadata={"print": "never"})


def printed_if_set(default: Any) -> Any:
    """A tiling field printed only when it differs from `default`."""
    return attrs.field(default=default, metadata={"print": "if_set"})


@attrs.frozen(kw_only=True)
class KernelTiling:
    """The fields every tiling has; subclasses add their blocks (declared in printed order).

    Subclasses declare their own fields in the order the attribute prints them; `rule` (the prose
    the tile pass shows with --explain) and other fields marked `never_printed` stay out of it.
    Tilings are built with keyword fields only (`kw_only`): the printed order is no constructor's order.
    """

    TEMPLATES: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _fields(cls) -> tuple[attrs.Attribute, ...]:
        return attrs.fields(cls)

    def to_attr(self) -> dict[str, Any]:
        """The printed `tiling = {...}` dictionary."""
        out: dict[str, Any] = {}
        for f in self._fields():
            how = f.metadata.get("print", "always")
            value = getattr(self, f.name)
            if how == "never" or (how == "if_set" and value == f.default):
                continue
            out[f.name] = value
        return out

    @classmethod
    def from_attr(cls, attr: Any, what: str = "tiling") -> "KernelTiling":
        """The typed tiling an IR `tiling` attribute describes; TilingAttrError says what is wrong with it."""
        if not isinstance(attr, dict):
            raise TilingAttrError(f"{what} must be a dictionary, not {type(attr).__name__}")
        values: dict[str, Any] = {}
        for f in cls._fields():
            how = f.metadata.get("print", "always")
            if how == "never":
                continue
            if f.name not in attr:
                if how == "if_set":
                    continue
                raise TilingAttrError(f"{what} has no '{f.name}' (a {cls.__name__} needs "
                                      f"{', '.join(x.name for x in cls._fields() if x.metadata.get('print', 'always') == 'always')})")
            value = attr[f.name]
            if f.name == "template":
                if value not in cls.TEMPLATES:
                    raise TilingAttrError(f"{what}: template {value!r} is not one of {', '.join(cls.TEMPLATES)}")
            else:
                # sizes may be 0: an empty tensor has empty rows and tiles
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise TilingAttrError(f"{what}: '{f.name}' must be a non-negative integer, not {value!r}")
            values[f.name] = value
        unknown = sorted(set(attr) - set(values) - {f.name for f in cls._fields()})
        if unknown:
            raise TilingAttrError(f"{what}: unknown key{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} "
                                  f"for a {cls.__name__}")
        if values.get("buffers") not in (1, 2):
            raise TilingAttrError(f"{what}: 'buffers' must be 1 or 2, not {values.get('buffers')!r}")
        return cls(**values)

    def with_changes(self, **changes: Any) -> "KernelTiling":
        return attrs.evolve(self, **changes)


@attrs.frozen(kw_only=True)
class RowBlockTiling(KernelTiling):
    """The fields of a vector kernel that tiles `rows` x `cols` blocks over the vector units (row-wise ops, scans,
    gathers): subclasses add theirs after these, and print in that order."""

    template: str
    rows: int
    cols: int
    buffers: int
    cores: int
    ub_bytes: int
    work_units: int | None = never_printed(None)
    rule: str = never_printed("")

    @property
    def blocks(self) -> dict[str, int]:
        return {"rows": self.rows, "cols": self.cols}


# --- shared arithmetic of the tiling rules ----------------------------------------------------------

def align(x: int, a: int) -> int:
    """`x` rounded up to a multiple of `a`."""
    return -(-x // a) * a


def check_buffers(buffers: int) -> None:
    if buffers not in (1, 2):
        raise ValueError(f"buffers must be 1 (single) or 2 (double buffering), not {buffers}")


def fractal(chip: Target, dtype: DType) -> tuple[int, int, int]:
    """The cube's m x k x n MACs per cycle for `dtype` (f32 has half the k: half the rate)."""
    mode = chip.cube_fractal(dtype.value)
    if mode is None:
        raise Untiled(f"the cube of {chip.name} has no {dtype} mode")
    return mode


def units_worth_starting(chip: Target, nbytes: int | None, most: int) -> int:
    """How many of `most` vector units to stream `nbytes` (operands and results) over: the count that minimises the
    head of starting them plus each one's share of the bytes at its HBM rate (the units together at most the chip's),
    as catlass advises trading parallelism against the head; `most` where the target has no head or the size is
    unknown."""
    head = chip.head_cycles(1)
    if not head or nbytes is None:
        return most
    per_unit, whole = chip.memory.hbm_read_bytes_per_cycle, chip.memory.hbm_bytes_per_s / chip.clock_hz
    return min(range(1, most + 1), key=lambda c: head * c + nbytes / min(per_unit * c, whole))


def halvings(start: int, least: int) -> list[int]:
    """start, then the powers of two below it down to `least` (block sizes to try, largest first)."""
    out = [start]
    p = least
    while p * 2 < start:
        p *= 2
    while p >= least and p < start:
        out.append(p)
        p //= 2
    return out


def product(dims: tuple[int | None, ...]) -> int | None:
    """The product of some dims, None when one is dynamic."""
    out = 1
    for d in dims:
        if d is None:
            return None
        out *= d
    return out


def halve(tiling: KernelTiling, key: str, least: int) -> tuple[KernelTiling, str] | None:
    """`tiling` with its parallel block dimension `key` halved, else (at `least`) single-buffered; None when
    neither is left.

    Halving the dimension that splits independent work changes how work is cut into units, never
    the order in which any result element is summed, and the number of buffers changes only when
    data moves, so results stay bit-identical. The budgets it records are the kernel's to recompute
    (Kernel.with_budget).
    """
    value = getattr(tiling, key)
    if value // 2 >= least:
        return attrs.evolve(tiling, **{key: value // 2}), f"{key} {value} -> {value // 2}"
    if tiling.buffers == 2:
        return attrs.evolve(tiling, buffers=1), "buffers 2 -> 1"
    return None


def cube_refuses(types: tuple[TensorType | None, ...], chip: Target) -> str | None:
    """Why the cube cannot multiply operands of these types (a dtype it has no mode for), or None."""
    for t in types:
        if t is not None and chip.cube_fractal(t.dtype.value) is None:
            return f"the cube of {chip.name} has no {t.dtype} mode"
    return None


# --- check instances: a small op a tiling computes alike (Kernel.check_instance) ----------------------

CHECK_ELEMENTS = 1 << 20  # about how many result elements a check instance keeps


def with_shapes(sig: OpSignature, operands: list[TensorType | None], results: list[TensorType | None]) -> OpSignature:
    """`sig` with other operand and result types (the same op and attributes)."""
    return OpSignature(sig.name, tuple(operands), tuple(results), dict(sig.attributes))


def resized(t: TensorType | None, axis: int, size: int) -> TensorType | None:
    """`t` with one dimension set to `size`."""
    if t is None:
        return None
    shape = list(t.shape)
    shape[axis] = size
    return TensorType(tuple(shape), t.dtype)


def cut_leading(sig: OpSignature, rank: int, elements: int = CHECK_ELEMENTS) -> OpSignature:
    """`sig` with its leading dimension cut so the result keeps about `elements` elements: every type of rank
    `rank` whose first dimension is the result's (operands of lower rank or a leading 1 broadcast, unchanged).

    For ops whose results are independent along the leading axis (elementwise ops, rows a row-wise op does not
    reduce), each result element left is computed as in `sig`."""
    out = sig.results[0]
    if out is None or not out.is_static or out.rank == 0 or not out.shape[0]:
        return sig
    lead = out.shape[0]
    per_row = max(product(out.shape[1:]) or 1, 1)
    keep = max(1, min(lead, elements // per_row))
    if keep == lead:
        return sig
    cut = lambda t: resized(t, 0, keep) if t is not None and t.rank == rank and t.shape[0] == lead else t  # noqa: E731
    return with_shapes(sig, [cut(t) for t in sig.operands], [resized(t, 0, keep) if t is not None and t.rank and
                                                              t.shape[0] == lead else t for t in sig.results])
