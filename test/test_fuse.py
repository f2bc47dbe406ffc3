"""Every fusion rule keeps the graph's values: the reference interpreter agrees before and after `fuse`.

The graphs are the ones the lit tests pin (test/lit/passes/fuse-*.geir), so each spelling and
near miss there is also checked numerically here, in float64 and in the graph's own dtypes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from geir.diagnostics import DiagnosticEngine
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.reference import run_graph
from geir.tools.geopt import split_chunks

LIT = Path(__file__).parent / "lit" / "passes"
TOLERANCE = {"f32": (1e-4, 1e-5), "f16": (1e-2, 1e-3), "bf16": (2e-2, 1e-2)}


def _chunks() -> list[tuple[str, str]]:
    out = []
    for path in sorted(LIT.glob("fuse-*.geir")):
        for text, offset in split_chunks(path.read_text(), True):
            module = parse(text, path.name, offset)
            out.append((f"{path.stem}:{module.graphs[0].name}", text))
    return out


def _inputs(graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for a in graph.args:
        shape = tuple(6 if d is None else d for d in a.type.shape)  # a run-time size (MoE's tokens): 6
        if a.type.dtype.name == "i1":
            out[a.name] = rng.random(shape) > 0.3
        else:
            # moderate magnitudes, as real activations have: unscaled f16 scores of unit normals lose digits
            out[a.name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    return out


def _fuse(text: str, pipeline: str = "fuse"):
    module = parse(text)
    errors = []
    ctx = PassContext(diagnostics=DiagnosticEngine(errors.append))
    assert PassManager(complete_pipeline(parse_pipeline(pipeline))).run(module, ctx), errors
    return module


@pytest.mark.parametrize("name,text", _chunks(), ids=[c[0] for c in _chunks()])
def test_fusion_keeps_values(name: str, text: str) -> None:
    before = parse(text).graphs[0]
    after = _fuse(text).graphs[0]
    inputs = _inputs(before)
    ref_before = run_graph(before, inputs, float64=True)
    ref_after = run_graph(after, inputs, float64=True)
    for a, b in zip(ref_before, ref_after):
        # written-out constants (1.41421356 for sqrt 2) are a few ulps off the exact ones fused ops use
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7, equal_nan=True)
    # in the graph's own dtypes the fused graph meets the spec's tolerances against the float64 truth
    native_after = run_graph(after, inputs)
    for exact, b, r in zip(ref_before, native_after, after.result_types):
        # indices and counts (MoE routing) are exact, and so is f64, computed as the float64 truth is
        if not r.dtype.is_float or r.dtype.value == "f64":
            assert np.array_equal(b, exact)
            continue
        rtol, atol = TOLERANCE[r.dtype.value]
        np.testing.assert_allclose(b.astype(np.float64), exact, rtol=rtol, atol=atol, equal_nan=True)


def test_fused_ops_are_present() -> None:
    fused = {name: {op.name for op in _fuse(text).graphs[0].ops} for name, text in _chunks()}
    assert "ge.flash_attention" in fused["fuse-attention:written_out_softmax"]
    assert "ge.flash_attention" not in fused["fuse-attention:softmax_axis_2"]
    assert "ge.layer_norm" in fused["fuse-rules:layer_norm"]
    assert "ge.fused_matmul" in fused["fuse-rules:matmul_bias_relu"]
    assert fused["fuse-rules:elementwise_chain"] == {"ge.fused_elementwise", "ge.return"}


def test_every_block_of_a_long_chain_fuses() -> None:
    """Attention blocks chained 200 deep each fuse (how time scales is bench/pipeline.py's job)."""
    lines = ["ge.graph @main(%x: tensor<1x2x16x16xf32>) -> tensor<1x2x16x16xf32> {"]
    prev = "%x"
    for i in range(200):
        lines += [f"  %s{i} = ge.matmul {prev}, {prev} {{transpose_b = true}}",
                  f"  %p{i} = ge.softmax %s{i}",
                  f"  %o{i} = ge.matmul %p{i}, {prev}"]
        prev = f"%o{i}"
    lines += [f"  ge.return {prev}", "}"]
    ops = [op.name for op in _fuse("\n".join(lines) + "\n").graphs[0].ops]
    assert ops == ["ge.flash_attention"] * 200 + ["ge.return"]


def test_a_chain_of_thousands_of_ops_fuses_without_recursion():
    # exported models have elementwise chains this long; the rule walks them iteratively and cuts
    # them into kernels of at most MAX_STEPS steps, each of which the vector tiling can hold
    from geir.passes.fusion.elementwise import MAX_STEPS

    n = 2000
    ops = ["%v0 = ge.exp %x"] + [f"%v{i} = ge.{'mul' if i % 3 else 'add'} %v{i - 1}, %c" for i in range(1, n)]
    text = ("ge.graph @main(%x: tensor<8x64xf32>) -> tensor<8x64xf32> {\n  %c = ge.const dense<0.5> : tensor<f32>\n  "
            + "\n  ".join(ops) + f"\n  ge.return %v{n - 1}\n}}\n")
    module = parse(text)
    diags: list = []
    ctx = PassContext(diagnostics=DiagnosticEngine(diags.append))
    assert PassManager(complete_pipeline(parse_pipeline("fuse,tile"))).run(module, ctx), diags
    fused = [op for op in module.graphs[0].ops if op.name == "ge.fused_elementwise"]
    assert len(fused) == -(-n // MAX_STEPS) and all(len(op.attr("body")) <= MAX_STEPS for op in fused)
    assert all("tiling" in op.attributes for op in fused)
    x = {"x": np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)}
    (want,) = run_graph(parse(text).graphs[0], x)
    (got,) = run_graph(module.graphs[0], x)
    assert np.array_equal(got, want)


# --- no pass recurses on the graph's depth ------------------------------------------------------------------

DEPTH = 3000  # three times Python's default recursion limit


def _chain(args: str, first: str, step: str, tail: list[str], ret: str) -> str:
    body = [f"  %v0 = {first}"] + [f"  %v{i} = {step.format(p=f'%v{i - 1}')}" for i in range(1, DEPTH + 1)]
    return "\n".join([f"ge.graph @main({args}) -> {ret} {{", *body, *tail, "}"]) + "\n"


@pytest.mark.parametrize("name, text", [
    # the GELU rule reads a product through its muls (once a RecursionError at about 1,000)
    ("muls", _chain("%x: tensor<4x16xf32>", "ge.relu %x", "ge.mul {p}, %x", [f"  ge.return %v{DEPTH}"],
                    "tensor<4x16xf32>")),
    # the attention rules follow the scores through masks added one after another
    ("masks", _chain("%q: tensor<1x2x16x8xf32>, %k: tensor<1x2x8x16xf32>, %v: tensor<1x2x16x8xf32>, "
                     "%m: tensor<1x2x16x16xf32>", "ge.matmul %q, %k", "ge.add {p}, %m",
                     [f"  %p = ge.softmax %v{DEPTH} {{axis = -1}}", "  %o = ge.matmul %p, %v", "  ge.return %o"],
                     "tensor<1x2x16x8xf32>")),
    # shape rules read sizes through casts (infer-shapes, const-fold)
    ("sizes", _chain("%x: tensor<?xf32>", "ge.shape_of %x", "ge.cast {p} {{to = i64}}",
                     [f"  %r = ge.dynamic_reshape %x, %v{DEPTH}", "  ge.return %r"], "tensor<?xf32>")),
])
def test_no_pass_recurses_on_the_graphs_depth(name, text):
    module = parse(text)
    ctx = PassContext()
    problems: list = []
    ctx.diagnostics.handler = problems.append
    # a ? size is lowered only once bound (the session does that): the sizes chain stops before tile
    pipeline = "const-fold,canonicalize,cse,dce,fuse"
    if name != "sizes":
        pipeline += ",fusion-guards,layout,tile,plan,lower"
    assert PassManager(complete_pipeline(parse_pipeline(pipeline))).run(module, ctx) and not problems, problems


def test_qkv_merge_concatenates_weights_in_the_order_of_its_split() -> None:
    """cse hands the middle matmul's input to the others (its use is appended to the shared input's users), so the
    rule meets the matmuls in another order than the graph's; the merged weight's pieces still line up with the
    split's (Qwen2-MoE's router merged with its shared expert's projections read the wrong columns before)."""
    w = lambda n, s: "[" + ", ".join("[" + ", ".join(f"{(i * 7 + j * 3 + s) % 11 / 10 - 0.5:.1f}" for j in range(4))  # noqa: E731
                                     + "]" for i in range(n)) + "]"
    text = f"""ge.graph @main(%x: tensor<3x4xf32>) -> (tensor<3x2xf32>, tensor<3x5xf32>, tensor<3x1xf32>) {{
  %w1 = ge.const dense<{w(2, 1)}> : tensor<2x4xf32>
  %a = ge.matmul %x, %w1 {{transpose_b = true}}
  %y = ge.reshape %x {{shape = [3, 4]}}
  %w2 = ge.const dense<{w(5, 2)}> : tensor<5x4xf32>
  %b = ge.matmul %y, %w2 {{transpose_b = true}}
  %w3 = ge.const dense<{w(1, 3)}> : tensor<1x4xf32>
  %c = ge.matmul %x, %w3 {{transpose_b = true}}
  ge.return %a, %b, %c
}}"""
    before = parse(text).graphs[0]
    after = _fuse(text, "canonicalize,cse,fuse").graphs[0]
    assert [op.name for op in after.ops].count("ge.matmul") == 1  # all three merged
    inputs = _inputs(before)
    for a, b in zip(run_graph(before, inputs, float64=True), run_graph(after, inputs, float64=True)):
        np.testing.assert_allclose(b, a, rtol=1e-12)


@pytest.mark.parametrize("cut", ["split", "transpose_split", "slices"])
def test_qkv_heads_reorders_weight_rows_so_the_pieces_are_the_same_elements(cut: str) -> None:
    """qkv_heads (GPT-NeoX's and Bloom's fused query_key_value, features [heads, 3, head_dim]) reorders the weight and
    bias at compile time and cuts the matmul's last axis instead: oracle, the unfused graph run by the reference on
    the same inputs, piece for piece (H = 2 heads, D = 2, a bias, prefill's 3 positions)."""
    rng = np.random.default_rng(28)
    w, b = rng.standard_normal((12, 3)), rng.standard_normal(12)
    dense = lambda a: np.array2string(a, separator=", ", floatmode="unique", threshold=10**6).replace("\n", "")  # noqa: E731
    view, piece, tail = {"split": ("[1, 3, 2, 6]", "1x3x2x2", "%q, %k, %v = ge.split %h {axis = 3, sizes = [2, 2, 2]}"),
                  "transpose_split": ("[1, 3, 2, 6]", "1x2x3x2", "%t = ge.transpose %h {perm = [0, 2, 1, 3]}\n"
                                      "  %q, %k, %v = ge.split %t {axis = 3, sizes = [2, 2, 2]}"),
                  "slices": ("[1, 3, 2, 3, 2]", "1x3x2x1x2", "%q = ge.slice %h {axes = [3], starts = [0], ends = [1]}\n"
                             "  %v = ge.slice %h {axes = [3], starts = [2], ends = [3]}\n"
                             "  %k = ge.slice %h {axes = [3], starts = [1], ends = [2]}")}[cut]
    text = f"""ge.graph @main(%x: tensor<1x3x3xf64>) -> (tensor<{piece}xf64>, tensor<{piece}xf64>, tensor<{piece}xf64>) {{
  %w = ge.const dense<{dense(w)}> : tensor<12x3xf64>
  %b = ge.const dense<{dense(b)}> : tensor<12xf64>
  %y = ge.fused_matmul %x, %w, %b {{transpose_b = true}}
  %h = ge.reshape %y {{shape = {view}}}
  {tail}
  ge.return %q, %k, %v
}}"""
    before = parse(text).graphs[0]
    after = _fuse(text, "infer-shapes,fuse{rules=qkv_heads}").graphs[0]
    assert not any(op.name == "ge.slice" for op in after.ops)
    split = [op for op in after.ops if op.name == "ge.split"]
    assert len(split) == 1 and split[0].axis == -1
    inputs = _inputs(before)
    for a, c in zip(run_graph(before, inputs, float64=True), run_graph(after, inputs, float64=True)):
        np.testing.assert_allclose(c, a, rtol=1e-12)


def test_matmul_residual_with_both_biases_folded_computes_the_parallel_residual() -> None:
    """matmul_residual on GPT-NeoX's mlp + attn with both projections biased: the down matmul takes the attention
    output as its addend, and the attention projection both biases summed. Oracle: the unfused graph in float64."""
    rng = np.random.default_rng(9)
    dense = lambda a: np.array2string(a, separator=", ", floatmode="unique", threshold=10**6).replace("\n", "")  # noqa: E731
    wo, wd = rng.standard_normal((4, 3)), rng.standard_normal((4, 5))
    bo, bd = rng.standard_normal(4), rng.standard_normal(4)
    text = f"""ge.graph @main(%a: tensor<2x3x3xf64>, %m: tensor<2x3x5xf64>) -> tensor<2x3x4xf64> {{
  %wo = ge.const dense<{dense(wo)}> : tensor<4x3xf64>
  %wd = ge.const dense<{dense(wd)}> : tensor<4x5xf64>
  %bo = ge.const dense<{dense(bo)}> : tensor<4xf64>
  %bd = ge.const dense<{dense(bd)}> : tensor<4xf64>
  %attn = ge.fused_matmul %a, %wo, %bo {{transpose_b = true}}
  %mlp = ge.fused_matmul %m, %wd, %bd {{transpose_b = true}}
  %y = ge.add %mlp, %attn
  ge.return %y
}}"""
    before = parse(text).graphs[0]
    after = _fuse(text, "infer-shapes,fuse{rules=matmul_residual}").graphs[0]
    assert [op.name for op in after.ops if op.name not in ("ge.const", "ge.return")] == ["ge.fused_matmul"] * 2
    inputs = _inputs(before)
    np.testing.assert_allclose(run_graph(after, inputs, float64=True)[0], run_graph(before, inputs, float64=True)[0],
                               rtol=1e-12)
