"""Regional import (frontends/torch_regional.py): a model exported with two of its layers, imported with all of them.

Oracle: torch.export of the whole model, imported as ever. The regional module must be that module op for op
(helpers.module_sig: the same ops, attributes, types, operand wiring, arguments and weights, value names aside),
for the serving step programs on LLaMA (grouped KV heads) and GPT-2 and generate's on five families; and what it
serves and generates must be Hugging Face's greedy tokens. A model whose layers differ is exported whole.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import geir.frontends.serve as serving  # noqa: E402
from geir.frontends.generate import _export, _StepModule, import_step  # noqa: E402
from geir.frontends.torch import generate, serve  # noqa: E402
from geir.frontends.torch_import import import_program  # noqa: E402
from geir.frontends.torch_regional import LayersDiffer, LayerWalk, cut_to_two_layers  # noqa: E402
from geir.passes.dce import eliminate_dead_ops  # noqa: E402
from helpers import module_sig  # noqa: E402
from helpers.tiny_models import tiny_gpt2, tiny_llama  # noqa: E402

LAYERS, BLOCK = 4, 16


def _llama(layers: int = LAYERS) -> torch.nn.Module:
    return tiny_llama(layers)


def _gpt2() -> torch.nn.Module:
    return tiny_gpt2(LAYERS)


def _whole(make, model, inputs, dynamic, per_layer=(), per_layer_dynamic=()):
    """The oracle: the whole model exported and imported."""
    dims = (*dynamic, tuple(per_layer_dynamic)) if per_layer else dynamic
    return import_program(_export(make(model), (*inputs, *per_layer), dims))


def _assert_same_module(regional, whole) -> None:
    assert regional.input_names == whole.input_names
    for imported in (regional, whole):  # each walk leaves dead stand-ins of its own (the cache layers' lengths)
        eliminate_dead_ops(imported.module.graph())
    assert module_sig(regional.module, value_names=False) == module_sig(whole.module, value_names=False)
    a, b = regional.module.resources, whole.module.resources
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), key


def _serving_steps(model):
    """serve's decode and prefill step programs: (make, inputs, dynamic, per-layer pools, their dims)."""
    step = _StepModule(model, False)
    pools = tuple(torch.zeros(64 * BLOCK, step.kv_heads, step.head_dim) for _ in range(2 * step.layers))
    b_dim, n_dim = serving._DIMS
    rows = [serving._Sequence(0, [1, 2, 3], 2, 0.0, [1, 2]), serving._Sequence(1, [1, 2, 3], 2, 0.0, [1, 2])]
    decode = (lambda m: serving._PagedDecode(m, BLOCK), serving._decode_inputs(rows, [[0, 0], [0, 0]], 2, BLOCK),
              ({0: b_dim}, {0: b_dim, 1: BLOCK * n_dim}, None, {0: b_dim}, {0: b_dim}, {0: b_dim, 1: n_dim}))
    slots = 3 * BLOCK
    prompts = [([5, 6, 7] * slots)[:slots], ([5, 6, 7] * slots)[:slots - 1]]
    tables = [[0, 1, 2], [3, 4, 5]]
    writes = [[serving._slot_of(t, j, BLOCK) for j in range(slots)] for t in tables]
    prefill = (lambda m: serving._PagedPrefill(m, BLOCK),
               serving._prefill_inputs(prompts, slots, writes, tables, BLOCK),
               ({0: b_dim, 1: BLOCK * n_dim}, {0: b_dim, 1: BLOCK * n_dim}, {0: BLOCK * n_dim},
                {0: b_dim, 1: BLOCK * n_dim}, {0: b_dim}, {0: b_dim, 1: BLOCK * n_dim}, {0: b_dim, 1: n_dim}))
    return {"decode": (*decode, pools, tuple(None for _ in pools)),
            "prefill": (*prefill, pools, tuple(None for _ in pools))}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_a_serving_step_imported_from_two_layers_is_the_whole_models(family, phase):
    model = _llama() if family == "llama" else _gpt2()
    make, inputs, dynamic, pools, dims = _serving_steps(model)[phase]
    regional = import_step(make, model, inputs, dynamic, pools, dims)
    assert regional.in_spec is None  # the regional path was taken (the whole export keeps torch's specs)
    _assert_same_module(regional, _whole(make, model, inputs, dynamic, pools, dims))


def _family(name: str) -> torch.nn.Module:
    """A small random-init model of a family generate takes, with LAYERS layers."""
    torch.manual_seed(0)
    if name == "llama":
        return _llama()
    if name == "gpt2":
        return _gpt2()
    if name == "qwen2":  # q/k/v biases
        cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    if name == "gptj":
        cfg = transformers.GPTJConfig(n_embd=64, n_inner=128, n_layer=LAYERS, n_head=4, rotary_dim=8, n_positions=64,
                                      vocab_size=100, bos_token_id=0, eos_token_id=0)
        return transformers.GPTJForCausalLM(cfg).eval()
    cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, vocab_size=100,
                                    multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False)
    return transformers.FalconForCausalLM(cfg).eval()


