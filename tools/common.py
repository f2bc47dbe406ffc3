"""What every GEIR command-line tool shares: reading input, printing diagnostics, atomic output."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from geir.passes import PipelineError, complete_pipeline, parse_pipeline, pipeline_text
from geir.target_npu.target import DEFAULT_TARGET, Target, available_targets, load_target

from geir.diagnostics import Diagnostic, DiagnosticError, Location, SourceManager
from geir.ir import Graph, Module

from geir.files import (  # noqa: F401
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    ToolError,
    output_problem,
    read_input,
    write_all_atomically,
    write_atomically,
)

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a program stopped by Ctrl-C


class DiagnosticPrinter:
    """Prints diagnostics to stderr with their source line and caret."""

    def __init__(self, sources: SourceManager, stream=None):
        self.sources = sources
        self.stream = stream or sys.stderr

    def __call__(self, diag: Diagnostic) -> None:
        print(self.sources.render(diag), file=self.stream)


def print_all(e: DiagnosticError, printer: DiagnosticPrinter) -> None:
    """Print every diagnostic an error carries."""
    for d in e.diagnostics:
        printer(d)


# a text file has few control bytes; a binary one (an .npz, an ONNX protobuf, a picture) has many
BINARY_SAMPLE_BYTES = 8192
BINARY_CONTROL_SHARE = 0.05
_TEXT_CONTROLS = b"\t\n\r\f\v\x1b"


def binary_kind(data: bytes) -> str | None:
    """What a binary input is ('a zip archive (an .npz?)', 'a binary file'), or None for text.

    A file is binary when its first bytes hold several NULs or more than BINARY_CONTROL_SHARE
    control bytes: one stray NUL in a text file is a diagnostic at its line, not a binary file.
    """
    sample = data[:BINARY_SAMPLE_BYTES]
    if not sample:
        return None
    controls = sum(1 for b in sample if b < 0x20 and b not in _TEXT_CONTROLS)
    if sample.count(0) < 2 and controls <= BINARY_CONTROL_SHARE * len(sample):
        return None
    if sample.startswith(b"PK\x03\x04"):
        return "a zip archive (an .npz? arrays go to --inputs or --weights)"
    return "a binary file"


def decode_or_report(name: str, data: bytes, sources: SourceManager, printer: DiagnosticPrinter) -> str | None:
    """The source text of an input (registered in `sources` for carets), or None with the error printed.

    A binary input is one `path: error:` line that echoes none of its bytes; text with a bad byte is
    a diagnostic at that byte, its line shown.
    """
    from geir.parser import decode_source

    kind = binary_kind(data)
    if kind is not None:
        printer(Diagnostic("error", f"{kind}, not GEIR text (a .geir file is UTF-8 text; an ONNX model is read by "
                                    f"its .onnx suffix)", Location(name, 0, 0)))
        return None
    try:
        text = decode_source(data, name)
    except DiagnosticError as e:
        sources.add(name, data.decode("utf-8", errors="replace"))
        print_all(e, printer)
        return None
    sources.add(name, text)
    return text


def parse_verified(name: str, data: bytes, sources: SourceManager, printer: DiagnosticPrinter) -> tuple[Module, str]:
    """A file's bytes decoded, parsed and verified, with its text (registered in `sources` for carets);
    on failure the diagnostics are printed and ToolError('') raised."""
    from geir.parser import parse
    from geir.verifier import verify_module

    text = decode_or_report(name, data, sources, printer)
    if text is None:
        raise ToolError("")
    try:
        module = parse(text, name)
    except DiagnosticError as e:
        print_all(e, printer)
        raise ToolError("") from None
    errors: list[Diagnostic] = []
    if not verify_module(module, errors.append):
        for d in errors:
            printer(d)
        raise ToolError("")
    return module, text


def is_onnx(path: str) -> bool:
    """Whether a tool reads FILE as an ONNX model (by its suffix, as gedoctor, getune and gerun do)."""
    return path.lower().endswith(".onnx")


def read_module(path: str, weights_flag: str | None, sources: SourceManager,
                printer: DiagnosticPrinter) -> tuple[Module, str, str, dict | None]:
    """(module, its name in diagnostics, its text, an ONNX model's weights or None) of FILE: a .geir file
    parsed and verified, or an .onnx model through the ONNX frontend (then --weights is a usage error)."""
    if is_onnx(path):
        if weights_flag:
            raise ToolError("--weights applies to a .geir file; an ONNX model carries its own weights", EXIT_USAGE)
        return _import_onnx(path, sources)
    name, data = read_input(path)
    module, text = parse_verified(name, data, sources, printer)
    return module, name, text, None


def import_model(path: str, sources: SourceManager) -> tuple[Module, dict]:
    """An ONNX model through the ONNX frontend, located in its text as geimport writes it; a clean error when it
    or onnx is missing."""
    module, _, _, weights = _import_onnx(path, sources)
    return module, weights


def _import_onnx(path: str, sources: SourceManager) -> tuple[Module, str, str, dict]:
    """(module, name, text, weights) of an ONNX model, its text registered in `sources` under the name."""
    from geir.parser import parse
    from geir.printer import print_module

    if not os.path.isfile(path):
        raise ToolError(f"cannot read '{path}': no such file")
    hint = "install the extra: pip install -e '.[onnx]'"
    try:
        from geir.frontends.onnx import OnnxImportError, import_onnx
    except ImportError as e:
        raise ToolError(f"cannot read ONNX models here: {e} ({hint})") from None
    try:
        module, weights = import_onnx(path)
    except OnnxImportError as e:
        raise ToolError(f"{path}: {e}") from None
    except ImportError as e:
        raise ToolError(f"cannot read ONNX models here: {e} ({hint})") from None
    # parsed back from its text, each op has a line a diagnostic or finding can point at and show
    name = f"{path} (as imported)"
    text = print_module(module)
    sources.add(name, text)
    return parse(text, name), name, text, dict(weights)


def tool_error(tool: str, message: str) -> None:
    print(f"{tool}: error: {message}", file=sys.stderr)


def version_line(tool: str) -> str:
    """`TOOL (GEIR) VERSION`, the version from the installed package's metadata."""
    from importlib import metadata  # only for --version: reading the metadata walks sys.path (tens of ms a start)

    try:
        version = metadata.version("geir")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
        version = "(not installed)"
    return f"{tool} (GEIR) {version}"


class _VersionAction(argparse.Action):
    """argparse's --version, with the line made only when --version is given (not on every start of the tool)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None, tool=""):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)
        self.tool = tool

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line(self.tool))
        parser.exit()


def add_version(parser: argparse.ArgumentParser, tool: str) -> None:
    parser.add_argument("--version", action=_VersionAction, tool=tool,
                        help="print the tool's name and GEIR's version, then exit")


def targets_summary() -> str:
    """One line per bundled target: its name, cores and clock."""
    lines = []
    for name in available_targets():
        t = load_target(name)
        default = "  (default)" if name == DEFAULT_TARGET else ""
        lines.append(f"{name:<12}{t.cube_cores:>3} cube cores, {t.vector_cores:>3} vector cores, "
                     f"{t.clock_hz / 1e9:.2f} GHz{default}")
    return "\n".join(lines)


class _ListTargets(argparse.Action):
    """--list-targets: print the bundled targets and exit 0, as --version does, whatever else is given."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(targets_summary())
        parser.exit(EXIT_OK)


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """--target NAME and --list-targets."""
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"simulated chip: a bundled name or a target .toml file (default {DEFAULT_TARGET})")
    parser.add_argument("--list-targets", action=_ListTargets,
                        help="print the bundled targets (cores, clock) and exit")


