"""Real models in: Hugging Face transformers from token ids, through both frontends, on the simulated NPU.

    python bench/hf_models.py [--models gpt2,llama,bert,t5,vit] [--paths torch,onnx,onnx23]
                              [--dtypes f32,f16,bf16] [--batch 2] [--seq 16] [--lengths 8,16,24]
                              [--json OUT.json]

Each model is built from a small random-init config (no downloads: 2 layers, hidden 64, 4 heads;
LLaMA with 2 kv heads), fed as a user feeds it: `input_ids` with a padded `attention_mask` at batch
2 (the second row's last quarter is padding), `pixel_values` for ViT. Paths:

  torch   geir.frontends.torch (torch.export, then GE)
  onnx    torch.onnx.export(dynamo=True) at the exporter's default opset, then geimport's importer
  onnx23  the same at opset 23 (ONNX's own Attention and RMSNormalization ops)

For each model x path x dtype it prints whether the model imports, whether it runs, its error
against the same model run by torch in float64 next to torch's own error in that dtype (the
torch.compile rule of geir.accuracy decides PASS), how many of the model's attention blocks fused
(k of n), and how many ops GE placed on the AI CPU. A model that stops says where (the first line
of the error). A second table exports each text model with a dynamic length (torch.export's
dynamic_shapes; ONNX dynamic axes): GE compiles it once, and each length is a re-plan of the
plan cache, judged by the same rule. Needs the `hf` extra (transformers, onnxscript) and torch.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import warnings
from typing import Any

import numpy as np

LAYERS, HIDDEN, HEADS = 2, 64, 4


def build(kind: str, attention: str = "sdpa"):
    """A small random-init Hugging Face model of `kind`, in eval mode, and its main input's name."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=100)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                                      bos_token_id=0, eos_token_id=0, **common)
        model = transformers.GPT2Model(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                       num_attention_heads=HEADS, num_key_value_heads=2, **common)
        model = transformers.LlamaModel(cfg)
    elif kind == "bert":
        cfg = transformers.BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      intermediate_size=128, max_position_embeddings=64, **common)
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    elif kind == "t5":
        cfg = transformers.T5Config(d_model=HIDDEN, d_ff=128, num_layers=LAYERS, num_heads=HEADS, d_kv=16, **common)
        model = transformers.T5EncoderModel(cfg)
    elif kind == "vit":
        cfg = transformers.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                     intermediate_size=128, image_size=32, patch_size=8, num_channels=3)
        model = transformers.ViTModel(cfg, add_pooling_layer=False)
    else:
        raise ValueError(f"unknown model {kind}")
    model.config._attn_implementation = attention
    return model.eval()


def inputs(kind: str, batch: int, seq: int) -> dict[str, Any]:
    """What a user feeds the model: token ids with a padded attention mask, or an image batch."""
    import torch

    g = torch.Generator().manual_seed(1)
    if kind == "vit":
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g)}
    ids = torch.randint(1, 100, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - seq // 4:] = 0  # the last row is padded at its end
    return {"input_ids": ids, "attention_mask": mask}


class LastHidden:
    """Wraps a model so that it takes its inputs positionally and returns the last hidden state."""

    def __new__(cls, model, names: list[str]):
        import torch

        class _Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, *xs):
                return self.model(**dict(zip(names, xs))).last_hidden_state

        return _Wrapped()


def first_line(e: BaseException) -> str:
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()  # torch's exporter colours its messages
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _cast_model(model, dtype: str):
    import torch

    return model.to({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype])


