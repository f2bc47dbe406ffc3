"""Where fused FlashAttention stops paying off: unfused / fused device time across attention shapes.

    python bench/fusion_crossover.py [--target ascend910b]

Runs attention (f16, D=128) as one `ge.flash_attention` (the fused kernel, whatever the guard
says) and written out op by op without fusion (matmul, scale, softmax, matmul), for
prefill shapes (Sq = Skv) and decode shapes (few query rows against many keys), and prints the
ratio beside the decision of the target's guard (`[fusion]` in its TOML file). A ratio below 1
means the fused kernel lost; the guard should say "unfuse" there. This is the measurement the
`flash_attention_decode_*` thresholds of each target cite.
"""

from __future__ import annotations

import argparse
import math
import sys

from geir.passes.fusion.guards import decompose_flash_attention, flash_attention_guard
from geir.passes.pattern import Rewriter
from geir.printer import print_module
from geir.kernels.flash_attention_tiling import choose_flash_tiling
from geir.parser import parse
from geir.runtime.profile import profile
from geir.session import NO_FUSE_PIPELINE, compile_module, run_program
from geir.target_npu.target import DEFAULT_TARGET, load_target
from geir.types import DType, TensorType

SHAPES = [  # (B, N, Nkv, Sq, Skv)
    (1, 8, 8, 128, 128), (1, 8, 8, 1024, 1024), (1, 8, 8, 1, 1), (1, 8, 8, 1, 128), (1, 8, 8, 1, 512),
    (1, 8, 8, 1, 2048), (1, 8, 8, 1, 8192), (1, 1, 1, 1, 8192), (1, 8, 8, 16, 8192), (1, 8, 8, 64, 8192),
    (1, 8, 8, 128, 8192), (1, 24, 24, 1, 8192), (1, 32, 32, 1, 8192), (4, 8, 8, 1, 8192),
    (1, 1, 1, 1, 512), (1, 2, 2, 1, 512), (1, 4, 4, 1, 1024),
    # grouped-query decode (the second round's decode figure, GEIR spec section 7)
    (1, 32, 8, 1, 512), (1, 32, 8, 1, 2048), (1, 32, 8, 1, 8192),
]
D = 128


def attention_text(b: int, n: int, sq: int, skv: int, fused: bool, d: int = D, dtype: str = "f16",
                   nkv: int | None = None) -> str:
    """The attention written out op by op, or (fused) as one ge.flash_attention, which no guard re-checks.

    With grouped K/V heads (nkv < n) the unfused graph is the fused op expanded as the guard expands it
    (K and V repeated for their groups).
    """
    nkv = n if nkv is None else nkv
    tq, tk = f"tensor<{b}x{n}x{sq}x{d}x{dtype}>", f"tensor<{b}x{nkv}x{skv}x{d}x{dtype}>"
    if fused or nkv != n:
        text = (f"ge.graph @main(%q: {tq}, %k: {tk}, %v: {tk}) -> {tq} {{\n"
                f"  %o = ge.flash_attention %q, %k, %v\n  ge.return %o\n}}\n")
        return text if fused else print_module(_expanded(parse(text, "<crossover>")))
    return (f"ge.graph @main(%q: {tq}, %k: {tk}, %v: {tk}) -> {tq} {{\n"
            f"  %s = ge.matmul %q, %k {{transpose_b = true}}\n"
            f"  %c = ge.const dense<{1 / math.sqrt(d)!r}> : tensor<{dtype}>\n"
            f"  %ss = ge.mul %s, %c\n  %p = ge.softmax %ss {{axis = -1}}\n  %o = ge.matmul %p, %v\n"
            f"  ge.return %o\n}}\n")


def _expanded(module):
    """The module with each ge.flash_attention expanded into primitive ops (the guard's expansion)."""
    graph = module.graphs[0]
    rw = Rewriter(graph)
    for op in [op for op in graph.ops if op.name == "ge.flash_attention"]:
        decompose_flash_attention(op, rw)
    return module


def device_us(text: str, pipeline: str, target: str) -> float:
    """Summed kernel time of one run (host copies, the same in both, left out), timed by the cost models alone: the
    schedule does not depend on the values, so every simulated figure is the full run's (spec section 6)."""
    program = compile_module(parse(text, "<crossover>"), pipeline, target)[0].graphs[0]
    return sum(k["time_us"] for k in profile(run_program(program, {}, target=target, timing_only=True))["kernels"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    args = ap.parse_args(argv)
    chip = load_target(args.target)
    g = chip.fusion
    print(f"target {chip.name}: {chip.cube_cores} cube cores; guard: unfuse decode calls of Sq <= {g.decode_max_q} "
          f"with Skv >= {g.decode_min_kv} whose work units fill at most {g.decode_max_busy:.0%} of the cube cores")
    print(f"{'B':>2} {'N':>3} {'Nkv':>3} {'Sq':>5} {'Skv':>6} {'units':>5} {'unfused us':>11} {'fused us':>9} "
          f"{'ratio':>6}  guard")
    agree = 0
    for b, n, nkv, sq, skv in SHAPES:
        fused = device_us(attention_text(b, n, sq, skv, True, nkv=nkv), NO_FUSE_PIPELINE, args.target)
        unfused = device_us(attention_text(b, n, sq, skv, False, nkv=nkv), NO_FUSE_PIPELINE, args.target)
        q, k = TensorType((b, n, sq, D), DType.f16), TensorType((b, nkv, skv, D), DType.f16)
        units = choose_flash_tiling(q, k, k, False, False, chip).work_units
        why = flash_attention_guard(q, k, k, None, False, "BNSD", chip)
        ratio = unfused / fused
        agree += (why is None) == (ratio >= 1)
        print(f"{b:>2} {n:>3} {nkv:>3} {sq:>5} {skv:>6} {units:>5} {unfused:>11.2f} {fused:>9.2f} {ratio:>6.2f}  "
              f"{'fuse' if why is None else 'unfuse'}")
    print(f"the guard agrees with the measurement on {agree} of {len(SHAPES)} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
