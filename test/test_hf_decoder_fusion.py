"""A real decoder layer as ops-transformer runs it (issue 28 item 1): a tiny Hugging Face LLaMA imported from
`input_ids` with a padded `attention_mask`, fused, counted against the layer's structure and run against torch.

Oracles: the model's config for what each layer holds (q, k and v projections of `hidden` -> `heads * head_dim`
and `kv_heads * head_dim`; two residual adds, each followed by an RMSNorm: the next sub-layer's, or the final
norm); the import's own ops before fusion for what there was to fuse; and torch in float64 (reference) and float32
(eager baseline), judged by geir.accuracy's torch.compile rule.
"""

from __future__ import annotations

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

LAYERS, HIDDEN, HEADS, KV_HEADS, BATCH, SEQ = 2, 64, 4, 2, 2, 16
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128


def _config() -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=100)


class _Hidden(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Hidden(transformers.LlamaModel(_config()).eval())


def _feed() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEQ)
    ids = torch.randint(1, 100, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, SEQ - SEQ // 4:] = 0  # the second row ends in padding
    return ids, mask


@pytest.fixture(scope="module")
def compiled():
    model, args = _model(), _feed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = from_module(model, args)
    imported = [op.name for op in module.graph().ops]
    session = Session(Module([module.graph()], module.file, module.resources))
    return model, args, module.resources, imported, session


def _count(names, name: str) -> int:
    return sum(n == name for n in names)


def test_the_import_holds_what_there_is_to_fuse(compiled):
    _, _, _, imported, _ = compiled
    # per layer: q, k, v, o, gate, up, down; four head transposes (q, k, v in, the output back)
    assert _count(imported, "ge.matmul") == 7 * LAYERS
    assert _count(imported, "ge.transpose") == 4 * LAYERS


def test_q_k_v_are_one_matmul_per_layer_and_gate_up_another(compiled):
    _, _, _, _, session = compiled
    ops = session.generic.ops
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    splits = [op for op in ops if op.name == "ge.split"]
    qkv = [s for s in splits if len(s.results) == 3]
    assert len(qkv) == len(splits) == LAYERS
    assert not [op for op in ops if op.name == "ge.glu"]
    # LLaMA's gate and up projections, merged once glu took the activation and product; the glu reads the merged
    # output's two halves itself (glu_merged), then becomes that matmul's epilogue (matmul_glu): no split between
    gate_ups = [op for op in ops if op.name == "ge.fused_matmul" and op.glu == "silu"]
    assert len(gate_ups) == LAYERS
    for mm in gate_ups:
        assert mm.operands[1].type.shape[-1 if not mm.transpose_b else -2] == 2 * INTERMEDIATE
        assert mm.results[0].type.shape[-1] == INTERMEDIATE
    for split in qkv:
        mm = split.operands[0].owner
        assert mm.name == "ge.matmul" and mm.results[0].type.shape[-1] == qkv_width
        assert split.sizes == [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
        # the attention norm's output is read by this one matmul alone
        assert mm.operands[0].users() == [mm]
    # every matmul is one of a layer's: the merged q/k/v, o, the merged gate/up and down
    assert sum(op.name in ("ge.matmul", "ge.fused_matmul") for op in ops) == 4 * LAYERS


def test_attention_reads_bsnd_with_no_transposes_around_it(compiled):
    _, _, _, _, session = compiled
    ops = session.generic.ops
    attention = [op for op in ops if op.name == "ge.flash_attention"]
    assert len(attention) == LAYERS and all(op.layout == "BSND" for op in attention)
    for op in attention:  # [B, S, N, D]: the sequence second, K/V with the config's kv heads
        assert op.operands[0].type.shape == (BATCH, SEQ, HEADS, HEAD_DIM)
        assert op.operands[1].type.shape == (BATCH, SEQ, KV_HEADS, HEAD_DIM)
    assert not [op for op in ops if op.name == "ge.transpose"]


def test_residual_adds_fuse_with_the_next_rms_norm(compiled):
    _, _, _, _, session = compiled
    ops = session.generic.ops
    # two residual adds a layer, each read by the next norm (the next layer's or the final one); the first
    # layer's input norm reads the embedding, with no add to fuse
    assert _count([op.name for op in ops], "ge.add_rms_norm") == 2 * LAYERS
    assert _count([op.name for op in ops], "ge.rms_norm") == 1
    fused = [op for op in ops if op.name == "ge.add_rms_norm"]
    for earlier, later in zip(fused, fused[1:]):  # each sum is the next residual add's input
        assert earlier.results[0] in later.operands[:2]


def test_the_fused_decoder_computes_what_torch_does(compiled):
    model, args, weights, _, session = compiled
    feed = {a.name: to_numpy(x) for a, x in zip(session.generic.args, args)}
    program = session.program({k: v.shape for k, v in feed.items()})
    actual = np.asarray(run_program(program, feed, weights).outputs[0], dtype=np.float64)
    with torch.no_grad():
        eager = model(*args).float().numpy()
        reference = _Hidden(model.model.double())(*args).numpy()
    verdict = compare(actual, reference, TensorType(tuple(actual.shape), DType.f32), eager)
    assert verdict.passed, verdict.render("last_hidden_state")
