"""The PyTorch adaptor: torch.nn modules imported through torch.export, fused by GE, run on the simulated NPU.

Every numeric test judges the NPU's result by gerun --check's rule (geir.accuracy), which is
torch.compile's: element-wise within the dtype's tolerance of the same module run in float64, or an
RMS error against float64 at most a multiple of that of torch's own eager run in the dtype. A few
tests of assorted ops compare element-wise with torch's f32 output directly.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

# the adaptor imports torch, so it comes after the skip
from geir.accuracy import compare  # noqa: E402
from geir.attributes import DenseResourceAttr  # noqa: E402
from geir.frontends.torch import TorchImportError, compile, from_exported, from_module, save  # noqa: E402
from geir.parser import parse_file  # noqa: E402
from geir.types import DType, TensorType  # noqa: E402
from geir.verifier import verify_graph  # noqa: E402

_GEIR_DTYPES = {torch.float32: DType.f32, torch.float16: DType.f16, torch.bfloat16: DType.bf16}


def _perturb(module: nn.Module, seed: int = 0) -> nn.Module:
    """Make every parameter non-trivial (layer norms off 1 and 0) while keeping torch's init scale."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return module.eval()


def _randn(*shape: int, dtype=torch.float32, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _reference(module: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """What the NPU result is judged against, as torch.compile judges: the module run in float64, and its
    own eager output in its dtype (the baseline of the RMS rule)."""
    with torch.no_grad():
        wide = copy.deepcopy(module).double()
        return wide(*[a.double() if a.is_floating_point() else a for a in args]), module(*args)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, eager: torch.Tensor | None = None,
                   dtype=torch.float32) -> None:
    """Passes gerun --check's rule for `dtype` against `expected`, with `eager` the baseline if given."""
    assert actual.dtype == dtype and tuple(actual.shape) == tuple(expected.shape)
    t = TensorType(tuple(actual.shape), _GEIR_DTYPES[dtype])
    baseline = eager.double().numpy() if eager is not None else None
    verdict = compare(actual.float().numpy(), expected.double().numpy(), t, baseline)
    assert verdict.passed, verdict.render("result")


def ops_of(graph) -> list[str]:
    return [op.name for op in graph.ops]


def check_module(module: nn.Module, args: tuple, dtype=torch.float32, **compile_args):
    """Compile, run once, compare with torch; returns the compiled module for structural checks."""
    fast = compile(module, args, **compile_args)
    out = fast(*args)
    assert_matches(out, *_reference(module, args), dtype)
    return fast


# --- single modules --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_linear_becomes_a_fused_matmul(bias):
    lin = _perturb(nn.Linear(32, 48, bias=bias))
    fast = check_module(lin, (_randn(2, 8, 32),))
    imported = ops_of(fast.module.graph())
    assert "ge.matmul" in imported and imported.count("ge.add") == int(bias)
    mm = next(op for op in fast.module.graph().ops if op.name == "ge.matmul")
    assert mm.attributes == {"transpose_b": True}  # the weight stays [out, in], as torch stores it
    # with a bias, fuse makes matmul + add one cube kernel with an epilogue
    assert ops_of(fast.graph).count("ge.fused_matmul" if bias else "ge.matmul") == 1
    assert "ge.add" not in ops_of(fast.graph)


def test_linear_on_a_vector_input():
    check_module(_perturb(nn.Linear(32, 16)), (_randn(32),))


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(affine):
    ln = _perturb(nn.LayerNorm(64, eps=1e-6, elementwise_affine=affine))
    fast = check_module(ln, (_randn(2, 8, 64, scale=3.0),))
    (op,) = [op for op in fast.module.graph().ops if op.name == "ge.layer_norm"]
    assert op.attributes == {"axis": -1, "epsilon": 1e-6}


def test_layer_norm_over_two_axes():
    check_module(_perturb(nn.LayerNorm([4, 16])), (_randn(2, 3, 4, 16),))


@pytest.mark.parametrize("act, expected", [
    (nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"), "gelu_tanh"), (nn.ReLU(), "relu"), (nn.SiLU(), "silu"),
])
def test_activation_after_linear_is_the_matmul_epilogue(act, expected):
    model = _perturb(nn.Sequential(nn.Linear(32, 64), act))
    fast = check_module(model, (_randn(4, 16, 32, scale=2.0),))
    (fused,) = [op for op in fast.graph.ops if op.name == "ge.fused_matmul"]
    assert fused.attributes["activation"] == expected


@pytest.mark.parametrize("act, op", [
    (nn.GELU(), "ge.gelu"), (nn.GELU(approximate="tanh"), "ge.gelu"), (nn.ReLU(), "ge.relu"), (nn.SiLU(), "ge.silu"),
])
def test_activation_alone(act, op):
    fast = check_module(act.eval(), (_randn(4, 100, scale=3.0),))
    assert op in ops_of(fast.module.graph())


# --- attention ---------------------------------------------------------------------------------------------

class SDPA(nn.Module):
    def __init__(self, is_causal: bool = False):
        super().__init__()
        self.is_causal = is_causal

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.is_causal)


def _qkv(sq: int = 16, skv: int = 16, n: int = 2, d: int = 32, dtype=torch.float32):
    return _randn(1, n, sq, d, dtype=dtype, seed=1), _randn(1, n, skv, d, dtype=dtype, seed=2), \
        _randn(1, n, skv, d, dtype=dtype, seed=3)


@pytest.mark.parametrize("case", ["plain", "causal", "causal_rectangular", "bool_mask", "float_mask"])
def test_scaled_dot_product_attention(case):
    sq, skv = (8, 24) if case == "causal_rectangular" else (16, 16)
    args = _qkv(sq, skv)
    if case == "bool_mask":
        keep = torch.rand(1, 1, sq, skv, generator=torch.Generator().manual_seed(4)) < 0.7
        keep[..., 0] = True  # every query keeps at least one key
        args += (keep,)
    elif case == "float_mask":
        args += (_randn(sq, skv, seed=5),)
    fast = check_module(SDPA(is_causal=case.startswith("causal")), args)
    (fa,) = [op for op in fast.module.graph().ops if op.name == "ge.flash_attention"]
    assert fa.attributes["causal"] == case.startswith("causal")
    assert len(fa.operands) == (4 if case.endswith("mask") else 3)
    assert fa.attributes["scale"] == pytest.approx(1 / math.sqrt(32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_rows_the_mask_hides_wholly_are_zeros_from_flash_attention_itself(kind, dtype):
    """torch's SDPA gives zeros for a query row whose every key is masked; the import zeroes them with a select,
    which fuse takes into flash_attention {zero_masked_rows} (masked_rows): one launch, the same numbers as the
    program with the select (bit for bit) and torch's zeros on those rows."""
    sq, skv = 6, 10
    keep = torch.rand(1, 1, sq, skv, generator=torch.Generator().manual_seed(7)) < 0.6
    keep[..., 0] = True
    keep[..., 2, :] = False  # row 2 keeps no key (a left-padded prompt's padding row)
    keep[..., 4, :] = False
    mask = keep if kind == "bool" else torch.zeros(1, 1, sq, skv, dtype=dtype).masked_fill(~keep, float("-inf"))
    args = _qkv(sq, skv, dtype=dtype) + (mask,)
    fast = check_module(SDPA(), args, dtype)
    out = fast(*args)
    assert torch.equal(out[:, :, [2, 4]], torch.zeros_like(out[:, :, [2, 4]]))  # torch's zeros
    (fa,) = [op for op in fast.graph.ops if op.name == "ge.flash_attention"]
    assert fa.attributes.get("zero_masked_rows") is True
    assert not {"ge.select", "ge.fused_elementwise"} & set(ops_of(fast.graph))
    plain = compile(SDPA(), args, pipeline="conv2d-im2col,canonicalize,cse,fuse{disable=masked_rows},layout,tile,plan,lower")
    expected = plain(*args)
    assert "ge.select" in ops_of(plain.graph) or "ge.fused_elementwise" in ops_of(plain.graph)
    np.testing.assert_array_equal(out.numpy(), expected.numpy())  # the fused kernel computes what the pair did


def test_sdpa_with_explicit_scale_and_grouped_heads():
    class GQA(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)

    q = _randn(1, 4, 16, 32, seed=1)
    k, v = _randn(1, 2, 16, 32, seed=2), _randn(1, 2, 16, 32, seed=3)
    check_module(GQA(), (q, k, v))


class HandAttention(nn.Module):
    """softmax(q @ k^T * scale) @ v, written out as people write it."""

    def __init__(self, divide: bool = False):
        super().__init__()
        self.divide = divide

    def forward(self, q, k, v):
        if self.divide:
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        else:
            scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.size(-1)))
        return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("divide", [False, True])
def test_hand_written_attention_fuses_into_flash_attention(divide):
    fast = check_module(HandAttention(divide), _qkv())
    imported = ops_of(fast.module.graph())
    assert imported.count("ge.matmul") == 2 and "ge.softmax" in imported  # imported as written ...
    ops = ops_of(fast.graph)
    assert ops.count("ge.flash_attention") == 1  # ... and GE's fuse makes it one kernel
    assert not {"ge.matmul", "ge.softmax", "ge.transpose"} & set(ops)
    (fa,) = [op for op in fast.graph.ops if op.name == "ge.flash_attention"]
    assert fa.attributes["scale"] == pytest.approx(1 / math.sqrt(32), rel=1e-6)


def test_nanogpt_masked_attention_fuses_as_causal():
    class Masked(nn.Module):
        def __init__(self, size: int = 16):
            super().__init__()
            self.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))

        def forward(self, q, k, v):
            t = q.size(-2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            return F.softmax(att, dim=-1) @ v

    fast = check_module(Masked(), _qkv())
    (fa,) = [op for op in fast.graph.ops if op.name == "ge.flash_attention"]
    assert fa.attributes["causal"] is True and len(fa.operands) == 3


def test_heads_split_and_merged_with_residual():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, x):
            b, s, d = x.shape
            h = self.proj(x).view(b, s, 4, d // 4).permute(0, 2, 1, 3)  # [B, N, S, D]
            h = h.transpose(1, 2).reshape(b, s, d)
            return x + h.unsqueeze(0).squeeze(0) * 0.5

    fast = check_module(_perturb(Heads()), (_randn(2, 8, 64),))
    assert {"ge.reshape", "ge.transpose", "ge.add"} <= set(ops_of(fast.module.graph()))


def test_assorted_ops_match_torch():
    class Assorted(nn.Module):
        def forward(self, x, y, m):
            a = torch.cat([x, y.expand(4, 8)], dim=0)
            b = torch.stack([x.sum(-1), x.mean(-1), x.amax(-1)], dim=1)
            c = a.narrow(0, 1, 4)[:, 2:6] + a.select(0, 3).unsqueeze(0)[:, :4]
            p, q = a.chunk(2, dim=1)
            r = torch.where(p > 0, p, q * 0.5) + torch.where(p >= 0.5, 1.0, -1.0) + (p != q).float()
            s = r.masked_fill(m, 3.0) + (p <= 0).to(torch.float32) + (p == p).float() * (q < 1).float()
            u = torch.addmm(torch.ones(4), s.t(), r, beta=0.5, alpha=2.0) + torch.bmm(s[None], s.t()[None])[0, :4].sum()
            v = (1 - x).sigmoid() * x.tanh() + (x.abs() + 1).sqrt().reciprocal() + (x.abs() + 1).rsqrt() - x.neg().exp()
            w = torch.maximum(x, y) - torch.minimum(x, y) ** 2 + x.square() + torch.pow(x, 3)
            h = x.to(torch.float16).to(torch.float32) + torch.zeros_like(x) + torch.full_like(x, 2.0)
            z = torch.flatten(torch.unbind(x, dim=0)[1].view(2, 4)).view(1, 8) * x.amax(dim=0, keepdim=True)
            return u, v + w + h + z, b, c

    args = (_randn(4, 8), _randn(1, 8, seed=1), torch.rand(8, 4, generator=torch.Generator().manual_seed(2)) < 0.5)
    fast = compile(Assorted(), args)
    for got, want in zip(fast(*args), Assorted()(*args)):
        assert_matches(got, want)


# --- transformer blocks ---------------------------------------------------------------------------------

class GPT2Block(nn.Module):
    """A GPT-2 block: pre-norm causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU(approximate="tanh")
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).permute(0, 2, 1, 3) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.permute(0, 2, 1, 3).reshape(b, s, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A few GPT-2 blocks, a final layer norm and an output projection."""

    def __init__(self, layers: int = 3, d: int = 64, vocab: int = 96):
        super().__init__()
        self.blocks = nn.ModuleList(GPT2Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpt2_block(dtype):
    block = _perturb(GPT2Block()).to(dtype)
    fast = check_module(block, (_randn(1, 32, 64, dtype=dtype, scale=0.5),), dtype)
    ops = ops_of(fast.graph)
    # the second layer norm takes the residual add before it; the first reads the block's input
    assert ops.count("ge.layer_norm") == 1 and ops.count("ge.add_layer_norm") == 1
    assert ops.count("ge.flash_attention") == 1
    assert ops.count("ge.fused_matmul") == 4
    assert "ge.matmul" not in ops and "ge.gelu" not in ops


def test_multi_layer_model():
    model = _perturb(TinyGPT(layers=3))
    fast = check_module(model, (_randn(2, 16, 64, scale=0.5),))
    ops = ops_of(fast.graph)
    # 7 layer norms: all but the first take the residual add before them
    assert ops.count("ge.flash_attention") == 3
    assert ops.count("ge.layer_norm") == 1 and ops.count("ge.add_layer_norm") == 6
    assert ops.count("ge.fused_matmul") == 12 and ops.count("ge.matmul") == 1  # the head has no bias
    p = fast.profile()
    assert p["simulated_time_us"] > 0 and len(p["kernels"]) >= 3 * 7


def test_dynamic_sequence_length_replans_through_the_plan_cache():
    block = _perturb(GPT2Block())
    seq = torch.export.Dim("seq", min=2, max=128)
    fast = compile(block, (_randn(1, 16, 64),), dynamic_shapes={"x": {1: seq}})
    assert fast.module.graph().args[0].type.shape == (1, None, 64)
    for s in (16, 24, 16):
        x = _randn(1, s, 64, seed=s)
        assert_matches(fast(x), *_reference(block, (x,)))
    assert fast.session.plan_cache["misses"] == 2 and fast.session.plan_cache["hits"] == 1


# --- the imported module --------------------------------------------------------------------------------

def test_from_module_gives_a_verified_main_graph_with_named_weights():
    block = _perturb(GPT2Block())
    module = from_module(block, (_randn(1, 16, 64),))
    graph = module.graph()
    assert graph.name == "main" and [a.name for a in graph.args] == ["x"]
    assert verify_graph(graph)
    keys = {op.attributes["value"].key for op in graph.ops
            if op.name == "ge.const" and isinstance(op.attributes["value"], DenseResourceAttr)}
    assert keys == set(module.resources)
    state = block.state_dict()
    assert "c_attn.weight" in keys
    for k in keys:
        np.testing.assert_array_equal(module.resources[k], state[k].numpy())


def test_from_exported_program():
    lin = _perturb(nn.Linear(16, 8))
    x = _randn(3, 16)
    module = from_exported(torch.export.export(lin, (x,)))
    assert [op.name for op in module.graph().ops][-3:] == ["ge.matmul", "ge.add", "ge.return"]


def test_saved_module_runs_under_gerun(tmp_path):
    from geir.tools import gerun

    block = _perturb(GPT2Block()).to(torch.bfloat16)
    x = _randn(1, 16, 64, dtype=torch.bfloat16, scale=0.5)
    geir_path, npz_path = save(from_module(block, (x,)), tmp_path / "block.geir")
    assert npz_path == tmp_path / "block.npz"
    assert parse_file(str(geir_path)).graph().args[0].type == TensorType((1, 16, 64), DType.bf16)
    np.savez(tmp_path / "in.npz", x=x.float().numpy())
    assert gerun.main([str(geir_path), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz") as out:
        got = torch.from_numpy(out["result0"]).to(torch.bfloat16)
    assert_matches(got, *_reference(block, (x,)), torch.bfloat16)


def test_several_outputs_keep_their_structure():
    class Two(nn.Module):
        def forward(self, x):
            return x.relu(), (x * 2).mean(dim=-1, keepdim=True)

    x = _randn(4, 32)
    fast = compile(Two(), (x,))
    out = fast(x)
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, Two()(x)):
        assert_matches(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_d_result_comes_back_zero_d_as_in_eager_torch(dtype):
    class Reductions(nn.Module):
        def forward(self, x):
            return x.sum(), (x * x).mean(), x.amax(dim=(0, 1), keepdim=True)

    x = _randn(4, 32, dtype=dtype)
    fast = compile(Reductions(), (x,))
    for got, want, eager in zip(fast(x), *_reference(Reductions(), (x,))):
        assert got.shape == eager.shape  # () for the sums: torch's 0-d, not (1,)
        assert_matches(got, want, eager, dtype)


def test_inputs_of_the_wrong_dtype_are_refused():
    fast = compile(nn.ReLU(), (_randn(8),))
    with pytest.raises(TypeError, match="compiled for f32"):
        fast(_randn(8, dtype=torch.float16))


# --- what cannot be imported ----------------------------------------------------------------------------

def test_unsupported_op_names_the_op_and_the_node():
    class Cumprod(nn.Module):
        def forward(self, x):
            return torch.cumprod(x, dim=-1)

    with pytest.raises(TorchImportError, match=r"aten\.cumprod\.default at node 'cumprod' \(.*test_torch_frontend\.py:\d+\)"):
        from_module(Cumprod(), (_randn(4, 8),))


def test_unsupported_dtype_is_named():
    with pytest.raises(TorchImportError, match="float64"):
        from_module(nn.ReLU(), (_randn(4).double(),))


def test_training_mode_dropout_is_refused_with_the_fix():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))
    with pytest.raises(TorchImportError, match=r"aten\.dropout.*module\.eval\(\)"):
        from_module(model.train(), (_randn(2, 8),))
    check_module(_perturb(model), (_randn(2, 8),))  # _perturb puts it in eval mode


def test_dynamic_batch_and_length_in_one_reshape_are_read_from_the_input():
    block = _perturb(GPT2Block())
    dims = {"x": {0: torch.export.Dim("batch", min=2, max=8), 1: torch.export.Dim("seq", min=2, max=64)}}
    fast = compile(block, (_randn(2, 16, 64),), dynamic_shapes=dims)
    assert fast.module.graph().args[0].type.shape == (None, None, 64)
    assert "ge.dynamic_reshape" in ops_of(fast.module.graph())  # [B, S, 64] -> [B, S, 4, 16] needs both sizes
    for b, s in ((2, 16), (3, 8), (5, 24)):
        x = _randn(b, s, 64, seed=b * s)
        assert_matches(fast(x), *_reference(block, (x,)))
    assert fast.session.plan_cache["misses"] == 3


def test_a_reshape_to_products_of_run_time_sizes_computes_them_in_the_graph():
    class Merge(nn.Module):
        def forward(self, x):
            return x.reshape(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3]) - 1

    dims = {"x": {k: torch.export.Dim(f"d{k}", min=2, max=8) for k in range(4)}}
    fast = compile(Merge(), (_randn(2, 3, 4, 5),), dynamic_shapes=dims)
    assert {"ge.dim", "ge.mul", "ge.dynamic_reshape"} <= set(ops_of(fast.module.graph()))
    for shape in ((2, 3, 4, 5), (7, 2, 3, 8)):
        x = _randn(*shape)
        assert torch.equal(fast(x), Merge()(x))


# --- indexing: what Hugging Face models do with token ids and masks ---------------------------------------

class Embeddings(nn.Module):
    """GPT-2's embeddings with HF's position ids from the attention mask (cumsum - 1, padding filled with 1)."""

    def __init__(self, vocab: int = 120, positions: int = 32, d: int = 64):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(positions, d)

    def forward(self, ids, mask):
        pos = mask.long().cumsum(-1) - 1
        pos = pos.masked_fill(mask == 0, 1)
        return self.wte(ids) + self.wpe(pos), pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embedding_and_position_ids_from_the_mask_match_torch(dtype):
    model = _perturb(Embeddings()).to(dtype)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 120, (2, 16), generator=gen)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    fast = compile(model, (ids, mask))
    assert {"ge.gather", "ge.cumsum"} <= set(ops_of(fast.module.graphs[0]))
    h, pos = fast(ids, mask)
    want_h, want_pos = model(ids, mask)
    assert torch.equal(pos, want_pos)
    assert h.dtype == dtype and torch.equal(h, want_h)  # a lookup and one add: the same bits as torch


