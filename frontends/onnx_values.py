"""Building a GEIR graph while importing ONNX: each ONNX value is a constant known now or an IR value.

Constants stay numpy arrays until an op that is not itself constant needs them; an op whose
operands are all constants is evaluated on the spot with the GEIR op's own semantics
(`geir.reference.run_op`), so shape arithmetic folds away and only the model's real computation
reaches the graph.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from geir.attributes import MAX_LITERAL_RANK, DenseAttr
from geir.builder import Builder, create_op, infer_result_types
from geir.ir import Graph, Value
from geir.opdef import ShapeError
from geir.ops.sizes import data_source
from geir.reference import run_op
from geir.traits import TakesSizes, Terminator
from geir.types import DType, TensorType
from geir.verifier import size_problem

# Initializers (and constants computed from them: weights stay weights) larger than this go to the
# weights archive (dense_resource); smaller ones are literals.
WEIGHT_INLINE_ELEMENTS = 16
# Constants computed at import (masks, shapes, scales) stay literals up to const-fold's default size,
# so later passes can read them (a causal mask is recognised by its values).
COMPUTED_INLINE_ELEMENTS = 1 << 16


class ImportProblem(Exception):
    """A problem with the node being converted; the importer adds which node it was.

    `unsupported` marks what GEIR cannot express (an op, a dtype, a value only known at run time),
    as opposed to a model that is malformed.
    """

    def __init__(self, message: str, unsupported: bool = True):
        super().__init__(message)
        self.unsupported = unsupported


def dtype_of(np_dtype: np.dtype) -> DType:
    """The GEIR dtype of a numpy dtype; ImportProblem when GEIR has none (float64, uint8, strings, ...)."""
    try:
        return DType.from_numpy(np_dtype)
    except (KeyError, TypeError):
        raise ImportProblem(f"GEIR has no dtype for {np.dtype(np_dtype).name} "
                            f"(it has {', '.join(d.value for d in DType)})") from None


def storable(array: np.ndarray) -> np.ndarray:
    """The array as it goes into a dense literal or the weights archive (bf16 held as float32, exactly)."""
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def _is_splat(arr: np.ndarray) -> bool:
    """Every element is the same (floats compared bit for bit: -0.0 and 0.0 differ, equal NaNs agree)."""
    if arr.size == 0:
        return False
    a = storable(arr).reshape(-1)  # flat: numpy cannot compare an array of over 32 dimensions with its element
    if a.dtype.kind == "f":
        a = a.view(f"u{a.dtype.itemsize}")
    return bool(np.all(a == a[0]))


@attrs.define(eq=False)
class Tensor:
    """An ONNX value during import: `array` when known at import time, `value` once it is in the graph."""

    value: Value | None = None
    array: np.ndarray | None = None
    name: str = ""
    # an initializer or computed from one: weights go to the archive rather than into the text
    initializer: bool = False

    @property
    def is_const(self) -> bool:
        return self.array is not None

    @property
    def type(self) -> TensorType:
        if self.value is not None:
            return self.value.type
        return TensorType(tuple(int(d) for d in self.array.shape), dtype_of(self.array.dtype))

    @property
    def shape(self) -> tuple:
        return tuple(self.array.shape) if self.array is not None else self.value.type.shape

    @property
    def rank(self) -> int:
        return len(self.shape)


class GraphBuilder(Builder):
    """geir.builder's Builder for the ONNX importer: folds ops whose operands are all constants."""

    def __init__(self, graph: Graph):
        super().__init__(graph)
        self.resources: dict[str, np.ndarray] = {}

    def _resource_key(self, onnx_name: str) -> str:
        base = self.NAME_CHARS.sub("_", onnx_name) or "weight"
        key, i = base, 1
        while key in self.resources:
            key, i = f"{base}_{i}", i + 1
        return key

    # --- values ------------------------------------------------------------------------------------
    def const(self, array: Any, dtype: Any = None, name: str = "") -> Tensor:
        """A constant tensor (nothing is added to the graph until an op needs it)."""
        return Tensor(array=np.asarray(array, dtype=dtype), name=name)

    def value_of(self, t: Tensor) -> Value:
        """The IR value of a tensor, adding a `ge.const` for a constant the first time it is needed."""
        if t.value is None:
            arr = t.array
            limit = WEIGHT_INLINE_ELEMENTS if t.initializer else COMPUTED_INLINE_ELEMENTS
            name = t.name or None
            if _is_splat(arr):
                t.value = self.constant(DenseAttr(storable(np.asarray(arr.flat[0]))), t.type, name=name)  # one value
            elif arr.size > limit or arr.ndim > MAX_LITERAL_RANK:  # the archive holds any rank, a literal 32
                key = self._resource_key(t.name or "const")
                self.resources[key] = storable(np.ascontiguousarray(arr))
                t.value = self.resource(key, t.type, name=name)
            else:
                t.value = self.constant(DenseAttr(storable(np.ascontiguousarray(arr))), t.type, name=name)
        return t.value

    # --- ops ---------------------------------------------------------------------------------------
    def emit(self, name: str, operands: list[Tensor], attrs: dict[str, Any] | None = None,
             results: int = 1) -> list[Tensor]:
        """Add `name(operands) {attrs}`, or evaluate it now when every operand is a constant."""
        # checked, typed and (when it can be) evaluated detached, before any operand is materialised
        probe = create_op(name, [], [None] * results, attrs)
        for key, spec in probe.ATTRS.items():
            if key in probe.attributes:
                why = spec.check(probe.attributes[key])
            else:
                why = f"needs attribute '{key}'" if spec.required else None
            if why is not None:
                raise ImportProblem(f"{name}: {why}", unsupported=False)
        why = probe.verify()
        if why is not None:
            raise ImportProblem(f"{name}: {why}", unsupported=False)
        try:
            inferred = infer_result_types(probe, [t.type for t in operands])
        except ShapeError as e:
            raise ImportProblem(str(e), unsupported=False) from None
        for t in inferred:
            why = size_problem(t) if t is not None else None
            if why is not None:
                raise ImportProblem(f"{name}: {why}", unsupported=True)
        if probe.has_trait(TakesSizes):  # its result type reads the size operands themselves, not only their types
            values = [self.value_of(t) for t in operands]
            for i in probe.SIZE_OPERANDS:
                source = data_source(values[i])
                if source is not None:
                    raise ImportProblem(f"{name}: its {probe.OPERAND_NAMES[i]} is computed from the values of input "
                                        f"'{source.name}', a size that depends on data (GEIR plans once the input "
                                        f"shapes are known)")
            try:
                op = self.create(name, values, attrs)
            except ShapeError as e:
                raise ImportProblem(str(e), unsupported=False) from None
            return [Tensor(value=r) for r in op.results]
        if all(t.is_const for t in operands):
            arrays = run_op(probe, [t.array for t in operands], result_types=inferred)
            weight = any(t.initializer for t in operands)
            return [Tensor(array=a, initializer=weight) for a in arrays]
        op = self.create(name, [self.value_of(t) for t in operands], attrs, inferred)
        return [Tensor(value=r) for r in op.results]

    def emit1(self, name: str, operands: list[Tensor], attrs: dict[str, Any] | None = None) -> Tensor:
        """`emit` for an op with one result."""
        return self.emit(name, operands, attrs)[0]

    def name_result(self, t: Tensor, onnx_name: str) -> None:
        """Give an op's result the ONNX name of what it stands for (when it has none yet)."""
        if t.value is not None and t.value.name is None and t.value.owner is not None:
            t.value.name = self.fresh_name(onnx_name)
        if not t.name:
            t.name = onnx_name

    def remove_dead_ops(self) -> None:
        """Drop ops nothing uses (folding and forwarding leave some behind)."""
        for op in reversed(self.graph.ops):
            if not op.has_trait(Terminator) and not any(r.uses for r in op.results):
                self.graph.erase(op)
