"""FlashAttention's CV-split schedule: the kernel as Atlas A2 (910B) runs it, cube and vector on separate cores.

On A2 an AIC (cube core) and its two AIVs (vector cores) share no buffer: S = Q K^T and P = softmax(S) go
through a workspace in GM (served by the L2), as ops-transformer's FlashAttentionScore design document
describes (`attention/flash_attention_score/docs/FA算子设计介绍.md`, sections 3 and 6, hicann/ops-transformer
36c13d0). A lane of `Cores` is one AIC with its AIV pair: MTE2, MTE1, CUBE and FIXP are the AIC's pipes;
AIV_MTE2, VECTOR and MTE3 the AIVs', each AIV taking half the block's rows (so a lane's vector and AIV_MTE2
cost is one AIV's, the two running side by side). Per CV block t of S1.i x S2.i:

    AIC  mm1(t): per pass of `cube_chunk` keys (128): MTE2 K chunk -> L1, MTE1 Q and K to L0A/L0B, CUBE S chunk,
                 FIXP S chunk -> workspace (f32)                       then set flag "S_t ready"
    AIV  sm(t):  per vector sub-block of v_rows rows: AIV_MTE2 S (and the mask) -> UB, VECTOR online softmax,
                 MTE3 P -> workspace (input dtype)                     then set flag "P_t ready"
    AIC  mm2(t): per pass: MTE2 P and V chunks -> L1, MTE1 to L0A/L0B, CUBE accumulate P V in L0C;
                 FIXP P V -> workspace (f32)                           then set flag "O_t ready"
    AIV  acc(t): AIV_MTE2 P V -> UB, VECTOR rescale and accumulate O
    after the last block: VECTOR O / l, MTE3 O -> GM

The AIC runs mm1 `preload` blocks ahead of mm2 ("cube double-issue": mm1(t + preload) before mm2(t)), so the
cube computes the next scores while the AIVs work; the AIVs likewise run sm(t + preload) before acc(t).
Workspace slots (preload + 1 for S and for P, 2 for P V per AIC) are reused in turn: a block waits for
its slot's previous contents to be consumed (the cross-core wait flags). A block's hand-overs between the
cores (S, P and P V ready) cost the target's [overhead] cross_core_sync_cycles together, a third each on the
waiting side (on the board about 1000 cycles per block: pto-isa's fa_cost_model.py), and a core starts each
work unit [overhead] block_dispatch_cycles after it is done with the last one's Q (about 2000, the same file).

Work units (batch, head, query row block) go to the cores in contiguous ranges of equal block count, as
ops-transformer's tiling splits them, so a core walks one head and keeps its K and V in the L2; where the
heads walked at once would not fit the L2 beside the workspace, the cores take turns on each head's row
blocks instead (GEIR's choice). A core's units run back to back, mm1 preloaded across a unit's end.

The arithmetic is the on-chip kernel's (flash_attention._compute): the same blocks, online softmax and
roundings, so both schedules give bit-identical results. A block's GM moves are costed in one access
each (L2 residency by block) and spread over its passes, each pass paying the DMA start latency.
"""

from __future__ import annotations

import numpy as np

from geir.kernels.base import LaunchContext
from geir.kernels.flash_attention_a2 import cube_chunk, workspace_per_core
from geir.kernels.tiling import align
from geir.opdef import lookup
from geir.target_npu.sim import PIPE_INDEX, PipeInterval, cube_cycles, local_copy_cycles, vector_cycles
from geir.target_npu.target import Target

# vector passes over a score tile (scale, mask, row max, subtract, exp, row sum, cast to P) and over the O rows
# per block (rescale by exp(m_old - m_new), add P V): the same work in both schedules (flash_attention.py)
SOFTMAX_PASSES = 7
# a logit softcap, cap * tanh(s / cap), adds its two multiplies and the tanh's own passes (ge.tanh's VECTOR_PASSES)
SOFTCAP_SCALE_PASSES = 2
# a pse bias (ALiBi) is one add over the score tile, as the mask's is among the softmax's passes
PSE_PASSES = 1


