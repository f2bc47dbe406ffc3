"""Parse GEIR text into a Module, building the IR in Lark's LALR callbacks (no parse tree).

Every mistake becomes a DiagnosticError at the exact line and column: lexical and syntax errors
say in words what was expected; undefined and redefined values, unknown ops and dtypes, and
malformed literals are caught here. Op-specific checks (operand counts, attribute kinds, shape
rules) are the verifier's, so they apply equally to IR that passes build.
"""

from __future__ import annotations

import difflib
import json
import threading
from pathlib import Path
from typing import Any

import lark
from lark import Lark, Token
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from geir.attributes import DenseAttr, DenseResourceAttr, NestedDict, NestedList, literal_to_array
from geir.builder import create_op
from geir.diagnostics import Diagnostic, DiagnosticError, Location, error
from geir.ir import Graph, Module, Value
from geir.opdef import lookup
from geir.traits import Terminator
from geir.types import DTYPES, TensorType, TypeSyntaxError, int64, parse_type

MAX_NESTING = 64

# What each terminal is, in words, for "expected ..." messages.
_TERMINAL_WORDS = {
    "VALUE_ID": "a value name like %x",
    "SYMBOL": "a graph name like @main",
    "OP_NAME": "an op name like ge.add",
    "TENSOR_TYPE": "a type like tensor<4xf32>",
    "BARE_ID": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "SPECIAL_FLOAT": "a number",
    "STRING": 'a string like "text"',
    "GRAPH_KIND": "a graph (ge.graph or rt.program)",
    "_ATTRIBUTES": "'attributes'",
    "_ARROW": "'->'",
    "LSQB": "'['",
    "DENSE_OPEN": "'dense<'",
    "RESOURCE_OPEN": "'dense_resource<'",
    "$END": "the end of the input",
}