@pytest.mark.parametrize("family", ["llama", "gpt2", "gptj", "falcon", "qwen2"])
def test_generates_step_programs_imported_from_two_layers_are_the_whole_models(family):
    model = _family(family)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    mask = torch.ones_like(ids)
    slots = 16
    s_dim, l_dim = torch.export.Dim("prompt", min=2, max=1 << 16), torch.export.Dim("cache", min=2, max=1 << 16)
    prefill_args = (ids, torch.cat([mask, torch.zeros(1, slots - 5, dtype=torch.long)], 1), torch.arange(5),
                    torch.arange(5)[None])
    prefill_dims = ({1: s_dim}, {1: l_dim}, {0: s_dim}, {1: s_dim})
    make = lambda m: _StepModule(m, True)  # noqa: E731
    regional = import_step(make, model, prefill_args, prefill_dims)
    assert regional.in_spec is None
    _assert_same_module(regional, _whole(make, model, prefill_args, prefill_dims))
    with torch.no_grad():
        cache = make(model)(*prefill_args)[1:]
    decode_args = (ids[:, :1], prefill_args[1], torch.tensor([5]), prefill_args[3][:, :1])
    decode_dims = (None, {1: l_dim}, None, None)
    per_layer_dims = tuple({2: l_dim} for _ in cache)
    make = lambda m: _StepModule(m, False)  # noqa: E731
    regional = import_step(make, model, decode_args, decode_dims, cache, per_layer_dims)
    assert regional.in_spec is None
    _assert_same_module(regional, _whole(make, model, decode_args, decode_dims, cache, per_layer_dims))


def test_served_and_generated_tokens_are_hugging_faces_greedy_ones():
    model = _llama()
    g = torch.Generator().manual_seed(3)
    trace = [(torch.randint(1, 100, (n,), generator=g), new, at) for n, new, at in ((6, 5, 0.0), (11, 4, 50.0))]
    run = serve(model, trace, block_size=8, warmup="none")
    for record, (ids, new, _) in zip(run.requests, trace):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=new,
                                  do_sample=False, pad_token_id=0)[0]
        assert torch.equal(record.tokens, want)
    ids = trace[0][0][None]
    out = generate(model, ids, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              pad_token_id=0)
    assert torch.equal(torch.as_tensor(out.tokens), want)


def test_a_model_whose_layers_differ_is_not_cut():
    model = _llama()
    model.model.layers[3].self_attn.scaling = 0.5  # one layer's setting: not one layer repeated
    assert cut_to_two_layers(model) is None
    assert cut_to_two_layers(_llama(2)) is None  # two layers: nothing to stamp out
    mixed = _llama()
    mixed.config.layer_types = ["full_attention", "sliding_attention"] * 2
    assert cut_to_two_layers(mixed) is None
    torch.manual_seed(0)  # Gemma2: sliding and full attention layers alternate
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, vocab_size=100)).eval()
    assert cut_to_two_layers(gemma2) is None


def test_layers_that_trace_differently_are_refused_and_exported_whole():
    # forward hooks scale each layer's MLP output by its own factor: the modules are alike, the traced layers are not
    model = _llama()
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_hook(lambda m, args, out, f=float(i + 1): out * f)
    make, inputs, dynamic, pools, dims = _serving_steps(model)["decode"]
    cut = cut_to_two_layers(model)
    assert cut is not None
    ep = _export(make(cut.model), (*inputs, *pools[:4]), (*dynamic, tuple(dims[:4])))
    why = LayerWalk.of(ep, cut.repeat(make(model), "model"))
    assert isinstance(why, str) and "differ at node" in why
    with pytest.raises(LayersDiffer):
        import_program(ep, repeat=cut.repeat(make(model), "model"))
    whole = import_step(make, model, inputs, dynamic, pools, dims)
    assert whole.in_spec is not None  # exported whole
    _assert_same_module(whole, _whole(make, model, inputs, dynamic, pools, dims))


def test_the_cut_leaves_the_model_as_it_was():
    model = _llama()
    before = [id(m) for m in model.model.layers]
    cut = cut_to_two_layers(model)
    assert len(cut.model.model.layers) == 2 and cut.model.config.num_hidden_layers == 2
    assert [id(m) for m in model.model.layers] == before and model.config.num_hidden_layers == LAYERS
    assert cut.model.model.layers[1] is model.model.layers[1]  # the weights shared, not copied
