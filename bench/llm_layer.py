"""Real decoder layers measured (issue 28): kernels per layer, glue, attention fused and accuracy, per HF family.

    python bench/llm_layer.py [--models llama,qwen2,phi3,gemma2,neox,gptj,bloom] [--dtypes f32,f16]
                              [--layers 2] [--prompt 8] [--seq-8b 2048] [--skip-8b] [--data-8b]
                              [--json OUT.json]

Each family's causal LM is built from a small random-init config (no downloads: 2 layers, hidden 64, 4 heads,
MLP 128, vocabulary 100; LLaMA, Qwen2, Phi-3 and Gemma2 with 2 KV heads), cast to the dtype, and exported as
`generate()` exports it (`geir.frontends.generate.export_steps`: a prefill step program that makes the KV cache,
a decode step program that takes it), through the torch frontend from `input_ids`. GE compiles both with its
default pipeline; the prefill runs an 8-token prompt into a 9-slot cache, the decode step one more token into
the last slot. Per family and dtype the table gives:

  kern/L    kernels launched per decoder layer: the compiled program's kernel launches (its `rt.launch` ops
            less the views: a reshape, or a split into runs of the operand's bytes, renames bytes, no device task)
            divided by the layers. The launches outside
            the layers (embedding, rotary tables, mask, final norm, LM head) are spread over them, so at 2
            layers this is an upper bound on a layer's own count;
  layer     a layer's own kernels: the program's launches less those of the same family built with one layer
            fewer (compiled and planned for the same shapes); for a family whose layers alternate kinds (Gemma2's
            sliding-window and full-attention layers, each kind's mask built once a step) a whole pattern more
            than the program's, per layer; the kernel goal is judged on it;
  glue      the share of kernel time (msprof's op_summary rows of the run: every kernel task, AI CPU included)
            in kernels other than matmuls (ge.matmul, ge.fused_matmul) and attention (ge.flash_attention);
  attn      attention fused / total: `ge.flash_attention` ops after fusion over the import's attention sites
            (its `ge.flash_attention`, what SDPA imports as, plus its `ge.softmax`, an attention written out);
            where one did not fuse, the fusion pass's remark about it follows in the row;
  accuracy  the prefill's and the decode step's last logits against the same HF model run by torch in float64,
            beside torch's own error in that dtype: geir.accuracy's torch.compile rule decides PASS.

A family that fails to export, import or compile prints the reason in its row, and the run goes on.

Goals (issue 28), each printed PASS or MISS with the measured figure:
  - at most 9 kernels per decoder layer in decode, as torch_npu's fused path runs one (AddRmsNorm, QKV, RoPE,
    KV scatter, attention, O, AddRmsNorm, gate-up + SwiGLU, down): judged on every family and dtype measured, on
    a layer's own kernels (kern/L where that could not be measured: --layers 1), with the kinds a LLaMA layer
    launches;
  - every attention fused, in prefill and decode, through the torch frontend (the issue also asks it of
    torch.compile and the ONNX exporter, with generate()'s tokens equal to Hugging Face's: bench/decoder_paths.py);
  - glue at most 5 % of prefill kernel time on the LLaMA-8B shape (hidden 4096, 32 heads, 8 KV heads, head dim
    128, MLP 14336, f16; a vocabulary of 1024), prompt --seq-8b tokens: judged on a decoder layer's own kernel
    time (the 2-layer run's per kernel type less the 1-layer run's: what a 32-layer model is made of), the 1-layer
    program's whole share printed beside it. The runs are timing only (the kernels' cost models, no arithmetic;
    the KV scatter's indices are stand-ins whose count decides its time); --data-8b computes them with data
    (about a minute and a half).
Needs torch and transformers (the `hf` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import warnings
from typing import Any

import attrs
import numpy as np

FAMILIES = ("llama", "qwen2", "phi3", "gemma2", "neox", "gptj", "bloom")
LAYERS, HIDDEN, HEADS, KV_HEADS, MLP, VOCAB, PROMPT = 2, 64, 4, 2, 128, 100, 8
# LLaMA-3-8B's layer (Meta's config.json: hidden_size 4096, num_attention_heads 32, num_key_value_heads 8,
# intermediate_size 14336); the vocabulary cut to 1024 (the goal is on the layers)
LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, mlp=14336, vocab=1024)
GOAL_DECODE_KERNELS = 9
GOAL_GLUE = 0.05
# Families whose layers come in a repeating pattern of kinds: Gemma2 alternates a sliding-window and a full-attention
# layer (transformers' Gemma2Config.layer_types), and each kind's mask is built once a step, by the step, not by a
# layer. A layer's own kernels are measured over a whole pattern more (every kind already present), per layer.
LAYER_PERIOD = {"gemma2": 2}
MATMUL_KERNELS = frozenset({"ge.matmul", "ge.fused_matmul"})
ATTENTION_KERNELS = frozenset({"ge.flash_attention"})
PHASES = ("prefill", "decode")


@attrs.frozen
class Shape:
    """A decoder's sizes."""

    layers: int = LAYERS
    hidden: int = HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    mlp: int = MLP
    vocab: int = VOCAB


