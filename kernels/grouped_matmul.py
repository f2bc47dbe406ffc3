"""GroupedMatmul on the cube: ge.grouped_matmul, the experts of an MoE layer, as ops-transformer's GroupedMatmul
runs it: one launch whose cores walk the groups in turn, each group a matmul of its rows by its weight.

The group sizes are values computed on the device (the routing's tokens per expert), known only when the launch
runs: the tiling is chosen at compile time for the average group (the rows over the groups), a TCubeTiling as
kernels/matmul.py's, and the kernel reads the group list when it runs and issues each non-empty group's blocks
with that schedule, one group after the other on the same cores (the Runtime sizes the work when the sizes are
known). A timing-only launch has no values: it times the rows split evenly over the groups.

Numbers: each group's rows are exactly kernels/matmul.py's (f32 accumulation over base_k slices in order, one
rounding); rows after the last group are zero, as the op's semantics say. Each expert's weight and each group's
rows are tensors of their own in global memory (their own residency in L2: the rows start in HBM).

Not modelled yet: ops-transformer's GroupedMatmul deals the base blocks of all groups over the cores; here each
group is split over the cores as a matmul of its size alone, so small groups leave cores idle (pessimistic).
"""

from __future__ import annotations

import attrs
import numpy as np

from geir.ir import Operation
from geir.kernels import matmul_tiling as tiling_rules
from geir.kernels.base import Kernel, LaunchContext, register_kernel
from geir.kernels.data_movement import check_fault, result_dtype
from geir.kernels.matmul import matmul_forward
from geir.kernels.matmul_tiling import MatmulTiling
from geir.kernels.tiling import Budget, KernelTiling, Miss, OpSignature, cube_refuses
from geir.ops.moe import group_bounds
from geir.target_npu.target import Target
from geir.types import TensorType


def group_matmul_signature(sig: OpSignature) -> OpSignature:
    """The matmul one group is: the average group's rows [ceil(M / G), K] by one weight [K, N] (or [N, K])."""
    x, weight = sig.operands[:2]
    groups = weight.shape[0] or 1
    rows = -(-x.shape[0] // groups) if x.shape[0] else 1
    a = TensorType((max(rows, 1), x.shape[1]), x.dtype)
    b = TensorType(weight.shape[1:], weight.dtype)
    return OpSignature("ge.matmul", (a, b), sig.results, {"transpose_b": bool(sig.attr("transpose_b", False))})


def even_groups(rows: int, groups: int) -> np.ndarray:
    """Running ends of `rows` split as evenly as can be over `groups` (a timing-only launch's stand-in)."""
    return np.array([(rows * (g + 1)) // groups for g in range(groups)], dtype=np.int64)


@register_kernel
class GroupedMatmulKernel(Kernel):
    """x [M, K] by weight[g] for each group g of consecutive rows, the group sizes read when the launch runs."""

    OPS = ("ge.grouped_matmul",)
    TILING = MatmulTiling

    def refuses(self, sig: OpSignature, target: Target) -> str | None:
        return cube_refuses(sig.operands[:2], target)

    def choose(self, sig: OpSignature, target: Target, buffers: int = 2) -> MatmulTiling | Miss:
        return tiling_rules.choose(group_matmul_signature(sig), target, buffers)

    def budget(self, tiling: MatmulTiling, sig: OpSignature, target: Target) -> Budget:
        return tiling_rules.budget(tiling, group_matmul_signature(sig), target)

    def shrink(self, tiling: MatmulTiling) -> tuple[MatmulTiling, str] | None:
        return tiling_rules.shrink(tiling)

    def candidates(self, sig: OpSignature, target: Target, buffers: int = 2) -> list[MatmulTiling]:
        return tiling_rules.candidates(group_matmul_signature(sig), target, buffers)

    def check_instance(self, sig: OpSignature, tiling: KernelTiling) -> OpSignature:
        return sig

    def run(self, op: Operation, inputs: list[np.ndarray], tiling: MatmulTiling,
            ctx: LaunchContext) -> list[np.ndarray]:
        check_fault(ctx)
        x, weight, group_list = inputs
        transpose_b = bool(op.attr("transpose_b"))
        out_dt = result_dtype(op, 0, x.dtype)
        n = weight.shape[1] if transpose_b else weight.shape[2]
        out = np.zeros((x.shape[0], n), dtype=out_dt)
        list_type = op.attr("group_list_type")
        if not ctx.compute:  # no values in a timing-only launch: the rows split evenly
            group_list, list_type = even_groups(x.shape[0], weight.shape[0]), "cumsum"
        x_name, w_name = ctx.operand_names[:2]
        out_name = ctx.result_names[0]
        for g, (start, end) in enumerate(group_bounds(np.asarray(group_list), list_type, x.shape[0])):
            if end == start:
                continue  # an expert no token chose: no block issued
            # each expert's weight and each group's rows are tensors of their own in GM, with their own L2 residency
            # (the rows start in HBM: what the routing left in L2 is not credited)
            group_ctx = attrs.evolve(ctx, operand_names=[f"{x_name}[{start}:{end}]", f"{w_name}[{g}]"],
                                     result_names=[f"{out_name}[{start}:{end}]"])
            out[start:end] = matmul_forward(x[start:end], weight[g], None, False, transpose_b, out_dt, tiling,
                                            group_ctx)
        return [out]
