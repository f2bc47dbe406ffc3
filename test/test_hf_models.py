"""Hugging Face models from what users feed them: `input_ids` with a padded `attention_mask` at batch 2
(`pixel_values` for ViT), through both frontends, in f32, f16 and bf16 (the `hf` extra;
bench/hf_models.py prints the whole table); and a dynamic-length export serving three lengths.

Oracles: the same model run by torch in float64 (the reference) and in float32 (the eager baseline),
judged by geir.accuracy's torch.compile rule; the config says how many attention blocks must fuse.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from geir.accuracy import compare  # noqa: E402
from geir.frontends.torch import from_module  # noqa: E402
from geir.frontends.torch_builder import to_numpy  # noqa: E402
from geir.ir import Module  # noqa: E402
from geir.ops.linalg import bnsd  # noqa: E402
from geir.session import Session, run_program  # noqa: E402
from geir.types import DType, TensorType  # noqa: E402

LAYERS, HIDDEN, HEADS, BATCH, SEQ = 2, 64, 4, 2, 16


TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
GEIR_DTYPES = {"f32": DType.f32, "f16": DType.f16, "bf16": DType.bf16}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64, vocab_size=100,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2Model(cfg).eval()
    if kind == "llama":  # grouped-query attention (2 kv heads for 4), RoPE, RMSNorm
        cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                       num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=100)
        return transformers.LlamaModel(cfg).eval()
    if kind == "bert":
        cfg = transformers.BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      intermediate_size=128, max_position_embeddings=64, vocab_size=100)
        return transformers.BertModel(cfg, add_pooling_layer=False).eval()
    if kind == "t5":  # the encoder: a relative position bias, then the padding mask
        cfg = transformers.T5Config(d_model=HIDDEN, d_ff=128, num_layers=LAYERS, num_heads=HEADS, d_kv=16,
                                    vocab_size=100)
        return transformers.T5EncoderModel(cfg).eval()
    cfg = transformers.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                 intermediate_size=128, image_size=32, patch_size=8, num_channels=3)
    return transformers.ViTModel(cfg, add_pooling_layer=False).eval()


class _Hidden(torch.nn.Module):
    """The last hidden state from token ids and their mask, or from an image batch (ViT)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if len(xs) == 1:
            return self.model(pixel_values=xs[0]).last_hidden_state
        ids, mask = xs
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _feed(seq: int = SEQ, kind: str = "gpt2") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq)
    if kind == "vit":
        return (torch.randn(BATCH, 3, 32, 32, generator=g),)
    ids = torch.randint(1, 100, (BATCH, seq), generator=g)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[-1, seq - seq // 4:] = 0  # the second row ends in padding
    return ids, mask


def _import(model: torch.nn.Module, args: tuple, path: str, tmp_path, dynamic: Any = None) -> tuple[Module, dict]:
    if path == "torch":
        module = from_module(model, args, dynamic_shapes=dynamic)
        return module, module.resources
    pytest.importorskip("onnxscript")
    from geir.frontends.onnx import import_onnx

    out = tmp_path / "model.onnx"
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        torch.onnx.export(model, args, dynamo=True, dynamic_shapes=dynamic).save(str(out))
    return import_onnx(str(out))


def _judge(model: torch.nn.Module, kind: str, args: tuple, actual: np.ndarray, dtype: str = "f32") -> None:
    """GEIR's output against torch in float64, no worse than torch's own run in `dtype` (the torch.compile rule)."""
    with torch.no_grad():
        eager = model(*args).float().numpy()
        doubled = [a.double() if a.is_floating_point() else a for a in args]
        reference = _Hidden(_model(kind).double())(*doubled).numpy()
    verdict = compare(np.asarray(actual, dtype=np.float64), reference,
                      TensorType(tuple(actual.shape), GEIR_DTYPES[dtype]), eager)
    assert verdict.passed, verdict.render("last_hidden_state")


# T5's encoder does not get through torch's ONNX exporter (its view of the attention output fails in the
# exporter's decomposition, before GEIR sees a graph): strict, so a torch that fixes it is noticed
T5_ONNX = pytest.mark.xfail(reason="torch.onnx.export fails on T5's encoder", strict=True)
CASES = [pytest.param(k, p, d, marks=[T5_ONNX] if (k, p) == ("t5", "onnx") else [], id=f"{k}-{p}-{d}")
         for k in ("gpt2", "llama", "bert", "t5", "vit") for p in ("torch", "onnx") for d in ("f32", "f16", "bf16")]


@pytest.mark.parametrize("kind, path, dtype", CASES)
def test_model_from_what_users_feed_it(kind, path, dtype, tmp_path):
    model = _Hidden(_model(kind).to(TORCH_DTYPES[dtype]))
    args = _feed(kind=kind)
    if kind == "vit":
        args = (args[0].to(TORCH_DTYPES[dtype]),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, weights = _import(model, args, path, tmp_path)
    session = Session(Module([module.graph()], module.file, weights))
    attention = [op for op in session.generic.ops if op.name == "ge.flash_attention"]
    assert len(attention) == LAYERS, "every attention block fuses"
    feed = {a.name: to_numpy(x) for a, x in zip(session.generic.args, args)}
    program = session.program({k: v.shape for k, v in feed.items()})
    actual = np.asarray(run_program(program, feed, weights).outputs[0], dtype=np.float64)
    _judge(model, kind, args, actual, dtype)
    assert np.isfinite(actual).all(), "no row is NaN: the padded row's queries still see their real keys"


DYNAMIC = [pytest.param(k, p, marks=[T5_ONNX] if (k, p) == ("t5", "onnx") else [], id=f"{k}-{p}")
           for k in ("gpt2", "llama", "bert", "t5") for p in ("torch", "onnx")]


@pytest.mark.parametrize("kind, path", DYNAMIC)
def test_a_dynamic_length_export_compiles_once_and_serves_three_lengths(kind, path, tmp_path):
    model = _Hidden(_model(kind))
    seq = torch.export.Dim("seq", min=2, max=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, weights = _import(model, _feed(), path, tmp_path, dynamic=(({1: seq}, {1: seq}),))
    assert [a.type.shape for a in module.graph().args] == [(BATCH, None)] * 2, "the length is `?`"
    session = Session(Module([module.graph()], module.file, weights))  # GE compiles once
    attention = [op for op in session.generic.ops if op.name == "ge.flash_attention"]
    assert len(attention) == LAYERS, "every attention block fuses with the length unknown"
    if kind == "llama":  # grouped-query heads stay grouped: 2 kv heads for 4 query heads, not repeated
        assert all(bnsd(op.operands[1].type, op.layout)[1] == 2 for op in attention)
    for n in (8, 16, 24, 16):
        args = _feed(n)
        feed = {a.name: to_numpy(x) for a, x in zip(session.generic.args, args)}
        program = session.program({k: v.shape for k, v in feed.items()})
        assert not any(op.name in ("ge.dim", "ge.shape_of", "ge.range", "ge.dynamic_reshape")
                       for op in program.ops), "the size arithmetic is evaluated when the shapes bind"
        actual = np.asarray(run_program(program, feed, weights).outputs[0])
        assert actual.shape == (BATCH, n, HIDDEN)
        _judge(model, kind, args, actual)
    assert session.plan_cache["misses"] == 3 and session.plan_cache["hits"] == 1
