"""GE, the graph engine: passes registered by name and the pattern-rewrite engine they share."""

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
from geir.passes import canonicalize, const_fold, conv2d, cse, dce, fuse, fusion_guards, infer_shapes, layout, lower, plan, tile  # noqa: F401,E402  (register the passes)

__all__ = [
    "PASSES", "Pass", "PassContext", "PassManager", "PipelineError", "complete_pipeline",
    "parse_pipeline", "pipeline_text", "register_pass",
]
