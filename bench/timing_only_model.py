"""Host wall time of timing-only runs of a whole LLaMA-7B-shaped model: prefill and one decode step,
with repeated launches replayed (the default) and with every launch timed, side by side.

    python bench/timing_only_model.py [--layers 32] [--seq 4096] [--kv 4096] [--skip-baseline]

Writes the model with examples/make_model.py (hidden 4096, 32 heads of 128, MLP 11008, f16,
SDPA attention as torch.export emits it, no weights), then times each phase of what
`gerun FILE --timing-only` does: the imports, parse and verify, GE's compile and specialisation,
and the Runtime's timing-only run. The baseline runs the same program with `Runtime(memo=False)`,
which times every launch; the two runs' figures must be identical (checked, printed).

Goal (issue 13, spec section 7): the 32-layer prefill at S 4096 in at most 10 s of host wall time,
one 32-layer decode step in at most 2 s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _make_model():
    spec = importlib.util.spec_from_file_location("make_model", ROOT / "examples" / "make_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_text(text: str) -> tuple[object, dict[str, float]]:
    """The lowered program gerun would run, and the seconds of parse (with verify) and compile."""
    from geir.parser import parse
    from geir.session import Session
    from geir.tools.gerun import shape_inputs
    from geir.verifier import verify_module

    t0 = time.perf_counter()
    module = parse(text, "model.geir")
    verify_module(module, lambda d: None)
    t1 = time.perf_counter()
    session = Session(module)
    inputs = shape_inputs(session.generic)
    program = session.program({k: v.shape for k, v in inputs.items()})
    return program, {"parse": t1 - t0, "compile": time.perf_counter() - t1}


def run(program, memo: bool) -> tuple[float, str, int]:
    """Seconds of the Runtime's timing-only run, its profile as JSON, and the launches it replayed."""
    from geir.runtime.interpreter import Runtime
    from geir.runtime.profile import profile
    from geir.target_npu import load_target

    t0 = time.perf_counter()
    result = Runtime(load_target("ascend910b"), timing_only=True, memo=memo).run(program, {}, {})
    return time.perf_counter() - t0, json.dumps(profile(result), sort_keys=True), result.replayed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--kv", type=int, default=4096)
    ap.add_argument("--skip-baseline", action="store_true", help="do not time every launch (the slow column)")
    args = ap.parse_args(argv)
    make_model = _make_model()
    shape = dict(layers=args.layers, hidden=4096, heads=32, mlp=11008, dtype="f16")
    models = {f"prefill S {args.seq}": make_model.model_text(seq=args.seq, sdpa=True, **shape),
              f"decode KV {args.kv}": make_model.model_text(seq=1, decode=args.kv, **shape)}
    t0 = time.perf_counter()
    import geir.tools.gerun  # noqa: F401  (what gerun imports before it reads a file)

    print(f"imports: {time.perf_counter() - t0:.2f} s (gerun pays them once per invocation)")
    for name, text in models.items():
        program, seconds = compile_text(text)
        fast, figures, replayed = run(program, memo=True)
        print(f"\n{args.layers}-layer {name}: parse {seconds['parse']:.2f} s, compile {seconds['compile']:.2f} s "
              f"(both once; the same program is run both ways)")
        line = f"  run: {fast:.2f} s with {replayed} launches replayed"
        if not args.skip_baseline:
            slow, slow_figures, _ = run(program, memo=False)
            line += (f", {slow:.2f} s timing every launch ({slow / fast:.1f}x); the two runs' profiles: "
                     f"{'identical' if slow_figures == figures else 'DIFFERENT'}")
        print(line)
        print(f"  parse + compile + run: {seconds['parse'] + seconds['compile'] + fast:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
