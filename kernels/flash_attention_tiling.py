"""FlashAttention's tiling (ops-transformer's flash_attention_score op_host tiling): templates, blocks, budgets.

Pure functions of the operands' types, the op's attributes and a target's numbers
(target_npu/targets/*.toml). Every tiling is checked against the real buffer capacities: the
preferred block is shrunk (s1, then s2, multiples of the cube fractal), then the keys of a row are
split into segments, and only when even the smallest tile overflows is it an error naming the buffer.

Decode-shaped calls (each head's query rows fit one row block, the keys are longer than one) take
flash-decoding (FusedInferAttentionScore's decode path) where it pays: the query rows of the heads
sharing a key/value head are stacked as one unit's rows, the keys are split into `segments` parts
across the cores the rows leave idle, each work unit (batch, key/value head, part) computes a partial
softmax-weighted sum with its running max and sum, and a log-sum-exp step combines the parts.
"""

from __future__ import annotations

import attrs

from geir.kernels.tiling import (
    F32_BYTES,
    SMALLEST_BLOCK,
    Budget,
    KernelTiling,
    Miss,
    OpSignature,
    TilingError,
    Untiled,
    align,
    check_buffers,
    choice,
    fractal,
    halve,
    halvings,
    never_printed,
    printed_if_set,
    resized,
    with_shapes,
)
from geir.kernels.flash_attention_a2 import (
    B_SPLIT,
    PRELOAD,
    S1S2,
    S2_BLOCK,
    SAME_AB,
    A2Choice,
    a2_template,
    cv_budget,
    vector_rows,
    workspace_per_core,
)
from geir.ops.linalg import bnsd
from geir.target_npu.target import Target
from geir.types import DType, TensorType

# ops-transformer's FlashAttention template policy (flash_attention_score tiling): key rows up to
# SHORT_KV stay whole ("S1Bn2gs1": s1 split, s2 not); longer ones are split on both sequence axes
# ("S1s2Bn2gs1") with 128 x 128 basic blocks, and past LONG_KV s1 may drop to 64 to fill the cores.
SHORT_KV = 128
LONG_KV = 1024
BLOCK = 128
LONG_S1 = (128, 64)
WHOLE_ROW, SPLIT_KV = "S1Bn2gs1", "S1s2Bn2gs1"
# flash-decoding: a unit is (batch, key/value head, key part), its group's query rows stacked as s1
FLASH_DECODE = "Bn2S2FD"
# FlashAttention-2's num_splits_heuristic: the fewest key parts whose waves keep at least this share
# of the best split's core utilisation busy
SPLIT_EFFICIENCY = 0.85
# running max, running sum and the rescale factor exp(m_old - m_new): one f32 per row each
FLASH_ROW_VECTORS = 3


@attrs.frozen(kw_only=True)
class FlashTiling(KernelTiling):
    """A FlashAttention kernel's template, blocks and the budgets they use, with the rule that chose them."""

    TEMPLATES = (WHOLE_ROW, SPLIT_KV, FLASH_DECODE)

    template: str
    s1: int
    s2: int
    d: int
    buffers: int
    cores: int
    ub_bytes: int
    segments: int
    l1_bytes: int
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int
    work_units: int | None = printed_if_set(None)
    skipped_blocks: int = printed_if_set(0)
    # the CV-split schedule of a chip whose cube and vector units are separate cores (Atlas A2): how many mm1
    # the AIC issues ahead of mm2, and the rows of each AIV's vector sub-block; 0: the on-chip schedule
    preload: int = printed_if_set(0)
    v_rows: int = printed_if_set(0)
    rule: str = never_printed("")
    # the template ops-transformer's design document picks and the condition that picked it (CV-split tilings)
    design: A2Choice | None = never_printed(None)

    @property
    def cv_split(self) -> bool:
        """Whether this tiling runs the CV-split schedule (cube and vector cores exchanging S and P through GM)."""
        return self.preload > 0

    @property
    def kv_splits(self) -> int:
        """How many parts the keys of a row are split into (flash-decoding's parts, or key segments)."""
        return max(self.segments, 1)


