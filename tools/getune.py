"""getune: time every tiled op's legal candidate tilings on the simulated NPU, in parallel on Ray, and keep the
best in a tuning repository that GE's `tile{db=DB}` consults.

    getune FILE|MODEL.onnx [--target T ...] [--workers N] [--address ADDR] [--db DB] [--json]
                [--sweep] [--set KEY=V1[,V2...] ...] [--shape ARG=DIMS[,DIMS...] ...] [--csv OUT.csv]

Per op it prints the rules' tiling and time, the best found and its time and the speed-up, then the whole
graph's kernel time with the rules and tuned. Candidates run on a local Ray it starts (`--workers N`
CPUs, default all), on the cluster at `--address` (or $RAY_ADDRESS), or in this process with
`--workers 0`. The repository (default: tuning.sqlite in the user's cache directory) keeps every time
measured, so a second run times only what is new. `--sweep` varies each `--set` chip parameter
(`ub_bytes=x2`, `l2_mib=96,384`, `hbm_tb_per_s=3.2`) and `--shape` binding one at a time from each
target and tabulates the graph's time: which parameter the model is sensitive to.

Progress goes to stderr: rewritten in place on a terminal, a line every 10 s elsewhere (never silent for minutes).
Exit codes: 0 done, 1 bad input or a failed run, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from geir.tools.common import (
    EXIT_OK,
    EXIT_USAGE,
    DiagnosticPrinter,
    ToolError,
    add_version,
    check_target,
    non_negative,
    parse_verified,
    read_input,
    refuse_overwrites,
    refuse_unwritable,
    run_tool,
    select_graph,
    write_atomically,
)

from geir.diagnostics import DiagnosticError, SourceManager
from geir.target_npu.target import DEFAULT_TARGET

TOOL = "getune"


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=TOOL, description="Tune the tilings of a graph's kernels on the simulated NPU "
                                "(in parallel on Ray) into a repository that tile{db=DB} consults.")
    add_version(p, TOOL)
    p.add_argument("input", metavar="FILE", help="a .geir holding a ge.graph (- for stdin), or an .onnx model")
    p.add_argument("--entry", metavar="NAME", help="the graph to time (default @main, else the only graph)")
    p.add_argument("--target", action="append", default=[], metavar="T",
                   help=f"a chip to tune for (repeat for several; default {DEFAULT_TARGET}): a bundled name, a target "
                        f".toml, or a what-if chip NAME[KEY=VALUE,...]")
    p.add_argument("--workers", type=non_negative, default=None, metavar="N",
                   help="CPUs of the local Ray getune starts (default: all); 0 tunes in this process, without Ray")
    p.add_argument("--address", metavar="ADDR", default=None,
                   help="an existing Ray cluster to run on (default $RAY_ADDRESS; else a local Ray)")
    p.add_argument("--db", metavar="DB", default=None,
                   help="the tuning repository, an SQLite file (default: tuning.sqlite in the user's cache directory)")
    p.add_argument("--buffers", type=int, choices=(1, 2), default=2,
                   help="tilings with this many buffers (the tile pass's option; default 2, double buffering)")
    p.add_argument("--json", action="store_true", help='print {"ops": [...], "graph": {...}} as JSON')
    p.add_argument("--sweep", action="store_true",
                   help="vary each --set parameter and --shape binding one at a time and tabulate the graph's time")
    p.add_argument("--set", action="append", default=[], metavar="KEY=V1[,V2...]", dest="overrides",
                   help="a chip parameter changed from each target (ub_bytes, l1_bytes, l2_mib, hbm_tb_per_s, "
                        "clock_ghz, cube_cores, ...; values as numbers, 384KiB, or x2 for twice the target's)")
    p.add_argument("--shape", action="append", default=[], metavar="ARG=DIMS[,DIMS...]", dest="shapes",
                   help="bind argument %%ARG to a shape (1x4096x128); with --sweep each shape is a point")
    p.add_argument("--csv", metavar="OUT.csv", help="with --sweep: write the table as CSV (atomically)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_tool(TOOL, run, build_arg_parser().parse_args(argv))


def _axes(args: argparse.Namespace) -> list:
    """The --set and --shape options as sweep axes (a usage error names the bad one)."""
    from geir.session.sweep import Axis, parse_dims
    from geir.target_npu.overrides import OverrideError, parse_override

    axes = []
    for text in args.overrides:
        try:
            key, values = parse_override(text)
        except OverrideError as e:
            raise ToolError(f"--set {text}: {e}", EXIT_USAGE) from None
        axes.append(Axis("set", key, tuple(values)))
    for text in args.shapes:
        arg, eq, dims = text.partition("=")
        if not eq or not arg.strip().lstrip("%") or not dims:
            raise ToolError(f"--shape {text}: expected ARG=DIMS[,DIMS...], as x=1x4096x128", EXIT_USAGE)
        values = tuple(v.strip() for v in dims.split(","))
        for v in values:
            try:
                parse_dims(v)
            except ValueError as e:
                raise ToolError(f"--shape {text}: {e}", EXIT_USAGE) from None
        axes.append(Axis("shape", arg.strip().lstrip("%"), values))
    return axes


def _points(args: argparse.Namespace, targets: list[str], axes: list) -> tuple[list, list]:
    """The points to tune at, and for a sweep the (point, target, key, value) rows they stand for."""
    from geir.session.sweep import parse_dims, sweep_points
    from geir.session.tuning import Point
    from geir.target_npu.overrides import OverrideError, target_spec

    if args.sweep:
        if not axes:
            raise ToolError("--sweep needs at least one --set or --shape to vary", EXIT_USAGE)
        try:
            rows = sweep_points(targets, axes)
        except (OverrideError, KeyError, ValueError) as e:
            raise ToolError(f"--set: {e}", EXIT_USAGE) from None
        return [r[0] for r in rows], rows
    overrides = []
    for axis in axes:
        if len(axis.values) > 1:
            raise ToolError(f"--{'set' if axis.kind == 'set' else 'shape'} {axis.key} has several values: give "
                            f"--sweep to sweep them, or one value", EXIT_USAGE)
        if axis.kind == "set":
            overrides.append((axis.key, axis.values[0]))
    shapes = tuple((a.key, parse_dims(a.values[0])) for a in axes if a.kind == "shape")
    try:
        specs = [target_spec(t, overrides) if overrides else t for t in targets]
    except (OverrideError, KeyError, ValueError) as e:
        raise ToolError(f"--set: {e}", EXIT_USAGE) from None
    return [Point(s, shapes, s) for s in specs], []


def run(args: argparse.Namespace) -> int:
    from geir.passes.tuning_repository import RepositoryError, TuningRepository, default_path
    from geir.runtime.interpreter import RuntimeFailure
    from geir.session.executors import InProcess, OnRay, RayUnavailable
    from geir.session.sweep import SweepReport
    from geir.session.tuning import TuneError, tune

    if args.csv and not args.sweep:
        raise ToolError("--csv writes a sweep's table: give --sweep", EXIT_USAGE)
    targets = args.target or [DEFAULT_TARGET]
    for t in targets:
        check_target(t)
    axes = _axes(args)
    points, sweep_rows = _points(args, targets, axes)
    db = args.db or str(default_path())
    refuse_overwrites([("FILE", args.input)], [("--db", db), ("--csv", args.csv)])
    refuse_unwritable([("--csv", args.csv)])  # before minutes of tuning (the repository says its own problems)
    sources = SourceManager()
    printer = DiagnosticPrinter(sources)
    if args.input.lower().endswith(".onnx"):  # through the ONNX frontend, as gedoctor reads one; weights unneeded
        from geir.printer import print_module
        from geir.tools.gedoctor import import_model

        module, _ = import_model(args.input, sources)
        name, text = f"{args.input} (as imported)", print_module(module)
    else:
        name, data = read_input(args.input)
        module, text = parse_verified(name, data, sources, printer)
    graph = select_graph(module, args.entry, args.input)
    if graph.kind != "ge.graph":
        raise ToolError(f"@{graph.name} in {args.input} is an {graph.kind}: getune tunes a ge.graph before it is "
                        f"tiled and lowered")
    try:
        repository = TuningRepository(db, create=True)
        repository.check_writable()  # before any candidate is timed: every time measured is kept there
    except RepositoryError as e:
        raise ToolError(f"--db: {e}") from None
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if args.workers == 0 and args.address:
        raise ToolError("--workers 0 tunes in this process: it takes no --address", EXIT_USAGE)
    try:
        executor = InProcess() if args.workers == 0 else OnRay(args.workers or os.cpu_count() or 1, address)
    except RayUnavailable as e:
        repository.close()
        raise ToolError(str(e)) from None
    progress = None if args.quiet or args.json else _Progress(sys.stderr.isatty())
    try:
        report = tune(text, points, executor, repository, buffers=args.buffers, name=name, entry=graph.name,
                      progress=progress)
    except DiagnosticError as e:
        for d in e.diagnostics:
            printer(d)
        raise ToolError("") from None
    except (TuneError, RuntimeFailure, RepositoryError) as e:
        raise ToolError(str(e)) from None
    finally:
        executor.close()
        repository.close()
        if progress is not None and progress.tty and progress.shown:
            print(file=sys.stderr)
    if args.sweep:
        table = SweepReport.of(sweep_rows, report)
        if args.csv:
            write_atomically(args.csv, table.csv())
        print(json.dumps(table.record(), indent=2, allow_nan=False) if args.json else table.render())
    else:
        print(json.dumps(report.record(), indent=2, allow_nan=False) if args.json else report.render())
    if not args.quiet and not args.json:
        print(f"getune: repository {db}", file=sys.stderr)
    return EXIT_OK


PROGRESS_EVERY_S = 10.0


class _Progress:
    """The tasks timed so far, on stderr: rewritten in place on a terminal; elsewhere (a log, CI) one line every
    PROGRESS_EVERY_S seconds, so that a long tuning run is never silent for minutes."""

    def __init__(self, tty: bool):
        self.tty = tty
        self.shown = False
        self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            print(f"\rgetune: {done}/{total} tasks timed", end="", file=sys.stderr, flush=True)
            self.shown = True
        elif time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            print(f"getune: {done}/{total} tasks timed", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
