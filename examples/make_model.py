#!/usr/bin/env python3
"""Write an N-layer GPT-2 style decoder in GEIR, spelled op by op as an exporter would, with its
weights in an `.npz` beside it (same stem; `dense_resource<"l3.attn.wqkv">` names array
`l3.attn.wqkv`).

    python examples/make_model.py -o /tmp/gpt.geir                 # 32 layers, hidden 512, 8 heads
    python examples/make_model.py --layers 2 --hidden 128 --heads 2 --seq 64 -o /tmp/small.geir
    python examples/make_model.py --dynamic-seq -o /tmp/dyn.geir    # sequence length `?`
    geopt /tmp/gpt.geir --passes=fuse --explain                     # what fuses, and why not

Each layer is the GPT-2 block (pre-norm):

    h   = x + c_proj(attention(ln_1(x)))       attention: causal, heads of hidden / heads
    out = h + mlp_proj(gelu_tanh(mlp_fc(ln_2(h))))

written out the way a framework exporter emits it: each layer norm as mean, sub, pow 2, mean,
add eps, rsqrt, mul, mul gamma, add beta; the QKV projection as one matmul + bias add split into
q, k, v; heads by reshape + transpose to [B, N, S, D]; attention as matmul with k transposed,
div by sqrt(head dim), the causal mask, softmax and matmul with v; the heads merged back by
transpose + reshape; GELU in its tanh form. After `fuse` each layer is two ge.layer_norm, one
ge.flash_attention and four ge.fused_matmul (QKV, attention output, MLP up with
activation = "gelu_tanh", MLP down), with the residual adds, the split and the head reshapes
and transposes left between them.

The causal mask is GPT-2's: `select(tril, scores, finfo(dtype).min)` with one constant
lower-triangular `i1` [1, 1, S, S] shared by every layer, which `fuse` turns into
`causal = true`. With `--dynamic-seq` the sequence length is `?` and a constant mask cannot be
written, so the graph takes an additive mask argument `%mask: tensor<1x1x?x?xDTYPE>` instead
(0 = attend, a large negative = masked; pass the causal mask there for a decoder, or any
padding mask) and attention fuses with that mask as its fourth operand, `causal = false`.

Weights are random (numpy's default_rng(seed), uniform with std 0.02 like GPT-2's normal
initialisation; gamma near 1 and small non-zero biases so that every term matters), stored as
float16 for f16 models and float32 otherwise (the graph casts them to its dtype). The default
32-layer model has 12 * 512^2 * 32 = 100M parameters (200 MB); use --hidden/--layers for small
ones, or `--no-weights` to write only the text (to time passes on big graphs). The weights are
written one array at a time, so memory stays at one layer's worth. The text is built with plain
string formatting: writing 32 layers takes milliseconds.

`examples/gpt2_block.geir` and its `.npz` are this script's output for
`--layers 1 --hidden 256 --heads 4 --seq 128` (the test suite checks that they still are).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zipfile

import numpy as np

from geir.files import current_umask

# finfo(dtype).min: the value GPT-2 writes into masked attention scores
MASK_MIN = {"f16": "-65504.0", "bf16": "-3.3895313892515355e+38", "f32": "-3.4028234663852886e+38"}
DTYPES = ("f16", "bf16", "f32")
_UNIT_STD = float(np.sqrt(12.0))  # uniform on [-0.5, 0.5) times this has standard deviation 1


def weight_shapes(hidden: int, mlp: int) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays of one layer (keys without the `lN.` prefix) and their shapes, in creation order."""
    return [
        ("ln1.gamma", (hidden,)), ("ln1.beta", (hidden,)),
        ("attn.wqkv", (hidden, 3 * hidden)), ("attn.bqkv", (3 * hidden,)),
        ("attn.wo", (hidden, hidden)), ("attn.bo", (hidden,)),
        ("ln2.gamma", (hidden,)), ("ln2.beta", (hidden,)),
        ("mlp.w1", (hidden, mlp)), ("mlp.b1", (mlp,)),
        ("mlp.w2", (mlp, hidden)), ("mlp.b2", (hidden,)),
    ]


def iter_weights(layers: int, hidden: int, mlp: int, seed: int = 0, dtype: str = "f16"):
    """Random weights for every layer, one `(key, array)` at a time (`"l0.ln1.gamma"`, ...)."""
    rng = np.random.default_rng(seed)
    store = np.float16 if dtype == "f16" else np.float32
    for i in range(layers):
        for name, shape in weight_shapes(hidden, mlp):
            # uniform with the standard deviation wanted: several times faster than normal draws,
            # which matters at 100M parameters
            a = rng.random(shape, dtype=np.float32)
            a -= 0.5
            if name.endswith(".gamma"):
                a *= 0.1 * _UNIT_STD
                a += 1.0
            elif name.endswith(".beta"):
                a *= 0.1 * _UNIT_STD
            else:  # projection weights and biases
                a *= 0.02 * _UNIT_STD
            yield f"l{i}.{name}", a.astype(store)


