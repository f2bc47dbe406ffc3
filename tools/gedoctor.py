"""gedoctor: compile and run a program on the simulated NPU and say which layer to look at first.

    gedoctor FILE [--json] [--entry NAME] [--passes=PIPELINE | --no-fuse] [--target NAME]
             [--inputs IN.npz | --seed N] [--weights W.npz]

FILE is a `.geir` holding a ge.graph (compiled with the pipeline, gerun's default unless told), a
`.geir` holding an rt.program (already lowered: the Runtime and kernel layers are judged), or an
`.onnx` model (imported by geir.frontends.onnx). The report answers, in this order: did fusion
take effect, did the Runtime overlap data movement with compute, is each kernel near its limit,
and the single layer to look at first with the evidence. `--json` prints exactly
`{"culprit": "fusion" | "runtime" | "kernel" | "none", "findings": [...]}`.

Exit codes: 0 a diagnosis (whatever the culprit), 1 bad input or a failed run, 2 bad usage,
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from geir.tools.common import (
    seed,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    DiagnosticPrinter,
    ToolError,
    add_target_options,
    add_version,
    check_target,
    checked_pipeline,
    import_model,  # noqa: F401  (getune and the tests take it from here)
    read_module,
    run_tool,
    select_graph,
)

from geir.diagnostics import Diagnostic, DiagnosticError, SourceManager

if TYPE_CHECKING:
    from geir.session.doctor import Diagnosis, KernelView

TOOL = "gedoctor"
SECTIONS = {
    "ge-host": "0. GE on the host: did the run wait for GE?",
    "fusion": "1. GE fusion: did fusion take effect?",
    "runtime": "2. Runtime: did data movement overlap compute?",
    "kernel": "3. Kernels: is each near its limit?",
}
TABLE_ROWS = 10  # kernels shown per table, the slowest first


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=TOOL,
        description="Compile and run a program on the simulated NPU and say which layer to look at first: "
                    "GE fusion, the Runtime's overlap, or the kernels.",
    )
    add_version(p, TOOL)
    p.add_argument("input", metavar="FILE", help="a .geir (ge.graph or rt.program, - for stdin) or an .onnx model")
    p.add_argument("--json", action="store_true", help='print {"culprit": ..., "findings": [...]} as JSON')
    p.add_argument("--cold", action="store_true",
                   help="judge the first request, which waits for GE's compile (default: a warm run, a plan-cache hit)")
    p.add_argument("--launch", choices=("single-op", "graph"), default="single-op",
                   help="how the run's kernels reach the device: submitted one by one (single-op), or replayed from "
                        "a task graph captured once (graph); a host-launch culprit recommends graph mode")
    p.add_argument("--entry", metavar="NAME", help="the graph to diagnose (default @main, else the only graph)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--inputs", metavar="IN.npz", help="inputs by argument name (default: random, --seed 0)")
    src.add_argument("--seed", type=seed, default=0, metavar="N", help="random normal inputs from this seed")
    p.add_argument("--weights", metavar="W.npz",
                   help="arrays for dense_resource constants (default: the .npz beside FILE with its stem)")
    add_target_options(p)
    pipe = p.add_mutually_exclusive_group()
    pipe.add_argument("--passes", metavar="PIPELINE", help="GE pipeline (lower is added at the end)")
    pipe.add_argument("--no-fuse", action="store_true", help="the default pipeline without fusion")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_tool(TOOL, run, build_arg_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from geir.session.doctor import diagnose_graph, diagnose_program
    from geir.runtime.interpreter import RuntimeFailure
    from geir.tools.gerun import (
        check_inputs_match,
        load_weights,
        npz_inputs,
        random_inputs,
    )

    chip = check_target(args.target)
    sources = SourceManager()
    printer = DiagnosticPrinter(sources)
    pipeline = checked_pipeline(args, sources)
    module, _, _, onnx_weights = read_module(args.input, args.weights, sources, printer)
    graph = select_graph(module, args.entry, args.input)
    lowered = graph.kind == "rt.program"
    if lowered and (args.passes is not None or args.no_fuse):
        raise ToolError(f"@{graph.name} in {args.input} is an rt.program (already lowered): --passes and --no-fuse "
                        f"apply to a ge.graph", EXIT_USAGE)
    if lowered:
        from geir.runtime.interpreter import target_mismatch

        mismatch = target_mismatch(graph, chip)
        if mismatch is not None:
            printer(mismatch)
            return EXIT_USAGE  # as gerun: the program is fine, the command asked for another chip
    from geir.runtime.device import host_memory_problem

    too_big = host_memory_problem(graph)
    if too_big is not None:
        printer(too_big)
        return EXIT_FAILURE
    weights = onnx_weights if onnx_weights is not None else load_weights(graph, args, printer)
    inputs = npz_inputs(graph, args.inputs) if args.inputs else random_inputs(graph, args.seed)
    try:
        if lowered:
            check_inputs_match(graph, inputs, f"--inputs {args.inputs}" if args.inputs else f"--seed {args.seed}")
            diagnosis = diagnose_program(graph, inputs, weights, chip, args.launch)
        else:
            diagnosis = diagnose_graph(graph, inputs, weights, pipeline, chip, module.file, cold=args.cold,
                                       launch_mode=args.launch)
    except DiagnosticError as e:
        for d in e.diagnostics:
            printer(d)
        return EXIT_FAILURE
    except RuntimeFailure as e:
        raise ToolError(str(e)) from None
    if args.json:
        print(json.dumps(diagnosis.to_json(), indent=2, allow_nan=False))
    else:
        print(report(diagnosis, args.input, None if lowered else pipeline, sources))
    sys.stdout.flush()
    return EXIT_OK


# --- the text report ---------------------------------------------------------------------------------

def report(d: Diagnosis, name: str, pipeline: str | None, sources: SourceManager) -> str:
    """The three sections in order, then the layer to look at first with its evidence."""
    totals = (f"device time {d.device_us:.1f} us in {len(d.kernels)} kernel(s); end to end {d.end_to_end_us:.1f} us "
              f"(host-device copies {d.copies_us:.1f} us)")
    lines = [f"gedoctor: {name} on {d.target}" + (f", pipeline {pipeline}" if pipeline else " (an rt.program)"),
             totals, ""]
    for layer, title in SECTIONS.items():
        lines.append(title)
        if layer == "runtime":
            lines += _runtime_table(d)
        elif layer == "kernel":
            lines += _kernel_table(d)
        for f in d.findings:
            if f.layer == layer:
                where = f"{f.location}: " if f.location else ""
                lines.append(f"  [{f.severity}] {where}{f.message}")
        lines.append("")
    deciding = d.deciding()
    if deciding is None:
        lines.append(f"Look first at: none - no layer stands out: {d.calm()}")
    else:
        lines.append(f"Look first at: {d.culprit} - {deciding.message}")
        if deciding.location:  # the source line it is about, as a diagnostic shows it
            lines += ["", sources.render(Diagnostic("note", "look here", deciding.loc))]
    return "\n".join(lines)


def _slowest(d: Diagnosis) -> list:
    return sorted(d.kernels, key=lambda v: -v.time_us)[:TABLE_ROWS]


def _more(d: Diagnosis) -> list[str]:
    rest = len(d.kernels) - TABLE_ROWS
    return [f"  ... {rest} more kernel(s), each shorter"] if rest > 0 else []


def _runtime_table(d: Diagnosis) -> list[str]:
    from geir.session.doctor import pipe_waits

    head = (f"  {'kernel':<36}{'time_us':>9}{'share':>7}{'buf':>5}{'overlap':>9}{'mem_bnd':>9}{'mte2':>6}{'cube':>6}"
            f"{'vec':>6}  compute waits (flag/slot)")
    rows = [head]
    for v in _slowest(d):
        f, k = v.figures, v.stats
        if v.on_aicpu:  # no AI Core pipes: nothing to overlap
            rows.append(f"  {_short(v):<36}{v.time_us:>9.1f}{100 * v.share:>6.0f}%{'-':>5}{'-':>9}{'-':>9}{'-':>6}"
                        f"{'-':>6}{'-':>6}  - (AI CPU)")
            continue
        compute = max(("CUBE", "VECTOR"), key=lambda p: k.busy[p])
        flag, slot = pipe_waits(k, compute)
        buf = k.tiling.buffers if k.tiling else "-"
        waits = f"{compute.lower()} {100 * flag:.0f}% / {100 * slot:.0f}%" if k.busy[compute] else "- (no compute)"
        rows.append(f"  {_short(v):<36}{v.time_us:>9.1f}{100 * v.share:>6.0f}%{buf!s:>5}{f['overlap_ratio']:>9.2f}"
                    f"{f['memory_bound']:>9.2f}{f['mte2_ratio']:>6.2f}{f['cube_ratio']:>6.2f}{f['vec_ratio']:>6.2f}"
                    f"  {waits}")
    return rows + _more(d)


def _kernel_table(d: Diagnosis) -> list[str]:
    rows = [f"  {'kernel':<36}{'time_us':>9}{'TFLOP/s':>9}{'roof':>8}{'of roof':>9}  bound"]
    for v in _slowest(d):
        r = v.roof
        if v.on_aicpu:  # no AI Core roofline: GE placed it on the AI CPU
            rows.append(f"  {_short(v):<36}{v.time_us:>9.1f}{'-':>9}{'-':>8}{'-':>9}  AI CPU")
            continue
        rows.append(f"  {_short(v):<36}{v.time_us:>9.1f}{r.achieved_tflops:>9.2f}{r.roof_tflops:>8.1f}"
                    f"{100 * r.fraction:>8.0f}%  {r.bound}")
    return rows + _more(d)


def _short(v: KernelView) -> str:
    """A kernel's name and line, short enough for a table column."""
    where = f":{v.loc.line}" if v.loc is not None and v.loc.line else ""
    text = f"{v.name.removeprefix('ge.')}{where}"
    return text if len(text) <= 35 else text[:34] + "~"


if __name__ == "__main__":
    sys.exit(main())
