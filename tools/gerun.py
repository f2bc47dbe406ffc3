"""gerun: compile a GEIR graph with GE's pipeline and run it on the simulated NPU's Runtime.

    gerun FILE [--entry NAME] [--inputs IN.npz ... | --seed N] [--output OUT.npz] [--weights W.npz]
          [--target NAME] [--passes=PIPELINE | --no-fuse] [--check] [--profile] [--profile-json P.json]
          [--trace TRACE.json] [--op-summary OUT.csv] [--inject-fault KIND@N]

An `.onnx` model is imported by the ONNX frontend first (its weights with it), as gedoctor and getune
read one. A file holding `ge.graph`s is compiled (default pipeline, `--passes`, or `--no-fuse`; `lower` ends
every pipeline); a file holding an `rt.program` runs as it is. Several `--inputs` run one after
the other in one session on the program compiled once.

Files written (only when the whole run succeeded, and all or none: each goes to a temporary beside
it, and only when every one is written are they renamed over their targets, so a file that cannot be
written leaves every existing one as it was; every path is checked writable before the run):
- `--output`: `result0`, `result1`, ... (one run) or `run0.result0`, ... (several runs); bf16 as float32.
- `--profile-json`: one run: exactly the spec's profile keys. Several runs: the last run's profile
  at top level (the spec's keys) plus `runs`, the list of every run's profile in order.
- `--trace`: Chrome trace-event JSON: host GE (the passes, wall-clock), Runtime (the submissions) and runs
  tracks, one track per device stream, one per core and pipe; several runs follow one another on the time
  axis. It renders the run's one typed timeline (geir.runtime.trace).
- `--timeline`: the same timeline as a PNG picture (geir.runtime.timeline), all runs one after another.
- `--op-summary`: msprof's op_summary CSV (geir.runtime.op_summary), one row per kernel task; several
  runs: one table, every run's kernels one after another on one device timeline.

Exit codes: 0 success, 1 bad input, a failed run or a failed --check, 2 bad usage (an output onto an
input or onto another output included), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
from geir.kernels.base import KernelStats
from geir.passes import PipelineError
from geir.runtime.interpreter import GraphCaptures, RuntimeListener, Task
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
    is_onnx,
    print_all,
    read_module,
    refuse_overwrites,
    refuse_unwritable,
    run_tool,
    select_graph,
    write_all_atomically,
)

from geir.accuracy import TOLERANCES, compare  # noqa: F401  (the tolerance policy, re-exported for the tests)
from geir.files import npz_bytes
from geir.attributes import DenseResourceAttr
from geir.diagnostics import Diagnostic, DiagnosticError, SourceManager
from geir.ir import Graph, Module
from geir.parser import parse
from geir.types import DType, TensorType

TOOL = "gerun"
FAULT_KINDS = ("dma", "core", "ub_overflow")
PROGRESS_MIN_KERNELS = 5


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=TOOL,
        description="Compile a GEIR graph (or take a lowered rt.program) and run it on the simulated NPU.",
    )
    add_version(p, TOOL)
    p.add_argument("input", metavar="FILE",
                   help="a .geir file holding ge.graphs or an rt.program (- for stdin), or an .onnx model")
    p.add_argument("--entry", metavar="NAME", help="the graph to run (default @main, else the only graph)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--inputs", action="append", default=[], metavar="IN.npz",
                     help="inputs by argument name (repeat for several runs in one session)")
    src.add_argument("--seed", type=seed, metavar="N", help="random normal inputs from this seed (default 0)")
    p.add_argument("--output", "-o", metavar="OUT.npz", help="write the results here (atomically)")
    p.add_argument("--weights", metavar="W.npz",
                   help="arrays for dense_resource constants (default: the .npz beside FILE with its stem)")
    add_target_options(p)
    pipe = p.add_mutually_exclusive_group()
    pipe.add_argument("--passes", metavar="PIPELINE", help="GE pipeline (lower is added at the end)")
    pipe.add_argument("--no-fuse", action="store_true", help="the default pipeline without fusion")
    p.add_argument("--check", action="store_true",
                   help="compare with the float64 reference interpreter on the graph as written")
    p.add_argument("--profile", action="store_true", help="print the run's profile")
    p.add_argument("--profile-json", metavar="P.json", help="write the profile as JSON (atomically)")
    p.add_argument("--trace", metavar="TRACE.json", help="write a Chrome trace of the run (atomically)")
    p.add_argument("--op-summary", metavar="OUT.csv",
                   help="write msprof's op_summary table as CSV (atomically): one row per kernel task with msprof's "
                        "Atlas A2 PipeUtilization columns, N/A where the simulation has no figure; several --inputs: "
                        "one table, every run's kernels one after another, as msprof lists several iterations")
    p.add_argument("--timeline", metavar="OUT.png",
                   help="draw the run as a PNG (atomically): GE's passes, the Runtime's tasks, every pipe of the "
                        "cores; several --inputs: all runs one after another (needs matplotlib: the plot extra)")
    p.add_argument("--overlap-compile", type=int, metavar="PARTS",
                   help="cut the graph into up to PARTS subgraphs; GE compiles the next while the device runs the "
                        "current one, on one modelled timeline (reports time to first kernel, the compile hidden, "
                        "end to end against compile-then-run, and whether GE is the bottleneck)")
    p.add_argument("--resident", action="append", default=[], metavar="ARG",
                   help="an input that stays on the device between calls (a KV cache): not copied in; a shell "
                        "pattern such as 'l*_kcache' (may repeat)")
    p.add_argument("--timing-only", action="store_true",
                   help="time every task with the kernels' cost models and skip the arithmetic: the simulated "
                        "figures are the full run's, at a fraction of the host time; weights may be absent and "
                        "there are no results (--output and --check are refused)")
    p.add_argument("--launch", choices=("single-op", "graph"), default="single-op",
                   help="how the kernels reach the device: the host submits each launch (single-op, the default), "
                        "or the program's task graph is captured on the device once and each run replays it with "
                        "one submission (graph: ACL Graph, torchair's reduce-overhead; the profile's launch_mode)")
    p.add_argument("--explain", action="store_true",
                   help="print GE's fusion and tiling remarks, and what each re-plan for a new shape changed")
    p.add_argument("--inject-fault", action="append", default=[], metavar="KIND@N",
                   help=f"make the N-th task of KIND fail ({', '.join(FAULT_KINDS)})")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_tool(TOOL, run, build_arg_parser().parse_args(argv), on_interrupt=_Progress.clear_line)


# --- usage ------------------------------------------------------------------------------------------

def parse_fault(text: str) -> tuple[str, int]:
    """`KIND@N` -> (kind, n); ToolError (usage) when malformed."""
    m = re.fullmatch(r"([a-z_]+)@(\d+)", text)
    if not m or m.group(1) not in FAULT_KINDS:
        raise ToolError(f"--inject-fault: expected KIND@N with KIND one of {', '.join(FAULT_KINDS)} and N a "
                        f"non-negative integer, not '{text}'", EXIT_USAGE)
    return m.group(1), int(m.group(2))


# --- input file ----------------------------------------------------------------------------------------

# --- weights ---------------------------------------------------------------------------------------------

def _resource_consts(graph: Graph) -> list:
    return [op for op in graph.ops if op.name in ("ge.const", "rt.const")
            and isinstance(op.attributes.get("value"), DenseResourceAttr)]


def load_weights(graph: Graph, args: argparse.Namespace, printer: DiagnosticPrinter) -> dict[str, np.ndarray]:
    """The arrays the graph's dense_resource constants name, checked against their types."""
    consts = _resource_consts(graph)
    path = weights_path(args)
    if not consts:
        if args.weights:
            _load_npz(path, "weights")  # an explicit archive must at least be readable
        return {}
    if path is None or (not args.weights and not Path(path).is_file()):
        op = consts[0]
        where = f"expected '{path}' beside the input, or" if path else "give one with"
        printer(Diagnostic("error", f"no weights archive for dense_resource<\"{op.value.key}\">: {where} --weights "
                                    f"W.npz", op.attr_loc("value")))
        raise ToolError("")
    archive = _load_npz(path, "weights")
    weights: dict[str, np.ndarray] = {}
    failed = False
    for op in consts:
        key = op.value.key
        t: TensorType = op.results[0].type
        if key not in archive:
            printer(Diagnostic("error", f"weight '{key}' is not in the weights archive '{path}'", op.attr_loc("value")))
            failed = True
            continue
        a = archive[key]
        if tuple(a.shape) != tuple(t.shape):
            printer(Diagnostic("error", f"weight '{key}' in '{path}' has shape {list(a.shape)}, but the constant is "
                                        f"{t}", op.attr_loc("value")))
            failed = True
            continue
        problem, narrowing = array_dtype_problem(a, t.dtype)
        if problem:
            printer(Diagnostic("error", f"weight '{key}' in '{path}' {problem}", op.attr_loc("value")))
            failed = True
            continue
        if narrowing:
            printer(Diagnostic("warning", f"weight '{key}' in '{path}' is {a.dtype}: rounded to {t.dtype} "
                                          f"({narrowing})", op.attr_loc("value")))
        weights[key] = as_bf16(a) if t.dtype is DType.bf16 else a
    if failed:
        raise ToolError("")
    return weights


