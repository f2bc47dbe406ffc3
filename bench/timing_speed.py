"""Host time of timing-only runs: the kernels' timing models against the reference schedule, side by side.

    python bench/timing_speed.py [--seq 4096] [--kv 4096] [--repeat 5] [--reference-repeat 1] [--block] [--gpt2]

Builds one LLaMA-7B-shaped layer (hidden 4096, 32 heads of 128, MLP 11008, f16) as a prefill over
--seq tokens (QKV matmul with bias, causal FlashAttention, output matmul, MLP up with a GELU
epilogue, MLP down) and as one decode step (one query row, M = 1 matmuls, --kv keys), compiles each
with the default pipeline for the 910B, and runs it timing-only (`Runtime(timing_only=True)`): once
with the kernels' timing as it is, once with the reference schedule kept as the test oracle
(`test/helpers/reference_timing.py`: the code that issued one instruction and one GM move at a
time, and listed the vector kernels' GM pieces as three rectangles). Prints each kernel's host
seconds, both totals and their ratio, and checks that both runs timed everything identically (every
task, every kernel's statistics, the GM counters). `--block` also runs the whole GPT-2-style block at
--seq (layer norms, residual adds, the QKV split and head transposes around the same matmuls and
attention, as `fuse` leaves make_model's block); `--gpt2` runs examples/make_model.py's own block
(--seq 1024 at most: its causal mask is a literal that takes long to parse beyond that).

Every launch is timed here (`memo=False`): this measures the kernels' timing models. A whole model's
timing-only run also replays a launch identical to one it timed (`geir.runtime.launch_memo`), so its
repeated layers cost little more than one; `gerun --timing-only` says how many it replayed.

Goal (issue 13): the S 4096 layer in at most about 0.25 s of host time, so that 32 layers fit in
10 s with the rest of the pipeline; the decode step a small fraction of that.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "test"))  # the reference schedule lives with the tests that use it as oracle

from helpers import reference_timing as ref  # noqa: E402

from geir.kernels import KERNELS, data_movement, flash_attention, matmul, vector  # noqa: E402
from geir.parser import parse  # noqa: E402
from geir.runtime.interpreter import Runtime  # noqa: E402
from geir.session import DEFAULT_PIPELINE, compile_module  # noqa: E402
from geir.target_npu import load_target  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, MLP = 4096, 32, 128, 11008


def layer_text(seq: int, kv: int) -> str:
    """One layer's four matmuls and its attention over `seq` query rows and `kv` keys (causal when they match)."""
    H, F, N, D, dt = HIDDEN, MLP, HEADS, HEAD_DIM, "f16"
    causal = "{causal = true}" if seq == kv else ""
    return f"""ge.graph @main(%x: tensor<{seq}x{H}x{dt}>, %wqkv: tensor<{H}x{3 * H}x{dt}>, %bqkv: tensor<{3 * H}x{dt}>,
    %q: tensor<1x{N}x{seq}x{D}x{dt}>, %k: tensor<1x{N}x{kv}x{D}x{dt}>, %v: tensor<1x{N}x{kv}x{D}x{dt}>,
    %a: tensor<{seq}x{H}x{dt}>, %wo: tensor<{H}x{H}x{dt}>, %w1: tensor<{H}x{F}x{dt}>, %b1: tensor<{F}x{dt}>,
    %w2: tensor<{F}x{H}x{dt}>) -> (tensor<{seq}x{3 * H}x{dt}>, tensor<1x{N}x{seq}x{D}x{dt}>, tensor<{seq}x{H}x{dt}>,
    tensor<{seq}x{H}x{dt}>) {{
  %qkv0 = ge.matmul %x, %wqkv
  %qkv = ge.add %qkv0, %bqkv
  %o = ge.flash_attention %q, %k, %v {causal}
  %ao = ge.matmul %a, %wo
  %u0 = ge.matmul %ao, %w1
  %u1 = ge.add %u0, %b1
  %u = ge.gelu %u1
  %d = ge.matmul %u, %w2
  ge.return %qkv, %o, %ao, %d
}}
"""


