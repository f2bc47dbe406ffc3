"""ge.paged_attention (FusedInferAttentionScore with a block table): its semantics, tiling rules and kernel.

Oracles: torch's scaled_dot_product_attention over keys and values gathered from the pool by hand (a loop over the
table written here); the dense FlashAttention kernel run on those gathered keys with the same blocks and key parts
(bit for bit); the rules' documented conditions (Sq == 1 is the IFA branch, whole blocks per key tile, block_size x
head dim <= 128 x 128, FlashAttention-2's split heuristic counted out); the K/V bytes a tile moves counted from the
block size.
"""

from __future__ import annotations

import math

import attrs
import ml_dtypes
import numpy as np
import pytest

from geir.accuracy import compare
from geir.builder import Builder
from geir.kernels.base import LaunchContext
from geir.kernels.flash_attention import flash_attention_forward
from geir.kernels.flash_attention_tiling import FLASH_DECODE, kv_parts
from geir.kernels.paged_attention import PagedAttentionKernel
from geir.kernels.paged_attention_tiling import INCRE, PROMPT, PagedTiling, choose, ifa_kv_parts
from geir.kernels.tiling import Miss, OpSignature
from geir.ops.numerics import round_to
from geir.target_npu import load_target
from geir.target_npu.sim import PIPE_INDEX, Cores, GlobalMemory, vector_cycles
from geir.types import DType, TensorType

torch = pytest.importorskip("torch")