def run_case(kind: str, path: str, dtype: str, batch: int, seq: int) -> dict[str, Any]:
    """One model x path x dtype: the figures the table prints."""
    import torch

    from geir.accuracy import compare
    from geir.types import DType, TensorType

    row: dict[str, Any] = {"model": kind, "path": path, "dtype": dtype, "imports": False, "runs": False}
    feed = inputs(kind, batch, seq)
    names = list(feed)
    model = LastHidden(_cast_model(build(kind), dtype), names)
    args = tuple(feed.values())
    if kind == "vit" and dtype != "f32":
        args = (args[0].to(next(model.parameters()).dtype),)
    with torch.no_grad():
        eager = model(*args).float().numpy()
        reference = LastHidden(build(kind).double(), names)(
            *[a.double() if a.is_floating_point() else a for a in args]).numpy()
    try:
        module, weights = import_path(model, args, path)
    except Exception as e:  # noqa: BLE001 - a model that stops at the door: say where
        row["stops"] = first_line(e)
        return row
    row["imports"] = True
    try:
        actual, graph, program = compile_and_run(module, weights, names, args)
    except Exception as e:  # noqa: BLE001
        row["stops"] = first_line(e)
        return row
    row["runs"] = True
    t = TensorType(tuple(actual.shape), {"f32": DType.f32, "f16": DType.f16, "bf16": DType.bf16}[dtype])
    verdict = compare(actual.astype(np.float64), reference, t, eager)
    row.update(rms_err=verdict.rms_err, eager_rms_err=verdict.eager_rms_err, accurate=verdict.passed,
               attention_fused=sum(op.name == "ge.flash_attention" for op in graph.ops), attention_blocks=LAYERS,
               aicpu_ops=sum(op.name == "rt.launch" and op.attr("engine") == "aicpu" for op in program.ops))
    return row


def import_path(model, args, path: str, dynamic=None):
    """The GEIR module (and weights) of the model through one frontend path (`dynamic`: torch's dynamic_shapes)."""
    import torch

    if path == "torch":
        from geir.frontends.torch import from_module

        module = from_module(model, args, dynamic_shapes=dynamic)
        return module, module.resources
    from geir.frontends.onnx import import_onnx

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "model.onnx")
        kw = {"opset_version": 23} if path == "onnx23" else {}
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                program = torch.onnx.export(model, args, dynamo=True, dynamic_shapes=dynamic, **kw)
                program.save(out)
        except Exception as e:  # noqa: BLE001 - torch's exporter, before GEIR sees anything
            raise RuntimeError(f"torch.onnx.export failed, before geimport: {first_line(e)}") from e
        return import_onnx(out)


def compile_and_run(module, weights, names, args):
    """Compile with GE's default pipeline and run on the simulated 910B: the output, the fused graph and the
    lowered program."""
    from geir.ir import Module
    from geir.session import Session, run_program

    session = Session(Module([module.graph()], module.file, weights))
    graph_args = [a.name for a in session.generic.args]
    from geir.frontends.torch_builder import to_numpy

    feed = {name: to_numpy(a) for name, a in zip(graph_args, args)}
    program = session.program({k: v.shape for k, v in feed.items()})
    result = run_program(program, feed, weights)
    return np.asarray(result.outputs[0], dtype=np.float64), session.generic, program


