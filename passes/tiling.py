"""Tilings for the kernels ops become: FlashAttention templates and blocks, matmul base blocks, vector tiles.

Pure functions of tensor types and a target's numbers (target_npu/targets/*.toml); the `tile` pass
puts their `to_attr()` on the ops. Every tiling is checked against the real buffer capacities: the
preferred block is shrunk (s1, then s2, multiples of the cube fractal), then the keys of a row are
split into segments, and only when even the smallest tile overflows is it an error naming the buffer.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from geir.ops.numerics import broadcast_dims
from geir.target_npu.target import Target, load_target
from geir.types import DType, TensorType

# ops-transformer's FlashAttention template policy (flash_attention_score tiling): key rows up to
# SHORT_KV stay whole ("S1Bn2gs1": s1 split, s2 not); longer ones are split on both sequence axes
# ("S1s2Bn2gs1") with 128 x 128 basic blocks, and past LONG_KV s1 may drop to 64 to fill the cores.
SHORT_KV = 128
LONG_KV = 1024
BLOCK = 128
LONG_S1 = (128, 64)
WHOLE_ROW, SPLIT_KV = "S1Bn2gs1", "S1s2Bn2gs1"
# running max, running sum and the rescale factor exp(m_old - m_new): one f32 per row each
FLASH_ROW_VECTORS = 3
# matmul basic block m x n x k (ops-transformer BMM basic block 128 x 256 x 64)
MATMUL_BLOCK = (128, 256, 64)
F32_BYTES = 4
BUFFER_NAMES = {"ub": "UB", "l1": "L1", "l0a": "L0A", "l0b": "L0B", "l0c": "L0C"}

# ops that become no kernel: constants live in the weights, return is bookkeeping, reshape is a view
NO_KERNEL = frozenset({"ge.const", "ge.return", "ge.reshape"})
ROW_OPS = frozenset({"ge.reduce_sum", "ge.reduce_max", "ge.reduce_mean", "ge.softmax", "ge.layer_norm", "ge.rms_norm"})
COPY_OPS = {"ge.concat": "DataCopy", "ge.split": "DataCopy", "ge.slice": "DataCopy", "ge.reshape": "DataCopy",
            "ge.trans_data": "TransData", "ge.transpose": "VectorTranspose"}


class TilingError(ValueError):
    """No tiling fits the target: the message names the buffer, the bytes asked for and its capacity."""


class Untiled(Exception):
    """The op stays untiled for a stated reason (an --explain remark, not an error)."""


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _target(chip: Target | str) -> Target:
    return load_target(chip) if isinstance(chip, str) else chip


def _check_buffers(buffers: int) -> None:
    if buffers not in (1, 2):
        raise ValueError(f"buffers must be 1 (single) or 2 (double buffering), not {buffers}")


def fractal(chip: Target, dtype: DType) -> tuple[int, int, int]:
    """The cube's m x k x n MACs per cycle for `dtype` (f32 has half the k: half the rate)."""
    table = chip.data["cube"]
    if dtype.value not in table:
        raise Untiled(f"the cube of {chip.name} has no {dtype} mode")
    m, k, n = table[dtype.value]
    return m, k, n


def _halvings(start: int, least: int) -> list[int]:
    """start, then the powers of two below it down to `least` (block sizes to try, largest first)."""
    out = [start]
    p = least
    while p * 2 < start:
        p *= 2
    while p >= least and p < start:
        out.append(p)
        p //= 2
    return out


@attrs.frozen
class Budget:
    """Bytes a tile asks of each on-chip buffer."""

    ub: int
    l1: int
    l0a: int
    l0b: int
    l0c: int

    def overflow(self, chip: Target) -> tuple[str, int, int] | None:
        """(buffer name, bytes asked, capacity) of the first buffer that does not hold the tile, or None."""
        for name in BUFFER_NAMES:
            need, cap = getattr(self, name), chip.buffer_bytes(name)
            if need > cap:
                return BUFFER_NAMES[name], need, cap
        return None