def as_bf16(a: np.ndarray) -> np.ndarray:
    """bf16 arrays as numpy stores them: np.savez of an ml_dtypes.bfloat16 array loads back as raw 2-byte void."""
    return a.view(DType.bf16.np) if a.dtype.kind == "V" and a.dtype.itemsize == 2 and a.dtype.names is None else a


def array_dtype_problem(a: np.ndarray, dtype: DType) -> tuple[str | None, str | None]:
    """(why the array cannot stand for a `dtype` tensor, or None; what a narrowing cast to it loses, or None)."""
    k = a.dtype.kind
    if dtype is DType.bf16 and as_bf16(a) is not a:
        return None, None
    if a.dtype.names is not None or k in "OSUVMm":
        return f"holds {a.dtype} data, which no GEIR dtype stands for", None
    if k == "c":
        return f"is complex ({a.dtype}): GEIR has no complex dtype, and dropping the imaginary part would change it", None
    if a.dtype == dtype.np or np.can_cast(a.dtype, dtype.np, "safe"):
        return None, None
    return None, "a narrowing cast"


def _load_npz(path: str, what: str) -> dict[str, np.ndarray]:
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):  # a .npy renamed: one array, not an archive
            raise ToolError(f"{what} '{path}' is not an npz archive (it holds a single .npy array)")
        with z:
            return {k: z[k] for k in z.files}
    except ToolError:
        raise
    except OSError as e:
        raise ToolError(f"cannot read {what} '{path}': {e.strerror or e}") from None
    except ValueError as e:
        if "allow_pickle" not in str(e):
            raise ToolError(f"cannot read {what} '{path}': {e}") from None
        # numpy's own words name a flag of its API; say what is in the file and what GEIR takes instead
        raise ToolError(f"cannot read {what} '{path}': it holds an object array (pickled Python objects), which GEIR "
                        f"never loads, as running a pickle can run any code; save numeric arrays (np.savez of arrays "
                        f"of a numeric or bool dtype)") from None
    except Exception as e:  # noqa: BLE001 - a corrupt archive (BadZipFile, ...)
        raise ToolError(f"cannot read {what} '{path}': {e}") from None


