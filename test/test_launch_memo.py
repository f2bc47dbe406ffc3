"""A timing-only run replays a launch identical to one it timed before (geir.runtime.launch_memo), and
what it reports is what timing every launch reports, to the last bit.

The oracle is the same run with the memo off (`Runtime(memo=False)`), which times every launch, and
the full run, which computes every value; test_timing_only.py compares timing-only and full runs
on programs of every kernel family, so here the programs are the ones the memo serves: models whose
layers repeat, and launches that differ only in what L2 holds.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from geir.parser import parse
from geir.runtime.interpreter import Runtime
from geir.runtime.op_summary import op_summary_rows
from geir.runtime.profile import profile
from geir.runtime.trace import chrome_trace_json, run_trace
from geir.session import DEFAULT_PIPELINE, NO_FUSE_PIPELINE, compile_module
from geir.target_npu import load_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _make_model():
    spec = importlib.util.spec_from_file_location("make_model", EXAMPLES / "make_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_model = _make_model()


def _program(text: str, pipeline: str = DEFAULT_PIPELINE):
    return compile_module(parse(text, "model.geir"), pipeline, "ascend910b")[0].graphs[0]


def _figures(result) -> str:
    """Everything a user sees of a run's timing: profile, tasks, every pipe interval, the op summary, the trace."""
    tasks = [(t.kind, t.name, t.stream, t.start_us, t.end_us, t.submitted_us) for t in result.tasks]
    pipes = [(iv.name, iv.pipe, iv.cores.tolist(), np.asarray(iv.start).tolist(), np.asarray(iv.end).tolist())
             for iv in result.cores.intervals]
    counters = (result.gm.gm_read_bytes, result.gm.gm_write_bytes, result.gm.hbm_read_bytes,
                result.gm.hbm_write_bytes, result.gm.clock)
    return json.dumps([profile(result), tasks, pipes, counters, op_summary_rows(result),
                       chrome_trace_json(run_trace(result))],
                      sort_keys=True, default=str)


MODELS = {
    "gpt2 4 layers": dict(layers=4, hidden=256, heads=4, seq=128, mlp=1024, dtype="f16"),
    "sdpa 4 layers": dict(layers=4, hidden=256, heads=2, seq=256, mlp=512, dtype="f16", sdpa=True),
    "decode 3 layers": dict(layers=3, hidden=256, heads=2, seq=1, mlp=512, dtype="f16", decode=512),
    "f32 unfused": dict(layers=3, hidden=128, heads=2, seq=64, mlp=256, dtype="f32"),
}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("record", [False, True], ids=["plain", "pipes recorded"])
def test_replayed_layers_time_what_timing_every_launch_times(name, record):
    config = MODELS[name]
    program = _program(make_model.model_text(**config), NO_FUSE_PIPELINE if name == "f32 unfused"
                       else DEFAULT_PIPELINE)
    target = load_target("ascend910b")
    memo = Runtime(target, record_pipes=record, timing_only=True)
    replayed = memo.run(program, {}, {})
    timed = Runtime(target, record_pipes=record, timing_only=True, memo=False).run(program, {}, {})
    # the later layers repeat the first ones' launches on tensors in the same residency state
    assert replayed.replayed >= len(replayed.kernels) // config["layers"], (replayed.replayed, len(replayed.kernels))
    assert timed.replayed == 0
    assert _figures(replayed) == _figures(timed)


def test_counted_waits_are_replayed_too():
    program = _program(make_model.model_text(layers=3, hidden=128, heads=2, seq=64, mlp=256, dtype="f16"))
    target = load_target("ascend910b")
    runs = [Runtime(target, timing_only=True, count_waits=True, memo=m).run(program, {}, {}) for m in (True, False)]
    assert runs[0].replayed > 0
    assert [(k.waits.flag, k.waits.slot) for k in runs[0].kernels] == [(k.waits.flag, k.waits.slot)
                                                                       for k in runs[1].kernels]


# The same add twice on a tensor that fits L2: the first reads x from HBM (it was just copied in),
# the second finds it in L2. Same op, types and tiling; only the residency differs, so it must be timed.
TWICE = """ge.graph @main(%x: tensor<64x1024xf16>) -> (tensor<64x1024xf16>, tensor<64x1024xf16>) {
  %a = ge.add %x, %x
  %b = ge.add %x, %x
  ge.return %a, %b
}
"""


def test_a_launch_reading_other_residency_is_timed_not_replayed():
    program = _program(TWICE, DEFAULT_PIPELINE.replace("cse,", ""))  # cse would make the two adds one
    target = load_target("ascend910b")
    run = Runtime(target, timing_only=True).run(program, {}, {})
    timed = Runtime(target, timing_only=True, memo=False).run(program, {}, {})
    first, second = timed.kernels
    assert first.hbm_read_bytes > 0 and second.hbm_read_bytes == 0, "the second add reads x from L2"
    assert run.replayed == 0
    assert _figures(run) == _figures(timed)


