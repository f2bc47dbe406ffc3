"""Serving many requests at once on the simulated NPU: continuous or static batching over a KV block pool, one clock.

`serve` takes requests `(input_ids, max_new_tokens, arrival_us)` and runs them greedily as a server would. The
step programs are built from generate()'s (geir.frontends.generate): a prefill per admitted request (batch 1,
its cache made on the device) and a decode step over the whole running batch. The decode step writes each row's new key
and value at that row's own slot with a one-hot select (`torch.where(write, new, cache)`, GEIR's `ge.select`),
because the rows are at different lengths and index_copy writes one slot for all rows; the select reads and
writes each row's whole cache once per layer, which is what it costs over index_copy's one-slot write.

What is modelled, and what is not:
- The KV *pool* is bookkeeping (geir.runtime.kv_pool): every sequence holds blocks of `block_size` tokens,
  allocated as it grows and freed when it finishes or is preempted; admission and preemption follow it, and
  the run reports its bytes, peak and waste. Attention does NOT read the pool's blocks (no paged attention):
  the running batch's cache is a dense device tensor [batch, kv heads, slots, head dim] per layer, slots a
  whole number of blocks (or `buckets`' gear). When rows join or leave, or the batch needs more slots, a
  regroup program (a device gather of rows, padded or cut to the new length) builds the new dense cache on
  the device, on the timeline; a paged cache would not need it.
- GE's gears: a prefill is padded to its cache's slots (pads after the tokens, masked), so a plan serves every
  prompt of that many blocks; a decode step's batch is padded to a power of two (rows repeated, their
  results dropped). GE re-plans only on a new (batch, slots) bucket; the pads cost compute.
- Continuous batching (Orca's and vLLM's iteration-level scheduling): each iteration admits the waiting
  requests that have arrived and whose blocks fit (first come, first served), prefills them, then runs one
  decode step over every running sequence; finished sequences leave and free their blocks. When a running
  sequence needs a block and none is free, the latest admitted sequence is preempted by recompute: its blocks
  are freed and it waits again, to be prefilled over its prompt and the tokens it already has.
- Static batching: a batch is formed from the requests waiting when the previous batch ends, each reserving
  blocks for the longest it can get in the batch; the batch decodes until its longest request is done
  (finished rows keep their slot, their results dropped), and arrivals wait for the next batch.
- One clock: GE's host work (compiles and re-plans, measured on the host) overlaps the device's runs as in
  generate(); every device figure is the simulator's. A request cannot start before it arrives.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import attrs
import numpy as np
import torch

from geir.builder import Builder
from geir.frontends.generate import (
    DEVICE_STEPS,
    GE_HOST,
    _cache_layer_class,
    _export,
    _Loop,
    _StepModule,
    bucket_length,
)
from geir.frontends.torch_builder import to_numpy
from geir.frontends.torch_import import import_program
from geir.ir import Module
from geir.runtime.device import DeviceTensor
from geir.runtime.interpreter import LAUNCH_MODES, RuntimeListener
from geir.runtime.kv_pool import KVBlockPool
from geir.runtime.profile import time_split
from geir.runtime.trace import Counter, Span, Trace, Track, chrome_trace
from geir.session import DEFAULT_PIPELINE, run_program
from geir.target_npu.target import DEFAULT_TARGET, Target, as_target
from geir.types import DType, TensorType

POLICIES = ("continuous", "static")
REQUESTS_PID = 2  # the requests' tracks, after GE's (0) and the device's (1)


@attrs.frozen
class RequestRecord:
    """One request served: its tokens (prompt and new) and its times on the modelled clock (us)."""

    tokens: torch.Tensor  # the prompt, then the new tokens (1-D LongTensor)
    prompt_length: int
    new_tokens: int
    arrival_us: float
    ttft_us: float  # arrival to the first new token
    tpot_us: float  # mean time per new token after the first (0 with one new token)
    latency_us: float  # arrival to the last new token
    preempted: int  # times it was preempted (and later recomputed)

    def as_dict(self) -> dict[str, Any]:
        """The record as plain data (the tokens as a list)."""
        return {**attrs.asdict(self, filter=lambda a, _: a.name != "tokens"), "tokens": self.tokens.tolist()}


@attrs.frozen
class ServeStep:
    """One device run of a serving run: a request's prefill, a batch's decode step, or a regroup of the cache."""

    index: int
    kind: str  # "prefill", "decode" or "regroup"
    requests: tuple[int, ...]  # the requests it serves (indices into the given list)
    batch: int  # rows it runs (the batch gear: padded rows included)
    slots: int  # cache slots per row
    plan_cache: str  # "hit" or "miss"
    host_ge_us: float  # GE's host time for it (compile or re-plan; 0 on a hit)
    ge_start_us: float
    start_us: float
    device_us: float  # its span on the device
    kernel_time_us: float
    transfer_time_us: float
    end_us: float
    pool_used_blocks: int  # the pool after the step
    pool_token_slots: int
    pool_allocated_slots: int

    def as_dict(self) -> dict[str, Any]:
        """The record as plain data."""
        return {**attrs.asdict(self), "requests": list(self.requests)}


@attrs.frozen
class Serving:
    """What `serve` returns: a record per request (in the order given), a record per device run, the run's figures."""

    requests: list[RequestRecord]
    steps: list[ServeStep]
    policy: str
    block_size: int
    pool_blocks: int
    pool_bytes: int
    pool_peak_blocks: int
    plan_cache_hits: int  # over the step programs (prefill and decode)
    plan_cache_misses: int
    regroups: int
    pool_sized_from: str = "pool_bytes"  # or "requests": no target names its device memory, so None sizes it so


    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.requests)

    @property
    def makespan_us(self) -> float:
        """From the first arrival to the last step's end."""
        if not self.steps:
            return 0.0
        return self.steps[-1].end_us - min(r.arrival_us for r in self.requests)

    @property
    def throughput_tok_per_s(self) -> float:
        """New tokens per modelled second, over the makespan."""
        return self.new_tokens / self.makespan_us * 1e6 if self.makespan_us else 0.0

    @property
    def host_ge_us(self) -> float:
        """GE's host work: compiles and re-plans of the step programs and of the regroups."""
        return sum(s.host_ge_us for s in self.steps)

    @property
    def device_busy_us(self) -> float:
        return sum(s.device_us for s in self.steps)

    @property
    def device_idle_us(self) -> float:
        """The device running no kernel and no copy over the makespan: between runs (waiting for arrivals or for
        GE) and inside them (waiting for the host to submit the next launch)."""
        inside = sum(max(0.0, s.device_us - s.kernel_time_us - s.transfer_time_us) for s in self.steps)
        return max(0.0, self.makespan_us - self.device_busy_us) + inside

    @property
    def pool_waste(self) -> float:
        """Slots allocated beyond the tokens, as a fraction of the allocated slots, over all the run's steps."""
        allocated = sum(s.pool_allocated_slots for s in self.steps)
        return sum(s.pool_allocated_slots - s.pool_token_slots for s in self.steps) / allocated if allocated else 0.0

    @property
    def pool_utilisation(self) -> float:
        """The pool's blocks in use, as a fraction of the pool, averaged over the run's steps."""
        if not self.steps or not self.pool_blocks:
            return 0.0
        return sum(s.pool_used_blocks for s in self.steps) / (len(self.steps) * self.pool_blocks)

    def summary(self) -> dict[str, Any]:
        """The run in figures (plain data)."""
        return {"policy": self.policy, "requests": len(self.requests), "new_tokens": self.new_tokens,
                "steps": len(self.steps), "makespan_us": self.makespan_us,
                "throughput_tok_per_s": self.throughput_tok_per_s, "block_size": self.block_size,
                "pool_blocks": self.pool_blocks, "pool_bytes": self.pool_bytes, "pool_sized_from": self.pool_sized_from,
                "pool_peak_blocks": self.pool_peak_blocks, "pool_waste": self.pool_waste,
                "pool_utilisation": self.pool_utilisation, "plan_cache_hits": self.plan_cache_hits,
                "plan_cache_misses": self.plan_cache_misses, "regroups": self.regroups,
                "host_ge_us": self.host_ge_us, "device_busy_us": self.device_busy_us,
                "device_idle_us": self.device_idle_us, "preemptions": sum(r.preempted for r in self.requests)}

    def as_dict(self) -> dict[str, Any]:
        """The whole run as plain data: the summary, each request, each step."""
        return {**self.summary(), "per_request": [r.as_dict() for r in self.requests],
                "per_step": [s.as_dict() for s in self.steps]}

    def timeline(self) -> Trace:
        """The run's one timeline (geir.runtime.trace): GE's host work, the device's runs with the KV pool's blocks
        as a counter, and a track per request (queued from its arrival, then served until its last token)."""
        trace = Trace()
        for s in self.steps:
            label = f"{s.kind} {s.batch}x{s.slots}"
            if s.host_ge_us:
                trace.spans.append(Span(GE_HOST, f"GE: plan {label}", s.ge_start_us, s.ge_start_us + s.host_ge_us,
                                        "ge"))
            trace.spans.append(Span(DEVICE_STEPS, label, s.start_us, s.end_us, s.kind,
                                    {"requests": list(s.requests), "plan_cache": s.plan_cache}))
            trace.counters.append(Counter(DEVICE_STEPS, "KV pool (blocks)", s.end_us,
                                          {"used": s.pool_used_blocks, "free": self.pool_blocks - s.pool_used_blocks}))
        for i, r in enumerate(self.requests):
            track = Track(REQUESTS_PID, i, "requests", f"request {i}")
            prefills = [s for s in self.steps if s.kind == "prefill" and i in s.requests]
            begin, end = prefills[0].start_us, r.arrival_us + r.latency_us
            if begin > r.arrival_us:
                trace.spans.append(Span(track, "queued", r.arrival_us, begin, "queued"))
            trace.spans.append(Span(track, f"request {i}", begin, end, "request",
                                    {"prompt": r.prompt_length, "new_tokens": r.new_tokens, "ttft_us": r.ttft_us,
                                     "tpot_us": r.tpot_us, "preempted": r.preempted}))
            for p in prefills:
                trace.spans.append(Span(track, "prefill", p.start_us, p.end_us, "prefill"))
        return trace

    def trace(self) -> dict[str, Any]:
        """A Chrome trace (chrome://tracing, Perfetto) of the run's timeline."""
        return chrome_trace(self.timeline(), display_unit="ms")

    def render(self) -> str:
        """A table of the requests, then the run's figures."""
        lines = [f"{'req':>4}{'prompt':>7}{'new':>5}{'arrival us':>12}{'TTFT us':>11}{'TPOT us':>10}"
                 f"{'latency us':>12}{'preempted':>10}"]
        for i, r in enumerate(self.requests):
            lines.append(f"{i:>4}{r.prompt_length:>7}{r.new_tokens:>5}{r.arrival_us:>12.0f}{r.ttft_us:>11.0f}"
                         f"{r.tpot_us:>10.0f}{r.latency_us:>12.0f}{r.preempted:>10}")
        m = self.summary()
        lines.append(f"{m['policy']} batching: {m['requests']} requests, {m['new_tokens']} new tokens in "
                     f"{m['makespan_us']:.0f} us (modelled): {m['throughput_tok_per_s']:.0f} tokens/s; "
                     f"{m['steps']} device runs ({m['regroups']} cache regroups); plan cache {m['plan_cache_hits']} "
                     f"hits / {m['plan_cache_misses']} misses; host GE {m['host_ge_us']:.0f} us; device idle "
                     f"{m['device_idle_us']:.0f} us")
        sized = "" if self.pool_sized_from == "pool_bytes" else ", sized for every request at its longest"
        lines.append(f"KV pool: {m['pool_blocks']} blocks of {m['block_size']} tokens ({m['pool_bytes']} B{sized}), peak "
                     f"{m['pool_peak_blocks']} blocks, utilisation {100 * m['pool_utilisation']:.1f} %, waste "
                     f"{100 * m['pool_waste']:.1f} % of allocated slots; {m['preemptions']} preemption(s)")
        return "\n".join(lines)


