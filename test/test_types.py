"""Tensor types: spelling, parsing (static, `?`, rank 0, storage formats), errors and helpers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from geir.types import (
    DTYPES,
    DType,
    TensorType,
    TypeSyntaxError,
    dims_compatible,
    format_type,
    parse_type,
    types_compatible,
)

SPEC_DTYPES = ["f16", "bf16", "f32", "f64", "i8", "i32", "i64", "i1"]


def test_dtype_set_is_the_spec_set():
    assert sorted(DTYPES) == sorted(SPEC_DTYPES)


@pytest.mark.parametrize(
    "name, np_dtype, size",
    [
        ("f16", np.float16, 2),
        ("bf16", ml_dtypes.bfloat16, 2),
        ("f32", np.float32, 4),
        ("f64", np.float64, 8),
        ("i8", np.int8, 1),
        ("i32", np.int32, 4),
        ("i64", np.int64, 8),
        ("i1", np.bool_, 1),
    ],
)
def test_dtype_numpy_mapping(name, np_dtype, size):
    d = DTYPES[name]
    assert str(d) == name
    assert d.np == np.dtype(np_dtype)
    assert d.itemsize == size
    assert DType.from_numpy(np.dtype(np_dtype)) is d
    assert d.is_float == (name in ("f16", "bf16", "f32", "f64"))
    assert d.is_int == (name in ("i8", "i32", "i64"))


def test_from_numpy_maps_float64_to_f64_and_rejects_others():
    # f64 is a GEIR dtype (spec section 1: it runs on the AI CPU); a numpy dtype GEIR lacks is a KeyError
    assert DType.from_numpy(np.float64) is DType.f64
    with pytest.raises(KeyError):
        DType.from_numpy(np.complex64)


@pytest.mark.parametrize(
    "text, shape, dtype, fmt",
    [
        ("tensor<1x8x2048x64xf16>", (1, 8, 2048, 64), DType.f16, "ND"),
        ("tensor<f32>", (), DType.f32, "ND"),
        ("tensor<?x64xbf16>", (None, 64), DType.bf16, "ND"),
        ("tensor<?x?x?xi8>", (None, None, None), DType.i8, "ND"),
        ("tensor<64x64xf16, NZ>", (64, 64), DType.f16, "NZ"),
        ("tensor<64x64xf16,NZ>", (64, 64), DType.f16, "NZ"),
        ("tensor<64x64xf16, ND>", (64, 64), DType.f16, "ND"),
        ("tensor<0x3xi1>", (0, 3), DType.i1, "ND"),
        ("tensor<7xi64>", (7,), DType.i64, "ND"),
        ("tensor<2x?xi32, NZ>", (2, None), DType.i32, "NZ"),
    ],
)
def test_parse_type(text, shape, dtype, fmt):
    t = parse_type(text)
    assert t == TensorType(shape, dtype, fmt)
    assert t.rank == len(shape)


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("tensor<1x8x2048x64xf16>", "tensor<1x8x2048x64xf16>"),
        ("tensor<f32>", "tensor<f32>"),
        ("tensor<?x64xbf16>", "tensor<?x64xbf16>"),
        ("tensor<64x64xf16,NZ>", "tensor<64x64xf16, NZ>"),
        ("tensor<64x64xf16, ND>", "tensor<64x64xf16>"),  # ND is the default and not printed
    ],
)
def test_format_type_is_canonical(text, canonical):
    t = parse_type(text)
    assert format_type(t) == canonical
    assert str(t) == canonical
    assert parse_type(canonical) == t


@pytest.mark.parametrize(
    "text, fragment, offset",
    [
        # the offset is where the bad piece starts within the type text
        ("tensor<4xf33>", "unknown dtype 'f33'", 9),
        ("tensor<4x8xfloat>", "unknown dtype 'float'", 11),
        ("tensor<>", "unknown dtype ''", 7),
        ("tensor<4x>", "unknown dtype ''", 9),
        ("tensor<4xyxf32>", "bad dimension 'y'", 9),
        ("tensor<4x-1xf32>", "bad dimension '-1'", 9),
        ("tensor<a4xf32>", "bad dimension 'a4'", 7),
        ("tensor<4xf32, NQ>", "unknown storage format 'NQ'", 14),
    ],
)
def test_type_errors_and_offsets(text, fragment, offset):
    with pytest.raises(TypeSyntaxError) as e:
        parse_type(text)
    assert fragment in str(e.value)
    assert e.value.offset == offset
    assert text[offset:].startswith(fragment.split("'")[1])


def test_unknown_dtype_message_lists_the_dtypes():
    with pytest.raises(TypeSyntaxError) as e:
        parse_type("tensor<2xf63>")
    for d in SPEC_DTYPES:
        assert d in str(e.value)


def test_static_and_dynamic_properties():
    t = parse_type("tensor<2x3x4xf16>")
    assert t.is_static and t.num_elements == 24 and t.nbytes == 48
    d = parse_type("tensor<2x?x4xf32>")
    assert not d.is_static and d.num_elements is None and d.nbytes is None
    s = parse_type("tensor<i64>")
    assert s.is_static and s.num_elements == 1 and s.nbytes == 8
    assert t.with_shape((6, 4)) == TensorType((6, 4), DType.f16)
    assert t.with_dtype(DType.f32).nbytes == 96
    nz = parse_type("tensor<16x16xf16, NZ>")
    assert nz.with_dtype(DType.f32).format == "NZ"


def test_types_are_hashable_values():
    a = parse_type("tensor<?x4xf32>")
    b = TensorType((None, 4), DType.f32)
    assert a == b and hash(a) == hash(b)
    assert a != TensorType((None, 4), DType.f32, "NZ")
    assert len({a, b}) == 1


def test_compatibility_with_unknown_dims():
    assert dims_compatible(None, 3) and dims_compatible(3, None) and dims_compatible(3, 3)
    assert not dims_compatible(3, 4)
    f = DType.f32
    assert types_compatible(TensorType((None, 4), f), TensorType((8, 4), f))
    assert types_compatible(TensorType((None, None), f), TensorType((8, 4), f))
    assert not types_compatible(TensorType((None, 4), f), TensorType((8, 5), f))
    assert not types_compatible(TensorType((8,), f), TensorType((8, 1), f))
    assert not types_compatible(TensorType((8,), f), TensorType((8,), DType.f16))
