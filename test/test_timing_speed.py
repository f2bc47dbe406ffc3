"""The fast timing models produce the reference schedule exactly.

`kernels/matmul.py` and `kernels/flash_attention.py` time their tiles with batched numpy (a wave's
k steps at once, L2 hits of many reads from one byte clock, a guessed pipe regime checked against
every instruction's equation). `helpers/reference_timing.py` keeps the code they replaced, which
issued one instruction and one GM move at a time. Each test runs a kernel through both on identical
chip states (twice in a row, so the second launch meets the first one's L2 residency) and compares
every figure float for float: the pipes' free and busy cycles, every recorded interval, the booked
waits, the GM byte counters, the byte clock, and every block's last touch.

Host speed itself is measured by `bench/timing_speed.py`, not here.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import attrs
import ml_dtypes
import numpy as np
import pytest

from geir.kernels.base import LaunchContext, PipeWaits
from geir.kernels.data_movement import GmTensor, flat_pieces, share_pieces
from geir.kernels.flash_attention import _time_tiles
from geir.kernels.flash_attention_tiling import candidates as flash_candidates
from geir.kernels.matmul import matmul_forward
from geir.kernels.matmul_tiling import candidates as matmul_candidates
from geir.kernels.tiling import OpSignature
from geir.parser import parse, parse_file
from geir.runtime.interpreter import Runtime
from geir.session import DEFAULT_PIPELINE, compile_module
from geir.target_npu import load_target
from geir.target_npu.sim import Cores, GlobalMemory
from geir.target_npu.target import Target
from geir.types import DType, TensorType
from helpers import reference_timing as ref

BF16 = np.dtype(ml_dtypes.bfloat16)


def _small_l2(name: str, mib: int) -> Target:
    """A chip whose L2 holds only `mib` MiB, so small launches meet reuse distances on both sides of it."""
    target = load_target(name)
    data = copy.deepcopy(target.data)
    data["memory"]["l2_mib"] = mib
    return Target(f"{target.name}-l2-{mib}mib", data)


# the default: a 910B with an L2 a small launch overflows; the real ones where named
TARGET = _small_l2("ascend910b", 1)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
REAL = {name: load_target(name) for name in ("ascend910b", "ascend910a", "ascend310p")}


def _arr(shape, dt) -> np.ndarray:
    """A stand-in operand: the timing reads shapes and dtypes only."""
    return np.broadcast_to(np.zeros((), dt), tuple(shape))


def _type(shape, dt) -> TensorType:
    return TensorType(tuple(shape), DType.from_numpy(np.dtype(dt)))


def _warm(gm: GlobalMemory, names: list[str]) -> None:
    """A chip state that earlier kernels left: some blocks of each operand touched, at different times
    (some within the L2's reach, some beyond it)."""
    gm.clock = 3 * gm.l2_bytes
    rng = np.random.default_rng(len(names))
    for name in names:
        gm.tensor(name, 1 << 16)
        last = gm.last_touch[name]
        hot = rng.random(len(last)) < 0.5
        last[hot] = rng.integers(gm.clock - 2 * gm.l2_bytes, gm.clock, hot.sum())
        gm.tensor_clock[name] = gm.clock - 100


def _figures(cores: Cores, gm: GlobalMemory, waits: PipeWaits | None):
    intervals = [(iv.pipe, iv.name, np.asarray(iv.cores).tolist(), np.asarray(iv.start, dtype=float).tolist(),
                  np.asarray(iv.end, dtype=float).tolist()) for iv in cores.intervals]
    return {"free": cores.free.tolist(), "busy": cores.busy.tolist(), "intervals": intervals,
            "clock": gm.clock, "bytes": (gm.gm_read_bytes, gm.gm_write_bytes, gm.hbm_read_bytes, gm.hbm_write_bytes),
            "last_touch": {k: v.tolist() for k, v in sorted(gm.last_touch.items())},
            "tensor_clock": sorted(gm.tensor_clock.items()), "sizes": sorted(gm.sizes.items()),
            "waits": None if waits is None else (waits.flag, waits.slot)}


def _both(launch_new, launch_ref, operands: list[str], results: list[str], *, record: bool = True,
          count_waits: bool = True, warm: bool = False, cores: int = 24, sizes: dict | None = None,
          launches: int = 2, target: Target = TARGET, busy: bool = False) -> None:
    """Run a launch `launches` times in a row through the fast and the reference timing; the figures must match.

    `warm`: the operands' blocks were last touched at assorted times; `busy`: the pipes' busy and free
    cycles start at fractions (as another kernel's float costs would leave them)."""
    figures = []
    for launch in (launch_new, launch_ref):
        chip = Cores(cores, record=record)
        gm = GlobalMemory(target)
        if busy:
            rng = np.random.default_rng(cores)
            chip.busy[:] = rng.random(chip.busy.shape) * 1e4
            chip.free[:] = chip.busy + rng.random(chip.busy.shape) * 1e3
        if warm:
            _warm(gm, operands + results)
        for name, nbytes in (sizes or {}).items():
            gm.declare(name, nbytes)
        waits = PipeWaits() if count_waits else None
        for _ in range(launches):
            chip.sync_to(chip.finish)
            launch(LaunchContext(target, chip, gm, list(operands), list(results), None, waits, compute=False))
        figures.append(_figures(chip, gm, waits))
    new, old = figures
    for key in old:
        assert new[key] == old[key], f"{key} differs"


# --- matmul --------------------------------------------------------------------------------------------

def _matmul_tilings(a, b, bias, ta, tb, dt, activation, buffers, pick, target):
    ops = [_type(a, dt), _type(b, dt)] + ([_type(bias, dt)] if bias is not None else [])
    name = "ge.fused_matmul" if bias is not None or activation != "none" else "ge.matmul"
    sig = OpSignature(name, tuple(ops), (None,), {"transpose_a": ta, "transpose_b": tb, "activation": activation})
    tilings = matmul_candidates(sig, target, buffers)
    assert tilings, "the shape has tilings"
    if pick is None or len(tilings) <= pick:
        return tilings
    # the rule's largest blocks, the smallest, and some between
    idx = np.unique(np.linspace(0, len(tilings) - 1, pick).round().astype(int))
    return [tilings[i] for i in idx]


def _check_matmul(a, b, bias=None, ta=False, tb=False, dt=np.float16, activation="none", buffers=2, pick=6,
                  names=("a", "b", "bias", "c"), target=TARGET, **kw):
    dt = np.dtype(dt)
    A, B = _arr(a, dt), _arr(b, dt)
    Bias = None if bias is None else _arr(bias, dt)
    operands = [names[0], names[1]] + ([names[2]] if bias is not None else [])
    batch = np.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    M = A.shape[-1] if ta else A.shape[-2]
    N = B.shape[-2] if tb else B.shape[-1]
    kw.setdefault("sizes", {names[3]: math.prod(batch) * M * N * dt.itemsize})
    for tiling in _matmul_tilings(a, b, bias, ta, tb, dt, activation, buffers, pick, target):
        _both(lambda ctx: matmul_forward(A, B, Bias, ta, tb, dt, tiling, ctx, activation=activation),
              lambda ctx: ref.matmul_timing(A, B, Bias, ta, tb, dt, tiling, ctx, activation),
              operands, [names[3]], target=target, **kw)


MATMULS = {
    "square": dict(a=(256, 256), b=(256, 256)),
    "edges": dict(a=(100, 200), b=(200, 150)),
    "bias": dict(a=(100, 200), b=(200, 150), bias=(150,)),
    "bias scalar": dict(a=(64, 96), b=(96, 80), bias=(1,)),
    "bias rows": dict(a=(40, 72), b=(72, 56), bias=(40, 56)),
    "bias column": dict(a=(40, 72), b=(72, 56), bias=(40, 1)),
    "gelu": dict(a=(100, 200), b=(150, 200), bias=(150,), tb=True, activation="gelu"),
    "gelu_tanh 1 buffer": dict(a=(100, 200), b=(200, 150), bias=(150,), activation="gelu_tanh", buffers=1),
    "relu transpose_a": dict(a=(200, 100), b=(200, 150), ta=True, activation="relu"),
    "silu both transposed": dict(a=(72, 40), b=(56, 72), ta=True, tb=True, activation="silu"),
    "batched": dict(a=(3, 40, 72), b=(3, 72, 56), bias=(56,)),
    "batch broadcast": dict(a=(2, 3, 40, 72), b=(3, 56, 72), bias=(1,), tb=True),
    "batch broadcast a": dict(a=(40, 72), b=(4, 72, 56)),
    "M=1": dict(a=(1, 1024), b=(1024, 512), bias=(512,)),
    "M=1 1 buffer": dict(a=(1, 300), b=(300, 512), buffers=1),
    "decode scores": dict(a=(8, 1, 64), b=(8, 300, 64), tb=True),
    "K below a fractal": dict(a=(50, 10), b=(10, 70)),
    "K one step": dict(a=(64, 64), b=(64, 640)),
    "f32": dict(a=(100, 200), b=(200, 150), bias=(150,), dt=np.float32),
    "bf16": dict(a=(100, 200), b=(200, 150), dt=BF16, activation="gelu"),
    "a is b": dict(a=(96, 96), b=(96, 96), tb=True, names=("x", "x", "bias", "c")),
    "c in place of a": dict(a=(96, 96), b=(96, 96), names=("x", "w", "bias", "x")),
    "bias is a": dict(a=(1, 96), b=(96, 96), bias=(96,), names=("x", "w", "x", "c")),
    "big c": dict(a=(96, 96), b=(96, 96), sizes={"c": 1 << 30}),
    "long k": dict(a=(64, 4096), b=(4096, 512), bias=(512,), pick=3),
    "wide": dict(a=(256, 512), b=(512, 1536), pick=2),
}


@pytest.mark.parametrize("case", list(MATMULS))
def test_matmul_timing_is_the_reference(case):
    _check_matmul(**MATMULS[case])


@pytest.mark.parametrize("target", list(REAL))
@pytest.mark.parametrize("case", ["edges", "gelu", "M=1"])
def test_matmul_timing_on_the_real_chips(case, target):
    _check_matmul(**MATMULS[case], target=REAL[target], pick=3)


@pytest.mark.parametrize("case", ["edges", "gelu", "batch broadcast", "M=1 1 buffer", "f32", "wide"])
def test_matmul_timing_on_a_warm_chip(case):
    # mixed residency: a tile's fractals were last touched at different times by earlier kernels
    _check_matmul(**MATMULS[case], warm=True)


@pytest.mark.parametrize("record, count_waits", [(False, False), (True, False), (False, True)])
def test_matmul_timing_without_recording(record, count_waits):
    _check_matmul(a=(100, 200), b=(200, 150), bias=(150,), activation="gelu", record=record,
                  count_waits=count_waits, pick=3)


@pytest.mark.parametrize("case", ["edges", "gelu", "M=1 1 buffer", "batched"])
def test_matmul_timing_after_fractional_busy_cycles(case):
    # busy counters that are not whole numbers: each pipe's costs must be added one at a time, in order
    _check_matmul(**MATMULS[case], busy=True, pick=3)


def test_matmul_timing_on_fewer_cores():
    # after a core stops, a launch runs on the survivors (odd lane counts, partial last waves)
    _check_matmul(a=(300, 260), b=(260, 200), bias=(200,), cores=23, pick=4)
    _check_matmul(a=(100, 64), b=(64, 100), cores=1, pick=2)


def test_matmul_timing_every_candidate():
    # every base block the kernel may be given, both buffer counts
    for buffers in (1, 2):
        _check_matmul(a=(80, 144), b=(144, 112), bias=(112,), buffers=buffers, pick=None, launches=1)


def test_matmul_timing_random_shapes():
    rng = np.random.default_rng(13)
    for _ in range(12):
        M, N, K = (int(x) for x in rng.integers(1, 300, 3))
        ta, tb = bool(rng.integers(2)), bool(rng.integers(2))
        batch = [(), (2,), (3,)][rng.integers(3)]
        a = batch + ((K, M) if ta else (M, K))
        b = ((N, K) if tb else (K, N)) if rng.integers(2) else batch + ((N, K) if tb else (K, N))
        bias = [None, (N,), (1,)][rng.integers(3)]
        activation = ["none", "gelu", "relu"][rng.integers(3)]
        dt = [np.float16, BF16, np.float32][rng.integers(3)]
        _check_matmul(a=a, b=b, bias=bias, ta=ta, tb=tb, dt=dt, activation=activation,
                      buffers=int(rng.integers(1, 3)), pick=2, warm=bool(rng.integers(2)))


# --- flash attention -------------------------------------------------------------------------------------

def _flash_tilings(q, k, v, mask, causal, dt, buffers, pick, target):
    ops = [_type(q, dt), _type(k, dt), _type(v, dt)] + ([_type(mask.shape, mask.dtype)] if mask is not None else [])
    sig = OpSignature("ge.flash_attention", tuple(ops), (None,), {"causal": causal})
    tilings = flash_candidates(sig, target, buffers)
    assert tilings, "the shape has tilings"
    if pick is None or len(tilings) <= pick:
        return tilings
    idx = np.unique(np.linspace(0, len(tilings) - 1, pick).round().astype(int))
    return [tilings[i] for i in idx]


def _check_flash(q, k, v=None, mask=None, causal=False, dt=np.float16, buffers=2, pick=4,
                 names=("q", "k", "v", "mask", "o"), segments=None, target=TARGET, **kw):
    dt = np.dtype(dt)
    v = k if v is None else v
    Q, K = _arr(q, dt), _arr(k, dt)
    Mk = None if mask is None else _arr(mask[0], mask[1])
    operands = list(names[:3]) + ([names[3]] if mask is not None else [])
    tilings = _flash_tilings(q, k, v, Mk, causal, dt, buffers, pick, target)
    if segments is not None:  # key segments the rule may not pick for this shape
        tilings = [attrs.evolve(t, segments=segments) for t in tilings]
    for tiling in tilings:
        def launch(ctx, fn):
            m = None if Mk is None else np.broadcast_to(Mk, (Q.shape[0], Q.shape[1], Q.shape[2], K.shape[2]))
            fn(Q.shape, K.shape, dt, m, causal, tiling.s1, tiling.s2, tiling.buffers, max(tiling.segments, 1), ctx)

        _both(lambda ctx: launch(ctx, _flash_time_new), lambda ctx: launch(ctx, ref.flash_timing),
              operands, [names[4]], target=target, **kw)


def _flash_time_new(q_shape, k_shape, dt, mask, causal, s1, s2, nbuf, segments, ctx):
    _time_tiles(q_shape, k_shape, dt, mask, causal, s1, s2, nbuf, segments, ctx)


FLASH = {
    "plain": dict(q=(1, 4, 256, 64), k=(1, 4, 256, 64)),
    "causal": dict(q=(1, 4, 512, 64), k=(1, 4, 512, 64), causal=True),
    "causal 1 buffer": dict(q=(1, 2, 384, 64), k=(1, 2, 384, 64), causal=True, buffers=1),
    "causal ragged": dict(q=(2, 3, 200, 64), k=(2, 3, 200, 64), causal=True),
    "bool mask": dict(q=(1, 2, 256, 64), k=(1, 2, 256, 64), mask=((1, 1, 256, 256), np.bool_)),
    "additive mask": dict(q=(1, 2, 256, 64), k=(1, 2, 300, 64), mask=((1, 2, 256, 300), np.float16)),
    "causal and mask": dict(q=(1, 2, 256, 64), k=(1, 2, 256, 64), mask=((1, 1, 256, 256), np.bool_), causal=True),
    "gqa": dict(q=(1, 8, 256, 64), k=(1, 2, 256, 64), causal=True),
    "gqa 1 buffer": dict(q=(2, 4, 128, 64), k=(2, 1, 128, 64), buffers=1),
    "long kv": dict(q=(1, 2, 128, 128), k=(1, 2, 2048, 128)),
    "decode": dict(q=(1, 8, 1, 128), k=(1, 8, 1024, 128)),
    "head dim 128": dict(q=(1, 4, 512, 128), k=(1, 4, 512, 128), causal=True),
    "v head dim": dict(q=(1, 2, 256, 64), k=(1, 2, 256, 64), v=(1, 2, 256, 32)),
    "bf16": dict(q=(1, 2, 256, 64), k=(1, 2, 256, 64), dt=BF16, causal=True),
    "f32": dict(q=(1, 2, 256, 64), k=(1, 2, 256, 64), dt=np.float32),
    "q is k": dict(q=(1, 2, 256, 64), k=(1, 2, 256, 64), names=("x", "x", "v", "mask", "o"), causal=True),
    "k is v": dict(q=(1, 2, 256, 64), k=(1, 2, 256, 64), names=("q", "x", "x", "mask", "o")),
    "o in place of q": dict(q=(1, 2, 256, 64), k=(1, 2, 256, 64), names=("x", "k", "v", "mask", "x")),
}


@pytest.mark.parametrize("case", list(FLASH))
def test_flash_timing_is_the_reference(case):
    _check_flash(**FLASH[case])


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("case", ["long kv", "causal", "decode"])
def test_flash_timing_in_key_segments(case, segments):
    _check_flash(**FLASH[case], segments=segments, pick=2)


@pytest.mark.parametrize("case", ["causal", "additive mask", "gqa"])
def test_flash_timing_on_a_warm_chip(case):
    _check_flash(**FLASH[case], warm=True)


@pytest.mark.parametrize("target", list(REAL))
def test_flash_timing_on_the_real_chips(target):
    _check_flash(**FLASH["causal and mask"], target=REAL[target], pick=2)


@pytest.mark.parametrize("record, count_waits", [(False, False), (True, False), (False, True)])
def test_flash_timing_without_recording(record, count_waits):
    _check_flash(**FLASH["causal ragged"], record=record, count_waits=count_waits, pick=2)


@pytest.mark.parametrize("case", ["causal ragged", "additive mask"])
def test_flash_timing_after_fractional_busy_cycles(case):
    _check_flash(**FLASH[case], busy=True, pick=2)


def test_flash_timing_on_fewer_cores():
    _check_flash(**FLASH["causal"], cores=23, pick=2)
    _check_flash(**FLASH["gqa"], cores=1, pick=1)


# --- the vector kernels' pieces --------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_flat_pieces_cost_what_the_listed_pieces_cost(seed):
    # flat_pieces lists each fractal once with all the range's bytes in it; read and written, it must cost
    # and touch exactly what the three parts listed one after another (the reference) did
    rng = np.random.default_rng(seed)
    target = TARGET
    for _ in range(40):
        mats, R, C = int(rng.integers(1, 4)), int(rng.integers(1, 70)), int(rng.integers(1, 90))
        t = GmTensor("x", mats * R, C, int(rng.choice([1, 2, 4])), R)
        n = int(rng.integers(1, 30))
        lo = rng.integers(0, t.size + 1, n)
        hi = lo + (rng.integers(0, t.size + 1, n) if rng.random() < 0.3 else rng.integers(0, 3 * C + 40, n))
        part, count = rng.integers(0, 50, n), rng.integers(0, 4 * C, n)
        key = rng.integers(0, 3, n) if rng.random() < 0.5 else None
        states = []
        for flat, share in ((flat_pieces, share_pieces), (ref.flat_pieces, ref.share_pieces)):
            gm = GlobalMemory(target)
            gm.clock = 2 * gm.l2_bytes
            gm.tensor("x", t.blocks)
            gm.last_touch["x"][:] = np.random.default_rng(seed).integers(0, gm.clock, t.blocks)
            costs = [ref.read_pieces(gm, "x", *flat(t, lo, hi), key=key),
                     ref.read_pieces(gm, "x", *share(t, part, 50, count)),
                     ref.write_pieces(gm, "x", *flat(t, lo, hi))]
            states.append(([c.tolist() for c in costs], gm.clock, gm.gm_read_bytes, gm.hbm_read_bytes,
                           gm.last_touch["x"].tolist()))
        assert states[0] == states[1]


SMALL_BLOCK = """ge.graph @main(%x: tensor<1x200x256xf16>, %g: tensor<256xf16>, %b: tensor<256xf16>,
    %w: tensor<256x768xf16>, %bw: tensor<768xf16>, %wo: tensor<256x256xf16>, %m: tensor<1x1x200x200xi1>)
    -> (tensor<1x200x256xf16>, tensor<1x200x256xf32>) {
  %ln = ge.layer_norm %x, %g, %b {axis = -1, epsilon = 1.0e-05}
  %qkv0 = ge.matmul %ln, %w
  %qkv = ge.add %qkv0, %bw
  %q2, %k2, %v2 = ge.split %qkv {axis = -1, sizes = [256, 256, 256]}
  %q3 = ge.reshape %q2 {shape = [1, 200, 4, 64]}
  %q = ge.transpose %q3 {perm = [0, 2, 1, 3]}
  %k3 = ge.reshape %k2 {shape = [1, 200, 4, 64]}
  %k = ge.transpose %k3 {perm = [0, 2, 1, 3]}
  %v3 = ge.reshape %v2 {shape = [1, 200, 4, 64]}
  %v = ge.transpose %v3 {perm = [0, 2, 1, 3]}
  %o = ge.flash_attention %q, %k, %v, %m
  %ot = ge.transpose %o {perm = [0, 2, 1, 3]}
  %o2 = ge.reshape %ot {shape = [1, 200, 256]}
  %a0 = ge.matmul %o2, %wo
  %h = ge.add %x, %a0
  %s = ge.softmax %h {axis = -1}
  %c = ge.cast %s {to = f32}
  ge.return %h, %c
}
"""

PROGRAMS = ["attention.geir", "gpt2_block.geir", "attention/causal.geir", "attention/gqa.geir",
            "attention/bool_mask.geir", "doctor/vector_bound.geir", SMALL_BLOCK]


@pytest.fixture
def reference_schedule(monkeypatch):
    """Every kernel timed by the reference code: matmul and FlashAttention's timing, the listed pieces."""
    from geir.kernels import data_movement, flash_attention, matmul, vector

    def matmul_forward(a, b, bias, transpose_a, transpose_b, out_dt, tiling, ctx, epilogue=None, activation="none",
                       glu="none"):
        # the reference has no glu epilogue (matmul_glu) yet: the programs this oracle times have none
        assert glu == "none", "the reference schedule does not time a glu epilogue"
        ref.matmul_timing(a, b, bias, transpose_a, transpose_b, out_dt, tiling, ctx, activation)
        A = np.swapaxes(a, -1, -2) if transpose_a else a
        B = np.swapaxes(b, -1, -2) if transpose_b else b
        return np.empty(np.broadcast_shapes(A.shape[:-2], B.shape[:-2]) + (A.shape[-2], B.shape[-1]), dtype=out_dt)

    monkeypatch.setattr(matmul, "matmul_forward", matmul_forward)
    monkeypatch.setattr(flash_attention, "_time_tiles", ref.flash_timing)
    for module in (data_movement, vector, matmul):
        if hasattr(module, "flat_pieces"):
            monkeypatch.setattr(module, "flat_pieces", ref.flat_pieces)
        monkeypatch.setattr(module, "share_pieces", ref.share_pieces)
    return monkeypatch


def _program_figures(result) -> str:
    tasks = [(t.kind, t.name, t.stream, t.start_us, t.end_us) for t in result.tasks]
    pipes = [(iv.name, iv.pipe, np.asarray(iv.cores).tolist(), np.asarray(iv.start, dtype=float).tolist(),
              np.asarray(iv.end, dtype=float).tolist()) for iv in result.cores.intervals]
    stats = [(k.name, k.start, k.end, k.cores, sorted(k.busy.items()), k.gm_read_bytes, k.gm_write_bytes,
              k.hbm_read_bytes, k.hbm_write_bytes, None if k.waits is None else (k.waits.flag, k.waits.slot))
             for k in result.kernels]
    gm = result.gm
    return json.dumps([tasks, pipes, stats, gm.clock, sorted((k, v.tolist()) for k, v in gm.last_touch.items())],
                      default=str)


@pytest.mark.parametrize("source", PROGRAMS, ids=[p[:24] if p.endswith(".geir") else "small block" for p in PROGRAMS])
def test_programs_time_as_the_reference_schedule(source, request):
    # whole programs, every kernel family, fused and not: the Runtime's figures with the kernels' timing
    # and with the reference code in its place
    module = parse_file(str(EXAMPLES / source)) if source.endswith(".geir") else parse(source, "block.geir")
    program = compile_module(module, DEFAULT_PIPELINE, "ascend910b")[0].graphs[0]
    target = REAL["ascend910b"]
    runs = []
    for reference in (False, True):
        if reference:
            request.getfixturevalue("reference_schedule")
        result = Runtime(target, record_pipes=True, count_waits=True, timing_only=True, memo=False).run(program, {}, {})
        runs.append(_program_figures(result))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("shape", [(256, 512, 2 * 1024), (100, 200, 2 * 384)])
def test_a_glu_matmuls_halves_move_batched_as_they_move_one_at_a_time(tb, shape):
    # the oracle: the same kernel moving every A, gate and up tile on its own (read_pieces, _Moves._each), the
    # path every glu took before its two halves joined the batched transfer
    from geir.kernels import matmul as mm

    m, k, n2 = shape
    dt = np.dtype(np.float16)
    A, B = _arr((m, k), dt), _arr((n2, k) if tb else (k, n2), dt)
    sig = OpSignature("ge.fused_matmul", (_type((m, k), dt), _type(B.shape, dt)), (None,),
                      {"transpose_a": False, "transpose_b": tb, "glu": "silu"})
    tilings = matmul_candidates(sig, TARGET, 2)
    assert tilings
    made = mm._Moves.__init__
    batched = []

    def watched(self, *a, **kw):
        made(self, *a, **kw)
        batched.append(self.sets is not None)

    def unbatched(self, *a, **kw):
        made(self, *a, **kw)
        self.sets = None

    def run(ctx, tiling, init):
        mm._Moves.__init__ = init
        try:
            matmul_forward(A, B, None, False, tb, dt, tiling, ctx, glu="silu")
        finally:
            mm._Moves.__init__ = made

    for tiling in tilings[:: max(len(tilings) // 5, 1)]:
        _both(lambda ctx, t=tiling: run(ctx, t, watched), lambda ctx, t=tiling: run(ctx, t, unbatched),
              ["a", "b"], ["c"], sizes={"c": m * n2 // 2 * dt.itemsize})
    assert any(batched)  # some tiling's halves lie on B's tile grid and took the batched path
