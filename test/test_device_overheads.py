"""The costs of running kernels on the board that no pipe's work accounts for (issue 25): the launch head (catlass's
empty-kernel TaskDuration, in proportion to the cores started), the HBM floor of a launch, the cross-core
synchronisation of a CV-split kernel and the dispatch of its work units (pto-isa's fa_cost_model.py), and
flash-decoding on the CV-split path of Atlas A2.

Each cost is checked against its formula: the same launch on a what-if chip without the cost, plus the formula's
cycles, where nothing else can hide it.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from geir.kernels import KERNELS, LaunchContext
from geir.kernels.base import measure
from geir.kernels.flash_attention import flash_attention_forward
from geir.kernels.tiling import OpSignature
from geir.runtime.single_launch import op_of, time_launch, time_warm_launch
from geir.target_npu import load_target
from geir.target_npu.sim import PIPE_INDEX, Cores, GlobalMemory
from geir.types import DType, TensorType

from helpers.attention import attention_inputs

B910 = load_target("ascend910b")
NO_HEAD = load_target("ascend910b[overhead.head_full_chip_us=0]")
F16 = DType("f16")


def _sig(name: str, operands: list[tuple[int, ...]], result: tuple[int, ...], **attributes) -> OpSignature:
    return OpSignature(name, tuple(TensorType(s, F16) for s in operands), (TensorType(result, F16),), attributes)


def _stats(sig: OpSignature, target, record: bool = False, **fields):
    """One launch of the rule's tiling (with `fields` changed) on an idle chip (in a frame from cycle 0), with its
    intervals when recorded."""
    kernel = KERNELS[sig.name]
    tiling = attrs.evolve(kernel.choose(sig, target), **fields)
    if not record:
        return time_launch(sig, tiling, target), None
    op = op_of(sig)
    ctx = LaunchContext(target, Cores(target.cube_cores, record=True), GlobalMemory(target),
                        [f"arg{i}" for i in range(len(op.operands))], ["out0"], compute=False)
    args = [np.broadcast_to(np.zeros((), t.dtype.np), t.shape) for t in sig.operands]
    _, stats = measure(ctx, sig.name, tiling, 0.0, lambda: kernel.run(op, args, tiling, ctx))
    return stats, ctx.cores


def _head_by_hand(started: int) -> float:
    """catlass's 20.5 us for every core (24 AIC + 48 AIV), in proportion to the cores started, in cycles at 1.85 GHz."""
    return 20.5e-6 * 1.85e9 * started / 72


@pytest.mark.parametrize("what, sig, started, fields", [
    ("a cube-only matmul on 24 AIC", _sig("ge.matmul", [(2048, 2048), (2048, 2048)], (2048, 2048)), 24, {}),
    ("an add on the 48 AIV", _sig("ge.add", [(4096, 4096), (4096, 4096)], (4096, 4096)), 48, {}),
    ("an add of 8 tiles: 8 AIV", _sig("ge.add", [(16, 16), (16, 16)], (16, 16)), 8, {"elems": 32}),
    ("a CV-split FlashAttention of 64 units on 24 AIC and 48 AIV",
     _sig("ge.flash_attention", [(1, 8, 1024, 128)] * 3, (1, 8, 1024, 128)), 72, {}),
    ("a CV-split FlashAttention of 16 units on 16 AIC and their 32 AIV",
     _sig("ge.flash_attention", [(1, 2, 1024, 128)] * 3, (1, 2, 1024, 128)), 48, {}),
])
def test_the_head_is_catlass_full_chip_figure_in_proportion_to_the_cores_started(what, sig, started, fields):
    with_head, _ = _stats(sig, B910, **fields)
    without, _ = _stats(sig, NO_HEAD, **fields)
    assert with_head.head == pytest.approx(_head_by_hand(started), rel=1e-12), what
    assert with_head.cycles == pytest.approx(without.cycles + _head_by_hand(started), rel=1e-12), what
    assert without.head == 0


def test_no_instruction_starts_before_the_head_and_the_trace_shows_it():
    sig = _sig("ge.matmul", [(1024, 1024), (1024, 1024)], (1024, 1024))
    stats, cores = _stats(sig, B910, record=True)
    heads = [i for i in cores.intervals if i.name == "head"]
    assert len(heads) == 1 and heads[0].pipe == PIPE_INDEX["SCALAR"]
    assert np.all(heads[0].end == pytest.approx(stats.head))
    assert min(float(np.min(i.start)) for i in cores.intervals if i.name != "head") >= stats.head


def test_a_chip_without_a_measured_head_has_none():
    sig = _sig("ge.matmul", [(512, 512), (512, 512)], (512, 512))
    assert _stats(sig, load_target("ascend910a"))[0].head == 0  # no public figure for the 910A: not modelled


def test_an_add_larger_than_the_l2_ends_no_sooner_than_its_bytes_pass_hbm():
    # asc-devkit's add_high_performance shape: 2 x 128 MiB read, 128 MiB written; 384 MiB touched through a
    # 192 MiB L2, so the whole result is written back to HBM during the launch
    sig = _sig("ge.add", [(8192, 8192), (8192, 8192)], (8192, 8192))
    stats, _ = _stats(sig, B910)
    assert KERNELS["ge.add"].choose(sig, B910).cores == 48
    written_back = 8192 * 8192 * 2  # at least 384 - 192 MiB must leave the L2: all of the 128 MiB result
    floor = (stats.hbm_read_bytes + written_back) / 1.6e12 * 1.85e9
    assert stats.hbm_read_bytes > 0.9 * 2 * 8192 * 8192 * 2  # what missed the L2 (the operands start in HBM)
    assert stats.hbm_wait > 0
    assert stats.cycles == pytest.approx(stats.head + floor, rel=1e-9)


