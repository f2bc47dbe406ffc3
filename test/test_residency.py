"""A large tensor's L2 residency kept as runs (geir.target_npu.residency) reads and writes as the per-block array
does, to the bit, and holds host memory by what was touched, not by the tensor's size.

Oracles: a plain numpy array put through the same reads and writes (numpy's own fancy indexing, the last of
duplicate ids winning); the same timing-only runs with every tensor's residency an array; and the bytes a dense
residency would take (8 per 512-byte block)."""

from __future__ import annotations

import importlib.util
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import geir.target_npu.residency as residency_module
from geir.parser import parse
from geir.runtime.interpreter import Runtime
from geir.runtime.op_summary import op_summary_rows
from geir.runtime.profile import profile
from geir.session import DEFAULT_PIPELINE, compile_module
from geir.target_npu import load_target
from geir.target_npu.residency import SparseResidency, covered, resampled

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("seed", range(6))
def test_runs_read_and_write_as_the_array_does(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5000))
    dense = np.full(n, -np.inf)
    runs = SparseResidency(n, -np.inf)
    for step in range(200):
        k = int(rng.integers(0, 40))
        if rng.random() < 0.5:  # a contiguous range, as a tile or a token's rows are
            lo = int(rng.integers(0, n))
            idx = np.arange(lo, min(n, lo + k))
        else:  # scattered ids, duplicates included, in any shape
            idx = rng.integers(0, n, size=(k, 2))
        vals = float(step) if rng.random() < 0.5 else rng.integers(0, 8, size=idx.shape).astype(np.float64)
        dense[idx] = vals
        runs[idx] = vals
        probe = rng.integers(0, n, size=(7, 3))
        np.testing.assert_array_equal(runs[probe], dense[probe])
        assert runs[int(probe[0, 0])] == dense[probe[0, 0]]
    np.testing.assert_array_equal(np.asarray(runs), dense)
    assert len(runs) == n and runs.copy().tolist() == dense.tolist()
    # canonical: as few runs as the array has changes of value
    assert runs.runs == 1 + int(np.count_nonzero(dense[1:] != dense[:-1]))
    # the launch memo's relative form: the same subtraction per block, and back
    np.testing.assert_array_equal(np.asarray(1000 - runs), 1000 - dense)
    np.testing.assert_array_equal(np.asarray((1000 - runs).absolute(1000)), dense)


@pytest.mark.parametrize("size,n", [(1, 7), (5, 5), (37, 100), (1000, 4096), (3, 2_000_000)])
def test_resampling_onto_a_larger_grid_takes_the_array_formula(size, n):
    rng = np.random.default_rng(size)
    last = rng.integers(0, 4, size).astype(np.float64)
    want = last[(np.arange(n) * size) // n]  # gm_tensor's formula, block by block
    got = resampled(last, n)
    np.testing.assert_array_equal(np.asarray(got), want)
    runs = SparseResidency(size, 0.0)
    runs[np.arange(size)] = last
    np.testing.assert_array_equal(np.asarray(resampled(runs, n)), want)


@pytest.mark.parametrize("size,n", [(1, 7), (5, 5), (37, 100), (100, 37), (4096, 1000), (64, 3), (3, 2_000_000),
                                    (2_000_000, 700)])
def test_a_grid_covering_the_same_bytes_takes_the_oldest_touch_of_the_blocks_it_covers(size, n):
    """covered: new block j spans old blocks [floor(j size / n), ceil((j + 1) size / n)) and takes their minimum
    (served from L2 only if every byte of it is), block by block as a loop over the ranges computes it."""
    rng = np.random.default_rng(size + n)
    last = np.where(rng.random(size) < 0.3, -np.inf, rng.integers(0, 9, size).astype(np.float64))
    if size > 100_000:  # a few runs over a large tensor, as a pool's residency is
        widths = [size // 3, 5, size // 3, 11, size - 2 * (size // 3) - 16]
        last = np.repeat(np.array([-np.inf, 4.0, 2.0, -np.inf, 7.0]), widths)
    lo = (np.arange(n) * size) // n
    hi = np.maximum(lo + 1, -(-((np.arange(n) + 1) * size) // n))
    if n <= 100_000:
        want = np.array([last[a:b].min() for a, b in zip(lo, hi)])
    else:  # each new block lies inside one old block or on a boundary between two
        want = np.minimum(last[lo], last[np.minimum(hi, size) - 1])
    np.testing.assert_array_equal(np.asarray(covered(last, n)), want)
    runs = SparseResidency(size, 0.0)
    runs[np.arange(size)] = last
    np.testing.assert_array_equal(np.asarray(covered(runs, n)), want)


def _figures(result) -> str:
    tasks = [(t.kind, t.name, t.start_us, t.end_us) for t in result.tasks]
    counters = (result.gm.gm_read_bytes, result.gm.gm_write_bytes, result.gm.hbm_read_bytes,
                result.gm.hbm_write_bytes, result.gm.clock)
    return json.dumps([profile(result), tasks, counters, op_summary_rows(result)], sort_keys=True, default=str)


def _make_model():
    spec = importlib.util.spec_from_file_location("make_model", EXAMPLES / "make_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("config", [dict(layers=2, hidden=256, heads=4, seq=128, mlp=1024, dtype="f16"),
                                    dict(layers=2, hidden=256, heads=2, seq=1, mlp=512, dtype="f16", decode=512)],
                         ids=["prefill", "decode"])
@pytest.mark.parametrize("memo", [True, False], ids=["memo", "every launch timed"])
def test_a_run_with_every_residency_in_runs_times_what_arrays_time(config, memo, monkeypatch):
    text = _make_model().model_text(**config)
    program = compile_module(parse(text, "model.geir"), DEFAULT_PIPELINE, "ascend910b")[0].graphs[0]
    target = load_target("ascend910b")
    dense = Runtime(target, timing_only=True, memo=memo).run(program, {}, {})
    assert not any(isinstance(v, SparseResidency) for v in dense.gm.last_touch.values())
    monkeypatch.setattr(residency_module, "SPARSE_FROM", 0)  # every tensor, however small, keeps runs
    runs = Runtime(target, timing_only=True, memo=memo).run(program, {}, {})
    assert all(isinstance(v, SparseResidency) for v in runs.gm.last_touch.values())
    assert _figures(runs) == _figures(dense)
    assert runs.replayed == dense.replayed


def test_a_serving_run_over_a_60_gb_pool_holds_host_memory_by_what_it_touches():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from geir.frontends.torch import serve

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    requests = [([1, 2, 3, 4, 5], 3, 0.0)]

    def peak(pool_bytes: int) -> tuple[int, object]:
        tracemalloc.start()
        try:
            run = serve(model, requests, block_size=16, pool_bytes=pool_bytes, timing_only=True)
            return tracemalloc.get_traced_memory()[1], run
        finally:
            tracemalloc.stop()

    small, _ = peak(16 << 20)
    large, run = peak(60 << 30)
    assert run.pool_bytes > 59 << 30
    # a dense residency: 8 bytes per 512-byte block of the pools, 0.9 GB here; the run touches 8 tokens' rows of
    # 512 bytes (2 layers x K, V x 2 KV heads x 16 dims x f32): a few runs of 16 bytes each, well under 1 MiB
    dense = 8 * run.pool_bytes // 512
    assert large - small < (1 << 20) < dense // 100, (large, small, dense)