def test_index_select_cumsum_and_float_tests_match_torch():
    class Assorted(nn.Module):
        def forward(self, x, y, i):
            flags = torch.where(torch.isinf(x), 1.0, 0.0) + torch.where(torch.isnan(x), 2.0, 0.0)
            return (torch.index_select(x, 1, i), torch.index_select(x, 0, i[0]), flags, torch.cumsum(y, dim=0),
                    torch.arange(3, 40, 5) + i[:1])

    x, y = _randn(6, 50), _randn(40, 3, seed=1)
    x[0, 3], x[2, 7], x[4, 1] = float("inf"), float("-inf"), float("nan")
    i = torch.tensor([4, 0, 4, 49, 7])
    fast = compile(Assorted(), (x, y, i))
    got, want = fast(x, y, i), Assorted()(x, y, i)
    for k in (0, 1, 2, 4):  # moved or tested elements, and integers: exactly torch's (NaN where torch has NaN)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True)
    class Cumsum(nn.Module):
        def forward(self, y):
            return torch.cumsum(y, dim=0)

    assert_matches(got[3], *_reference(Cumsum(), (y,)))
    ops = set(ops_of(fast.module.graphs[0]))
    assert {"ge.gather", "ge.isinf", "ge.isnan", "ge.cumsum"} <= ops and "ge.arange" not in ops  # a static arange folds


