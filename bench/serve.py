"""Continuous against static batching at equal KV pool memory, on a synthetic trace (geir.frontends.torch.serve).

    python bench/serve.py [--requests 24] [--rate 20] [--block-size 16] [--pool-blocks 48] [--timing-only]
                          [--seed 0] [--json OUT.json]

The trace: `--requests` requests with Poisson arrivals at `--rate` requests per modelled millisecond; prompt and
output lengths drawn independently from log-normal distributions shaped like ShareGPT's (long-tailed; the vLLM
paper's ShareGPT has a mean prompt of 161 and output of 338 tokens), scaled down to this small model: prompt
lengths exp(N(ln 12, 0.6)) clipped to [2, 64], output lengths exp(N(ln 16, 0.7)) clipped to [1, 64]. The model
is a random-init 2-layer LLaMA (hidden 64, 4 heads, 2 KV heads, f32) on ascend910b; both policies get the same
pool (`--pool-blocks` blocks of `--block-size` tokens) and the same requests, and their tokens must agree
(full numerics). Each row: throughput (new tokens per modelled second over the makespan, GE's host work
included as it lies on the one clock), device throughput (new tokens per second of device busy time: the
steady state once GE's plans are cached), mean TTFT and TPOT, device busy and idle time, pool peak, utilisation and
waste, preemptions, plan-cache hits and misses, host GE time. The device figures are simulated; GE's host time
is measured, so it and the makespan vary with the machine's load.

What is modelled: the pool is bookkeeping (admission, preemption, waste); attention reads a dense per-batch cache
that a regroup run rebuilds on the device when rows join or leave (see geir/frontends/serve.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import warnings


def synthetic_trace(n: int, rate_per_ms: float, vocab: int, seed: int) -> list[tuple[list[int], int, float]]:
    """ShareGPT-like long-tailed lengths (log-normal, scaled down) and Poisson arrivals."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        prompt = min(64, max(2, round(math.exp(rng.gauss(math.log(12), 0.6)))))
        new = min(64, max(1, round(math.exp(rng.gauss(math.log(16), 0.7)))))
        out.append(([rng.randrange(1, vocab) for _ in range(prompt)], new, t))
        t += rng.expovariate(rate_per_ms) * 1000.0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24, help="requests in the trace (default 24)")
    ap.add_argument("--rate", type=float, default=20.0, help="arrivals per modelled millisecond (default 20)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    ap.add_argument("--pool-blocks", type=int, default=48, help="KV pool blocks, the same for both (default 48)")
    ap.add_argument("--timing-only", action="store_true", help="cost models only (no token check)")
    ap.add_argument("--launch", choices=("single-op", "graph"), default="single-op",
                    help="how each step's kernels reach the device (default single-op)")
    ap.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"serve: needs torch and the hf extra (pip install -e '.[torch,hf]'): {e}", file=sys.stderr)
        return 2
    from geir.frontends.serve import kv_bytes_per_token
    from geir.frontends.torch import serve

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(config).eval()
    trace = synthetic_trace(args.requests, args.rate, config.vocab_size, args.seed)
    pool_bytes = args.pool_blocks * args.block_size * kv_bytes_per_token(model)
    prompts = [len(p) for p, _, _ in trace]
    news = [n for _, n, _ in trace]
    print(f"{len(trace)} requests, prompts {min(prompts)}-{max(prompts)} tokens (mean {sum(prompts) / len(trace):.1f}), "
          f"outputs {min(news)}-{max(news)} (mean {sum(news) / len(trace):.1f}), arrivals over "
          f"{trace[-1][2] / 1e3:.2f} ms; pool {args.pool_blocks} blocks of {args.block_size} tokens ({pool_bytes} B); "
          f"2-layer LLaMA, hidden 64, f32, ascend910b, {args.launch} launches{', timing only' if args.timing_only else ''}")
    print(f"{'policy':<11}{'tok/s':>8}{'device tok/s':>13}{'makespan ms':>12}{'TTFT ms':>9}{'TPOT us':>9}{'busy ms':>9}{'idle ms':>9}"
          f"{'peak':>6}{'util':>6}{'waste':>7}{'preempt':>8}{'hits':>6}{'miss':>6}{'GE ms':>8}")
    rows, tokens = [], None
    for policy in ("continuous", "static"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = serve(model, [(torch.tensor(p), n, a) for p, n, a in trace], policy=policy,
                        block_size=args.block_size, pool_bytes=pool_bytes, timing_only=args.timing_only,
                        launch=args.launch)
        got = [r.tokens.tolist() for r in run.requests]
        if tokens is not None and got != tokens and not args.timing_only:
            print(f"{policy}: tokens differ from continuous batching's", file=sys.stderr)
            return 1
        tokens = got
        m = run.summary()
        ttft = sum(r.ttft_us for r in run.requests) / len(run.requests)
        tpot = sum(r.tpot_us for r in run.requests) / len(run.requests)
        rows.append({**m, "mean_ttft_us": ttft, "mean_tpot_us": tpot})
        print(f"{policy:<11}{m['throughput_tok_per_s']:>8.0f}{m['new_tokens'] / m['device_busy_us'] * 1e6:>13.0f}"
              f"{m['makespan_us'] / 1e3:>12.2f}{ttft / 1e3:>9.2f}"
              f"{tpot:>9.0f}{m['device_busy_us'] / 1e3:>9.2f}{m['device_idle_us'] / 1e3:>9.2f}"
              f"{m['pool_peak_blocks']:>6}{100 * m['pool_utilisation']:>5.0f}%{100 * m['pool_waste']:>6.1f}%"
              f"{m['preemptions']:>8}{m['plan_cache_hits']:>6}{m['plan_cache_misses']:>6}{m['host_ge_us'] / 1e3:>8.0f}",
              flush=True)
    cont, stat = rows
    print(f"continuous batching: {cont['throughput_tok_per_s'] / stat['throughput_tok_per_s']:.2f}x static's "
          f"throughput on the one clock (GE's host work included), {stat['device_busy_us'] / cont['device_busy_us']:.2f}x "
          f"its device throughput (the same tokens in less device time)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
