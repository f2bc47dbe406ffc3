"""GE's session (CANN's `ge::Session`): compile a graph, specialise it per input shape signature
(the plan cache), compile the next subgraph while the Runtime runs the current one, and run the
result on the Runtime. It sits above GE's passes and the Runtime, and calls both."""

from geir.session.pipeline import (  # noqa: F401
    DEFAULT_PIPELINE,
    NO_FUSE_PIPELINE,
    compile_module,
    lowering_pipeline,
    run_passes,
    run_program,
)
from geir.session.plan_cache import Replan, Session, ShapeMismatch, bind_shapes  # noqa: F401