# --- inputs ----------------------------------------------------------------------------------------------

def random_inputs(graph: Graph, seed: int) -> dict[str, np.ndarray]:
    """Random inputs for every argument: normal floats, booleans for i1, small integers otherwise."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for a in graph.args:
        t: TensorType = a.type
        if not t.is_static:
            raise ToolError(f"argument %{a.name} is {t}: random inputs need static shapes; give --inputs")
        if t.dtype is DType.i1:
            out[a.name] = rng.random(t.shape) < 0.5
        elif t.dtype.is_float:
            out[a.name] = rng.standard_normal(t.shape, dtype=np.float32).astype(t.dtype.np)
        else:
            out[a.name] = rng.integers(-8, 8, size=t.shape).astype(t.dtype.np)
    return out


def resident_args(graph: Graph, patterns: list[str]) -> set[str]:
    """The arguments --resident names (shell patterns); a pattern that names none is a usage error."""
    import fnmatch

    names = [a.name for a in graph.args]
    chosen: set[str] = set()
    for pattern in patterns:
        hit = fnmatch.filter(names, pattern.lstrip("%"))
        if not hit:
            raise ToolError(f"--resident {pattern}: no argument of @{graph.name} matches (its arguments: "
                            f"{', '.join('%' + n for n in names[:8])}{', ...' if len(names) > 8 else ''})", EXIT_USAGE)
        chosen.update(hit)
    return chosen


def shape_inputs(graph: Graph) -> dict[str, np.ndarray]:
    """Stand-ins with every argument's shape and dtype and no memory (zero strides), for a timing-only run."""
    from geir.runtime.device import stand_in

    out: dict[str, np.ndarray] = {}
    for a in graph.args:
        t: TensorType = a.type
        if not t.is_static:
            raise ToolError(f"argument %{a.name} is {t}: a timing-only run takes its shapes from --inputs")
        out[a.name] = stand_in(t)
    return out


