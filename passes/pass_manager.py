"""Passes by name, their typed options, pipeline strings, and the pass manager that runs them.

A pipeline is MLIR's syntax: `infer-shapes,fuse{rules=flash_attention disable=gelu},plan`.
A pass lists the passes whose results it needs in REQUIRES; the manager inserts any that have
not run yet, and `pipeline_text` shows the pipeline actually run.
"""

from __future__ import annotations

import difflib
import time
import typing
from typing import Any, Callable, ClassVar

import attrs

from geir.diagnostics import Diagnostic, DiagnosticEngine, DiagnosticError, Location
from geir.ir import Module
from geir.registry import Registry
from geir.target_npu.target import DEFAULT_TARGET, Target, as_target
from geir.verifier import verify_module


def _load_passes() -> None:
    from geir.passes import load_all

    load_all()


# Registered passes by name: GE's own passes are registered on the first read (get_all_passes).
PASSES: Registry[type["Pass"]] = Registry("passes", _load_passes)


@attrs.define
class PassContext:
    """What a pass may use besides the IR: the target, the diagnostics sink, --explain."""

    target: Target = attrs.field(default=DEFAULT_TARGET, converter=as_target)  # a name given is loaded
    diagnostics: DiagnosticEngine = attrs.field(factory=lambda: DiagnosticEngine(lambda d: None))
    explain: bool = False
    # tilings already chosen, by op signature: a runtime session keeps one across its shape
    # specialisations so that only ops whose shapes changed are tiled again
    tiling_memo: dict | None = None
    # the typed outcomes passes report for other code to consume (tiling decisions, fusion outcomes,
    # fusions undone); remarks are rendered from them, and nothing parses the remarks back
    records: list = attrs.field(factory=list)

    def record(self, outcome: Any) -> None:
        """Report a typed outcome of the running pass (collected whether or not --explain is on)."""
        self.records.append(outcome)

    def records_of(self, kind: type) -> list:
        """The outcomes of one kind reported so far, in order."""
        return [r for r in self.records if isinstance(r, kind)]

    def remark(self, message: str, loc: Location) -> None:
        """An --explain remark (dropped unless --explain is on)."""
        if self.explain:
            self.diagnostics.remark(message, loc)

    def error(self, message: str, loc: Location) -> None:
        self.diagnostics.emit(Diagnostic("error", message, loc))


class Pass:
    """A named transformation of a module; options are the attrs fields of the subclass."""

    NAME: ClassVar[str] = ""
    # passes whose results this one needs; inserted before it when they have not run yet
    REQUIRES: ClassVar[tuple[str, ...]] = ()

    def run(self, module: Module, ctx: PassContext) -> None:
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """Options that differ from their defaults."""
        out = {}
        for f in attrs.fields(type(self)):
            value = getattr(self, f.name)
            default = f.default.factory() if isinstance(f.default, attrs.Factory) else f.default
            if value != default:
                out[f.name] = value
        return out

    def text(self) -> str:
        """This pass as it would be written in a pipeline."""
        opts = self.options()
        if not opts:
            return self.NAME
        return self.NAME + "{" + " ".join(f"{k.replace('_', '-')}={_option_text(v)}" for k, v in opts.items()) + "}"


def _option_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


P = typing.TypeVar("P", bound=type[Pass])


def register_pass(name: str) -> Callable[[P], P]:
    """Register a pass class under `name`; its annotated fields become typed options."""

    def register(cls: P) -> P:
        if not attrs.has(cls):
            cls = attrs.define(kw_only=True)(cls)
        cls.NAME = name
        PASSES[name] = cls
        return cls

    return register


def closest(word: str, known: typing.Iterable[str]) -> str | None:
    """The known name `word` most likely misspells (difflib's closest match), or None."""
    matches = difflib.get_close_matches(word, list(known), n=1)
    return matches[0] if matches else None


class PipelineError(Exception):
    """A bad --passes string: the message and the 0-based column in the pipeline text."""

    def __init__(self, message: str, column: int):
        super().__init__(message)
        self.column = column


def parse_pipeline(text: str) -> list[Pass]:
    """`a,b{k=v k2=x,y},c` -> pass instances; raises PipelineError with the column of the mistake."""
    passes: list[Pass] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] == " ":
            i += 1
        if i >= n:
            break
        if passes:  # between two passes: one comma
            if text[i] != ",":
                raise PipelineError("expected ',' between passes", i)
            comma = i
            i += 1
            while i < n and text[i] == " ":
                i += 1
            if i >= n or text[i] == ",":
                raise PipelineError("expected a pass name after ','", comma if i >= n else i)
        elif text[i] == ",":
            raise PipelineError("expected a pass name before ','", i)
        start = i
        while i < n and text[i] not in ",{ ":
            i += 1
        name = text[start:i]
        cls = PASSES.get(name)
        if cls is None:
            raise PipelineError(unknown_pass_message(name), start)
        options: dict[str, tuple[str, int]] = {}
        if i < n and text[i] == "{":
            close = text.find("}", i)
            if close < 0:
                raise PipelineError("missing '}' after the options", i)
            j = i + 1
            body = text[j:close]
            for m in _option_items(body, j):
                key, value, col = m
                if key in options:
                    raise PipelineError(f"option '{key}' given twice", j + col)
                options[key] = (value, j + col)
            i = close + 1
            if i < n and text[i] not in ", ":
                raise PipelineError(f"expected ',' after the options of '{name}'", i)
        passes.append(_instantiate(cls, options))
    return passes