def make_weights(layers: int, hidden: int, mlp: int, seed: int = 0, dtype: str = "f16") -> dict[str, np.ndarray]:
    """Random weights for every layer: `{"l0.ln1.gamma": array, ...}`."""
    return dict(iter_weights(layers, hidden, mlp, seed, dtype))


def write_npz(path: str, arrays) -> int:
    """Write `(key, array)` pairs as an uncompressed `.npz` (what np.savez writes), one array in
    memory at a time, so that large models do not need all their weights in memory at once.
    Returns the number of elements written."""
    n = 0
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, a in arrays:
            with zf.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)
            n += a.size
    return n


def _layer_norm(p: str, which: str, x: str, hidden: int, t: str, dt: str) -> list[str]:
    n = f"%{p}_{which}"
    return [
        f"  // {which}: layer norm written out, (x - mean) * rsqrt(var + eps) * gamma + beta",
        f"  {n}_mean = ge.reduce_mean {x} {{axes = [-1], keepdims = true}}",
        f"  {n}_d = ge.sub {x}, {n}_mean",
        f"  {n}_sq = ge.pow {n}_d, %two",
        f"  {n}_var = ge.reduce_mean {n}_sq {{axes = [-1], keepdims = true}}",
        f"  {n}_vare = ge.add {n}_var, %eps",
        f"  {n}_rstd = ge.rsqrt {n}_vare",
        f"  {n}_norm = ge.mul {n}_d, {n}_rstd",
        f"  {n}_gamma = ge.const dense_resource<\"{p}.{which}.gamma\"> : tensor<{hidden}x{dt}>",
        f"  {n}_scaled = ge.mul {n}_norm, {n}_gamma",
        f"  {n}_beta = ge.const dense_resource<\"{p}.{which}.beta\"> : tensor<{hidden}x{dt}>",
        f"  {n} = ge.add {n}_scaled, {n}_beta : {t}",
    ]


def _linear(p: str, name: str, key: tuple[str, str], x: str, k: int, n: int, dt: str) -> list[str]:
    v = f"%{p}_{name}"
    return [
        f"  {v}_w = ge.const dense_resource<\"{p}.{key[0]}\"> : tensor<{k}x{n}x{dt}>",
        f"  {v}_mm = ge.matmul {x}, {v}_w",
        f"  {v}_b = ge.const dense_resource<\"{p}.{key[1]}\"> : tensor<{n}x{dt}>",
        f"  {v} = ge.add {v}_mm, {v}_b",
    ]


def _sdpa_lines(p: str) -> list[str]:
    """Attention as torch.export emits F.scaled_dot_product_attention(q, k, v, is_causal=True) (a Hugging Face
    model with attn_implementation="sdpa"), which GEIR's torch frontend imports as one ge.flash_attention."""
    return ["  // attention as torch.export emits scaled_dot_product_attention(is_causal=True): one op",
            f"  %{p}_ctx = ge.flash_attention %{p}_q, %{p}_k, %{p}_v {{causal = true}}"]


