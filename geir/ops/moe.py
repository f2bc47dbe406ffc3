"""Mixture-of-experts ops, as ops-transformer's moe and gmm families name them: the experts' grouped matmul over
token counts known only at run time (GroupedMatmul)."""

from __future__ import annotations

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.indexing import require_indices
from geir.ops.numerics import require_float, same_dtype, work
from geir.traits import CubeOp
from geir.types import TensorType

# how a group list gives the groups' rows: running ends (torch's `offs`, CANN's group_list_type 0) or counts (1)
GROUP_LIST_TYPES = ("cumsum", "count")


def group_bounds(group_list: np.ndarray, list_type: str, rows: int) -> list[tuple[int, int]]:
    """Each group's rows [start, end) from a group list, clipped to the `rows` there are."""
    ends = np.cumsum(group_list) if list_type == "count" else np.asarray(group_list)
    bounds, start = [], 0
    for end in ends.astype(np.int64).tolist():
        end = min(max(end, start), rows)
        bounds.append((start, end))
        start = end
    return bounds


@op("ge.grouped_matmul")
class GroupedMatmul(Operation):
    """Rows of `x` [M, K] in consecutive groups, group g's rows times `weight[g]` ([K, N], or [N, K] with
    `transpose_b`), the group sizes given at run time by `group_list` ([G] integers); rows after the last group
    are zero. ops-transformer's GroupedMatmul with one x, one weight tensor and split_item 3 (one output), as
    transformers' grouped_mm experts call it."""

    OPERAND_NAMES = ("x", "weight", "group_list")
    TRAITS = (CubeOp,)
    transpose_b = Attr(bool, default=False)
    group_list_type = Attr(str, default="cumsum", choices=GROUP_LIST_TYPES)

    def infer(self, x: TensorType, weight: TensorType, group_list: TensorType) -> TensorType:
        dtype = same_dtype(self.name, x, weight)
        require_float(x, "x")
        require_indices(group_list, "group_list")
        if x.rank != 2 or weight.rank != 3 or group_list.rank != 1:
            raise ShapeError(f"grouped_matmul takes x [M, K], weight [G, K, N] and group_list [G], got {x}, "
                             f"{weight} and {group_list}")
        k, n = (weight.shape[2], weight.shape[1]) if self.transpose_b else weight.shape[1:]
        for what, a, b in (("contraction dims", x.shape[1], k), ("groups of weight and group_list", weight.shape[0],
                                                                    group_list.shape[0])):
            if a is not None and b is not None and a != b:
                raise ShapeError(f"grouped_matmul {what} differ: {a} vs {b}")
        return TensorType((x.shape[0], n), dtype)

    def compute(self, x: np.ndarray, weight: np.ndarray, group_list: np.ndarray) -> np.ndarray:
        a, w = work(x), work(weight)  # f16/bf16 accumulate in f32, as the cube does
        if self.transpose_b:
            w = np.swapaxes(w, -1, -2)
        out = np.zeros((a.shape[0], w.shape[2]), dtype=np.result_type(a, w))
        for g, (start, end) in enumerate(group_bounds(group_list, self.group_list_type, a.shape[0])):
            if end > start:
                out[start:end] = a[start:end] @ w[g]
        return out

    def flops(self) -> float:
        """2 per multiply-add over the rows the groups can hold (all of x: the counts are known only at run time)."""
        x, out = self.operands[0].type, self.results[0].type
        return 2.0 * (out.num_elements or 0) * (x.shape[1] or 0)