def unknown_pass_message(name: str) -> str:
    """`unknown pass 'fsue'; did you mean 'fuse'?`, or the known passes when none is close."""
    guess = closest(name, PASSES)
    if guess:
        return f"unknown pass '{name}'; did you mean '{guess}'?"
    return f"unknown pass '{name}' (known passes: {', '.join(sorted(PASSES))})"


def _option_items(body: str, base: int) -> list[tuple[str, str, int]]:
    """`k=v k2=v2` -> (key, value, offset in body) per item; errors carry the pipeline column (body starts at `base`)."""
    items = []
    pos = 0
    for part in body.split(" "):
        if part:
            key, eq, value = part.partition("=")
            if not eq:
                raise PipelineError(f"option '{key}' needs a value: {key}=...", base + pos)
            items.append((key, value, pos))
        pos += len(part) + 1
    return items


def _instantiate(cls: type[Pass], options: dict[str, tuple[str, int]]) -> Pass:
    fields = {f.name: f for f in attrs.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, (value, col) in options.items():
        field = fields.get(key.replace("-", "_"))
        if field is None:
            known = [f.replace("_", "-") for f in fields]
            guess = closest(key, known)
            hint = f"; did you mean '{guess}'?" if guess else f" (its options: {', '.join(known) or 'none'})"
            raise PipelineError(f"pass '{cls.NAME}' has no option '{key}'{hint}", col)
        try:
            kwargs[field.name] = _convert(value, hints[field.name])
        except ValueError as e:
            raise PipelineError(f"option '{key}' of pass '{cls.NAME}': {e}", col) from None
    try:
        return cls(**kwargs)
    except ValueError as e:  # an option validator refused a value
        col = min((c for _, c in options.values()), default=0)
        raise PipelineError(f"pass '{cls.NAME}': {e}", col) from None


def _convert(text: str, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1]
        return [_convert(x, item) for x in text.split(",") if x]
    if hint is bool:
        if text in ("true", "1"):
            return True
        if text in ("false", "0"):
            return False
        raise ValueError(f"expected true or false, got '{text}'")
    if hint is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got '{text}'") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got '{text}'") from None
    return text


def complete_pipeline(passes: list[Pass]) -> list[Pass]:
    """The pipeline with every pass's REQUIRES inserted before it, unless already run earlier."""
    out: list[Pass] = []
    done: set[str] = set()

    def add(p: Pass) -> None:
        for req in p.REQUIRES:
            if req not in done:
                add(PASSES[req]())
        out.append(p)
        done.add(p.NAME)

    for p in passes:
        add(p)
    return out


def pipeline_text(passes: list[Pass]) -> str:
    return ",".join(p.text() for p in passes)


@attrs.define
class PassManager:
    """Runs passes in order, verifying after each, with hooks for IR printing and timing."""

    passes: list[Pass]
    verify_each: bool = True
    before: Callable[[Pass, Module], None] | None = None
    after: Callable[[Pass, Module], None] | None = None
    timings: dict[str, float] = attrs.field(factory=dict)

    def run(self, module: Module, ctx: PassContext) -> bool:
        """Run the pipeline; False (with diagnostics emitted) when a pass or verification fails.

        GE's passes transform ge.graphs: a module holding an already lowered rt.program is refused
        (every pass would misread it: dce would find its tasks dead, tile would re-tile launches).
        """
        if self.passes:
            lowered = [g for g in module.graphs if g.kind == "rt.program"]
            for g in lowered:
                ctx.error(f"@{g.name} is an rt.program (already lowered): GE's passes "
                          f"('{self.passes[0].NAME}' first) run on a ge.graph", g.loc)
            if lowered:
                return False
        for p in self.passes:
            if self.before:
                self.before(p, module)
            errors = ctx.diagnostics.error_count
            t0 = time.perf_counter()
            try:
                p.run(module, ctx)
            except DiagnosticError as e:
                for d in e.diagnostics:
                    ctx.diagnostics.emit(d)
            ok = ctx.diagnostics.error_count == errors
            if ok and self.verify_each:
                ok = verify_module(module, ctx.diagnostics.emit)
                if not ok:
                    ctx.diagnostics.emit(Diagnostic("note", f"the IR did not verify after pass '{p.NAME}'",
                                                    Location(module.file, 0, 0)))
            self.timings[p.NAME] = self.timings.get(p.NAME, 0.0) + time.perf_counter() - t0
            if not ok:
                return False
            if self.after:
                self.after(p, module)
        return True