# --- the requests ---------------------------------------------------------------------------------------------

@attrs.define(eq=False)
class _Sequence:
    """A request as the scheduler tracks it."""

    index: int
    prompt: list[int]
    max_new: int
    arrival_us: float
    tokens: list[int]  # the prompt and the tokens so far
    token_us: list[float] = attrs.field(factory=list)  # when each new token was ready
    preempted: int = 0
    admitted: int = -1  # the order it was (last) admitted in: preemption takes the latest

    @property
    def new(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def done(self) -> bool:
        return self.new >= self.max_new

    @property
    def most_slots(self) -> int:
        """The cache slots it needs at most: its tokens but the last new one, which no step feeds."""
        return len(self.prompt) + self.max_new - 1


def _requests(requests: Sequence[Any]) -> list[_Sequence]:
    """The requests as sequences; ValueError naming the request and the problem."""
    out = []
    for i, req in enumerate(requests):
        try:
            ids, max_new, arrival = req
        except (TypeError, ValueError):
            raise ValueError(f"request {i}: expected (input_ids, max_new_tokens, arrival_us), not {req!r}") from None
        ids = torch.as_tensor(ids)
        if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(f"request {i}: input_ids must be one prompt (a 1-D list or a [1, n] tensor)")
        prompt = [int(t) for t in ids.reshape(-1).tolist()]
        if len(prompt) < 2:  # torch.export specialises a length of 1, as in generate
            raise ValueError(f"request {i}: the prompt has {len(prompt)} token(s); serve takes prompts of at least 2")
        if not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"request {i}: max_new_tokens must be at least 1, not {max_new}")
        if float(arrival) < 0:
            raise ValueError(f"request {i}: arrival_us must be >= 0, not {arrival}")
        out.append(_Sequence(i, prompt, int(max_new), float(arrival), list(prompt)))
    if not out:
        raise ValueError("serve needs at least one request")
    return out


