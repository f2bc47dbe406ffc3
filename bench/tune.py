"""getune at scale: candidates timed per second on 1 and 2 local Ray workers and on a multi-node cluster, and the
tuned-vs-rules kernel time on a suite of attention, matmul and norm shapes across the three targets.

    python bench/tune.py [--quick] [--skip-scaling] [--json OUT.json]

Throughput: the quick suite (five ops, on ascend910b) is tuned from an empty repository by a local Ray of 1 worker,
of 2 workers, and by a Ray cluster of two nodes with one CPU each started in this process
(`ray.cluster_utils.Cluster`); each line gives candidates per second of host wall time and the ratio
to 1 worker. The machine's CPU count bounds what more workers can give.

Gain: for every op of the suite on each target, the rules' tiling and the best candidate are timed
standalone (an idle chip, operands in HBM); tuned / rules is never above 1 (an entry is only used
when it beats the rules), and the geometric mean of rules / tuned over the ops where the rules were
not already the fastest is the figure of the second round's goal (>= 1.1x, GEIR spec section 7).
Needs the `tune` extra (Ray).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from geir.passes.tuning_repository import TuningRepository
from geir.session.executors import OnRay
from geir.session.tuning import Point, TuneReport, geomean, tune

TARGETS = ("ascend910b", "ascend910a", "ascend310p")


def suite(quick: bool) -> str:
    """One graph holding the suite's ops, each on its own arguments (so no fusion joins them)."""
    f16 = "f16"
    cases = [
        # attention: prefill (causal, D 128 and 64) and one decode step over a long grouped KV
        ("flash_attention", [(1, 8, 1024, 128)] * 3, "{causal = true}", (1, 8, 1024, 128)),
        ("flash_attention", [(1, 16, 2048, 64)] * 3, "", (1, 16, 2048, 64)),
        ("flash_attention", [(1, 32, 1, 128), (1, 8, 4096, 128), (1, 8, 4096, 128)], "", (1, 32, 1, 128)),
        # matmul: a LLaMA-shaped projection, an MLP up-projection, a BERT FFN, a decode-sized GEMV-like one
        ("matmul", [(1024, 4096), (4096, 4096)], "", (1024, 4096)),
        ("matmul", [(512, 4096), (4096, 11008)], "", (512, 11008)),
        ("matmul", [(384, 768), (768, 3072)], "", (384, 3072)),
        ("matmul", [(16, 4096), (4096, 4096)], "", (16, 4096)),
        # norms and softmax
        ("rms_norm", [(1024, 4096), (4096,)], "{epsilon = 1.0e-05}", (1024, 4096)),
        ("layer_norm", [(512, 768), (768,), (768,)], "{epsilon = 1.0e-05}", (512, 768)),
        ("softmax", [(8, 128, 2048)], "{axis = -1}", (8, 128, 2048)),
    ]
    if quick:
        cases = [cases[0], cases[5], cases[6], cases[8], cases[9]]
    args, body, results = [], [], []
    for i, (op, shapes, attrs, out) in enumerate(cases):
        names = []
        for j, shape in enumerate(shapes):
            names.append(f"%a{i}_{j}")
            args.append(f"{names[-1]}: tensor<{'x'.join(map(str, shape))}x{f16}>")
        rtype = f"tensor<{'x'.join(map(str, out))}x{f16}>"
        body.append(f"  %r{i} = ge.{op} {', '.join(names)} {attrs} : {rtype}".replace("  :", " :"))
        results.append((f"%r{i}", rtype))
    return (f"ge.graph @main({', '.join(args)}) -> ({', '.join(t for _, t in results)}) {{\n"
            + "\n".join(body) + f"\n  ge.return {', '.join(r for r, _ in results)}\n}}\n")


def timed_run(text: str, targets: tuple[str, ...], executor: OnRay, db: Path) -> TuneReport:
    with TuningRepository(db, create=True) as repo:
        return tune(text, [Point(t) for t in targets], executor, repo, name="<suite>", graph_times=False)


def scaling(text: str, workdir: Path) -> list[dict]:
    """Candidates per second of host time: 1 and 2 local workers, and a two-node cluster."""
    import ray
    from ray.cluster_utils import Cluster

    rows = []
    for workers in (1, 2):
        executor = OnRay(workers)
        try:
            report = timed_run(text, ("ascend910b",), executor, workdir / f"local{workers}.sqlite")
        finally:
            executor.close()
        rows.append({"setup": f"local Ray, {workers} worker{'s' * (workers > 1)}", "workers": report.workers,
                     "candidates": report.timed, "seconds": report.seconds,
                     "candidates_per_second": report.candidates_per_second})
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        executor = OnRay(address=cluster.address)
        report = timed_run(text, ("ascend910b",), executor, workdir / "cluster.sqlite")
        executor.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    rows.append({"setup": "Ray cluster, 2 nodes x 1 CPU", "workers": report.workers, "candidates": report.timed,
                 "seconds": report.seconds, "candidates_per_second": report.candidates_per_second})
    return rows


