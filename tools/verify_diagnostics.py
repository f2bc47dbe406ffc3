"""mlir-opt's --verify-diagnostics: compare the diagnostics produced with `expected-*` comments.

`// expected-error {{text}}` expects an error on its own line, `@+N` / `@-N` N lines below or
above; `expected-warning`, `expected-remark` and `expected-note` likewise. The text must appear
in the message. Every expectation must be met exactly once and nothing else may be reported.
"""

from __future__ import annotations

import re

import attrs

from geir.diagnostics import Diagnostic, Location

_EXPECTED = re.compile(r"expected-(error|warning|remark|note)(?:@([+-]\d+))?\s*\{\{(.*?)\}\}")


@attrs.define
class Expectation:
    severity: str
    text: str
    line: int  # the line the diagnostic must be on
    loc: Location  # where the expectation is written
    met: bool = False


def parse_expectations(text: str, file: str, line_offset: int = 0) -> list[Expectation]:
    """Every `expected-*` comment in a chunk of source text."""
    out = []
    for i, line in enumerate(text.split("\n")):
        comment = line.find("//")
        if comment < 0:
            continue
        for m in _EXPECTED.finditer(line, comment):
            lineno = i + 1 + line_offset
            delta = m.group(2) or "+0"
            # an offset longer than any line number is never met (and int() refuses over 4300 digits)
            target = lineno + int(delta) if len(delta) <= 19 else -1
            out.append(Expectation(m.group(1), m.group(3), target, Location(file, lineno, m.start() + 1)))
    return out


def check_diagnostics(expected: list[Expectation], produced: list[Diagnostic]) -> list[Diagnostic]:
    """Errors for every produced diagnostic nobody expected and every expectation not met."""
    problems: list[Diagnostic] = []
    for d in produced:
        for e in expected:
            if not e.met and e.severity == d.severity and e.line == d.loc.line and e.text in d.message:
                e.met = True
                break
        else:
            problems.append(Diagnostic("error", f"unexpected {d.severity}: {d.message}", d.loc))
        # notes attached to a diagnostic are matched like diagnostics of their own
        problems.extend(check_diagnostics(expected, list(d.notes)) if d.notes else [])
    return problems


def unmet(expected: list[Expectation]) -> list[Diagnostic]:
    return [Diagnostic("error", f'expected {e.severity} "{e.text}" was not produced', e.loc)
            for e in expected if not e.met]