def softmax_passes(softcap: float, pse: bool = False) -> int:
    """Vector passes over a score tile: the online softmax's, a softcap's where there is one, and one add of the
    pse tile where there is a pse."""
    return (SOFTMAX_PASSES + (SOFTCAP_SCALE_PASSES + lookup("ge.tanh").VECTOR_PASSES if softcap else 0)
            + (PSE_PASSES if pse else 0))
ACCUMULATE_PASSES = 2
F32 = 4


class _Ring:
    """A ring of buffer slots on every lane: a producer takes the next slot once its old contents were consumed.

    The lanes still working at a step are the leading ones (lanes are sorted by their block count) and every one
    of them did the same ring operations so far, so one producer and one consumer count serve them all."""

    def __init__(self, slots: int, lanes: int):
        self.slots = slots
        self.free = np.zeros((slots, lanes))
        self.rows = list(self.free)  # one view per slot: a row's slice is cheaper than a 2-d index per call
        self.head = 0  # the producer's next slot
        self.tail = 0  # the consumer's next slot

    def take(self, n: int) -> np.ndarray:
        """When the producer's next slot on the first n lanes is free (an event to wait for); advances the producer."""
        ready = self.rows[self.head % self.slots][:n]
        self.head += 1
        return ready

    def give(self, n: int, when: np.ndarray) -> None:
        """The consumer is done with its next slot on the first n lanes at `when`."""
        self.rows[self.tail % self.slots][:n] = when
        self.tail += 1


class _Rings:
    """Every buffer ring of the schedule."""

    def __init__(self, lanes: int, preload: int, buffers: int):
        self.l1_k = _Ring(buffers, lanes)   # K chunks in L1 (mm1)
        self.l1_pv = _Ring(buffers, lanes)  # P and V chunks in L1 (mm2)
        self.l0 = _Ring(buffers, lanes)     # L0A / L0B fragments
        self.l0c = _Ring(buffers, lanes)    # L0C results
        self.ws_s = _Ring(preload + 1, lanes)  # workspace: S blocks
        self.ws_p = _Ring(preload + 1, lanes)  # workspace: P blocks
        self.ws_o = _Ring(2, lanes)            # workspace: P V blocks
        self.ub_in = _Ring(buffers, lanes)   # UB: S sub-blocks in
        self.ub_out = _Ring(buffers, lanes)  # UB: P sub-blocks out
        self.ub_o = _Ring(1, lanes)          # UB: landing buffer of P V


def _split(cost: np.ndarray, parts: int, latency: float) -> np.ndarray:
    """One move's cycles spread over `parts` DMAs of equal size, each paying the start latency."""
    return _share(cost, 1 / parts, latency)


def _share(cost: np.ndarray, share: float, latency: float) -> np.ndarray:
    """The cycles of a DMA moving `share` of a move's bytes: the start latency and that share of the rest."""
    return np.where(cost > 0, latency + (cost - latency) * share, 0.0)


class _Layout:
    """The GM names of one launch's tensors (registered by the caller with the kernel's grid of blocks) and its
    workspace, cut by core."""

    def __init__(self, gm, names: list[str | None], nk: int, cores: int, preload: int, s1: int, s2: int, d: int,
                 isz: int):
        self.q, self.k, self.v, self.mask, self.o = names
        self.nk = nk
        # per core: S slots, P slots, P V slots, each cut in two halves (one per AIV)
        self.slots = (preload + 1, preload + 1, 2)
        self.per_core = 2 * sum(self.slots)
        self.ws = f"{self.o}:workspace"
        gm.workspace(self.ws, cores * self.per_core, cores * workspace_per_core(s1, s2, d, isz, preload))

    def ws_ids(self, kind: int, slot: int, on: np.ndarray) -> np.ndarray:
        """[lane, half] ids of workspace slot `slot` of kind 0 (S), 1 (P) or 2 (P V) on cores `on`."""
        base = on * self.per_core + 2 * (sum(self.slots[:kind]) + slot)
        return np.stack([base, base + 1], axis=1)


