"""Defining op kinds: the registry, typed attribute fields, operand accessors and generic checks.

An op kind is one class:

    @op("ge.softmax")
    class Softmax(Operation):
        OPERAND_NAMES = ("x",)
        TRAITS = (RowWise,)
        axis = Attr(int, default=-1)
        def verify(self): ...
        def infer(self, x): ...
        def compute(self, x): ...
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from geir.attributes import DenseAttr, DenseResourceAttr
from geir.ir import Operation
from geir.registry import Registry
from geir.traits import Trait
from geir.types import DType

REQUIRED = object()


def _load_dialects() -> None:
    from geir.ops import load_all

    load_all()


# The registry of op kinds by name ("ge.add" -> class): the ge and rt dialects are registered on the first read.
OPS: Registry[type[Operation]] = Registry("op kinds", _load_dialects)

# Attributes that passes may put on any op (they are not errors where an op does not declare them).
PASS_ATTRIBUTES = {"engine", "mem_offset", "mem_operand", "tiling", "workspace"}


class ShapeError(ValueError):
    """Operand types an op cannot accept; the message is shown at the op."""


_KIND_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    DType: "a dtype",
    "ints": "a list of integers",
    dict: "a dictionary",
    list: "a list",
    "dense": "a dense literal",
    "any": "a value",
}


class Attr:
    """A typed attribute field of an op kind; reads as the attribute's value on an op."""

    def __init__(self, kind: Any, default: Any = REQUIRED, choices: tuple | None = None):
        self.kind = kind
        self.default = default
        self.choices = choices
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, op: Operation | None, owner: type) -> Any:
        if op is None:
            return self
        return op.attributes.get(self.name, self.default_value)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def default_value(self) -> Any:
        return None if self.default is REQUIRED else self.default

    def check(self, value: Any) -> str | None:
        """Why `value` is not acceptable for this attribute, or None."""
        ok = _kind_ok(self.kind, value)
        if not ok:
            return f"attribute '{self.name}' must be {_KIND_NAMES[self.kind]}, not {describe_value(value)}"
        if self.choices is not None and value not in self.choices:
            options = " or ".join(_show(c) for c in self.choices)
            return f"attribute '{self.name}' must be {options}, not {_show(value)}"
        return None


def _show(v: Any) -> str:
    return f'"{v}"' if isinstance(v, str) else str(v)


def _kind_ok(kind: Any, value: Any) -> bool:
    if kind == "any":
        return True
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "ints":
        return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    if kind == "dense":
        return isinstance(value, (DenseAttr, DenseResourceAttr))
    return isinstance(value, kind)


def describe_value(value: Any) -> str:
    """A few words for the kind of an attribute value, for error messages."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value}"
    if isinstance(value, str):
        return f'the string "{value}"'
    if isinstance(value, DType):
        return f"the dtype {value}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a dictionary"
    return "a dense literal"


T = TypeVar("T", bound=type[Operation])


def op(name: str) -> Callable[[T], T]:
    """Register an op kind under `name`: accessors for its operands and attributes, and its bases' traits."""

    def register(cls: T) -> T:
        cls.ATTRS = {k: v for base in reversed(cls.__mro__) for k, v in vars(base).items() if isinstance(v, Attr)}
        cls.TRAITS = tuple(dict.fromkeys(t for base in reversed(cls.__mro__) for t in vars(base).get("TRAITS", ())))
        for i, operand in enumerate(cls.OPERAND_NAMES):
            setattr(cls, operand.rstrip("*+?"), _operand_accessor(i, operand))
        cls.NAME = name
        _check_row_facts(name, cls)
        OPS[name] = cls
        return cls

    return register


def _check_row_facts(name: str, cls: type) -> None:
    """An Elementwise or RowWise op must say what its kernel reads (passes, statistics, row axes): refused at
    registration rather than failing inside the kernel or costed by a silent default."""
    from geir.traits import ROW_STATISTICS, Elementwise, RowWise

    for trait in (Elementwise, RowWise):
        missing = [fact for fact in trait.REQUIRED if trait in cls.TRAITS and not hasattr(cls, fact)]
        if missing:
            raise TypeError(f"{name} has the {trait.__name__} trait but does not declare {', '.join(missing)} "
                            f"(what its kernel reads: geir/traits.py {trait.__name__})")
    if RowWise not in cls.TRAITS:
        return
    if cls.SEGMENT_STATISTIC not in ROW_STATISTICS:
        raise TypeError(f"{name}: SEGMENT_STATISTIC {cls.SEGMENT_STATISTIC!r} is not one of {', '.join(ROW_STATISTICS)}")


def _operand_accessor(i: int, spec: str) -> property:
    if spec.endswith(("*", "+")):
        return property(lambda self: self.operands[i:], doc=f"operands {i}...")
    if spec.endswith("?"):
        return property(lambda self: self.operands[i] if i < len(self.operands) else None, doc=f"operand {i}, if present")
    return property(lambda self: self.operands[i], doc=f"operand {i}")


def lookup(name: str) -> type[Operation] | None:
    """The class registered for an op name, or None."""
    return OPS.get(name)


def ops_with_trait(trait: type[Trait]) -> tuple[str, ...]:
    """The names of the registered op kinds that have `trait`, sorted (asked now: an op registered later counts)."""
    return tuple(sorted(name for name, cls in OPS.items() if cls.has_trait(trait)))


def operand_count_error(cls: type[Operation], count: int) -> str | None:
    """Why `count` operands do not suit this op kind, or None."""
    names = cls.OPERAND_NAMES
    least = sum(1 for n in names if not n.endswith(("?", "*")))
    most = None if any(n.endswith(("*", "+")) for n in names) else len(names)
    if count >= least and (most is None or count <= most):
        return None
    if most is None:
        return f"expects at least {least} operand{'s' * (least != 1)}, got {count}"
    want = str(least) if least == most else f"{least} or {most}"
    listed = ", ".join(n.rstrip("?") for n in names)
    return f"expects {want} operand{'s' * (most != 1)} ({listed}), got {count}"
