"""Decode attention, fused against unfused: kernel (device) time of one query row against a long KV.

    python bench/decode_attention.py [--target ascend910b] [--skv 512 2048 8192]

The shapes of the second round's decode figure (GEIR spec section 7): B 1, N 32 query heads over
Nkv 8 key/value heads, D 128, f16, Sq 1. "fused" is one `ge.flash_attention` (the tiling the
kernel chooses: flash-decoding's split-KV path where the query rows are too few to fill the
cores); "unfused" is the same op expanded into primitive ops exactly as the fusion guard expands
it (`decompose_flash_attention`: K/V heads repeated for their groups, matmul, scale, softmax in
f32, matmul). A ratio unfused / fused above 1 means the fused kernel wins. "grouped" is a stricter
unfused baseline that GE does not build: the query heads of each K/V head reshaped into rows of one
matmul, so K and V are not repeated.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from geir.kernels.flash_attention_tiling import choose_flash_tiling
from geir.parser import parse
from geir.passes.fusion.guards import decompose_flash_attention, flash_attention_guard
from geir.passes.pattern import Rewriter
from geir.runtime.profile import profile
from geir.session import NO_FUSE_PIPELINE, compile_module, run_program
from geir.target_npu.target import DEFAULT_TARGET, load_target
from geir.types import DType, TensorType

B, N, NKV, SQ, D = 1, 32, 8, 1, 128
SKV = (512, 1024, 2048, 4096, 8192)


def fused_text(b: int, n: int, nkv: int, sq: int, skv: int, d: int = D, dtype: str = "f16") -> str:
    """One ge.flash_attention with grouped K/V heads."""
    tq, tk = f"tensor<{b}x{n}x{sq}x{d}x{dtype}>", f"tensor<{b}x{nkv}x{skv}x{d}x{dtype}>"
    return (f"ge.graph @main(%q: {tq}, %k: {tk}, %v: {tk}) -> {tq} {{\n"
            f"  %o = ge.flash_attention %q, %k, %v\n  ge.return %o\n}}\n")


def grouped_text(b: int, n: int, nkv: int, sq: int, skv: int, d: int = D, dtype: str = "f16") -> str:
    """Unfused attention with each K/V head's query heads as rows of one matmul (no K/V repeat)."""
    tq, tk = f"tensor<{b}x{n}x{sq}x{d}x{dtype}>", f"tensor<{b}x{nkv}x{skv}x{d}x{dtype}>"
    rows = n // nkv * sq
    return (f"ge.graph @main(%q: {tq}, %k: {tk}, %v: {tk}) -> {tq} {{\n"
            f"  %g = ge.reshape %q {{shape = [{b}, {nkv}, {rows}, {d}]}}\n"
            f"  %s = ge.matmul %g, %k {{transpose_b = true}}\n  %f = ge.cast %s {{to = f32}}\n"
            f"  %c = ge.const dense<{1 / d ** 0.5!r}> : tensor<f32>\n  %t = ge.mul %f, %c\n"
            f"  %p = ge.softmax %t {{axis = -1}}\n  %h = ge.cast %p {{to = {dtype}}}\n  %o = ge.matmul %h, %v\n"
            f"  %r = ge.reshape %o {{shape = [{b}, {n}, {sq}, {d}]}}\n  ge.return %r\n}}\n")


def kernel_us(text: str, target: str, unfuse: bool) -> float:
    """Summed kernel time of one run of the graph, fused as written or expanded as the guard expands it."""
    module = parse(text, "<decode>")
    if unfuse:
        graph = module.graphs[0]
        rw = Rewriter(graph)
        for op in [op for op in graph.ops if op.name == "ge.flash_attention"]:
            decompose_flash_attention(op, rw)
    program = compile_module(module, NO_FUSE_PIPELINE, target)[0].graphs[0]
    rng = np.random.default_rng(0)
    inputs = {a.name: rng.standard_normal(a.type.shape, dtype=np.float32).astype(np.float16) for a in program.args}
    return sum(k["time_us"] for k in profile(run_program(program, inputs, target=target))["kernels"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--skv", type=int, nargs="+", default=list(SKV))
    args = ap.parse_args(argv)
    chip = load_target(args.target)
    print(f"target {chip.name}: {chip.cube_cores} cube cores; B {B}, N {N}, Nkv {NKV}, Sq {SQ}, D {D}, f16")
    print(f"{'Skv':>6} {'splits':>6} {'units':>5} {'unfused us':>11} {'fused us':>9} {'ratio':>6} "
          f"{'grouped us':>11} {'ratio':>6}  guard")
    for skv in args.skv:
        text = fused_text(B, N, NKV, SQ, skv)
        fused, unfused = kernel_us(text, args.target, False), kernel_us(text, args.target, True)
        grouped = kernel_us(grouped_text(B, N, NKV, SQ, skv), args.target, False)
        q, k = TensorType((B, N, SQ, D), DType.f16), TensorType((B, NKV, skv, D), DType.f16)
        tiling = choose_flash_tiling(q, k, k, False, False, chip)
        why = flash_attention_guard(q, k, k, None, False, "BNSD", chip)
        print(f"{skv:>6} {tiling.kv_splits:>6} {tiling.work_units:>5} {unfused:>11.2f} {fused:>9.2f} "
              f"{unfused / fused:>6.2f} {grouped:>11.2f} {grouped / fused:>6.2f}  {'fuse' if why is None else 'unfuse'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
