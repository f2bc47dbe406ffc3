"""What every GEIR command-line tool shares: reading input, printing diagnostics, atomic output."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from geir.passes import PipelineError, complete_pipeline, parse_pipeline, pipeline_text

from geir.diagnostics import Diagnostic, Location, SourceManager
from geir.ir import Graph, Module

from geir.files import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, ToolError, read_input, write_atomically  # noqa: F401


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
