"""Source locations and diagnostics printed as `FILE:LINE:COL: error: message` with a caret."""

from __future__ import annotations

from typing import Callable, Iterable

import attrs


@attrs.frozen(slots=True)
class Location:
    """A position in a source file; line and column are 1-based."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


UNKNOWN = Location("<unknown>", 0, 0)

SEVERITIES = ("error", "warning", "remark", "note")


@attrs.frozen
class Diagnostic:
    """One message attached to a location, with optional notes that follow it."""

    severity: str
    message: str
    loc: Location
    notes: tuple["Diagnostic", ...] = ()


class DiagnosticError(Exception):
    """Raised to abandon work after an error diagnostic; carries the diagnostics to show."""

    def __init__(self, *diags: Diagnostic):
        super().__init__("; ".join(f"{d.loc}: {d.message}" for d in diags))
        self.diagnostics = list(diags)


def error(message: str, loc: Location, notes: Iterable[Diagnostic] = ()) -> DiagnosticError:
    """An error diagnostic ready to raise."""
    return DiagnosticError(Diagnostic("error", message, loc, tuple(notes)))


class SourceManager:
    """Knows the text of every source it has seen, to print the line under a diagnostic."""

    def __init__(self) -> None:
        self._lines: dict[str, list[str]] = {}

    def add(self, name: str, text: str) -> None:
        self._lines[name] = text.split("\n")

    def line(self, loc: Location) -> str | None:
        lines = self._lines.get(loc.file)
        if lines is None or not 1 <= loc.line <= len(lines):
            return None
        return lines[loc.line - 1]

    def render(self, diag: Diagnostic) -> str:
        """Text of a diagnostic: header line, source line and caret, then its notes."""
        out = [self._render_one(diag)]
        out.extend(self._render_one(n) for n in diag.notes)
        return "\n".join(out)

    def _render_one(self, diag: Diagnostic) -> str:
        if diag.loc.line == 0:
            return f"{diag.loc.file}: {diag.severity}: {diag.message}"
        head = f"{diag.loc}: {diag.severity}: {diag.message}"
        src = self.line(diag.loc)
        if src is None:
            return head
        src = src.rstrip("\r")
        # keep tabs so the caret lines up under the same character in a terminal
        pad = "".join("\t" if c == "\t" else " " for c in src[: max(diag.loc.col - 1, 0)])
        shown = "".join(c if c.isprintable() or c == "\t" else "?" for c in src)
        return f"{head}\n{shown}\n{pad}^"


class DiagnosticEngine:
    """Routes diagnostics to a handler (print them, or collect them for --verify-diagnostics)."""

    def __init__(self, handler: Callable[[Diagnostic], None]):
        self.handler = handler
        self.error_count = 0

    def emit(self, diag: Diagnostic) -> None:
        if diag.severity == "error":
            self.error_count += 1
        self.handler(diag)

    def remark(self, message: str, loc: Location) -> None:
        self.emit(Diagnostic("remark", message, loc))

    def warning(self, message: str, loc: Location) -> None:
        self.emit(Diagnostic("warning", message, loc))
