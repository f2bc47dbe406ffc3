"""ONNX's backend node tests through geimport + gerun: the per-op pass table and attention fusion.

    python bench/onnx_conformance.py              # markdown tables (what the README shows)
    python bench/onnx_conformance.py --failures   # also every failing case with its reason

1. Every node test case `onnx` generates (`collect_testcases`, the `_expanded` function-body
   variants included) is imported, printed and parsed back, compiled with the default pipeline,
   run on the simulated 910B and compared with ONNX's expected outputs at the case's tolerances
   (geir.frontends.onnx_conformance). Cases with an op, dtype or run-time-only value GEIR does not
   take are "unsupported". A case refused only because a shape, axes or indices input is fed at
   run time also runs with its integer inputs bound as constants ("bound"). One row per op tested.
2. The `_expanded` attention cases (a softcap included) without a key/value cache or a qk_matmul_output
   output (ONNX's own primitive spelling of attention): how many become one ge.flash_attention
   after the default pipeline's canonicalize + fuse, as given (head dim 8 or less) and with the
   head dim widened to 16, with the --explain reason of each miss; the widened graphs also run
   fused and are compared with ONNX's reference implementation.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

from geir.frontends.onnx import OnnxImportError
from geir.frontends.onnx_conformance import fuse_attention, fusion_goal, node_cases, run_case, widen_head_dim


def conformance(show_failures: bool) -> list:
    """Run every case; print the per-op table."""
    results = [run_case(case) for case in node_cases()]
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        by_op[r.op][r.status] += 1
        by_op[r.op]["bound"] += r.status == "pass" and r.bound
    total = collections.Counter(r.status for r in results)
    bound = sum(1 for r in results if r.bound and r.status == "pass")
    print(f"## ONNX node tests ({len(results)} cases from onnx's collect_testcases, `_expanded` variants included)\n")
    print(f"passed {total['pass']}, failed {total['fail']}, unsupported {total['unsupported']}; "
          f"of the {total['pass'] + total['fail']} cases GEIR imports, {total['pass']} pass "
          f"({bound} of them with their integer inputs - shapes, axes, indices - bound as constants)\n")
    print("| op | cases | pass | of which bound | fail | unsupported |")
    print("|---|---:|---:|---:|---:|---:|")
    untaken = []
    for op in sorted(by_op, key=str.lower):
        c = by_op[op]
        if c["pass"] + c["fail"] == 0:
            untaken.append(op)
            continue
        cases = c["pass"] + c["fail"] + c["unsupported"]
        print(f"| {op} | {cases} | {c['pass']} | {c['bound']} | {c['fail']} | {c['unsupported']} |")
    print(f"\n{len(untaken)} ops with no case GEIR imports (an op, dtype or run-time value outside GEIR): "
          + ", ".join(untaken) + "\n")
    failures = [r for r in results if r.status == "fail"]
    if failures:
        print("failing cases:")
        for r in failures if show_failures else failures[:10]:
            print(f"- {r.name}: {r.detail[:300]}")
        print()
    return results


def fusion() -> None:
    """The expanded attention cases' fusion fraction, as given and with head dim 16."""
    goals = [c for c in node_cases() if fusion_goal(c)]
    print(f"## Expanded attention cases fused into one ge.flash_attention ({len(goals)} cases: `_expanded`, "
          f"softcaps included, no key/value cache, no qk_matmul_output output)\n")
    for label, widen in (("as given (head dim 8, or 1 and 4 in two cases)", False), ("head dim widened to 16", True)):
        fused, reasons, runs = 0, collections.Counter(), collections.Counter()
        for case in goals:
            try:
                variant = widen_head_dim(case) if widen else case
                count, misses = fuse_attention(variant)
            except OnnxImportError as e:
                reasons[f"not imported: {e.reason}"] += 1
                continue
            if count == 1:
                fused += 1
                if widen:
                    r = run_case(variant)
                    runs[r.status] += 1
                    if r.status != "pass":
                        reasons[f"fused, but the run failed: {r.detail[:160]}"] += 1
            else:
                for why in misses or [f"{count} flash attentions, no miss reported"]:
                    reasons[why] += 1
        print(f"- {label}: {fused} of {len(goals)} fuse ({100 * fused / len(goals):.0f} %)"
              + (f"; run fused against ONNX's reference: {runs['pass']} pass, {runs['fail']} fail" if widen else ""))
        for why, n in reasons.most_common():
            print(f"  - {n} x {why}")
    print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--failures", action="store_true", help="list every failing case with its reason")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    conformance(args.failures)
    fusion()
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