class _Builder(lark.Transformer):
    """Rule callbacks: each reduction builds a piece of IR directly."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file
        self.current: Graph | None = None
        self.scope: dict[str, Value] = {}
        self.graphs: dict[str, Graph] = {}
        self.module = Module(file=file)

    def loc(self, tok: Token) -> Location:
        return Location(self.file, tok.line, tok.column)

    def type_of(self, tok: Token) -> TensorType:
        try:
            return parse_type(str(tok))
        except TypeSyntaxError as e:
            raise error(str(e), Location(self.file, tok.line, tok.column + e.offset)) from None

    # --- graphs ----------------------------------------------------------------------------
    def start(self, children: list) -> Module:
        return self.module

    def graph_head(self, children: list) -> Graph:
        kind, sym, *args, sig, attr_dict = children
        name = str(sym)[1:]
        if name in self.graphs:
            raise error(f"redefinition of graph '@{name}'", self.loc(sym),
                        [Diagnostic("note", "previously defined here", self.graphs[name].loc)])
        self.scope = {}
        values = []
        for arg in args:
            if arg is None:
                continue
            tok, t = arg
            self.define(tok)
            v = Value(t, str(tok)[1:], None, len(values), self.loc(tok))
            self.scope[v.name] = v
            values.append(v)
        attributes, attr_locs = attr_dict if attr_dict is not None else ({}, None)
        g = Graph(name, values, sig, [], attributes, self.loc(sym), kind=str(kind), attr_locs=attr_locs)
        self.graphs[name] = g
        self.current = g
        return g

    def arg(self, children: list) -> tuple[Token, TensorType]:
        return children[0], self.type_of(children[1])

    def signature_results(self, children: list) -> list[TensorType]:
        return [self.type_of(t) for t in children if t is not None]

    def graph(self, children: list) -> Graph:
        g: Graph = children[0]
        self.module.graphs.append(g)
        self.current = None
        return g

    def define(self, tok: Token) -> None:
        name = str(tok)[1:]
        prev = self.scope.get(name)
        if prev is not None:
            raise error(f"redefinition of value '%{name}'", self.loc(tok),
                        [Diagnostic("note", "previously defined here", prev.loc)])

    # --- operations ------------------------------------------------------------------------
    def op(self, children: list) -> None:
        result_toks, name_tok, operand_toks, dense, attr_dict, types = children
        name = str(name_tok)
        cls = lookup(name)
        if cls is None:
            raise error(_unknown_op_message(name), self.loc(name_tok))
        first = result_toks[0] if result_toks else name_tok
        loc = self.loc(first)
        scope = self.scope
        operands = []
        for tok in operand_toks or ():
            v = scope.get(str(tok)[1:])
            if v is None:
                raise error(f"use of undefined value '{tok}'", self.loc(tok))
            operands.append(v)
        attributes, attr_locs = attr_dict if attr_dict is not None else ({}, None)
        if dense is not None:
            value, dense_tok = dense
            if "value" not in cls.ATTRS:
                raise error(f"{name} does not take a value; only ge.const does", self.loc(dense_tok))
            if "value" in attributes:
                raise error("the value is given twice: inline and as an attribute", self.loc(dense_tok))
            attributes["value"] = value
            attr_locs = dict(attr_locs or {}, value=self.loc(dense_tok))
        result_toks = result_toks or []
        want = cls.NUM_RESULTS
        if want is not None and len(result_toks) != want:
            if want == 0:
                raise error(f"{name} produces no results", loc)
            if not result_toks:
                raise error(f"{name} produces {want} result{'s' * (want != 1)}; name {'them' if want > 1 else 'it'}, "
                            f"as in `%r = {name} ...`", loc)
            raise error(f"{name} produces {want} result{'s' * (want != 1)}, but {len(result_toks)} names are bound", loc)
        result_types: list[TensorType | None]
        if types is None:
            result_types = [None] * len(result_toks)
        else:
            result_types = [self.type_of(t) for t in types]
            if cls.has_trait(Terminator):
                result_types = []  # checked against the operands below
                for tok, t, v in zip(types, [self.type_of(t) for t in types], operands):
                    if v.type is not None and v.type != t:
                        raise error(f"return type {t} contradicts the operand's type {v.type}", self.loc(tok))
                if len(types) != len(operands):
                    raise error(f"{name} has {len(operands)} operands but {len(types)} types", self.loc(types[0]))
            elif len(result_types) != len(result_toks):
                raise error(f"{name} has {len(result_toks)} result{'s' * (len(result_toks) != 1)} "
                            f"but {len(result_types)} type{'s' * (len(result_types) != 1)}", self.loc(types[0]))
        names = [str(tok)[1:] for tok in result_toks]
        locs = [loc] + [self.loc(tok) for tok in result_toks[1:]] if result_toks else []
        op = create_op(name, operands, result_types, attributes, loc, names, result_locs=locs, attr_locs=attr_locs,
                       op_class=cls)
        for tok, v in zip(result_toks, op.results):
            if v.name in scope:
                self.define(tok)
            scope[v.name] = v
        self.current._ops.append(op)

    def result_list(self, children: list) -> list[Token]:
        return children

    operand_list = result_list
    type_list = result_list

    # --- attributes ------------------------------------------------------------------------
    def attr_dict(self, children: list) -> tuple[dict[str, Any], dict[str, Location]]:
        out: dict[str, Any] = NestedDict()
        locs: dict[str, Location] = {}
        for entry in children:
            if entry is None:
                continue
            key_tok, value = entry
            key = _string(key_tok, self) if key_tok.type == "STRING" else str(key_tok)
            if key in out:
                raise error(f"attribute '{key}' is given twice", self.loc(key_tok))
            out[key] = value
            locs[key] = self.loc(key_tok)
        # lists and dictionaries count alike: the printer and passes recurse through both
        depth = 1 + max((v.depth for v in out.values() if isinstance(v, (NestedList, NestedDict))), default=0)
        if depth > MAX_NESTING:
            raise error(f"dictionaries nest more than {MAX_NESTING} deep", self.loc(children[0][0]))
        out.depth = depth
        return out, locs

    def attr_entry(self, children: list) -> tuple[Token, Any]:
        key, value = children
        if isinstance(value, tuple):  # a nested dictionary: keep its values, drop the locations
            value = value[0]
        return key, value

    def int_value(self, children: list) -> int:
        tok = children[0]
        try:
            return int64(str(tok), "integer literal")
        except ValueError as e:
            raise error(str(e), self.loc(tok)) from None

    def float_value(self, children: list) -> float:
        return float(children[0])

    def string_value(self, children: list) -> str:
        return _string(children[0], self)

    def word_value(self, children: list) -> Any:
        tok = children[0]
        word = str(tok)
        if word == "true":
            return True
        if word == "false":
            return False
        if word in DTYPES:
            return DTYPES[word]
        if word.startswith(("f", "i", "bf")) and word[-1].isdigit():
            raise error(f"unknown dtype '{word}' (expected one of {', '.join(DTYPES)})", self.loc(tok))
        raise error(f"unknown attribute value '{word}': expected a number, true, false, a string, "
                    f"a dtype, a list or a dictionary", self.loc(tok))

    def list_value(self, children: list) -> NestedList:
        bracket, *elements = children
        items = NestedList(x[0] if isinstance(x, tuple) else x for x in elements if x is not None)
        depth = 1 + max((x.depth for x in items if isinstance(x, (NestedList, NestedDict))), default=0)
        if depth > MAX_NESTING:
            raise error(f"lists nest more than {MAX_NESTING} deep", self.loc(bracket))
        items.depth = depth
        return items

    def dense_value(self, children: list) -> tuple[DenseAttr | DenseResourceAttr, Token]:
        opener, body = children
        if opener.type == "RESOURCE_OPEN":
            return DenseResourceAttr(_string(body, self)), opener
        try:
            return DenseAttr(literal_to_array(body)), opener
        except ValueError as e:
            raise error(str(e), self.loc(opener)) from None


def _string(tok: Token, builder: _Builder) -> str:
    try:
        s = json.loads(str(tok))
    except ValueError:
        raise error("bad escape in string", builder.loc(tok)) from None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape: no UTF-8 text can hold it
        raise error("string holds an unpaired surrogate escape", builder.loc(tok)) from None
    return s


def _unknown_op_message(name: str) -> str:
    from geir.opdef import OPS

    close = difflib.get_close_matches(name, list(OPS), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown op '{name}'{hint}"


_GRAMMAR = (Path(__file__).with_name("grammar.lark")).read_text()
_parser_lock = threading.Lock()
_lark: Lark | None = None
_builder: _Builder | None = None


def _get_parser() -> tuple[Lark, _Builder]:
    global _lark, _builder
    if _lark is None:
        _builder = _Builder("<input>")
        # cache=True keeps Lark's LALR tables in a temp file: every tool start after the first skips the
        # grammar analysis (a few tens of milliseconds, a noticeable part of a small geopt run)
        _lark = Lark(_GRAMMAR, parser="lalr", lexer="contextual", transformer=_builder,
                     maybe_placeholders=True, propagate_positions=False, cache=True)
    return _lark, _builder


def parse(text: str | bytes, file: str = "<input>", line_offset: int = 0) -> Module:
    """Parse a whole GEIR file; raises DiagnosticError on the first mistake.

    `line_offset` shifts reported lines (for chunks cut out of a larger file).
    """
    if isinstance(text, bytes):
        text = decode_source(text, file)
    if "\0" in text:
        line = text.count("\n", 0, text.index("\0")) + 1
        col = text.index("\0") - (text.rfind("\n", 0, text.index("\0")) + 1) + 1
        raise error("unexpected NUL byte", Location(file, line + line_offset, col))
    with _parser_lock:
        lk, builder = _get_parser()
        builder.__init__(file)
        try:
            lk.parse(("\n" * line_offset) + text if line_offset else text)
        except UnexpectedInput as e:
            raise _syntax_error(e, lk, file, text, line_offset) from None
        except RecursionError:
            raise error("input nests too deeply", Location(file, 1 + line_offset, 1)) from None
        module = builder.module
        builder.__init__(file)  # drop references to the IR
    if not module.graphs:
        raise error("expected a graph: `ge.graph @name(...) -> ... { ... }`", Location(file, 1 + line_offset, 1))
    return module


def parse_file(path: str) -> Module:
    """Parse the file at `path` (diagnostics name it as given)."""
    return parse(Path(path).read_bytes(), path)


def decode_source(data: bytes, file: str) -> str:
    """Source bytes as text; invalid UTF-8 is an error at the offending byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        # in characters, like every other column (the bytes before e.start on its line are valid UTF-8)
        col = len(data[data.rfind(b"\n", 0, e.start) + 1:e.start].decode("utf-8")) + 1
        raise error(f"input is not valid UTF-8 (byte 0x{data[e.start]:02x})", Location(file, line, col)) from None


