"""Op traits: each trait's promise checked against what the ops compute, and the registry queries."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geir.builder import create_op
from geir import parse, traits
from geir.ir import Graph, Value
from geir.opdef import OPS, ops_with_trait
from geir.ops.elementwise import Gelu, Unary
from geir.ops.fused import FusedMatmul, chainable, chainable_ops
from geir.ops.linalg import Matmul
from geir.ops.numerics import softmax
from geir.passes.pattern import is_trivially_dead
from geir.reference import run_graph, run_op
from geir.traits import CubeOp, Elementwise, Fused, InPlaceCapable, Terminator, Trait
from geir.types import DType, TensorType
from geir.verifier import verify_graph

from helpers import graph_text

REPO = Path(__file__).resolve().parents[1]
TRAITS = [t for _, t in inspect.getmembers(traits, inspect.isclass) if issubclass(t, Trait) and t is not Trait]

# What each trait holds of today's ops, written out independently of the declarations.
ELEMENTWISE = {f"ge.{n}" for n in (
    "add", "sub", "mul", "div", "max", "min", "pow", "greater", "less", "equal", "select",
    "exp", "log", "sqrt", "rsqrt", "neg", "abs", "tanh", "sigmoid", "relu", "silu", "erf", "gelu", "cast", "isinf", "isnan", "sin", "cos",
)}
EXPECTED = {
    traits.Elementwise: ELEMENTWISE | {"ge.fused_elementwise", "ge.glu"},
    # a float test's i1 result is never the size of its float operand
    traits.InPlaceCapable: ELEMENTWISE - {"ge.isinf", "ge.isnan"} | {"ge.fused_elementwise", "ge.glu"},
    traits.Fused: {"ge.fused_elementwise", "ge.fused_matmul", "ge.flash_attention", "ge.glu", "ge.rotary_embedding",
                   "ge.add_rms_norm", "ge.add_layer_norm", "ge.moe_gating_topk_softmax", "ge.moe_init_routing",
                   "ge.moe_finalize_routing", "ge.paged_attention", "ge.rms_norm_add_rms_norm"},
    traits.CubeOp: {"ge.matmul", "ge.fused_matmul", "ge.flash_attention", "ge.grouped_matmul", "ge.paged_attention"},
    traits.RowWise: {"ge.reduce_sum", "ge.reduce_max", "ge.reduce_mean", "ge.softmax", "ge.layer_norm", "ge.rms_norm"},
    traits.Normalization: {"ge.layer_norm", "ge.rms_norm"},
    traits.ShapeView: {"ge.reshape"},
    traits.DataMovement: {"ge.transpose", "ge.reshape", "ge.concat", "ge.split", "ge.slice", "ge.trans_data", "ge.gather",
                          "ge.index", "ge.gather_elements", "ge.index_put", "ge.index_put_pair", "ge.scatter_elements",
                          "ge.dynamic_reshape", "ge.dynamic_slice", "ge.dynamic_broadcast"},
    # read only shapes: folded once the shapes are bound
    traits.ShapeOnly: {"ge.dim", "ge.shape_of"},
    # take sizes from tensors: static ops once the sizes are constants
    traits.TakesSizes: {"ge.range", "ge.dynamic_reshape", "ge.dynamic_slice", "ge.dynamic_broadcast"},
    traits.NoKernel: {"ge.const", "ge.return"},
    traits.Terminator: {"ge.return", "rt.return"},
}


# --- the registry ------------------------------------------------------------------------------------

def test_every_trait_has_a_one_line_promise():
    assert set(TRAITS) == set(EXPECTED)
    for t in TRAITS:
        assert t.__doc__ and "\n" not in t.__doc__.strip(), t


@pytest.mark.parametrize("trait", TRAITS, ids=lambda t: t.__name__)
def test_ops_with_trait_lists_exactly_the_ops_that_declare_it(trait):
    names = ops_with_trait(trait)
    assert isinstance(names, tuple) and list(names) == sorted(names)
    assert set(names) == EXPECTED[trait]
    # declared on the op's class or one of its bases, nowhere else
    declaring = {name for name, cls in OPS.items()
                 if any(trait in vars(base).get("TRAITS", ()) for base in cls.__mro__)}
    assert set(names) == declaring


def test_a_subclass_has_its_bases_traits_and_its_own():
    assert Matmul.TRAITS == (CubeOp,)
    assert FusedMatmul.has_trait(CubeOp) and FusedMatmul.has_trait(Fused) and not Matmul.has_trait(Fused)
    assert Gelu.has_trait(Elementwise) and Unary.has_trait(Elementwise)
    assert len(set(FusedMatmul.TRAITS)) == len(FusedMatmul.TRAITS)


def test_an_op_and_its_class_answer_alike():
    x = Value(TensorType((4,), DType.f32), "x")
    op = create_op("ge.exp", [x], [x.type])
    for t in TRAITS:
        assert op.has_trait(t) == type(op).has_trait(t)
    assert op.has_trait(Elementwise) and not op.has_trait(Terminator)


def test_a_fused_body_chains_the_elementwise_ops_that_are_not_fused():
    assert set(chainable_ops()) == ELEMENTWISE
    assert not chainable(OPS["ge.fused_elementwise"]) and not chainable(OPS["ge.softmax"])


# --- Elementwise: element i of the result depends only on element i of each operand --------------------

BODY = [{"op": "ge.mul", "args": [0, 1]}, {"op": "ge.exp", "args": [2]}, {"op": "ge.greater", "args": [3, 1]},
        {"op": "ge.select", "args": [4, 3, 0]}]
# attributes an op needs for the oracle to run it (each set is one case)
ATTRS: dict[str, list[dict[str, Any]]] = {
    "ge.cast": [{"to": DType.f16}, {"to": DType.i32}],
    "ge.gelu": [{}, {"approximate": "tanh"}],
    "ge.fused_elementwise": [{"body": BODY}],
}
# ops whose values the oracle cannot judge: no operands, or values passed through unchanged (trans_data
# changes the storage format only, so it would look elementwise, but it moves bytes and computes nothing)
# (arange has no operands either; gather's and index's indices are integers, which the oracle's float
# operands are not, and so are the sizes the size ops read and take: test_sizes judges those against numpy)
UNJUDGED = {"ge.const", "ge.return", "ge.trans_data", "ge.arange", "ge.gather", "ge.index", "ge.gather_elements",
            "ge.index_put", "ge.scatter_elements",
            "ge.dim", "ge.shape_of",
            "ge.range", "ge.dynamic_reshape", "ge.dynamic_slice", "ge.dynamic_broadcast",
            # MoE routing takes integer expert ids and group sizes (test_moe judges them against torch)
            "ge.grouped_matmul", "ge.moe_init_routing", "ge.moe_finalize_routing",
            # a block table and slots of integers (test_paged_attention judges them against torch and numpy)
            "ge.paged_attention", "ge.index_put_pair"}
# cube ops whose spec is another op's over gathered operands: paged attention is flash attention over the blocks
# its table names (test_paged_attention: torch's SDPA over a hand gather, bit for bit the dense kernel)
SPEC_ELSEWHERE = {"ge.paged_attention"}
# the ops that compute across elements, with operands (4x4 float32 unless given) and attributes
ACROSS: dict[str, tuple[int, dict[str, Any]]] = {
    "ge.matmul": (2, {}),
    "ge.fused_matmul": (2, {"activation": "relu"}),
    "ge.flash_attention": (3, {}),
    "ge.softmax": (1, {}),
    "ge.layer_norm": (3, {}),
    "ge.rms_norm": (2, {}),
    "ge.reduce_sum": (1, {"axes": [1]}),
    "ge.reduce_max": (1, {"axes": [1]}),
    "ge.reduce_mean": (1, {"axes": [0], "keepdims": True}),
    "ge.transpose": (1, {"perm": [1, 0]}),
    "ge.reshape": (1, {"shape": [-1]}),
    "ge.concat": (2, {"axis": 0}),
    "ge.split": (1, {"axis": 1, "sizes": [1, 3]}),
    "ge.slice": (1, {"axes": [0], "starts": [1], "ends": [3]}),
    "ge.cumsum": (1, {"axis": 1}),
    "ge.topk": (1, {"k": 4}),  # every element, sorted: the shape kept, the values moved across the row
    "ge.sort": (1, {"axis": 1}),
    "ge.histc": (1, {"bins": 4, "min": -1.0, "max": 1.0}),
    "ge.moe_gating_topk_softmax": (1, {"k": 4}),
    "ge.conv2d": (2, {"pads": [1, 1, 2, 2]}),  # a 4x4 kernel over a 4x4 image, padded to keep its shape
    "ge.rotary_embedding": (3, {"rotary_dim": 4}),  # each element with its rotation partner
    "ge.add_rms_norm": (3, {}),  # the sum's rows normalised (and the sum)
    "ge.add_layer_norm": (4, {}),
    "ge.rms_norm_add_rms_norm": (4, {}),  # x2's rows normalised, added, the sum's rows normalised (and the sum)
}


def run(name: str, attrs: dict[str, Any], arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Op `name` on arrays through the reference interpreter."""
    operands = [Value(TensorType(a.shape, DType.from_numpy(a.dtype))) for a in arrays]
    op = create_op(name, operands, [], attrs)
    inferred = op.infer(*[v.type for v in operands])
    types = list(inferred) if isinstance(inferred, tuple) else [inferred]
    return run_op(op, arrays, result_types=types)


