"""The MatMul kernel's schedule on its own: each shape timed standalone (an idle chip, operands in HBM) with the
rules' TCubeTiling, its bound, and for the decode GEMV-like shapes the fraction of the chip's HBM bandwidth
they reach.

    python bench/matmul.py [--target ascend910b] [--markdown]

Shapes: pto-isa's gemm_performance GEMMs (m = k = n), a LLaMA-7B-shaped layer's projections in prefill (S 4096)
and in decode (one token: M = 1, where the kernel only streams the weight B from HBM), and an LM head.
The fraction of HBM bandwidth is the bytes read past the L2 over the kernel's time, over the chip's HBM
bandwidth (target data file: [memory] hbm_tb_per_s); the cube fraction is the cube's FLOP/s over its peak.
"""

from __future__ import annotations

import argparse

from geir.kernels import KERNELS
from geir.kernels.tiling import OpSignature
from geir.runtime.profile import cube_peak_flops
from geir.runtime.single_launch import time_launch
from geir.target_npu.target import load_target
from geir.types import DType, TensorType

F16 = DType("f16")
SHAPES = [  # (what, M, K, N)
    ("gemm_performance 1536^3", 1536, 1536, 1536),
    ("gemm_performance 3072^3", 3072, 3072, 3072),
    ("gemm_performance 6144^3", 6144, 6144, 6144),
    ("gemm_performance 7680^3", 7680, 7680, 7680),
    ("prefill q/k/v/o 4096", 4096, 4096, 4096),
    ("prefill gate/up 4096", 4096, 4096, 11008),
    ("prefill down 4096", 4096, 11008, 4096),
    ("decode q/k/v/o", 1, 4096, 4096),
    ("decode gate/up", 1, 4096, 11008),
    ("decode down", 1, 11008, 4096),
    ("decode LM head", 1, 4096, 32000),
]


def row(what: str, M: int, K: int, N: int, target) -> dict:
    """One shape timed standalone with the rules' tiling."""
    sig = OpSignature("ge.matmul", (TensorType((M, K), F16), TensorType((K, N), F16)), (TensorType((M, N), F16),), {})
    tiling = KERNELS["ge.matmul"].choose(sig, target)
    stats = time_launch(sig, tiling, target)
    us = stats.cycles / (target.clock_hz / 1e6)
    ratios = {p: b / stats.cores / stats.cycles for p, b in stats.busy.items() if b}
    bound = max(ratios, key=ratios.get)
    hbm_bw = target.memory.hbm_bytes_per_s
    return {"shape": what, "mkn": f"{M} x {K} x {N}", "us": us,
            "cube": 2 * M * N * K / (us * 1e-6) / cube_peak_flops(target),
            "bound": f"{bound} {ratios[bound]:.0%}",
            "hbm": stats.hbm_read_bytes / (us * 1e-6) / hbm_bw,
            "tiling": (f"{tiling.single_core_m}x{tiling.single_core_n} per core, base {tiling.base_m}x{tiling.base_n}"
                       f"x{tiling.base_k}, step_k {tiling.step_ka}, {'N' if tiling.iterate_order else 'M'} first")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="ascend910b")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    target = load_target(args.target)
    rows = [row(*shape, target) for shape in SHAPES]
    head = ("shape", "M x K x N", "time (us)", "cube peak", "busiest pipe", "HBM bandwidth", "tiling")
    cells = [(r["shape"], r["mkn"], f"{r['us']:.1f}", f"{r['cube']:.1%}", r["bound"], f"{r['hbm']:.1%}", r["tiling"])
             for r in rows]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for c in cells:
            print("| " + " | ".join(c) + " |")
        return 0
    widths = [max(len(x[i]) for x in cells + [head]) for i in range(len(head))]
    for c in [head] + cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
