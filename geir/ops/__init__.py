"""The `ge.` and `rt.` dialects: `load_all()` registers every op (geir.opdef.OPS calls it on its first read)."""

from __future__ import annotations

import importlib

# the modules that declare the ops, each registering its op kinds with geir.opdef.op when imported
DIALECT_MODULES = ("conv", "core", "elementwise", "fused", "glu", "indexing", "linalg", "moe", "paged", "reductions",
                   "rotary", "rt", "shape_ops", "sizes")


def load_all() -> None:
    """Register every op kind of the ge and rt dialects (importing a module twice registers nothing twice)."""
    for name in DIALECT_MODULES:
        importlib.import_module(f"geir.ops.{name}")