def _batch_gear(rows: int) -> int:
    """The batch a decode step runs for `rows` sequences: the next power of two (GE's gears: fewer re-plans)."""
    return 1 << (rows - 1).bit_length()


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Device bytes one token's keys and values take over all layers."""
    step = _StepModule(model, False)
    return 2 * step.layers * step.kv_heads * step.head_dim * torch.finfo(model.dtype).bits // 8


# --- the step programs ----------------------------------------------------------------------------------------

class _RowDecode(_StepModule):
    """The decode step for a batch of sequences at different lengths: each row writes its key and value at its
    own slot (`write`, a one-hot [batch, slots] mask), attends over its own slots (`attention_mask`)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model, False)
        bound = _cache_layer_class()

        class RowLayer(bound):
            def __init__(self, keys, values, slots, write):
                super().__init__(keys, values, slots)
                self.write = write

            def update(self, key_states, value_states, *args, **kwargs):
                self.keys = torch.where(self.write, key_states, self.keys)
                self.values = torch.where(self.write, value_states, self.values)
                return self.keys, self.values

        self.row_layer = RowLayer

    def forward(self, input_ids, attention_mask, slots, position_ids, write, *past):
        from transformers.cache_utils import Cache

        w = write[:, None, :, None]  # [batch, 1, slots, 1]: broadcast over heads and head dim
        # `slots` holds the last slot: the causal bound lets every slot in, the mask keeps each row to its own
        cache = Cache(layers=[self.row_layer(past[2 * i], past[2 * i + 1], slots, w) for i in range(self.layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return (out.logits[:, -1, :], *kv)


class _PaddedPrefill(_StepModule):
    """The prefill of one sequence padded to its cache's slots (GE's gears: a plan per slot count, not per prompt
    length): the pads come after the tokens, so causality keeps them out of the tokens' attention, and the mask
    keeps their keys out of every later step's (the decode overwrites their slots); the next token's logits are
    read at the last real token (`last`)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model, True)

    def forward(self, input_ids, attention_mask, slots, position_ids, last):
        self.last = last
        return super().forward(input_ids, attention_mask, slots, position_ids)

    def next_token_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_select(1, self.last)[:, 0, :]


