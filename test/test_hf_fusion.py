"""Hugging Face models' own spellings fuse, and compute what torch computes (the `hf` extra).

Models are built from small random-init configs (no downloads), in both of transformers' attention
implementations ("eager": attention written out op by op; "sdpa": torch's scaled_dot_product_attention
with the mask HF builds), and imported through `geir.frontends.torch` from `inputs_embeds`. The
oracles: the same model run by torch in float64 (the reference) and in float32 (the eager baseline),
judged by geir.accuracy's torch.compile rule; and the model's config for what must fuse (one
attention per layer, K/V with the config's `num_key_value_heads`).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from geir.accuracy import compare  # noqa: E402
from geir.frontends.torch import compile as geir_compile  # noqa: E402
from geir.ops.linalg import bnsd  # noqa: E402
from geir.types import DType, TensorType  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ = 2, 64, 4, 16


def _model(kind: str, attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":  # grouped-query attention: 2 kv heads for 4 query heads, RoPE, RMSNorm
        config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                          num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=100)
        model = transformers.LlamaModel(config)
    else:  # T5's encoder: a relative position bias added to unscaled scores, RMSNorm without a mean
        config = transformers.T5Config(d_model=HIDDEN, d_ff=128, num_layers=LAYERS, num_heads=HEADS, d_kv=16,
                                       vocab_size=100)
        model = transformers.T5EncoderModel(config)
    model.config._attn_implementation = attention
    return model.eval()


class _FromEmbeddings(torch.nn.Module):
    """The model's last hidden state from `inputs_embeds` (the token embedding is another issue's op)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).last_hidden_state


CASES = [(k, a) for k in ("llama", "t5") for a in ("eager", "sdpa")]


@pytest.mark.parametrize("kind, attention", CASES, ids=[f"{k}-{a}" for k, a in CASES])
def test_hf_attention_fuses_natively_and_matches_torch(kind, attention):
    model = _FromEmbeddings(_model(kind, attention))
    x = torch.randn(1, SEQ, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = geir_compile(model, (x,))
    attention_ops = [op for op in compiled.graph.ops if op.name == "ge.flash_attention"]
    assert len(attention_ops) == LAYERS, [op.name for op in compiled.graph.ops]
    kv_heads = model.model.config.num_key_value_heads if kind == "llama" else HEADS
    for op in attention_ops:
        # the kernel reads the grouped K/V itself: no repeated copies are built for it
        # (heads are axis 1 of BNSD, axis 2 of BSND: the layout attention_layout folds the head transposes into)
        assert bnsd(op.operands[1].type, op.layout)[1] == kv_heads and bnsd(op.operands[2].type, op.layout)[1] == kv_heads
        if kind == "llama":  # HF's causal mask is the kernel's causal flag, not a tensor it reads
            assert op.attr("causal") and len(op.operands) == 3
    assert not [op for op in compiled.graph.ops if op.name == "ge.softmax"], "a softmax was left unfused"
    if kind == "t5" or attention == "eager":
        # each norm after a residual add takes the add in (add_rms_norm); the first reads the embeddings alone
        norms = [op for op in compiled.graph.ops if op.name in ("ge.rms_norm", "ge.add_rms_norm")]
        assert len(norms) == 2 * LAYERS + 1

    actual = compiled(x).detach().numpy()
    with torch.no_grad():
        eager = model(x).numpy()
        reference = model.double()(x.double()).numpy()
    verdict = compare(actual, reference, TensorType(tuple(actual.shape), DType.f32), eager)
    assert verdict.passed, verdict.render("last_hidden_state")
    assert np.isfinite(actual).all()