def npz_inputs(graph: Graph, path: str) -> dict[str, np.ndarray]:
    """Inputs read from an npz by argument name, cast to the argument dtype; shapes checked."""
    archive = _load_npz(path, "inputs")
    out: dict[str, np.ndarray] = {}
    for a in graph.args:
        t: TensorType = a.type
        if a.name not in archive:
            held = ", ".join(sorted(archive)) or "nothing"
            raise ToolError(f"inputs '{path}' has no array '{a.name}' for argument %{a.name} (it holds {held})")
        x = archive[a.name]
        if len(x.shape) != t.rank or any(d is not None and d != s for d, s in zip(t.shape, x.shape)):
            raise ToolError(f"input '{a.name}' in '{path}' has shape {list(x.shape)}, but %{a.name} is {t}")
        problem, _ = array_dtype_problem(x, t.dtype)
        if problem:
            raise ToolError(f"input '{a.name}' in '{path}' {problem}")
        x = as_bf16(x) if t.dtype is DType.bf16 else x
        try:
            with np.errstate(all="ignore"):
                out[a.name] = x.astype(t.dtype.np)
        except (TypeError, ValueError) as e:
            raise ToolError(f"input '{a.name}' in '{path}' ({x.dtype}) cannot be cast to {t.dtype}: {e}") from None
    return out


# --- running ---------------------------------------------------------------------------------------------

class _Progress(RuntimeListener):
    """A carriage-return progress line on stderr, only when stderr is a terminal: a Runtime listener, a step
    per kernel launch."""

    def __init__(self, total: int, label: str):
        self.total = total
        self.label = label
        self.on = total >= PROGRESS_MIN_KERNELS and sys.stderr.isatty()
        self.done = 0

    def step(self, name: str) -> None:
        self.done += 1
        if self.on:
            width = 30
            filled = width * self.done // self.total
            sys.stderr.write(f"\r{self.label}[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                             f"{name[:30]:<30}")
            sys.stderr.flush()

    def launched(self, task: Task, stats: KernelStats) -> None:
        """A kernel ran: one step of the line."""
        self.step(task.name)

    def close(self) -> None:
        if self.on:
            self.clear_line()

    @staticmethod
    def clear_line() -> None:
        if sys.stderr.isatty():
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def run_once(program: Graph, inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray], args: argparse.Namespace,
             faults: list[tuple[str, int]], label: str, memo=True):
    """One run of the program; ToolError with a one-line message when the Runtime fails (`memo`: timing
    only, the launches earlier runs of this invocation timed)."""
    from geir.runtime.interpreter import Runtime, RuntimeFailure

    launches = sum(1 for op in program.ops if op.name == "rt.launch")
    progress = _Progress(launches, label)
    runtime = Runtime(args.chip, record_pipes=bool(args.trace or args.timeline), faults=faults,
                      timing_only=args.timing_only, memo=memo, listeners=[progress], launch_mode=args.launch,
                      graphs=args.graphs)
    try:
        return runtime.run(program, inputs, weights, resident_args(program, args.resident))
    except RuntimeFailure as e:
        raise ToolError(str(e)) from None
    finally:
        progress.close()


