"""What every GEIR command-line tool shares: reading input, printing diagnostics, atomic output."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

from geir.passes import PipelineError, complete_pipeline, parse_pipeline, pipeline_text

from geir.diagnostics import Diagnostic, Location, SourceManager
from geir.ir import Graph, Module

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class ToolError(Exception):
    """A problem outside any source file (unreadable input, bad flag value) and its exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILURE):
        super().__init__(message)
        self.code = code


def read_input(path: str) -> tuple[str, bytes]:
    """(name used in diagnostics, raw bytes) of a file, or of stdin for '-'."""
    if path == "-":
        return "<stdin>", sys.stdin.buffer.read()
    try:
        return path, Path(path).read_bytes()
    except OSError as e:
        raise ToolError(f"cannot read '{path}': {e.strerror or e}") from None


def write_atomically(path: str, data: str | bytes) -> None:
    """Write the whole file or nothing: a temporary file beside it, then a rename.

    A target that exists and is no regular file (/dev/null, a pipe, a terminal) is written in
    place: renaming over it would replace the device with a file.
    """
    target = Path(path)
    mode = "wb" if isinstance(data, bytes) else "w"
    if target.exists() and not target.is_file() and not target.is_dir():
        try:
            with open(target, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
                f.write(data)
        except OSError as e:
            raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    except OSError as e:
        raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):  # e.g. OUT is a directory: a diagnostic, not a traceback
            raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
        raise


class DiagnosticPrinter:
    """Prints diagnostics to stderr with their source line and caret."""

    def __init__(self, sources: SourceManager, stream=None):
        self.sources = sources
        self.stream = stream or sys.stderr

    def __call__(self, diag: Diagnostic) -> None:
        print(self.sources.render(diag), file=self.stream)


def tool_error(tool: str, message: str) -> None:
    print(f"{tool}: error: {message}", file=sys.stderr)


def checked_pipeline(args: argparse.Namespace, sources: SourceManager) -> str:
    """--passes / --no-fuse as the pipeline text to compile with; a mistake in it is a usage error (with a caret)."""
    from geir.runtime.session import DEFAULT_PIPELINE, NO_FUSE_PIPELINE

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
    """Run a tool's body: its errors and anything unexpected become one `tool: error:` line, never a traceback."""
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
        tool_error(tool, "interrupted")
        return EXIT_FAILURE
    except Exception as e:  # noqa: BLE001 - a tool prints one line, never a traceback
        if os.environ.get("GEIR_TRACEBACK"):
            raise
        tool_error(tool, f"internal error: {type(e).__name__}: {e} (set GEIR_TRACEBACK=1 to see where)")
        return EXIT_FAILURE
