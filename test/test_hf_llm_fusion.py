"""A real decoder layer's rotary embedding and gated MLP fuse (issue 28 item 1): tiny random-init Hugging Face
LLaMA (rotate_half, SwiGLU), GPT-NeoX with rotary_pct = 0.25 (a partial rotation) and GPT-J (interleaved pairs,
rotary_dim of the head dim), imported through geir.frontends.torch (LLaMA also through torch's ONNX exporter,
which writes SiLU as x * sigmoid(x)) from `input_ids` with a padded `attention_mask`, then compiled and run on
the simulated NPU.

Oracles: the config says how many rotations (q and k of every layer) and gated MLPs there are, so how many
fused ops must appear and which ops must be gone; the numbers are the same model run by torch in float64 (the
reference) and in the model's dtype (the eager baseline), judged by geir.accuracy's torch.compile rule.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections import Counter

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
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                       num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=100)
        return transformers.LlamaModel(cfg).eval()
    if kind == "neox":
        cfg = transformers.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                         num_attention_heads=HEADS, vocab_size=100, rotary_pct=0.25,
                                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
        return transformers.GPTNeoXModel(cfg).eval()
    cfg = transformers.GPTJConfig(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=100, rotary_dim=8,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPTJModel(cfg).eval()


class _Hidden(torch.nn.Module):
    """The last hidden state from token ids and their mask."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _feed() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEQ)
    ids = torch.randint(1, 100, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, SEQ - SEQ // 4:] = 0  # the second row ends in padding
    return ids, mask


# what each family's config says its layers rotate: (mode, rotary_dim of the head dim 16), and its MLP's gate
EXPECTED = {"llama": ("half", 16, "silu"), "neox": ("half", 4, None), "gptj": ("interleave", 8, None)}
CASES = [("llama", "f32", "torch"), ("llama", "f16", "torch"), ("llama", "f32", "onnx"), ("neox", "f32", "torch"),
         ("gptj", "f32", "torch")]


def _import(model: torch.nn.Module, args: tuple, path: str, tmp_path) -> tuple[Module, dict]:
    if path == "torch":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = from_module(model, args)
        return module, module.resources
    pytest.importorskip("onnxscript")
    from geir.frontends.onnx import import_onnx

    out = tmp_path / "model.onnx"
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, dynamo=True).save(str(out))
    return import_onnx(str(out))


@pytest.mark.parametrize("kind, dtype, path", CASES, ids=[f"{k}-{d}-{p}" for k, d, p in CASES])
def test_rotary_and_gated_mlp_fuse_and_match_torch(kind, dtype, path, tmp_path):
    model = _Hidden(_model(kind).to(TORCH_DTYPES[dtype]))
    args = _feed()
    module, weights = _import(model, args, path, tmp_path)
    before = Counter(op.name for op in module.graph().ops)
    session = Session(Module([module.graph()], module.file, weights))
    after = Counter(op.name for op in session.generic.ops)
    mode, rotary_dim, gate = EXPECTED[kind]

    # q and k of every layer rotate (on the same tables: in one launch, rotary_pair); every piece of the written-out
    # rotation is gone
    assert before["ge.neg"] == 2 * LAYERS and after["ge.neg"] == 0, (before, after)
    rotations = [op for op in session.generic.ops if op.name == "ge.rotary_embedding"]
    assert sum(len(op.results) for op in rotations) == 2 * LAYERS
    assert all(op.mode == mode and op.rotary_dim == rotary_dim for op in rotations)
    assert after["ge.concat"] == 0 and after["ge.slice"] < before["ge.slice"], (before, after)
    if gate is not None:  # the gated MLP: act(gate) * up is one op per layer, no activation left alone
        written = "ge.sigmoid" if path == "onnx" else f"ge.{gate}"  # ONNX's SiLU is x * sigmoid(x)
        assert before[written] == LAYERS and after[written] == 0
        # (a ge.glu, or the epilogue of the merged gate-up matmul where matmul_glu took it in)
        glus = [op.activation if op.name == "ge.glu" else op.glu for op in session.generic.ops
                if op.name == "ge.glu" or (op.name == "ge.fused_matmul" and op.glu != "none")]
        assert glus == [gate] * LAYERS

    feed = {a.name: to_numpy(x) for a, x in zip(session.generic.args, args)}
    program = session.program({k: v.shape for k, v in feed.items()})
    actual = np.asarray(run_program(program, feed, weights).outputs[0], dtype=np.float64)
    with torch.no_grad():
        eager = model(*args).float().numpy()
        reference = _Hidden(_model(kind).double())(*args).numpy()
    verdict = compare(actual, reference, TensorType(tuple(actual.shape), DType.f32 if dtype == "f32" else DType.f16),
                      eager)
    assert verdict.passed, verdict.render("last_hidden_state")
