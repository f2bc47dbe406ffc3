"""Hugging Face language models from what users feed them: `input_ids` with a padded `attention_mask` at
batch 2, through both frontends (the `hf` extra; bench/hf_models.py prints the whole table).

Oracles: the same model run by torch in float64 (the reference) and in float32 (the eager baseline),
judged by geir.accuracy's torch.compile rule; the config says how many attention blocks must fuse.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from geir.accuracy import compare  # noqa: E402
from geir.frontends.torch import from_module  # noqa: E402
from geir.frontends.torch_builder import to_numpy  # noqa: E402
from geir.ir import Module  # noqa: E402
from geir.session import Session, run_program  # noqa: E402
from geir.types import DType, TensorType  # noqa: E402

LAYERS, HIDDEN, HEADS, BATCH, SEQ = 2, 64, 4, 2, 16


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64, vocab_size=100,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2Model(cfg).eval()
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=100)
    return transformers.LlamaModel(cfg).eval()


class _Hidden(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _feed() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, SEQ - SEQ // 4:] = 0  # the second row ends in padding
    return ids, mask


def _import(model: torch.nn.Module, args: tuple, path: str, tmp_path) -> tuple[Module, dict]:
    if path == "torch":
        module = from_module(model, args)
        return module, module.resources
    pytest.importorskip("onnxscript")
    from geir.frontends.onnx import import_onnx

    out = tmp_path / "model.onnx"
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        torch.onnx.export(model, args, dynamo=True).save(str(out))
    return import_onnx(str(out))


@pytest.mark.parametrize("path", ["torch", "onnx"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_language_model_from_token_ids_with_padding(kind, path, tmp_path):
    model = _Hidden(_model(kind))
    args = _feed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, weights = _import(model, args, path, tmp_path)
    session = Session(Module([module.graph()], module.file, weights))
    attention = [op for op in session.generic.ops if op.name == "ge.flash_attention"]
    assert len(attention) == LAYERS, "every attention block fuses"
    feed = {a.name: to_numpy(x) for a, x in zip(session.generic.args, args)}
    program = session.program({k: v.shape for k, v in feed.items()})
    actual = np.asarray(run_program(program, feed, weights).outputs[0])
    with torch.no_grad():
        eager = model(*args).numpy()
        reference = _Hidden(_model(kind).double())(*args).numpy()
    verdict = compare(actual, reference, TensorType(tuple(actual.shape), DType.f32), eager)
    assert verdict.passed, verdict.render("last_hidden_state")
    assert np.isfinite(actual).all(), "no row is NaN: the padded row's queries still see their real keys"