def behaves_elementwise(name: str, attrs: dict[str, Any], arrays: list[np.ndarray]) -> bool:
    """The oracle: results have the operands' broadcast shape, and permuting the elements of every
    (broadcast) operand the same way permutes the result's elements that way."""
    shape = np.broadcast_shapes(*[a.shape for a in arrays])
    full = [np.broadcast_to(a, shape).copy() for a in arrays]
    outs = run(name, attrs, full)
    if any(o.shape != shape for o in outs):
        return False
    perm = np.random.default_rng(1).permutation(int(np.prod(shape)))
    permuted = run(name, attrs, [a.reshape(-1)[perm].reshape(shape) for a in full])
    return all(_close(p, o.reshape(-1)[perm].reshape(shape)) for p, o in zip(permuted, outs))


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    # numpy's vector loops and their scalar tails may round transcendental functions apart by an ulp
    if a.dtype.kind == "f":
        return bool(np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-6, atol=0, equal_nan=True))
    return bool(np.array_equal(a, b))


def operands_for(name: str, shape: tuple[int, ...], rng: np.random.Generator,
                 dtype: Any = np.float32) -> list[np.ndarray]:
    """Random operands for an elementwise op: an i1 condition, otherwise values where log, sqrt and pow are defined."""
    names = OPS[name].OPERAND_NAMES
    names = ("x", "y") if names == ("x+",) else names  # the fused body below takes two operands
    return [rng.random(shape) < 0.5 if n == "cond" else rng.uniform(0.5, 2.0, shape).astype(dtype) for n in names]


