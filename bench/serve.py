"""Continuous against static batching at equal KV pool memory, on a synthetic trace (geir.frontends.torch.serve).

    python bench/serve.py [--shape tiny|llama-7b] [--requests N] [--rate R] [--block-size B] [--pool-blocks P]
                          [--timing-only] [--launch single-op|graph] [--warmup gears|decode|none] [--seed 0]
                          [--waste-only] [--json OUT.json] [--plot OUT.png]

The trace: lengths log-normal with the vLLM paper's ShareGPT means (Kwon et al., SOSP 2023, section 6.1: 161
prompt and 338 output tokens on average), times a scale: prompts exp(N(ln(161 s) - 1/2, 1.0)) clipped to
[4, 2048 s], outputs exp(N(ln(338 s) - 0.32, 0.8)) clipped to [1, 1024 s] (mu = ln(mean) - sigma^2 / 2 puts the
log-normal's mean at the paper's; the spreads are this bench's choice); Poisson arrivals at `--rate`.

Two shapes:
- `tiny` (the default): a random-init 2-layer LLaMA (hidden 64, 4 heads, 2 KV heads, f32) with full numerics;
  64 requests (the issue's 64-256) at half scale (s = 0.5: means 81 and 169 tokens, so a sequence spans several
  16-token blocks as ShareGPT's do) arriving at 20 per modelled millisecond; 16-token blocks (the paper's), a pool
  of 512 blocks (about half of what the trace needs with every request at its longest: memory bounds the batch).
  Both policies' tokens must agree.
- `llama-7b`: LLaMA-2-7B's shape (Meta's config.json: hidden 4096, 32 heads, 32 KV heads, 32 layers, MLP 11008,
  vocabulary 32000; f16), timing only: its weights are stand-ins with every shape and no bytes (one element
  broadcast, zero strides; 13.5 GB of f16 would not fit the host), so every kernel is timed by its cost model on
  the real shapes and nothing is computed. 256 requests at full scale (s = 1) at 20 per modelled second;
  128-token blocks as on Ascend; the pool is what an Atlas 800I A2 NPU's 64 GiB of HBM (the target file's
  hbm_gib) leaves at vLLM's default gpu_memory_utilization of 0.9 after the weights, the step's inputs and the
  largest activation arena (GE's plan of the prefill at its largest gear, before the pool exists: vLLM's profile
  run); serve sizes it (memory_utilization).

Each row: throughput (new tokens per modelled second over the makespan, GE's host work included as it lies on the
one clock), device throughput (new tokens per second of device busy time: the steady state once GE's plans are
cached), mean TTFT and TPOT, device busy and idle time, pool peak, utilisation and waste, preemptions, plan-cache
hits and misses and host GE time during the trace, and GE's startup time (`start ms`: serve's warm-up before
the first arrival, by default vLLM's: both step programs compiled, and planned, in graph mode captured, at every
gear a step can take: the decode step at every batch gear, the prefill at every (batch gear, power of two of
blocks) under the token budget; outside the makespan, as vLLM's serving benchmarks measure after engine startup;
the same for both policies). Waste is the slots allocated beyond the tokens stored, as a share of the allocated
slots (the PagedAttention paper's measure: its Fig. 2 has 96.3 % of vLLM's KV memory holding tokens), summed over
the run's steps; `of pool` is the same slots as a share of the whole pool's. The device figures are simulated;
GE's host time is measured, so it and the makespan vary with the machine's load.

Both shapes judge the issue's goals, each PASS or MISS with its figure: continuous >= 2x static's throughput (on
the one clock, and in device time), pool waste < 4 %. The paper's < 4 % is measured with 16-token blocks and
internal fragmentation is about half a block per sequence, so the waste goal is judged at block size 16 and also
reported at Ascend's 128 (for llama-7b at 16 from the scheduler alone on the same trace, `scheduler_waste`:
waste depends on which tokens each step holds, not on the model). The llama-7b shape adds: device idle <= 5 % of
a batch-1 decode step in graph mode (the profile's device_idle_us over the step's span), the decode TPOT within
15 % of a measured anchor (bench/calibration.py's decode_anchors(): torchair's LLaMA-2-7B and Qwen2-7B steps in
graph mode at batch 1 on one Atlas 800I A2 card, each beside GEIR serving its shape, the served family's judged
first; about a minute more),
and the 256-request trace in at most 60 s of host time (each policy's serve() call, export and compiles
included, on this host). `--waste-only` prints the waste at both block sizes and nothing else.

What is modelled: the pool is the KV cache itself (one [slots, KV heads, head dim] tensor per layer for keys and one
for values, resident on the device): each step writes its tokens' keys and values at their blocks' slots in place,
and attention reads each row's blocks through its block table (ge.paged_attention, FIA with a block table); rows
joining or leaving move no cache (see geir/frontends/serve.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Meta's Llama-2-7b-hf config.json
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
SERVED_FAMILY = "llama"  # bench/calibration.py's name for the family above: its decode anchor judges the TPOT first
# the vLLM paper's ShareGPT means (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention", SOSP 2023, section 6.1): input and output tokens
SHAREGPT_MEAN_PROMPT, SHAREGPT_MEAN_OUTPUT = 161.31, 337.99
PROMPT_SIGMA, OUTPUT_SIGMA = 1.0, 0.8
# vLLM's default gpu_memory_utilization (the device's memory: the target file's [memory] hbm_gib)
MEMORY_UTILISATION = 0.9
GOAL_SPEEDUP, GOAL_WASTE, GOAL_IDLE, GOAL_TPOT, GOAL_HOST_S = 2.0, 0.04, 0.05, 0.15, 60.0
# the tiny shape's trace: the same ShareGPT-like distribution at half scale (means 81 and 169 tokens), so a sequence
# spans several 16-token blocks as ShareGPT's do while a full-numerics run stays within minutes; its pool holds about
# half of what the trace needs with every request at its longest, so memory bounds the batch as in the vLLM paper
TINY_SCALE, TINY_POOL_BLOCKS = 0.5, 512
# the PagedAttention paper's block size (vLLM's default; Kwon et al., SOSP 2023, section 7.2) and Ascend's default
# (vllm-ascend; ATB's recommendation): both inside FusedInferAttentionScore's documented range for head dim 128
# (ops-transformer, aclnnFusedInferAttentionScoreV5.md, Paged Attention: blockSize 16-aligned, at most 1024)
PAPER_BLOCK, ASCEND_BLOCK = 16, 128


def sharegpt_trace(n: int, rate_per_ms: float, vocab: int, seed: int,
                   scale: float = 1.0) -> list[tuple[list[int], int, float]]:
    """Lengths log-normal with the vLLM paper's ShareGPT means times `scale` (1: full scale; the spreads and the
    clips scale with them), Poisson arrivals."""
    rng = random.Random(seed)
    mu_p = math.log(SHAREGPT_MEAN_PROMPT * scale) - PROMPT_SIGMA ** 2 / 2
    mu_o = math.log(SHAREGPT_MEAN_OUTPUT * scale) - OUTPUT_SIGMA ** 2 / 2
    top_p, top_o = max(4, round(2048 * scale)), max(2, round(1024 * scale))
    out, t = [], 0.0
    for _ in range(n):
        prompt = min(top_p, max(4, round(math.exp(rng.gauss(mu_p, PROMPT_SIGMA)))))
        new = min(top_o, max(1, round(math.exp(rng.gauss(mu_o, OUTPUT_SIGMA)))))
        out.append(([rng.randrange(1, vocab) for _ in range(prompt)], new, t))
        t += rng.expovariate(rate_per_ms) * 1000.0
    return out


def stand_in_llama(layers: int = LLAMA_7B["num_hidden_layers"], dtype: Any = None) -> Any:
    """LLaMA-2-7B's shape (`layers` of its layers) with stand-in weights: each one element broadcast to the weight's
    shape (zero strides, two bytes behind 6.7e9 elements), so torch.export and GEIR's importer see every shape while
    the host holds no weights; a timing-only run needs nothing else. The rotary table is real (it is computed)."""
    import torch
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    dtype = dtype or torch.float16
    config = transformers.LlamaConfig(**{**LLAMA_7B, "num_hidden_layers": layers})
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/calibration.py, also when loaded by path
    from calibration import stand_in

    model = stand_in(transformers.LlamaForCausalLM, config, LlamaRotaryEmbedding, dtype)
    if any(b.is_meta for b in model.buffers()):  # a buffer this shape left on meta would fail the export
        raise RuntimeError("the stand-in LLaMA kept a buffer without values")
    return model


def weight_bytes(model: Any) -> int:
    """The bytes the model's weights take on the device (what a checkpoint holds), stand-ins counted whole."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _RunIdle:
    """Each run's device span and its idle time within it (the profile's device_idle_us), in run order."""

    def __init__(self) -> None:
        self.runs: list[tuple[float, float]] = []

    def listener(self) -> Any:
        from geir.runtime.interpreter import RuntimeListener
        from geir.runtime.profile import device_idle_us

        runs = self.runs

        class Recorder(RuntimeListener):
            def run_finished(self, result: Any) -> None:
                runs.append((max((t.end_us for t in result.tasks), default=0.0), device_idle_us(result)))

        return Recorder()