def build(kind: str, dtype: str, shape: Shape = Shape()) -> Any:
    """A random-init Hugging Face causal LM of the family `kind` with `shape`, in eval mode and `dtype`."""
    import torch
    import transformers as tf

    s = shape
    head_dim = s.hidden // s.heads
    torch.manual_seed(0)
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0, vocab_size=s.vocab)
    if kind == "llama":
        cfg = tf.LlamaConfig(hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
                             num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, **ids)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
                             num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, **ids)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "phi3":
        cfg = tf.Phi3Config(hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
                            num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, **ids)
        model = tf.Phi3ForCausalLM(cfg)
    elif kind == "gemma2":
        cfg = tf.Gemma2Config(hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
                              num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=head_dim, **ids)
        model = tf.Gemma2ForCausalLM(cfg)
    elif kind == "neox":
        cfg = tf.GPTNeoXConfig(hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
                               num_attention_heads=s.heads, rotary_pct=0.25, max_position_embeddings=64, **ids)
        model = tf.GPTNeoXForCausalLM(cfg)
    elif kind == "gptj":
        cfg = tf.GPTJConfig(n_embd=s.hidden, n_inner=s.mlp, n_layer=s.layers, n_head=s.heads,
                            rotary_dim=head_dim // 2, n_positions=64, **ids)
        model = tf.GPTJForCausalLM(cfg)
    elif kind == "bloom":
        cfg = tf.BloomConfig(hidden_size=s.hidden, n_layer=s.layers, n_head=s.heads, **ids)
        model = tf.BloomForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model family {kind!r} (one of {', '.join(FAMILIES)})")
    return model.to(_torch_dtype(dtype)).eval()


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]


@attrs.define
class PhaseRun:
    """One step program as GE compiled and ran it: the fused graph, the lowered program, its run, the remarks."""

    imported: Any  # the GEIR module as torch spelled it
    fused: Any  # the session's graph after fusion
    program: Any  # the lowered rt.program
    result: Any  # the Runtime's RunResult
    remarks: list[str]
    shapes: list[tuple[int, ...]]  # what it was planned for: each argument's shape, in order


@attrs.define
class Measured:
    """One family x dtype: the table's row (plain data, the JSON) and each phase's run for a caller to inspect."""

    row: dict[str, Any]
    phases: dict[str, PhaseRun] = attrs.field(factory=dict)


def kernel_launches(result: Any) -> int:
    """Kernel launches of a run: its kernel records less the views (no cycles on no cores), as msprof lists them."""
    return sum(not (k.cores == 0 and k.cycles == 0) for k in result.kernels)


