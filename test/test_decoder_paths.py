"""Issue 28's model table (item 3): every listed decoder family fuses every attention through the torch frontend,
torch.compile(backend="geir") and torch's ONNX dynamo exporter, and generate() gives Hugging Face's greedy tokens.

Oracles: the config's layer count (one attention a layer), the same model run by torch in float64 and in f32
(geir.accuracy's torch.compile rule), and Hugging Face's own `generate(do_sample=False)`; bench/decoder_paths.py
runs the paths, and this test holds it to those oracles rather than to its verdicts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("decoder_paths", ROOT / "bench" / "decoder_paths.py")
paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paths)


@pytest.mark.parametrize("kind", paths.llm_layer.FAMILIES)
def test_every_path_fuses_every_attention_and_matches_torch(kind):
    layers = paths.llm_layer.build(kind, "f32").config.num_hidden_layers
    for path in paths.PATHS:
        row = paths.run_path(kind, path)
        assert row["runs"] and not row.get("stops"), (path, row.get("stops"))
        assert row["attention_fused"] == layers, (path, row)
        assert row["accurate"], (path, row)


@pytest.mark.parametrize("kind", paths.llm_layer.FAMILIES)
def test_generate_gives_hugging_faces_greedy_tokens(kind):
    row = paths.run_generate(kind)
    assert row["runs"], row.get("stops")
    assert row["new_tokens"] == paths.NEW_TOKENS and row["tokens_equal"]