def layer_text(i: int, x: str, *, hidden: int, heads: int, seq: int | None, mlp: int, dtype: str,
               sdpa: bool = False, decode: int | None = None) -> tuple[list[str], str]:
    """The ops of layer `i` reading `x` (a value name with `%`); returns (lines, name of its output)."""
    p = f"l{i}"
    d = hidden // heads
    s = "?" if seq is None else str(seq)
    s_attr = -1 if seq is None else seq
    t = f"tensor<1x{s}x{hidden}x{dtype}>"
    L = [f"  // ---- layer {i} ----"]
    L += _layer_norm(p, "ln1", x, hidden, t, dtype)
    L.append("  // attention: QKV projection (one matmul + bias), split, heads to [B, N, S, D]")
    L += _linear(p, "qkv", ("attn.wqkv", "attn.bqkv"), f"%{p}_ln1", hidden, 3 * hidden, dtype)
    L.append(f"  %{p}_q2, %{p}_k2, %{p}_v2 = ge.split %{p}_qkv {{axis = -1, sizes = [{hidden}, {hidden}, {hidden}]}}")
    for h in "qkv":
        L.append(f"  %{p}_{h}3 = ge.reshape %{p}_{h}2 {{shape = [1, {s_attr}, {heads}, {d}]}}")
        L.append(f"  %{p}_{h} = ge.transpose %{p}_{h}3 {{perm = [0, 2, 1, 3]}}")
    if decode is not None:
        L.append(f"  // decode: this token's query against the layer's K/V cache ({decode} positions, this one's"
                 f" included: the caller wrote %{p}_k, %{p}_v there)")
        L.append(f"  %{p}_ctx = ge.flash_attention %{p}_q, %{p}_kcache, %{p}_vcache")
    elif sdpa:
        L += _sdpa_lines(p)
    else:
        L.append("  // scores = q @ k^T / sqrt(head dim), masked, softmax, @ v")
        L.append(f"  %{p}_kt = ge.transpose %{p}_k {{perm = [0, 1, 3, 2]}}")
        L.append(f"  %{p}_s = ge.matmul %{p}_q, %{p}_kt")
        L.append(f"  %{p}_ss = ge.div %{p}_s, %sqrt_d")
        if seq is None:
            L.append(f"  %{p}_sm = ge.add %{p}_ss, %mask")
        else:
            L.append(f"  %{p}_sm = ge.select %causal, %{p}_ss, %mask_min")
        L.append(f"  %{p}_p = ge.softmax %{p}_sm {{axis = -1}}")
        L.append(f"  %{p}_ctx = ge.matmul %{p}_p, %{p}_v")
    L.append("  // heads back to [B, S, hidden], output projection, residual")
    L.append(f"  %{p}_ctxt = ge.transpose %{p}_ctx {{perm = [0, 2, 1, 3]}}")
    L.append(f"  %{p}_ctx2 = ge.reshape %{p}_ctxt {{shape = [1, {s_attr}, {hidden}]}}")
    L += _linear(p, "attn", ("attn.wo", "attn.bo"), f"%{p}_ctx2", hidden, hidden, dtype)
    L.append(f"  %{p}_h = ge.add {x}, %{p}_attn : {t}")
    L += _layer_norm(p, "ln2", f"%{p}_h", hidden, t, dtype)
    L.append("  // MLP: up projection, GELU (tanh form), down projection, residual")
    L += _linear(p, "fc", ("mlp.w1", "mlp.b1"), f"%{p}_ln2", hidden, mlp, dtype)
    f = f"%{p}_fc"
    L += [
        f"  {f}_cube = ge.pow {f}, %three",
        f"  {f}_c = ge.mul {f}_cube, %gelu_c",
        f"  {f}_in = ge.add {f}, {f}_c",
        f"  {f}_tin = ge.mul {f}_in, %sqrt_2_pi",
        f"  {f}_tanh = ge.tanh {f}_tin",
        f"  {f}_1t = ge.add {f}_tanh, %one",
        f"  {f}_half = ge.mul %half, {f}",
        f"  %{p}_gelu = ge.mul {f}_half, {f}_1t",
    ]
    L += _linear(p, "mlp", ("mlp.w2", "mlp.b2"), f"%{p}_gelu", mlp, hidden, dtype)
    L.append(f"  %{p}_out = ge.add %{p}_h, %{p}_mlp : {t}")
    return L, f"%{p}_out"


