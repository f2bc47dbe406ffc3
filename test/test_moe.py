"""Mixture of experts (issue 28 item 4): Qwen2-MoE and Mixtral from input_ids on the simulated NPU.

Oracles: Hugging Face's `generate(do_sample=False)` for the tokens; torch for each op's semantics (torch.sort,
torch.histc, transformers' grouped_mm fallback); torch in float64 for the accuracy rule (GEIR's error no worse
than torch eager's in the model's dtype).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from geir.builder import Builder  # noqa: E402
from geir.frontends.torch import compile as geir_compile, generate  # noqa: E402
from geir.ir import Module  # noqa: E402
from geir.session import Session, run_program  # noqa: E402
from geir.types import DType, TensorType  # noqa: E402

EXPERTS, TOP_K = 4, 2


def qwen2_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_experts=EXPERTS,
                                      num_experts_per_tok=TOP_K, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, decoder_sparse_step=1, mlp_only_layers=[])
    return transformers.Qwen2MoeForCausalLM(cfg).eval()


def mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=EXPERTS,
                                     num_experts_per_tok=TOP_K, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=100)
    return transformers.MixtralForCausalLM(cfg).eval()


MODELS = {"qwen2_moe": qwen2_moe, "mixtral": mixtral}


def _hf(model, ids, new):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_hugging_faces_generate(name):
    model = MODELS[name]()
    assert model.config._experts_implementation == "grouped_mm"  # what transformers runs by default
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(7))
    run = generate(model, ids, 5, buckets="pow2")
    assert torch.equal(run.tokens, _hf(model, ids, 5))


class _MoeBlock(torch.nn.Module):
    """One model's sparse MoE block alone (router, experts, combine) on [B, S, H] hidden states."""

    def __init__(self, model):
        super().__init__()
        self.block = model.model.layers[0].mlp

    def forward(self, h):
        out = self.block(h)
        return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_moe_block_is_as_accurate_as_torch_eager(name, dtype):
    block = _MoeBlock(MODELS[name]()).eval()
    h = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(1))
    reference = MODELS[name]().double()
    reference.config._experts_implementation = "eager"  # torch's grouped_mm takes no float64: the loop over experts
    with torch.no_grad():
        exact = _MoeBlock(reference).eval()(h.double())
        eager = block.to(dtype)(h.to(dtype)).double()
    fast = geir_compile(block, (h.to(dtype),), dynamic_shapes=({1: torch.export.Dim("s", min=2, max=64)},))
    got = fast(h.to(dtype)).double()
    eager_err = (eager - exact).abs().max().item()
    assert (got - exact).abs().max().item() <= max(eager_err, 1e-6) * 1.0001
    # GE runs the block as ops-transformer's moe family: nothing of the router's and the dispatch's pieces is left
    ops = [op.name for op in fast.graph.ops]
    assert ops.count("ge.grouped_matmul") == 2
    for name in ("ge.moe_gating_topk_softmax", "ge.moe_init_routing", "ge.moe_finalize_routing"):
        assert ops.count(name) == 1, name
    assert not {"ge.topk", "ge.sort", "ge.histc", "ge.index_put", "ge.softmax"} & set(ops)


def _run(graph, feed):
    session = Session(Module([graph], "<test>", {}))
    program = session.program({k: v.shape for k, v in feed.items()})
    return run_program(program, feed).outputs


def test_sort_along_a_run_time_length_is_torchs_stable_sort():
    b = Builder()
    x = b.argument(TensorType((None,), DType.i64), "x")
    values, indices = b.create("ge.sort", [x], {"axis": 0}).results
    graph = b.finish([values, indices])
    ids = torch.randint(0, EXPERTS, (15,), generator=torch.Generator().manual_seed(2))
    want = torch.sort(ids, stable=True)
    got = _run(graph, {"x": ids.numpy()})
    assert np.array_equal(got[0], want.values.numpy()) and np.array_equal(got[1], want.indices.numpy())


