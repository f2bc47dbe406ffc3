"""The tuning repository: what getune measured, kept for GE's `tile{db=DB}` to consult (CANN AOE's knowledge base).

An SQLite file. Each op is keyed by its kernel, operand and result types, attributes, the buffers the tile
pass asks for, and the target (its name and a fingerprint of its numbers, so that a chip whose data
changed is a different chip). Every time is stored with the version of the cost model that measured it
(a fingerprint of the kernels' and the simulator's source): times of another version are not reused,
and an entry they made is not taken. For each key the repository keeps the simulated time of every candidate
tiling tried (so a sweep resumes where it stopped) and, once an op is tuned, its entry: the rules'
tiling and time, and the best tiling found with its time and the numerics check it passed. An entry is
only ever used when it beats the rules; one whose best is the rules' own tiling says so.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterable

import attrs

from geir.kernels.tiling import KernelTiling, OpSignature
from geir.target_npu.target import Target

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS measurements (
    op_key TEXT NOT NULL, target TEXT NOT NULL, model TEXT NOT NULL, tiling TEXT NOT NULL, time_us REAL NOT NULL,
    PRIMARY KEY (op_key, target, model, tiling));
CREATE TABLE IF NOT EXISTS entries (
    op_key TEXT NOT NULL, target TEXT NOT NULL, model TEXT NOT NULL,
    kernel TEXT NOT NULL, operands TEXT NOT NULL, results TEXT NOT NULL, attributes TEXT NOT NULL,
    buffers INTEGER NOT NULL,
    rules_tiling TEXT NOT NULL, rules_us REAL NOT NULL, tiling TEXT NOT NULL, time_us REAL NOT NULL,
    candidates INTEGER NOT NULL, check_report TEXT NOT NULL,
    PRIMARY KEY (op_key, target));
"""
# the columns each table must have (a file of an older layout lacks some; queries would fail on them)
_COLUMNS = {
    "meta": ("key", "value"),
    "measurements": ("op_key", "target", "model", "tiling", "time_us"),
    "entries": ("op_key", "target", "model", "kernel", "operands", "results", "attributes", "buffers", "rules_tiling",
                "rules_us", "tiling", "time_us", "candidates", "check_report"),
}


class RepositoryError(ValueError):
    """A tuning repository that cannot be opened or read (not SQLite, another schema); the message says which."""


def _is_time(value: Any) -> bool:
    """Whether a stored time is a finite, non-negative number of microseconds."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def default_path() -> Path:
    """Where getune keeps its repository unless told: the user's cache directory ($XDG_CACHE_HOME or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "geir" / "tuning.sqlite"


@functools.cache
def cost_model_version() -> str:
    """A fingerprint of the code that times a launch: the kernels' and the simulator's source files."""
    import geir.kernels
    import geir.target_npu.sim

    files = sorted(Path(geir.kernels.__file__).parent.glob("*.py")) + [Path(geir.target_npu.sim.__file__)]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