def block_rows(s1: int, sq: int) -> int:
    """The query rows a unit's block computes: s1, or the query's rows where it has fewer (a decode step's one row
    per head, or its group's rows stacked), as ops-transformer's kernels size a block by its real rows: s1RealSize
    = min(s1BaseSize, S1 - s1oIdx * s1BaseSize) sets the matmuls' M (SetTail), the Q copy's rows and the vector
    loop's (flash_attention_var_len_score.h, ComputeBmm1Tail, ComputeMm1, CopyInMm1AToL1, CANN 8.1.RC1's
    built-in ascendc/flash_attention_score, as mirrored in leideng/CANN-8.1.RC1 at 4332a01). Where only the
    query's last block is short (S1 > s1, S1 % s1 != 0) every block is costed at s1: GEIR's blocks of a launch
    share one cost (that tail is over-costed by at most one block per head)."""
    return min(s1, sq) if sq > 0 else s1


def cv_grid(q_shape, k_shape, s1: int, s2: int, segments: int = 1) -> dict[str, int]:
    """The blocks each role's tensor is cut into by the CV-split schedule (for the caller to register)."""
    B, N, Sq, _ = q_shape
    Nkv, Skv = k_shape[1], k_shape[2]
    nq, nk = -(-Sq // s1), -(-Skv // s2)
    return {"q": B * N * nq, "k": B * Nkv * nk, "v": B * Nkv * nk, "mask": B * N * nq * nk,
            "o": B * N * nq * segments}


def unit_trips(B: int, N: int, nq: int, nk: int, segments: int, s1: int, s2: int, causal: bool,
               causal_rows: int | None, kv_tiles: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Each work unit's first key block and how many it reads, units numbered ((b N + n) nq + row block) segments
    + key part: a part's blocks, cut short where a causal mask hides the rest (`causal_rows`: stacked heads whose
    query positions all lie below it) or where the row's keys end (`kv_tiles` [B], its actual length's)."""
    u = np.arange(B * N * nq * segments)
    seg, rows = u % segments, u // segments
    per_seg = -(-nk // segments)
    t0 = seg * per_seg
    t1 = np.minimum(t0 + per_seg, nk)
    if causal:  # key blocks wholly above the diagonal are skipped
        limit = causal_rows if causal_rows is not None else (rows % nq + 1) * s1
        t1 = np.minimum(t1, -(-limit // s2))
    if kv_tiles is not None:  # the row's keys end there: the unit reads no tile after
        t1 = np.minimum(t1, np.asarray(kv_tiles)[rows // nq // N])
    return t0, np.maximum(t1 - t0, 0)


def parts_spanned(trips: np.ndarray, segments: int) -> np.ndarray:
    """Per row block, the key parts that hold any of its keys: how many partials flash-decoding's combine reads
    (IncreFlashAttention's actualCombineLoopSize, ceil(actual length / part size): a part past the row's length
    holds nothing to combine, and the CV schedule stores no partial for it)."""
    return np.count_nonzero(trips.reshape(-1, segments) > 0, axis=1)


def time_cv_split(q_shape, k_shape, dt: np.dtype, mask, causal: bool, s1: int, s2: int, v_rows: int,
                  preload: int, ctx: LaunchContext, names: list[str | None], buffers: int = 2, segments: int = 1,
                  causal_rows: int | None = None, softcap: float = 0.0, *, pse_bytes: int = 0,
                  kv_tiles: np.ndarray | None = None) -> None:
    """Issue the CV-split schedule of every work unit (batch, head, query row block, key part) on the cores that
    run them.

    `segments` > 1: flash-decoding's key parts, each unit storing its partial O with its row max and sum (f32) for
    the caller's combine; `causal_rows`: the rows are stacked heads whose query positions all lie below it, so a
    causal mask hides the same key blocks from every row block. `pse_bytes`: a pse's bytes per block, read with the
    mask's tile (names[3] names the mask, or the pse where there is no mask). `kv_tiles` [B]: the key tiles each
    batch row reads (its actual length's: IncreFlashAttention's actual_seq_lengths_kv); a unit stops there.
    """
    target, cores, gm = ctx.target, ctx.cores, ctx.gm
    B, N, Sq, D = q_shape
    Nkv, Skv = k_shape[1], k_shape[2]
    group = N // Nkv
    isz = np.dtype(dt).itemsize
    dname = "bf16" if dt.name == "bfloat16" else ("f16" if dt == np.float16 else "f32")
    nq, nk = -(-Sq // s1), -(-Skv // s2)
    units = B * N * nq * segments
    if not units or not nk:
        return  # nothing to load or compute (an empty sequence)
    lay = _Layout(gm, names, nk, cores.count, preload, s1, s2, D, isz)
    u = np.arange(units)
    rows = u // segments  # the unit's (batch, head, row block)
    t0, trips = unit_trips(B, N, nq, nk, segments, s1, s2, causal, causal_rows, kv_tiles)
    bn = rows // nq
    kv_first = ((bn // N) * Nkv + (bn % N) // group) * nk + t0  # a unit's first K/V block
    blocks = _UnitBlocks(q=rows, mask=rows * nk + t0, o=u if segments > 1 else rows)
    q_rows = block_rows(s1, Sq)  # a block's real query rows (`rows` above: each unit's row block)
    mask_bytes = (0 if mask is None else q_rows * s2 * np.dtype(mask.dtype).itemsize) + pse_bytes
    # A core walking one head keeps that head's K and V in the L2 only while the heads all cores walk at once fit
    # beside the workspace; otherwise the cores take turns on each head's row blocks, sharing its K and V
    read = Skv if kv_tiles is None else min(Skv, int(np.max(kv_tiles, initial=0)) * s2)  # the keys a head reads
    heads_at_once = min(cores.count, B * Nkv) * 2 * read * D * isz
    if heads_at_once <= gm.l2_bytes:
        assignment = contiguous(trips, cores.count)
    else:
        assignment = interleaved(units, cores.count)
    costs = _Costs(target, dname, s1, s2, D, isz, v_rows, buffers, softmax_passes(softcap, pse=pse_bytes > 0), q_rows)
    if segments > 1:  # a partial O: f32, with the row max and sum for the combine
        costs.out_block = q_rows * (D + 2) * F32
    _Program(ctx, lay, costs, assignment, trips, kv_first, blocks, mask_bytes, preload, buffers).run()
    gm.release(lay.ws)


class _UnitBlocks:
    """Each work unit's block of Q and of O, and its first block of the mask."""

    def __init__(self, q: np.ndarray, mask: np.ndarray, o: np.ndarray):
        self.q, self.mask, self.o = q, mask, o


