"""geopt: parse, verify, run a pass pipeline over, and print GEIR (mlir-opt for GEIR)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import typing
from pathlib import Path

import attrs
from geir.passes import (
    PASSES,
    PassContext,
    PassManager,
    PipelineError,
    complete_pipeline,
    parse_pipeline,
    pipeline_text,
)
from geir.passes.pass_manager import unknown_pass_message
from geir.tools.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    DiagnosticPrinter,
    ToolError,
    add_target_options,
    add_version,
    check_target,
    decode_or_report,
    read_input,
    refuse_overwrites,
    refuse_unwritable,
    run_tool,
    write_all_atomically,
)
from geir.tools.verify_diagnostics import check_diagnostics, parse_expectations, unmet

from geir.diagnostics import (
    Diagnostic,
    DiagnosticEngine,
    DiagnosticError,
    Location,
    SourceManager,
)
from geir.dot import FusionRecorder, graph_title, to_dot
from geir.parser import parse
from geir.printer import print_module
from geir.verifier import verify_module

TOOL = "geopt"
SPLIT_MARKER = re.compile(r"^// -----\s*$", re.MULTILINE)


def _type_text(hint: typing.Any) -> str:
    """An option's type as written in --help: int, bool, str, or `int,...` for a list."""
    if typing.get_origin(hint) in (list, tuple):
        return f"{_type_text(typing.get_args(hint)[0])},..."
    return getattr(hint, "__name__", str(hint))


def _default_text(field: attrs.Attribute) -> str:
    default = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, (list, tuple)):
        return ",".join(str(x) for x in default) or "empty"
    return str(default) if default != "" else "empty"


def passes_help() -> str:
    """Every registered pass with the first line of its docstring, then its options with types and defaults."""
    lines = ["passes (--passes=PIPELINE, e.g. 'canonicalize,fuse{rules=softmax},plan{alignment=64}'):"]
    for name, cls in sorted(PASSES.items()):
        doc = (cls.__doc__ or "").strip().split("\n")[0]
        lines.append(f"  {name:<16}{doc}")
        hints = typing.get_type_hints(cls)
        for field in attrs.fields(cls):
            option = f"{field.name.replace('_', '-')}=<{_type_text(hints[field.name])}>"
            lines.append(f"      {option:<22}default {_default_text(field)}")
    return "\n".join(lines)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=TOOL,
        description="Parse a GEIR file, run passes over it and print the result.",
        epilog=passes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the pass table keeps its lines
    )
    add_version(p, TOOL)
    p.add_argument("input", nargs="?", default="-", help="a .geir file, or - for standard input (default)")
    p.add_argument("--passes", default="", metavar="PIPELINE",
                   help="passes to run, e.g. 'cse,canonicalize{...},dce' (default: none, a round trip)")
    p.add_argument("-o", dest="output", metavar="OUT", help="write the result here (atomically) instead of stdout")
    add_target_options(p)
    p.add_argument("--print-pipeline", action="store_true", help="print the pipeline actually run to stderr")
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass to stderr")
    p.add_argument("--print-ir-before", action="append", default=[], metavar="P",
                   help="print the IR before pass P (repeatable, or comma-separated)")
    p.add_argument("--print-ir-after", action="append", default=[], metavar="P",
                   help="print the IR after pass P (repeatable, or comma-separated)")
    p.add_argument("--timing", action="store_true", help="print a per-pass time table (parse and print included)")
    p.add_argument("--explain", action="store_true", help="print a remark for every fusion candidate, tiling choice and AI CPU placement")
    p.add_argument("--split-input-file", action="store_true", help="process each '// -----' chunk separately")
    p.add_argument("--verify-diagnostics", action="store_true",
                   help="check diagnostics against expected-error/warning/remark comments")
    p.add_argument("--no-verify", action="store_true", help="do not verify the IR after each pass")
    p.add_argument("--dot", metavar="OUT.dot",
                   help="also write the resulting graph as Graphviz DOT (atomically), the ops that fuse made "
                        "filled by rule, and beside it the same graph as a PNG drawn without Graphviz (OUT.png; "
                        "needs matplotlib: the plot extra); '--dot -' prints the DOT on stdout in place of the IR")
    return p


def picture_path(dot: str | None) -> str | None:
    """Where the PNG of the graph goes beside a --dot file (its stem with .png), or None: no DOT file (stdout, a
    device), or no matplotlib (a note says so)."""
    from geir.graph_picture import matplotlib_available

    if not dot or dot == "-" or (os.path.exists(dot) and not os.path.isfile(dot)):
        return None
    if not matplotlib_available():
        print(f"{TOOL}: note: no PNG beside {dot}: drawing it needs matplotlib: pip install -e '.[plot]'",
              file=sys.stderr)
        return None
    path = Path(dot).with_suffix(".png")
    return str(path if str(path) != dot else Path(dot + ".png"))


def _pass_names(values: list[str], flag: str) -> set[str]:
    names = {n for v in values for n in v.split(",") if n}
    unknown = sorted(names - set(PASSES))
    if unknown:
        raise ToolError(f"{flag}: {unknown_pass_message(unknown[0])}", EXIT_USAGE)
    return names


def split_chunks(text: str, split: bool) -> list[tuple[str, int]]:
    """(chunk text, number of lines before it) for each `// -----` chunk, or the whole text."""
    if not split:
        return [(text, 0)]
    chunks = []
    start, line = 0, 0
    for m in SPLIT_MARKER.finditer(text):
        chunks.append((text[start:m.start()], line))
        line += text.count("\n", start, m.end()) + 1
        start = m.end() + 1
    chunks.append((text[start:], line))
    return chunks


