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
Workspace slots (preload + 1 for S, preload for P, 2 for P V per AIC) are reused in turn: a block waits for
its slot's previous contents to be consumed (the cross-core wait flags). The flags themselves cost no
cycles beyond the data they wait for: no public source gives their latency.

The arithmetic is the on-chip kernel's (flash_attention._compute): the same blocks, online softmax and
roundings, so both schedules give bit-identical results. A block's GM moves are costed in one access
each (L2 residency by block) and spread over its passes, each pass paying the DMA start latency.
"""

from __future__ import annotations

import numpy as np

from geir.kernels.base import LaunchContext, issue
from geir.kernels.flash_attention_a2 import cube_chunk, workspace_per_core
from geir.kernels.tiling import align
from geir.target_npu.sim import cube_cycles, local_copy_cycles, vector_cycles
from geir.target_npu.target import Target

# vector passes over a score sub-block (scale, mask, row max, subtract, exp, row sum, cast to P) and over the O
# rows per block (rescale by exp(m_old - m_new), add P V): the on-chip kernel's counts
SOFTMAX_PASSES = 7
ACCUMULATE_PASSES = 2
F32 = 4


class _Ring:
    """A ring of buffer slots on every core: a producer takes the next slot once its old contents were consumed."""

    def __init__(self, slots: int, cores: int):
        self.slots = slots
        self.free = np.zeros((slots, cores))
        self.head = np.zeros(cores, dtype=np.int64)  # the producer's next slot
        self.tail = np.zeros(cores, dtype=np.int64)  # the consumer's next slot

    def take(self, on: np.ndarray) -> np.ndarray:
        """When the producer's next slot on each core is free (an event to wait for); advances the producer."""
        ready = self.free[self.head[on] % self.slots, on]
        self.head[on] += 1
        return ready

    def give(self, on: np.ndarray, when: np.ndarray) -> None:
        """The consumer is done with its next slot on each core at `when`."""
        self.free[self.tail[on] % self.slots, on] = when
        self.tail[on] += 1


class _Rings:
    """Every buffer ring of the schedule, kept per core across waves (a core's next unit reuses them)."""

    def __init__(self, cores: int, preload: int, buffers: int):
        self.l1_k = _Ring(buffers, cores)   # K chunks in L1 (mm1)
        self.l1_pv = _Ring(buffers, cores)  # P and V chunks in L1 (mm2)
        self.l0 = _Ring(buffers, cores)     # L0A / L0B fragments
        self.l0c = _Ring(buffers, cores)    # L0C results
        self.ws_s = _Ring(preload + 1, cores)  # workspace: S blocks
        self.ws_p = _Ring(preload, cores)      # workspace: P blocks
        self.ws_o = _Ring(2, cores)            # workspace: P V blocks
        self.ub_in = _Ring(buffers, cores)   # UB: S sub-blocks in
        self.ub_out = _Ring(buffers, cores)  # UB: P sub-blocks out
        self.ub_o = _Ring(1, cores)      # UB: landing buffer of P V


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
        self.slots = (preload + 1, preload, 2)
        self.per_core = 2 * sum(self.slots)
        self.ws = f"{self.o}:workspace"
        gm.workspace(self.ws, cores * self.per_core, cores * workspace_per_core(s1, s2, d, isz, preload))

    def ws_ids(self, kind: int, slot: np.ndarray, on: np.ndarray) -> np.ndarray:
        """[lane, half] ids of workspace slot `slot` of kind 0 (S), 1 (P) or 2 (P V) on cores `on`."""
        base = on * self.per_core + 2 * (sum(self.slots[:kind]) + slot)
        return np.stack([base, base + 1], axis=1)


