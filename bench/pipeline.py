"""The full GE pipeline on a 32-layer transformer, and how its time scales on 4x and 16x larger graphs.

    python bench/pipeline.py [--layers 32] [--repeat 3]

Generates the models with examples/make_model.py, then times parse and each pass of
infer-shapes, const-fold, canonicalize, fuse, layout, tile, plan (best of --repeat runs).
Goal: the pipeline on 32 layers under 1 s, and time per op roughly flat as the graph grows
(no pattern matching that is quadratic in graph size).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from geir.diagnostics import DiagnosticEngine
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline

PIPELINE = "infer-shapes,const-fold,canonicalize,fuse,layout,tile,plan"
MAKE_MODEL = Path(__file__).resolve().parent.parent / "examples" / "make_model.py"


def generate(layers: int, out: Path) -> str:
    # the pipeline never reads the weights: --no-weights spares writing gigabytes of npz for 512 layers
    subprocess.run([sys.executable, str(MAKE_MODEL), "--layers", str(layers), "--no-weights", "-o", str(out)], check=True)
    return out.read_text()


def run_once(text: str) -> tuple[float, dict[str, float], int, int]:
    """(parse seconds, seconds per pass, ops before, ops after) for one run of the pipeline."""
    t0 = time.perf_counter()
    module = parse(text)
    t_parse = time.perf_counter() - t0
    ops_before = sum(len(g.ops) for g in module.graphs)
    errors: list = []
    pm = PassManager(complete_pipeline(parse_pipeline(PIPELINE)), verify_each=False)
    ok = pm.run(module, PassContext(diagnostics=DiagnosticEngine(errors.append)))
    if not ok:
        raise SystemExit(f"pipeline failed: {[d.message for d in errors]}")
    return t_parse, dict(pm.timings), ops_before, sum(len(g.ops) for g in module.graphs)


def best(text: str, repeat: int) -> tuple[float, dict[str, float], int, int]:
    runs = [run_once(text) for _ in range(repeat)]
    return min(runs, key=lambda r: sum(r[1].values()))


def replan_cost(layers: int, tmp: Path, repeat: int) -> None:
    """A dynamic-length model: full compile (parse, every pass, the first specialisation) vs a re-plan."""
    from geir.session import Session

    path = tmp / f"dyn{layers}.geir"
    subprocess.run([sys.executable, str(MAKE_MODEL), "--layers", str(layers), "--dynamic-seq", "--no-weights",
                    "-o", str(path)], check=True)
    text = path.read_text()

    def shapes(session: Session, s: int) -> dict[str, tuple[int, ...]]:
        return {a.name: tuple(s if d is None else d for d in a.type.shape) for a in session.generic.args}

    fulls, replans = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        session = Session(parse(text))
        session.program(shapes(session, 128))
        fulls.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        session.program(shapes(session, 512))
        replans.append(time.perf_counter() - t0)
    full, replan = min(fulls), min(replans)
    print(f"\nRe-plan of a {layers}-layer model with a dynamic sequence length (plan cache miss)")
    print(f"  full compile (parse, passes, first specialisation) {full * 1e3:8.1f} ms")
    print(f"  re-plan for a new length                           {replan * 1e3:8.1f} ms   "
          f"{replan / full:5.0%} of a full compile   goal: <= 20 %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sizes = [args.layers, 4 * args.layers, 16 * args.layers]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in sizes:
            text = generate(layers, Path(tmp) / f"model{layers}.geir")
            rows.append((layers, *best(text, args.repeat if layers == args.layers else 1)))

    layers, t_parse, timings, ops, ops_after = rows[0]
    print(f"Pipeline {PIPELINE} on a {layers}-layer model ({ops} ops in, {ops_after} out), best of {args.repeat}")
    for name, t in timings.items():
        print(f"  {name:<14} {t * 1e3:8.1f} ms")
    total = sum(timings.values())
    print(f"  {'total':<14} {total * 1e3:8.1f} ms   (parse {t_parse * 1e3:.1f} ms besides)   goal: under 1000 ms")

    print("\nScaling (time per op should stay flat)")
    print(f"  {'layers':>7} {'ops':>8} {'pipeline s':>11} {'us/op':>8} {'vs first':>9}")
    base = None
    for layers, t_parse, timings, ops, _ in rows:
        total = sum(timings.values())
        per_op = total / ops * 1e6
        base = base or per_op
        print(f"  {layers:>7} {ops:>8} {total:11.3f} {per_op:8.1f} {per_op / base:8.2f}x")
    with tempfile.TemporaryDirectory() as tmp:
        replan_cost(args.layers, Path(tmp), args.repeat)


if __name__ == "__main__":
    main()
