"""Load a target description: a TOML file of the chip's numbers with their sources."""

from __future__ import annotations

import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Any

import attrs

TARGET_DIR = Path(__file__).with_name("targets")
DEFAULT_TARGET = "ascend910b"


@attrs.frozen
class Target:
    """A chip's numbers, as read from its data file (the raw tables stay available in `data`)."""

    name: str
    data: dict[str, Any] = attrs.field(repr=False)

    @property
    def clock_hz(self) -> float:
        return self.data["cores"]["clock_ghz"] * 1e9

    @property
    def cube_cores(self) -> int:
        return self.data["cores"]["cube"]

    @property
    def vector_cores(self) -> int:
        return self.data["cores"]["vector"]

    def buffer_bytes(self, name: str) -> int:
        """Capacity of an on-chip buffer (ub, l1, l0a, l0b, l0c) in bytes."""
        return self.data["buffers_kib"][name] * 1024


def available_targets() -> list[str]:
    """Names of the bundled targets."""
    return sorted(p.stem for p in TARGET_DIR.glob("*.toml"))


@lru_cache(maxsize=None)
def load_target(name_or_path: str = DEFAULT_TARGET) -> Target:
    """A bundled target by name, or a user's own TOML file by path (KeyError if neither)."""
    path = Path(name_or_path)
    if not (path.suffix == ".toml" and path.is_file()):
        path = TARGET_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise KeyError(name_or_path)
    data = tomllib.loads(path.read_text())
    return Target(data.get("name", path.stem), data)


def check_target(instance: object, attribute: object, name: str) -> None:
    """attrs validator for a pass's `target` option: empty (use --target), a bundled name, or a TOML path."""
    if name:
        try:
            load_target(name)
        except KeyError:
            raise ValueError(f"unknown target '{name}' (available: {', '.join(available_targets())})") from None