def cv_grid(q_shape, k_shape, s1: int, s2: int) -> dict[str, int]:
    """The blocks each role's tensor is cut into by the CV-split schedule (for the caller to register)."""
    B, N, Sq, _ = q_shape
    Nkv, Skv = k_shape[1], k_shape[2]
    nq, nk = -(-Sq // s1), -(-Skv // s2)
    return {"q": B * N * nq, "k": B * Nkv * nk, "v": B * Nkv * nk, "mask": B * N * nq * nk, "o": B * N * nq}


def time_cv_split(q_shape, k_shape, dt: np.dtype, mask, causal: bool, s1: int, s2: int, v_rows: int,
                  preload: int, ctx: LaunchContext, names: list[str | None], buffers: int = 2) -> None:
    """Issue the CV-split schedule of every work unit (batch, head, query row block), wave by wave."""
    target, cores, gm = ctx.target, ctx.cores, ctx.gm
    B, N, Sq, D = q_shape
    Nkv, Skv = k_shape[1], k_shape[2]
    group = N // Nkv
    isz = np.dtype(dt).itemsize
    dname = "bf16" if dt.name == "bfloat16" else ("f16" if dt == np.float16 else "f32")
    nq, nk = -(-Sq // s1), -(-Skv // s2)
    units = B * N * nq
    lay = _Layout(gm, names, nk, cores.count, preload, s1, s2, D, isz)
    rings = _Rings(cores.count, preload, buffers)
    c = _Costs(target, dname, s1, s2, D, isz, v_rows, buffers)
    mask_bytes = 0 if mask is None else s1 * s2 * np.dtype(mask.dtype).itemsize
    lat = gm.latency
    qi_all = np.arange(units) % nq
    trips_all = np.full(units, nk)
    if causal:  # key blocks wholly above the diagonal are skipped
        trips_all = np.minimum(trips_all, -(-((qi_all + 1) * s1) // s2))
    for ids, on in balanced(trips_all, cores.count):
        qi, bn = ids % nq, ids // nq
        kv_head = (bn // N) * Nkv + (bn % N) // group
        _Wave(ctx, lay, rings, c, on, bn * nq + qi, kv_head * nk, trips_all[ids], mask_bytes, lat, preload).run()
    gm.release(lay.ws)


def balanced(blocks: np.ndarray, cores: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Work units dealt to cores as contiguous ranges of about equal block count, in waves of one unit per core:
    (unit ids, core ids) per wave.

    As ops-transformer's FlashAttentionScore tiling splits them: a core walks consecutive row blocks of one
    head, so it reads that head's K and V from HBM once and from the L2 after, and a causal mask's short
    rows and long rows are spread by their block counts.
    """
    units = len(blocks)
    if not units:
        return []
    total = np.cumsum(blocks, dtype=np.float64)
    # core c starts at the first unit whose preceding blocks reach c / cores of the total
    starts = np.searchsorted(total - blocks, np.arange(cores) * total[-1] / cores, side="left")
    starts = np.minimum(np.maximum.accumulate(starts), units)
    ends = np.append(starts[1:], units)
    count = ends - starts
    waves = []
    for w in range(int(count.max(initial=0))):
        on = np.nonzero(count > w)[0]
        waves.append((starts[on] + w, on))
    return waves


class _Costs:
    """The cycles of a CV block's on-chip instructions (the same for every block of a launch)."""

    def __init__(self, target: Target, dname: str, s1: int, s2: int, D: int, isz: int, v_rows: int, buffers: int):
        vpc = target.data["cores"].get("vector_per_cube", 1)
        chunk = min(cube_chunk(align(s1, 16), align(s2, 16), align(D, 16), isz, buffers, target), s2)
        self.chunks = -(-s2 // chunk)
        self.half = -(-s1 // vpc)  # rows each AIV takes
        self.subs = -(-self.half // v_rows)
        self.rows = [min(v_rows, self.half - j * v_rows) for j in range(self.subs)]
        self.mm1_l0 = local_copy_cycles(target, (s1 + chunk) * D * isz)
        self.mm1 = cube_cycles(target, dname, s1, D, chunk)
        self.mm2_l0 = local_copy_cycles(target, (s1 + D) * chunk * isz)
        self.mm2 = cube_cycles(target, dname, s1, chunk, D)
        # vector work of a sub-block pair (each AIV its v_rows rows, side by side: vector_cycles counts the pair)
        self.softmax = [vector_cycles(target, vpc * r * s2 * F32, SOFTMAX_PASSES) for r in self.rows]
        self.acc = vector_cycles(target, s1 * D * F32, ACCUMULATE_PASSES)
        self.o_l = vector_cycles(target, s1 * D * F32, 1)
        self.s_block, self.p_block, self.o_block = s1 * s2 * F32, s1 * s2 * isz, s1 * D * F32
        self.q_block, self.kv_block, self.out_block = s1 * D * isz, s2 * D * isz, s1 * D * isz


class _Wave:
    """One wave's units, one per lane, through the AIC's and the AIVs' programs."""

    def __init__(self, ctx: LaunchContext, lay: _Layout, rings: _Rings, c: _Costs, on: np.ndarray,
                 q_block: np.ndarray, kv_first: np.ndarray, trips: np.ndarray, mask_bytes: int, lat: float,
                 preload: int):
        self.ctx, self.lay, self.r, self.c = ctx, lay, rings, c
        self.on, self.q_block, self.kv_first, self.trips = on, q_block, kv_first, trips
        self.mask_bytes, self.lat, self.preload = mask_bytes, lat, preload
        L = len(on)
        # the cross-core flags of the blocks in flight, by block index: when S_t, P_t and (P V)_t are in GM
        self.s_ready: dict[int, np.ndarray] = {}
        self.p_ready: dict[int, np.ndarray] = {}
        self.o_ready: dict[int, np.ndarray] = {}
        self.q_in_l1 = np.zeros(L)

    def ins(self, pipe: str, idx: np.ndarray, cost, flags=(), slots=(), name: str = "") -> np.ndarray:
        return issue(self.ctx.cores, self.ctx.waits, pipe, self.on[idx], cost, flags, slots, name=name)

    def run(self) -> None:
        gm, c, lay, on = self.ctx.gm, self.c, self.lay, self.on
        every = np.arange(len(on))
        q_cost = gm.read(lay.q, self.q_block, c.q_block)
        self.q_in_l1 = self.ins("MTE2", every, q_cost, name="load Q")
        steps = int(self.trips.max(initial=0))
        d = self.preload
        for t in range(min(d, steps)):
            self.mm1(t)
        for t in range(min(d, steps)):
            self.softmax(t)
        for t in range(steps):
            if t + d < steps:
                self.mm1(t + d)
            self.mm2(t)
            if t + d < steps:
                self.softmax(t + d)
            self.accumulate(t)
        done = self.ins("VECTOR", every, c.o_l, name="O / l")
        self.ins("MTE3", every, self._pair(gm.write_pieces, lay.o, self.q_block, c.out_block), [done], name="store O")

    def _active(self, t: int) -> np.ndarray:
        return np.nonzero(self.trips > t)[0]

    def _ws_read(self, kind: int, ring: _Ring, idx: np.ndarray, nbytes: int, by_aiv: bool) -> np.ndarray:
        """Cycles to read a workspace block on each lane (by the AIV pair, each its half, or by the AIC)."""
        gm, on = self.ctx.gm, self.on[idx]
        ids = self.lay.ws_ids(kind, ring.tail[on] % ring.slots, on)
        half = np.full(ids.shape, nbytes // 2, dtype=np.int64)
        if by_aiv:
            return gm.read_pieces(self.lay.ws, ids.reshape(-1, 1), half.reshape(-1, 1)).reshape(-1, 2).max(axis=1)
        return gm.read_pieces(self.lay.ws, ids, half)

    def _ws_write(self, kind: int, ring: _Ring, idx: np.ndarray, nbytes: int, by_aiv: bool) -> np.ndarray:
        """Cycles to write a workspace block on each lane (slot: the ring's producer slot, before `take`)."""
        gm, on = self.ctx.gm, self.on[idx]
        ids = self.lay.ws_ids(kind, ring.head[on] % ring.slots, on)
        half = np.full(ids.shape, nbytes // 2, dtype=np.int64)
        if by_aiv:
            return gm.write_pieces(self.lay.ws, ids.reshape(-1, 1), half.reshape(-1, 1)).reshape(-1, 2).max(axis=1)
        return gm.write_pieces(self.lay.ws, ids, half)

    def mm1(self, t: int) -> None:
        """S_t = Q K_t^T on the AIC, pass by pass, each pass's scores to the workspace."""
        idx = self._active(t)
        if not len(idx):
            return
        gm, c, r, lay, on = self.ctx.gm, self.c, self.r, self.lay, self.on[idx]
        k_cost = _split(gm.read(lay.k, self.kv_first[idx] + t, c.kv_block), c.chunks, self.lat)
        s_cost = _split(self._ws_write(0, r.ws_s, idx, c.s_block, False), c.chunks, self.lat)
        slot_free = r.ws_s.take(on)
        end = None
        for j in range(c.chunks):
            k_in = self.ins("MTE2", idx, k_cost, slots=[r.l1_k.take(on)], name="load K chunk")
            l0 = self.ins("MTE1", idx, c.mm1_l0, [k_in, self.q_in_l1[idx]], [r.l0.take(on)], name="Q, K to L0")
            r.l1_k.give(on, l0)
            s = self.ins("CUBE", idx, c.mm1, [l0], [r.l0c.take(on)], name="S = Q K^T")
            r.l0.give(on, s)
            end = self.ins("FIXP", idx, s_cost, [s], [slot_free] if j == 0 else [], name="S to workspace")
            r.l0c.give(on, end)
        self.s_ready[t] = end

    def softmax(self, t: int) -> None:
        """The online softmax of block t on the AIV pair, sub-block by sub-block, P to the workspace."""
        idx = self._active(t)
        if not len(idx):
            return
        gm, c, r, lay, on = self.ctx.gm, self.c, self.r, self.lay, self.on[idx]
        s_cost = self._ws_read(0, r.ws_s, idx, c.s_block, True)
        if lay.mask is not None:  # each AIV reads its rows of the block's mask tile with its scores
            s_cost = s_cost + self._pair(gm.read_pieces, lay.mask, self.q_block[idx] * lay.nk + t, self.mask_bytes)
        p_cost = self._ws_write(1, r.ws_p, idx, c.p_block, True)
        p_slot = r.ws_p.take(on)
        ready = self.s_ready.pop(t)
        loaded = end = None
        for j, rows in enumerate(c.rows):
            share = rows / c.half
            loaded = self.ins("AIV_MTE2", idx, _share(s_cost, share, self.lat), [ready], [r.ub_in.take(on)],
                              name="load S")
            sm = self.ins("VECTOR", idx, c.softmax[j], [loaded], [r.ub_out.take(on)], name="online softmax")
            r.ub_in.give(on, sm)
            end = self.ins("MTE3", idx, _share(p_cost, share, self.lat), [sm], [p_slot] if j == 0 else [],
                           name="P to workspace")
            r.ub_out.give(on, end)
        r.ws_s.give(on, loaded)
        self.p_ready[t] = end

    def _pair(self, move, name: str, blocks: np.ndarray, nbytes: int) -> np.ndarray:
        """Cycles of the AIV pair moving halves of one block each on every lane (side by side: the slower half)."""
        ids = np.repeat(blocks, 2)[:, None]
        return move(name, ids, np.full(ids.shape, nbytes // 2, dtype=np.int64)).reshape(-1, 2).max(axis=1)

    def mm2(self, t: int) -> None:
        """(P V)_t on the AIC: P and V pass by pass, accumulated in L0C, the result to the workspace."""
        idx = self._active(t)
        if not len(idx):
            return
        gm, c, r, lay, on = self.ctx.gm, self.c, self.r, self.lay, self.on[idx]
        v_cost = gm.read(lay.v, self.kv_first[idx] + t, c.kv_block)
        pv_cost = _split(v_cost + self._ws_read(1, r.ws_p, idx, c.p_block, False), c.chunks, self.lat)
        o_cost = self._ws_write(2, r.ws_o, idx, c.o_block, False)
        ready = self.p_ready.pop(t)
        acc_free = r.l0c.take(on)
        loaded = cube = None
        for j in range(c.chunks):
            loaded = self.ins("MTE2", idx, pv_cost, [ready], [r.l1_pv.take(on)], name="load P, V chunk")
            l0 = self.ins("MTE1", idx, c.mm2_l0, [loaded], [r.l0.take(on)], name="P, V to L0")
            r.l1_pv.give(on, l0)
            cube = self.ins("CUBE", idx, c.mm2, [l0], [acc_free] if j == 0 else [], name="P V")
            r.l0.give(on, cube)
        r.ws_p.give(on, loaded)
        end = self.ins("FIXP", idx, o_cost, [cube],
                       [r.ws_o.take(on)], name="P V to workspace")
        r.l0c.give(on, end)
        self.o_ready[t] = end

    def accumulate(self, t: int) -> None:
        """O = O * exp(m_old - m_new) + (P V)_t on the AIV pair."""
        idx = self._active(t)
        if not len(idx):
            return
        c, r, on = self.c, self.r, self.on[idx]
        cost = self._ws_read(2, r.ws_o, idx, c.o_block, True)
        loaded = self.ins("AIV_MTE2", idx, cost, [self.o_ready.pop(t)], [r.ub_o.take(on)], name="load P V")
        r.ws_o.give(on, loaded)
        done = self.ins("VECTOR", idx, c.acc, [loaded], name="rescale and accumulate O")
        r.ub_o.give(on, done)