def contiguous(blocks: np.ndarray, cores: int) -> list[np.ndarray]:
    """Each core's units: contiguous ranges of about equal block count.

    As ops-transformer's FlashAttentionScore tiling splits them: a core walks consecutive row blocks of one
    head, so it reads that head's K and V from HBM once and from the L2 after, and a causal mask's short
    rows and long rows are spread by their block counts.
    """
    units = len(blocks)
    used = min(cores, units)  # fewer units than cores: one each on the first cores
    total = np.cumsum(blocks, dtype=np.float64)
    # core c starts at the first unit whose preceding blocks reach c / used of the total
    starts = np.searchsorted(total - blocks, np.arange(used) * total[-1] / used, side="left")
    starts = np.minimum(np.maximum.accumulate(starts), units)
    bounds = np.concatenate([starts, np.full(cores - used + 1, units)])
    return [np.arange(bounds[c], bounds[c + 1]) for c in range(cores)]


def interleaved(units: int, cores: int) -> list[np.ndarray]:
    """Each core's units dealt in turn (unit i to core i mod cores, in a snake so that a causal mask's long rows
    do not all land on the last cores): the cores work on neighbouring row blocks of one head at a time and
    share its K and V in the L2 (GEIR's choice where the heads of a contiguous split would not fit the L2)."""
    out: list[list[int]] = [[] for _ in range(cores)]
    for w, first in enumerate(range(0, units, cores)):
        ids = range(first, min(first + cores, units))
        lanes = range(len(ids)) if w % 2 == 0 else range(cores - 1, cores - 1 - len(ids), -1)
        for unit, core in zip(ids, lanes):
            out[core].append(unit)
    return [np.array(x, dtype=np.int64) for x in out]