def decode_rows(n: int | None, nkv: int | None, sq: int | None, skv: int | None) -> int | None:
    """The stacked query rows (group x Sq) of one key/value head when a call is decode-shaped, else None.

    Decode-shaped: each head's query rows fit one row block and the keys are longer than one block.
    The rows of the heads sharing a K/V head are stacked (IncreFlashAttention folds the group into the
    cube's M), in row blocks of BLOCK when they are more.
    """
    if None in (n, nkv, sq, skv) or not nkv or not sq or sq > BLOCK or skv <= SHORT_KV:
        return None
    return (n // nkv) * sq


def kv_parts(skv: int, units: int, cores: int, s2: int) -> int:
    """Flash-decoding's key parts for `units` (batch, K/V head) units: FlashAttention-2's num_splits_heuristic.

    Each part count p gives units x p work units in waves of `cores`; its efficiency is the share of
    the cores its waves keep busy. The fewest parts within SPLIT_EFFICIENCY of the best efficiency win,
    counting only part counts that change the key blocks per part; a part holds at least one key block
    (IncreFlashAttention keeps 512 keys a part on the real chip; on this model one block still pays:
    B 1, N 8, Skv 512 takes 4.78 us in 1 part, 2.50 us in 2).
    """
    blocks = -(-skv // s2)

    def efficiency(p: int) -> float:
        waves = units * p / cores
        return waves / -(-units * p // cores)

    eligible = [p for p in range(1, min(blocks, cores) + 1) if p == 1 or -(-blocks // p) != -(-blocks // (p - 1))]
    best = max(efficiency(p) for p in eligible)
    parts = min(p for p in eligible if efficiency(p) >= SPLIT_EFFICIENCY * best)
    per = -(-blocks // parts)
    return -(-blocks // per)  # no empty part: 9 blocks in 4 parts are 3 + 3 + 3


def decode_units(bsz: int, n: int, nkv: int, sq: int, s1: int) -> int:
    """Flash-decoding's work units before the keys are split: B x Nkv x the row blocks of a group's stacked rows."""
    return bsz * nkv * -(-(n // nkv) * sq // s1)


def decode_skipped(n: int, nkv: int, sq: int, skv: int, s1: int, s2: int) -> int:
    """Key blocks per K/V head a top-left causal mask hides from flash-decoding's units: every stacked row lies below Sq."""
    return -(-(n // nkv) * sq // s1) * causal_skipped(sq, skv, sq, s2)


def decode_plan(bsz: int | None, n: int | None, nkv: int | None, sq: int | None, skv: int | None, fm: int,
                cores: int) -> tuple[int, list[tuple[int, int]], str] | None:
    """(s1, [(key parts, s2)] to try, the rule) of flash-decoding where it pays for this call, else None.

    It pays where splitting the keys fills the cores better, or where a group's stacked rows share
    one row block (K and V are then read once per group, not once per head).
    """
    rows = decode_rows(n, nkv, sq, skv) if bsz is not None else None
    if rows is None:
        return None
    units = decode_units(bsz, n, nkv, sq, BLOCK)
    parts = kv_parts(skv, units, cores, BLOCK)
    if parts == 1 and not sq < rows <= BLOCK:
        return None
    group = n // nkv
    what = f"Sq = {sq}" + (f" x {group} grouped heads" if group > 1 else "")
    if rows > BLOCK:
        what += f" in row blocks of {BLOCK}"
    rule = f"flash-decoding: {what} leaves {units} work unit(s) for {cores} cores: "
    if parts > 1:
        blocks = -(-skv // BLOCK)
        per = -(-blocks // parts) * BLOCK  # whole key blocks per part
        rule += f"Skv {skv} split in {parts} parts of up to {per} keys, combined by log-sum-exp"
    else:
        rule += f"Skv {skv} kept whole (more parts would not fill the cores better)"
    return min(rows, BLOCK), [(kv_parts(skv, units, cores, s2), s2) for s2 in halvings(BLOCK, fm)], rule


def k_chunk(m: int, n: int, k: int, kmin: int, nbytes: int, buffers: int, chip: Target) -> int:
    """The largest contraction chunk whose L0A (m x k) and L0B (k x n) fragments fit; kmin when none does."""
    for c in halvings(align(k, kmin), kmin):
        if m * c * nbytes * buffers <= chip.buffer_bytes("l0a") and \
                c * n * nbytes * buffers <= chip.buffer_bytes("l0b"):
            return c
    return kmin


def flash_budget(s1: int, s2: int, d: int, dtype: DType, buffers: int, chip: Target, *,
                 causal: bool = False, mask_itemsize: int = 0) -> Budget:
    """What one FlashAttention work unit keeps on chip for an s1 x s2 block with head dim d."""
    fm, fk, _ = fractal(chip, dtype)
    s1, s2, d = align(s1, fm), align(s2, fm), align(d, fm)
    b = dtype.itemsize
    # Each vector unit paired with the cube takes its share of the block's rows (910B: one AIC, two
    # AIVs, each with its own UB), so UB is budgeted per vector unit for s1 / vector_per_cube rows.
    rows = -(-s1 // chip.vector_per_cube)
    # Score side, X = (4 / bytes + 1) * buffers in units of the input dtype: the f32 scores the cube
    # delivers plus their softmax P in the input dtype for the second matmul, both double-buffered so
    # FIXP lands block j+1 while the vector unit works on block j (f16: 6 bytes per element, f32: 8).
    score = rows * s2 * (F32_BYTES + b) * buffers
    # Output side, Y = 8 / bytes: the f32 accumulator O plus one f32 landing buffer for each block's
    # P @ V; one buffer suffices because it is folded into O before the next P exists, and the cube
    # fills that gap with the next Q @ K^T.
    out = rows * d * 2 * F32_BYTES
    # Row statistics: one f32 per row each, padded to a UB block as the vector unit addresses them.
    vectors = FLASH_ROW_VECTORS * rows * chip.memory.ub_block_bytes
    # Masks arrive as s1 x s2 tiles like K and V: a 1-byte causal tile, and the user's mask.
    masks = rows * s2 * ((1 if causal else 0) + mask_itemsize) * buffers
    # L1 holds the cube's operands: Q, K, V blocks and P on its way back in, each double-buffered.
    l1 = (s1 * d + 2 * s2 * d + s1 * s2) * b * buffers
    # L0A/L0B hold fractal chunks of the contraction (Q @ K^T contracts d, P @ V contracts s2).
    kq = k_chunk(s1, s2, d, fk, b, buffers, chip)
    kp = k_chunk(s1, d, s2, fk, b, buffers, chip)
    l0a = max(s1 * kq, s1 * kp) * b * buffers
    l0b = max(kq * s2, kp * d) * b * buffers
    # L0C accumulates whole results in f32 (scores s1 x s2, then P @ V s1 x d), ping-ponged.
    l0c = max(s1 * s2, s1 * d) * F32_BYTES * buffers
    return Budget(score + out + vectors + masks, l1, l0a, l0b, l0c)


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


def whole_row_options(skv: int, fm: int) -> list[tuple[int, int]]:
    """(key segments, s2) for a short key row: whole, then split into segments until one is a fractal long."""
    options = [(1, max(skv, 1))]
    seg = 2
    while -(-skv // (seg // 2)) > fm:
        s2 = align(-(-skv // seg), fm)
        options.append((-(-skv // s2), s2))
        seg *= 2
    return options


def choose_flash_tiling(q_type: TensorType, k_type: TensorType, v_type: TensorType, causal: bool, has_mask: bool,
                        chip: Target, buffers: int = 2, *, layout: str = "BNSD",
                        mask_itemsize: int | None = None) -> FlashTiling:
    """Template and blocks for one flash_attention, as ops-transformer picks them, fitted to `chip`.

    Dynamic (`?`) sequence lengths are tiled for the largest bucket (> 1024 keys, the split
    template), which is valid at every length: the runtime re-tiles once it knows the shape.
    A dynamic head dim leaves the op untiled (raises Untiled): every budget scales with it.
    """
    check_buffers(buffers)
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
    nkv = bnsd(k_type, layout)[1]
    decode = decode_plan(bsz, n, nkv, sq, skv, fm, cube)
    if decode is None and chip.separate_cube_vector:
        return choose_cv_tiling(bsz, n, nkv, sq, skv, d, dtype, causal, mask_bytes, chip, buffers=buffers)
    if decode is not None:
        template = FLASH_DECODE
        s1_pref, s2_options, rule = decode
    elif skv is not None and skv <= SHORT_KV:
        template = WHOLE_ROW
        rule = f"key sequence {skv} <= {SHORT_KV}: {WHOLE_ROW}, each row's keys in one block (s2 = Skv)"
        s2_options = whole_row_options(skv, fm)
    else:
        template = SPLIT_KV
        s2_options = [(1, s) for s in halvings(BLOCK, fm)]
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

    # flash-decoding on a chip whose cube and vector units are separate cores runs the CV-split schedule, as
    # IncreFlashAttention does on Atlas A2: its block's budget is the CV block's
    cv_decode = template == FLASH_DECODE and chip.separate_cube_vector
    v_rows = 0
    first_miss: tuple[int, int, tuple[str, int, int]] | None = None
    row_miss = first_miss  # the smallest block of the last s2 that failed outright
    last = first_miss  # the most recent block that did not fit
    for segments, s2 in s2_options:
        if first_miss is not None:
            row_miss = last
        for s1 in halvings(s1_pref, fm):
            if cv_decode:
                v_rows, budget = cv_fit(s1, s2, d, dtype, chip, buffers, causal, mask_bytes)
            else:
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
            if segments > 1 and template != FLASH_DECODE:
                rule += f" in {segments} key segments combined by log-sum-exp"
            work = units(s1) if template != FLASH_DECODE else decode_units(bsz, n, nkv, sq, s1) * segments
            cores = cube if work is None else min(work, cube)
            rule += f"; {'an unknown number of' if work is None else work} work units over {cores} cores"
            skipped = causal_skipped(sq, skv, s1, s2) if causal and sq is not None and skv is not None else 0
            if template == FLASH_DECODE and causal:  # stacked rows all lie at positions < Sq
                skipped = decode_skipped(n, nkv, sq, skv, s1, s2)
            if skipped:
                rule += f"; causal skips {skipped} fully masked blocks per head"
            if cv_decode:
                rule += (f"; CV-split: each AIV takes {-(-s1 // chip.vector_per_cube)} rows "
                         f"in {v_rows} x {s2} f32 vector blocks, the cube issues {PRELOAD} mm1 ahead")
            return FlashTiling(template=template, s1=s1, s2=s2, d=d, buffers=buffers, cores=cores, ub_bytes=budget.ub,
                               segments=segments, l1_bytes=budget.l1, l0a_bytes=budget.l0a, l0b_bytes=budget.l0b,
                               l0c_bytes=budget.l0c, work_units=work, skipped_blocks=skipped,
                               preload=PRELOAD if cv_decode else 0, v_rows=v_rows, rule=rule)
    s1, s2, (buf, need, cap) = last
    raise TilingError(f"no flash_attention tiling fits {chip.name}: even the smallest block s1 = {s1}, s2 = {s2} "
                      f"with head dim {d} ({dtype}, {buffers} buffers) needs {need} bytes of {buf}, which holds {cap}")



def a2_design(bsz: int | None, n: int | None, nkv: int | None, sq: int | None, skv: int | None, d: int,
              dtype: DType, chip: Target) -> tuple[A2Choice, A2Choice]:
    """(the design document's template, the template whose blocks GEIR runs) for one attention on an A2 chip."""
    if None in (bsz, n, nkv, sq, skv) or not nkv or n % nkv:
        dynamic = A2Choice(S1S2, "a sequence length or head count is dynamic: the blocks of S2 > 1024, valid at "
                                 "every length (the runtime re-tiles once it knows the shape)", BLOCK, S2_BLOCK)
        return dynamic, dynamic
    design = a2_template(bsz, nkv, n // nkv, sq, skv, d, dtype, chip.vector_cores)
    runs = design if design.template != SAME_AB else \
        a2_template(bsz, nkv, n // nkv, sq, skv, d, dtype, chip.vector_cores, same_ab=False)
    if runs.template == B_SPLIT:
        runs = A2Choice(B_SPLIT, runs.condition, align(sq, 16), skv)
    return design, runs


def choose_cv_tiling(bsz: int | None, n: int | None, nkv: int | None, sq: int | None, skv: int | None, d: int,
                     dtype: DType, causal: bool, mask_bytes: int, chip: Target, preload: int = PRELOAD,
                     blocks: tuple[int, int] | None = None, buffers: int = 2) -> FlashTiling:
    """The CV-split tiling on a chip whose cube and vector units are separate cores: the design document's
    template and CV block (`blocks` instead when given), the vector sub-block that fits UB, shrunk where a
    buffer overflows (v_rows, then S1.i)."""
    design, runs = a2_design(bsz, n, nkv, sq, skv, d, dtype, chip)
    s1_0, s2 = blocks or (runs.s1_i, runs.s2_i)
    s1_0, s2 = max(s1_0, SMALLEST_BLOCK), max(s2, 1)  # empty sequences still get a (never used) block
    template = SPLIT_KV if s2 < (skv or s2 + 1) else WHOLE_ROW
    rule = design.render() + (f" ({design.runs})" if design.runs else "")
    if not design.s1_i:  # the document gives no block for this template: say which one GEIR runs
        rule += f"; CV block {s1_0} x {s2}"
    first = None
    vpc = chip.vector_per_cube
    for s1 in halvings(s1_0, SMALLEST_BLOCK):
        for v_rows in halvings(vector_rows(s2, -(-s1 // vpc)), 1):
            budget = cv_budget(s1, s2, d, v_rows, dtype, chip, buffers=buffers, causal=causal,
                               mask_itemsize=mask_bytes)
            miss = budget.overflow(chip)
            if miss is not None:
                first = first or (s1, v_rows, miss)
                last = (s1, v_rows, miss)
                continue
            if first is not None:
                p1, pv, (buf, need, cap) = first
                rule += (f"; S1.i {p1} with {pv}-row vector blocks needs {need} bytes of {buf}, which holds {cap} on "
                         f"{chip.name} ({dtype}, d = {d}): shrunk to S1.i {s1}, {v_rows}-row vector blocks")
            work = None if None in (bsz, n, sq) else bsz * n * -(-sq // s1)
            cores = chip.cube_cores if work is None else min(work, chip.cube_cores)
            skipped = causal_skipped(sq, skv, s1, s2) if causal and sq is not None and skv is not None else 0
            ws = workspace_per_core(s1, s2, d, dtype.itemsize, preload)
            rule += (f"; each AIV takes {-(-s1 // vpc)} rows in {v_rows} x {s2} f32 vector blocks; the cube issues "
                     f"{preload} mm1 ahead; {'an unknown number of' if work is None else work} work units over "
                     f"{cores} AIC ({vpc} AIV each); GM workspace {ws} bytes per AIC")
            if skipped:
                rule += f"; causal skips {skipped} fully masked blocks per head"
            return FlashTiling(template=template, s1=s1, s2=s2, d=d, buffers=buffers, cores=cores, ub_bytes=budget.ub,
                               segments=1, l1_bytes=budget.l1, l0a_bytes=budget.l0a, l0b_bytes=budget.l0b,
                               l0c_bytes=budget.l0c, work_units=work, skipped_blocks=skipped, preload=preload,
                               v_rows=v_rows, rule=rule, design=design)
    s1, v_rows, (buf, need, cap) = last
    raise TilingError(f"no flash_attention tiling fits {chip.name}: even S1.i = {s1} x S2.i = {s2} with {v_rows}-row "
                      f"vector blocks (head dim {d}, {dtype}) needs {need} bytes of {buf}, which holds {cap}")


# --- the kernel's tiling interface (geir.kernels.base.Kernel) ----------------------------------------

def _mask_and_pse(sig: OpSignature) -> tuple[TensorType | None, TensorType | None]:
    """The mask's and the pse's types of one flash_attention (None where absent): a pse is the last operand."""
    extras = list(sig.operands[3:])
    pse = extras.pop() if sig.attr("has_pse", False) and extras else None
    return (extras[0] if extras else None), pse


def _problem(sig: OpSignature) -> tuple[TensorType, TensorType, TensorType, bool, bool, str, int | None]:
    """q, k, v types, causal, has a mask, layout and the mask's itemsize of one flash_attention (a pse's tile sits
    beside the mask's in the UB: its itemsize counts with the mask's)."""
    q, k, v = sig.operands[:3]
    mask, pse = _mask_and_pse(sig)
    tiles = [t for t in (mask, pse) if t is not None]
    return (q, k, v, bool(sig.attr("causal", False)), bool(tiles), sig.attr("layout", "BNSD"),
            sum(t.dtype.itemsize for t in tiles) if tiles else None)


def choose(sig: OpSignature, chip: Target, buffers: int = 2) -> FlashTiling | Miss:
    """The rule's tiling for one flash_attention, or why there is none (on a chip whose cube and vector units are
    separate cores, Atlas A2, the CV-split tiling of ops-transformer's design document)."""
    q, k, v, causal, has_mask, layout, mask_itemsize = _problem(sig)
    return choice(lambda: choose_flash_tiling(q, k, v, causal, has_mask, chip, buffers, layout=layout,
                                              mask_itemsize=mask_itemsize))


def cv_fit(s1: int, s2: int, d: int, dtype: DType, chip: Target, buffers: int, causal: bool,
           mask_bytes: int) -> tuple[int, Budget]:
    """(vector sub-block rows, budget) of an s1 x s2 CV block: the most rows whose UB fits, else the fewest's."""
    vpc = chip.vector_per_cube
    for v_rows in halvings(vector_rows(s2, -(-s1 // vpc)), 1):
        b = cv_budget(s1, s2, d, v_rows, dtype, chip, buffers=buffers, causal=causal, mask_itemsize=mask_bytes)
        if b.overflow(chip) is None:
            return v_rows, b
    return v_rows, b


def budget(tiling: FlashTiling, sig: OpSignature, chip: Target) -> Budget:
    """What one work unit of this tiling keeps on chip for this op."""
    if tiling.cv_split:
        q, _, _, causal, has_mask, _, mask_itemsize = _problem(sig)
        return cv_budget(tiling.s1, tiling.s2, tiling.d, tiling.v_rows, q.dtype, chip, buffers=tiling.buffers,
                         causal=causal, mask_itemsize=(mask_itemsize or q.dtype.itemsize) if has_mask else 0)
    return _budget(tiling.s1, tiling.s2, tiling.d, tiling.buffers, sig, chip)


def workspace_bytes(tiling: FlashTiling, sig: OpSignature) -> int:
    """GM workspace the launch needs beside its operands and results: the CV-split schedule's S, P and P V slots
    of every AIC it runs on (0 on the on-chip schedule)."""
    if not tiling.cv_split:
        return 0
    return tiling.cores * workspace_per_core(tiling.s1, tiling.s2, tiling.d, sig.operands[0].dtype.itemsize,
                                             tiling.preload)


def _budget(s1: int, s2: int, d: int, buffers: int, sig: OpSignature, chip: Target) -> Budget:
    q, _, _, causal, has_mask, _, mask_itemsize = _problem(sig)
    mask_bytes = (mask_itemsize or q.dtype.itemsize) if has_mask else 0
    return flash_budget(s1, s2, d, q.dtype, buffers, chip, causal=causal, mask_itemsize=mask_bytes)


def shrink(tiling: FlashTiling) -> tuple[FlashTiling, str] | None:
    """Fewer query rows per work unit (s1 halved): less on chip, bit-identical results; None at the smallest."""
    return halve(tiling, "s1", SMALLEST_BLOCK)


def candidates(sig: OpSignature, chip: Target, buffers: int = 2) -> list[FlashTiling]:
    """Every legal tiling of one flash_attention: each template's s1 x s2 blocks (and key segments) that fit."""
    q, k, v, causal, has_mask, layout, mask_itemsize = _problem(sig)
    bsz, n, sq, d = bnsd(q, layout)
    skv = bnsd(k, layout)[2]
    dv = bnsd(v, layout)[3]
    if None in (bsz, n, sq, skv, d, dv):
        return []
    d = max(d, dv)
    try:
        fm = fractal(chip, q.dtype)[0]
    except Untiled:
        return []
    nkv = bnsd(k, layout)[1]
    decode = decode_plan(bsz, n, nkv, sq, skv, fm, chip.cube_cores)
    if decode is not None:  # flash-decoding's blocks, each s2 with the rule's key parts
        rows, options, _ = decode
        out = []
        mask_bytes = (mask_itemsize or q.dtype.itemsize) if has_mask else 0
        for segments, s2 in options:
            for s1 in halvings(rows, fm):
                rule = f"candidate {FLASH_DECODE} {s1} x {s2} in {segments} key parts"
                if not chip.separate_cube_vector:
                    if _budget(s1, s2, d, buffers, sig, chip).overflow(chip) is None:
                        out.append(_tiling(FLASH_DECODE, s1, s2, d, buffers, segments, bsz, n, sq, skv, causal, chip,
                                           sig, rule, decode_units(bsz, n, nkv, sq, s1) * segments,
                                           decode_skipped(n, nkv, sq, skv, s1, s2) if causal else 0))
                    continue
                v_rows, b = cv_fit(s1, s2, d, q.dtype, chip, buffers, causal, mask_bytes)
                if b.overflow(chip) is None:
                    work = decode_units(bsz, n, nkv, sq, s1) * segments
                    for preload in (1, 2):  # as the CV-split candidates
                        out.append(FlashTiling(
                            template=FLASH_DECODE, s1=s1, s2=s2, d=d, buffers=buffers,
                            cores=min(work, chip.cube_cores), ub_bytes=b.ub, segments=segments, l1_bytes=b.l1,
                            l0a_bytes=b.l0a, l0b_bytes=b.l0b, l0c_bytes=b.l0c, work_units=work,
                            skipped_blocks=decode_skipped(n, nkv, sq, skv, s1, s2) if causal else 0,
                            preload=preload, v_rows=v_rows, rule=f"{rule}, CV-split, preload {preload}"))
        return out
    if chip.separate_cube_vector:
        return cv_candidates(bsz, n, nkv, sq, skv, d, q.dtype, causal, has_mask, mask_itemsize, chip, buffers)
    if skv <= SHORT_KV:
        template, options = WHOLE_ROW, whole_row_options(skv, fm)
    else:  # the rule's blocks and larger ones, up to a key block of 4 x BLOCK
        template, options = SPLIT_KV, [(1, s2) for s2 in halvings(min(4 * BLOCK, align(skv, fm)), fm)]
    out = []
    for segments, s2 in options:
        for s1 in halvings(max(1, min(2 * BLOCK, sq)), fm):
            if _budget(s1, s2, d, buffers, sig, chip).overflow(chip) is None:
                rule = f"candidate {template} {s1} x {s2}" + (f" in {segments} key segments" if segments > 1 else "")
                out.append(_tiling(template, s1, s2, d, buffers, segments, bsz, n, sq, skv, causal, chip, sig, rule))
    return out


def cv_candidates(bsz: int, n: int, nkv: int, sq: int, skv: int, d: int, dtype: DType, causal: bool, has_mask: bool,
                  mask_itemsize: int | None, chip: Target, buffers: int = 2) -> list[FlashTiling]:
    """The CV-split tilings to try on an A2 chip: CV blocks of S1.i 32 to 256 and S2.i 256 to 1024 (or the whole
    key row when shorter), each with preload 1 and 2, where they fit."""
    mask_bytes = (mask_itemsize or dtype.itemsize) if has_mask else 0
    widths = sorted({min(w, skv) for w in (256, 512, S2_BLOCK)}, reverse=True)
    out = []
    for s2 in widths:
        for s1 in halvings(max(16, min(2 * BLOCK, align(sq, 16))), 32):
            for preload in (1, 2):
                try:
                    t = choose_cv_tiling(bsz, n, nkv, sq, skv, d, dtype, causal, mask_bytes, chip, preload, (s1, s2),
                                         buffers)
                except TilingError:
                    continue
                if t.s1 == s1:  # not shrunk into another candidate
                    out.append(attrs.evolve(t, rule=f"candidate CV-split {s1} x {s2}, preload {preload}"))
    return out


def _tiling(template: str, s1: int, s2: int, d: int, buffers: int, segments: int, bsz: int, n: int, sq: int,
            skv: int, causal: bool, chip: Target, sig: OpSignature, rule: str, work: int | None = None,
            skipped: int | None = None) -> FlashTiling:
    work = bsz * n * -(-sq // s1) if work is None else work
    b = _budget(s1, s2, d, buffers, sig, chip)
    if skipped is None:
        skipped = causal_skipped(sq, skv, s1, s2) if causal else 0
    return FlashTiling(template=template, s1=s1, s2=s2, d=d, buffers=buffers, cores=min(work, chip.cube_cores),
                       ub_bytes=b.ub, segments=segments, l1_bytes=b.l1, l0a_bytes=b.l0a, l0b_bytes=b.l0b,
                       l0c_bytes=b.l0c, work_units=work, skipped_blocks=skipped, rule=rule)


def check_instance(sig: OpSignature, tiling: FlashTiling) -> OpSignature:
    """One batch and one K/V head with the query heads that share it: each query row still meets every key
    in the same blocks (and key segments), so its numbers are those of the whole op."""
    q, k, v, _, _, layout, _ = _problem(sig)
    if None in bnsd(q, layout) + bnsd(k, layout) + bnsd(v, layout):
        return sig
    n, nkv = bnsd(q, layout)[1], bnsd(k, layout)[1]
    extras = [t for t in _mask_and_pse(sig) if t is not None]
    group = n // nkv if nkv and n % nkv == 0 else n
    heads = 1 if layout == "BNSD" else 2
    # a mask or pse that differs per head keeps every head (its head axis is where BNSD puts it)
    if any(t.rank == 4 and t.shape[1] not in (1,) for t in extras):
        group, kv_heads = n, nkv
    else:
        kv_heads = 1
    q2, k2, v2 = (resized(resized(t, 0, 1), heads, h) for t, h in ((q, group), (k, kv_heads), (v, kv_heads)))
    operands = [q2, k2, v2]
    for t in extras:
        operands.append(resized(t, 0, 1) if t.rank == 4 else t)
    out = sig.results[0]
    results = [resized(resized(out, 0, 1), heads, group) if out is not None and out.rank == 4 else out]
    return with_shapes(sig, operands, results)