def test_histc_counts_as_torch_does():
    b = Builder()
    x = b.argument(TensorType((None,), DType.f32), "x")
    graph = b.finish([b.create("ge.histc", [x], {"bins": 5, "min": 0.0, "max": 4.0}).result])
    # every expert id, the maximum (the last bin is closed) and ids outside the range, which torch ignores
    v = torch.tensor([0, 4, 4, 2, 3, 3, 3, -1, 5, 1.5], dtype=torch.float32)
    assert np.array_equal(_run(graph, {"x": v.numpy()})[0], torch.histc(v, bins=5, min=0, max=4).numpy())


def test_grouped_matmul_is_transformers_grouped_mm():
    from transformers.integrations.moe import _grouped_mm_fallback

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 16, generator=g), torch.randn(EXPERTS, 8, 16, generator=g)
    offs = torch.tensor([2, 2, 7, 8], dtype=torch.int32)  # an empty group, and a row after the last group
    b = Builder()
    args = [b.argument(TensorType(tuple(a.shape), d), n) for a, d, n in
            ((x, DType.f32, "x"), (w, DType.f32, "w"), (offs, DType.i32, "offs"))]
    out = b.create("ge.grouped_matmul", args, {"transpose_b": True}).result
    got = _run(b.finish([out]), {"x": x.numpy(), "w": w.numpy(), "offs": offs.numpy()})[0]
    want = _grouped_mm_fallback(x, w.transpose(-2, -1), offs)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    assert not got[8:].any()  # rows after the last group are zero


def _one_op(name, operands, attributes, feed):
    b = Builder()
    args = [b.argument(TensorType(tuple(a.shape), d), n) for (n, a), d in zip(feed.items(), operands)]
    op = b.create(name, args, attributes)
    return _run(b.finish(list(op.results)), {n: a.numpy() for n, a in feed.items()})


@pytest.mark.parametrize("renorm", [False, True])
def test_gating_is_softmax_then_topk_then_renormalised_as_transformers_routes(renorm):
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(4))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, 3, dim=-1)
    if renorm:  # Mixtral; Qwen2-MoE with norm_topk_prob
        weights = weights / weights.sum(dim=-1, keepdim=True)
    got = _one_op("ge.moe_gating_topk_softmax", [DType.f32], {"k": 3, "renorm": renorm}, {"x": logits})
    np.testing.assert_allclose(got[0], weights.numpy(), rtol=1e-6)
    assert np.array_equal(got[1], experts.numpy())


def _transformers_dispatch(x, top_k_index, num_experts):
    """transformers' grouped_mm experts before the matmuls: rows by expert, the inverse order, running ends."""
    k = top_k_index.shape[1]
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    tokens = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0))
    return x[perm // k], inv_perm, torch.cumsum(tokens, dim=0, dtype=torch.int32)


def test_init_routing_orders_the_pairs_as_transformers_grouped_mm_experts_do():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 16, generator=g)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(7)])
    got = _one_op("ge.moe_init_routing", [DType.f32, DType.i64], {"num_experts": EXPERTS},
                  {"x": x, "expert_idx": experts})
    for a, b in zip(got, _transformers_dispatch(x, experts, EXPERTS)):
        assert np.array_equal(a, b.numpy())


def test_finalize_routing_combines_as_transformers_grouped_mm_experts_do():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, 16, generator=g)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(7)])
    scales = torch.rand(7, TOP_K, generator=g)
    expanded, inv_perm, _ = _transformers_dispatch(x, experts, EXPERTS)
    y = expanded * 3.0 - 1.0  # stands in for the experts' output rows, in expert order
    _, perm = torch.sort(experts.reshape(-1))
    weighted = y * scales.reshape(-1)[perm].unsqueeze(-1)  # transformers' combine
    want = weighted[inv_perm].view(7, TOP_K, 16).sum(dim=1)
    got = _one_op("ge.moe_finalize_routing", [DType.f32, DType.f32, DType.i64], {},
                  {"expanded": y, "scales": scales, "expanded_row_idx": inv_perm})
    np.testing.assert_allclose(got[0], want.numpy(), rtol=1e-6, atol=1e-7)