def _k_chunk(m: int, n: int, k: int, kmin: int, nbytes: int, buffers: int, chip: Target) -> int:
    """The largest contraction chunk whose L0A (m x k) and L0B (k x n) fragments fit; kmin when none does."""
    for c in _halvings(_align(k, kmin), kmin):
        if m * c * nbytes * buffers <= chip.buffer_bytes("l0a") and \
                c * n * nbytes * buffers <= chip.buffer_bytes("l0b"):
            return c
    return kmin


def flash_budget(s1: int, s2: int, d: int, dtype: DType, buffers: int, chip: Target, *,
                 causal: bool = False, mask_itemsize: int = 0) -> Budget:
    """What one FlashAttention work unit keeps on chip for an s1 x s2 block with head dim d."""
    fm, fk, _ = fractal(chip, dtype)
    s1, s2, d = _align(s1, fm), _align(s2, fm), _align(d, fm)
    b = dtype.itemsize
    # Each vector unit paired with the cube takes its share of the block's rows (910B: one AIC, two
    # AIVs, each with its own UB), so UB is budgeted per vector unit for s1 / vector_per_cube rows.
    rows = -(-s1 // chip.data["cores"].get("vector_per_cube", 1))
    # Score side, X = (4 / bytes + 1) * buffers in units of the input dtype: the f32 scores the cube
    # delivers plus their softmax P in the input dtype for the second matmul, both double-buffered so
    # FIXP lands block j+1 while the vector unit works on block j (f16: 6 bytes per element, f32: 8).
    score = rows * s2 * (F32_BYTES + b) * buffers
    # Output side, Y = 8 / bytes: the f32 accumulator O plus one f32 landing buffer for each block's
    # P @ V; one buffer suffices because it is folded into O before the next P exists, and the cube
    # fills that gap with the next Q @ K^T.
    out = rows * d * 2 * F32_BYTES
    # Row statistics: one f32 per row each, padded to a UB block as the vector unit addresses them.
    vectors = FLASH_ROW_VECTORS * rows * chip.data["memory"]["ub_block_bytes"]
    # Masks arrive as s1 x s2 tiles like K and V: a 1-byte causal tile, and the user's mask.
    masks = rows * s2 * ((1 if causal else 0) + mask_itemsize) * buffers
    # L1 holds the cube's operands: Q, K, V blocks and P on its way back in, each double-buffered.
    l1 = (s1 * d + 2 * s2 * d + s1 * s2) * b * buffers
    # L0A/L0B hold fractal chunks of the contraction (Q @ K^T contracts d, P @ V contracts s2).
    kq = _k_chunk(s1, s2, d, fk, b, buffers, chip)
    kp = _k_chunk(s1, d, s2, fk, b, buffers, chip)
    l0a = max(s1 * kq, s1 * kp) * b * buffers
    l0b = max(kq * s2, kp * d) * b * buffers
    # L0C accumulates whole results in f32 (scores s1 x s2, then P @ V s1 x d), ping-ponged.
    l0c = max(s1 * s2, s1 * d) * F32_BYTES * buffers
    return Budget(score + out + vectors + masks, l1, l0a, l0b, l0c)


@attrs.frozen
class FlashTiling:
    """A FlashAttention kernel's template, blocks and the budgets they use, with the rule that chose them."""

    template: str
    s1: int
    s2: int
    d: int
    buffers: int
    cores: int
    ub_bytes: int
    l1_bytes: int
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int
    segments: int
    work_units: int | None
    skipped_blocks: int
    rule: str

    def to_attr(self) -> dict[str, Any]:
        """The printed `tiling = {...}`: the spec's keys in its order, then the extras."""
        out: dict[str, Any] = {
            "template": self.template, "s1": self.s1, "s2": self.s2, "d": self.d, "buffers": self.buffers,
            "cores": self.cores, "ub_bytes": self.ub_bytes, "segments": self.segments, "l1_bytes": self.l1_bytes,
            "l0a_bytes": self.l0a_bytes, "l0b_bytes": self.l0b_bytes, "l0c_bytes": self.l0c_bytes,
        }
        if self.work_units is not None:
            out["work_units"] = self.work_units
        if self.skipped_blocks:
            out["skipped_blocks"] = self.skipped_blocks
        return out


def bnsd(t: TensorType, layout: str = "BNSD") -> tuple[int | None, ...]:
    """(B, N, S, D) of a rank-4 attention operand in `layout`."""
    b, x, y, d = t.shape
    return (b, x, y, d) if layout == "BNSD" else (b, y, x, d)


def causal_skipped(sq: int, skv: int, s1: int, s2: int) -> int:
    """Blocks per head that a top-left causal mask hides entirely (key block starts after the last row)."""
    if not sq or not skv:
        return 0
    key_blocks = -(-skv // s2)
    skipped = 0
    for r0 in range(0, sq, s1):
        last_row = min(r0 + s1, sq) - 1
        skipped += max(0, key_blocks - (last_row // s2 + 1))
    return skipped


def choose_flash_tiling(q_type: TensorType, k_type: TensorType, v_type: TensorType, causal: bool, has_mask: bool,
                        chip: Target | str, buffers: int = 2, *, layout: str = "BNSD",
                        mask_itemsize: int | None = None) -> FlashTiling:
    """Template and blocks for one flash_attention, as ops-transformer picks them, fitted to `chip`.

    Dynamic (`?`) sequence lengths are tiled for the largest bucket (> 1024 keys, the split
    template), which is valid at every length: the runtime re-tiles once it knows the shape.
    A dynamic head dim leaves the op untiled (raises Untiled): every budget scales with it.
    """
    _check_buffers(buffers)
    chip = _target(chip)
    bsz, n, sq, d = bnsd(q_type, layout)
    skv = bnsd(k_type, layout)[2]
    dv = bnsd(v_type, layout)[3]
    if d is None or dv is None:
        raise Untiled("the head dim is dynamic, and every buffer budget scales with it")
    d = max(d, dv)
    dtype = q_type.dtype
    fm = fractal(chip, dtype)[0]
    mask_bytes = (mask_itemsize if mask_itemsize is not None else dtype.itemsize) if has_mask else 0
    cube = chip.cube_cores

    def units(s1: int) -> int | None:
        if None in (bsz, n, sq):
            return None
        return bsz * n * -(-sq // s1)

    s1_pref = BLOCK if sq is None else max(1, min(BLOCK, sq))
    if skv is not None and skv <= SHORT_KV:
        template = WHOLE_ROW
        rule = f"key sequence {skv} <= {SHORT_KV}: {WHOLE_ROW}, each row's keys in one block (s2 = Skv)"
        s2_options = [(1, max(skv, 1))]
        seg = 2
        while -(-skv // (seg // 2)) > fm:  # split the row into segments until they are one fractal long
            s2 = _align(-(-skv // seg), fm)
            s2_options.append((-(-skv // s2), s2))
            seg *= 2
    else:
        template = SPLIT_KV
        s2_options = [(1, s) for s in _halvings(BLOCK, fm)]
        if skv is None:
            rule = f"key sequence is dynamic: {SPLIT_KV} for the largest bucket (> {LONG_KV}), valid at every length"
        elif skv <= LONG_KV:
            rule = f"key sequence {skv} in ({SHORT_KV}, {LONG_KV}]: {SPLIT_KV} with {BLOCK} x {BLOCK} blocks"
        else:
            rule = f"key sequence {skv} > {LONG_KV}: {SPLIT_KV}, both sequence axes split, s2 = {BLOCK}"
            wide, narrow = (units(s) for s in LONG_S1)
            if s1_pref == LONG_S1[0] and wide is not None and wide < cube and narrow > wide:
                s1_pref = LONG_S1[1]
                rule += (f", s1 = {s1_pref} so the {wide} work units at s1 = {LONG_S1[0]} "
                         f"become {narrow} for {cube} cores")
            else:
                rule += f", s1 = {s1_pref}"

    first_miss: tuple[int, int, tuple[str, int, int]] | None = None
    row_miss = first_miss  # the smallest block of the last s2 that failed outright
    last = first_miss  # the most recent block that did not fit
    for segments, s2 in s2_options:
        if first_miss is not None:
            row_miss = last
        for s1 in _halvings(s1_pref, fm):
            budget = flash_budget(s1, s2, d, dtype, buffers, chip, causal=causal, mask_itemsize=mask_bytes)
            miss = budget.overflow(chip)
            if miss is not None:
                first_miss = first_miss or (s1, s2, miss)
                last = (s1, s2, miss)
                continue
            if first_miss is not None:
                p1, p2, (buf, need, cap) = first_miss
                rule += (f"; {p1} x {p2} needs {need} bytes of {buf}, which holds {cap} on {chip.name} "
                         f"({dtype}, d = {d}, {buffers} buffers)")
                if s2 != p2:  # say what ruled out the larger s2 at its smallest s1
                    l1_, l2_, (buf, need, cap) = row_miss
                    rule += f", and even {l1_} x {l2_} needs {need} bytes of {buf}, which holds {cap}"
                rule += f": shrunk to {s1} x {s2}"
            if segments > 1:
                rule += f" in {segments} key segments combined by log-sum-exp"
            work = units(s1)
            cores = cube if work is None else min(work, cube)
            rule += f"; {'an unknown number of' if work is None else work} work units over {cores} cores"
            skipped = causal_skipped(sq, skv, s1, s2) if causal and sq is not None and skv is not None else 0
            if skipped:
                rule += f"; causal skips {skipped} fully masked blocks per head"
            return FlashTiling(template, s1, s2, d, buffers, cores,
                               budget.ub, budget.l1, budget.l0a, budget.l0b, budget.l0c, segments, work, skipped, rule)
    s1, s2, (buf, need, cap) = last
    raise TilingError(f"no flash_attention tiling fits {chip.name}: even the smallest block s1 = {s1}, s2 = {s2} "
                      f"with head dim {d} ({dtype}, {buffers} buffers) needs {need} bytes of {buf}, which holds {cap}")


@attrs.frozen
class Tiling:
    """A matmul or vector kernel's tiling: template, block sizes by name, budgets, and the rule."""

    template: str
    blocks: dict[str, int]
    buffers: int
    cores: int
    ub_bytes: int
    rule: str
    extra: dict[str, int] = attrs.field(factory=dict)

    def to_attr(self) -> dict[str, Any]:
        """The printed `tiling = {...}`: template, block sizes, buffers, cores, ub_bytes, then extras."""
        return {"template": self.template, **self.blocks, "buffers": self.buffers, "cores": self.cores,
                "ub_bytes": self.ub_bytes, **self.extra}


def _prod(dims: tuple[int | None, ...]) -> int | None:
    return None if None in dims else math.prod(dims)


def matmul_budget(m: int, n: int, k: int, itemsize: int, buffers: int, chip: Target, *,
                  epilogue: bool = False, bias: bool = False) -> Budget:
    """What one matmul work unit keeps on chip for an m x n x k base block."""
    # L0A/L0B double-buffer the fractal operands, L0C the f32 result; L1 stages both operands (and a
    # bias row). Without an epilogue FIXP writes L0C straight to GM; a bias/activation epilogue runs on
    # the vector units, each taking its share of the rows as an f32 tile plus the rounded result.
    rows = -(-m // chip.data["cores"].get("vector_per_cube", 1))
    ub = rows * n * (F32_BYTES + itemsize) * buffers if epilogue else 0
    l1 = (m * k + k * n) * itemsize * buffers + (n * itemsize if bias else 0)
    return Budget(ub, l1, m * k * itemsize * buffers, k * n * itemsize * buffers, m * n * F32_BYTES * buffers)


def choose_matmul_tiling(a: TensorType, b: TensorType, chip: Target | str, buffers: int = 2, *,
                         transpose_a: bool = False, transpose_b: bool = False, epilogue: bool = False) -> Tiling:
    """A cube base block m x n x k fitting L0A, L0B, L0C (and UB for an epilogue), shrinking k, then n, then m."""
    _check_buffers(buffers)
    chip = _target(chip)
    fm, fk, fn = fractal(chip, a.dtype)
    M, K = (a.shape[-1], a.shape[-2]) if transpose_a else (a.shape[-2], a.shape[-1])
    N = b.shape[-2] if transpose_b else b.shape[-1]
    nb = a.dtype.itemsize
    pm, pn, pk = (p if dim is None else min(p, _align(dim, f))
                  for p, dim, f in zip(MATMUL_BLOCK, (M, N, K), (fm, fn, fk)))
    first_miss = None
    for m in _halvings(pm, fm):
        for n in _halvings(pn, fn):
            for k in _halvings(pk, fk):
                budget = matmul_budget(m, n, k, nb, buffers, chip, epilogue=epilogue)
                ub = budget.ub
                miss = budget.overflow(chip)
                if miss is not None:
                    first_miss = first_miss or (m, n, k, miss)
                    last = (m, n, k, miss)
                    continue
                batch = _prod(broadcast_dims(a.shape[:-2], b.shape[:-2]))
                work = None if None in (batch, M, N) else batch * -(-M // m) * -(-N // n)
                rule = f"base block {m} x {n} x {k} ({a.dtype}, {buffers} buffers)"
                if first_miss:
                    pm_, pn_, pk_, (buf, need, cap) = first_miss
                    rule += f"; {pm_} x {pn_} x {pk_} needs {need} bytes of {buf}, which holds {cap} on {chip.name}"
                cores = chip.cube_cores if work is None else min(work, chip.cube_cores)
                rule += f"; {'an unknown number of' if work is None else work} work units over {cores} cores"
                template = "MatmulEpilogue" if epilogue else "MatmulBasicBlock"
                return Tiling(template, {"m": m, "n": n, "k": k}, buffers, cores, ub, rule,
                              {"l1_bytes": budget.l1, "l0a_bytes": budget.l0a, "l0b_bytes": budget.l0b,
                               "l0c_bytes": budget.l0c})
    m, n, k, (buf, need, cap) = last
    raise TilingError(f"no matmul tiling fits {chip.name}: even {m} x {n} x {k} needs {need} bytes of {buf}, "
                      f"which holds {cap}")


def _row_extent(name: str, x: TensorType, attributes: dict[str, Any]) -> tuple[int | None, int | None]:
    """(rows, row length) of a row-wise op: the row is what one output element (or row) reduces over."""
    rank = x.rank
    if name == "ge.softmax":
        axes = [attributes.get("axis", -1) % rank]
    elif name == "ge.layer_norm":
        axes = list(range(attributes.get("axis", -1) % rank, rank))
    elif name == "ge.rms_norm":
        axes = [rank - 1]
    else:
        axes = [a % rank for a in attributes.get("axes", [])] if rank else []
    row = _prod(tuple(x.shape[i] for i in axes))
    rows = _prod(tuple(d for i, d in enumerate(x.shape) if i not in axes))
    return rows, row


def choose_vector_tiling(name: str, operands: list[TensorType], results: list[TensorType], chip: Target | str,
                         buffers: int = 2, attributes: dict[str, Any] | None = None) -> Tiling:
    """A UB tile for a vector kernel: whole rows for row-wise ops (segmented when one cannot fit), else a flat chunk."""
    _check_buffers(buffers)
    chip = _target(chip)
    attributes = attributes or {}
    ub, block = chip.buffer_bytes("ub"), chip.data["memory"]["ub_block_bytes"]
    vcores = chip.vector_cores
    data = operands + results
    sizes = [_prod(t.shape) for t in data]
    total = None if None in sizes else max(sizes, default=1)
    # operands smaller than the tile's tensors (broadcast scalars, gamma/beta, bias rows) are loaded
    # once and stay resident; the rest stream through UB
    resident = [t for t, n in zip(operands, sizes) if total is not None and n < total and t.nbytes * 8 <= ub]
    fixed = sum(_align(t.nbytes, block) for t in resident)
    streamed = [t for t in data if not any(t is r for r in resident)]
    # Bytes per streamed element: each operand and result slice, double-buffered so MTE2/MTE3 move
    # the next tile while the vector unit works, plus an f32 working copy when 16-bit floats are
    # computed (one per step of a fused chain: a conservative bound, no reuse). Copies move each
    # element once in and once out, however many pieces they cut or join.
    if name in COPY_OPS:
        per_elem = 2 * operands[0].dtype.itemsize * buffers
    else:
        per_elem = sum(t.dtype.itemsize for t in streamed) * buffers
        steps = len(attributes.get("body", ())) or any(t.dtype in (DType.f16, DType.bf16) for t in data)
        per_elem += F32_BYTES * steps
    if name in ROW_OPS:
        x = operands[0]
        rows, row = _row_extent(name, x, attributes)
        if row is None:
            raise Untiled("the reduced extent is dynamic, and a row must fit in UB")
        # per row one UB block for each of its two statistics (max and sum, or mean and variance)
        row_stats = 2 * block
        segments, seg_len = 1, row
        while fixed + _align(seg_len * per_elem, block) + row_stats > ub:
            if seg_len <= block:
                need = fixed + _align(seg_len * per_elem, block) + row_stats
                raise TilingError(f"no {name[3:]} tiling fits {chip.name}: even a {seg_len}-element piece of a row "
                                  f"needs {need} bytes of UB, which holds {ub}")
            segments *= 2
            seg_len = -(-row // segments)
        row_bytes = _align(seg_len * per_elem, block) + row_stats
        fit = (ub - fixed) // row_bytes
        tile_rows = fit if rows is None else max(1, min(fit, rows, -(-rows // vcores)))
        work = None if rows is None else -(-rows // tile_rows) * segments
        rule = f"rows of {row} elements, {tile_rows} rows a tile"
        if segments > 1:
            rule += (f"; a row needs more than UB holds ({ub}), so {segments} segments of {seg_len} "
                     f"combined by the reduction")
        cores = vcores if work is None else min(work, vcores)
        rule += f"; {'an unknown number of' if work is None else work} work units over {cores} cores"
        return Tiling("VectorRow", {"rows": tile_rows, "cols": seg_len}, buffers, cores,
                      fixed + tile_rows * row_bytes, rule, {"segments": segments})
    # a flat chunk in whole UB blocks for every dtype (block elements is a multiple of 32 bytes at 1 byte and up)
    fit = ((ub - fixed) // per_elem) // block * block
    if fit < block:
        raise TilingError(f"no {name[3:]} tiling fits {chip.name}: {block} elements need "
                          f"{fixed + block * per_elem} bytes of UB, which holds {ub}")
    elems = fit if total is None else max(block, min(fit, _align(-(-total // vcores), block)))
    work = None if total is None else -(-total // elems)
    cores = vcores if work is None else min(work, vcores)
    rule = (f"{elems} elements a tile, {per_elem} UB bytes each with {buffers} buffers; "
            f"{'an unknown number of' if work is None else work} work units over {cores} cores")
    return Tiling(COPY_OPS.get(name, "VectorElementwise"), {"elems": elems}, buffers, cores,
                  fixed + elems * per_elem, rule)


# the block dimension that splits independent work, per template family: shrinking it changes how
# work is cut into units, never the order in which any result element is summed
_PARALLEL_DIM = {"S1Bn2gs1": "s1", "S1s2Bn2gs1": "s1", "MatmulBasicBlock": "m", "MatmulEpilogue": "m",
                 "VectorRow": "rows"}
SMALLEST_BLOCK = 16


def smaller_tiling(tiling: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """A tiling that keeps less on chip than `tiling` and gives bit-identical results, with what changed.

    What the Runtime asks GE for when a kernel's tile does not fit at run time: the parallel block
    dimension is halved (query rows for FlashAttention, output rows for matmul, rows or elements for
    vector tiles). None when it is already at its smallest.
    """
    template = tiling.get("template", "")
    key = _PARALLEL_DIM.get(template, "elems" if "elems" in tiling else None)
    if key is None or key not in tiling:
        return None
    least = 1 if key == "rows" else (SMALLEST_BLOCK if key in ("s1", "m") else 32)
    value = int(tiling[key])
    if value // 2 < least:
        return None
    new = dict(tiling, **{key: value // 2})
    if "ub_bytes" in new:
        new["ub_bytes"] = -(-int(tiling["ub_bytes"]) // 2)  # an upper bound: the halved dimension scales it
    return new, f"{key} {value} -> {value // 2}"
