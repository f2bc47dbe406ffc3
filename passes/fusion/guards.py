"""Shape guards of fused ops, and how to undo a fusion whose guard fails for a shape.

`fuse` decides on the graph as written. With `?` dimensions some conditions of a fused kernel
(a dtype the cube computes, a tiling that fits the buffers, a shape on which it pays off) can only be checked once the Runtime binds real shapes; `fuse` then fuses optimistically
and `fusion-guards` checks again for each shape signature, expanding the fused op back into
primitive ops where a guard fails. Both call the same guard, so a static graph and a
specialisation of a dynamic one reach the same decision.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from geir.attributes import DenseAttr
from geir.ir import Operation, Value
from geir.ops.linalg import bnsd
from geir.passes.pattern import Rewriter
from geir.kernels.flash_attention_tiling import FLASH_DECODE, choose_flash_tiling
from geir.kernels.tiling import TilingError, Untiled, fractal
from geir.target_npu.target import Target
from geir.types import DType, TensorType


def flash_attention_guard(q: TensorType, k: TensorType, v: TensorType, mask: TensorType | None, causal: bool,
                          layout: str, chip: Target, pse: TensorType | None = None) -> str | None:
    """Why the fused FlashAttention kernel cannot take these shapes on `chip`; None when it can.

    Unknown (`?`) dimensions pass: the check is made again once they are known. A pse's tile sits beside the
    mask's in the UB, so its itemsize counts with the mask's.
    """
    b, n, sq, d = bnsd(q, layout)
    skv = bnsd(k, layout)[2]
    try:
        fractal(chip, q.dtype)  # a head dim off the fractal is padded to it; a dtype the cube lacks is not
    except Untiled as e:
        return str(e)
    if None in (b, n, sq, d, skv) or None in v.shape:
        return None
    try:
        tiles = [t for t in (mask, pse) if t is not None]
        tiling = choose_flash_tiling(q, k, v, causal, bool(tiles), chip, layout=layout,
                                     mask_itemsize=sum(t.dtype.itemsize for t in tiles) if tiles else None)
    except TilingError as e:
        return f"no tiling of the fused kernel fits: {e}"
    except Untiled:
        return None
    if tiling.template == FLASH_DECODE:
        # flash-decoding splits the keys across the cores the rows leave idle: it beat the unfused ops on
        # every decode shape bench/fusion_crossover.py measures, down to 4 work units (B 1, N 1, Skv 512)
        return None
    return _decode_guard(sq, skv, tiling.work_units, chip)


def _decode_guard(sq: int, skv: int, units: int, chip: Target) -> str | None:
    """Decode-shaped attention (few query rows, many keys) on too few work units does not pay off.

    Without flash-decoding (a key/value head's stacked query rows overflow one row block) the fused
    kernel parallelises over query row blocks, so a handful of rows against a long key sequence keeps
    most cube cores idle, while the unfused matmuls spread over all of them. The thresholds are
    target data, measured by bench/fusion_crossover.py.
    """
    max_q, min_kv, busy = chip.fusion.decode_max_q, chip.fusion.decode_min_kv, chip.fusion.decode_max_busy
    if max_q is None or min_kv is None or sq > max_q or skv < min_kv or units > busy * chip.cube_cores:
        return None
    return (f"decode-shaped attention (Sq = {sq} <= {max_q}, Skv = {skv} >= {min_kv}) does not pay off fused: "
            f"its {units} work unit(s) leave {chip.cube_cores - units} of {chip.cube_cores} cube cores idle, "
            f"while unfused matmuls use them all")


def flash_attention_op_guard(op: Operation, chip: Target) -> str | None:
    """flash_attention_guard for a `ge.flash_attention` op."""
    types = [x.type for x in op.operands]
    mask, pse = op.mask_and_pse(types[3:])
    return flash_attention_guard(types[0], types[1], types[2], mask, bool(op.attr("causal")), op.attr("layout"),
                                 chip, pse)


def _const(rw: Rewriter, array: np.ndarray, dtype: DType, before: Operation) -> Value:
    t = TensorType(array.shape, dtype)
    return rw.create("ge.const", [], {"value": DenseAttr(np.asarray(array, dtype=dtype.np))}, [t], before=before).result


def _repeat_heads(rw: Rewriter, x: Value, group: int, before: Operation) -> Value:
    """[B, Nkv, S, D] -> [B, Nkv * group, S, D], each kv head repeated for its group of query heads."""
    b, nkv, s, d = x.type.shape
    one = rw.create("ge.reshape", [x], {"shape": [b, nkv, 1, s, d]}, before=before).result
    many = rw.create("ge.concat", [one] * group, {"axis": 2}, before=before).result
    return rw.create("ge.reshape", [many], {"shape": [b, nkv * group, s, d]}, before=before).result


def decompose_flash_attention(op: Operation, rw: Rewriter) -> None:
    """Replace a ge.flash_attention by the primitive ops it stands for (shapes must be known).

    The scores and softmax are computed in f32, as the fused kernel does, and the probabilities
    are rounded to the input dtype before the second matmul, so the results stay within the
    spec's tolerances of the fused kernel's.
    """
    def make(name: str, operands: list[Value], attributes: dict | None = None) -> Value:
        return rw.create(name, operands, attributes, before=op).result

    q, k, v = op.operands[:3]
    mask, pse = op.mask_and_pse(op.operands[3:])
    layout = op.attr("layout")
    _, n, sq, d = bnsd(q.type, layout)
    _, nkv, skv, _ = bnsd(k.type, layout)
    bsnd = layout == "BSND"
    if bsnd:
        q, k, v = (make("ge.transpose", [x], {"perm": [0, 2, 1, 3]}) for x in (q, k, v))
    dtype = q.type.dtype
    group = n // nkv
    if group > 1:
        k, v = _repeat_heads(rw, k, group, op), _repeat_heads(rw, v, group, op)
    s = make("ge.matmul", [q, k], {"transpose_b": True})
    if dtype != DType.f32:
        s = make("ge.cast", [s], {"to": DType.f32})
    scale = op.attr("scale")
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = make("ge.mul", [s, _const(rw, np.array(scale), DType.f32, op)])
    if op.attr("softcap"):
        cap = _const(rw, np.array(op.attr("softcap")), DType.f32, op)
        s = make("ge.mul", [make("ge.tanh", [make("ge.div", [s, cap])]), cap])
    if pse is not None:
        s = make("ge.add", [s, pse if pse.type.dtype == DType.f32 else make("ge.cast", [pse], {"to": DType.f32})])
    minus_inf = None
    if mask is not None and mask.type.dtype == DType.i1:
        minus_inf = _const(rw, np.array(-np.inf), DType.f32, op)
        s = make("ge.select", [mask, s, minus_inf])
    elif mask is not None:
        m = mask if mask.type.dtype == DType.f32 else make("ge.cast", [mask], {"to": DType.f32})
        s = make("ge.add", [s, m])
    if op.attr("causal"):
        keep = _const(rw, np.tril(np.ones((sq, skv), dtype=bool)), DType.i1, op)
        minus_inf = minus_inf or _const(rw, np.array(-np.inf), DType.f32, op)
        s = make("ge.select", [keep, s, minus_inf])
    p = make("ge.softmax", [s], {"axis": -1})
    if dtype != DType.f32:
        p = make("ge.cast", [p], {"to": dtype})
    out = make("ge.matmul", [p, v])
    if bsnd:
        out = make("ge.transpose", [out], {"perm": [0, 2, 1, 3]})
    rw.replace(op, [out])


# op name -> (its guard, how to expand it); the fused ops whose decision depends on shapes
FUSION_GUARDS: dict[str, tuple[Callable[[Operation, Target], str | None], Callable[[Operation, Rewriter], None]]] = {
    "ge.flash_attention": (flash_attention_op_guard, decompose_flash_attention),
}