def _grouped_matmul_run(x, w, ends):
    b = Builder()
    args = [b.argument(TensorType(tuple(a.shape), DType.from_numpy(a.dtype)), n)
            for a, n in ((x, "x"), (w, "w"), (ends, "ends"))]
    out = b.create("ge.grouped_matmul", args, {"transpose_b": True}).result
    session = Session(Module([b.finish([out])], "<test>", {}))
    feed = {"x": x, "w": w, "ends": ends}
    result = run_program(session.program({k: v.shape for k, v in feed.items()}), feed)
    (stats,) = [k for k in result.kernels if k.name == "ge.grouped_matmul"]
    return result.outputs[0], stats


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_grouped_matmul_kernel_runs_on_the_cube_as_transformers_grouped_mm_computes(dtype):
    from transformers.integrations.moe import _grouped_mm_fallback

    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(40, 32, generator=g), torch.randn(EXPERTS, 48, 32, generator=g)
    ends = torch.tensor([7, 7, 30, 38], dtype=torch.int32)  # an expert no token chose; rows 38, 39 in no group
    got, stats = _grouped_matmul_run(x.numpy().astype(dtype), w.numpy().astype(dtype), ends.numpy())
    assert stats.engine == "aicore" and stats.tiling.base_m > 0
    x32, w32 = (torch.from_numpy(t.numpy().astype(dtype).astype(np.float32)) for t in (x, w))
    want = _grouped_mm_fallback(x32, w32.transpose(-2, -1), ends).numpy()
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol, atol=tol * 10)
    assert not got[38:].any()


def test_each_expert_a_token_chose_costs_its_weights_once():
    # the same rows in one group, then spread over all four experts: three more experts' weights come from HBM
    # (one expert's weight is read from HBM once, its later row blocks find it in L2)
    g = np.random.default_rng(9)
    x, w = g.standard_normal((64, 32)).astype(np.float32), g.standard_normal((EXPERTS, 48, 32)).astype(np.float32)
    _, one = _grouped_matmul_run(x, w, np.array([0, 0, 0, 64], dtype=np.int32))
    _, four = _grouped_matmul_run(x, w, np.array([16, 32, 48, 64], dtype=np.int32))
    assert four.hbm_read_bytes - one.hbm_read_bytes == 3 * 48 * 32 * 4
    assert four.flops == one.flops == 2 * 64 * 48 * 32  # the same rows multiplied either way


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_compile_runs_the_model_from_input_ids_on_the_npu(name, geir_graphs):
    from geir.frontends.torch import GeirFallbackWarning

    made = geir_graphs
    torch._dynamo.reset()
    model = MODELS[name]()
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", GeirFallbackWarning)  # nothing may fall back to eager torch
        warnings.simplefilter("ignore", FutureWarning)
        got = torch.compile(model, backend="geir")(ids, use_cache=False).logits
        want = model(ids, use_cache=False).logits
    torch._dynamo.reset()
    ran = [c for g in made for c in g.compiled.values() if c is not None and c.last_result is not None]
    moe = {"ge.moe_gating_topk_softmax", "ge.moe_init_routing", "ge.grouped_matmul", "ge.moe_finalize_routing"}
    assert ran and any(moe <= {op.name for op in c.graph.ops} for c in ran)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_floor_divide_rounds_down_as_torch_does():
    class FloorDivide(torch.nn.Module):
        def forward(self, x):
            return x // 3

    from geir.frontends.torch import compile as compile_module

    x = torch.tensor([-7, -6, -5, -1, 0, 1, 5, 6, 7], dtype=torch.int64)  # negatives round down, not to zero
    got = compile_module(FloorDivide(), (x,))(x)
    assert torch.equal(got, torch.floor_divide(x, 3))
