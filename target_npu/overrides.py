"""Target overrides: "what-if chips" whose numbers differ from a bundled (or user) target by named overrides.

A what-if chip is addressed by a plain string, `BASE[key=value,key=value]`, so it flows through every
API that takes a target name (`load_target`, a pass's `target` option, `--target`, the Runtime):

    ascend910b[ub_bytes=x2]                 twice the Unified Buffer
    ascend910b[l2_mib=384,hbm_tb_per_s=3.2] a bigger L2 and faster HBM
    chips/my_chip.toml[cube_cores=x0.5]     a user's target file with half its cube cores

Keys are the friendly names of OVERRIDE_KEYS or a raw dotted `table.key` of a numeric quantity the
target's data already holds (`memory.l2_mib`, `aicpu.cores`). Values are plain numbers in the key's
unit (`393216`, `1.5`), numbers with a unit suffix (`384KiB`, `2MiB`, `1GiB`, `3.2TB/s`, `800GB/s`,
`1500MHz`), or a multiplier of the base target's value (`x2`, `x0.5`, `2x`).

A what-if chip's name is its canonical spec: each quantity under one key (`l2_bytes=384MiB` and
`memory.l2_mib=384` both render as `l2_mib=384`) with its resolved value (`ub_bytes=x2` on the 910B
renders as `ub_bytes=393216`), so equal chips have equal names, and the name loads the same chip.
"""

from __future__ import annotations

import copy
import difflib
import re
from fractions import Fraction
from typing import Any, NamedTuple, Sequence

from geir.target_npu.target import Target, TargetError, _check_data


class OverrideError(ValueError):
    """A malformed override or spec (`KEY=VALUE`, `BASE[k=v,...]`), or one the target cannot take."""


class Quantity(NamedTuple):
    """Where a friendly key's number lives in the target data, and the size of its unit."""

    table: str
    key: str
    # One unit of the friendly key, in the dimension's base unit (bytes, bytes/s, Hz; 1 for plain numbers)
    unit: Fraction
    # "bytes", "rate" (bytes/s) and "freq" (Hz) take unit suffixes; "count" and "number" are plain numbers
    dimension: str


_B, _KIB, _MIB, _GIB = Fraction(1), Fraction(1024), Fraction(2**20), Fraction(2**30)

# Friendly keys. The first key listed for a quantity is the one its canonical spec uses.
OVERRIDE_KEYS: dict[str, Quantity] = {
    "ub_bytes": Quantity("buffers_kib", "ub", _B, "bytes"),
    "l1_bytes": Quantity("buffers_kib", "l1", _B, "bytes"),
    "l0a_bytes": Quantity("buffers_kib", "l0a", _B, "bytes"),
    "l0b_bytes": Quantity("buffers_kib", "l0b", _B, "bytes"),
    "l0c_bytes": Quantity("buffers_kib", "l0c", _B, "bytes"),
    "l2_mib": Quantity("memory", "l2_mib", _MIB, "bytes"),
    "l2_bytes": Quantity("memory", "l2_mib", _B, "bytes"),
    "hbm_gib": Quantity("memory", "hbm_gib", _GIB, "bytes"),
    "hbm_tb_per_s": Quantity("memory", "hbm_tb_per_s", Fraction(10**12), "rate"),
    "hbm_bandwidth": Quantity("memory", "hbm_tb_per_s", Fraction(10**12), "rate"),
    "clock_ghz": Quantity("cores", "clock_ghz", Fraction(10**9), "freq"),
    "cube_cores": Quantity("cores", "cube", Fraction(1), "count"),
    "vector_cores": Quantity("cores", "vector", Fraction(1), "count"),
    "gm_read_l2": Quantity("memory", "gm_read_bytes_per_cycle_l2", Fraction(1), "number"),
    "gm_read_hbm": Quantity("memory", "gm_read_bytes_per_cycle_hbm", Fraction(1), "number"),
    "dma_latency_cycles": Quantity("memory", "dma_latency_cycles", Fraction(1), "count"),
    "pcie_gb_per_s": Quantity("host", "pcie_gb_per_s", Fraction(10**9), "rate"),
    # 0: the cube and vector units as one AI core (GEIR's on-chip FlashAttention schedule), 1: separate cores
    # exchanging data through GM (Atlas A2's AIC and AIV); how the two models of one chip compare
    "separate_cube_vector": Quantity("cores", "separate_cube_vector", Fraction(1), "flag"),
}