def pool_and_table(b, nkv, d, bs, lengths, num_blocks, dtype=np.float32, seed=0):
    """A random pool [num_blocks, bs, nkv * d] for keys and for values, and a table giving each row its own
    blocks in a scrambled order (ceil(length / bs) each, the rest of a row's entries pointing at block 0)."""
    rng = np.random.default_rng(seed)
    kc = (0.5 * rng.standard_normal((num_blocks, bs, nkv * d))).astype(dtype)
    vc = rng.standard_normal((num_blocks, bs, nkv * d)).astype(dtype)
    width = max(-(-n // bs) for n in lengths)
    free = list(rng.permutation(num_blocks))
    table = np.zeros((b, width), dtype=np.int64)
    for i, n in enumerate(lengths):
        for j in range(-(-n // bs)):
            table[i, j] = free.pop()
    return kc, vc, table


def gathered_by_hand(cache, table, nkv, d, bs):
    """[B, Nkv, width * bs, D]: key j of row b is slot j % bs of block table[b, j // bs], head h its h-th D slice."""
    b, width = table.shape
    out = np.zeros((b, nkv, width * bs, d), dtype=cache.dtype)
    for i in range(b):
        for j in range(width * bs):
            for h in range(nkv):
                out[i, h, j] = cache[table[i, j // bs], j % bs, h * d:(h + 1) * d]
    return out


def torch_attention(q, k, v, lengths, causal=False):
    """torch's SDPA in float64 with each row's keys cut at its length (GQA heads repeated)."""
    group = q.shape[1] // k.shape[1]
    qt, kt, vt = (torch.from_numpy(x.astype(np.float64)) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    keep = torch.arange(k.shape[2])[None, :] < torch.tensor(lengths)[:, None]
    mask = keep[:, None, None, :].expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if causal:  # bottom-right: the queries are the last Sq tokens of each row's keys (here: equal lengths)
        sq, skv = q.shape[2], k.shape[2]
        mask = mask & torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)
    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).numpy()


def paged_op(q, kc, vc, table, lengths, nkv, mask=None, causal=False):
    """A ge.paged_attention on arguments of these arrays' types (the op the kernel reads its attributes from)."""
    b = Builder()
    args = [b.argument(TensorType(x.shape, DType.from_numpy(x.dtype)), name)
            for x, name in ((q, "q"), (kc, "key_cache"), (vc, "value_cache"), (table, "block_table"),
                            (np.asarray(lengths, dtype=np.int64), "lengths"))]
    if mask is not None:
        args.append(b.argument(TensorType(mask.shape, DType.from_numpy(mask.dtype)), "mask"))
    op = b.create("ge.paged_attention", args, {"num_key_value_heads": nkv, "causal": causal})
    b.finish([op.result])
    return op


def run_kernel(op, inputs, tiling=None, target="ascend910b"):
    t = load_target(target)
    sig = OpSignature.of(op)
    tiling = tiling or choose(sig, t)
    assert isinstance(tiling, PagedTiling), tiling
    ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), [a.name for a in op.operands], ["o"])
    return PagedAttentionKernel().run(op, inputs, tiling, ctx)[0], tiling, ctx


CASES = {  # b, n, nkv, sq, d, bs, lengths
    "decode, GQA, ragged rows": (3, 8, 2, 1, 64, 16, [37, 5, 64]),
    "decode, long context split": (1, 4, 1, 1, 64, 128, [3000]),
    "prefill, MHA": (2, 2, 2, 24, 32, 8, [24, 24]),
}


@pytest.mark.parametrize("case", CASES)
def test_the_semantics_equal_torch_attention_over_the_blocks_gathered_by_hand(case):
    b, n, nkv, sq, d, bs, lengths = CASES[case]
    kc, vc, table = pool_and_table(b, nkv, d, bs, lengths, num_blocks=sum(-(-x // bs) for x in lengths) + 3)
    q = (0.5 * np.random.default_rng(1).standard_normal((b, n, sq, d))).astype(np.float32)
    k, v = gathered_by_hand(kc, table, nkv, d, bs), gathered_by_hand(vc, table, nkv, d, bs)
    op = paged_op(q, kc, vc, table, lengths, nkv)
    out = op.compute(q, kc, vc, table, np.asarray(lengths))
    np.testing.assert_allclose(out, torch_attention(q, k, v, lengths), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_kernel_equals_the_dense_kernel_on_the_gathered_blocks_bit_for_bit(case, dtype):
    b, n, nkv, sq, d, bs, lengths = CASES[case]
    kc, vc, table = pool_and_table(b, nkv, d, bs, lengths, sum(-(-x // bs) for x in lengths) + 3, dtype)
    q = (0.5 * np.random.default_rng(2).standard_normal((b, n, sq, d))).astype(dtype)
    op = paged_op(q, kc, vc, table, lengths, nkv)
    out, tiling, _ = run_kernel(op, [q, kc, vc, table, np.asarray(lengths)])
    k, v = gathered_by_hand(kc, table, nkv, d, bs), gathered_by_hand(vc, table, nkv, d, bs)
    keep = np.arange(k.shape[2])[None, None, None, :] < np.asarray(lengths)[:, None, None, None]
    t = load_target("ascend910b")
    ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), ["q", "k", "v", None], ["o"])
    dense = flash_attention_forward(q, k, v, np.broadcast_to(keep, (b, n, sq, k.shape[2])), False,
                                    1 / math.sqrt(d), tiling.as_flash(), ctx)
    assert out.dtype == dense.dtype and np.array_equal(out, dense)
    tol = 2e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(out.astype(np.float64), torch_attention(q, k, v, lengths), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_kernels_accuracy_passes_the_torch_compile_rule(case, dtype):
    # spec section 3 (geir.accuracy): within the dtype's tolerance of float64 (torch's SDPA over the blocks
    # gathered by hand), or no worse than the op run eagerly in its own precision
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    b, n, nkv, sq, d, bs, lengths = CASES[case]
    kc, vc, table = pool_and_table(b, nkv, d, bs, lengths, sum(-(-x // bs) for x in lengths) + 3)
    kc, vc = kc.astype(dt), vc.astype(dt)
    q = (0.5 * np.random.default_rng(3).standard_normal((b, n, sq, d))).astype(dt)
    op = paged_op(q, kc, vc, table, lengths, nkv)
    out, _, _ = run_kernel(op, [q, kc, vc, table, np.asarray(lengths)])
    k, v = gathered_by_hand(kc, table, nkv, d, bs), gathered_by_hand(vc, table, nkv, d, bs)
    eager = round_to(op.compute(q, kc, vc, table, np.asarray(lengths)), dt)
    verdict = compare(out, torch_attention(q, k, v, lengths), TensorType(out.shape, DType.from_numpy(dt)), eager)
    assert out.dtype == dt and verdict.passed, verdict.render("o")


def test_a_mask_is_applied_on_top_of_the_lengths():
    b, n, nkv, d, bs, lengths = 2, 4, 2, 32, 8, [20, 11]
    kc, vc, table = pool_and_table(b, nkv, d, bs, lengths, 8)
    q = np.random.default_rng(3).standard_normal((b, n, 1, d)).astype(np.float32)
    mask = np.ones((b, 1, 1, table.shape[1] * bs), dtype=bool)
    mask[0, ..., 3] = mask[1, ..., 0] = False
    op = paged_op(q, kc, vc, table, lengths, nkv, mask=mask)
    assert op.mask is not None and op.actual_seq_lengths_kv is not None
    out = op.compute(q, kc, vc, table, np.asarray(lengths), mask)
    k, v = gathered_by_hand(kc, table, nkv, d, bs), gathered_by_hand(vc, table, nkv, d, bs)
    keep = (np.arange(k.shape[2]) < np.asarray(lengths)[:, None])[:, None, None, :] & mask
    group = n // nkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x.astype(np.float64)) for x in (q, np.repeat(k, group, 1), np.repeat(v, group, 1))),
        attn_mask=torch.from_numpy(np.broadcast_to(keep, (b, n, 1, k.shape[2])).copy())).numpy()
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    kernel_out, _, _ = run_kernel(op, [q, kc, vc, table, np.asarray(lengths), mask])
    np.testing.assert_allclose(kernel_out, ref, rtol=2e-5, atol=2e-6)


# --- the rules ----------------------------------------------------------------------------------------

def signature(b, n, nkv, sq, d, bs, width, num_blocks=64, dtype=DType.f16):
    q = TensorType((b, n, sq, d), dtype)
    kc = TensorType((num_blocks, bs, nkv * d), dtype)
    table = TensorType((b, width), DType.i64)
    lengths = TensorType((b,), DType.i64)
    out = TensorType((b, n, sq, d), dtype)
    return OpSignature("ge.paged_attention", (q, kc, kc, table, lengths), (out,), {"num_key_value_heads": nkv})


def test_the_branch_is_ifa_for_one_query_row_and_pfa_otherwise():
    t = load_target("ascend910b")
    incre = choose(signature(4, 32, 8, 1, 128, 128, 8), t)
    prompt = choose(signature(1, 32, 8, 256, 128, 128, 2), t)
    assert incre.rule.startswith(INCRE) and prompt.rule.startswith(PROMPT)


@pytest.mark.parametrize("bs", [16, 64, 128])
def test_a_key_tile_is_whole_blocks(bs):
    tiling = choose(signature(2, 32, 8, 1, 128, bs, 4096 // bs), load_target("ascend910b"))
    assert tiling.s2 == tiling.blocks_per_tile * bs and tiling.block_size == bs and tiling.blocks_per_tile >= 1


def test_a_block_larger_than_one_cube_tile_is_refused_with_atbs_limit():
    miss = choose(signature(1, 8, 8, 1, 128, 256, 4), load_target("ascend910b"))
    assert isinstance(miss, Miss) and "128 x 128" in miss.reason


def test_long_contexts_split_the_keys_as_flash_attention_2s_heuristic_counts_off_atlas_a2():
    t = load_target("ascend910a")  # one AI core does cube and vector work: no IncreFlashAttention rule of its own
    tiling = choose(signature(1, 8, 1, 1, 128, 128, 64), t)  # 8192 keys, one K/V head: one unit before splitting
    assert tiling.template == FLASH_DECODE
    units = 1  # batch 1 x 1 K/V head x one row block of the 8 stacked query heads
    blocks = 64  # key tiles of one 128-key block each
    effs = {}
    for p in range(1, min(blocks, t.cube_cores) + 1):
        if p > 1 and math.ceil(blocks / p) == math.ceil(blocks / (p - 1)):
            continue
        waves = units * p / t.cube_cores
        effs[p] = waves / math.ceil(waves)
    expected = min(p for p, e in effs.items() if e >= 0.85 * max(effs.values()))
    assert tiling.segments == expected == kv_parts(8192, units, t.cube_cores, tiling.s2)
    assert tiling.segments > 1


@pytest.mark.parametrize("b, n, nkv, keys, parts", [
    (1, 8, 1, 8192, 16),  # 48 vector cores / 1 unit = 48 parts, fewer until each holds 512 keys: 16
    (1, 28, 4, 2048, 4),  # Qwen2-7B's heads over torchair's 2048-position cache: 12 parts, fewer to 512 keys each
    (1, 28, 4, 1920, 1),  # grouped queries under 2048 keys: no split
    (1, 32, 32, 1024, 1),  # a block table over at most 1024 keys: no split on 910B
    (1, 32, 32, 4096, 1),  # B x Nkv = 32, not under 0.4 x 48: the units fill the cores
    (2, 16, 8, 4096, 3),  # 16 units, under 19.2, groups of 2 over 4096 keys: 48 // 16 = 3 parts of 1365 keys
    (1, 8, 8, 4096, 6),  # no grouping: 48 / 8 = 6 parts of 683 keys
])
def test_on_atlas_a2_decode_splits_the_keys_as_incre_flash_attentions_rule(b, n, nkv, keys, parts):
    """IncreFlashAttention's flash-decode rule (ops-transformer's IsFlashDecode, CheckCoreOkFlag, SplitBNS), worked by
    hand: no split with a block table over at most 1024 keys; a split only while B x Nkv < 0.4 x 48 vector cores and,
    with grouped queries, over at least 2048 keys; then 48 / (B x Nkv) parts, fewer while a part holds under 512."""
    t = load_target("ascend910b")
    bs = 128
    tiling = choose(signature(b, n, nkv, 1, 128, bs, keys // bs), t)
    assert tiling.template == FLASH_DECODE
    assert ifa_kv_parts(keys, b * nkv, n // nkv, t.vector_cores) == parts
    blocks = keys // tiling.s2
    assert tiling.segments == -(-blocks // -(-blocks // parts))  # whole tiles a part, no empty part
    assert tiling.work_units == b * nkv * tiling.segments


def test_the_tiling_round_trips_through_its_attribute():
    tiling = choose(signature(2, 8, 2, 1, 64, 16, 10), load_target("ascend910b"))
    assert PagedTiling.from_attr(tiling.to_attr()) == attrs.evolve(tiling, rule="", design=None)


def test_a_tile_moves_the_bytes_of_its_blocks():
    """The K and V bytes read are whole blocks: B x Nkv x table width x block_size x D x itemsize each (flash-
    decoding stacks a group's query heads, so each K/V head's blocks are read once)."""
    b, n, nkv, d, bs, lengths = 2, 8, 2, 64, 16, [256, 200]
    kc, vc, table = pool_and_table(b, nkv, d, bs, lengths, 40, np.float16)
    q = np.random.default_rng(4).standard_normal((b, n, 1, d)).astype(np.float16)
    op = paged_op(q, kc, vc, table, lengths, nkv)
    # on a chip whose cube and vector share a core (no S and P through a GM workspace), the reads are K, V and q
    _, tiling, ctx = run_kernel(op, [q, kc, vc, table, np.asarray(lengths)], target="ascend910a")
    assert tiling.template == FLASH_DECODE and tiling.s1 == n // nkv
    kv = 2 * b * nkv * table.shape[1] * bs * d * 2  # K and V: every block of the table once, f16
    q_bytes = b * n * d * 2 * tiling.segments  # each unit's stacked query rows, once per key part
    # the log-sum-exp combine reads each part's partial rows back: O, running max and sum in f32
    partials = b * nkv * tiling.segments * tiling.s1 * (d + 2) * 4 if tiling.segments > 1 else 0
    assert ctx.gm.gm_read_bytes == kv + q_bytes + partials


# --- the pool's update in place -----------------------------------------------------------------------------

def test_an_in_place_pool_update_moves_only_the_slots_written():
    """ge.index_put with in_place: the same numbers as the copy (numpy's index assignment on a copy is the oracle),
    and the bytes moved are the slots written only (read once, written once), whatever the pool's size; without
    it, the whole pool is copied too."""
    from geir.kernels.data_movement import ScatterUpdateKernel

    slots, nkv, d = 4096, 2, 64
    pool = np.random.default_rng(5).standard_normal((slots, nkv, d)).astype(np.float16)
    values = np.random.default_rng(6).standard_normal((3, nkv, d)).astype(np.float16)
    where = np.array([7, 900, 4000])
    moved = {}
    for in_place in (False, True):
        b = Builder()
        args = [b.argument(TensorType(x.shape, DType.from_numpy(x.dtype)), n)
                for x, n in ((pool, "pool"), (values, "values"), (where, "where"))]
        op = b.create("ge.index_put", args, {"axis": 0, "in_place": in_place})
        b.finish([op.result])
        t = load_target("ascend910b")
        kernel = ScatterUpdateKernel()
        tiling = kernel.choose(OpSignature.of(op), t)
        ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), ["pool", "values", "where"], ["out"])
        out = kernel.run(op, [pool, values, where], tiling, ctx)[0]
        expected = pool.copy()
        expected[where] = values
        assert np.array_equal(out, expected)
        moved[in_place] = (ctx.gm.gm_read_bytes, ctx.gm.gm_write_bytes)
    slab = 3 * nkv * d * 2
    assert moved[True][1] == slab  # the three slots written, nothing else
    assert moved[False][1] == slab + pool.nbytes  # the pool copied into the result, then the slots


def test_an_in_place_pair_update_moves_only_the_slots_written_and_the_rule_keeps_it():
    """kv_scatter_pair merges two in-place pool updates into an in-place ge.index_put_pair (the same numbers as two
    copies; only both tensors' slots move), and refuses to merge an in-place update with a copying one."""
    from geir.kernels.data_movement import ScatterPairKernel
    from geir.passes.fusion.kv_scatter import MergeIndexPutPair
    from geir.passes.pattern import Miss

    slots, nkv, d = 1024, 2, 32
    rng = np.random.default_rng(7)
    k_pool, v_pool = (rng.standard_normal((slots, nkv, d)).astype(np.float16) for _ in range(2))
    k_new, v_new = (rng.standard_normal((2, nkv, d)).astype(np.float16) for _ in range(2))
    where = np.array([5, 700])
    for mixed in (False, True):
        b = Builder()
        kp, vp, kn, vn, w = (b.argument(TensorType(x.shape, DType.from_numpy(x.dtype)), n) for x, n in
                             ((k_pool, "k"), (v_pool, "v"), (k_new, "kn"), (v_new, "vn"), (where, "w")))
        k_put = b.create("ge.index_put", [kp, kn, w], {"axis": 0, "in_place": True})
        v_put = b.create("ge.index_put", [vp, vn, w], {"axis": 0, "in_place": not mixed})
        b.finish([k_put.result, v_put.result])
        m = MergeIndexPutPair().match(k_put)
        assert isinstance(m, Miss) == mixed
        if mixed:
            assert "copies its operand" in m.reason
    # the merged in-place pair, run by its kernel
    b = Builder()
    args = [b.argument(TensorType(x.shape, DType.from_numpy(x.dtype)), n) for x, n in
            ((k_pool, "k"), (v_pool, "v"), (k_new, "kn"), (v_new, "vn"), (where, "w"))]
    pair = b.create("ge.index_put_pair", args, {"axis": 0, "in_place": True})
    b.finish(list(pair.results))
    t = load_target("ascend910b")
    kernel = ScatterPairKernel()
    ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), ["k", "v", "kn", "vn", "w"], ["ko", "vo"])
    outs = kernel.run(pair, [k_pool, v_pool, k_new, v_new, where], kernel.choose(OpSignature.of(pair), t), ctx)
    for out, pool, new in zip(outs, (k_pool, v_pool), (k_new, v_new)):
        expected = pool.copy()
        expected[where] = new
        assert np.array_equal(out, expected)
    assert ctx.gm.gm_write_bytes == 2 * 2 * nkv * d * 2  # two slots of K and of V, nothing else


# --- serve() over the pool ---------------------------------------------------------------------------------

def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    return transformers.LlamaForCausalLM(cfg).eval()


def _two_requests():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(1, 100, (5,), generator=g), 4, 0.0), (torch.randint(1, 100, (11,), generator=g), 3, 0.0)]


def test_serve_attends_over_the_pool_with_no_regroup_and_no_gather_of_blocks():
    """Every decode step launches ge.paged_attention once per layer and no flash_attention; no gather reads the
    pool's blocks ([num_blocks, block_size, Nkv, D]); no device run rebuilds a dense cache."""
    from geir.frontends.torch import serve
    from geir.runtime.interpreter import RuntimeListener

    class Kernels(RuntimeListener):
        def __init__(self):
            self.runs: list[list[str]] = []

        def run_started(self, program):
            self.runs.append([])

        def launched(self, task, stats):
            self.runs[-1].append((task.name, tuple(t.shape for t in task.inputs)))

    seen = Kernels()
    run = serve(_tiny_llama(), _two_requests(), block_size=4, listeners=[seen])
    kinds = [s.kind for s in run.steps]
    assert "regroup" not in kinds and run.regroups == 0
    assert len(seen.runs) == len(run.steps)
    blocks = run.pool_blocks, run.block_size
    for kind, launches in zip(kinds, seen.runs):
        names = [name for name, _ in launches]
        assert not any(name == "ge.gather" and shapes[0][:2] == blocks for name, shapes in launches)
        # the K and V pools of 2 layers, written at the step's slots (a layer's K and V in one pair launch)
        assert names.count("ge.index_put") + 2 * names.count("ge.index_put_pair") == 4
        if kind == "decode":
            assert names.count("ge.paged_attention") == 2 and "ge.flash_attention" not in names


def test_a_decode_step_costs_the_same_whatever_the_pools_size():
    """The pool is read through the tables and written at the step's slots only: 8 blocks or 4096, the same
    device times, step by step (timing only: the schedule does not depend on the tokens)."""
    from geir.frontends.serve import kv_bytes_per_token
    from geir.frontends.torch import serve

    model = _tiny_llama()
    runs = [serve(model, _two_requests(), block_size=4, pool_bytes=blocks * 4 * kv_bytes_per_token(model),
                  timing_only=True) for blocks in (8, 4096)]
    assert [s.kind for s in runs[0].steps] == [s.kind for s in runs[1].steps]
    # Equal but for the L2 model's few cycles (at most 0.1 %: the gate-up matmul with its glu epilogue and add_rms_norm of a decode step
    # differ by about 0.02 us in 45 us, the pools' block bookkeeping); a pool copied or read whole each step would
    # add its 4096 blocks' bytes, hundreds of times the step's own
    for small, big in zip(runs[0].steps, runs[1].steps):
        assert big.kernel_time_us == pytest.approx(small.kernel_time_us, rel=1e-3)


# --- each row stops at its own length (FIA's actual_seq_lengths_kv, a value-depend input) --------------------------

def _tiles_read(lengths, tiling, nk):
    """Key tiles each (row, key part) unit reads when a row stops after the tiles its length spans: FlashAttention's
    parts of whole tiles (ceil(nk / parts) each), cut at ceil(length / s2)."""
    parts = max(tiling.segments, 1)
    per = -(-nk // parts)
    return [max(0, min((p + 1) * per, nk, -(-n // tiling.s2)) - p * per) for n in lengths for p in range(parts)]


@pytest.mark.parametrize("target", ["ascend910a", "ascend910b"])
def test_a_row_with_a_shorter_length_reads_only_its_own_blocks(target):
    """With the lengths known on the host (GE's value-depend input), a table as wide as the longest row costs a short
    row only its own tiles: the K and V bytes read are sum over rows of Nkv x (its tiles) x s2 x D x itemsize each,
    and its numbers are the dense kernel's over the whole table (the keys past its length masked), bit for bit."""
    b, n, nkv, d, bs = 2, 8, 2, 64, 16
    wide, lengths = [256, 256], [256, 40]
    kc, vc, table = pool_and_table(b, nkv, d, bs, wide, 40, np.float16)
    q = np.random.default_rng(5).standard_normal((b, n, 1, d)).astype(np.float16)
    op = paged_op(q, kc, vc, table, lengths, nkv)
    assert PagedAttentionKernel().value_depend(op) == (4,)
    t = load_target(target)
    tiling = choose(OpSignature.of(op), t)
    inputs = [q, kc, vc, table, np.asarray(lengths)]

    def launch(known):
        ctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), [a.name for a in op.operands], ["o"],
                            host_values=(None,) * 4 + (known,))
        return PagedAttentionKernel().run(op, inputs, tiling, ctx)[0], ctx

    full, full_ctx = launch(None)  # lengths computed on the device: every tile of the table is read
    short, ctx = launch(np.asarray(lengths))
    k, v = gathered_by_hand(kc, table, nkv, d, bs), gathered_by_hand(vc, table, nkv, d, bs)
    keep = np.arange(k.shape[2])[None, None, None, :] < np.asarray(lengths)[:, None, None, None]
    dctx = LaunchContext(t, Cores(t.cube_cores), GlobalMemory(t), ["q", "k", "v", None], ["o"])
    dense = flash_attention_forward(q, k, v, np.broadcast_to(keep, (b, n, 1, k.shape[2])), False, 1 / math.sqrt(d),
                                    tiling.as_flash(), dctx)
    assert np.array_equal(short, dense) and np.array_equal(full, dense)
    nk = table.shape[1] * bs // tiling.s2
    tiles = _tiles_read(lengths, tiling, nk)
    assert sum(tiles) < sum(_tiles_read(wide, tiling, nk))  # the short row's tail is a real saving
    if target == "ascend910a":  # the on-chip schedule: the reads are K, V, q and the parts' partials
        kv = 2 * nkv * sum(tiles) * tiling.s2 * d * 2
        q_bytes = b * n * d * 2 * tiling.segments
        # the combine reads a row's partials of the parts that hold its keys, ceil(its tiles / a part's tiles) of
        # them (IncreFlashAttention's actualCombineLoopSize): the short row's fewer
        per = -(-nk // max(tiling.segments, 1))
        spanned = [-(-min(-(-n // tiling.s2), nk) // per) for n in lengths]
        assert tiling.segments > 1 and spanned[1] < spanned[0]  # the case this checks
        partials = nkv * sum(spanned) * tiling.s1 * (d + 2) * 4
        assert ctx.gm.gm_read_bytes == kv + q_bytes + partials
    else:  # the CV split adds its GM workspace traffic; K and V are still only the tiles read
        assert ctx.gm.gm_read_bytes < full_ctx.gm.gm_read_bytes
    # the cube's work is per tile read (the two matmuls of each): it shrinks as the tiles do
    cube = lambda c: c.cores.busy[PIPE_INDEX["CUBE"]].sum()  # noqa: E731
    assert cube(ctx) / cube(full_ctx) == pytest.approx(sum(tiles) / sum(_tiles_read(wide, tiling, nk)))


def test_the_flash_decoding_combine_reads_only_the_parts_a_row_spans():
    """On Atlas A2, IncreFlashAttention's combine of a (batch, K/V head) reads and reduces the partials of
    actualCombineLoopSize = ceil(length / part) key parts, not the split's every part: a row whose length ends in
    the first part combines one partial. Checked on the CV schedule's recorded instructions: the combine's vector
    work per unit is the target's vector cost of its spanned parts' rows, and its partial loads move their bytes."""
    b, n, nkv, d, bs = 2, 8, 2, 64, 128
    wide, lengths = [4096, 4096], [4096, 400]
    kc, vc, table = pool_and_table(b, nkv, d, bs, wide, 70, np.float16)
    q = np.random.default_rng(6).standard_normal((b, n, 1, d)).astype(np.float16)
    op = paged_op(q, kc, vc, table, lengths, nkv)
    t = load_target("ascend910b")
    tiling = choose(OpSignature.of(op), t)
    assert tiling.segments > 1  # B x Nkv = 4 units for 48 vector cores over 4096 keys: IFA splits them
    ctx = LaunchContext(t, Cores(t.cube_cores, record=True), GlobalMemory(t), [a.name for a in op.operands], ["o"],
                        host_values=(None,) * 4 + (np.asarray(lengths),))
    PagedAttentionKernel().run(op, [q, kc, vc, table, np.asarray(lengths)], tiling, ctx)
    part_keys = -(-(table.shape[1] * bs // tiling.s2) // tiling.segments) * tiling.s2
    spanned = [-(-length // part_keys) for length in lengths for _ in range(nkv)]  # per (row, K/V head)
    assert spanned[0] == tiling.segments and spanned[-1] == 1
    rows = n // nkv  # a unit's rows: its group's query heads
    combine = [iv for iv in ctx.cores.intervals if iv.name == "combine segments"]
    got = sorted(float(e - s_) for iv in combine for s_, e in zip(np.atleast_1d(iv.start), np.atleast_1d(iv.end)))
    want = sorted(vector_cycles(t, k * rows * d * 4, 3) for k in spanned)
    assert got == pytest.approx(want)
    loads = [iv for iv in ctx.cores.intervals if iv.name == "load partials"]
    assert sum(np.size(iv.cores) for iv in loads) == b * nkv


def test_the_launch_memo_keys_a_paged_launch_by_the_tiles_its_rows_read():
    """Timing-only runs replay a launch timed before when its timing reads the same: for the lengths, the tiles
    ceil(length / s2) each row spans, so lengths within the same tiles share a key and others do not."""
    b, n, nkv, d, bs = 2, 8, 2, 64, 16
    kc, vc, table = pool_and_table(b, nkv, d, bs, [256, 256], 40, np.float16)
    q = np.zeros((b, n, 1, d), np.float16)
    op = paged_op(q, kc, vc, table, [1, 1], nkv)
    tiling = choose(OpSignature.of(op), load_target("ascend910b"))
    kernel = PagedAttentionKernel()
    key = lambda lengths: kernel.timing_values(tiling, (None,) * 4 + (np.asarray(lengths),))  # noqa: E731
    s2 = tiling.s2
    assert key([1, s2]) == key([s2, 2]) == (1, 1)
    assert key([s2 + 1, 5]) == (2, 1) != key([s2, 5])


# --- the pools' L2 residency -----------------------------------------------------------------------------------

def _update_then_attend(gm, t, k_pool, v_pool, table, lengths, q, others: int, again: bool = False):
    """On one chip: `others` bytes of other data read (a layer's weights), then each pool updated in place at one
    slot (ge.index_put_pair, its results at offsets of their own that a small tensor held just before, as an arena
    reuses them), then paged attention over the results (`again`: twice in a row). The attention launches' HBM
    read bytes."""
    from geir.kernels.data_movement import ScatterPairKernel
    from geir.kernels.paged_attention_tiling import choose as choose_paged

    nkv, d = 2, k_pool.shape[2] // 2
    new = np.zeros((1, nkv, d), np.float16)
    b = Builder()
    args = [b.argument(TensorType(x.shape, DType.from_numpy(x.dtype)), n) for x, n in
            ((k_pool.reshape(-1, nkv, d), "k"), (v_pool.reshape(-1, nkv, d), "v"), (new, "kn"), (new, "vn"),
             (np.array([5]), "w"))]
    pair = b.create("ge.index_put_pair", args, {"axis": 0, "in_place": True})
    b.finish(list(pair.results))
    if others:  # other tensors streaming through the L2 (a layer's weights)
        gm.tensor("weights", -(-others // 512))
        gm.read_pieces("weights", np.arange(-(-others // 512))[None, :], np.full((1, -(-others // 512)), 512))
    cores = Cores(t.cube_cores)
    for name in ("ko", "vo"):  # what the results' offsets held before: a few blocks, just written
        gm.tensor(name, 16, resident=True)
    kernel = ScatterPairKernel()
    ctx = LaunchContext(t, cores, gm, ["k", "v", "kn", "vn", "w"], ["ko", "vo"])
    kernel.run(pair, [k_pool.reshape(-1, nkv, d), v_pool.reshape(-1, nkv, d), new, new, np.array([5])],
               kernel.choose(OpSignature.of(pair), t), ctx)
    gm.tensor_clock["q"] = gm.clock  # the query was just written: only K and V can miss
    op = paged_op(q, k_pool, v_pool, table, lengths, nkv)
    tiling = choose_paged(OpSignature.of(op), t)
    reads = []
    for _ in range(2 if again else 1):
        before = gm.hbm_read_bytes
        attend = LaunchContext(t, cores, gm, ["q", "ko", "vo", "table", "lengths"], ["o"])
        PagedAttentionKernel().run(op, [q, k_pool, v_pool, table, np.asarray(lengths)], tiling, attend)
        reads.append(gm.hbm_read_bytes - before)
    return reads


@pytest.mark.parametrize("written_long_ago", [False, True])
def test_a_pool_read_after_more_than_the_l2_of_other_data_comes_from_hbm_and_back_to_back_from_l2(written_long_ago):
    """The K/V a paged attention reads through its table come from HBM when more than the L2's capacity of other
    bytes moved since they were last touched (an LRU cache's reuse distance), whatever one slot the step just wrote
    (at most those bytes hit); read again at once, they come from the L2. A pool that was never touched is cold.
    The in-place update's results start from their pools' residency, not from what their offsets held before."""
    t = load_target("ascend910a")
    b, nkv, d, bs, lengths = 1, 2, 64, 16, [1024]
    k_pool, v_pool, table = pool_and_table(b, nkv, d, bs, lengths, 96, np.float16)
    q = np.random.default_rng(8).standard_normal((b, 2 * nkv, 1, d)).astype(np.float16)
    kv = 2 * b * nkv * table.shape[1] * bs * d * 2  # K and V of every block the table names, f16
    slot = 2 * nkv * d * 2  # the one slot written just before, K and V
    gm = GlobalMemory(t)
    if written_long_ago:  # the whole pools written (a prefill), then more than the L2 of other bytes
        for name, pool in (("k", k_pool), ("v", v_pool)):
            blocks = pool.nbytes // 512
            gm.tensor(name, blocks)
            gm.write_pieces(name, np.arange(blocks)[None, :], np.full((1, blocks), 512))
    first, second = _update_then_attend(gm, t, k_pool, v_pool, table, lengths, q, 2 * gm.l2_bytes, again=True)
    assert kv - slot <= first <= kv
    assert second == 0


def test_a_pool_written_just_before_is_read_from_the_l2():
    """Pools the step wrote whole (a prefill's slots), less than the L2's capacity ago: its attention hits."""
    t = load_target("ascend910a")
    b, nkv, d, bs, lengths = 1, 2, 64, 16, [1024]
    k_pool, v_pool, table = pool_and_table(b, nkv, d, bs, lengths, 96, np.float16)
    q = np.random.default_rng(8).standard_normal((b, 2 * nkv, 1, d)).astype(np.float16)
    gm = GlobalMemory(t)
    for name, pool in (("k", k_pool), ("v", v_pool)):
        blocks = pool.nbytes // 512
        gm.tensor(name, blocks)
        gm.write_pieces(name, np.arange(blocks)[None, :], np.full((1, blocks), 512))
    assert _update_then_attend(gm, t, k_pool, v_pool, table, lengths, q, 0) == [0]