class _Costs:
    """The cycles of a CV block's on-chip instructions (the same for every block of a launch)."""

    def __init__(self, target: Target, dname: str, s1: int, s2: int, D: int, isz: int, v_rows: int, buffers: int,
                 score_passes: int = SOFTMAX_PASSES, rows: int | None = None):
        vpc = target.vector_per_cube
        chunk = min(cube_chunk(align(s1, 16), align(s2, 16), align(D, 16), isz, buffers, target), s2)
        self.chunks = -(-s2 // chunk)
        # the block's rows (block_rows: fewer than s1 where the query has fewer); on chip they are kept in whole
        # fractals of 16 rows (the kernel's ND-to-NZ copies and its aligned P), in GM and on the AIVs as they are
        rows = s1 if rows is None else rows
        s1, m = rows, align(rows, 16)
        self.half = -(-s1 // vpc)  # rows each AIV takes
        self.subs = -(-self.half // v_rows)
        self.rows = [min(v_rows, self.half - j * v_rows) for j in range(self.subs)]
        # the same cycles as 0-d float64 arrays: an instruction adds them to its lanes' times, and numpy adds an
        # array about twice as fast as it converts a Python number (the sums are the same float64 sums)
        cycles = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
        self.mm1_l0 = cycles(local_copy_cycles(target, (m + chunk) * D * isz))
        self.mm1 = cycles(cube_cycles(target, dname, s1, D, chunk))
        self.mm2_l0 = cycles(local_copy_cycles(target, (m + D) * chunk * isz))
        self.mm2 = cycles(cube_cycles(target, dname, s1, chunk, D))
        # vector work of a sub-block pair (each AIV its v_rows rows, side by side: vector_cycles counts the pair)
        self.softmax = [cycles(vector_cycles(target, vpc * r * s2 * F32, score_passes)) for r in self.rows]
        self.acc = cycles(vector_cycles(target, s1 * D * F32, ACCUMULATE_PASSES))
        self.o_l = cycles(vector_cycles(target, s1 * D * F32, 1))
        self.s_block, self.p_block, self.o_block = s1 * s2 * F32, m * s2 * isz, s1 * D * F32
        self.q_block, self.kv_block, self.out_block = s1 * D * isz, s2 * D * isz, s1 * D * isz


class _Program:
    """Every core's blocks in order, one lane per core: the AIC's and the AIVs' programs over them.

    A core's units follow one another without a break: the AIC preloads mm1 across a unit's end into the next
    unit's blocks, as the kernel's loop over its (unit, block) pairs does. Step j is every core's j-th block.
    Lanes are sorted by their block count (most first), so the lanes working at a step are a leading slice of
    the state arrays; the pipes' state is written back to the cores at the end.
    """

    def __init__(self, ctx: LaunchContext, lay: _Layout, c: _Costs, assignment: list[np.ndarray], trips: np.ndarray,
                 kv_first: np.ndarray, blocks: _UnitBlocks, mask_bytes: int, preload: int, buffers: int):
        self.ctx, self.lay, self.c, self.blocks = ctx, lay, c, blocks
        self.trips, self.kv_first, self.mask_bytes, self.preload = trips, kv_first, mask_bytes, preload
        self.lat = ctx.gm.latency
        cores = ctx.cores
        length = np.array([int(trips[assignment[i]].sum()) for i in range(cores.count)])
        self.order = np.argsort(-length, kind="stable")  # lane i is core order[i]
        L = cores.count
        self.steps = int(length.max(initial=0))
        self.n_at = [int(np.count_nonzero(length > j)) for j in range(self.steps)]
        # [step, lane]: the unit and its block each lane does at step j (-1: the lane is done)
        self.unit = np.full((self.steps, L), -1, dtype=np.int64)
        self.block = np.zeros((self.steps, L), dtype=np.int64)
        for lane, core in enumerate(self.order):
            ids = assignment[core]
            n = int(length[core])
            self.unit[:n, lane] = np.repeat(ids, trips[ids])
            self.block[:n, lane] = np.arange(n) - np.repeat(np.cumsum(trips[ids]) - trips[ids], trips[ids])
        self.r = _Rings(L, preload, buffers)
        self.free = cores.free[:, self.order].copy()  # [pipe, lane]: when each pipe is free
        self.busy = np.zeros_like(self.free)
        # one view per pipe (a 1-d slice per instruction is cheaper than a 2-d index)
        self.free_rows, self.busy_rows = list(self.free), list(self.busy)
        self.intervals: list | None = [] if cores.record else None
        self.plain = self.intervals is None and ctx.waits is None
        self.ws_made: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.lane_ids = np.arange(L)
        # the cross-core flags of the blocks in flight, by step: when S_j, P_j and (P V)_j are in GM
        self.s_ready: dict[int, np.ndarray] = {}
        self.p_ready: dict[int, np.ndarray] = {}
        self.o_ready: dict[int, np.ndarray] = {}
        # a flag set by the other core is seen this much after its data landed; a unit starts this much later
        self.flag_sync = ctx.target.overhead("cross_core_sync_cycles") / 3
        self.dispatch = ctx.target.overhead("block_dispatch_cycles")
        self.q_ready = np.zeros(L)
        self.q_free = np.zeros(L)  # L1's Q: free for the next unit once the last mm1 of this one took it to L0A

    def ins(self, pipe: str, lanes, cost, flags=(), slots=(), name: str = "") -> np.ndarray:
        """One instruction on `pipe` of some lanes (a count n: the first n; or an index array): it starts when the
        pipe, its flags and its slots are all ready; returns its end times."""
        p = PIPE_INDEX[pipe]
        at = slice(0, lanes) if lanes.__class__ is int else lanes
        row = self.free_rows[p]
        free = row[at]
        if self.plain:  # nothing booked or recorded: flags and slots are one maximum (a max is exact in any order)
            start = free
            for e in flags:
                start = np.maximum(start, e)
            for e in slots:
                start = np.maximum(start, e)
            end = start + cost
            row[at] = end
            busy = self.busy_rows[p][at]
            if at.__class__ is slice:
                busy += cost  # in place: a slice is a view of the row
            else:
                self.busy_rows[p][at] = busy + cost
            return end
        ready = free
        for e in flags:
            ready = np.maximum(ready, e)
        start = ready
        for e in slots:
            start = np.maximum(start, e)
        end = start + cost
        waits = self.ctx.waits
        if waits is not None:
            waits.flag[pipe] += float(np.sum(ready - free))
            waits.slot[pipe] += float(np.sum(start - ready))
        if self.intervals is not None:
            self.intervals.append((p, name, at, np.array(start, dtype=float), end))
        row[at] = end
        self.busy_rows[p][at] += cost
        return end

    def run(self) -> None:
        d = self.preload
        for j in range(min(d, self.steps)):
            self.mm1(j)
        for j in range(min(d, self.steps)):
            self.softmax(j)
        for j in range(self.steps):
            if j + d < self.steps:
                self.mm1(j + d)
            self.mm2(j)
            if j + d < self.steps:
                self.softmax(j + d)
            self.accumulate(j)
        cores = self.ctx.cores
        cores.free[:, self.order] = self.free
        cores.busy[:, self.order] += self.busy
        if self.intervals is not None:
            for p, name, at, start, end in self.intervals:
                cores.intervals.append(PipeInterval(p, name, self.order[at], start, end))

    def _ws(self, write: bool, kind: int, slot: int, n: int, nbytes: int, by_aiv: bool) -> np.ndarray:
        """Cycles to move a workspace block on each of the first n lanes (by the AIV pair, each its half, side by
        side, or by the AIC)."""
        gm = self.ctx.gm
        move = gm.write_pieces if write else gm.read_pieces
        # the slot ids and the halves' sizes repeat every preload + 1 steps: made once (the moves only read them)
        key = (kind, slot, n, nbytes)
        made = self.ws_made.get(key)
        if made is None:
            ids = self.lay.ws_ids(kind, slot, self.order[:n])
            made = self.ws_made[key] = (ids, np.full(ids.shape, nbytes // 2, dtype=np.int64))
        ids, half = made
        rows = ids.reshape(-1, 1) if by_aiv else ids  # the AIV pair: each half its own move
        if nbytes >= 2:
            cost = gm.workspace_move(self.lay.ws, rows, nbytes // 2, write)
            if cost is not None:  # every row alike (a read that found every piece in the L2)
                return np.full(n, cost)
        if by_aiv:
            return move(self.lay.ws, rows, half.reshape(-1, 1)).reshape(-1, 2).max(axis=1)
        return move(self.lay.ws, ids, half)

    def _shared(self, name: str, blocks: np.ndarray, nbytes: int, j: int) -> np.ndarray:
        """Cycles of each lane's read of one block, where lanes may read the same block together: the one that
        brings a block into the L2 (the first of its readers) takes turns with the step, so no core pays for
        every block its neighbours share (which core's request reaches the L2 first is not the model's to know)."""
        n = len(blocks)
        turn = (self.lane_ids[:n] + j % max(n, 1)) % max(n, 1)  # np.roll(arange(n), -(j % n)), without its wrapper
        cost = np.empty(n)
        cost[turn] = self.ctx.gm.read(name, blocks[turn], nbytes)
        return cost

    def _pair(self, move, name: str, blocks: np.ndarray, nbytes: int) -> np.ndarray:
        """Cycles of the AIV pair moving halves of one block each on every lane (side by side: the slower half)."""
        ids = np.repeat(blocks, 2)[:, None]
        return move(name, ids, np.full(ids.shape, nbytes // 2, dtype=np.int64)).reshape(-1, 2).max(axis=1)

    def mm1(self, j: int) -> None:
        """S_j = Q K_j^T on the AIC, pass by pass, each pass's scores to the workspace (Q first, at a unit's start)."""
        n = self.n_at[j]
        unit, t = self.unit[j, :n], self.block[j, :n]
        gm, c, r, lay = self.ctx.gm, self.c, self.r, self.lay
        first = np.nonzero(t == 0)[0]
        if len(first):  # a new unit: its Q into L1, once the last one left for L0A
            cost = gm.read(lay.q, self.blocks.q[unit[first]], c.q_block)
            self.q_ready[first] = self.ins("MTE2", first, cost, slots=[self.q_free[first] + self.dispatch],
                                           name="load Q")
        k_cost = _split(self._shared(lay.k, self.kv_first[unit] + t, c.kv_block, j), c.chunks, self.lat)
        s_cost = _split(self._ws(True, 0, r.ws_s.head % r.ws_s.slots, n, c.s_block, False), c.chunks, self.lat)
        slot_free = r.ws_s.take(n)
        q_ready = self.q_ready[:n]
        end = l0 = None
        for chunk in range(c.chunks):
            k_in = self.ins("MTE2", n, k_cost, slots=[r.l1_k.take(n)], name="load K chunk")
            l0 = self.ins("MTE1", n, c.mm1_l0, [k_in, q_ready], [r.l0.take(n)], name="Q, K to L0")
            r.l1_k.give(n, l0)
            s = self.ins("CUBE", n, c.mm1, [l0], [r.l0c.take(n)], name="S = Q K^T")
            r.l0.give(n, s)
            end = self.ins("FIXP", n, s_cost, [s], [slot_free] if chunk == 0 else [], name="S to workspace")
            r.l0c.give(n, end)
        last = np.nonzero(t == self.trips[unit] - 1)[0]
        self.q_free[last] = l0[last]  # the unit's Q has gone to L0A for the last time
        self.s_ready[j] = end + self.flag_sync

    def softmax(self, j: int) -> None:
        """The online softmax of block j on the AIV pair, sub-block by sub-block, P to the workspace."""
        n = self.n_at[j]
        unit, t = self.unit[j, :n], self.block[j, :n]
        gm, c, r, lay = self.ctx.gm, self.c, self.r, self.lay
        s_cost = self._ws(False, 0, r.ws_s.tail % r.ws_s.slots, n, c.s_block, True)
        if lay.mask is not None:  # each AIV reads its rows of the block's mask tile with its scores
            s_cost = s_cost + self._pair(gm.read_pieces, lay.mask, self.blocks.mask[unit] + t, self.mask_bytes)
        p_cost = self._ws(True, 1, r.ws_p.head % r.ws_p.slots, n, c.p_block, True)
        p_slot = r.ws_p.take(n)
        ready = self.s_ready.pop(j)
        loaded = end = None
        shares: dict[float, tuple[np.ndarray, np.ndarray]] = {}  # the sub-blocks are of one or two sizes
        for sub, rows in enumerate(c.rows):
            share = rows / c.half
            if share not in shares:
                shares[share] = (_share(s_cost, share, self.lat), _share(p_cost, share, self.lat))
            s_part, p_part = shares[share]
            loaded = self.ins("AIV_MTE2", n, s_part, [ready], [r.ub_in.take(n)], name="load S")
            sm = self.ins("VECTOR", n, c.softmax[sub], [loaded], [r.ub_out.take(n)], name="online softmax")
            r.ub_in.give(n, sm)
            end = self.ins("MTE3", n, p_part, [sm], [p_slot] if sub == 0 else [],
                           name="P to workspace")
            r.ub_out.give(n, end)
        r.ws_s.give(n, loaded)
        self.p_ready[j] = end + self.flag_sync

    def mm2(self, j: int) -> None:
        """(P V)_j on the AIC: P and V pass by pass, accumulated in L0C, the result to the workspace."""
        n = self.n_at[j]
        unit, t = self.unit[j, :n], self.block[j, :n]
        c, r, lay = self.c, self.r, self.lay
        v_cost = self._shared(lay.v, self.kv_first[unit] + t, c.kv_block, j)
        p_cost = self._ws(False, 1, r.ws_p.tail % r.ws_p.slots, n, c.p_block, False)
        pv_cost = _split(v_cost + p_cost, c.chunks, self.lat)
        o_cost = self._ws(True, 2, r.ws_o.head % r.ws_o.slots, n, c.o_block, False)
        ready = self.p_ready.pop(j)
        acc_free = r.l0c.take(n)
        loaded = cube = None
        for chunk in range(c.chunks):
            loaded = self.ins("MTE2", n, pv_cost, [ready], [r.l1_pv.take(n)], name="load P, V chunk")
            l0 = self.ins("MTE1", n, c.mm2_l0, [loaded], [r.l0.take(n)], name="P, V to L0")
            r.l1_pv.give(n, l0)
            cube = self.ins("CUBE", n, c.mm2, [l0], [acc_free] if chunk == 0 else [], name="P V")
            r.l0.give(n, cube)
        r.ws_p.give(n, loaded)
        end = self.ins("FIXP", n, o_cost, [cube], [r.ws_o.take(n)], name="P V to workspace")
        r.l0c.give(n, end)
        self.o_ready[j] = end + self.flag_sync

    def accumulate(self, j: int) -> None:
        """O = O * exp(m_old - m_new) + (P V)_j on the AIV pair; after a unit's last block, O / l and O to GM."""
        n = self.n_at[j]
        unit, t = self.unit[j, :n], self.block[j, :n]
        gm, c, r, lay = self.ctx.gm, self.c, self.r, self.lay
        cost = self._ws(False, 2, r.ws_o.tail % r.ws_o.slots, n, c.o_block, True)
        loaded = self.ins("AIV_MTE2", n, cost, [self.o_ready.pop(j)], [r.ub_o.take(n)], name="load P V")
        r.ws_o.give(n, loaded)
        done = self.ins("VECTOR", n, c.acc, [loaded], name="rescale and accumulate O")
        r.ub_o.give(n, done)
        last = np.nonzero(t == self.trips[unit] - 1)[0]
        if len(last):
            out = self.ins("VECTOR", last, c.o_l, name="O / l")
            self.ins("MTE3", last, self._pair(gm.write_pieces, lay.o, self.blocks.o[unit[last]], c.out_block), [out], name="store O")