# %a is read by %b and %b by %c, each after an add of a tensor larger than the L2 (128 and 256 MiB read and written)
# moved between them: both are cold, by different numbers of bytes, and a miss is a miss however long ago the block
# was touched, so %c's launch replays %b's (the same op, tiling and in-place offset).
COLD = """ge.graph @main(%x: tensor<64x1024xf16>, %z: tensor<8192x8192xf16>, %w: tensor<8192x16384xf16>) ->
    (tensor<8192x8192xf16>, tensor<8192x16384xf16>, tensor<64x1024xf16>) {
  %a = ge.add %x, %x
  %p = ge.add %z, %z
  %b = ge.add %a, %a
  %q = ge.add %w, %w
  %c = ge.add %b, %b
  ge.return %p, %q, %c
}
"""


def test_launches_on_tensors_cold_by_different_distances_replay_one_another():
    program = _program(COLD, DEFAULT_PIPELINE.replace("cse,", ""))
    target = load_target("ascend910b")
    run = Runtime(target, timing_only=True).run(program, {}, {})
    timed = Runtime(target, timing_only=True, memo=False).run(program, {}, {})
    a, p, b, q, c = timed.kernels
    # the oracle's own counters: %b and %c read their operand's 128 KiB from HBM (then hit, as its second operand),
    # each after more bytes than the L2 holds
    assert b.hbm_read_bytes == c.hbm_read_bytes == 64 * 1024 * 2
    assert min(p.gm_read_bytes + p.gm_write_bytes, q.gm_read_bytes + q.gm_write_bytes) > target.memory.l2_bytes
    assert run.replayed == 1  # %c: the only launch that repeats another's (op, tiling, operands' residency)
    assert _figures(run) == _figures(timed)


def test_a_memo_kept_across_runs_replays_the_second_run_whole():
    program = _program(make_model.model_text(layers=2, hidden=128, heads=2, seq=64, mlp=256, dtype="f16"))
    runtime = Runtime(load_target("ascend910b"), timing_only=True)
    first = runtime.run(program, {}, {})
    second = runtime.run(program, {}, {})
    assert second.replayed == len(second.kernels)
    assert _figures(first) == _figures(second)


@pytest.mark.parametrize("record", [False, True], ids=["plain", "pipes recorded"])
def test_a_run_replayed_whole_is_the_run_its_launches_give(record):
    # the oracle: the same runs with every launch walked (whole_runs=False), the first of them with none replayed
    from geir.runtime.launch_memo import LaunchMemo

    program = _program(make_model.model_text(layers=2, hidden=128, heads=2, seq=64, mlp=256, dtype="f16"))
    target = load_target("ascend910b")
    memos = {whole: LaunchMemo(whole_runs=whole) for whole in (True, False)}
    runs = {whole: [Runtime(target, record_pipes=record, timing_only=True, memo=memos[whole]).run(program, {}, {})
                    for _ in range(3)] for whole in (True, False)}
    assert memos[True].runs.hits == 2 and memos[False].runs.hits == 0
    assert memos[True].hits == memos[False].hits  # a whole replay counts its launches as walking them would
    for whole_run, walked in zip(runs[True], runs[False]):
        assert whole_run.replayed == walked.replayed
        assert _figures(whole_run) == _figures(walked)
    assert _figures(runs[False][0]) == _figures(Runtime(target, record_pipes=record, timing_only=True,
                                                        memo=False).run(program, {}, {}))


def test_a_run_told_to_listeners_is_walked():
    from geir.runtime.interpreter import RuntimeListener
    from geir.runtime.launch_memo import LaunchMemo

    program = _program(make_model.model_text(layers=2, hidden=128, heads=2, seq=64, mlp=256, dtype="f16"))
    target = load_target("ascend910b")
    memo = LaunchMemo()
    launched = []

    class Count(RuntimeListener):
        def launched(self, task, stats):
            launched.append(task)

    for _ in range(2):
        Runtime(target, timing_only=True, memo=memo, listeners=[Count()]).run(program, {}, {})
    assert memo.runs.hits == 0 and len(launched) == 2 * len(list(program.walk("rt.launch")))


