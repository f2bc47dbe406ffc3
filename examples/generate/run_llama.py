"""A small random-init LLaMA generating token by token on the simulated NPU, step by step.

    python examples/generate/run_llama.py [--new 24] [--buckets pow2|none|16,32,64] [--trace OUT.json]

Builds a LLaMA-family model from a small config (no download: 4 layers, hidden 256, 8 heads with 2
kv heads, RoPE, RMSNorm), takes a 16-token prompt, and runs `geir.frontends.torch.generate`: a
prefill, then one decode step per token, the KV cache kept on the device. It prints one line per
step (plan-cache hit or miss, GE's host time, the device's, the cache's slots and bytes) and checks
the tokens against `model.generate(do_sample=False)`. Needs torch and the hf extra.
"""

from __future__ import annotations

import argparse
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=24, help="tokens to generate (default 24)")
    ap.add_argument("--buckets", default="pow2", help="none, pow2 (default) or lengths like 16,32,64")
    ap.add_argument("--trace", help="also write the run as a Chrome trace (GE, the device, memory counters)")
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"run_llama: needs torch and the hf extra (pip install -e '.[torch,hf]'): {e}", file=sys.stderr)
        return 2
    from geir.frontends.torch import generate

    buckets = None if args.buckets == "none" else args.buckets if args.buckets == "pow2" else [
        int(n) for n in args.buckets.split(",")]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(1, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = generate(model, prompt, args.new, buckets=buckets)
    print(run.render())
    print(run.diagnose())
    if args.trace:
        import json

        from geir.files import write_atomically

        write_atomically(args.trace, json.dumps(run.trace()))  # never a partial file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new,
                                  do_sample=False, pad_token_id=0)
    same = torch.equal(run.tokens, expected)
    print(f"tokens {'equal' if same else 'DIFFER from'} Hugging Face's model.generate(do_sample=False)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