def block_text(seq: int) -> str:
    """A whole GPT-2-style block over `seq` tokens, in the fused form GE's `fuse` gives make_model's block."""
    H, F, N, D, dt = HIDDEN, MLP, HEADS, HEAD_DIM, "f16"
    heads = ", ".join(str(x) for x in (1, seq, N, D))
    return f"""ge.graph @main(%x: tensor<1x{seq}x{H}x{dt}>, %g1: tensor<{H}x{dt}>, %b1: tensor<{H}x{dt}>,
    %wqkv: tensor<{H}x{3 * H}x{dt}>, %bqkv: tensor<{3 * H}x{dt}>, %wo: tensor<{H}x{H}x{dt}>, %bo: tensor<{H}x{dt}>,
    %g2: tensor<{H}x{dt}>, %b2: tensor<{H}x{dt}>, %w1: tensor<{H}x{F}x{dt}>, %bf: tensor<{F}x{dt}>,
    %w2: tensor<{F}x{H}x{dt}>, %bd: tensor<{H}x{dt}>) -> tensor<1x{seq}x{H}x{dt}> {{
  %ln1 = ge.layer_norm %x, %g1, %b1 {{axis = -1, epsilon = 1.0e-05}}
  %qkv0 = ge.matmul %ln1, %wqkv
  %qkv = ge.add %qkv0, %bqkv
  %q2, %k2, %v2 = ge.split %qkv {{axis = -1, sizes = [{H}, {H}, {H}]}}
  %q3 = ge.reshape %q2 {{shape = [{heads}]}}
  %q = ge.transpose %q3 {{perm = [0, 2, 1, 3]}}
  %k3 = ge.reshape %k2 {{shape = [{heads}]}}
  %k = ge.transpose %k3 {{perm = [0, 2, 1, 3]}}
  %v3 = ge.reshape %v2 {{shape = [{heads}]}}
  %v = ge.transpose %v3 {{perm = [0, 2, 1, 3]}}
  %o = ge.flash_attention %q, %k, %v {{causal = true}}
  %ot = ge.transpose %o {{perm = [0, 2, 1, 3]}}
  %o2 = ge.reshape %ot {{shape = [1, {seq}, {H}]}}
  %a0 = ge.matmul %o2, %wo
  %a = ge.add %a0, %bo
  %h = ge.add %x, %a
  %ln2 = ge.layer_norm %h, %g2, %b2 {{axis = -1, epsilon = 1.0e-05}}
  %u0 = ge.matmul %ln2, %w1
  %u1 = ge.add %u0, %bf
  %u = ge.gelu %u1 {{approximate = "tanh"}}
  %d0 = ge.matmul %u, %w2
  %d = ge.add %d0, %bd
  %y = ge.add %h, %d
  ge.return %y
}}
"""