def check_target(name: str) -> Target:
    """The chip --target names (a bundled chip, a target file, a what-if spec); a usage error where none."""
    try:
        return load_target(name)
    except KeyError as e:  # TargetError: an unknown name (with the nearest one) or an invalid file, said in it
        raise ToolError(str(e), EXIT_USAGE) from None


def _written_in_place(path: str) -> bool:
    """An existing device, pipe or terminal: write_atomically writes it in place, it holds no file to lose."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False  # one of them does not exist (yet)


def refuse_overwrites(inputs: list[tuple[str, str | None]], outputs: list[tuple[str, str | None]]) -> None:
    """A usage error, before any work, when an output is an input or two outputs share a path.

    Each entry is (the flag as the user knows it, its path); None and '-' (stdin, stdout) and
    devices or pipes are left out. Paths are compared resolved, so `./a`, a symbolic link to it
    and a hard link of it all count as `a`.
    """
    def real(entries: list[tuple[str, str | None]]) -> list[tuple[str, str]]:
        return [(flag, path) for flag, path in entries if path and path != "-" and not _written_in_place(path)]

    outs, ins = real(outputs), real(inputs)
    for i, (flag, path) in enumerate(outs):
        for in_flag, in_path in ins:
            if _same_file(path, in_path):
                raise ToolError(f"{flag} '{path}' and {in_flag} '{in_path}' are the same file: an output must "
                                f"not overwrite an input", EXIT_USAGE)
        for other_flag, other in outs[:i]:
            if _same_file(path, other):
                raise ToolError(f"{other_flag} '{other}' and {flag} '{path}' are the same file: give each output "
                                f"its own path", EXIT_USAGE)


def refuse_unwritable(outputs: list[tuple[str, str | None]]) -> None:
    """An error (exit 1, as a failed write is) naming the flag and the path when an output cannot be written.

    Asked before any work, so that a long run does not end in `cannot write`; None and '-' (stdout)
    are left out. The write itself (write_all_atomically) still replaces all or nothing.
    """
    for flag, path in outputs:
        if path and path != "-":
            problem = output_problem(path)
            if problem is not None:
                raise ToolError(f"cannot write {flag} '{path}': {problem}")


def checked_pipeline(args: argparse.Namespace, sources: SourceManager) -> str:
    """--passes / --no-fuse as the pipeline text to compile with; a mistake in it is a usage error (with a caret)."""
    from geir.session.pipeline import DEFAULT_PIPELINE, NO_FUSE_PIPELINE

    if args.no_fuse:
        return NO_FUSE_PIPELINE
    if args.passes is None:
        return DEFAULT_PIPELINE
    try:
        passes = complete_pipeline(parse_pipeline(args.passes))
    except PipelineError as e:
        sources.add("--passes", args.passes)
        print(sources.render(Diagnostic("error", str(e), Location("--passes", 1, e.column + 1))), file=sys.stderr)
        raise ToolError("", EXIT_USAGE) from None
    if "lower" in [p.NAME for p in passes][:-1]:
        raise ToolError(f"--passes: lower must be the last pass (pipeline: {pipeline_text(passes)})", EXIT_USAGE)
    return args.passes if passes else "lower"


def select_graph(module: Module, entry: str | None, name: str) -> Graph:
    """The graph named by --entry, else @main, else the only graph."""
    names = ", ".join(f"@{g.name}" for g in module.graphs)
    try:
        return module.graph(entry)
    except KeyError:
        if entry is not None:
            raise ToolError(f"{name} has no graph @{entry} (it holds {names or 'none'})") from None
        raise ToolError(f"{name} holds several graphs ({names}) and none is @main: choose one with --entry") from None


def run_tool(tool: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
             on_interrupt: Callable[[], None] | None = None) -> int:
    """Run a tool's body: its errors and anything unexpected become one `tool: error:` line, never a traceback.

    Ctrl-C is one `tool: interrupted` line and exit 130; an output already written stays whole
    (write_atomically renames only complete files).
    """
    try:
        return run(args)
    except ToolError as e:
        if str(e):  # an empty message: the diagnostics were printed already
            tool_error(tool, str(e))
        return e.code
    except BrokenPipeError:
        return EXIT_FAILURE
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        print(f"{tool}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a tool prints one line, never a traceback
        if os.environ.get("GEIR_TRACEBACK"):
            raise
        tool_error(tool, f"internal error: {type(e).__name__}: {e} (set GEIR_TRACEBACK=1 to see where)")
        return EXIT_FAILURE


def non_negative(text: str) -> int:
    """argparse type of a count or a seed: a non-negative integer (numpy's generators take no negative seed)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{text}'") from None  # argparse's own words
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


seed = non_negative  # --seed: numpy's generators take no negative seed
