"""Parse, verify and print throughput of GEIR on a long op chain, side by side with xdsl-opt.

    python bench/parse_throughput.py [--ops 20000] [--repeat 3] [--sizes 5000,10000,20000,40000]

Prints ops/s for parse, verify and print in-process, for `geopt` end to end (a subprocess,
interpreter start-up included), and for `xdsl-opt` on the equivalent `arith.addf` chain when
xdsl is installed (extra `bench`). Also checks that geopt's time grows linearly with size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from geir.parser import parse
from geir.printer import print_module
from geir.verifier import verify_module


def geir_chain(n: int) -> str:
    lines = ["ge.graph @main(%a: tensor<f32>) -> tensor<f32> {", "  %v0 = ge.add %a, %a : tensor<f32>"]
    lines += [f"  %v{i} = ge.add %v{i - 1}, %a : tensor<f32>" for i in range(1, n)]
    lines += [f"  ge.return %v{n - 1}", "}"]
    return "\n".join(lines) + "\n"


def mlir_chain(n: int) -> str:
    lines = ["func.func @main(%a: f32) -> f32 {", "  %v0 = arith.addf %a, %a : f32"]
    lines += [f"  %v{i} = arith.addf %v{i - 1}, %a : f32" for i in range(1, n)]
    lines += [f"  func.return %v{n - 1} : f32", "}"]
    return "\n".join(lines) + "\n"


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def wall(cmd: list[str], repeat: int) -> float:
    def once() -> None:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return best_of(repeat, once)


def tool(name: str) -> str | None:
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", help="the end-to-end chain lengths, comma-separated (default: ops/4, ops/2, ops, 2 ops)")
    args = ap.parse_args()
    n, r = args.ops, args.repeat

    text = geir_chain(n)
    parse(geir_chain(10))  # build the parser tables outside the timed region
    t_parse = best_of(r, lambda: parse(text))
    module = parse(text)
    t_verify = best_of(r, lambda: verify_module(module))
    t_print = best_of(r, lambda: print_module(module))
    assert print_module(module) == text, "the chain does not print back to itself"

    print(f"GEIR in-process, {n} ops (ops/s, higher is better)")
    for what, t in (("parse", t_parse), ("verify", t_verify), ("print", t_print),
                    ("parse+verify+print", t_parse + t_verify + t_print)):
        print(f"  {what:<20} {n / t:>12,.0f} ops/s   {t * 1e3:8.1f} ms")

    geopt = tool("geopt")
    xdsl = tool("xdsl-opt")
    with tempfile.TemporaryDirectory() as tmp:
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [n // 4, n // 2, n, 2 * n]
        print("\nEnd to end (a fresh process each run; interpreter start-up included)")
        print(f"  {'ops':>8}  {'geopt s':>9} {'geopt ops/s':>12}  {'xdsl-opt s':>10} {'xdsl ops/s':>11}  {'ratio':>6}")
        for size in sizes:
            g = os.path.join(tmp, f"chain{size}.geir")
            Path(g).write_text(geir_chain(size))
            tg = wall([geopt, g], r) if geopt else float("nan")
            if xdsl:
                m = os.path.join(tmp, f"chain{size}.mlir")
                Path(m).write_text(mlir_chain(size))
                tx = wall([xdsl, m], r)
                xs, xr, ratio = f"{tx:10.3f}", f"{size / tx:11,.0f}", f"{tx / tg:5.2f}x"
            else:
                xs = xr = "n/a"
                ratio = "-"
            print(f"  {size:>8}  {tg:9.3f} {size / tg:12,.0f}  {xs:>10} {xr:>11}  {ratio:>6}")
        if not xdsl:
            print("  (xdsl-opt not installed: pip install -e '.[bench]' to compare)")
    print("\nratio = geopt ops/s / xdsl-opt ops/s (goal >= 2x); ops/s should stay flat as size grows (linear).")


if __name__ == "__main__":
    main()