def test_every_registered_op_is_judged_by_the_oracle():
    ge_ops = {n for n in OPS if n.startswith("ge.")}
    assert ge_ops == set(ops_with_trait(Elementwise)) | set(ACROSS) | UNJUDGED


@pytest.mark.parametrize("name", ops_with_trait(Elementwise))
def test_an_elementwise_op_maps_element_i_to_element_i(name):
    rng = np.random.default_rng(0)
    for attrs in ATTRS.get(name, [{}]):
        assert behaves_elementwise(name, attrs, operands_for(name, (3, 5), rng)), attrs


@pytest.mark.parametrize("name", [n for n in ops_with_trait(Elementwise) if OPS[n].OPERAND_NAMES != ("x",)])
def test_an_elementwise_op_reads_a_broadcast_operand_as_its_full_shape(name):
    rng = np.random.default_rng(2)
    for attrs in ATTRS.get(name, [{}]):
        full = operands_for(name, (3, 5), rng)
        for i in range(len(full)):
            small = [a[:1] if j == i else a for j, a in enumerate(full)]  # operand i as 1x5
            spread = [np.broadcast_to(a, (3, 5)).copy() for a in small]
            for got, want in zip(run(name, attrs, small), run(name, attrs, spread)):
                assert got.shape == (3, 5) and _close(got, want), (attrs, i)


@pytest.mark.parametrize("name", sorted(ACROSS))
def test_an_op_without_the_trait_computes_across_elements(name):
    count, attrs = ACROSS[name]
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(count)]
    if name in ("ge.flash_attention", "ge.conv2d"):
        arrays = [a.reshape(1, 1, 4, 4) for a in arrays]
    assert not OPS[name].has_trait(Elementwise)
    assert not behaves_elementwise(name, attrs, arrays)


# --- InPlaceCapable: writing the result over a dying operand gives the same values -----------------------

# comparisons give i1: the operands a result of theirs may overwrite are 1-byte ones
IN_PLACE_DTYPE = {"ge.greater": np.int8, "ge.less": np.int8, "ge.equal": np.int8}


