"""The `ge.` dialect: importing this package registers every graph op (see geir.opdef)."""

from geir.ops import core, elementwise, fused, linalg, reductions, shape_ops  # noqa: F401
