"""bench/serve.py's LLaMA-7B shape, timing only: stand-in weights that hold no bytes, and serving figures checked
against analytic counts (weight and KV bytes from the config, blocks = ceil(tokens / block_size), the HBM floor)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from geir.frontends.serve import kv_bytes_per_token  # noqa: E402
from geir.frontends.torch import compile, from_module, serve  # noqa: E402
from geir.passes.fusion.qkv import _concatenate  # noqa: E402

H, HEADS, MLP, VOCAB, HEAD_DIM = 4096, 32, 11008, 32000, 128
HBM_BYTES_PER_US = 1.6e6  # ascend910b's cited 1.6 TB/s


def _bench():
    spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parent.parent / "bench" / "serve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_broadcast_parameter_imports_as_a_broadcast_resource_with_its_values():
    lin = torch.nn.Linear(64, 96, bias=False)
    lin.weight = torch.nn.Parameter(torch.full((), 0.25).expand(96, 64), requires_grad=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    module = from_module(lin, (x,))
    (array,) = module.resources.values()
    assert array.shape == (96, 64) and not any(array.strides) and float(array.flat[0]) == 0.25
    np.testing.assert_allclose(compile(lin, (x,))(x).numpy(), (x @ torch.full((64, 96), 0.25)).numpy(), rtol=1e-5)


def test_concatenating_broadcast_weights_keeps_a_broadcast_and_real_ones_concatenate():
    a = np.broadcast_to(np.float16(0.5), (4, 3))
    b = np.broadcast_to(np.float16(0.5), (2, 3))
    out = _concatenate([a, b], axis=0)
    assert out.shape == (6, 3) and not any(out.strides)
    np.testing.assert_array_equal(out, np.concatenate([np.asarray(a), np.asarray(b)]))
    c = np.broadcast_to(np.float16(1.0), (2, 3))  # a different element: the real concatenation
    np.testing.assert_array_equal(_concatenate([a, c], axis=0), np.concatenate([np.array(a), np.array(c)]))


def test_the_sharegpt_trace_has_the_stated_means_and_bounds():
    bench = _bench()
    trace = bench.sharegpt_trace(4000, 0.02, VOCAB, 1)
    prompts = [len(p) for p, _, _ in trace]
    outputs = [n for _, n, _ in trace]
    assert min(prompts) >= 4 and max(prompts) <= 2048 and min(outputs) >= 1 and max(outputs) <= 1024
    # the log-normals' means are the vLLM paper's (161 and 338); clipping the tails takes a few percent off
    assert 0.88 * 161.31 < sum(prompts) / len(prompts) < 1.05 * 161.31
    assert 0.88 * 337.99 < sum(outputs) / len(outputs) < 1.05 * 337.99
    assert 40 < trace[-1][2] / 1e3 / 3999 < 60  # Poisson arrivals at 0.02 per ms: 50 ms apart on average


def test_the_7b_stand_in_serves_a_few_requests_with_analytic_pool_and_byte_counts():
    bench = _bench()
    model = bench.stand_in_llama(layers=1)
    # no weight bytes on the host: every parameter is one element broadcast
    assert sum(p.untyped_storage().nbytes() for p in model.parameters()) <= 2 * len(list(model.parameters()))
    layer = 4 * H * H + 3 * H * MLP + 2 * H  # q, k, v, o; gate, up, down; two norms
    assert bench.weight_bytes(model) == 2 * (2 * VOCAB * H + layer + H)
    per_token = kv_bytes_per_token(model)
    assert per_token == 2 * 1 * HEADS * HEAD_DIM * 2  # keys and values, 1 layer, 32 KV heads, head dim 128, f16

    prompts, news = [130, 40, 128], [3, 2, 4]
    requests = [(torch.arange(1, p + 1), n, 0.0) for p, n in zip(prompts, news)]
    run = serve(model, requests, block_size=128, timing_only=True)
    blocks = sum(math.ceil((p + n - 1) / 128) for p, n in zip(prompts, news))  # each at its longest
    assert run.pool_blocks == blocks and run.pool_bytes == blocks * 128 * per_token
    assert [r.new_tokens for r in run.requests] == news
    assert all(r.tokens[r.prompt_length:].tolist() == [-1] * r.new_tokens for r in run.requests)
    # every request arrived at 0 and fits: one batched prefill runs first (a batch of 4 rows over the longest
    # prompt's 2 blocks: 1024 tokens, within vLLM's 2048), adding every prompt's blocks
    prefills = [s for s in run.steps if s.kind == "prefill"]
    assert [(s.requests, s.batch, s.slots) for s in prefills] == [((0, 1, 2), 4, 256)]
    assert prefills[0].pool_used_blocks == sum(math.ceil(p / 128) for p in prompts)
    assert prefills[0].pool_token_slots == sum(prompts)
    assert prefills[0].pool_allocated_slots == 128 * prefills[0].pool_used_blocks
    # a decode step reads every weight matrix at least once (the embedding is a gather of a few rows): HBM floor
    floor_us = 2 * (layer - 2 * H + VOCAB * H) / HBM_BYTES_PER_US
    decodes = [s for s in run.steps if s.kind == "decode"]
    assert decodes and all(s.kernel_time_us >= floor_us for s in decodes)
    waste = sum(s.pool_allocated_slots - s.pool_token_slots for s in run.steps)
    assert run.pool_waste == pytest.approx(waste / sum(s.pool_allocated_slots for s in run.steps))


def test_the_batch1_graph_decode_step_lines_up_its_runs_and_reads_its_weights():
    # bench/serve.py's idle and TPOT goals: one request in graph mode, each step one Runtime run; a cached decode
    # step spans at least the weight matrices' read at the HBM rate, and its idle time lies within its span
    bench = _bench()
    model = bench.stand_in_llama(layers=1)
    args = bench.argparse.Namespace(block_size=128)
    step = bench.decode_step_batch1(model, args, prompt=20, new=3)
    layer = 4 * H * H + 3 * H * MLP + 2 * H
    floor_us = 2 * (layer - 2 * H + VOCAB * H) / HBM_BYTES_PER_US
    assert step["decode_span_us"] >= floor_us
    assert 0 <= step["device_idle_us"] <= step["decode_span_us"] and step["tpot_us"] == step["decode_span_us"]