@pytest.mark.parametrize("name", ops_with_trait(InPlaceCapable))
def test_an_in_place_op_can_overwrite_its_operand_element_by_element(name):
    rng = np.random.default_rng(4)
    checked = 0
    for attrs in ATTRS.get(name, [{}]):
        arrays = operands_for(name, (3, 5), rng, IN_PLACE_DTYPE.get(name, np.float32))
        (want,) = run(name, attrs, arrays)
        for i, x in enumerate(arrays):
            if x.dtype.itemsize != want.dtype.itemsize:
                continue  # the plan gives such a result a slot of its own
            checked += 1
            # element by element, front to back, the result written over operand i's bytes as it goes
            flat = [a.reshape(-1).copy() for a in arrays]
            result = flat[i].view(want.dtype)
            for k in range(result.size):
                (out,) = run(name, attrs, [f[k:k + 1] for f in flat])
                result[k] = out[0]
            assert _close(result.reshape(want.shape), want), (attrs, i)
    assert checked


# --- CubeOp: the spec defines each one through a matrix product ------------------------------------------

def _spec_matmul(a, b):
    return a.astype(np.float64) @ b.astype(np.float64)


def _spec_attention(q, k, v):
    return softmax(_spec_matmul(q, np.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1]), -1) @ v.astype(np.float64)


def _spec_grouped_matmul(x, w, ends):
    """Rows 0-1 times weight 0, rows 2-5 times weight 1 (the groups GROUP_ENDS gives)."""
    return np.concatenate([_spec_matmul(x[:2], w[0]), _spec_matmul(x[2:6], w[1])])


# GEIR.md: matmul is np.matmul; flash_attention is softmax(scale * q @ k^T + mask) @ v, scale 1/sqrt(D)
SPEC_MATMULS = {
    "ge.matmul": (_spec_matmul, [(2, 3, 4), (2, 4, 5)]),
    "ge.fused_matmul": (_spec_matmul, [(3, 4), (4, 5)]),
    "ge.flash_attention": (_spec_attention, [(1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)]),
    "ge.grouped_matmul": (_spec_grouped_matmul, [(6, 4), (2, 4, 5)]),
}
# the grouped matmul's groups end at these rows (integers: its third operand)
GROUP_ENDS = np.array([2, 6], dtype=np.int64)


@pytest.mark.parametrize("name", sorted(set(ops_with_trait(CubeOp)) - SPEC_ELSEWHERE))
def test_every_cube_op_is_a_matrix_product_of_the_spec(name):
    formula, shapes = SPEC_MATMULS[name]
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    if name == "ge.grouped_matmul":
        arrays.append(GROUP_ENDS)
    (got,) = run(name, {}, arrays)
    np.testing.assert_allclose(got, formula(*arrays), rtol=1e-5, atol=1e-5)


# --- Terminator: the op that ends a graph, and that passes never drop ---------------------------------

PROGRAM = """\
rt.program @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %d = rt.h2d %x {offset = 0} : tensor<4xf32>
  %y = rt.launch %d {kernel = "ge.exp", offsets = [512]} : tensor<4xf32>
  %h = rt.d2h %y : tensor<4xf32>
  rt.return %h
}
"""


def _graphs() -> list[Graph]:
    return [parse(graph_text("  %y = ge.exp %x\n  ge.return %y")).graphs[0], parse(PROGRAM).graphs[0]]


def test_every_terminator_ends_the_graphs_of_its_kind():
    graphs = _graphs()
    assert {g.terminator_name for g in graphs} == set(ops_with_trait(Terminator))
    for g in graphs:
        assert verify_graph(g) and g.terminator.has_trait(Terminator)
        assert sum(op.has_trait(Terminator) for op in g.ops) == 1
        assert OPS[g.terminator_name].NUM_RESULTS == 0
        assert not is_trivially_dead(g.terminator)  # no results, yet dce keeps it
        g.ops = g.ops[:-1]
        assert not verify_graph(g, emit=lambda d: None)


def test_the_reference_returns_the_terminators_operands():
    g = _graphs()[0]
    x = np.array([0.0, 1.0, 2.0, -1.0], np.float32)
    (y,) = run_graph(g, {"x": x})
    np.testing.assert_allclose(y, np.exp(x), rtol=1e-6)


def test_no_pass_session_or_ir_module_names_the_terminator_by_hand():
    compares = re.compile(r"""(==|!=)\s*["']ge\.return["']|["']ge\.return["']\s*(==|!=)""")
    found = [f"{path.relative_to(REPO)}:{i}"
             for top in ("passes", "session", "geir", "frontends") for path in sorted((REPO / top).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if compares.search(line)]
    assert found == []
    assert compares.search('if op.name != "ge.return":')  # the pattern does catch the old spelling
