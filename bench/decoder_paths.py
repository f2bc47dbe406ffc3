"""Issue 28's model table: each decoder family through every way a user brings it, attention fused and tokens right.

    python bench/decoder_paths.py [--models llama,qwen2,phi3,gemma2,neox,gptj,bloom] [--json OUT.json]

Each family's causal LM is bench/llm_layer.py's (a small random-init config: 2 layers, hidden 64, 4 heads, MLP
128, vocabulary 100; no downloads), in f32. Its logits from `input_ids` with a padded `attention_mask` (batch 2,
8 tokens, the second row's last two tokens padding) go through three paths:

  torch     geir.frontends.torch (torch.export, then GE's default pipeline)
  compile   torch.compile(model, backend="geir"): every graph dynamo hands the backend, none falling back
  onnx      torch.onnx.export(dynamo=True) at the exporter's default opset, then geimport's importer

and `generate()` (geir.frontends.torch.generate) runs a 6-token prompt for 5 greedy tokens. Per path: attention
fused (`ge.flash_attention` in what GE compiled, over the config's layers: one attention per layer), the logits'
at the real tokens (a padding position's are no one's prediction, and each path may fill them differently) RMS error against the same model in float64 beside torch's own in f32 (the torch.compile rule decides), or where
the path stopped; for generate, whether its tokens equal Hugging Face's `generate(do_sample=False)`.
The goal line (issue 28 item 3) is PASS when every family fuses every attention on every path, passes the
accuracy rule, and generates Hugging Face's tokens. Needs torch and transformers (the `hf` extra); about a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches, also when loaded by path
import hf_models  # noqa: E402
import llm_layer  # noqa: E402

PATHS = ("torch", "compile", "onnx")
BATCH, SEQ, PADDED = 2, 8, 2
PROMPT, NEW_TOKENS = 6, 5


def _logits_module(model: Any) -> Any:
    """The model as a module from (input_ids, attention_mask) to its logits."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).logits

    return Logits().eval()


def _feed() -> tuple[Any, Any]:
    import torch

    ids = torch.randint(1, llm_layer.VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - PADDED:] = 0  # the second row ends in padding, as a batch of prompts does
    return ids, mask


def _compiled_run(module: Any, args: tuple) -> tuple[np.ndarray, int, list[str]]:
    """torch.compile with the geir backend: the output, the attention GE fused over every graph it compiled, and
    what fell back to eager."""
    import torch

    import geir.frontends.torch_compile as torch_compile

    made: list[Any] = []

    class Recorded(torch_compile.GeirGraph):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    original = torch_compile.GeirGraph
    torch_compile.GeirGraph = Recorded  # the backend builds one GeirGraph per graph dynamo hands it
    try:
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            out = torch.compile(module, backend="geir")(*args)
    finally:
        torch_compile.GeirGraph = original
        torch._dynamo.reset()
    fallbacks = [str(w.message).splitlines()[0] for w in caught
                 if issubclass(w.category, torch_compile.GeirFallbackWarning)]
    fused = sum(op.name == "ge.flash_attention" for g in made for c in g.compiled.values() if c is not None
                for op in c.graph.ops)
    return out.double().numpy(), fused, fallbacks


def run_path(kind: str, path: str) -> dict[str, Any]:
    """One family through one path: attention fused and the logits judged by the torch.compile rule."""
    import torch

    from geir.accuracy import compare
    from geir.types import DType, TensorType

    row: dict[str, Any] = {"model": kind, "path": path, "runs": False, "attention_sites": llm_layer.LAYERS}
    model = _logits_module(llm_layer.build(kind, "f32"))
    args = _feed()
    with torch.no_grad():
        eager = model(*args).double().numpy()
        reference = _logits_module(llm_layer.build(kind, "f32").double())(*args).numpy()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if path == "compile":
                actual, fused, fallbacks = _compiled_run(model, args)
                if fallbacks:
                    row["stops"] = f"falls back to eager: {fallbacks[0]}"
            else:
                module, weights = hf_models.import_path(model, args, path)
                actual, graph, _ = hf_models.compile_and_run(module, weights, ["input_ids", "attention_mask"], args)
                fused = sum(op.name == "ge.flash_attention" for op in graph.ops)
    except Exception as e:  # noqa: BLE001 - a path that stops: say where
        row["stops"] = hf_models.first_line(e)
        return row
    real = args[1].numpy().astype(bool)  # the positions that hold tokens
    actual, reference, eager = actual[real], reference[real], eager[real]
    verdict = compare(actual, reference, TensorType(tuple(actual.shape), DType.f32), eager)
    row.update(runs=True, attention_fused=fused, rms_err=verdict.rms_err, eager_rms_err=verdict.eager_rms_err,
               accurate=verdict.passed)
    return row