def check_inputs_match(program: Graph, inputs: dict[str, np.ndarray], which: str) -> None:
    """A lowered rt.program runs only the shapes it was lowered for (a ge.graph is re-planned per shape)."""
    for a in program.args:
        x = inputs[a.name]
        if tuple(x.shape) != tuple(a.type.shape):
            raise ToolError(f"{which}: input '{a.name}' has shape {list(x.shape)}, but the program was compiled for "
                            f"{a.type}; give the ge.graph to have it re-planned for new shapes")


# --- check -----------------------------------------------------------------------------------------------

def check_run(reference: Graph, inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray],
              outputs: list[np.ndarray], types: list[TensorType], prefix: str) -> bool:
    """Run the float64 reference and the eager baseline, print one line per result and return whether all passed."""
    from geir.reference import ReferenceRunError, run_graph

    try:
        with np.errstate(all="ignore"):
            expected = run_graph(reference, inputs, float64=True, resources=weights)
            eager = run_graph(reference, inputs, resources=weights)
    except ReferenceRunError as e:
        raise ToolError(f"--check: the reference interpreter cannot run @{reference.name}: {e}") from None
    passed = True
    for i, (a, b, e, t) in enumerate(zip(outputs, expected, eager, types)):
        verdict = compare(a, b, t, e)
        passed &= verdict.passed
        print(f"check {verdict.render(f'{prefix}result{i}')}")
    return passed


# --- outputs ---------------------------------------------------------------------------------------------