def _serve(model: Any, trace: list, policy: str, args: argparse.Namespace, pool_bytes: int | None,
           listeners: tuple = (), memory_utilization: float | None = None) -> tuple[Any, float]:
    """One policy over the trace (a pool of `pool_bytes`, or sized by serve from `memory_utilization` of the
    device's memory); its Serving and the host seconds the serve() call took."""
    import torch

    from geir.frontends.torch import serve

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = serve(model, [(torch.tensor(p), n, a) for p, n, a in trace], policy=policy,
                    block_size=args.block_size, pool_bytes=pool_bytes, timing_only=args.timing_only,
                    launch=args.launch, listeners=listeners, warmup=args.warmup,
                    memory_utilization=memory_utilization)
    return run, time.perf_counter() - start


def _sizing(run: Any) -> str:
    """How serve sized the pool from the device's memory, for the header ('' when it was given)."""
    z = run.pool_sizing
    if z is None:
        return ""
    return (f"; {100 * z.utilisation:.0f} % of the device's {z.device_bytes / 2**30:.0f} GiB less {z.weights_bytes / 1e9:.2f} "
            f"GB of weights, {z.activation_bytes / 1e6:.1f} MB of activations (GE's plan of the largest prefill gear) "
            f"and {z.input_bytes / 1e3:.0f} kB of inputs")