def model_text(layers: int, hidden: int, heads: int, seq: int | None, mlp: int, dtype: str,
               command: str = "", path: str = "", sdpa: bool = False, decode: int | None = None) -> str:
    """The whole model as GEIR text (graph @main); `command` and `path` only go into the header comment.

    `decode`: one decode step (sequence 1) against per-layer K/V caches of that many positions, taken as
    arguments `%lN_kcache`, `%lN_vcache`; the step also returns each layer's new K and V."""
    s = "?" if seq is None else str(seq)
    t = f"tensor<1x{s}x{hidden}x{dtype}>"
    d = hidden // heads
    args = f"%x: {t}"
    cache_t = f"tensor<1x{heads}x{decode}x{d}x{dtype}>"
    kv_t = f"tensor<1x{heads}x1x{d}x{dtype}>"
    if decode is not None:
        args += "".join(f", %l{i}_kcache: {cache_t}, %l{i}_vcache: {cache_t}" for i in range(layers))
    if seq is None and not sdpa:
        args += f", %mask: tensor<1x1x?x?x{dtype}>"
    what = "One GPT-2 style transformer block" if layers == 1 else f"A {layers}-layer GPT-2 style decoder"
    head = [
        f"// {what}: hidden {hidden}, {heads} heads of {d}, MLP {mlp}, sequence {s}, {dtype}, B=1.",
        "// Written out op by op as an exporter emits it: layer norms as mean/sub/pow/mean/add/rsqrt/mul/mul/add,",
        "// QKV as matmul + bias + split, heads by reshape + transpose, attention as matmul with k transposed,",
        "// div by sqrt(head dim), causal mask, softmax, matmul with v, GELU in its tanh form, residual adds.",
        "// Weights: the .npz beside this file (same stem), dense_resource keys `lN.name`.",
    ]
    if seq is None:
        head.append("// Sequence length `?`: %mask is the additive attention mask (0 = attend, large negative = masked).")
    if command:
        head.append(f"// Generated by: {command}")
    head.append(f"// See it fuse: geopt {path or 'FILE'} --passes=fuse --explain")
    results = t if decode is None else "(" + ", ".join([t] + [kv_t] * (2 * layers)) + ")"
    L = head + [f"ge.graph @main({args}) -> {results} {{", "  // constants shared by every layer"]
    L += [
        f"  %two = ge.const dense<2.0> : tensor<{dtype}>",
        f"  %eps = ge.const dense<1e-05> : tensor<{dtype}>",
        f"  %sqrt_d = ge.const dense<{float(np.sqrt(d))!r}> : tensor<{dtype}>",
        f"  %three = ge.const dense<3.0> : tensor<{dtype}>",
        f"  %gelu_c = ge.const dense<0.044715> : tensor<{dtype}>",
        f"  %sqrt_2_pi = ge.const dense<0.7978845608028654> : tensor<{dtype}>",
        f"  %one = ge.const dense<1.0> : tensor<{dtype}>",
        f"  %half = ge.const dense<0.5> : tensor<{dtype}>",
    ]
    if seq is not None and not sdpa and decode is None:
        row = ["true"] * seq
        rows = []
        for i in range(seq):
            rows.append("[" + ", ".join(row[: i + 1] + ["false"] * (seq - i - 1)) + "]")
        L.append("  // GPT-2's causal mask: key j <= query i is kept; the rest gets finfo(dtype).min")
        L.append(f"  %causal = ge.const dense<[[[{', '.join(rows)}]]]> : tensor<1x1x{seq}x{seq}xi1>")
        L.append(f"  %mask_min = ge.const dense<{MASK_MIN[dtype]}> : tensor<{dtype}>")
    x = "%x"
    for i in range(layers):
        lines, x = layer_text(i, x, hidden=hidden, heads=heads, seq=seq, mlp=mlp, dtype=dtype, sdpa=sdpa,
                              decode=decode)
        L += lines
    new_kv = "".join(f", %l{i}_k, %l{i}_v" for i in range(layers)) if decode is not None else ""
    L.append(f"  ge.return {x}{new_kv}")
    L.append("}")
    return "\n".join(L) + "\n"


