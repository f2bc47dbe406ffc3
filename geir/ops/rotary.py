"""Rotary position embedding (RoPE) as one op: ops-transformer's RotaryPositionEmbedding (torch_npu's
`npu_rotary_mul`), with the partial rotation GPT-NeoX (`rotary_pct`) and Phi (`partial_rotary_factor`) use.

    y[..., :r] = x_r * cos + rotate(x_r) * sin      x_r = x[..., :r], r = rotary_dim
    y[..., r:] = x[..., r:]                          (passed through)

`mode = "half"` (LLaMA, GPT-NeoX): rotate(x) = concat(-x2, x1) of the two halves of x_r.
`mode = "interleave"` (GPT-J): rotate(x) pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]).
cos and sin are as wide as the rotated part (HF's duplicated tables) and broadcast to it.

With a fourth operand `k`, q (the first) and k are rotated by the same tables in one launch and both come back,
as ops-transformer's ApplyRotaryPosEmb (torch_npu's `npu_apply_rotary_pos_emb(q, k, cos, sin)`) does: each
tensor's result is the one-tensor op's, bit for bit.
"""

from __future__ import annotations

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.numerics import broadcast_dims, require_float, work
from geir.traits import Fused
from geir.types import TensorType

MODES = ("half", "interleave")


def rotate(x: np.ndarray, mode: str) -> np.ndarray:
    """The rotated partner of every element on the last axis: concat(-x2, x1), or (-x[2i+1], x[2i]) pairwise."""
    if mode == "half":
        h = x.shape[-1] // 2
        return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    return np.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


@op("ge.rotary_embedding")
class RotaryEmbedding(Operation):
    """x * cos + rotate(x) * sin on the first `rotary_dim` elements of the last axis, the rest passed through;
    computed in f32 and rounded once; with `k`, k is rotated alike and is the second result."""

    OPERAND_NAMES = ("x", "cos", "sin", "k?")
    TRAITS = (Fused,)
    NUM_RESULTS = None  # one, or two with k
    mode = Attr(str, default="half", choices=MODES)
    rotary_dim = Attr(int)

    def verify(self) -> str | None:
        want = 1 + (len(self.operands) > 3)
        if len(self.results) != want:
            return f"rotary_embedding of {want} tensor{'s' * (want > 1)} has {want} result{'s' * (want > 1)}, not {len(self.results)}"
        return None

    def infer(self, x: TensorType, cos: TensorType, sin: TensorType,
              k: TensorType | None = None) -> TensorType | tuple[TensorType, TensorType]:
        if k is not None:
            if k.dtype != x.dtype or (k.rank and x.rank and k.shape[-1] != x.shape[-1]):
                raise ShapeError(f"k {k} differs from q {x} in dtype or head dim")
            return self._infer_one(x, cos, sin), self._infer_one(k, cos, sin)
        return self._infer_one(x, cos, sin)

    def _infer_one(self, x: TensorType, cos: TensorType, sin: TensorType) -> TensorType:
        require_float(x)
        if x.rank == 0:
            raise ShapeError("rotary_embedding needs an input of rank 1 or more")
        r, d = self.rotary_dim, x.shape[-1]
        if r <= 0 or r % 2:
            raise ShapeError(f"rotary_dim {r} must be a positive even number")
        if d is not None and r > d:
            raise ShapeError(f"rotary_dim {r} exceeds the last axis of {x}")
        rotated = x.shape[:-1] + (r,)
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != x.dtype:
                raise ShapeError(f"{name} {t} differs in dtype from x {x}")
            if broadcast_dims(rotated, t.shape) != rotated:
                raise ShapeError(f"{name} {t} does not broadcast to the rotated part {TensorType(rotated, x.dtype)}")
        return TensorType(x.shape, x.dtype)

    def compute(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, k: np.ndarray | None = None):
        if k is not None:
            return self.rotate_one(x, cos, sin), self.rotate_one(k, cos, sin)
        return self.rotate_one(x, cos, sin)

    def rotate_one(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """One tensor rotated (the op's semantics for each of its tensors)."""
        r = self.rotary_dim
        xw = work(x)
        xr = xw[..., :r]
        y = xr * work(cos) + rotate(xr, self.mode) * work(sin)
        return np.concatenate([y, xw[..., r:]], axis=-1) if r < x.shape[-1] else y