def run_dynamic(kind: str, path: str, batch: int, lengths: list[int]) -> dict[str, Any]:
    """One text model x path exported with a dynamic length: GE compiles once, then each length is a re-plan."""
    import time

    import torch

    from geir.accuracy import compare
    from geir.frontends.torch_builder import to_numpy
    from geir.ir import Module
    from geir.session import Session, run_program
    from geir.types import DType, TensorType

    row: dict[str, Any] = {"model": kind, "path": path, "imports": False, "lengths": {}}
    feed = inputs(kind, batch, lengths[0])
    names = list(feed)
    model = LastHidden(build(kind), names)
    length = torch.export.Dim("S", min=2, max=64)
    try:
        module, weights = import_path(model, tuple(feed.values()), path, dynamic=(tuple({1: length} for _ in names),))
    except Exception as e:  # noqa: BLE001
        row["stops"] = first_line(e)
        return row
    row["imports"] = True
    start = time.perf_counter()
    session = Session(Module([module.graph()], module.file, weights))
    row["compile_ms"] = (time.perf_counter() - start) * 1e3
    row["attention_fused"] = sum(op.name == "ge.flash_attention" for op in session.generic.ops)
    reference_model = LastHidden(build(kind).double(), names)
    for n in lengths:
        args = tuple(inputs(kind, batch, n).values())
        with torch.no_grad():
            eager = model(*args).numpy()
            reference = reference_model(*args).numpy()
        try:
            data = {a.name: to_numpy(x) for a, x in zip(session.generic.args, args)}
            program = session.program({k: v.shape for k, v in data.items()})
            actual = np.asarray(run_program(program, data, weights).outputs[0], dtype=np.float64)
        except Exception as e:  # noqa: BLE001
            row["stops"] = f"length {n}: {first_line(e)}"
            return row
        verdict = compare(actual, reference, TensorType(tuple(actual.shape), DType.f32), eager)
        row["lengths"][n] = {"accurate": verdict.passed, "replan_ms": session.replans[-1].ms}
    row["plan_cache"] = session.plan_cache
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama,bert,t5,vit")
    ap.add_argument("--paths", default="torch,onnx,onnx23")
    ap.add_argument("--dtypes", default="f32,f16,bf16")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--lengths", default="8,16,24",
                    help="the lengths a dynamic-length export serves from one compile (empty: skip that table)")
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"hf_models: needs torch and the hf extra (pip install -e '.[torch,hf]'): {e}", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # the exporter's notes on torchvision ops
    rows = []
    print(f"{'model':<7}{'path':<8}{'dtype':<6}{'imports':<9}{'runs':<6}{'rms err':>9}{'torch':>9}  {'ok':<5}"
          f"{'attn':<6}{'aicpu':<6}stops at")
    for kind in args.models.split(","):
        for path in args.paths.split(","):
            for dtype in args.dtypes.split(","):
                row = run_case(kind, path, dtype, args.batch, args.seq)
                rows.append(row)
                err = f"{row['rms_err']:>9.1e}{row['eager_rms_err']:>9.1e}" if row["runs"] else f"{'':>18}"
                ok = ("PASS" if row.get("accurate") else "FAIL") if row["runs"] else ""
                attn = f"{row['attention_fused']}/{row['attention_blocks']}" if row["runs"] else ""
                aicpu = str(row["aicpu_ops"]) if row["runs"] else ""
                print(f"{kind:<7}{path:<8}{dtype:<6}{'yes' if row['imports'] else 'no':<9}"
                      f"{'yes' if row['runs'] else 'no':<6}{err}  {ok:<5}{attn:<6}{aicpu:<6}{row.get('stops', '')}",
                      flush=True)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    dynamic_rows = []
    if lengths:
        print(f"\ndynamic length (f32): one compile, then lengths {', '.join(map(str, lengths))} each re-planned")
        print(f"{'model':<7}{'path':<8}{'imports':<9}{'compile':>9}  {'attn':<6}{'lengths ok':<12}{'re-plans':<22}"
              f"stops at")
        for kind in args.models.split(","):
            if kind == "vit":
                continue  # an image model: its size is the image's, not a length
            for path in args.paths.split(","):
                row = run_dynamic(kind, path, args.batch, lengths)
                dynamic_rows.append(row)
                done = row["lengths"]
                ok = f"{sum(v['accurate'] for v in done.values())}/{len(lengths)}" if row["imports"] else ""
                replans = " ".join(f"{v['replan_ms']:.0f}" for v in done.values())
                compile_ms = f"{row['compile_ms']:>7.0f}ms" if "compile_ms" in row else f"{'':>9}"
                attn = f"{row['attention_fused']}/{LAYERS}" if "attention_fused" in row else ""
                print(f"{kind:<7}{path:<8}{'yes' if row['imports'] else 'no':<9}{compile_ms}  {attn:<6}{ok:<12}"
                      f"{(replans + ' ms') if replans else '':<22}{row.get('stops', '')}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"static": rows, "dynamic": dynamic_rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
