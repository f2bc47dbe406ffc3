"""Long fuzz campaigns of the tools: runs, failures and the distinct reproducers.

    python bench/fuzz.py [--seed 0] [--geopt 10000] [--gerun 500] [--geimport 500] [--gedoctor 0] [--getune 0]
                         [--geserve 0] [--out DIR]

Mutates the example and lit programs, rt.programs lowered from them, small ONNX models and geserve's request
traces and model configs with
geir.tools.fuzz (its docstring lists the mutation classes: target files and what-if chips at the edges,
damaged tuning repositories and poisoned entries, huge tensors, deep chains among them) and runs each tool in-process on every
case (gedoctor on programs and models alike). A failure is an exit code
other than 0/1/2, a traceback, an internal error, or a diagnostic outside the input. Failures are grouped by kind; with --out, one
reproducer file per kind is written there.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

from geir.tools.fuzz import campaign, signature


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--geopt", type=int, default=10000)
    ap.add_argument("--gerun", type=int, default=500)
    ap.add_argument("--geimport", type=int, default=500)
    ap.add_argument("--gedoctor", type=int, default=0)
    ap.add_argument("--getune", type=int, default=0)
    ap.add_argument("--geserve", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write one reproducer per distinct failure here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    outcomes = campaign(args.seed, {"geopt": args.geopt, "gerun": args.gerun, "geimport": args.geimport,
                                    "gedoctor": args.gedoctor, "getune": args.getune,
                                    "geserve": args.geserve})
    seconds = time.perf_counter() - t0
    failures = [o for o in outcomes if o.problem]
    kinds: dict[str, list] = collections.defaultdict(list)
    for o in failures:
        kinds[signature(o)].append(o)
    print(f"{len(outcomes)} runs in {seconds:.0f} s (seed {args.seed}): {len(failures)} failures, "
          f"{len(kinds)} distinct; {sum(o.slow for o in outcomes)} gerun/gedoctor/getune/geserve runs dropped as slow")
    for tool in ("geopt", "gerun", "geimport", "gedoctor", "getune", "geserve"):
        runs = [o for o in outcomes if o.case.tool == tool]
        if not runs:
            continue
        codes = collections.Counter(o.code for o in runs if not o.problem and not o.slow)
        print(f"  {tool:<9} {len(runs):>6} runs, {sum(1 for o in runs if o.problem):>4} failures, exit codes "
              + ", ".join(f"{c}: {n}" for c, n in sorted(codes.items())))
    for kind, group in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(group):>5} x {kind}")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            first = group[0].case
            folder = args.out / f"{first.tool}-{len(list(args.out.iterdir())):03d}"
            folder.mkdir()
            (folder / first.name).write_bytes(first.data)
            for name, data in first.files:  # the files the case had beside its input ({dir} in its arguments)
                (folder / name).write_bytes(data)
            argv = " ".join(a.replace("{dir}", str(folder)) for a in first.args)
            print(f"          reproducer: {first.tool} {folder / first.name} {argv}")


if __name__ == "__main__":
    main()