def _prefill_inputs(tokens: list[int], slots: int) -> tuple[torch.Tensor, ...]:
    """A prefill's inputs for one sequence padded to `slots`: ids (pads 0), the mask over the slots, the slots
    written, the positions (the pads' held at the last token's, inside any model's position table), the last
    token's index."""
    n = len(tokens)
    mask = torch.zeros(1, slots, dtype=torch.long)
    mask[0, :n] = 1
    ids = torch.zeros(1, slots, dtype=torch.long)
    ids[0, :n] = torch.tensor([max(t, 0) for t in tokens])  # timing only: an unknown token (-1) fed as 0
    positions = torch.arange(slots).clamp(max=n - 1)[None]
    return ids, mask, torch.arange(slots), positions, torch.tensor([n - 1])


def _decode_inputs(rows: list[_Sequence], slots: int) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs: each row feeds its last token at its own slot (its cached tokens' count)."""
    batch = len(rows)
    ids = torch.tensor([[max(r.tokens[-1], 0)] for r in rows])  # timing only: an unknown token (-1) fed as 0
    at = [len(r.tokens) - 1 for r in rows]
    mask = torch.zeros(batch, slots, dtype=torch.long)
    write = torch.zeros(batch, slots, dtype=torch.bool)
    for i, n in enumerate(at):
        mask[i, :n + 1] = 1
        write[i, n] = True
    return ids, mask, torch.tensor([slots - 1]), torch.tensor([[n] for n in at]), write


def _regroup_graph(parts: list[list[TensorType]], slots: int, batch: int) -> Module:
    """The running batch's new dense cache: the rows of the given caches (concatenated in order) that `rows`
    names, each cut or zero-padded to `slots` slots."""
    b = Builder()
    args = [[b.argument(t, f"part{i}_{j}") for j, t in enumerate(types)] for i, types in enumerate(parts)]
    rows = b.argument(TensorType((batch,), DType.i64), "rows")
    out = []
    for j in range(len(parts[0])):
        pieces = []
        for part in args:
            a = part[j]
            bsz, heads, length, dim = a.type.shape
            if length > slots:
                a = b.create("ge.slice", [a], {"axes": [2], "starts": [0], "ends": [slots]}).result
            elif length < slots:
                zeros = b.constant(np.array(0, dtype=a.type.dtype.np),
                                   TensorType((bsz, heads, slots - length, dim), a.type.dtype))
                a = b.create("ge.concat", [a, zeros], {"axis": 2}).result
            pieces.append(a)
        whole = pieces[0] if len(pieces) == 1 else b.create("ge.concat", pieces, {"axis": 0}).result
        out.append(b.create("ge.gather", [whole, rows], {"axis": 0}).result)
    return Module([b.finish(out)], "<regroup cache>")


# --- serving --------------------------------------------------------------------------------------------------

def serve(model: torch.nn.Module, requests: Sequence[Any], policy: str = "continuous", block_size: int = 128,
          pool_bytes: int | None = None, launch: str = "single-op", buckets: Sequence[int] | str | None = None,
          dtype: torch.dtype | None = None, target: Target | str = DEFAULT_TARGET, timing_only: bool = False,
          pipeline: str = DEFAULT_PIPELINE, listeners: Sequence[RuntimeListener] = (),
          progress: Callable[[int, int], None] | None = None) -> Serving:
    """Serve `requests` ((input_ids, max_new_tokens, arrival_us) each) greedily with a Hugging Face causal LM on
    the simulated NPU, batching by `policy` over a KV pool of `pool_bytes` in blocks of `block_size` tokens
    (None: as large as every request at its longest at once, since no target names its device memory yet).
    `buckets`: the decode cache's slot gears (generate's rule), whole blocks when None. `timing_only`: every run
    timed by the kernels' cost models without the arithmetic (the schedule does not depend on the tokens, so the
    device figures are the full run's); the new tokens are then unknown, -1. ValueError, before anything runs,
    for a bad argument or a request that could never fit the pool. `progress(done, total)`: told each time a
    request finishes (a progress bar on long runs)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    if launch not in LAUNCH_MODES:
        raise ValueError(f"launch must be one of {', '.join(LAUNCH_MODES)}, not {launch!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    seqs = _requests(requests)
    if dtype is not None:  # a copy in that dtype: the caller's model stays as it is
        import copy

        model = copy.deepcopy(model).to(dtype)
    model = model.eval()
    vocab = getattr(model.config, "vocab_size", None)
    for s in seqs:
        bad = [t for t in s.prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"request {s.index}: token id {bad[0]} is outside the model's vocabulary (0 to "
                             f"{vocab - 1 if vocab else '?'})")
    per_token = kv_bytes_per_token(model)
    if pool_bytes is None:
        blocks = sum(-(-s.most_slots // block_size) for s in seqs)
        pool = KVBlockPool(blocks, block_size, per_token)
    else:
        pool = KVBlockPool.from_bytes(int(pool_bytes), block_size, per_token)
    if buckets is not None:  # a gear for the longest cache any step needs, said now rather than mid-run
        bucket_length(max(s.most_slots for s in seqs), buckets)
    for s in seqs:
        if not pool.fits_ever(s.most_slots):
            raise ValueError(f"request {s.index} can never fit the KV pool: its prompt of {len(s.prompt)} tokens and "
                             f"{s.max_new} new tokens need {pool.blocks_for(s.most_slots)} blocks of {block_size} "
                             f"tokens ({pool.blocks_for(s.most_slots) * pool.block_bytes} B), the pool has "
                             f"{pool.num_blocks} ({pool.pool_bytes} B)")
    run = _Server(model, seqs, pool, policy, buckets, as_target(target), pipeline, listeners, timing_only,
                  progress, launch).run()
    return attrs.evolve(run, pool_sized_from="requests" if pool_bytes is None else "pool_bytes")


class _Server:
    """The scheduler and the one clock: GE's sessions for both step programs, the batch's cache on the device."""

    def __init__(self, model: torch.nn.Module, seqs: list[_Sequence], pool: KVBlockPool, policy: str,
                 buckets: Sequence[int] | str | None, target: Target, pipeline: str,
                 listeners: Sequence[RuntimeListener], timing_only: bool = False,
                 progress: Callable[[int, int], None] | None = None, launch: str = "single-op"):
        self.seqs = seqs
        self.progress = progress
        self.finished = 0
        self.timing_only = timing_only
        self.pool = pool
        self.policy = policy
        self.buckets = buckets
        self.target = target
        self.pipeline = pipeline
        self.listeners = listeners
        self.loop = _Loop(*self._programs(model, seqs[0].prompt), target, pipeline, listeners, launch)
        self.names = {phase: [a.name for a in session.generic.args]
                      for phase, (session, _) in self.loop.sessions.items()}
        self.regroup_programs: dict[tuple, Any] = {}
        self.regroups = 0
        self.steps: list[ServeStep] = []
        self.host_free = 0.0
        self.device_free = 0.0
        self.rows: list[_Sequence] = []  # the dense batch cache's rows (a padded row repeats the first)
        self.cache: list[DeviceTensor] = []
        self.pending: dict[int, list[DeviceTensor]] = {}  # prefilled caches not yet in the batch's
        self.admissions = 0

    def _programs(self, model: torch.nn.Module, prompt: list[int]) -> tuple[Any, Any]:
        """The prefill (one sequence, its length dynamic) and the row-wise decode step (batch and slots
        dynamic), exported from the model and imported by GEIR's frontend."""
        args = _prefill_inputs(prompt, len(prompt))
        l_dim = torch.export.Dim("cache", min=2, max=1 << 16)
        prefill = import_program(_export(_PaddedPrefill(model), args, ({1: l_dim}, {1: l_dim}, {0: l_dim},
                                                                        {1: l_dim}, None)), source="<prefill>")
        rows = [_Sequence(0, prompt, 2, 0.0, list(prompt) + [0]), _Sequence(1, prompt, 2, 0.0, list(prompt) + [0])]
        slots = len(prompt) + 1
        # the cache's shape from the config, not from an eager prefill: on a timing-only stand-in model (zero-stride
        # weights) an eager LLaMA-7B forward takes minutes of host time
        step = _StepModule(model, False)
        past = [torch.zeros(2, step.kv_heads, slots, step.head_dim, dtype=model.dtype) for _ in range(2 * step.layers)]
        b_dim = torch.export.Dim("batch", min=1, max=1 << 12)
        dynamic = ({0: b_dim}, {0: b_dim, 1: l_dim}, None, {0: b_dim}, {0: b_dim, 1: l_dim},
                   tuple({0: b_dim, 2: l_dim} for _ in past))
        decode = import_program(_export(_RowDecode(model), (*_decode_inputs(rows, slots), *past), dynamic),
                                source="<decode>")
        return prefill, decode

    # --- the slots rule ---

    def _slots(self, tokens: int) -> int:
        """Cache slots per row for sequences of up to `tokens` cached tokens: `buckets`' gear, or whole blocks."""
        if self.buckets is not None:
            return bucket_length(tokens, self.buckets)
        return self.pool.blocks_for(tokens) * self.pool.block_size

    # --- the one clock ---

    def _record(self, kind: str, seqs: list[_Sequence], batch: int, slots: int, run_ge_us: float, replanned: bool,
                split: dict[str, float], ready_us: float = 0.0) -> ServeStep:
        """Lay a device run on the timeline: GE prepares it when the host is free (and the request is there),
        the device starts it once the plan is ready and the previous run is done."""
        ge_start = max(self.host_free, ready_us)
        self.host_free = ge_start + run_ge_us
        start = max(self.device_free, self.host_free, ready_us)
        end = start + split["simulated_time_us"]
        self.device_free = end
        usage = self.pool.usage()
        step = ServeStep(len(self.steps), kind, tuple(s.index for s in seqs), batch, slots,
                         "miss" if replanned else "hit", run_ge_us, ge_start, start, split["simulated_time_us"],
                         split["kernel_time_us"], split["transfer_time_us"], end, usage.used_blocks,
                         usage.token_slots, usage.allocated_slots)
        self.steps.append(step)
        return step

    def _prefill(self, seq: _Sequence) -> None:
        """Prefill one sequence over all its tokens (its prompt, and what it had before a preemption)."""
        n = len(seq.tokens)
        self.pool.allocate(seq.index, n)
        slots = self._slots(n)
        names = self.names["prefill"]
        feed = {k: to_numpy(t) for k, t in zip(names, _prefill_inputs(seq.tokens, slots))}
        run = self.loop.plan_and_run("prefill", feed, self.timing_only)
        self.pool.store(seq.index, n)
        self.pending[seq.index] = self._results(run.program, run.result)[1:]
        split = time_split(run.result)
        step = self._record("prefill", [seq], 1, slots, run.ge_us, run.replanned, split, seq.arrival_us)
        self._emit(seq, None if self.timing_only else np.asarray(run.result.outputs[0])[0], step.end_us)

    def _results(self, program: Any, result: Any) -> list[Any]:
        """A run's results; timing only: stand-ins of their types for the cache (on the device, never read)."""
        if not self.timing_only:
            return list(result.outputs)
        return [DeviceTensor(v.type, np.empty(0, np.uint8)) for v in program.terminator.operands]

    def _emit(self, seq: _Sequence, logits: np.ndarray | None, at_us: float) -> None:
        """The row's greedy token, ready when its step ends (timing only: not known, -1)."""
        seq.tokens.append(-1 if logits is None else int(np.asarray(logits, dtype=np.float64).argmax(-1)))
        seq.token_us.append(at_us)

    def _regroup(self, rows: list[_Sequence], slots: int) -> None:
        """The batch's dense cache rebuilt on the device for `rows` (padded to the batch gear) at `slots` slots:
        rows kept from the current cache, rows just prefilled, rows leaving dropped."""
        parts: list[list[DeviceTensor]] = []
        where: dict[int, int] = {}
        offset = 0
        if self.cache and any(r.index not in self.pending and r.index in {x.index for x in self.rows} for r in rows):
            parts.append(self.cache)
            for i, r in enumerate(self.rows):
                where.setdefault(r.index, i)
            offset = self.cache[0].shape[0]
        for index, cache in self.pending.items():
            parts.append(cache)
            where[index] = offset
            offset += cache[0].shape[0]
        batch = _batch_gear(len(rows))
        padded = rows + [rows[0]] * (batch - len(rows))
        order = np.array([where[r.index] for r in padded], dtype=np.int64)
        types = [[c.type for c in part] for part in parts]
        key = (tuple(tuple(tuple(t.shape) for t in p) for p in types), slots, batch)
        ge_us = 0.0
        miss = key not in self.regroup_programs
        if miss:
            from geir.session import compile_module

            start = time.perf_counter()
            self.regroup_programs[key] = compile_module(_regroup_graph(types, slots, batch), self.pipeline,
                                                        self.target)[0].graphs[0]
            ge_us = (time.perf_counter() - start) * 1e6
        program = self.regroup_programs[key]
        names = [a.name for a in program.args]
        feed = dict(zip(names, [c for part in parts for c in part] + [order]))
        n = len(parts[0])
        result = run_program(program, feed, target=self.target, keep=range(n), listeners=self.listeners,
                             timing_only=self.timing_only, launch_mode=self.loop.launch, graphs=self.loop.graphs,
                             memo=self.loop.memo)
        self.cache = self._results(program, result)
        self.rows = padded
        self.pending = {}
        self.regroups += 1
        self._record("regroup", rows, batch, slots, ge_us + result.capture_us, miss, time_split(result))

    def _decode(self, rows: list[_Sequence], live: set[int]) -> None:
        """One decode step over the running rows (`live`: the rows whose tokens count; static batching keeps
        finished rows in the batch, their results dropped)."""
        slots_needed = max(len(r.tokens) for r in rows)
        batch = _batch_gear(len(rows))
        current = [r.index for r in self.rows[:len(rows)]]
        same_rows = (current == [r.index for r in rows] and len(self.rows) == batch and not self.pending)
        if not same_rows or not self.cache or self.cache[0].shape[2] < slots_needed:
            self._regroup(rows, self._slots(slots_needed))
        slots = self.cache[0].shape[2]
        names = self.names["decode"]
        # the padded rows (whatever the cache holds there) repeat the first row's inputs; their results are dropped
        padded = rows + [rows[0]] * (batch - len(rows))
        feed = {k: to_numpy(t) for k, t in zip(names, _decode_inputs(padded, slots))}
        feed.update(zip(names[5:], self.cache))
        run = self.loop.plan_and_run("decode", feed, self.timing_only)
        self.cache = self._results(run.program, run.result)[1:]
        for r in rows:
            self.pool.store(r.index, min(len(r.tokens), r.most_slots))
        step = self._record("decode", [r for r in rows if r.index in live], batch, slots, run.ge_us, run.replanned,
                            time_split(run.result))
        logits = None if self.timing_only else np.asarray(run.result.outputs[0])
        for i, r in enumerate(rows):
            if r.index in live:
                self._emit(r, None if logits is None else logits[i], step.end_us)

    # --- the policies ---

    def run(self) -> Serving:
        (self._continuous if self.policy == "continuous" else self._static)()
        records = []
        for s in self.seqs:
            first, last = s.token_us[0], s.token_us[-1]
            tpot = (last - first) / (s.new - 1) if s.new > 1 else 0.0
            records.append(RequestRecord(torch.tensor(s.tokens, dtype=torch.long), len(s.prompt), s.new, s.arrival_us,
                                         first - s.arrival_us, tpot, last - s.arrival_us, s.preempted))
        sessions = [session for session, _ in self.loop.sessions.values()]
        return Serving(records, self.steps, self.policy, self.pool.block_size, self.pool.num_blocks,
                       self.pool.pool_bytes, self.pool.peak_blocks, sum(s.hits for s in sessions),
                       sum(s.misses for s in sessions), self.regroups)

    def _waiting(self, waiting: list[_Sequence]) -> list[_Sequence]:
        """The waiting sequences first come, first served (a preempted one keeps its place by arrival)."""
        return sorted(waiting, key=lambda s: (s.arrival_us, s.index))

    def _idle_until_next(self, waiting: list[_Sequence]) -> None:
        """Nothing to run: the device waits for the next arrival."""
        self.device_free = max(self.device_free, min(s.arrival_us for s in waiting))

    def _finish(self, seq: _Sequence) -> None:
        """A request done: its blocks back to the pool."""
        self.pool.free(seq.index)
        self.finished += 1
        if self.progress is not None:
            self.progress(self.finished, len(self.seqs))

    def _continuous(self) -> None:
        waiting = list(self.seqs)
        running: list[_Sequence] = []
        while waiting or running:
            waiting = self._waiting(waiting)
            now = self.device_free
            if not running and waiting[0].arrival_us > now:
                self._idle_until_next(waiting)
                continue
            # admit what has arrived and fits, first come first served: prefill joins the batch this iteration
            admitted = []
            for seq in list(waiting):
                if seq.arrival_us > now:
                    break
                if not self.pool.can_hold(seq.index, len(seq.tokens) + (0 if seq.new + 1 >= seq.max_new else 1)):
                    break
                waiting.remove(seq)
                seq.admitted = self.admissions
                self.admissions += 1
                self._prefill(seq)
                admitted.append(seq)
                if seq.done:
                    self.pending.pop(seq.index, None)
                    self._finish(seq)
                else:
                    running.append(seq)
            # every running sequence needs a slot for the token it feeds: preempt the latest admitted if none
            for seq in sorted(running, key=lambda s: s.admitted):
                if seq not in running:
                    continue
                while not self.pool.can_hold(seq.index, len(seq.tokens)):
                    victim = max(running, key=lambda s: s.admitted)
                    self._preempt(victim, running, waiting)
                    if victim is seq:
                        break
                if seq in running:
                    self.pool.allocate(seq.index, len(seq.tokens))
            if not admitted and not running:  # the pool is empty here, and every request fits it alone (checked)
                raise AssertionError(f"request {waiting[0].index} could not be admitted into an empty pool")
            if running:
                self._decode(running, {s.index for s in running})
                for seq in [s for s in running if s.done]:
                    running.remove(seq)
                    self._finish(seq)

    def _preempt(self, seq: _Sequence, running: list[_Sequence], waiting: list[_Sequence]) -> None:
        """Preemption by recompute: its blocks freed, its cache dropped; it waits to be prefilled again."""
        running.remove(seq)
        self.pool.free(seq.index)
        self.pending.pop(seq.index, None)
        seq.preempted += 1
        waiting.append(seq)

    def _static(self) -> None:
        waiting = list(self.seqs)
        while waiting:
            waiting = self._waiting(waiting)
            now = self.device_free
            if waiting[0].arrival_us > now:
                self._idle_until_next(waiting)
                continue
            # a batch of what has arrived, each reserving the slots it may reach while the batch runs
            batch: list[_Sequence] = []
            for seq in waiting:
                if seq.arrival_us > now:
                    break
                trial = batch + [seq]
                steps = max(s.max_new for s in trial)
                need = sum(self.pool.blocks_for(len(s.prompt) + steps - 1) for s in trial)
                if need > self.pool.free_blocks:
                    break
                batch = trial
            steps = max(s.max_new for s in batch)
            for seq in batch:
                waiting.remove(seq)
                self.pool.allocate(seq.index, len(seq.prompt) + steps - 1)
                self._prefill(seq)
            for _ in range(steps - 1):
                self._decode(batch, {s.index for s in batch if not s.done})
            for seq in batch:
                self._finish(seq)

