"""GE, the graph engine: passes registered by name and the pattern-rewrite engine they share.

`load_all()` registers GE's passes; PASSES calls it on its first read (`get_all_passes()` returns it loaded),
so importing a single pass module never leaves the registry half filled.
"""

from __future__ import annotations

import importlib

from geir.passes.pass_manager import (
    PASSES,
    Pass,
    PassContext,
    PassManager,
    PipelineError,
    complete_pipeline,
    parse_pipeline,
    pipeline_text,
    register_pass,
)

# the modules that declare GE's passes (each registers its passes with register_pass when imported)
PASS_MODULES = ("canonicalize", "const_fold", "conv2d", "cse", "dce", "fuse", "fusion_guards", "infer_shapes",
                "layout", "lower", "plan", "tile")


def load_all() -> None:
    """Register every pass of GE (importing a module twice registers nothing twice)."""
    for name in PASS_MODULES:
        importlib.import_module(f"geir.passes.{name}")


def get_all_passes() -> dict[str, type[Pass]]:
    """Every registered pass by name, GE's own loaded first."""
    return dict(PASSES.load())


__all__ = [
    "PASSES", "Pass", "PassContext", "PassManager", "PipelineError", "complete_pipeline", "get_all_passes",
    "load_all", "parse_pipeline", "pipeline_text", "register_pass",
]