def _storable(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


def outputs_npz(runs: list[list[np.ndarray]]) -> bytes:
    arrays: dict[str, np.ndarray] = {}
    for r, outs in enumerate(runs):
        for i, a in enumerate(outs):
            arrays[f"run{r}.result{i}" if len(runs) > 1 else f"result{i}"] = _storable(np.asarray(a))
    return npz_bytes(arrays)


def summary_line(name: str, a: np.ndarray, t: TensorType) -> str:
    a = np.asarray(a)
    if a.size and (a.dtype.kind == "f" or a.dtype.name == "bfloat16"):
        x = a.astype(np.float64)
        finite = x[np.isfinite(x)]
        stats = (f"mean {finite.mean():.6g}, std {finite.std():.6g}, min {finite.min():.6g}, max {finite.max():.6g}"
                 if finite.size else "no finite values")
        bad = a.size - finite.size
        return f"{name}: {t}  {stats}" + (f", {bad} non-finite" if bad else "")
    if a.size:
        return f"{name}: {t}  sum {a.astype(np.int64).sum()}, min {a.min()}, max {a.max()}"
    return f"{name}: {t}  (empty)"


# --- the tool --------------------------------------------------------------------------------------------

def weights_path(args: argparse.Namespace) -> str | None:
    """--weights, else the .npz beside FILE with its stem (None for stdin)."""
    if args.weights:
        return args.weights
    if args.input == "-" or is_onnx(args.input):  # an ONNX model carries its weights
        return None
    return str(Path(args.input).with_suffix(".npz"))


def refuse_overwriting_inputs(args: argparse.Namespace) -> None:
    """No output onto the graph, its weights or an --inputs archive, nor two outputs onto one file."""
    weights = ("--weights" if args.weights else "the weights archive beside FILE", weights_path(args))
    inputs = [("FILE", args.input), weights] + [("--inputs", path) for path in args.inputs]
    refuse_overwrites(inputs, output_flags(args))


def output_flags(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """Every file gerun may write, as (flag, path)."""
    return [("--output", args.output), ("--profile-json", args.profile_json), ("--trace", args.trace),
            ("--timeline", args.timeline), ("--op-summary", args.op_summary)]


def run(args: argparse.Namespace) -> int:
    args.chip = check_target(args.target)  # the typed Target every step below takes
    args.graphs = GraphCaptures()  # graph mode: each program captured once in this invocation, then replayed
    if args.timing_only and (args.output or args.check):
        raise ToolError(f"--timing-only computes no values: {'--output' if args.output else '--check'} needs a full "
                        f"run", EXIT_USAGE)
    refuse_overwriting_inputs(args)
    refuse_unwritable(output_flags(args))  # before the run, not after it
    if args.timeline:
        from geir.runtime.timeline import matplotlib_available

        if not matplotlib_available():  # said before anything runs, not after a long run
            raise ToolError("--timeline needs matplotlib: pip install -e '.[plot]'")
    faults: list[tuple[str, int]] = []
    requested_faults = [parse_fault(f) for f in args.inject_fault]
    sources = SourceManager()
    try:
        pipeline = checked_pipeline(args, sources)
    except ToolError as e:
        if not str(e):
            return e.code
        raise
    printer = DiagnosticPrinter(sources)
    try:
        return _run(args, pipeline, requested_faults, faults, sources, printer)
    except ToolError as e:
        if not str(e):  # diagnostics were printed already
            return e.code
        raise


def _run(args, pipeline: str, requested_faults, faults, sources, printer) -> int:
    from geir.session import Session, ShapeMismatch

    # a .geir file, or an .onnx model through the ONNX frontend (its weights with it), as gedoctor and getune read them
    module, name, text, onnx_weights = read_module(args.input, args.weights, sources, printer)
    graph = select_graph(module, args.entry, name)
    is_program = graph.kind == "rt.program"
    if is_program and args.check:
        raise ToolError(f"--check needs the graph: @{graph.name} in {name} is an rt.program (already lowered); "
                        f"run --check on the ge.graph it was lowered from", EXIT_USAGE)
    if is_program and (args.passes is not None or args.no_fuse):
        raise ToolError(f"@{graph.name} in {name} is an rt.program (already lowered): --passes and --no-fuse "
                        f"apply to a ge.graph", EXIT_USAGE)
    faults.extend(requested_faults)
    from geir.runtime.device import host_memory_problem

    too_big = host_memory_problem(graph, timing_only=args.timing_only)
    if too_big is not None:
        printer(too_big)
        return EXIT_FAILURE

    weights = {} if args.timing_only else onnx_weights if onnx_weights is not None else load_weights(graph, args,
                                                                                                        printer)

    if args.overlap_compile is not None:
        return _run_overlapped(args, module, graph, text, name, weights, is_program, pipeline)

    session = None
    if is_program:
        from geir.runtime.interpreter import load_tilings, no_target_note, target_mismatch

        program = graph
        mismatch = target_mismatch(program, args.chip)
        if mismatch is not None:
            printer(mismatch)
            return EXIT_USAGE  # the program is fine; the command asked for another chip
        assumed = no_target_note(program, args.chip)
        if assumed is not None:
            printer(assumed)
        # decoded once for this program: the runs below reuse these tilings
        problems = load_tilings(program, args.chip)[1]
        for d in problems:
            printer(d)
        if problems:
            return EXIT_FAILURE
    else:
        reference = select_graph(parse(text, name), args.entry, name) if args.check else None
        try:
            session = Session(Module([graph], module.file, module.resources), pipeline, args.chip, emit=printer,
                              explain=args.explain)
        except DiagnosticError:
            return EXIT_FAILURE  # the session printed the diagnostics
        except PipelineError as e:
            raise ToolError(f"--passes: {e}", EXIT_USAGE) from None
        program = session.generic

    # inputs for every run
    if args.inputs:
        runs = [npz_inputs(program, path) for path in args.inputs]
        labels = [f"--inputs {path}" for path in args.inputs]
    elif args.timing_only:  # only the shapes matter: zero-stride stand-ins, no memory
        runs = [shape_inputs(program)]
        labels = ["--timing-only"]
    else:
        runs = [random_inputs(program, 0 if args.seed is None else args.seed)]
        labels = [f"--seed {args.seed or 0}"]
    if session is None:
        for inputs, label in zip(runs, labels):
            check_inputs_match(program, inputs, label)

    several = len(runs) > 1
    results = []
    plan_caches = []
    programs = []
    host_ge_us: list[float] = []  # GE's host work each run waited for: the compile (run 0), a re-plan
    # GE's spans by the step they belong to: [0] the compile, [r + 1] what run r's re-plan did
    span_groups: list[list] = [list(session.spans) if session is not None else []]
    from geir.runtime.launch_memo import LaunchMemo

    memo = LaunchMemo()  # timing only: every run replays what an earlier one timed
    for r, inputs in enumerate(runs):
        if session is not None:
            # the plan cache: a new shape signature is specialised by GE, a known one reused
            before = (len(session.spans), session.misses)
            try:
                program = session.program({k: v.shape for k, v in inputs.items()})
            except DiagnosticError:
                return EXIT_FAILURE
            except ShapeMismatch as e:
                raise ToolError(f"{labels[r]}: {e}") from None
            plan_caches.append(dict(session.plan_cache))
            host_ge_us.append((session.compile_us if r == 0 else 0.0) + session.last_ge_us)
            span_groups.append(session.spans[before[0]:])
        programs.append(program)
        results.append(run_once(program, inputs, weights, args, faults, f"run {r} " if several else "", memo))
        if args.explain and session is not None and session.misses > before[1]:
            # the re-plan's host time beside the device time of the run it served, on the one timeline
            served = max((t.end_us for t in results[-1].tasks), default=0.0)
            print(f"{labels[r]}: {session.replans[-1].summary()}; the run it served took {served:.1f} us on "
                  f"the device (GE's re-plan is {session.last_ge_us / served if served else 0:.0f}x that)")
            for line in session.replans[-1].unfused + session.replans[-1].retiled:
                print(f"  {line}")
        elif args.explain and session is not None:
            print(f"{labels[r]}: plan cache hit, no re-plan")

    failed_checks = 0
    for r, (inputs, result) in enumerate(zip(runs, results)):
        result_types = list(programs[r].result_types)
        prefix = f"run{r}." if several else ""
        for i, a in enumerate(result.outputs):
            print(summary_line(f"{prefix}result{i}", a, result_types[i]))
        if args.timing_only:
            replayed = f" ({result.replayed} replayed from an identical launch)" if result.replayed else ""
            print(f"{prefix}timing only: {len(result.kernels)} kernels timed{replayed}, no values computed")
        if args.check:
            failed_checks += not check_run(reference, inputs, weights, result.outputs, result_types, prefix)
    if args.check:
        print("check: PASS" if not failed_checks else
              f"check: FAIL ({failed_checks} of {len(runs)} run(s) out of tolerance)")

    profiles = []
    if args.profile or args.profile_json:
        from geir.runtime.profile import format_profile, profile  # only when asked: a module of its own to compile

        for r, result in enumerate(results):
            cache = plan_caches[r] if plan_caches else {"hits": r, "misses": 1, "replan_ms": 0.0}
            profiles.append(profile(result, plan_cache=cache, host_ge_us=host_ge_us[r] if host_ge_us else 0.0))
    if args.profile:
        for r, p in enumerate(profiles):
            if several:
                print(f"-- run {r} --")
            print(format_profile(p))
    sys.stdout.flush()
    if failed_checks:
        return EXIT_FAILURE

    # every file is prepared first, then written: a failure leaves none behind
    files: list[tuple[str, str | bytes]] = []
    if args.output:
        files.append((args.output, outputs_npz([r.outputs for r in results])))
    if args.profile_json:
        doc = dict(profiles[-1])
        if several:
            doc["runs"] = profiles
        files.append((args.profile_json, json.dumps(_json_safe(doc), allow_nan=False)))
    # the one timeline: the compile, then per run GE's re-plan (if it needed one) and the run, one after another
    if args.trace or args.timeline:
        from geir.runtime.trace import chrome_trace_json, runs_trace

        trace = runs_trace(results, span_groups)
    if args.trace:
        files.append((args.trace, chrome_trace_json(trace)))
    if args.op_summary:
        files.append((args.op_summary, _op_summary_csv(results)))
    if args.timeline:
        from geir.runtime.timeline import render_png, timeline_data

        files.append((args.timeline, render_png(timeline_data(trace, results[0].target, f"{name} @{graph.name}"))))
    write_all_atomically(files)  # all or nothing: no file is replaced unless every one can be
    return EXIT_OK


def _run_overlapped(args, module: Module, graph: Graph, text: str, name: str, weights: dict[str, np.ndarray],
                    is_program: bool, pipeline: str) -> int:
    """gerun --overlap-compile: one run, GE compiling part k+1 while the Runtime runs part k."""
    from geir.session.pipelined import run_pipelined

    if is_program or args.overlap_compile < 1 or len(args.inputs) > 1 or args.inject_fault or args.timeline:
        raise ToolError("--overlap-compile takes a ge.graph, PARTS >= 1 and one set of inputs, without "
                        "--inject-fault or --timeline", EXIT_USAGE)
    inputs = npz_inputs(graph, args.inputs[0]) if args.inputs else (
        shape_inputs(graph) if args.timing_only else random_inputs(graph, args.seed or 0))
    try:
        run = run_pipelined(Module([graph], module.file, module.resources), inputs, weights,
                            parts=args.overlap_compile, pipeline=pipeline, target=args.chip,
                            timing_only=args.timing_only)
    except DiagnosticError as e:
        print_all(e, DiagnosticPrinter(SourceManager()))
        return EXIT_FAILURE
    summary = run.summary()
    result_types = list(graph.result_types)
    for i, a in enumerate(run.outputs):
        print(summary_line(f"result{i}", a, TensorType(a.shape, result_types[i].dtype)))
    failed = False
    if args.check:
        reference = select_graph(parse(text, name), args.entry, name)
        failed = not check_run(reference, inputs, weights, run.outputs,
                               [TensorType(a.shape, t.dtype) for a, t in zip(run.outputs, result_types)], "")
        print("check: PASS" if not failed else "check: FAIL (1 of 1 run(s) out of tolerance)")
    print(f"compile overlap: {summary['parts']} parts on one timeline; first kernel at "
          f"{summary['time_to_first_kernel_us']:.1f} us (compile-then-run: "
          f"{summary['compile_then_run_first_kernel_us']:.1f} us); end to end {summary['end_to_end_us']:.1f} us "
          f"(compile-then-run: {summary['compile_then_run_us']:.1f} us); GE compiled for {summary['compile_us']:.1f} us "
          f"of host time, {summary['compile_hidden_us']:.1f} us of it while the device ran; the device ran for "
          f"{summary['device_us']:.1f} us, {summary['kernel_time_us']:.1f} us of it kernels")
    print(f"compile overlap: {run.verdict()}")
    if failed:
        return EXIT_FAILURE
    files: list[tuple[str, str | bytes]] = []
    if args.output:
        files.append((args.output, outputs_npz([run.outputs])))
    if args.profile_json:
        doc = {"overlap_compile": {key: summary[key] for key in ("time_to_first_kernel_us", "compile_hidden_us",
                                                                  "end_to_end_us", "compile_then_run_us")}}
        doc["overlap_compile"].update({k: v for k, v in summary.items() if k not in doc["overlap_compile"]})
        files.append((args.profile_json, json.dumps(_json_safe(doc), allow_nan=False)))
    if args.trace:
        files.append((args.trace, run.trace()))
    if args.op_summary:  # the parts ran one after another: one table, as for several runs
        files.append((args.op_summary, _op_summary_csv(run.results)))
    write_all_atomically(files)
    return EXIT_OK


def _op_summary_csv(results: list) -> str:
    """msprof's op_summary CSV of the runs, one after another on one device timeline."""
    from geir.runtime.op_summary import op_summary_rows_of_runs, render_csv

    return render_csv(op_summary_rows_of_runs(results))


def _json_safe(x: Any) -> Any:
    """Plain JSON values: numpy scalars as Python numbers, non-finite floats as null."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


if __name__ == "__main__":
    sys.exit(main())