def _row(policy: str, run: Any, host_s: float) -> dict[str, Any]:
    m = run.summary()
    n = len(run.requests)
    waste_slots = sum(s.pool_allocated_slots - s.pool_token_slots for s in run.steps)
    pool_slots = len(run.steps) * run.pool_blocks * run.block_size
    return {**m, "mean_ttft_us": sum(r.ttft_us for r in run.requests) / n,
            "mean_tpot_us": sum(r.tpot_us for r in run.requests) / n,
            "pool_waste_of_pool": waste_slots / pool_slots if pool_slots else 0.0, "host_s": host_s}


def tiny_llama() -> Any:
    """The tiny shape's model: a random-init 2-layer LLaMA (hidden 64, 4 heads, 2 KV heads, f32)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    return transformers.LlamaForCausalLM(config).eval()


def scheduler_waste(trace: list, block_sizes: tuple[int, ...]) -> dict[int, float]:
    """Continuous batching's pool waste (slots allocated beyond the tokens over the allocated slots, summed over the
    steps) on `trace`'s lengths at each block size, from the scheduler and the pool's accounting alone: a tiny
    model, timing only (waste does not depend on the model, only on which tokens each step holds), every request
    arriving at once (a sequence is counted in every step of its life, whatever the arrivals), a pool that holds
    them all (as the 7B shape's 60 GB pool does: no preemption)."""
    import torch

    from geir.frontends.torch import serve

    model = tiny_llama()
    requests = [(torch.tensor([1 + t % 99 for t in p]), n, 0.0) for p, n, _ in trace]
    out = {}
    for bs in block_sizes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # no warm-up: with every request there at once the schedule does not depend on the clock, so GE's
            # startup would only add host time (the plans this schedule needs are made as it needs them)
            out[bs] = serve(model, requests, block_size=bs, timing_only=True, warmup="none").pool_waste
    return out


def _print_waste(trace: list) -> dict[int, float]:
    """The scheduler's waste on the trace at the paper's and Ascend's block sizes, printed beside the expectation
    of internal fragmentation alone (half a block per sequence, over its tokens and that half block)."""
    start = time.perf_counter()
    waste = scheduler_waste(trace, (PAPER_BLOCK, ASCEND_BLOCK))
    host_s = time.perf_counter() - start
    for bs, w in waste.items():
        held = sum(sum(p + k for k in range(n)) for p, n, _ in _lengths(trace)) / sum(n for _, n, _ in _lengths(trace))
        print(f"pool waste at block size {bs:>3} (continuous, scheduler only): {100 * w:5.2f} % of allocated slots "
              f"(half a block per sequence over a mean {held:.0f} tokens held: {100 * bs / 2 / (held + bs / 2):.1f} %)")
    print(f"(a tiny model timing only on the trace's lengths, every request at once: {host_s:.0f} s of host time)")
    return waste


def _describe(trace: list) -> str:
    """The trace's lengths and arrivals in a phrase."""
    prompts = [len(p) for p, _, _ in trace]
    news = [n for _, n, _ in trace]
    return (f"prompts {min(prompts)}-{max(prompts)} tokens (mean {sum(prompts) / len(trace):.1f}), outputs "
            f"{min(news)}-{max(news)} (mean {sum(news) / len(trace):.1f}), arrivals over {trace[-1][2] / 1e3:.2f} ms")


def _lengths(trace: list) -> list[tuple[int, int, float]]:
    return [(len(p), n, a) for p, n, a in trace]


def _print_row(policy: str, row: dict[str, Any]) -> None:
    print(f"{policy:<11}{row['throughput_tok_per_s']:>8.0f}{row['new_tokens'] / row['device_busy_us'] * 1e6:>13.0f}"
          f"{row['makespan_us'] / 1e3:>12.2f}{row['mean_ttft_us'] / 1e3:>11.2f}"
          f"{row['mean_tpot_us']:>11.0f}{row['device_busy_us'] / 1e3:>11.2f}{row['device_idle_us'] / 1e3:>11.2f}"
          f"{row['pool_peak_blocks']:>6}{100 * row['pool_utilisation']:>5.0f}%{100 * row['pool_waste']:>6.1f}%"
          f"{row['preemptions']:>8}{row['plan_cache_hits']:>6}{row['plan_cache_misses']:>6}"
          f"{row['host_ge_us'] / 1e3:>8.0f}{row['startup_ge_us'] / 1e3:>10.0f}", flush=True)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def decode_step_batch1(model: Any, args: argparse.Namespace, prompt: int, new: int) -> dict[str, Any]:
    """One request alone, timing only, in graph mode: its decode steps' span, TPOT and device idle (profile)."""
    import torch

    from geir.frontends.torch import serve

    idle = _RunIdle()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = serve(model, [(torch.arange(1, prompt + 1), new, 0.0)], block_size=args.block_size,
                    timing_only=True, launch="graph", listeners=[idle.listener()])
    if len(idle.runs) != len(run.steps):  # every step is one Runtime run: the two lists line up
        raise RuntimeError(f"{len(idle.runs)} runs for {len(run.steps)} steps")
    decodes = [(s, r) for s, r in zip(run.steps, idle.runs) if s.kind == "decode" and s.plan_cache == "hit"]
    span = sum(r[0] for _, r in decodes) / len(decodes)
    idle_us = sum(r[1] for _, r in decodes) / len(decodes)
    # the TPOT of the steady state: a cached decode step's span (the request's own TPOT on the one clock also
    # waits for GE's first plans of each bucket)
    return {"prompt": prompt, "new_tokens": new, "decode_span_us": span, "device_idle_us": idle_us,
            "idle_share": idle_us / span, "tpot_us": span, "tpot_one_clock_us": run.requests[0].tpot_us}


def _plot(rows: list[dict[str, Any]], runs: list[Any], out: str, title: str) -> None:
    """Running sequences and the pool's blocks in use over modelled time, one panel per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for run, row in zip(runs, rows):
        t = [s.end_us / 1e6 for s in run.steps]
        axes[0].step(t, [s.pool_used_blocks for s in run.steps], where="post",
                     label=f"{row['policy']} ({row['throughput_tok_per_s']:.0f} tok/s)")
        decodes = [s for s in run.steps if s.kind == "decode"]
        axes[1].plot([s.end_us / 1e6 for s in decodes], [len(s.requests) for s in decodes], ".", ms=2,
                     label=row["policy"])
    axes[0].axhline(runs[0].pool_blocks, color="grey", lw=0.8, ls="--", label="pool")
    axes[0].set_ylabel("KV blocks in use")
    axes[1].set_ylabel("sequences decoded")
    axes[1].set_xlabel("modelled time (s)")
    axes[0].legend(fontsize=8)
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("tiny", "llama-7b"), default="tiny",
                    help="tiny: a 2-layer LLaMA with full numerics; llama-7b: LLaMA-2-7B's shape, timing only")
    ap.add_argument("--requests", type=int, help="requests in the trace (tiny 64, llama-7b 256)")
    ap.add_argument("--rate", type=float, help="arrivals per modelled millisecond (tiny 20, llama-7b 0.02)")
    ap.add_argument("--block-size", type=int, help="tokens per KV block (tiny 16, llama-7b 128)")
    ap.add_argument("--pool-blocks", type=int,
                    help=f"KV pool blocks, the same for both (tiny {TINY_POOL_BLOCKS}; llama-7b: what {MEMORY_UTILISATION}"
                         f" of the device's memory leaves after the weights, inputs and activations)")
    ap.add_argument("--layers", type=int, default=LLAMA_7B["num_hidden_layers"],
                    help="llama-7b: how many of its 32 layers (fewer: a quicker check of the same path)")
    ap.add_argument("--timing-only", action="store_true", help="cost models only (no token check; llama-7b always)")
    ap.add_argument("--launch", choices=("single-op", "graph"), default="single-op",
                    help="how each step's kernels reach the device (default single-op)")
    ap.add_argument("--warmup", choices=("gears", "decode", "none"), default="gears",
                    help="GE's work before the first arrival, outside the makespan (default gears: vLLM's startup, "
                         "every prefill and decode gear planned); decode: the decode step's gears only; none: every "
                         "plan on the trace's clock")
    ap.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    ap.add_argument("--waste-only", action="store_true",
                    help=f"only the scheduler's pool waste on this shape's trace at block sizes {PAPER_BLOCK} and "
                         f"{ASCEND_BLOCK} (no policy runs)")
    ap.add_argument("--json", help="also write the rows as JSON")
    ap.add_argument("--plot", help="also draw the run (pool occupancy and batch over time) to this PNG")
    args = ap.parse_args(argv)
    big = args.shape == "llama-7b"
    args.requests = args.requests or (256 if big else 64)
    args.rate = args.rate if args.rate is not None else (0.02 if big else 20.0)
    args.block_size = args.block_size or (128 if big else 16)
    args.timing_only = args.timing_only or big
    if args.requests < 1 or args.rate <= 0 or args.block_size < 1 or (args.pool_blocks is not None and args.pool_blocks < 1):
        ap.error("--requests, --rate, --block-size and --pool-blocks must be positive")
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"serve: needs torch and the hf extra (pip install -e '.[torch,hf]'): {e}", file=sys.stderr)
        return 2
    from geir.frontends.serve import kv_bytes_per_token

    torch.manual_seed(0)
    if args.waste_only:  # the trace alone: no model of this shape, no pool of its memory
        trace = (sharegpt_trace(args.requests, args.rate, LLAMA_7B["vocab_size"], args.seed) if big else
                 sharegpt_trace(args.requests, args.rate, 100, args.seed, TINY_SCALE))
        print(f"{len(trace)} requests ({args.shape} shape's trace), {_describe(trace)}")
        _print_waste(trace)
        return 0
    if big:
        model = stand_in_llama(args.layers)
        trace = sharegpt_trace(args.requests, args.rate, LLAMA_7B["vocab_size"], args.seed)
        per_token = kv_bytes_per_token(model)
        pool_blocks = args.pool_blocks  # None: serve sizes the pool from the device's memory
        what = (f"LLaMA-2-7B shape ({args.layers} layers, f16, stand-in weights of {weight_bytes(model) / 1e9:.1f} GB),"
                f" timing only")
    else:
        model = tiny_llama()
        trace = sharegpt_trace(args.requests, args.rate, model.config.vocab_size, args.seed, TINY_SCALE)
        per_token = kv_bytes_per_token(model)
        pool_blocks = args.pool_blocks or TINY_POOL_BLOCKS
        what = f"2-layer LLaMA, hidden 64, f32{', timing only' if args.timing_only else ''}"
    pool_bytes = None if pool_blocks is None else pool_blocks * args.block_size * per_token
    rows, runs, tokens = [], [], None
    for policy in ("continuous", "static"):
        run, host_s = _serve(model, trace, policy, args, pool_bytes,
                             memory_utilization=MEMORY_UTILISATION if pool_bytes is None else None)
        if not runs:  # the pool, the same for both policies (serve's sizing is a function of model and trace)
            pool_blocks = run.pool_blocks
            print(f"{len(trace)} requests, {_describe(trace)}; pool {pool_blocks} blocks of {args.block_size} tokens "
                  f"({run.pool_bytes} B{f', {per_token} B a token' if big else ''}{_sizing(run)}); {what}, ascend910b, "
                  f"{args.launch} launches")
            print(f"{'policy':<11}{'tok/s':>8}{'device tok/s':>13}{'makespan ms':>12}{'TTFT ms':>11}{'TPOT us':>11}"
                  f"{'busy ms':>11}{'idle ms':>11}{'peak':>6}{'util':>6}{'waste':>7}{'preempt':>8}{'hits':>6}{'miss':>6}"
                  f"{'GE ms':>8}{'start ms':>10}")
        got = [r.tokens.tolist() for r in run.requests]
        if tokens is not None and got != tokens and not args.timing_only:
            print(f"{policy}: tokens differ from continuous batching's", file=sys.stderr)
            return 1
        tokens = got
        rows.append(_row(policy, run, host_s))
        runs.append(run)
        _print_row(policy, rows[-1])
    cont, stat = rows
    speedup = cont["throughput_tok_per_s"] / stat["throughput_tok_per_s"]
    print(f"continuous batching: {speedup:.2f}x static's "
          f"throughput on the one clock (GE's host work in the trace included), "
          f"{stat['device_busy_us'] / cont['device_busy_us']:.2f}x its device throughput (the same tokens in less "
          f"device time)")
    if args.warmup != "none":
        print(f"startup ({args.warmup} warm-up, before the first arrival, outside the makespan as in vLLM's serving "
              f"benchmarks): GE {cont['startup_ge_us'] / 1e3:.0f} and {stat['startup_ge_us'] / 1e3:.0f} ms, "
              f"{cont['startup_plans']} and {stat['startup_plans']} plans, device "
              f"{cont['startup_device_us'] / 1e3:.2f} and {stat['startup_device_us'] / 1e3:.2f} ms")
    extra: dict[str, Any] = {}
    if big:
        extra = _goals(model, args, trace, rows, speedup)
    else:
        _tiny_goals(args, rows, speedup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, **extra} if big else rows, f, indent=1)
    if args.plot:
        _plot(rows, runs, args.plot, f"{len(trace)} requests, {what}; pool {pool_blocks} x {args.block_size} tokens")
    return 0


def _tiny_goals(args: argparse.Namespace, rows: list[dict[str, Any]], speedup: float) -> None:
    """The issue's throughput and waste goals on the tiny shape, PASS or MISS with their figures."""
    cont, stat = rows
    device = stat["device_busy_us"] / cont["device_busy_us"]
    print("goals (tiny shape):")
    print(f"  continuous >= {GOAL_SPEEDUP:.0f}x static's throughput at equal pool memory: on the one clock "
          f"{_verdict(speedup >= GOAL_SPEEDUP)} ({speedup:.2f}x; GE's plans in the trace, {cont['plan_cache_misses']} and "
          f"{stat['plan_cache_misses']}, {cont['host_ge_us'] / 1e3:.0f} and {stat['host_ge_us'] / 1e3:.0f} ms of "
          f"makespans of {cont['makespan_us'] / 1e3:.0f} and {stat['makespan_us'] / 1e3:.0f} ms); in device time "
          f"{_verdict(device >= GOAL_SPEEDUP)} ({device:.2f}x)")
    paper = "the paper's" if args.block_size == PAPER_BLOCK else f"not the paper's {PAPER_BLOCK}"
    print(f"  pool waste < {100 * GOAL_WASTE:.0f} % (continuous, {args.block_size}-token blocks, {paper}): "
          f"{_verdict(cont['pool_waste'] < GOAL_WASTE)} ({100 * cont['pool_waste']:.2f} % of allocated slots; static "
          f"{100 * stat['pool_waste']:.1f} %)")


def _goals(model: Any, args: argparse.Namespace, trace: list, rows: list[dict[str, Any]],
           speedup: float) -> dict[str, Any]:
    """The issue's goals on the LLaMA-7B shape, each PASS or MISS with its figure."""
    cont, stat = rows
    prompt = round(SHAREGPT_MEAN_PROMPT)
    step = decode_step_batch1(model, args, prompt, 6)
    floor_us = weight_bytes(model) / (1.6e12) * 1e6  # the weights read once a step at the target's 1.6 TB/s
    print("goals (LLaMA-2-7B shape):")
    print(f"  continuous >= {GOAL_SPEEDUP:.0f}x static's throughput at equal pool memory: {_verdict(speedup >= GOAL_SPEEDUP)} "
          f"({speedup:.2f}x on the one clock; {stat['device_busy_us'] / cont['device_busy_us']:.2f}x in device time)")
    waste = scheduler_waste(trace, (PAPER_BLOCK,)) if args.block_size != PAPER_BLOCK else {}
    waste[args.block_size] = cont["pool_waste"]
    # judged at the paper's block size: its < 4 % is measured there, and internal fragmentation (half a block per
    # sequence) grows with the block: at 128 on ShareGPT's lengths half a block alone is ~13 % of what is held
    print(f"  pool waste < {100 * GOAL_WASTE:.0f} % (continuous) at block size {PAPER_BLOCK}, the paper's: "
          f"{_verdict(waste[PAPER_BLOCK] < GOAL_WASTE)} ({100 * waste[PAPER_BLOCK]:.2f} % of allocated slots"
          f"{'' if args.block_size == PAPER_BLOCK else ', the scheduler alone on this trace'}); at this run's "
          f"{args.block_size}: {_verdict(cont['pool_waste'] < GOAL_WASTE)} ({100 * cont['pool_waste']:.2f} % of "
          f"allocated, {100 * cont['pool_waste_of_pool']:.2f} % of the pool's; static {100 * stat['pool_waste']:.1f} %)")
    print(f"  device idle <= {100 * GOAL_IDLE:.0f} % of a batch-1 decode step, graph mode: "
          f"{_verdict(step['idle_share'] <= GOAL_IDLE)} ({step['device_idle_us']:.1f} us of {step['decode_span_us']:.0f} us, "
          f"{100 * step['idle_share']:.2f} %; prompt {prompt}, 128-slot cache)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/calibration.py, also when loaded by path
    from calibration import decode_anchors, decode_step_us

    # every measured 7B step, each beside GEIR serving its own shape (about 30 s each); the one of the family served
    # here (LLaMA) judges first, the other is judged as well: the two boards disagree (2.60x and 1.68x their weights'
    # read), so one verdict alone would hide which
    anchors = sorted(decode_anchors(), key=lambda a: a.family != SERVED_FAMILY)
    judged = []
    for anchor in anchors:
        anchor_us = decode_step_us(anchor)
        ratio = anchor_us / (anchor.measured_ms * 1e3)
        judged.append({"model": anchor.model, "measured_us": anchor.measured_ms * 1e3, "geir_us": anchor_us,
                       "ratio": ratio})
        print(f"  decode TPOT within {100 * GOAL_TPOT:.0f} % of a measured anchor "
              f"({'the served family' if anchor.family == SERVED_FAMILY else 'another family'}): "
              f"{_verdict(abs(ratio - 1) <= GOAL_TPOT)} (bench/calibration.py: {anchor.model}, {anchor.dtype}, batch "
              f"{anchor.batch}, {anchor.launch} mode on one {anchor.chip} card, {anchor.measured_ms:.1f} ms a step; GEIR "
              f"serving that shape {anchor_us / 1e3:.2f} ms attending the board's whole {anchor.attended}-position "
              f"cache, {ratio:.2f}x)")
    print(f"  this run's batch-1 TPOT {step['tpot_us'] / 1e3:.2f} ms (a cached step), "
          f"{step['tpot_us'] / floor_us:.2f}x the weights' read at 1.6 TB/s ({floor_us / 1e3:.2f} ms)")
    for row in rows:
        print(f"  {len(trace)} requests in <= {GOAL_HOST_S:.0f} s of host time ({row['policy']}): "
              f"{_verdict(row['host_s'] <= GOAL_HOST_S)} ({row['host_s']:.1f} s, export and compiles included)")
    return {"decode_batch1": step, "weights_read_us": floor_us, "pool_waste_by_block_size": waste,
            "tpot_anchor": judged[0], "tpot_anchors": judged}


if __name__ == "__main__":
    sys.exit(main())