# The canonical friendly key of each quantity that has one (the first listed above)
_CANONICAL: dict[tuple[str, str], str] = {}
for _name, _q in OVERRIDE_KEYS.items():
    _CANONICAL.setdefault((_q.table, _q.key), _name)

# Unit suffixes by dimension, lower-cased: bytes in powers of 1024 (as the buffers are sized), rates
# and clocks in powers of 1000 (as bandwidths and frequencies are quoted).
_SUFFIXES: dict[str, tuple[str, Fraction]] = {
    "b": ("bytes", _B), "kib": ("bytes", _KIB), "mib": ("bytes", _MIB), "gib": ("bytes", _GIB),
    "tb/s": ("rate", Fraction(10**12)), "gb/s": ("rate", Fraction(10**9)), "mb/s": ("rate", Fraction(10**6)),
    "ghz": ("freq", Fraction(10**9)), "mhz": ("freq", Fraction(10**6)),
}
# Decimal byte units are refused rather than guessed: a "KB" of buffer is ambiguous
_AMBIGUOUS = {"kb": "KiB", "mb": "MiB", "gb": "GiB"}

# Quantities the data holds as integers that may still become fractional: buffer sizes (KiB, in whole
# UB blocks), the L2 size and rates or times. Every other integer (cores, block sizes, cycles, the
# fusion guards' row counts) must stay a whole number.
_FRACTIONAL_OK = {
    ("memory", "l2_mib"), ("memory", "gm_read_bytes_per_cycle_l2"), ("memory", "gm_read_bytes_per_cycle_hbm"),
    ("memory", "onchip_bytes_per_cycle"), ("memory", "hbm_tb_per_s"), ("memory", "hbm_gib"), ("vector", "bytes_per_cycle"),
    ("aicpu", "clock_ghz"), ("aicpu", "cycles_per_op"), ("aicpu", "bytes_per_cycle"), ("aicpu", "task_overhead_us"),
    ("host", "pcie_gb_per_s"), ("host", "copy_latency_us"), ("host", "launch_latency_us"),
}

