"""The `ge.` and `rt.` dialects: importing this package registers every op (see geir.opdef)."""

from geir.ops import conv, core, elementwise, fused, glu, indexing, linalg, reductions, rotary, rt, shape_ops, sizes  # noqa: F401