class Timer:
    """Accumulates wall time by name in first-seen order (parse, verify, each pass, print)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds

    def report(self) -> str:
        total = sum(self.times.values()) or 1e-12
        bar = "===" + "-" * 73 + "==="
        lines = [bar, "... Execution time report ...".center(79).rstrip(), bar,
                 f"  Total Execution Time: {total:.4f} seconds", "", "  ----Wall Time----  ----Name----"]
        for name, t in self.times.items():
            lines.append(f"  {t:9.4f} ({100 * t / total:5.1f}%)  {name}")
        lines.append(f"  {total:9.4f} (100.0%)  Total")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_tool(TOOL, run, build_arg_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    args.chip = check_target(args.target)  # the typed Target the passes take
    picture = picture_path(args.dot)
    outputs = [("-o", args.output), ("--dot", args.dot), ("the picture beside --dot", picture)]
    refuse_overwrites([("FILE", args.input)], outputs)
    refuse_unwritable(outputs)
    sources = SourceManager()
    try:
        pipeline = complete_pipeline(parse_pipeline(args.passes))
    except PipelineError as e:
        sources.add("--passes", args.passes)
        print(sources.render(Diagnostic("error", str(e), Location("--passes", 1, e.column + 1))), file=sys.stderr)
        return EXIT_USAGE
    before = _pass_names(args.print_ir_before, "--print-ir-before")
    after = _pass_names(args.print_ir_after, "--print-ir-after")
    if args.print_pipeline:
        print(pipeline_text(pipeline), file=sys.stderr)

    name, data = read_input(args.input)
    printer = DiagnosticPrinter(sources)
    text = decode_or_report(name, data, sources, printer)  # a binary file: one line, none of its bytes
    if text is None:
        return EXIT_FAILURE
    timer = Timer()

    def dump(when: str, p, module) -> None:
        print(f"// -----// IR Dump {when} {p.NAME} //----- //", file=sys.stderr)
        print(print_module(module), file=sys.stderr, end="")

    recorder = FusionRecorder()  # which ops fuse made, for --dot

    def dump_before(p, module) -> None:
        if args.dot:
            recorder.before(p, module)
        if p.NAME in before:
            dump("Before", p, module)

    def dump_after(p, module) -> None:
        if args.dot:
            recorder.after(p, module)
        if args.print_ir_after_all or p.NAME in after:
            dump("After", p, module)

    pm = PassManager(pipeline, verify_each=not args.no_verify, before=dump_before, after=dump_after)

    outputs: list[str] = []
    modules: list = []  # what each chunk became, for --dot
    failed = False
    for chunk, offset in split_chunks(text, args.split_input_file):
        produced: list[Diagnostic] = []
        engine = DiagnosticEngine(produced.append if args.verify_diagnostics else printer)
        out = _process_chunk(chunk, name, offset, engine, pm, args, timer, modules if args.dot else None)
        if out is not None:
            outputs.append(out)
        if args.verify_diagnostics:
            expected = parse_expectations(chunk, name, offset)
            problems = check_diagnostics(expected, produced) + unmet(expected)
            for d in problems:
                printer(d)
            failed |= bool(problems)
        else:
            failed |= out is None or engine.error_count > 0

    result = "// -----\n".join(outputs)
    dot = None
    if args.dot and not failed:
        graphs = [g for m in modules for g in m.graphs]
        dot = to_dot(graphs, recorder.marks(graphs), graph_title(name, pipeline_text(pipeline)))
    files: list[tuple[str, str | bytes]] = []  # -o and --dot: both or neither
    if args.output and not failed:
        files.append((args.output, result))
    if dot is not None and args.dot != "-":
        files.append((args.dot, dot))
        if picture is not None:  # the same graph drawn by matplotlib, for a reader without Graphviz
            from geir.graph_picture import graph_picture, render_png

            files.append((picture, render_png(graph_picture(graphs, recorder.marks(graphs),
                                                            graph_title(name, pipeline_text(pipeline))))))
    write_all_atomically(files)
    if args.dot == "-":
        if dot is not None:
            sys.stdout.write(dot)
            sys.stdout.flush()
    elif not args.output:
        sys.stdout.write(result)
        sys.stdout.flush()
    if args.timing:
        print(timer.report(), file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


def _process_chunk(source: str, name: str, offset: int, engine: DiagnosticEngine, pm: PassManager,
                   args: argparse.Namespace, timer: Timer, modules: list | None = None) -> str | None:
    """Parse, verify, run the pipeline and print one chunk; None when it failed (diagnostics emitted).

    When `modules` is given, the module the chunk became is appended to it.
    """
    t0 = time.perf_counter()
    try:
        module = parse(source, name, offset)
    except DiagnosticError as e:
        for d in e.diagnostics:
            engine.emit(d)
        return None
    finally:
        timer.add("parse", time.perf_counter() - t0)
    t0 = time.perf_counter()
    ok = verify_module(module, engine.emit)
    timer.add("verify", time.perf_counter() - t0)
    if not ok:
        return None
    ctx = PassContext(target=args.chip, diagnostics=engine, explain=args.explain)
    pm.timings = {}
    ok = pm.run(module, ctx)
    for pass_name, seconds in pm.timings.items():
        timer.add(pass_name, seconds)
    if not ok:
        return None
    t0 = time.perf_counter()
    text = print_module(module)
    timer.add("print", time.perf_counter() - t0)
    if modules is not None:
        modules.append(module)
    return text


if __name__ == "__main__":
    sys.exit(main())