def target_key(target: Target) -> str:
    """The target as the repository keys it: its name and a fingerprint of every number in its data."""
    digest = hashlib.sha256(json.dumps(target.data, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{target.name}#{digest}"


def op_key(sig: OpSignature, buffers: int) -> str:
    """The op as the repository keys it: kernel, operand and result types, attributes and buffers."""
    name, operands, results, attributes = sig.key
    return json.dumps([name, list(operands), list(results), attributes, buffers])


def tiling_text(tiling: KernelTiling) -> str:
    """A tiling as the repository stores it: its IR attribute as canonical JSON."""
    return json.dumps(tiling.to_attr(), sort_keys=True)


@attrs.frozen
class Entry:
    """One tuned op: the rules' tiling and time, the best tiling found and its time (the rules' own when none
    beat them), how many candidates were timed, and the numerics check the best passed."""

    kernel: str
    rules_tiling: dict[str, Any]
    rules_us: float
    tiling: dict[str, Any]
    time_us: float
    candidates: int
    check: str
    model: str = ""  # the cost model version that measured it (cost_model_version())

    @property
    def current(self) -> bool:
        """Whether this version of the cost model measured it."""
        return self.model == cost_model_version()

    @property
    def beats_rules(self) -> bool:
        """Whether the best found is faster than the rules (the only case in which GE uses it)."""
        return self.time_us < self.rules_us and self.tiling != self.rules_tiling

    @property
    def speedup(self) -> float:
        return self.rules_us / self.time_us if self.time_us > 0 else 1.0


class TuningRepository:
    """An open tuning repository; `create` makes the file (and its directory) when it does not exist."""

    def __init__(self, path: str | os.PathLike, create: bool = False):
        self.path = Path(os.path.expanduser(str(path)))
        if self.path.is_dir():
            raise RepositoryError(f"'{self.path}' is a directory, not a tuning repository")
        if not self.path.exists():
            if not create:
                raise RepositoryError(f"no tuning repository at '{self.path}' (getune --db writes one)")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RepositoryError(f"cannot make the folder of '{self.path}': {e.strerror}") from None
        try:
            self._db = sqlite3.connect(self.path)
        except sqlite3.Error as e:
            raise RepositoryError(f"cannot open '{self.path}': {e}") from None
        try:
            self._check_layout()
        except RepositoryError:
            self._db.close()
            raise

    def _check_layout(self) -> None:
        """Make the tables of an empty file; refuse a database of another program, schema or layout, so that
        a query never meets a missing column and a write never lands in someone else's database."""
        try:
            tables = {name for (name,) in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables and "meta" not in tables:
                raise RepositoryError(f"'{self.path}' is an SQLite database of another program (it holds "
                                      f"{', '.join(sorted(tables))}), not a tuning repository")
            if not tables:
                self._write(lambda: self._db.executescript(_SCHEMA + f"INSERT INTO meta VALUES ('schema', "
                                                                     f"'{SCHEMA_VERSION}');"))
            row = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            # compared as text: SQLite may hand back the integer 1 for a value written as '1'
            if row is None or str(row[0]).strip() != str(SCHEMA_VERSION):
                which = "no schema version" if row is None else f"schema {row[0]!r}"
                raise RepositoryError(f"'{self.path}' is a tuning repository of {which}, not schema "
                                      f"{SCHEMA_VERSION}: give getune another --db, or remove it to start afresh")
            for table, columns in _COLUMNS.items():
                have = [r[1] for r in self._db.execute(f"PRAGMA table_info({table})")]
                missing = [c for c in columns if c not in have]
                if missing:
                    what = "no table" if not have else f"no column {', '.join(missing)} in table"
                    raise RepositoryError(f"'{self.path}' has {what} {table}: a tuning repository of another "
                                          f"layout than this GEIR's (schema {SCHEMA_VERSION}): give getune another "
                                          f"--db, or remove it to start afresh")
        except sqlite3.DatabaseError as e:
            raise RepositoryError(f"'{self.path}' is not a tuning repository: {e}") from None

    def check_writable(self) -> None:
        """RepositoryError now, not after the first candidates were timed, when the file cannot be written."""
        self._write(lambda: self._db.execute("UPDATE meta SET value = value WHERE key = 'schema'"))

    def _write(self, change: Any) -> None:
        """Run `change` in one transaction; RepositoryError when the file cannot be written (read-only, full disk)."""
        try:
            with self._db:
                change()
        except sqlite3.DatabaseError as e:
            raise RepositoryError(f"cannot write to the tuning repository '{self.path}': {e}") from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "TuningRepository":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- measurements ---------------------------------------------------------------------------

    def measured(self, key: str, target_key: str) -> dict[str, float]:
        """Every candidate timed so far for this op on this target: tiling text -> microseconds."""
        try:
            rows = self._db.execute("SELECT tiling, time_us FROM measurements WHERE op_key = ? AND target = ? AND "
                                    "model = ?", (key, target_key, cost_model_version())).fetchall()
        except sqlite3.DatabaseError as e:
            raise RepositoryError(f"'{self.path}' cannot be read: {e}") from None
        # a time that is not a finite, non-negative number (a damaged row) is dropped: the candidate is timed again
        return {t: float(us) for t, us in rows if isinstance(t, str) and _is_time(us)}

    def record(self, key: str, target_key: str, times: Iterable[tuple[str, float]]) -> None:
        """Store the times of some candidates (committed at once, so an interrupted sweep keeps them)."""
        rows = [(key, target_key, cost_model_version(), t, us) for t, us in times]
        self._write(lambda: self._db.executemany("INSERT OR REPLACE INTO measurements VALUES (?, ?, ?, ?, ?)", rows))

    def measurement_count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]

    # --- entries -------------------------------------------------------------------------------

    def store(self, sig: OpSignature, buffers: int, target_key: str, entry: Entry) -> None:
        """Keep an op's tuned entry (replacing an older one)."""
        name, operands, results, attributes = sig.key
        row = (op_key(sig, buffers), target_key, entry.model or cost_model_version(), name, json.dumps(list(operands)),
               json.dumps(list(results)), attributes, buffers, json.dumps(entry.rules_tiling), entry.rules_us,
               json.dumps(entry.tiling), entry.time_us, entry.candidates, entry.check)  # tilings in attribute order
        self._write(lambda: self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                                             "?, ?, ?)", row))

    def entry(self, sig: OpSignature, buffers: int, target: Target) -> Entry | None:
        """The op's tuned entry on this target, or None when it was never tuned."""
        tkey = target_key(target)
        try:
            row = self._db.execute(
                "SELECT kernel, rules_tiling, rules_us, tiling, time_us, candidates, check_report, model FROM entries "
                "WHERE op_key = ? AND target = ?", (op_key(sig, buffers), tkey)).fetchone()
        except sqlite3.DatabaseError as e:
            raise RepositoryError(f"'{self.path}' cannot be read: {e}") from None
        if row is None:
            return None
        kernel, rules_tiling, rules_us, tiling, time_us, candidates, check, model = row
        try:
            rules_tiling, tiling = json.loads(rules_tiling), json.loads(tiling)
        except (json.JSONDecodeError, TypeError) as e:
            raise RepositoryError(f"'{self.path}': the entry of {kernel} is not valid JSON: {e}") from None
        if not (isinstance(rules_tiling, dict) and isinstance(tiling, dict) and _is_time(rules_us)
                and _is_time(time_us) and isinstance(candidates, int) and isinstance(check, str)):
            raise RepositoryError(f"'{self.path}': the entry of {kernel} is damaged (its tilings are not dictionaries "
                                  f"or its times not non-negative numbers)")
        return Entry(kernel, rules_tiling, float(rules_us), tiling, float(time_us), candidates, check, model)

    def entry_count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