def test_isnan_of_an_integer_tensor_is_all_false_like_torch():
    class IntNan(nn.Module):
        def forward(self, i):
            return torch.isnan(i)

    i = torch.tensor([[1, 2], [3, 4]])
    fast = compile(IntNan(), (i,))
    assert torch.equal(fast(i), torch.isnan(i))



def test_indexing_with_one_integer_tensor_is_a_gather_like_torch():
    class Index(nn.Module):
        def forward(self, x, i, j):
            return x[:, i], x[j], x[..., i]

    x = _randn(5, 7, 9)
    i, j = torch.tensor([[0, 3], [-1, 2]]), torch.tensor([4, -5, 0])
    fast = compile(Index(), (x, i, j))
    assert ops_of(fast.module.graphs[0]).count("ge.gather") == 3
    for got, want in zip(fast(x, i, j), Index()(x, i, j)):
        assert torch.equal(got, want)


def test_indexing_with_a_boolean_mask_is_refused_with_the_reason():
    class Masked(nn.Module):
        def forward(self, x, m):
            return x[m]

    x = _randn(5, 7)
    with pytest.raises(TorchImportError, match=r"aten\.index\.Tensor at node .*boolean mask: its result's size depends"):
        from_module(Masked(), (x, x > 0))


def test_indexing_with_two_run_time_index_tensors_is_a_ge_index_like_torch():
    class Pairs(nn.Module):
        def forward(self, x, i, j):
            return x[i, j], x[:, i, j]

    x = _randn(5, 6, 7)
    i, j = torch.tensor([[4], [-5], [0]]), torch.tensor([3, -1])  # broadcast to 3x2, negatives count from the end
    fast = compile(Pairs(), (x, i, j))
    assert ops_of(fast.module.graphs[0]).count("ge.index") == 2
    for got, want in zip(fast(x, i, j), Pairs()(x, i, j)):
        assert torch.equal(got, want)