def kernels_by_type(result: Any) -> dict[str, int]:
    """How many kernels of each type a run launched (views left out), the most frequent first."""
    counts: dict[str, int] = {}
    for k in result.kernels:
        if not (k.cores == 0 and k.cycles == 0):
            counts[k.name] = counts.get(k.name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def glue_share(result: Any) -> float:
    """The share of the run's kernel time in kernels other than matmuls and attention (msprof's op_summary rows)."""
    times = kernel_time_by_type(result)
    total = sum(times.values())
    glue = sum(t for name, t in times.items() if name not in MATMUL_KERNELS | ATTENTION_KERNELS)
    return glue / total if total else 0.0


def attention_sites(graph: Any) -> int:
    """Attention blocks in an imported graph: SDPA's `ge.flash_attention`s and written-out `ge.softmax`es."""
    return sum(op.name in ("ge.flash_attention", "ge.softmax") for op in graph.ops)


def _first_line(e: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()  # torch's exporter colours its messages
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _quietly(fn, *args):
    """Call fn with transformers' and torch's notes on tracing kept off the table."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return fn(*args)


def _compile(imported: Any) -> tuple[Any, list[str]]:
    """GE's session over an imported step program (fusion remarks collected)."""
    from geir.builder import clone_graph
    from geir.ir import Module
    from geir.session import Session

    remarks: list[str] = []
    m = imported.module
    # GE's passes rewrite the graph in place: the import stays as torch spelled it, to count what there was
    session = Session(Module([clone_graph(m.graph())], m.file, m.resources), explain=True,
                      emit=lambda d: remarks.append(d.message) if d.severity == "remark" else None)
    return session, remarks


def _run_phase(imported: Any, feed: dict[str, Any], timing_only: bool = False) -> PhaseRun:
    """Compile a step program, plan it for the feed's shapes (numpy arrays, or shapes when timing only), run it."""
    from geir.session import run_program

    session, remarks = _compile(imported)
    shapes = {k: (v if timing_only else v.shape) for k, v in feed.items()}
    program = session.program(shapes)
    weights = imported.module.resources
    result = run_program(program, {} if timing_only else feed, weights, timing_only=timing_only)
    return PhaseRun(imported.module, session.generic, program, result, remarks, list(shapes.values()))


def _step_feeds(names: list[str], ids: Any, cache_length: int) -> dict[str, Any]:
    """The prefill's inputs as generate feeds them: the prompt, its mask over the cache's slots, slots, positions."""
    import torch

    from geir.frontends.torch_builder import to_numpy

    prompt = ids.shape[1]
    mask = torch.zeros(ids.shape[0], cache_length, dtype=torch.long)
    mask[:, :prompt] = 1
    positions = torch.arange(prompt)[None].expand(ids.shape[0], prompt)
    return {n: to_numpy(t) for n, t in zip(names, (ids, mask, torch.arange(prompt), positions))}


def _last_logits(model: Any, ids: Any) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits[:, -1, :].double().numpy()


def measure(kind: str, dtype: str, layers: int = LAYERS, prompt: int = PROMPT) -> Measured:
    """One family in one dtype: export prefill and decode as generate() does, compile, run, count and compare."""
    import torch

    from geir.accuracy import compare
    from geir.frontends.generate import export_steps
    from geir.frontends.torch_builder import to_numpy
    from geir.types import DType, TensorType

    row: dict[str, Any] = {"model": kind, "dtype": dtype, "layers": layers, "runs": False}
    out = Measured(row)
    g = torch.Generator().manual_seed(prompt)
    ids = torch.randint(1, VOCAB, (1, prompt + 1), generator=g)  # the prompt, then the token the decode step feeds
    shape = Shape(layers=layers)
    try:
        model = build(kind, dtype, shape)
        prefill, decode = _quietly(export_steps, model, ids[:, :prompt], torch.ones_like(ids[:, :prompt]),
                                   prompt + 1)
    except Exception as e:  # noqa: BLE001 - a family that stops before GE: say where
        row["stops"] = f"export: {_first_line(e)}"
        return out
    try:
        names = [a.name for a in prefill.module.graph().args]
        pre = _run_phase(prefill, _step_feeds(names, ids[:, :prompt], prompt + 1))
        out.phases["prefill"] = pre
        dnames = [a.name for a in decode.module.graph().args]
        step = (ids[:, prompt:], torch.ones(1, prompt + 1, dtype=torch.long), torch.tensor([prompt]),
                torch.tensor([[prompt]]))
        feed = {n: to_numpy(t) for n, t in zip(dnames, step)}
        feed.update(zip(dnames[4:], pre.result.outputs[1:]))  # the cache the prefill made
        out.phases["decode"] = _run_phase(decode, feed)
    except Exception as e:  # noqa: BLE001 - GE or the Runtime stopped: say where
        row["stops"] = f"{'decode' if 'prefill' in out.phases else 'prefill'}: {_first_line(e)}"
        return out
    row["runs"] = True
    reference = build(kind, "f32", shape).double()
    gdtype = {"f32": DType.f32, "f16": DType.f16, "bf16": DType.bf16}[dtype]
    for phase, tokens in (("prefill", ids[:, :prompt]), ("decode", ids)):
        run = out.phases[phase]
        actual = np.asarray(run.result.outputs[0], dtype=np.float64)
        verdict = compare(actual, _last_logits(reference, tokens), TensorType(actual.shape, gdtype),
                          _last_logits(model, tokens))
        fused = sum(op.name in ATTENTION_KERNELS for op in run.fused.ops)
        sites = attention_sites(run.imported.graph())
        launches = kernel_launches(run.result)
        row[phase] = {"kernels": launches, "kernels_per_layer": launches / layers, "layer_kernels": None,
                      "kernels_by_type": kernels_by_type(run.result), "glue_share": glue_share(run.result),
                      "attention_fused": fused, "attention_sites": sites, "rms_err": verdict.rms_err,
                      "eager_rms_err": verdict.eager_rms_err, "accurate": verdict.passed,
                      "kernel_time_us": sum(k.cycles for k in run.result.kernels) * 1e6 / run.result.target.clock_hz}
        if fused < sites:
            misses = [r for r in run.remarks if r.startswith("flash_attention")]  # the fusion pattern's own
            row[phase]["attention_remark"] = misses[0] if misses else "the flash_attention pattern left no remark"
    period = LAYER_PERIOD.get(kind, 1)
    planned = {phase: out.phases[phase].shapes for phase in PHASES}
    try:
        if period == 1 and layers > 1:  # the same family with one layer fewer launches all but one layer's kernels
            fewer, more = _launches_at(kind, dtype, layers - 1, ids[:, :prompt], planned), None
        elif period > 1 and layers >= period:  # every kind of layer present: a whole pattern more, per layer
            fewer, more = None, _launches_at(kind, dtype, layers + period, ids[:, :prompt], planned)
        else:
            fewer = more = None
    except Exception:  # noqa: BLE001 - the row keeps its other figures
        fewer = more = None
    for phase in PHASES if (fewer or more) else ():
        this = static_kernels(out.phases[phase].program)
        low, high = (fewer[phase], this) if fewer else (this, more[phase])
        own = {name: (high.get(name, 0) - low.get(name, 0)) / period for name in {*high, *low}}
        own = {name: int(n) if float(n).is_integer() else n for name, n in own.items()}
        row[phase]["layer_kernels"] = sum(own.values())
        row[phase]["layer_kernels_by_type"] = dict(sorted(((k, n) for k, n in own.items() if n),
                                                          key=lambda kv: (-kv[1], kv[0])))
    return out


def is_view(launch: Any) -> bool:
    """A launch that only renames bytes (a reshape, a split into runs of its operand's bytes): an AI Core launch the
    tile pass gave no tiling, since its kernel needs none; no device task."""
    return launch.engine != "aicpu" and not launch.attr("tiling")


def static_kernels(program: Any) -> dict[str, int]:
    """Kernel launches of a lowered program by kernel: its `rt.launch` ops less the views."""
    counts: dict[str, int] = {}
    for op in program.ops:
        if op.name == "rt.launch" and not is_view(op):
            counts[op.attr("kernel")] = counts.get(op.attr("kernel"), 0) + 1
    return counts


def _launches_at(kind: str, dtype: str, layers: int, prompt_ids: Any,
                 planned: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per phase, the kernel launches (by kernel) of the family's step programs with `layers` layers, planned, not
    run, for the shapes `planned` gives (each phase's argument shapes: a smaller model's cache is a prefix)."""
    import torch

    from geir.frontends.generate import export_steps

    model = build(kind, dtype, Shape(layers=layers))
    steps = _quietly(export_steps, model, prompt_ids, torch.ones_like(prompt_ids), prompt_ids.shape[1] + 1)
    out = {}
    for phase, imported in zip(PHASES, steps):
        session, _ = _compile(imported)
        args = session.generic.args
        shapes = list(planned[phase])
        while len(shapes) < len(args):  # a larger model's extra layers: their caches shaped as the last layer's
            shapes.append(shapes[-2])
        out[phase] = static_kernels(session.program({a.name: shape for a, shape in zip(args, shapes)}))
    return out


def glue_8b(seq: int, timing_only: bool = True) -> dict[str, Any]:
    """The prefill's glue share on LLaMA-8B's layer shape (f16): a layer's own (the 2-layer run's kernel time less the
    1-layer run's) and the 1-layer program's whole, with the glue kernels that take most of a layer."""
    row: dict[str, Any] = {"model": "llama-8B shape", "dtype": "f16", "seq": seq, "timing_only": timing_only}
    try:
        one, two = (_prefill_8b(seq, layers, timing_only) for layers in (1, 2))
    except Exception as e:  # noqa: BLE001
        row["stops"] = _first_line(e)
        return row
    times = [kernel_time_by_type(r) for r in (one, two)]
    own = {name: times[1].get(name, 0.0) - times[0].get(name, 0.0) for name in times[1]}
    total = sum(own.values())
    glue = {name: t for name, t in own.items() if name not in MATMUL_KERNELS | ATTENTION_KERNELS}
    row.update(glue_share=sum(glue.values()) / total, layer_kernel_time_us=total,
               layer_kernels=kernel_launches(two) - kernel_launches(one), one_layer_glue_share=glue_share(one),
               top_glue=sorted(((n, t / total) for n, t in glue.items()), key=lambda kv: -kv[1])[:4])
    return row


def _prefill_8b(seq: int, layers: int, timing_only: bool) -> Any:
    """The run of the prefill step program of a LLaMA with the 8B layer shape and `layers` layers on `seq` tokens."""
    import torch

    from geir.frontends.generate import export_steps

    shape = Shape(layers=layers, **LLAMA_8B)
    model = build("llama", "f16", shape)
    ids = torch.randint(1, shape.vocab, (1, 4), generator=torch.Generator().manual_seed(0))
    # exported at a short prompt (both lengths are dynamic), planned for `seq`
    prefill, _ = _quietly(export_steps, model, ids, torch.ones_like(ids), 4)
    del model
    names = [a.name for a in prefill.module.graph().args]
    if timing_only:
        return _run_phase(prefill, dict(zip(names, [(1, seq), (1, seq), (seq,), (1, seq)])), timing_only=True).result
    tokens = torch.randint(1, shape.vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    return _run_phase(prefill, _step_feeds(names, tokens, seq)).result


def kernel_time_by_type(result: Any) -> dict[str, float]:
    """Kernel time (us) per kernel type of a run, from msprof's op_summary rows (every kernel task, AI CPU too)."""
    from geir.runtime.op_summary import op_summary_rows

    out: dict[str, float] = {}
    for r in op_summary_rows(result):
        out[r.op_type] = out.get(r.op_type, 0.0) + r.task_duration_us
    return out


def _decode_per_layer(row: dict[str, Any]) -> float:
    """The decode figure the kernel goal is judged on: a layer's own launches, or all of them over the layers."""
    own = row["decode"]["layer_kernels"]
    return own if own is not None else row["decode"]["kernels_per_layer"]


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _print_row(row: dict[str, Any]) -> None:
    head = f"{row['model']:<8}{row['dtype']:<6}"
    if not row["runs"]:
        print(f"{head}stops at {row['stops']}", flush=True)
        return
    cells = []
    for phase in PHASES:
        p = row[phase]
        own = f"{p['layer_kernels']:>6}" if p["layer_kernels"] is not None else f"{'?':>6}"
        cells.append(f"{own}{p['kernels_per_layer']:>7.1f}{100 * p['glue_share']:>6.1f}%"
                     f"{p['attention_fused']:>4}/{p['attention_sites']:<3}"
                     f"{p['rms_err']:>9.1e}{p['eager_rms_err']:>9.1e} {'PASS' if p['accurate'] else 'FAIL':<5}")
    remarks: dict[str, list[str]] = {}  # each remark once, with the phases it came from
    for phase in PHASES:
        if "attention_remark" in row[phase]:
            remarks.setdefault(row[phase]["attention_remark"], []).append(phase)
    said = "; ".join(f"{' and '.join(phases)}: {text}" for text, phases in remarks.items())
    print((head + "  ".join(cells) + (f"  {said}" if said else "")).rstrip(), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(FAMILIES))
    ap.add_argument("--dtypes", default="f32,f16")
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of each small model")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens of the prefill (at least 2)")
    ap.add_argument("--seq-8b", type=int, default=2048, help="prompt tokens of the LLaMA-8B-shape prefill")
    ap.add_argument("--skip-8b", action="store_true", help="leave out the LLaMA-8B-shape runs (the glue goal)")
    ap.add_argument("--data-8b", action="store_true",
                    help="run the LLaMA-8B shape with data (the kernels' arithmetic too), not timing only")
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"llm_layer: needs torch and the hf extra (pip install -e '.[torch,hf]'): {e}", file=sys.stderr)
        return 2
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in FAMILIES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(FAMILIES)}")
    warnings.simplefilter("ignore")
    print(f"{args.layers} layers, hidden {HIDDEN}, {HEADS} heads, prompt {args.prompt}; per phase: a layer's own "
          f"kernels, all kernels over the layers, glue share of kernel time, attention fused/total, last-logits RMS "
          f"error vs float64 beside torch's own in that dtype, verdict")
    print(f"{'':<14}{'prefill':<49}{'decode'}")
    unit = f"{'layer':>6}{'kern/L':>7}{'glue':>7}{'attn':>8}{'rms err':>9}{'torch':>9} {'ok':<5}"
    print(f"{'model':<8}{'dtype':<6}{unit}  {unit}  attention remark")
    rows = []
    for kind in models:
        for dtype in args.dtypes.split(","):
            row = measure(kind, dtype, args.layers, args.prompt).row
            rows.append(row)
            _print_row(row)
    ran = [r for r in rows if r["runs"]]
    print("\ngoals")
    if ran:
        judged = {id(r): _decode_per_layer(r) for r in ran}
        worst = max(ran, key=lambda r: judged[id(r)])
        best = min(ran, key=lambda r: judged[id(r)])
        over = [r for r in ran if judged[id(r)] > GOAL_DECODE_KERNELS]
        print(f"  decode kernels per layer <= {GOAL_DECODE_KERNELS} (a layer's own where measured, else all over the "
              f"layers): {_verdict(not over)} ({len(ran) - len(over)}/{len(ran)} rows within; fewest "
              f"{judged[id(best)]:g} {best['model']} {best['dtype']}, most {judged[id(worst)]:g} {worst['model']} "
              f"{worst['dtype']})")
        first = ran[0]
        by_type = first["decode"].get("layer_kernels_by_type")
        if by_type:
            spread = ", ".join(f"{name.removeprefix('ge.')} {n}" for name, n in by_type.items())
            print(f"  a {first['model']} {first['dtype']} decode layer's own kernels: {spread}")
    stopped = [r for r in rows if not r["runs"]]
    unfused = [r for r in ran if any(r[p]["attention_fused"] < r[p]["attention_sites"] for p in PHASES)]
    short = [f"{r['model']} {r['dtype']} {r['prefill']['attention_fused']}/{r['prefill']['attention_sites']}"
             for r in unfused] + [f"{r['model']} {r['dtype']} did not run" for r in stopped]
    print(f"  every attention fused, prefill and decode (torch frontend): {_verdict(not short)} "
          f"({len(ran) - len(unfused)}/{len(rows)} rows{': ' + ', '.join(short) if short else ''})")
    big = None
    if not args.skip_8b:
        big = glue_8b(args.seq_8b, timing_only=not args.data_8b)
        if "stops" in big:
            print(f"  glue <= {100 * GOAL_GLUE:.0f} % of prefill kernel time, LLaMA-8B shape: MISS "
                  f"(did not run: {big['stops']})")
        else:
            top = ", ".join(f"{name.removeprefix('ge.')} {100 * share:.1f} %" for name, share in big["top_glue"])
            how = "run with data" if args.data_8b else "timing only"
            print(f"  glue <= {100 * GOAL_GLUE:.0f} % of prefill kernel time, LLaMA-8B shape (S {args.seq_8b}, f16, "
                  f"{how}; a layer's own, the 2-layer run less the 1-layer one): "
                  f"{_verdict(big['glue_share'] <= GOAL_GLUE)} ({100 * big['glue_share']:.1f} % of "
                  f"{big['layer_kernel_time_us']:.0f} us in {big['layer_kernels']} kernels; most glue: {top}; "
                  f"the 1-layer program's whole: {100 * big['one_layer_glue_share']:.1f} %)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "llama_8b": big}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
