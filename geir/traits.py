"""Op traits: facts about an op kind, declared on its class and queried instead of lists of op names.

An op kind declares its traits in a `TRAITS` tuple; a subclass has its bases' traits as well as
its own (geir.opdef.op collects them), so `ge.fused_matmul` is a cube op because `ge.matmul` is:

    @op("ge.softmax")
    class Softmax(Operation):
        TRAITS = (RowWise,)

Query an op or an op class with `op.has_trait(RowWise)`, or every registered op kind with
`geir.opdef.ops_with_trait(RowWise)`. The ops a `ge.fused_elementwise` body may chain are the
Elementwise ops that are not Fused (a body does not nest fused ops): see geir.ops.fused.chainable.
"""

from __future__ import annotations


class Trait:
    """A fact about an op kind; subclasses are the facts, never instantiated."""


class Elementwise(Trait):
    """Result element i depends only on element i of each operand, broadcast to the result's shape."""

    # what the vector kernel reads, declared by every op with the trait (checked when it is registered, `op()`):
    # VECTOR_PASSES, vector instructions per element of a tile on the AI Core (the obvious Ascend C sequence: Exp,
    # Ln, Sqrt, Div are one; pow is exp(b * ln a); tanh, sigmoid, silu, erf and gelu short exp/div or polynomial
    # sequences)
    REQUIRED = ("VECTOR_PASSES",)


class InPlaceCapable(Trait):
    """The result may take the memory slot of a same-sized operand that dies at this op, element by element."""


class Fused(Trait):
    """Made by fusion to stand for several ops (so never a step of a fused_elementwise body)."""


class CubeOp(Trait):
    """Runs on the cube unit: a matrix multiplication, possibly with work around it."""


class RowWise(Trait):
    """Reduces over rows: the vector kernel keeps each whole row in the Unified Buffer."""

    # what the row kernel reads, declared by every op with the trait (checked when it is registered, `op()`):
    # ROW_PASSES (vector instructions per element of a row tile), ROW_STAT_PASSES (of which a segmented row's
    # statistics pass does; None for a reduction, whose result is the statistic), SEGMENT_STATISTIC (how the
    # statistics of a row's segments combine: one of ROW_STATISTICS) and the classmethod row_axes(attributes,
    # rank) (the axes a row spans)
    REQUIRED = ("ROW_PASSES", "ROW_STAT_PASSES", "SEGMENT_STATISTIC", "row_axes")


# how the statistics of a long row's segments combine (the row kernel's `_SegmentStats`): partial sums, maxima,
# minima or means; online softmax's running max and sum; Chan's mean and M2 merge; a running sum of squares
ROW_STATISTICS = ("sum", "max", "min", "mean", "softmax", "mean_m2", "sum_of_squares")


class Normalization(Trait):
    """Normalises each row by its own statistics and scales it by learned weights (gamma)."""


class ShapeView(Trait):
    """A new shape over the same ND data in the same order: a view, no bytes need to move."""


class DataMovement(Trait):
    """Moves or reorders bytes and computes nothing."""


class ShapeOnly(Trait):
    """Reads only its operands' shapes, never their elements: it folds to a constant once the shapes are static."""


class TakesSizes(Trait):
    """Takes sizes from tensor operands (SIZE_OPERANDS): it becomes a static op once they are constants."""


class NoKernel(Trait):
    """Never launched as a kernel: the Runtime or the graph's bookkeeping provides it."""


class Terminator(Trait):
    """Ends its graph: its operands are the graph's results."""


class StaticForm:
    """Interface of an op that takes sizes (or indices) from tensors and has an equivalent op with static
    attributes once they are constants; const-fold rewrites it so when GE binds a shape signature."""

    def static_form(self, b) -> "object | None":
        """The equivalent static ops' result, built with builder `b` (set before this op); None while a size
        is not known."""
        raise NotImplementedError