def run_generate(kind: str) -> dict[str, Any]:
    """Greedy generation on the simulated NPU against Hugging Face's own, for one prompt."""
    import torch

    from geir.frontends.torch import generate

    row: dict[str, Any] = {"model": kind, "path": "generate", "runs": False}
    model = llm_layer.build(kind, "f32")
    ids = torch.randint(1, llm_layer.VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0)
        try:
            run = generate(model, ids, NEW_TOKENS, buckets="pow2")
        except Exception as e:  # noqa: BLE001
            row["stops"] = hf_models.first_line(e)
            return row
    row.update(runs=True, tokens_equal=bool(torch.equal(run.tokens, expected)),
               new_tokens=int(run.tokens.shape[1] - PROMPT))
    return row


def passes(row: dict[str, Any]) -> bool:
    """Whether a row meets issue 28's goal for its path."""
    if not row["runs"] or row.get("stops"):
        return False
    if row["path"] == "generate":
        return row["tokens_equal"]
    return row["accurate"] and row["attention_fused"] == row["attention_sites"]


def render(rows: list[dict[str, Any]]) -> str:
    """The table and the goal line."""
    lines = [f"{BATCH} x {SEQ} tokens (row 2 padded by {PADDED}; logits judged at the real tokens), f32; generate: a {PROMPT}-token prompt, "
             f"{NEW_TOKENS} greedy tokens",
             f"{'model':7} {'path':9} {'attn':>5}  {'rms err':>8} {'torch':>8}  {'ok':4}  stops at / tokens"]
    for r in rows:
        if r["path"] == "generate":
            detail = (f"{r['new_tokens']} tokens {'equal to' if r['tokens_equal'] else 'DIFFER from'} "
                      f"Hugging Face's" if r["runs"] else r.get("stops", ""))
            lines.append(f"{r['model']:7} {'generate':9} {'':>5}  {'':>8} {'':>8}  "
                         f"{'PASS' if passes(r) else 'MISS':4}  {detail}")
            continue
        attn = f"{r['attention_fused']}/{r['attention_sites']}" if r["runs"] else ""
        errs = f"{r['rms_err']:8.1e} {r['eager_rms_err']:8.1e}" if r["runs"] else f"{'':>8} {'':>8}"
        lines.append(f"{r['model']:7} {r['path']:9} {attn:>5}  {errs}  {'PASS' if passes(r) else 'MISS':4}  "
                     f"{r.get('stops', '')}")
    models = sorted({r["model"] for r in rows})
    good = [m for m in models if all(passes(r) for r in rows if r["model"] == m)]
    verdict = "PASS" if len(good) == len(models) else "MISS"
    lines += ["", f"goal: every attention fused through the torch frontend, torch.compile and the ONNX exporter, "
                  f"accurate, and generate()'s tokens Hugging Face's: {verdict} ({len(good)}/{len(models)} families)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(llm_layer.FAMILIES))
    parser.add_argument("--json", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    kinds = [k for k in args.models.split(",") if k]
    unknown = [k for k in kinds if k not in llm_layer.FAMILIES]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r} (one of {', '.join(llm_layer.FAMILIES)})")
    rows = [r for kind in kinds for r in (*(run_path(kind, p) for p in PATHS), run_generate(kind))]
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
