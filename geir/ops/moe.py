"""Mixture-of-experts ops, as ops-transformer's moe and gmm families name them: the router's softmax and top-k
(MoeGatingTopKSoftmaxV2), the tokens ordered by expert (MoeInitRoutingV2), the experts' grouped matmul over token
counts known only at run time (GroupedMatmul) and the weighted combine (MoeFinalizeRouting).

The token-expert pairs are numbered row-major, pair p = token * k + j (transformers' order); ops-transformer's V1
gating op numbers them column-major (its row_idx), the V2 ops take the flattened expert_idx as given."""

from __future__ import annotations

import numpy as np

from geir.ir import Operation
from geir.opdef import Attr, ShapeError, op
from geir.ops.indexing import require_indices, stable_order
from geir.ops.numerics import require_float, same_dtype, softmax, work
from geir.traits import CubeOp, Fused
from geir.types import DType, TensorType

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


@op("ge.moe_gating_topk_softmax")
class MoeGatingTopKSoftmax(Operation):
    """The router: softmax over the experts (last axis), the `k` largest probabilities and their experts (i64,
    ties to the lower expert), with `renorm` divided by their sum (ops-transformer's MoeGatingTopKSoftmaxV2 with
    renorm 1, which takes the softmax of the k largest logits: the same numbers)."""

    OPERAND_NAMES = ("x",)
    NUM_RESULTS = 2
    TRAITS = (Fused,)
    k = Attr(int)
    renorm = Attr(bool, default=False)

    def verify(self) -> str | None:
        return None if self.k >= 1 else f"moe_gating_topk_softmax k must be at least 1, got {self.k}"

    def infer(self, x: TensorType) -> tuple[TensorType, TensorType]:
        require_float(x, "x")
        if x.rank < 1:
            raise ShapeError(f"moe_gating_topk_softmax takes router logits [..., experts], not {x}")
        experts = x.shape[-1]
        if experts is not None and self.k > experts:
            raise ShapeError(f"moe_gating_topk_softmax k = {self.k} exceeds the {experts} experts")
        shape = x.shape[:-1] + (self.k,)
        return TensorType(shape, x.dtype), TensorType(shape, DType.i64)

    def compute(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = softmax(work(x), -1)
        index = stable_order(p, p.ndim - 1, descending=True)[..., :self.k]
        y = np.take_along_axis(p, index, axis=-1)
        if self.renorm:
            y = y / np.sum(y, axis=-1, keepdims=True)
        return y, index.astype(np.int64)


@op("ge.moe_init_routing")
class MoeInitRouting(Operation):
    """The token-expert pairs ordered by expert (a stable sort of the flattened `expert_idx` [N, k]):
    expanded_x [N*k, H] (row i: the token of the i-th pair in that order), expanded_row_idx [N*k] (where each pair
    went: expanded_row_idx[sorted[i]] = i) and the tokens per expert [E] as running ends (i32, `cumsum`) or counts,
    expert ids outside [0, E) counted nowhere. ops-transformer's MoeInitRoutingV2, dropless (drop_pad_mode 0)."""

    OPERAND_NAMES = ("x", "expert_idx")
    NUM_RESULTS = 3
    TRAITS = (Fused,)
    num_experts = Attr(int)
    tokens_list_type = Attr(str, default="cumsum", choices=GROUP_LIST_TYPES)

    def verify(self) -> str | None:
        return None if self.num_experts >= 1 else f"moe_init_routing needs at least one expert, got {self.num_experts}"

    def infer(self, x: TensorType, expert_idx: TensorType) -> tuple[TensorType, TensorType, TensorType]:
        require_indices(expert_idx, "expert_idx")
        if x.rank != 2 or expert_idx.rank != 2:
            raise ShapeError(f"moe_init_routing takes x [N, H] and expert_idx [N, k], got {x} and {expert_idx}")
        n, k = expert_idx.shape
        if x.shape[0] is not None and n is not None and x.shape[0] != n:
            raise ShapeError(f"moe_init_routing x has {x.shape[0]} tokens, expert_idx {n}")
        pairs = n * k if n is not None and k is not None else None
        return (TensorType((pairs, x.shape[1]), x.dtype), TensorType((pairs,), DType.i64),
                TensorType((self.num_experts,), DType.i32))

    def compute(self, x: np.ndarray, expert_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = expert_idx.shape[1]
        flat = expert_idx.reshape(-1)
        order = stable_order(flat, 0, descending=False)
        expanded_row_idx = np.empty_like(order)
        expanded_row_idx[order] = np.arange(order.size)
        inside = flat[(flat >= 0) & (flat < self.num_experts)]
        counts = np.bincount(inside, minlength=self.num_experts)
        tokens = np.cumsum(counts) if self.tokens_list_type == "cumsum" else counts
        return x[order // k], expanded_row_idx.astype(np.int64), tokens.astype(np.int32)


@op("ge.moe_finalize_routing")
class MoeFinalizeRouting(Operation):
    """The experts' rows put back and combined: out[t] = sum_j scales[t, j] * expanded[expanded_row_idx[t*k + j]]
    (expanded [N*k, H] in expert order, scales [N, k]), accumulated in f32 at least and rounded once, as
    ops-transformer's MoeFinalizeRouting without its residuals and bias."""

    OPERAND_NAMES = ("expanded", "scales", "expanded_row_idx")
    TRAITS = (Fused,)

    def infer(self, expanded: TensorType, scales: TensorType, expanded_row_idx: TensorType) -> TensorType:
        require_float(expanded, "expanded")
        require_indices(expanded_row_idx, "expanded_row_idx")
        if expanded.rank != 2 or scales.rank != 2 or expanded_row_idx.rank != 1:
            raise ShapeError(f"moe_finalize_routing takes expanded [N*k, H], scales [N, k] and expanded_row_idx "
                             f"[N*k], got {expanded}, {scales} and {expanded_row_idx}")
        return TensorType((scales.shape[0], expanded.shape[1]), expanded.dtype)

    def compute(self, expanded: np.ndarray, scales: np.ndarray, expanded_row_idx: np.ndarray) -> np.ndarray:
        n, k = scales.shape
        rows = work(expanded)[expanded_row_idx].reshape(n, k, -1)
        return np.sum(rows * work(scales)[:, :, None], axis=1)
