"""Registries filled by an explicit call, loaded on demand: the ops, the kernels and the passes by name.

Each registry is a mapping with a loader, as xDSL's `get_all_dialects()` / `get_all_passes()` are: the
loader registers the built-in entries (imports the modules that declare them) the first time anything
reads the registry, so no caller depends on which module happened to be imported first. Registering an
entry (a test's op, a plugin's pass) never triggers the load; reading always sees the built-ins.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable, Iterator, TypeVar

V = TypeVar("V")


class Registry(MutableMapping[str, V]):
    """Entries by name; `load` registers the built-in ones, called once before the first read."""

    def __init__(self, what: str, load: Callable[[], None]):
        self.what = what
        self._load = load
        self._entries: dict[str, V] = {}
        self._loaded = False

    @property
    def loaded(self) -> bool:
        """Whether the built-in entries have been registered (or are being registered now)."""
        return self._loaded

    def load(self) -> "Registry[V]":
        """Register the built-in entries now (once); the registry itself."""
        if not self._loaded:
            # set first: a module the loader imports may read the registry while it is being filled
            self._loaded = True
            try:
                self._load()
            except BaseException:
                self._loaded = False
                raise
        return self

    def __getitem__(self, name: str) -> V:
        return self.load()._entries[name]

    def __setitem__(self, name: str, value: V) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self.load()._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.load()._entries))

    def __len__(self) -> int:
        return len(self.load()._entries)

    def __repr__(self) -> str:
        return f"<{self.what}: {len(self._entries)} registered{'' if self._loaded else ', built-ins not loaded'}>"