def _syntax_error(e: UnexpectedInput, lk: Lark, file: str, text: str, line_offset: int) -> DiagnosticError:
    if isinstance(e, UnexpectedCharacters):
        ch = e.char or ""
        shown = ch if ch.isprintable() else repr(ch)[1:-1]
        expected = _expected_words(e.allowed, lk) if e.allowed else ""
        tail = f"; expected {expected}" if expected else ""
        return error(f"unexpected character '{shown}'{tail}", Location(file, e.line, e.column))
    if isinstance(e, UnexpectedEOF):
        lines = text.split("\n")
        loc = Location(file, len(lines) + line_offset, len(lines[-1]) + 1)
        return error(f"unexpected end of input; expected {_expected_words(e.expected, lk)}", loc)
    assert isinstance(e, UnexpectedToken)
    tok = e.token
    expected = _expected_words(e.accepts or e.expected, lk)
    if tok.type == "$END":
        lines = text.rstrip("\n").split("\n")
        loc = Location(file, len(lines) + line_offset, len(lines[-1]) + 1)
        return error(f"unexpected end of input; expected {expected}", loc)
    found = str(tok)
    if tok.type == "TENSOR_TYPE" or len(found) > 40:
        found = found[:40] + ("..." if len(found) > 40 else "")
    return error(f"expected {expected}, found '{found}'", Location(file, tok.line, tok.column))


def _expected_words(names: set[str], lk: Lark) -> str:
    patterns = {t.name: t.pattern for t in lk.terminals}
    words = []
    for n in names:
        w = _TERMINAL_WORDS.get(n)
        if w is None:
            p = patterns.get(n)
            w = f"'{p.value}'" if p is not None and p.type == "str" else n.lower()
        words.append(w)
    words = sorted(set(words), key=lambda w: (w.startswith("'"), w))
    if len(words) > 1:
        return ", ".join(words[:-1]) + " or " + words[-1]
    return words[0] if words else "something else"
