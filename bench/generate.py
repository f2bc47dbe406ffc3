"""Generation with and without shape buckets (GE's gears): compiles, plan-cache hits, padding and host GE share.

    python bench/generate.py [--steps 64] [--prompt 16] [--json OUT.json]

A small random-init LLaMA (4 layers, hidden 256, 8 heads, 2 kv heads) takes a 16-token prompt and
generates `--steps` decode steps through `geir.frontends.torch.generate`, three ways: without
buckets (every cache length a new shape signature: a re-plan each step, the cache grown each
step), with powers of two, and with a fixed few gears. Each row: GE's compiles and re-plans,
plan-cache hits, padding waste (free cache slots over all decode slots), host GE time and its
share of end to end, device time and end to end on the one timeline, and the peak KV bytes. The
tokens of all three must agree (the padding is masked). GE's figures are measured host time, so
they vary with the machine's load; the device's are simulated.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64, help="decode steps (default 64)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"generate: needs torch and the hf extra (pip install -e '.[torch,hf]'): {e}", file=sys.stderr)
        return 2
    from geir.frontends.torch import generate

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(1, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    total = args.prompt + args.steps
    gears = sorted({args.prompt, (args.prompt + total) // 2, total})
    policies = [("none", None), ("pow2", "pow2"), (f"gears {','.join(map(str, gears))}", gears)]
    print(f"{args.steps} decode steps after a {args.prompt}-token prompt (4-layer LLaMA, hidden 256, f32, ascend910b)")
    print(f"{'buckets':<16}{'compiles':>9}{'re-plans':>9}{'hits':>6}{'padding':>9}{'host GE ms':>11}{'GE share':>9}"
          f"{'device ms':>10}{'end to end ms':>14}{'peak KV B':>11}")
    rows, tokens = [], None
    for label, buckets in policies:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = generate(model, prompt, args.steps + 1, buckets=buckets)  # the prefill's token, then the steps
        m = run.summary()
        if tokens is not None and not torch.equal(tokens, run.tokens):
            print(f"{label}: tokens differ from the run without buckets", file=sys.stderr)
            return 1
        tokens = run.tokens
        rows.append({"buckets": label, **m})
        print(f"{label:<16}{m['compiles']:>9}{m['plan_cache_misses']:>9}{m['plan_cache_hits']:>6}"
              f"{100 * m['padding_waste']:>8.0f}%{m['host_ge_us'] / 1e3:>11.1f}{100 * m['host_ge_share']:>8.0f}%"
              f"{m['device_us'] / 1e3:>10.2f}{m['end_to_end_us'] / 1e3:>14.1f}{m['peak_kv_bytes']:>11}", flush=True)
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['buckets']}: end to end {base['end_to_end_us'] / r['end_to_end_us']:.2f}x faster than without "
              f"buckets; host GE {base['host_ge_us'] / max(r['host_ge_us'], 1e-9):.1f}x less")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