def test_full_runs_and_fault_injection_time_every_launch():
    program = _program(make_model.model_text(layers=2, hidden=128, heads=2, seq=64, mlp=256, dtype="f16"))
    target = load_target("ascend910b")
    assert Runtime(target).memo is None
    faulty = Runtime(target, timing_only=True, faults=[("core", 3)]).run(program, {}, {})
    assert faulty.replayed == 0 and faulty.faults


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_a_residency_kept_compact_gives_back_every_block_and_keys_as_the_array(dtype):
    from geir.runtime.launch_memo import _Blocks

    rng = np.random.default_rng(0)
    clock = 10_000_000
    pool = np.full(100_000, -1 if dtype is np.int64 else np.inf, dtype)  # the untouched tail
    pool[rng.choice(100_000, 300, replace=False)] = rng.integers(0, 5000, 300)  # a step's slots
    for relative in (pool, np.full(50, 7, dtype), pool[:0], np.arange(20, dtype=dtype)):
        compact = _Blocks.of(relative)
        back = compact.absolute(clock)
        np.testing.assert_array_equal(back, clock - relative)  # the oracle: GlobalMemory.last_touch's own form
        assert back.dtype == (clock - relative).dtype
    assert _Blocks.of(pool).where.size == 300  # the pool's few touched blocks, not its 100000
    other = pool.copy()
    other[5] = 3  # one more block touched
    assert _Blocks.of(pool).key() == _Blocks.of(pool.copy()).key() != _Blocks.of(other).key()


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_a_residency_cold_by_more_than_the_l2_keys_as_the_l2_its_blocks_cut_there(dtype):
    from geir.runtime.launch_memo import _Blocks, _relative

    clock, cold = 10_000_000, 4096
    rng = np.random.default_rng(1)
    cases = [np.full(1000, 5, dtype), rng.integers(0, clock - cold, 1000).astype(dtype),  # all cold, two ways
             rng.integers(0, clock, 1000).astype(dtype), np.array([clock - 1, 0, clock - cold], dtype)]
    if dtype is np.float64:
        cases.append(np.full(10, -np.inf))  # never touched
    for last in cases:
        # the oracle: the distances cut at `cold` by numpy, then made compact
        expected = _Blocks.of(np.minimum(clock - last, cold))
        got = _relative(clock, last, cold)
        assert got.key() == expected.key()
        np.testing.assert_array_equal(got.absolute(clock), expected.absolute(clock))
        assert got.absolute(clock).dtype == (clock - last).dtype


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_a_replayed_residency_left_unbuilt_keys_and_reads_as_the_built_array(dtype):
    from geir.runtime.launch_memo import _Blocks, _relative, _Replayed, _SeenLater
    from geir.target_npu.residency import Residencies

    seen = _SeenLater()
    rng = np.random.default_rng(2)
    then, cold = 5_000_000, 4096
    cases = [rng.integers(0, cold, 1000).astype(dtype), np.full(1000, cold, dtype), np.arange(30, dtype=dtype),
             np.array([cold, 3, cold, 0], dtype), np.array([5, 100, cold, cold], dtype), np.full(0, 1, dtype)]
    for relative in cases:
        stored = _Blocks.of(relative)
        built = stored.absolute(then)  # what the replay used to store
        # then + cold - 50: a block turns cold, as the background is, while another is not yet
        for now in (then, then + 1, then + 2000, then + cold - 50, then + cold, then + 10 * cold):
            # the oracle: the key of the array built at replay, taken at a later clock; also where the record was
            # replayed at another clock and read as many bytes later (a later layer's twin: derived once)
            expected = _relative(now, built, cold).key()
            assert _relative(now, _Replayed(stored, then), cold).key() == expected
            for shift in (0, 12345, 0):
                assert _relative(now + shift, _Replayed(stored, then + shift, seen), cold).key() == expected
    assert seen.hits > 0
    fraction = _Blocks.of(np.array([0.5, 1.0]))  # not whole numbers: derived every time, never from another clock
    assert _relative(11, _Replayed(fraction, 10, seen), cold).key() == _relative(11, fraction.absolute(10), cold).key()
    assert not fraction.integral()
    for relative in cases:
        stored = _Blocks.of(relative)
        built = stored.absolute(then)
        touches = Residencies({"t": _Replayed(stored, then)})
        assert isinstance(touches.peek("t"), _Replayed)
        got = touches["t"]  # any other reader gets the array, and it is kept built
        np.testing.assert_array_equal(got, built)
        assert got.dtype == built.dtype and touches.peek("t") is got


def test_the_role_index_follows_each_runs_global_memory_not_its_name_count():
    """A memo outlives its runs, and each run starts a GlobalMemory of its own: the index of role names a key reads
    (`@offset:q`) is that memory's, even where another run's memory held as many names (the index once went by the
    count alone and kept the first run's roles); within one memory it takes up the names added since."""
    from geir.runtime.launch_memo import LaunchMemo
    from geir.target_npu.sim import GlobalMemory

    target = load_target("ascend910b")
    memo = LaunchMemo()
    first, second = GlobalMemory(target), GlobalMemory(target)
    first.tensor_clock.update({"@0": 0, "@0:q": 0})
    second.tensor_clock.update({"@64": 0, "@64:k": 0})
    assert memo._role_names(first) == {"@0": ["@0:q"]}
    assert memo._role_names(second) == {"@64": ["@64:k"]}
    second.tensor_clock.update({"@0": 0, "@64:a": 0})
    assert memo._role_names(second) == {"@64": ["@64:a", "@64:k"]}