_FLAGS = {"0": 0, "1": 1, "false": 0, "true": 1}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_MULTIPLIER = re.compile(rf"[xX]({_NUMBER})|({_NUMBER})[xX]")
_QUANTITY = re.compile(rf"([+-]?{_NUMBER})([A-Za-z][A-Za-z/]*)?")
_MAX_EXPONENT = 30
_KEY = re.compile(r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?")


class _Value(NamedTuple):
    """A parsed value: a multiplier of the base's number, or an absolute number in data units."""

    factor: Fraction | None
    absolute: Fraction | None


def _data_unit(table: str, key: str) -> tuple[str, Fraction]:
    """The dimension and unit of a quantity as the data stores it, read off its name (`l2_mib`: MiB)."""
    if table == "buffers_kib" or key.endswith("_kib"):
        return "bytes", _KIB
    for tail, dim, unit in (("_gib", "bytes", _GIB), ("_mib", "bytes", _MIB), ("_bytes", "bytes", _B), ("_tb_per_s", "rate", Fraction(10**12)),
                            ("_gb_per_s", "rate", Fraction(10**9)), ("_ghz", "freq", Fraction(10**9))):
        if key.endswith(tail):
            return dim, unit
    return "number", Fraction(1)


def _quantity(key: str) -> Quantity | None:
    """The quantity a friendly or dotted key names (a dotted one in its data unit); None if unknown."""
    if key in OVERRIDE_KEYS:
        return OVERRIDE_KEYS[key]
    if "." in key:
        table, name = key.split(".")
        dim, unit = _data_unit(table, name)
        return Quantity(table, name, unit, dim)
    return None


def _unknown_key(key: str, data: dict[str, Any] | None = None) -> OverrideError:
    """The error for a key that names no quantity: the nearest key, and the friendly ones."""
    known = list(OVERRIDE_KEYS)
    if data is not None:
        known += [f"{t}.{k}" for t, sec in data.items() if isinstance(sec, dict)
                  for k, v in sec.items() if _is_number(v)]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return OverrideError(f"unknown override key '{key}'{hint} (keys: {', '.join(OVERRIDE_KEYS)}, "
                         f"or table.key for a number in the target file)")


def _is_number(v: Any) -> bool:
    """Whether a data value is a number (TOML's booleans are not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fraction(key: str, text: str, number: str) -> Fraction:
    """The exact value of a number as written; OverrideError for an exponent no chip needs."""
    mantissa, _, exponent = number.lower().partition("e")
    # Fraction("1e999999999") would compute the power exactly: refuse it before it takes the machine
    if exponent and abs(int(exponent)) > _MAX_EXPONENT:
        raise OverrideError(f"{key}={text}: the exponent of '{number}' is out of range (at most e{_MAX_EXPONENT})")
    return Fraction(number)


def _parse_value(key: str, q: Quantity, text: str) -> _Value:
    """One value of `key`: a multiplier, or a number (with an optional unit suffix) converted to data units."""
    if q.dimension == "flag":
        if text.lower() not in _FLAGS:
            raise OverrideError(f"{key}={text}: {key} takes 0 or 1 (or false, true), not '{text}'")
        return _Value(None, Fraction(_FLAGS[text.lower()]))
    m = _MULTIPLIER.fullmatch(text)
    if m:
        return _Value(_fraction(key, text, m.group(1) or m.group(2)), None)
    m = _QUANTITY.fullmatch(text)
    if not m:
        raise OverrideError(f"{key}={text}: '{text}' is not a number, a number with a unit (384KiB, 3.2TB/s) "
                            f"or a multiplier (x2, 0.5x)")
    number, suffix = _fraction(key, text, m.group(1)), m.group(2)
    size = q.unit
    if suffix:
        low = suffix.lower()
        if low in _AMBIGUOUS:
            raise OverrideError(f"{key}={text}: write {_AMBIGUOUS[low]} (powers of 1024), not '{suffix}'")
        dim, size = _SUFFIXES.get(low, (None, None))
        if dim is None:
            units = ", ".join(s for s, (d, _) in _SUFFIXES.items())
            raise OverrideError(f"{key}={text}: unknown unit '{suffix}' (units: {units}, any case)")
        if dim != q.dimension:
            takes = {"bytes": "a size in bytes (384KiB)", "rate": "a rate (3.2TB/s)", "freq": "a clock (1.5GHz)"}
            wants = takes.get(q.dimension, "a plain number")
            raise OverrideError(f"{key}={text}: {key} takes {wants}, not '{suffix}'")
    return _Value(None, number * size / _data_unit(q.table, q.key)[1])


def _check_key(key: str) -> Quantity:
    """The quantity of a syntactically valid key; OverrideError if it is malformed or an unknown friendly key."""
    if not _KEY.fullmatch(key):
        raise OverrideError(f"'{key}' is not an override key: a friendly name (ub_bytes) or table.key (memory.l2_mib)")
    q = _quantity(key)
    if q is None:
        raise _unknown_key(key)
    return q


def parse_override(text: str) -> tuple[str, list[str]]:
    """`KEY=V1[,V2...]` -> (key, values); each value is one point of a sweep. OverrideError if malformed."""
    key, eq, rest = text.partition("=")
    key = key.strip()
    if not eq:
        raise OverrideError(f"override '{text}' needs a value: KEY=VALUE[,VALUE...]")
    if not key:
        raise OverrideError(f"override '{text}' has no key before '='")
    q = _check_key(key)
    values = [v.strip() for v in rest.split(",")]
    if any(not v for v in values):
        raise OverrideError(f"override '{text}' has an empty value: KEY=VALUE[,VALUE...]")
    for v in values:
        _parse_value(key, q, v)
    return key, values


def split_spec(name: str) -> tuple[str, list[tuple[str, str]]]:
    """`BASE[k=v,k=v]` -> (BASE, [(k, v), ...]); a name without brackets -> (name, [])."""
    if not name.endswith("]"):
        return name, []  # a plain name, or a path that may hold brackets of its own
    # The overrides follow the last '[': values never hold one, a base path might
    open_ = name.rfind("[")
    if open_ < 0:
        raise OverrideError(f"'{name}' is not a target spec: BASE[key=value,...]")
    base, body = name[:open_].strip(), name[open_ + 1:-1]
    if not base:
        raise OverrideError(f"'{name}' names no base target before '['")
    if not body.strip():
        raise OverrideError(f"'{name}' has no overrides between '[' and ']'")
    items = []
    for part in body.split(","):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise OverrideError(f"'{part.strip()}' in '{name}' is not key=value (one value per key)")
        items.append((key, value))
    return base, items


def _render(value: int | float) -> str:
    """A resolved number as the spec writes it: ints plainly, floats by their shortest repr."""
    return str(value) if isinstance(value, int) else repr(value)


def target_spec(base: str, overrides: Sequence[tuple[str, str]]) -> str:
    """The canonical spec `BASE[key=value,...]` of `base` with `overrides`: keys in the order given, values resolved."""
    from geir.target_npu.target import load_target  # here, as target.py imports this module lazily

    try:
        target = load_target(base)
    except TargetError as e:
        raise OverrideError(str(e)) from None
    return apply_overrides(target, overrides, base=base).name


def apply_overrides(target: Target, overrides: Sequence[tuple[str, str]], *, base: str | None = None) -> Target:
    """A new Target: `target` with `overrides` ((key, value) pairs) applied, named by its canonical spec.

    `base` is the name the spec starts with (default: the target's name); overriding a what-if chip again
    merges into its overrides. The data is a deep copy, validated as a target file is; `data["overrides"]`
    holds the overridden quantities under their canonical keys, in their units.
    """
    if not overrides:
        return target
    data = copy.deepcopy(target.data)
    # Overriding a what-if chip again merges into its overrides, so its name still loads it from the root
    previous: dict[str, int | float] = dict(data["overrides"]) if "overrides" in data and "base" in data else {}
    root = data["base"] if previous else (base or target.name)
    given = [*(f"{k}={_render(v)}" for k, v in previous.items()), *(f"{k}={v}" for k, v in overrides)]
    where = f"{root}[{','.join(given)}]"
    changed: dict[tuple[str, str], int | float] = {}
    for key, text in overrides:
        try:
            value, entry = _apply_one(key, text, data)
        except OverrideError as e:
            raise OverrideError(f"{where}: {e}") from None
        if entry in changed:
            raise OverrideError(f"{where}: [{entry[0]}] {entry[1]} is overridden twice")
        data[entry[0]][entry[1]] = value
        changed[entry] = value
    _follow_vector_cores(target.data, data, changed, previous)
    try:
        _check_data(data, where)
    except TargetError as e:
        raise OverrideError(e.message) from None
    for (table, key), value in changed.items():
        if value < 0:  # quantities _check_data does not cover (fusion guards, ...): none is meaningfully negative
            raise OverrideError(f"{where}: [{table}] {key} must be non-negative, not {value}")
    merged = dict(previous)
    for (table, key), value in changed.items():
        name = _CANONICAL.get((table, key), f"{table}.{key}")
        merged[name] = _friendly(value, OVERRIDE_KEYS[name] if name in OVERRIDE_KEYS else None, table, key)
    spec = f"{root}[{','.join(f'{k}={_render(v)}' for k, v in merged.items())}]"
    data.update(name=spec, base=root, overrides=merged)
    # A what-if chip's numbers are no longer the platform file's: say so where the sources are cited
    if isinstance(data.get("source"), dict):
        data["source"]["overrides"] = f"what-if chip: {root} with {spec[len(root) + 1:-1]}"
    return Target(spec, data)


def _apply_one(key: str, text: str, data: dict[str, Any]) -> tuple[int | float, tuple[str, str]]:
    """The number one override stores, and the (table, key) it goes to; OverrideError if it cannot."""
    if "," in text:
        raise OverrideError(f"{key}={text}: one value per override (a list of values is a sweep of several chips)")
    if _KEY.fullmatch(key) and _quantity(key) is None:
        raise _unknown_key(key, data)  # with the target's dotted keys among the guesses
    q = _check_key(key)
    section = data.get(q.table)
    if q.dimension == "flag" and isinstance(section, dict):  # stored as 0 or 1; absent reads as 0
        return int(_parse_value(key, q, text).absolute), (q.table, q.key)
    if not isinstance(section, dict) or not _is_number(section.get(q.key)):
        if isinstance(section, dict) and q.key in section:
            raise OverrideError(f"{key}: [{q.table}] {q.key} is {section[q.key]!r}, not a number to override")
        if key in OVERRIDE_KEYS:
            raise OverrideError(f"{key}: the target has no number [{q.table}] {q.key} to override")
        raise _unknown_key(key, data)
    if not text:
        raise OverrideError(f"{key}= has an empty value")
    return _resolve(key, q, _parse_value(key, q, text), section[q.key], data), (q.table, q.key)


def _resolve(key: str, q: Quantity, value: _Value, current: int | float, data: dict[str, Any]) -> int | float:
    """The number to store (the multiplier applied to the current value, or the absolute one), typed as the data is."""
    # Floats from TOML count as the decimals they were written as (1.6 x 2 is 3.2, not 3.2000000000000002)
    exact = (Fraction(str(current)) * value.factor) if value.factor is not None else value.absolute
    assert exact is not None
    entry = (q.table, q.key)
    if q.table == "buffers_kib":
        # Buffers are allocated in UB blocks: a capacity must be a whole number of them
        block = data.get("memory", {}).get("ub_block_bytes", 32)
        nbytes = exact * 1024
        if nbytes.denominator != 1 or nbytes % block:
            raise OverrideError(f"{key}: {float(nbytes):g} bytes is not a multiple of the {block}-byte UB block")
    if isinstance(current, int):
        if exact.denominator == 1:
            return int(exact)
        if q.table != "buffers_kib" and entry not in _FRACTIONAL_OK:
            raise OverrideError(f"{key}: [{q.table}] {q.key} must be a whole number, not {float(exact):g}")
    return float(exact)


def _friendly(value: int | float, q: Quantity | None, table: str, key: str) -> int | float:
    """A stored number in its canonical key's unit (buffers in bytes), typed as stored (bytes always whole)."""
    if q is None:
        return value
    scale = _data_unit(table, key)[1] / q.unit
    if scale == 1:
        return value
    exact = Fraction(str(value)) * scale if isinstance(value, float) else value * scale
    return int(exact) if exact.denominator == 1 else float(exact)


def _follow_vector_cores(old: dict[str, Any], data: dict[str, Any], changed: dict[tuple[str, str], Any],
                         previous: dict[str, Any]) -> None:
    """On a target whose cube cores pair with vector cores (vector_per_cube), a new cube count moves the
    vector count with it, unless vector_cores was given: cube x vector_per_cube, plus any unpaired vector
    cores the base has (the 310P's 7 standalone vector cores stay)."""
    cores, before = data["cores"], old.get("cores", {})
    if "vector_per_cube" not in cores or ("cores", "vector") in changed or "vector_cores" in previous:
        return
    if ("cores", "cube") not in changed and ("cores", "vector_per_cube") not in changed:
        return
    try:
        unpaired = max(before["vector"] - before["cube"] * before["vector_per_cube"], 0)
        cores["vector"] = cores["cube"] * cores["vector_per_cube"] + unpaired
    except (KeyError, TypeError):  # a malformed [cores] table: _check_data says what is wrong
        pass