@contextlib.contextmanager
def reference_schedule():
    """Time every launch with the reference code instead of the kernels' own (matmul and FlashAttention
    timing, the vector and copy kernels' GM pieces)."""
    def matmul_forward(a, b, bias, transpose_a, transpose_b, out_dt, tiling, ctx, epilogue=None, activation="none"):
        assert not ctx.compute, "the reference schedule times; it does not compute"
        ref.matmul_timing(a, b, bias, transpose_a, transpose_b, out_dt, tiling, ctx, activation)
        A = np.swapaxes(a, -1, -2) if transpose_a else a
        B = np.swapaxes(b, -1, -2) if transpose_b else b
        batch = np.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        return np.empty(batch + (A.shape[-2], B.shape[-1]), dtype=out_dt)

    patches = [(matmul, "matmul_forward", matmul_forward), (flash_attention, "_time_tiles", ref.flash_timing)]
    # the vector and copy kernels' GM pieces, listed as three rectangles one after another
    patches += [(module, name, getattr(ref, name)) for module in (data_movement, vector, matmul)
                for name in ("flat_pieces", "share_pieces") if hasattr(module, name)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def kernel_clock(seconds: dict[str, float]):
    """Add each launch's host seconds to `seconds[op name]`."""
    saved = {}
    for cls in {type(k) for k in KERNELS.values()}:
        saved[cls] = cls.run

        def run(self, op, inputs, tiling, ctx, _run=cls.run):
            t0 = time.perf_counter()
            try:
                return _run(self, op, inputs, tiling, ctx)
            finally:
                seconds[op.name] += time.perf_counter() - t0
        cls.run = run
    try:
        yield
    finally:
        for cls, run in saved.items():
            cls.run = run


def figures(result) -> tuple:
    """What a timing-only run produced, for comparing two runs exactly."""
    tasks = [(t.kind, t.name, t.stream, t.start_us, t.end_us) for t in result.tasks]
    kernels = [(k.name, k.start, k.end, k.cores, sorted(k.busy.items()), k.gm_read_bytes, k.gm_write_bytes,
                k.hbm_read_bytes, k.hbm_write_bytes) for k in result.kernels]
    gm = result.gm
    return (tasks, kernels, result.cores.free.tolist(), result.cores.busy.tolist(), gm.clock,
            sorted((k, v.tolist()) for k, v in gm.last_touch.items()))


def timed(program, target, repeat: int) -> tuple[float, dict[str, float], tuple]:
    """Best of `repeat` timing-only runs: (host seconds, host seconds by kernel, the run's figures)."""
    best = None
    for _ in range(repeat):
        seconds: dict[str, float] = defaultdict(float)
        with kernel_clock(seconds):
            t0 = time.perf_counter()
            result = Runtime(target, timing_only=True, memo=False).run(program, {}, {})
            total = time.perf_counter() - t0
        if best is None or total < best[0]:
            best = (total, dict(seconds), figures(result))
    return best


def compare(name: str, program, target, repeat: int, reference_repeat: int) -> tuple[float, float]:
    new_s, new_k, new_f = timed(program, target, repeat)
    with reference_schedule():
        ref_s, ref_k, ref_f = timed(program, target, reference_repeat)
    same = "identical" if new_f == ref_f else "DIFFERENT"
    print(f"\n{name}: simulated {new_f[0][-1][4]:.1f} us; timing figures of the two runs: {same}")
    print(f"  {'kernel':<22}{'reference s':>13}{'now s':>10}{'ratio':>9}")
    for op in sorted(ref_k, key=ref_k.get, reverse=True):
        now = new_k.get(op, 0.0)
        print(f"  {op:<22}{ref_k[op]:>13.3f}{now:>10.3f}{ref_k[op] / max(now, 1e-9):>8.1f}x")
    print(f"  {'whole run':<22}{ref_s:>13.3f}{new_s:>10.3f}{ref_s / new_s:>8.1f}x")
    if new_f != ref_f:
        raise SystemExit(f"{name}: the timing models no longer produce the reference schedule")
    return ref_s, new_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096, help="prefill tokens (default 4096)")
    ap.add_argument("--kv", type=int, default=4096, help="keys a decode step attends to (default 4096)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of the kernels' timing, best taken (default 5)")
    ap.add_argument("--reference-repeat", type=int, default=1, help="runs of the reference (default 1)")
    ap.add_argument("--block", action="store_true", help="also the whole GPT-2-style block at --seq")
    ap.add_argument("--gpt2", action="store_true",
                    help="also examples/make_model.py's GPT-2 block (at most --seq 1024)")
    args = ap.parse_args()
    target = load_target("ascend910b")
    runs = [(f"prefill layer, S {args.seq}", layer_text(args.seq, args.seq)),
            (f"decode step, KV {args.kv}", layer_text(1, args.kv))]
    if args.block:
        runs.append((f"GPT-2-style block, S {args.seq}", block_text(args.seq)))
    if args.gpt2:
        seq = min(args.seq, 1024)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "block.geir"
            subprocess.run([sys.executable, str(ROOT / "examples" / "make_model.py"), "--no-weights", "--layers", "1",
                            "--hidden", str(HIDDEN), "--heads", str(HEADS), "--mlp", str(MLP), "--seq", str(seq),
                            "-o", str(out)], check=True)
            runs.append((f"GPT-2 block (make_model), S {seq}", out.read_text()))
    for name, text in runs:
        t0 = time.perf_counter()
        program = compile_module(parse(text), DEFAULT_PIPELINE, target.name)[0].graphs[0]
        print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s")
        compare(name, program, target, args.repeat, args.reference_repeat)


if __name__ == "__main__":
    main()