def test_a_launch_whose_bytes_stay_in_the_l2_is_not_held_by_the_floor():
    sig = _sig("ge.add", [(2048, 2048), (2048, 2048)], (2048, 2048))  # 24 MiB touched
    stats, _ = _stats(sig, B910)
    assert stats.hbm_wait == 0


def test_a_warm_launch_finds_in_the_l2_what_the_call_before_it_left():
    """A benchmark loop's steady state: the same attention again on the same operands reads none of Q, K and V from
    HBM (6 MiB, far below the 192 MiB L2), where the first call reads every byte of them from there."""
    sig = _sig("ge.flash_attention", [(1, 1, 1024, 128), (1, 1, 8192, 128), (1, 1, 8192, 128)], (1, 1, 1024, 128))
    tiling = KERNELS[sig.name].choose(sig, B910)
    cold, warm = time_launch(sig, tiling, B910), time_warm_launch(sig, tiling, B910)
    operands = 2 * (1024 + 2 * 8192) * 128
    assert cold.hbm_read_bytes >= operands
    assert warm.hbm_read_bytes == 0
    assert warm.cycles < cold.cycles and warm.head == cold.head


def _one_block_attention(target) -> float:
    """Cycles of a CV-split FlashAttention whose units hold one CV block each: a chain nothing overlaps."""
    q, k, v, _ = attention_inputs(1, 1, 256, 128, skv=512, dtype=np.float16, seed=0)
    sig = _sig("ge.flash_attention", [q.shape, k.shape, v.shape], q.shape)
    tiling = KERNELS["ge.flash_attention"].choose(sig, target)
    # two units of one 128 x 512 block each, side by side on two cores
    assert tiling.cv_split and tiling.s2 >= 512 and tiling.work_units == 2
    ctx = LaunchContext(target, Cores(target.cube_cores), GlobalMemory(target), ["q", "k", "v"], ["o"],
                        compute=False)
    flash_attention_forward(q, k, v, None, False, 1 / math.sqrt(128), tiling, ctx)
    return ctx.cores.finish


def test_a_cv_block_hands_over_three_times_at_a_third_of_the_sync_each():
    base = load_target("ascend910b[overhead.cross_core_sync_cycles=0,overhead.block_dispatch_cycles=0]")
    synced = load_target("ascend910b[overhead.block_dispatch_cycles=0]")
    # S ready (AIC -> AIV), P ready (AIV -> AIC), P V ready (AIC -> AIV): the block's chain waits for each
    assert _one_block_attention(synced) - _one_block_attention(base) == pytest.approx(1000, rel=1e-12)


def test_a_work_unit_starts_after_its_dispatch():
    base = load_target("ascend910b[overhead.cross_core_sync_cycles=0,overhead.block_dispatch_cycles=0]")
    dispatched = load_target("ascend910b[overhead.cross_core_sync_cycles=0]")
    assert _one_block_attention(dispatched) - _one_block_attention(base) == pytest.approx(2000, rel=1e-12)


def test_flash_decoding_runs_cv_split_on_a2_with_the_numbers_of_the_on_chip_schedule():
    q, k, v, _ = attention_inputs(1, 8, 1, 128, nkv=2, skv=4096, dtype=np.float16, seed=3)
    sig = _sig("ge.flash_attention", [q.shape, k.shape, v.shape], q.shape)
    tiling = KERNELS["ge.flash_attention"].choose(sig, B910)
    assert tiling.template == "Bn2S2FD" and tiling.segments > 1 and tiling.cv_split

    def run(t):
        ctx = LaunchContext(B910, Cores(B910.cube_cores), GlobalMemory(B910), ["q", "k", "v"], ["o"])
        return flash_attention_forward(q, k, v, None, False, 1 / math.sqrt(128), t, ctx), ctx

    cv, cv_ctx = run(tiling)
    on_chip, chip_ctx = run(attrs.evolve(tiling, preload=0, v_rows=0))
    assert np.array_equal(cv, on_chip)  # the same blocks, segments and roundings: bit-identical
    vector_side = cv_ctx.cores.busy[[PIPE_INDEX["AIV_MTE2"], PIPE_INDEX["VECTOR"]]].sum(axis=1)
    assert np.all(vector_side > 0)  # the AIVs load S and the partials with their own engine
    assert chip_ctx.cores.busy[PIPE_INDEX["AIV_MTE2"]].sum() == 0


def test_a_mixed_matmul_epilogue_waits_one_sync_for_the_aics_flag():
    # Atlas A2's MatmulMixEpilogue: the AIC drains a block to the workspace and sets a flag; its AIVs see it
    # cross_core_sync_cycles later. One base block on one core: the whole chain is the launch, so the flag's wait
    # adds exactly its cycles to the launch's end
    sig = _sig("ge.fused_matmul", [(128, 128), (128, 128)], (128, 128), activation="gelu")
    tiling = KERNELS[sig.name].choose(sig, B910)
    assert tiling.template == "MatmulMixEpilogue" and tiling.single_core_m == tiling.single_core_n == 128
    no_sync = load_target("ascend910b[overhead.cross_core_sync_cycles=0]")
    synced, _ = _stats(sig, B910)
    bare, _ = _stats(sig, no_sync)
    assert synced.cycles - bare.cycles == pytest.approx(B910.overhead("cross_core_sync_cycles"), rel=1e-12)
