"""The KV cache's update as a scatter kernel on the AI Core (issue 28 item 1): `ge.index_put` through one index
tensor, as ops-transformer's ScatterUpdate, instead of the AI CPU.

Oracles: numpy's own indexed assignment for the numbers, and an analytic count of the bytes a scatter that
does not share the operand's memory moves (the operand once each way, each written slab once each way).
"""

from __future__ import annotations

import numpy as np
import pytest

from geir.parser import parse
from geir.session import compile_module, run_program


def _run(cache_shape, values_shape, index, axis: int, dtype: str = "f16"):
    np_dt = {"f16": np.float16, "f32": np.float32}[dtype]
    t = lambda s: f"tensor<{'x'.join(map(str, s))}x{dtype}>"  # noqa: E731
    text = (f"ge.graph @main(%x: {t(cache_shape)}, %v: {t(values_shape)}, %i: tensor<{len(index)}xi64>) -> "
            f"{t(cache_shape)} {{\n  %y = ge.index_put %x, %v, %i {{axis = {axis}}}\n  ge.return %y\n}}\n")
    program = compile_module(parse(text, "<scatter>"))[0].graphs[0]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(cache_shape).astype(np_dt)
    v = rng.standard_normal(values_shape).astype(np_dt)
    i = np.asarray(index, dtype=np.int64)
    result = run_program(program, {"x": x, "v": v, "i": i})
    want = x.copy()
    want[(slice(None),) * axis + (i,)] = v  # numpy: a duplicate index keeps the last value written
    (kernel,) = result.kernels
    return np.asarray(result.outputs[0]), want, kernel, x, v


@pytest.mark.parametrize("index", [[5, 6, 7], [7], [3, -1, 0], [2, 9, 2]],
                         ids=["a step's tokens", "one token", "scattered, negative", "a duplicate"])
def test_the_scatter_is_numpy_s_indexed_assignment(index):
    out, want, kernel, _, _ = _run((2, 4, 16, 8), (2, 4, len(index), 8), index, axis=2)
    assert kernel.engine == "aicore" and kernel.tiling.template == "ScatterUpdate"
    np.testing.assert_array_equal(out, want)


def test_values_broadcast_over_the_indexed_slabs():
    out, want, _, _, _ = _run((6, 16), (1, 16), [4, 0], axis=0, dtype="f32")
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("index", [[5, 6, 7], [1, 9]], ids=["one run", "two runs"])
def test_the_scatter_moves_the_operand_once_and_each_slab_once(index):
    out, _, kernel, x, v = _run((1, 2, 64, 16), (1, 2, len(index), 16), index, axis=2)
    assert kernel.gm_read_bytes == x.nbytes + v.nbytes
    assert kernel.gm_write_bytes == x.nbytes + v.nbytes


def test_generate_s_cache_updates_run_on_the_ai_core():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from geir.frontends.generate import generate
    from geir.runtime.interpreter import RuntimeListener

    class Updates(RuntimeListener):
        def __init__(self):
            self.engines: list[str] = []
            self.names: list[str] = []

        def launched(self, task, stats) -> None:  # one engine per cache written (a pair writes K's and V's)
            if stats.name in ("ge.index_put", "ge.index_put_pair"):
                self.engines += [stats.engine] * (2 if stats.name == "ge.index_put_pair" else 1)
            self.names.append(stats.name)

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    updates = Updates()
    steps = 3
    run = generate(model, ids, steps, listeners=[updates])
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=steps, do_sample=False)
    assert torch.equal(run.tokens, want)
    # each step writes keys and values of every layer: all on the AI Core
    assert updates.engines == ["aicore"] * (2 * cfg.num_hidden_layers * steps)
    # K and V at the same slots: one ReshapeAndCache-like launch per layer and step (kv_scatter_pair)
    assert updates.names.count("ge.index_put_pair") == cfg.num_hidden_layers * steps
    assert "ge.index_put" not in updates.names


@pytest.mark.parametrize("index", [[5, 6, 7], [3, -1, 0]], ids=["a step's tokens", "scattered, negative"])
def test_k_and_v_updates_at_the_same_slots_are_one_launch_of_both_assignments(index):
    """Two index_puts through one index tensor fuse into one ge.index_put_pair launch (kv_scatter_pair); each result
    is numpy's indexed assignment, and the launch moves each cache and each slab once, as the two would."""
    t = lambda s: f"tensor<{'x'.join(map(str, s))}xf16>"  # noqa: E731
    cache, slab = (1, 2, 16, 8), (1, 2, len(index), 8)
    text = (f"ge.graph @main(%k: {t(cache)}, %v: {t(cache)}, %a: {t(slab)}, %b: {t(slab)}, %i: tensor<{len(index)}xi64>) "
            f"-> ({t(cache)}, {t(cache)}) {{\n  %kc = ge.index_put %k, %a, %i {{axis = 2}}\n"
            f"  %vc = ge.index_put %v, %b, %i {{axis = 2}}\n  ge.return %kc, %vc\n}}\n")
    program = compile_module(parse(text, "<kv>"))[0].graphs[0]
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal(cache).astype(np.float16) for _ in range(2))
    a, b = (rng.standard_normal(slab).astype(np.float16) for _ in range(2))
    i = np.asarray(index, dtype=np.int64)
    result = run_program(program, {"k": k, "v": v, "a": a, "b": b, "i": i})
    (kernel,) = result.kernels
    assert kernel.name == "ge.index_put_pair" and kernel.engine == "aicore"
    for out, x, slabs in zip(result.outputs, (k, v), (a, b)):
        want = x.copy()
        want[:, :, i] = slabs
        np.testing.assert_array_equal(np.asarray(out), want)
    moved = k.nbytes + v.nbytes + a.nbytes + b.nbytes
    assert kernel.gm_read_bytes == moved and kernel.gm_write_bytes == moved


def test_values_of_a_run_time_size_update_an_index_tensor_of_a_known_length():
    """A batch-1 gear binds the slots' length to 1 while the values' reshape keeps its `?`: the shape rule lets the
    run-time size stand (as broadcasting would resolve it), and refuses sizes that can never fit."""
    from geir.builder import create_op
    from geir.opdef import ShapeError
    from geir.types import DType, TensorType

    put = create_op("ge.index_put", [], [], {"axis": 0})
    cache, slots = TensorType((64, 4, 8), DType.f16), TensorType((1,), DType.i64)
    assert put.infer(cache, TensorType((None, 4, 8), DType.f16), slots) == cache
    assert put.infer(cache, TensorType((1, 4, 8), DType.f16), slots) == cache
    with pytest.raises(ShapeError, match="do not broadcast"):
        put.infer(cache, TensorType((2, 4, 8), DType.f16), slots)
    with pytest.raises(ShapeError, match="do not broadcast"):
        put.infer(cache, TensorType((None, 4, 9), DType.f16), slots)