def test_writes_through_indices_match_torch_index_put_index_copy_and_scatter():
    class Writes(nn.Module):
        def forward(self, cache, k, pos, x, i, v, src, index):
            updated = cache.index_copy(2, pos, k)  # a KV cache written at the new positions
            added = x.index_put((i,), v, accumulate=True)  # duplicates in i add up
            put = x.index_put((i[:2], i[:2]), v[:2, 0])  # distinct pairs: torch leaves duplicates undefined
            return updated, added, put, x.scatter(1, index, src), x.scatter_add(0, index, src), x.scatter(1, index, 2.5)

    cache, k = _randn(1, 2, 8, 4), _randn(1, 2, 3, 4, seed=1)
    pos = torch.tensor([5, 0, 7])
    x, v = _randn(4, 4, seed=2), _randn(3, 4, seed=3)
    i = torch.tensor([1, 3, 1])
    # each row a permutation: scatter writes every element once (torch leaves duplicates undefined)
    src, index = _randn(3, 4, seed=4), torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]])
    args = (cache, k, pos, x, i, v, src, index)
    fast = compile(Writes(), args)
    ops = ops_of(fast.module.graphs[0])
    assert ops.count("ge.index_put") == 3 and ops.count("ge.scatter_elements") == 3
    for got, want in zip(fast(*args), Writes()(*args)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_sdpa_gives_zeros_where_a_row_sees_no_key_as_torch_does():
    class Attend(nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    q, k, v = _randn(1, 2, 4, 8), _randn(1, 2, 5, 8, seed=1), _randn(1, 2, 5, 8, seed=2)
    m = torch.ones(1, 1, 4, 5, dtype=torch.bool)
    m[..., 0, :] = False  # a left-padded prompt's padding row: no key to attend to
    fast = compile(Attend(), (q, k, v, m))
    got, want = fast(q, k, v, m), Attend()(q, k, v, m)
    assert torch.all(want[..., 0, :] == 0) and torch.all(got[..., 0, :] == 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