def gains(text: str, workdir: Path) -> tuple[list[dict], dict]:
    """Per op and target: rules and tuned standalone kernel time; the geometric mean where the rules were beaten."""
    executor = OnRay(min(2, os.cpu_count() or 1))
    try:
        report = timed_run(text, TARGETS, executor, workdir / "gain.sqlite")
    finally:
        executor.close()
    rows = []
    for o in report.ops:
        shapes = " ".join("x".join(map(str, t.shape)) for t in o.op.sig.operands)
        rows.append({"target": o.op.target.name, "op": o.op.sig.name[3:], "shapes": shapes, "rules_us": o.rules_us,
                     "tuned_us": o.best_us, "tuned_over_rules": o.best_us / o.rules_us,
                     "candidates": len(o.op.candidates), "rules_optimal": o.best_us >= o.rules_us})
    beaten = [r["rules_us"] / r["tuned_us"] for r in rows if not r["rules_optimal"]]
    summary = {"ops": len(rows), "rules_beaten": len(beaten), "geomean_gain_where_beaten": geomean(beaten),
               "geomean_gain_all": geomean(r["rules_us"] / r["tuned_us"] for r in rows),
               "max_tuned_over_rules": max(r["tuned_over_rules"] for r in rows),
               "seconds": report.seconds, "candidates": report.timed}
    return rows, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller suite (five ops)")
    p.add_argument("--skip-scaling", action="store_true", help="only the tuned-vs-rules gains")
    p.add_argument("--scaling-only", action="store_true", help="only the throughput")
    p.add_argument("--json", metavar="OUT.json", help="write the figures as JSON")
    args = p.parse_args(argv)
    try:
        import ray  # noqa: F401
    except ImportError:
        print("bench/tune.py needs Ray: pip install -e '.[tune]'", file=sys.stderr)
        return 1
    text = suite(args.quick)
    out: dict = {"cpus": os.cpu_count()}
    # throughput is measured on the quick suite: the same work for each setup, a few minutes in all
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if not args.skip_scaling:
            rows = scaling(suite(True), workdir)
            base = rows[0]["candidates_per_second"]
            print(f"sweep throughput on ascend910b ({rows[0]['candidates']} candidates, {os.cpu_count()} CPUs here):")
            for r in rows:
                print(f"  {r['setup']:<30} {r['workers']} worker(s)  {r['candidates_per_second']:7.1f} candidates/s  "
                      f"({r['seconds']:.1f} s, {r['candidates_per_second'] / base:.2f}x 1 worker)")
            out["scaling"] = rows
        if args.scaling_only:
            if args.json:
                from geir.files import write_atomically

                write_atomically(args.json, json.dumps(out, indent=2, allow_nan=False))
            return 0
        t0 = time.perf_counter()
        rows, summary = gains(text, workdir)
        print(f"\ntuned vs rules, standalone kernel time ({summary['candidates']} candidates in "
              f"{time.perf_counter() - t0:.0f} s):")
        print(f"  {'target':<11} {'op':<16} {'shapes':<36} {'rules us':>10} {'tuned us':>10} {'tuned/rules':>11}")
        for r in rows:
            mark = "  (rules optimal)" if r["rules_optimal"] else ""
            print(f"  {r['target']:<11} {r['op']:<16} {r['shapes']:<36} {r['rules_us']:>10.2f} {r['tuned_us']:>10.2f} "
                  f"{r['tuned_over_rules']:>11.3f}{mark}")
        goal = summary["geomean_gain_where_beaten"]
        print(f"  geometric-mean gain where the rules were beaten ({summary['rules_beaten']} of {summary['ops']} ops): "
              f"{goal:.3f}x (goal >= 1.1x: {'met' if goal >= 1.1 else 'MISSED'}); over all ops {summary['geomean_gain_all']:.3f}x; "
              f"tuned/rules at most {summary['max_tuned_over_rules']:.3f} (goal <= 1: "
              f"{'met' if summary['max_tuned_over_rules'] <= 1 else 'MISSED'})")
        out["gains"] = rows
        out["summary"] = summary
    if args.json:
        from geir.files import write_atomically

        write_atomically(args.json, json.dumps(out, indent=2, allow_nan=False))
    return 0 if math.isfinite(summary["geomean_gain_where_beaten"]) else 1


if __name__ == "__main__":
    sys.exit(main())
