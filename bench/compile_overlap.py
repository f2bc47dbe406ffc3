"""Compile while running, on one modelled timeline: both regimes side by side.

    python bench/compile_overlap.py [--parts 8] [--big-layers 4] [--big-seq 4096]

GE's compile of each part is measured in host time; each part's run is its simulated timeline (the
Runtime's submissions, the copies, the kernels); geir.session.pipelined places compile-then-run and
compile-while-running from the same measurements. Two models:

- small: the tour's kind of model (examples/make_model.py, 16 layers, hidden 256, S 128), run in
  full. Microseconds of device work per part against milliseconds of GE: GE-bound, little to hide.
- big: a LLaMA-7B-shaped stack (hidden 4096, 32 heads, MLP 11008, f16, S 4096, attention as
  torch.export emits SDPA), --big-layers layers, in timing-only mode (no weights, no arithmetic):
  milliseconds of device work per layer, behind which GE's compile of the next part hides.

Prints, per model, compile-then-run against overlapped: time to first kernel and end to end, the
compile hidden, and the ratios.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from geir.parser import parse
from geir.runtime.device import stand_in
from geir.session.pipelined import run_pipelined

MAKE_MODEL = Path(__file__).resolve().parent.parent / "examples" / "make_model.py"


def _model(tmp: str, name: str, options: list[str]):
    path = Path(tmp) / f"{name}.geir"
    subprocess.run([sys.executable, str(MAKE_MODEL), *options, "-o", str(path)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    module = parse(path.read_text(), str(path))
    weights = dict(np.load(path.with_suffix(".npz"))) if path.with_suffix(".npz").exists() else {}
    return module, weights


def _report(title: str, run) -> None:
    s = run.summary()
    ovl, seq = run.schedule(True), run.schedule(False)
    print(f"{title}: {s['parts']} parts; GE {s['compile_us'] / 1e3:.1f} ms of host time, device "
          f"{s['device_us'] / 1e3:.2f} ms ({s['kernel_time_us'] / 1e3:.2f} ms of kernels)")
    print(f"  {'':26}{'compile-then-run':>18}{'overlapped':>14}{'ratio':>8}")
    for label, a, b in (("time to first kernel us", seq.time_to_first_kernel_us, ovl.time_to_first_kernel_us),
                        ("end to end us", seq.end_to_end_us, ovl.end_to_end_us),
                        ("compile hidden us", seq.compile_hidden_us, ovl.compile_hidden_us)):
        ratio = f"{a / b:8.2f}" if b else f"{'-':>8}"
        print(f"  {label:26}{a:>18.1f}{b:>14.1f}{ratio}")
    print(f"  share of GE's compile hidden: {ovl.compile_hidden_us / s['compile_us']:.0%}; {run.verdict()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--big-layers", type=int, default=4)
    ap.add_argument("--big-seq", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small, weights = _model(tmp, "small", ["--layers", "16", "--seq", "128", "--hidden", "256", "--heads", "4"])
        big, _ = _model(tmp, "big", ["--layers", str(args.big_layers), "--seq", str(args.big_seq), "--hidden", "4096",
                                     "--heads", "32", "--mlp", "11008", "--attention", "sdpa", "--no-weights"])
    rng = np.random.default_rng(0)
    inputs = {a.name: rng.standard_normal(a.type.shape, dtype=np.float32).astype(a.type.dtype.np)
              for a in small.graphs[0].args}
    _report("small (16 layers, hidden 256, S 128, full run)", run_pipelined(small, inputs, weights, parts=args.parts))
    shapes = {a.name: stand_in(a.type) for a in big.graphs[0].args}
    _report(f"big (LLaMA-7B-shaped, {args.big_layers} layers, S {args.big_seq}, timing only)",
            run_pipelined(big, shapes, {}, parts=min(args.parts, args.big_layers), timing_only=True))


if __name__ == "__main__":
    main()