def parse_mlp(text: str, hidden: int) -> int:
    """`4x` is 4 * hidden; a plain integer is the MLP width itself."""
    try:
        if text.endswith("x"):
            return int(round(float(text[:-1]) * hidden))
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mlp must be like 4x or 2048, not {text!r}") from None


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="make_model.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32, help="number of blocks (default 32)")
    p.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads; hidden / heads is the head dim (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--mlp", default="4x", help="MLP width: a multiple of hidden like 4x, or a number (default 4x)")
    p.add_argument("--dtype", default="f16", choices=DTYPES, help="element type (default f16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--dynamic-seq", action="store_true",
                   help="sequence length `?`, with an additive %%mask argument instead of the constant causal mask")
    p.add_argument("-o", dest="output", required=True, metavar="OUT.geir", help="output; weights go to OUT.npz")
    p.add_argument("--no-weights", action="store_true",
                   help="write only the text (for timing passes on big models); the graph then cannot run")
    p.add_argument("--timing", action="store_true", help="print how long the text and the weights took")
    p.add_argument("--attention", choices=("written", "sdpa"), default="written",
                   help="written: op by op with GPT-2's constant causal mask (default; the mask literal has seq^2 "
                        "elements, slow to parse beyond a few thousand); sdpa: as torch.export emits "
                        "scaled_dot_product_attention(is_causal=True), one ge.flash_attention")
    p.add_argument("--decode", type=int, metavar="KV",
                   help="one decode step: sequence 1, attention against per-layer K/V cache arguments of KV "
                        "positions (%%lN_kcache, %%lN_vcache); the step also returns each layer's new K and V")
    p.add_argument("--config", metavar="CONFIG.json",
                   help="take the shape from a Hugging Face config.json (hidden_size / n_embd, num_attention_heads / "
                        "n_head, intermediate_size / n_inner, num_hidden_layers / n_layer, torch_dtype); options "
                        "given on the command line win")
    return p


# a Hugging Face config's keys for each option (LLaMA-style names first, GPT-2's after)
CONFIG_KEYS = {"hidden": ("hidden_size", "n_embd"), "heads": ("num_attention_heads", "n_head"),
               "mlp": ("intermediate_size", "n_inner"), "layers": ("num_hidden_layers", "n_layer")}
CONFIG_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def apply_config(args: argparse.Namespace, argv: list[str], path: str) -> list[str]:
    """Fill the options not given on the command line from a Hugging Face config; returns what is approximated."""
    import json

    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    for option, keys in CONFIG_KEYS.items():
        value = next((config[k] for k in keys if config.get(k) is not None), None)
        if value is not None and f"--{option}" not in given:
            setattr(args, option, str(value) if option == "mlp" else int(value))
    dtype = CONFIG_DTYPES.get(str(config.get("torch_dtype")))
    if dtype and "--dtype" not in given:
        args.dtype = dtype
    notes = []
    kv = config.get("num_key_value_heads")
    if kv and kv != config.get("num_attention_heads"):
        notes.append(f"{kv} key/value heads (GQA) are written as {args.heads}: the K and V projections are wider")
    if config.get("hidden_act") in ("silu", "swiglu") or "llama" in str(config.get("model_type", "")):
        notes.append("the block is GPT-2's (layer norm, GELU MLP with one up projection), not SwiGLU with RMSNorm and "
                     "RoPE: the same matmul shapes but for the gate projection")
    return notes


def command_line(args: argparse.Namespace) -> str:
    """The command that makes this model (every option spelled out, the output as given)."""
    cmd = (f"python examples/make_model.py --layers {args.layers} --hidden {args.hidden} --heads {args.heads} "
           f"--seq {args.seq} --mlp {args.mlp} --dtype {args.dtype} --seed {args.seed}")
    if args.dynamic_seq:
        cmd += " --dynamic-seq"
    if args.attention != "written":
        cmd += f" --attention {args.attention}"
    if args.decode is not None:
        cmd += f" --decode {args.decode}"
    return cmd + f" -o {args.output}"


def _write_atomically(path: str, write) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".make_model.", suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp made it 0600; an output gets the umask's mode
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = build_arg_parser()
    args = ap.parse_args(argv)
    if args.config:
        try:
            for note in apply_config(args, list(sys.argv[1:] if argv is None else argv), args.config):
                print(f"make_model.py: note: {note}", file=sys.stderr)
        except (OSError, ValueError) as e:
            ap.error(f"--config {args.config}: {e}")
    if args.layers < 1 or args.hidden < 1 or args.heads < 1 or args.seq < 1:
        ap.error("--layers, --hidden, --heads and --seq must be positive")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    try:
        mlp = parse_mlp(args.mlp, args.hidden)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if mlp < 1:
        ap.error("--mlp must be positive")
    if not args.output.endswith(".geir"):
        ap.error("-o must name a .geir file (the weights go beside it with the .npz suffix)")
    head_dim = args.hidden // args.heads
    if head_dim % 16:
        print(f"make_model.py: warning: head dim {head_dim} is not a multiple of 16; attention will not fuse",
              file=sys.stderr)

    t0 = time.perf_counter()
    seq = None if args.dynamic_seq else args.seq
    if args.decode is not None:
        if args.decode < 1 or args.dynamic_seq:
            ap.error("--decode KV needs KV >= 1 and a static sequence")
        seq = 1
    text = model_text(args.layers, args.hidden, args.heads, seq, mlp, args.dtype, command_line(args), args.output,
                      sdpa=args.attention == "sdpa", decode=args.decode)
    t1 = time.perf_counter()
    n = 0
    if not args.no_weights:
        weights = iter_weights(args.layers, args.hidden, mlp, args.seed, args.dtype)
        _write_atomically(args.output[: -len(".geir")] + ".npz", lambda tmp: write_npz(tmp, weights))
        n = sum(int(np.prod(shape)) for _, shape in weight_shapes(args.hidden, mlp)) * args.layers
    t2 = time.perf_counter()

    def write_text(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    _write_atomically(args.output, write_text)
    if args.timing:
        print(f"text {1e3 * (t1 - t0):.1f} ms ({text.count(chr(10))} lines), weights "
              + ("skipped" if args.no_weights else f"{1e3 * (t2 - t1):.1f} ms ({n / 1e6:.1f}M parameters, made and written)"),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
