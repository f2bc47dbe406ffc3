"""Shape plumbing ONNX ops need and GEIR spells differently: reshapes with `?` dims, broadcasts, axes."""

from __future__ import annotations

from typing import Sequence

from geir.frontends.onnx_values import GraphBuilder, ImportProblem, Tensor
from geir.ops.numerics import broadcast_dims
from geir.opdef import ShapeError
from geir.types import Dim


# a broadcast is written as copies concatenated, one operand each (the spelling GE's grouped-query attention
# rule reads): past this many along one axis the op would fit no tiling, and billions not even in memory
MAX_COPIES = 1 << 16


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """An ONNX axis in [-rank, rank) made non-negative."""
    if not -rank <= axis < rank:
        raise ImportProblem(f"{what} {axis} is out of range for rank {rank}", unsupported=False)
    return axis % rank


def broadcast_shape(*shapes: Sequence[Dim]) -> tuple[Dim, ...]:
    """numpy broadcasting of several shapes (`?` as None)."""
    out: tuple[Dim, ...] = ()
    try:
        for s in shapes:
            out = broadcast_dims(out, tuple(s))
    except ShapeError as e:
        raise ImportProblem(str(e), unsupported=False) from None
    return out


def reshape_to(b: GraphBuilder, x: Tensor, dims: Sequence[Dim]) -> Tensor:
    """x with shape `dims`; a `?` (None) there becomes the reshape's one inferred dimension (-1)."""
    dims = tuple(dims)
    source = x.value.owner if x.value is not None else None
    if source is not None and source.name == "ge.reshape":  # a reshape of a reshape is one reshape
        x = Tensor(value=source.operands[0])
    if tuple(x.shape) == dims:
        return x
    unknown = sum(1 for d in dims if d is None)
    if unknown > 1:
        shown = "x".join("?" if d is None else str(d) for d in dims)
        raise ImportProblem(f"reshape to {shown}: GEIR reshapes allow one dimension known only at run time, "
                            f"this needs {unknown}")
    shape = [-1 if d is None else int(d) for d in dims]
    if unknown and -1 in [d for d in dims if d is not None]:
        raise ImportProblem("reshape with both a -1 and a dimension known only at run time")
    return b.emit1("ge.reshape", [x], {"shape": shape})


def broadcast_to(b: GraphBuilder, x: Tensor, shape: Sequence[Dim]) -> Tensor:
    """x broadcast to `shape` by numpy's rules: ranks aligned by a reshape, then copies concatenated
    along each axis where x has size 1 (data movement only, exact for every dtype)."""
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    if len(shape) < x.rank:
        raise ImportProblem(f"cannot broadcast {x.type} to rank {len(shape)}", unsupported=False)
    x = reshape_to(b, x, (1,) * (len(shape) - x.rank) + tuple(x.shape))
    for axis, (have, want) in enumerate(zip(x.shape, shape)):
        if have == want:
            continue
        if have != 1 or want is None:
            shown = "x".join("?" if d is None else str(d) for d in shape)
            raise ImportProblem(f"cannot broadcast {x.type} to {shown} at axis {axis}"
                                + (" (a dimension known only at run time)" if None in (have, want) else ""),
                                unsupported=None in (have, want))
        if want == 0:
            x = b.emit1("ge.slice", [x], {"axes": [axis], "starts": [0], "ends": [0]})
        elif want > MAX_COPIES:
            shown = "x".join(str(d) for d in shape)
            raise ImportProblem(f"cannot broadcast {x.type} to {shown}: that is {want} copies along axis {axis}, and "
                                f"GEIR writes a broadcast as copies concatenated, at most {MAX_COPIES}")
        else:
            x = b.emit1("ge.concat", [x] * want, {"axis": axis})
    return x
