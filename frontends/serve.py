"""Serving many requests at once on the simulated NPU: continuous or static batching over a KV block pool, one clock.

`serve` takes requests `(input_ids, max_new_tokens, arrival_us)` and runs them greedily as a server would. The
step programs are exported from the model over the KV *pools* (one [pool slots, kv heads, head dim] tensor per
layer for keys and one for values, resident on the device from the start): a batched prefill of an iteration's
admitted prompts (rows of different lengths, each padded to the longest's blocks) writes each row's keys and values
into its blocks, and a decode step over the whole running batch writes each row's new key and value at that row's
own pool slot (`index_copy` at the slots the block tables give); both read each row's keys back through its block
table (`pool.view(blocks, block_size, ...)[table]`) up to its own length (the mask). GE's fuse pass turns that
read and the attention into one `ge.paged_attention` (FusedInferAttentionScore with a block table: its
PromptFlashAttention branch for a prefill's rows, IncreFlashAttention's for a decode step's;
passes/fusion/paged_attention.py, kernels/paged_attention.py), so the kernel reads the blocks in place; serve
donates the pools to each step, so their update writes only the step's slots (ge.index_put's `in_place`).

What is modelled, and what is not:
- The pool (geir.runtime.kv_pool): every sequence holds blocks of `block_size` tokens, allocated as it grows and
  freed when it finishes or is preempted; admission and preemption follow it, and the run reports its bytes,
  peak and waste. Rows joining or leaving the batch, or growing a block, move no cache: the block tables change.
  A decode step's block table has one width for the whole run, as vLLM's (max blocks per sequence: the longest
  request's, or its `buckets` gear), and each row's key count is a run-time input (FIA's actual_seq_lengths_kv,
  known on the host as vllm-ascend's seq_lens are): the kernel reads each row's own tiles of whole blocks and
  stops there, its keys past its length masked. A prefill's table is as wide as its gear's blocks.
- GE's gears: a prefill's batch is padded to a power of two (rows repeating the first, results dropped) and its
  rows to a power of two of blocks over the longest row's (pads after each row's tokens, masked; a row's pads past
  its own blocks write into scratch slots past the pool's), so a plan serves every set of prompts of that (batch,
  blocks), and a run's prefill gears are few and known before the first arrival;
  a decode step's batch is padded to a power of two likewise. GE re-plans a prefill only on a new (batch, slots)
  bucket, a decode step only on a new batch gear (its table's width is fixed); the pads cost compute.
- Continuous batching (Orca's and vLLM's iteration-level scheduling): each iteration admits the waiting
  requests that have arrived and whose blocks fit, first come first served, within a token budget (vLLM's
  max_num_batched_tokens, counted here as the prefill's batch gear x slots: the work it runs, pads included; a
  prompt over the budget runs alone, where vLLM would refuse it), prefills them together in one step, then
  runs one decode step over every running sequence; finished sequences leave and free their blocks. When a
  running sequence needs a block and none is free, the latest admitted sequence is preempted by recompute: its
  blocks are freed and it waits again, to be prefilled over its prompt and the tokens it already has.
- Static batching: a batch is formed from the requests waiting when the previous batch ends, each reserving
  blocks for the longest it can get in the batch; its prompts are prefilled together (the same batched prefill
  and budget), then the batch decodes until its longest request is done (finished rows keep their slot, their
  results dropped), and arrivals wait for the next batch. Both policies run the same step programs and kernels
  over the same pool.
- One clock: GE's host work (compiles and re-plans, measured on the host) overlaps the device's runs as in
  generate(); every device figure is the simulator's. A request cannot start before it arrives.
- Startup (`warmup`): by default, before the first arrival, GE compiles both step programs and plans the decode
  step at every batch gear and the prefill at every (batch, blocks) gear under the token budget (in graph mode
  capturing each by a dummy run), as vLLM's engine compiles its model's general shape (a dummy run of
  max_num_batched_tokens) and captures every size of cudagraph_capture_sizes (vllm-ascend its ACL graphs; in
  eager mode nothing) before serving, so that no step waits for GE in the trace, whichever the policy; its GE and
  device time are reported apart, not on the trace's clock (vLLM's serving benchmarks measure after startup).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import numpy as np
import torch

from geir.frontends.generate import (
    DEVICE_STEPS,
    GE_HOST,
    _cache_layer_class,
    _Loop,
    _StepModule,
    bucket_length,
    import_step,
)
from geir.frontends.torch_builder import geir_dtype, to_numpy
from geir.kernels.paged_attention_tiling import CUBE_TILE_ELEMENTS  # one KV block is one cube tile
from geir.passes.lower import ALIGN  # the alignment GE lays each input out at
from geir.runtime.device import DeviceTensor, host_bytes_available
from geir.runtime.interpreter import LAUNCH_MODES, RuntimeListener
from geir.runtime.kv_pool import KVBlockPool
from geir.runtime.profile import time_split
from geir.runtime.trace import Counter, Span, Trace, Track, chrome_trace
from geir.session import DEFAULT_PIPELINE
from geir.target_npu.target import DEFAULT_TARGET, Target, as_target
from geir.types import TensorType
from geir.verifier import MAX_TENSOR_BYTES

POLICIES = ("continuous", "static")
# serve's warm-up before the first arrival: every gear of both step programs (vLLM's startup: no compile while
# serving), the decode step's gears only, or none
WARMUPS = ("gears", "decode", "none")
REQUESTS_PID = 2  # the requests' tracks, after GE's (0) and the device's (1)
PREFILL_INPUTS, DECODE_INPUTS = 7, 6  # each step program's inputs before the pools
# the step programs' dynamic sizes: the batch and the blocks (a row's slots are whole blocks)
_DIMS = (torch.export.Dim("batch", min=1, max=1 << 12), torch.export.Dim("blocks", min=1, max=1 << 16))
# vLLM's default max_num_batched_tokens when chunked prefill is off (vllm/config.py, SchedulerConfig:
# _DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048): the most tokens one iteration's prefills may take
MAX_BATCHED_TOKENS = 2048


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
    """One device run of a serving run: a batched prefill, a batch's decode step, or a regroup of the cache."""

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
class PoolSizing:
    """How the KV pool was sized from the device's memory, as vLLM sizes its KV cache (vllm/v1/worker/gpu_worker.py,
    determine_available_memory: the requested share of the device's memory less the weights and the peak
    activations of a profile run of the largest batch, before the cache exists)."""

    device_bytes: int  # the target's device memory ([memory] hbm_gib)
    utilisation: float  # the share of it serve may take (vLLM's gpu_memory_utilization)
    weights_bytes: int  # the step program's constants: its weights, uploaded once
    activation_bytes: int  # the largest activation arena: GE's plan of the prefill at its largest gear
    input_bytes: int  # that step's other inputs (ids, masks, tables), the pools aside
    scratch_slots: int  # slots past the pool's blocks that take a prefill row's pads (in every pool tensor)
    profile_ge_us: float = 0.0  # GE's host time planning the profile (startup work)

    @property
    def budget_bytes(self) -> int:
        return int(self.device_bytes * self.utilisation)

    @property
    def free_bytes(self) -> int:
        """What is left for the pool tensors: the budget less the weights, the activations and the inputs."""
        return self.budget_bytes - self.weights_bytes - self.activation_bytes - self.input_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "budget_bytes": self.budget_bytes, "free_bytes": self.free_bytes}


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
    # "pool_bytes" (given), "requests" (every request at its longest at once) or "memory" (memory_utilization)
    pool_sized_from: str = "pool_bytes"
    # the warm-up before the first arrival (vLLM's engine startup): GE's host time compiling the step programs and
    # planning (and, in graph mode, capturing) every gear, its plans, and the device time of its dummy runs (graph
    # mode's captures; none in single-op mode); outside the makespan, as vLLM's serving benchmarks measure after startup
    warmup: str = "none"
    startup_ge_us: float = 0.0
    startup_plans: int = 0
    startup_device_us: float = 0.0
    pool_sizing: PoolSizing | None = None  # sized from the device's memory: how


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
                "warmup": self.warmup, "startup_ge_us": self.startup_ge_us, "startup_plans": self.startup_plans,
                "startup_device_us": self.startup_device_us,
                "device_idle_us": self.device_idle_us, "preemptions": sum(r.preempted for r in self.requests),
                "pool_sizing": None if self.pool_sizing is None else self.pool_sizing.as_dict()}

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
        sized = {"pool_bytes": "", "requests": ", sized for every request at its longest"}.get(self.pool_sized_from, "")
        if self.pool_sizing is not None:
            z = self.pool_sizing
            sized = (f", sized from {100 * z.utilisation:.0f} % of the device's {z.device_bytes} B less the weights "
                     f"({z.weights_bytes} B), the largest activation arena ({z.activation_bytes} B) and the step's "
                     f"inputs ({z.input_bytes} B)")
        lines.append(f"KV pool: {m['pool_blocks']} blocks of {m['block_size']} tokens ({m['pool_bytes']} B{sized}), peak "
                     f"{m['pool_peak_blocks']} blocks, utilisation {100 * m['pool_utilisation']:.1f} %, waste "
                     f"{100 * m['pool_waste']:.1f} % of allocated slots; {m['preemptions']} preemption(s)")
        if self.warmup != "none":
            lines.append(f"startup ({m['warmup']} warm-up, before the first arrival, outside the makespan): GE "
                         f"{m['startup_ge_us']:.0f} us, {m['startup_plans']} plans, device "
                         f"{m['startup_device_us']:.0f} us")
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
    """The batch a step runs for `rows` sequences: the next power of two (GE's gears: fewer re-plans)."""
    return 1 << (rows - 1).bit_length()


def _slots_dim(blocks: Any, block_size: int) -> Any:
    """The export's dim of a row's cache slots, `block_size` x its table's width: the width's own dim for blocks of
    one token (torch.export refuses a derived dim equal to its root: 1 x blocks is a second dim named "blocks")."""
    return blocks if block_size == 1 else block_size * blocks


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Device bytes one token's keys and values take over all layers."""
    step = _StepModule(model, False)
    return 2 * step.layers * step.kv_heads * step.head_dim * torch.finfo(model.dtype).bits // 8


# --- the step programs ----------------------------------------------------------------------------------------

def _paged_layer_class():
    """transformers' cache layer over a layer's KV pool: the step's keys and values written at their pool slots
    (`write`), the keys attended read back through the block table (a decode), or the step's own (a prefill)."""
    bound = _cache_layer_class()

    class PagedLayer(bound):
        def __init__(self, keys, values, slots, write, table, block_size, length):
            # a stand-in of the attended length: transformers sizes the masks from it; nothing reads its values
            shape = keys.new_zeros(1, keys.shape[1], length, keys.shape[2])
            super().__init__(shape, shape, slots)
            self.pool_keys, self.pool_values = keys, values
            self.write, self.table, self.block_size = write, table, block_size

        def _read(self, pool):
            """[B, Nkv, blocks x block_size, D]: each row's blocks in its table's order (FIA's block table)."""
            _, heads, dim = pool.shape
            batch, blocks = self.table.shape
            # the block count unstated (-1): nothing in the program names the pool's size but its type
            rows = pool.reshape(-1, self.block_size, heads, dim)[self.table]
            return rows.reshape(batch, blocks * self.block_size, heads, dim).transpose(1, 2)

        def update(self, key_states, value_states, *args, **kwargs):
            def flat(x):  # [B, Nkv, S, D] -> [B x S, Nkv, D]: one row per slot written
                return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])

            write = self.write.reshape(-1)  # a prefill's [B, S] slots, a decode step's [B]: one per row written
            self.pool_keys = self.pool_keys.index_copy(0, write, flat(key_states))
            self.pool_values = self.pool_values.index_copy(0, write, flat(value_states))
            # both steps attend through the block table (FIA's PromptFlashAttention branch for a prefill's rows,
            # IncreFlashAttention's for a decode step's), each row over its own blocks up to its own length
            return self._read(self.pool_keys), self._read(self.pool_values)

    return PagedLayer


class _PagedStep(_StepModule):
    """A step over the KV pools (one [pool slots, Nkv, D] tensor per layer for keys and one for values): the step's
    keys and values written at `write` (pool slots: block x block_size + offset), the attention read through
    `table` (each row's blocks, in order); returns the logits and the pools."""

    def __init__(self, model: torch.nn.Module, block_size: int):
        super().__init__(model, False)
        self.block_size = block_size
        self.paged_layer = _paged_layer_class()

    def run(self, input_ids, attention_mask, slots, position_ids, write, table, pools):
        from transformers.cache_utils import Cache

        length = attention_mask.shape[1]
        cache = Cache(layers=[self.paged_layer(pools[2 * i], pools[2 * i + 1], slots, write, table, self.block_size,
                                               length) for i in range(self.layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        return out.logits, [t for layer in cache.layers for t in (layer.pool_keys, layer.pool_values)]


class _PagedDecode(_PagedStep):
    """The decode step for a batch of sequences at different lengths: each row writes its key and value at its own
    pool slot and attends over its own blocks (the table) up to its own length (`attention_mask`)."""

    def forward(self, input_ids, attention_mask, slots, position_ids, write, table, *pools):
        logits, pools = self.run(input_ids, attention_mask, slots, position_ids, write, table, pools)
        return (logits[:, -1, :], *pools)


class _PagedPrefill(_PagedStep):
    """The prefill of a batch of sequences of different lengths, each row padded to the batch's slots (whole
    blocks; GE's gears: a plan per (batch, slots), not per set of prompt lengths): a row's pads come after its
    tokens, so causality and the mask keep them out of its tokens' attention; each row writes its keys and values
    into its own blocks (pads past them into scratch slots no table names) and attends through its block table
    over its own length (the mask: FIA's per-row actual_seq_lengths); each row's next-token logits are read at
    its own last token (`last`)."""

    def forward(self, input_ids, attention_mask, slots, position_ids, last, write, table, *pools):
        logits, pools = self.run(input_ids, attention_mask, slots, position_ids, write, table, pools)
        at = last.reshape(-1, 1, 1).expand(-1, 1, logits.shape[-1])
        return (logits.gather(1, at)[:, 0, :], *pools)


def _prefill_inputs(rows: list[list[int]], slots: int, writes: list[list[int]], tables: list[list[int]],
                    block_size: int) -> tuple[torch.Tensor, ...]:
    """A batched prefill's inputs, each row padded to `slots` (whole blocks): ids (pads 0), the mask over the slots
    (each row's own length), the slots, the positions (a row's pads held at its last token's, inside any model's
    position table), each row's last token's index, the pool slot each position's key and value go to, and each
    row's block table (cut or padded with block 0 to the slots' blocks: the mask keeps those keys out)."""
    batch, blocks = len(rows), slots // block_size
    mask = torch.zeros(batch, slots, dtype=torch.long)
    ids = torch.zeros(batch, slots, dtype=torch.long)
    positions = torch.empty(batch, slots, dtype=torch.long)
    for i, tokens in enumerate(rows):
        n = len(tokens)
        mask[i, :n] = 1
        ids[i, :n] = torch.tensor([max(t, 0) for t in tokens])  # timing only: an unknown token (-1) fed as 0
        positions[i] = torch.arange(slots).clamp(max=n - 1)
    last = torch.tensor([len(t) - 1 for t in rows])
    table = torch.tensor([t[:blocks] + [0] * (blocks - len(t)) for t in tables])
    return ids, mask, torch.arange(slots), positions, last, torch.tensor(writes), table


def _slot_of(table: list[int], position: int, block_size: int) -> int:
    """The pool slot of a sequence's token at `position`: its block's first slot plus the offset in the block."""
    return table[position // block_size] * block_size + position % block_size


def _decode_inputs(rows: list[_Sequence], tables: list[list[int]], blocks: int,
                   block_size: int) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs: each row feeds its last token, writes it at its pool slot and attends over its
    blocks (its table, cut or padded with block 0 to `blocks`: the mask keeps those slots out) up to its own
    length."""
    batch, slots = len(rows), blocks * block_size
    ids = torch.tensor([[max(r.tokens[-1], 0)] for r in rows])  # timing only: an unknown token (-1) fed as 0
    at = [len(r.tokens) - 1 for r in rows]
    # row i keeps its first at[i] + 1 slots: one comparison in numpy (a 256-row batch's mask is 6 MB; torch's
    # comparison and cast take 30 times as long), not a row at a time
    mask = torch.from_numpy((np.arange(slots)[None, :] <= np.array(at, dtype=np.int64)[:, None]).astype(np.int64))
    write = torch.tensor([_slot_of(t, n, block_size) for t, n in zip(tables, at)])
    # a table reserved ahead of its tokens (static batching) is cut to the blocks the step reads
    table = torch.tensor([t[:blocks] + [0] * (blocks - len(t)) for t in tables])
    return ids, mask, torch.tensor([slots - 1]), torch.tensor([[n] for n in at]), write, table


def _kv_lengths(rows: list[_Sequence]) -> np.ndarray:
    """A decode step's keys per row (its cached tokens and the one it feeds): FIA's actual_seq_lengths_kv."""
    return np.array([len(r.tokens) for r in rows], dtype=np.int64)


def _bind_kv_lengths(graph: Any) -> str | None:
    """Give the decode step's attention each row's key count as a run-time input, as vllm-ascend's attention
    backend hands FusedInferAttentionScore the block table and `actual_seq_lengths_kv` together (the scheduler's
    sequence lengths, a host list; vllm_ascend/attention/attention_v1.py): a graph argument `kv_lengths` [B],
    appended after the pools, becomes every ge.paged_attention's actual_seq_lengths_kv. Serve knows that the mask
    it feeds keeps exactly each row's first kv_lengths keys, so the numbers are the same (the op drops keys past
    the length, then applies the mask) and the kernel stops at each row's blocks instead of reading the table's
    width. The argument's name, or None when GE's fuse pass made no ge.paged_attention (nothing to bind)."""
    from geir.builder import Builder
    from geir.types import DType

    attentions = [op for op in graph.ops if op.name == "ge.paged_attention" and op.actual_seq_lengths_kv is None]
    if not attentions:
        return None
    lengths = Builder(graph).argument(TensorType((None,), DType.i64), "kv_lengths")
    for op in attentions:
        op.insert_operand(4, lengths)
    return lengths.name


def _unpin_pools(graph: Any, first: int) -> bool:
    """The pools' size made a run-time size of the imported step program (the export saw one pool): each pool
    argument's slot axis unknown and each reshape of a pool into blocks (`_read`) counting them as -1, every
    other type inferred again. One export then serves a pool of any size: the memory profile's provisional pool,
    then the pool it sizes; GE specialises a plan for each, as for any dynamic size. False, the program as it
    was, where some other use of a pool fixes its size (the types do not check without it)."""
    from geir.diagnostics import DiagnosticError
    from geir.verifier import infer_types_again

    types = [(v, v.type) for v in graph.args[first:]] + [(r, r.type) for op in graph.ops for r in op.results]
    shapes = [(op, op.attributes["shape"]) for op in graph.ops if op.name == "ge.reshape"]
    result_types = list(graph.result_types)
    try:
        _unpinned(graph, first)
        infer_types_again(graph)
        return True
    except DiagnosticError:
        for v, t in types:
            v.type = t
        for op, shape in shapes:
            op.attributes["shape"] = shape
        graph.result_types = result_types
        return False


def _unpinned(graph: Any, first: int) -> None:
    """_unpin_pools' rewrite: the pools' slot axis unknown, their reshapes into blocks -1 (types not yet inferred)."""
    for pool in graph.args[first:]:
        pool.type = TensorType((None, *pool.type.shape[1:]), pool.type.dtype, pool.type.format)
        frontier = [pool]  # the pool, its updates (ge.index_put into it) and their reshapes into blocks
        while frontier:
            value = frontier.pop()
            for user in value.users():
                if user.operands[0] is not value:
                    continue
                if user.name == "ge.index_put":
                    frontier.append(user.results[0])
                elif user.name == "ge.reshape":
                    user.attributes["shape"] = [-1, *user.attributes["shape"][1:]]


def _donate_pools(graph: Any, first: int) -> None:
    """The pool arguments (from `first` on) are donated to the step: each one's update at the step's slots writes in
    place (ge.index_put's in_place: only the slots written move, as vllm-ascend's cache write does), since serve
    passes each pool to one step and keeps only what the step returns."""
    for pool in graph.args[first:]:
        users = pool.users()
        if len(users) == 1 and users[0].name == "ge.index_put" and users[0].operands[0] is pool:
            users[0].attributes["in_place"] = True


# --- serving --------------------------------------------------------------------------------------------------

def serve(model: torch.nn.Module, requests: Sequence[Any], policy: str = "continuous", block_size: int = 128,
          pool_bytes: int | None = None, launch: str = "single-op", buckets: Sequence[int] | str | None = None,
          dtype: torch.dtype | None = None, target: Target | str = DEFAULT_TARGET, timing_only: bool = False,
          pipeline: str = DEFAULT_PIPELINE, listeners: Sequence[RuntimeListener] = (),
          progress: Callable[[int, int], None] | None = None,
          max_batched_tokens: int = MAX_BATCHED_TOKENS, warmup: str = "gears",
          memory_utilization: float | None = None) -> Serving:
    """Serve `requests` ((input_ids, max_new_tokens, arrival_us) each) greedily with a Hugging Face causal LM on
    the simulated NPU, batching by `policy` over a KV pool of `pool_bytes` in blocks of `block_size` tokens
    (None: as large as every request at its longest at once; or see `memory_utilization`).
    `buckets`: the slot gears (generate's rule) of a prefill's rows and of the decode table's one width (the
    longest request's gear), whole blocks when None. `timing_only`: every run
    timed by the kernels' cost models without the arithmetic (the schedule does not depend on the tokens, so the
    device figures are the full run's); the new tokens are then unknown, -1. ValueError, before anything runs,
    for a bad argument or a request that could never fit the pool. `progress(done, total)`: told each time a
    request finishes (a progress bar on long runs). `max_batched_tokens`: the most tokens (batch gear x slots, pads
    included) one batched prefill may run, as vLLM's max_num_batched_tokens; a prompt longer runs alone.
    `warmup`: what GE does before the first arrival, as an engine's startup (WARMUPS). "gears" (the default,
    vLLM's: no compile while serving): both step programs compiled, the decode step planned (in graph mode
    captured, by a dummy run each) at every batch gear the pool can hold and the prefill at every (batch gear,
    slots) gear it can take under the token budget (a prefill's rows padded to a power of two of blocks, or to
    `buckets`' gears, as vLLM pads a batch to its next captured size; the padded keys masked, so the tokens are
    the same). vLLM's engine compiles its model before serving (vllm/v1/worker/gpu_model_runner.py: profile_run's
    dummy run of max_num_batched_tokens tokens "triggers compilation for general shape", then compile_sizes) and
    captures every size of cudagraph_capture_sizes (capture_model; vllm-ascend its ACL graphs), so it never
    compiles while serving; GE then plans nothing in the trace, whichever the policy. "decode": the decode gears
    only (each prefill gear planned on the trace's clock when it first occurs); "none": every compile and plan on
    the trace's clock. The startup's GE and device time are reported apart (Serving.startup_ge_us,
    startup_plans): the makespan counts from the first arrival, as vLLM's serving benchmarks measure after
    startup. `memory_utilization` (instead of `pool_bytes`): the pool takes what is left of that share of the
    target's device memory ([memory] hbm_gib) after the weights, the step's inputs and the largest activation
    arena, which GE's plan of the prefill at its largest gear gives before the pool exists, as vLLM's profile run
    does (vLLM's gpu_memory_utilization; Serving.pool_sizing says how)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    if launch not in LAUNCH_MODES:
        raise ValueError(f"launch must be one of {', '.join(LAUNCH_MODES)}, not {launch!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    if warmup not in WARMUPS:
        raise ValueError(f"warmup must be one of {', '.join(WARMUPS)}, not {warmup!r}")
    if max_batched_tokens < 1:
        raise ValueError(f"max_batched_tokens must be at least 1, not {max_batched_tokens}")
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
    _check_block(model, block_size)
    per_token = kv_bytes_per_token(model)
    if per_token < 1:
        raise ValueError("the model keeps no keys or values (no layers, or no K/V heads): it has no KV cache to serve")
    if memory_utilization is not None:
        if pool_bytes is not None:
            raise ValueError("give pool_bytes or memory_utilization, not both")
        _check_memory(as_target(target), memory_utilization)
        # provisional, for the export and the memory profile (the programs take a pool of any size): the server
        # sizes the pool from the device's memory before its warm-up
        pool = KVBlockPool(sum(-(-s.most_slots // block_size) for s in seqs), block_size, per_token)
    elif pool_bytes is None:
        blocks = sum(-(-s.most_slots // block_size) for s in seqs)
        pool = KVBlockPool(blocks, block_size, per_token)
    else:
        _check_pool_bytes(int(pool_bytes), as_target(target))
        pool = KVBlockPool.from_bytes(int(pool_bytes), block_size, per_token)
    if buckets is not None:  # a gear for the longest cache any step needs, said now rather than mid-run
        bucket_length(max(s.most_slots for s in seqs), buckets)
    if memory_utilization is None:
        _refuse_unfittable(seqs, pool)
    run = _Server(model, seqs, pool, policy, buckets, as_target(target), pipeline, listeners, timing_only,
                  progress, launch, max_batched_tokens, warmup, memory_utilization).run()
    if memory_utilization is not None:
        return attrs.evolve(run, pool_sized_from="memory")
    return attrs.evolve(run, pool_sized_from="requests" if pool_bytes is None else "pool_bytes")


def _check_block(model: torch.nn.Module, block_size: int) -> None:
    """ValueError unless one KV block of `block_size` tokens is one cube tile of FIA's paged attention (ATB
    PagedAttentionOperation: block_size x head dim <= 128 x 128), said before any step is exported or planned."""
    head_dim = _StepModule(model, False).head_dim
    if block_size * head_dim > CUBE_TILE_ELEMENTS:
        raise ValueError(f"block_size {block_size}: a block of {block_size} keys of head dim {head_dim} "
                         f"({block_size * head_dim} elements) exceeds one 128 x 128 cube tile (ATB PagedAttention: "
                         f"block_size x head dim <= 128 x 128); this model takes blocks of at most "
                         f"{CUBE_TILE_ELEMENTS // head_dim} tokens")


def _check_pool_bytes(pool_bytes: int, target: Target) -> None:
    """ValueError for a pool larger than the device's memory (or, on a target that names none, than any tensor)."""
    limit = target.memory.hbm_bytes or MAX_TENSOR_BYTES
    if pool_bytes > limit:
        what = f"the {target.name} device's {limit} B of memory" if target.memory.hbm_bytes else f"{limit} B"
        raise ValueError(f"pool_bytes {pool_bytes}: a KV pool larger than {what}")


def _check_host_holds(pool: KVBlockPool, how: str) -> None:
    """ValueError where serving with numbers cannot hold the KV pool in the host's memory (the simulated device's
    bytes are the host's: a 60 GB pool sized from an NPU's memory is a timing-only pool)."""
    available = host_bytes_available()
    if available is not None and pool.pool_bytes > available:
        raise ValueError(f"a KV pool of {pool.pool_bytes} B{' ' + how if how else ''} does not fit the "
                         f"{available} B this host has available to compute the numbers in: serve it timing only "
                         f"(no bytes held), or give a smaller pool_bytes")


def _check_memory(target: Target, utilisation: float) -> None:
    """ValueError unless `utilisation` is a share of a device memory the target names."""
    if not 0 < utilisation <= 1:
        raise ValueError(f"memory_utilization must be a share of the device's memory in (0, 1], not {utilisation}")
    if not target.memory.hbm_bytes:
        raise ValueError(f"target {target.name} names no device memory ([memory] hbm_gib): give pool_bytes")


def _refuse_unfittable(seqs: list[_Sequence], pool: KVBlockPool) -> None:
    """ValueError for the first request whose prompt and new tokens could never fit `pool`."""
    for s in seqs:
        if not pool.fits_ever(s.most_slots):
            raise ValueError(f"request {s.index} can never fit the KV pool: its prompt of {len(s.prompt)} tokens and "
                             f"{s.max_new} new tokens need {pool.blocks_for(s.most_slots)} blocks of "
                             f"{pool.block_size} tokens ({pool.blocks_for(s.most_slots) * pool.block_bytes} B), the "
                             f"pool has {pool.num_blocks} ({pool.pool_bytes} B)")


class _Server:
    """The scheduler and the one clock: GE's sessions for both step programs, the batch's cache on the device."""

    def __init__(self, model: torch.nn.Module, seqs: list[_Sequence], pool: KVBlockPool, policy: str,
                 buckets: Sequence[int] | str | None, target: Target, pipeline: str,
                 listeners: Sequence[RuntimeListener], timing_only: bool = False,
                 progress: Callable[[int, int], None] | None = None, launch: str = "single-op",
                 max_batched_tokens: int = MAX_BATCHED_TOKENS, warmup: str = "none",
                 memory_utilization: float | None = None):
        self.seqs = seqs
        self.warmup = warmup
        self.max_batched_tokens = max_batched_tokens
        self.progress = progress
        self.finished = 0
        self.timing_only = timing_only
        self.pool = pool
        self.policy = policy
        self.buckets = buckets
        self.target = target
        self.pipeline = pipeline
        self.listeners = listeners
        self.pools_unpinned = True  # both step programs take a pool of any size (_unpin_pools)
        self.loop = _Loop(*self._programs(model, seqs[0].prompt), target, pipeline, listeners, launch)
        # each row's key count, an input of the decode step's attention (FIA's actual_seq_lengths_kv)
        self.kv_lengths = _bind_kv_lengths(self.loop.sessions["decode"][0].generic)
        # the decode step's block table has one width for the whole run, as vLLM's (vllm/v1/worker/block_table.py:
        # max_num_blocks_per_req = cdiv(max_model_len, block_size)), the longest sequence served standing for
        # max_model_len (or its `buckets` gear): its shape, the mask's and every other input's depend on the batch
        # gear only, so GE plans the decode step once per batch gear; each row's length says where it stops
        self.decode_blocks = pool.blocks_for(self._slots(max(s.most_slots for s in seqs)))
        self.names = {phase: [a.name for a in session.generic.args]
                      for phase, (session, _) in self.loop.sessions.items()}
        self.regroups = 0  # none: attention reads the pool's blocks in place (ge.paged_attention)
        self.steps: list[ServeStep] = []
        self.host_free = 0.0
        self.device_free = 0.0
        self.sizing: PoolSizing | None = None
        if memory_utilization is not None:  # vLLM's order: the profile, then the pool, then the warm-up
            if not self.pools_unpinned:
                raise ValueError("this model's step programs fix the KV pool's size (a use of the pool beside its "
                                 "update and its blocks' read), so it cannot be sized after them: give pool_bytes")
            self.sizing = self._memory_profile(memory_utilization)
            self.pool = self._pool_from(self.sizing)
            _refuse_unfittable(seqs, self.pool)
        if not timing_only:
            _check_host_holds(self.pool, "sized from the device's memory" if self.sizing else "")
        self.pools = self._empty_pools()
        self.admissions = 0
        # GE's host us, plans, device us before the first arrival: the memory profile's plan is startup work too
        self.startup = (0.0, 0, 0.0) if self.sizing is None else (self.sizing.profile_ge_us, 1, 0.0)
        self.startup_misses = self.startup[1]
        if warmup != "none":
            self._warm_up(prefill=warmup == "gears")

    def decode_gears(self) -> list[int]:
        """Every batch gear a decode step of this run can take: 1, 2, 4, ... up to the gear of the most sequences
        the pool can hold at once (one block each at least) or the requests, whichever is fewer: vLLM captures
        every size of its list up to max_num_seqs (vllm/worker/model_runner.py, _BATCH_SIZES_TO_CAPTURE = [1, 2, 4]
        and multiples of 8; capture_model), GEIR's decode batches being powers of two."""
        most = _batch_gear(min(len(self.seqs), self.pool.num_blocks))
        return [1 << i for i in range(most.bit_length())]

    def prefill_gears(self) -> list[tuple[int, int]]:
        """Every (batch gear, slots) a batched prefill of this run can take: a batch gear as a decode step's, by the
        slots of each row length from the shortest prompt serve takes (2) to the longest sequence (a recompute
        prefills a preempted sequence's tokens too), within the token budget (max_batched_tokens: batch gear x
        slots) unless the prompt runs alone. vLLM's startup likewise covers every size a step can take up to its
        max_num_batched_tokens (the general shape's compile, then compile_sizes and cudagraph_capture_sizes)."""
        longest = max(s.most_slots for s in self.seqs)
        slots = sorted({self._prefill_slots(t) for t in range(2, longest + 1)})
        return [(b, n) for b in self.decode_gears() for n in slots if b == 1 or b * n <= self.max_batched_tokens]

    def _warm_up(self, prefill: bool = True) -> None:
        """The engine's startup, before the first arrival: both step programs compiled, the decode step planned at
        every batch gear and (`prefill`) the prefill at every gear (prefill_gears). In graph mode each plan is
        captured by a dummy run, timing only, over stand-in pools and empty tables (vLLM's capture_model: a dummy
        forward per size); in single-op mode GE plans them and nothing runs, as vLLM's eager mode (enforce_eager)
        captures nothing (so the startup has no device time). Its figures are kept apart; the trace's clock starts
        at 0 with the host and the device free."""
        ge_us = device_us = 0.0
        for phase in ("prefill", "decode"):
            if phase in self.loop.uncompiled:
                self.loop.uncompiled.discard(phase)
                ge_us += self.loop.sessions[phase][0].compile_us
        misses = sum(session.misses for session, _ in self.loop.sessions.values())
        pools = self._empty_pools(stand_ins=True)
        names = self.names["decode"]
        for batch in self.decode_gears():
            rows = [_Sequence(-1, self.seqs[0].prompt, 1, 0.0, list(self.seqs[0].prompt)) for _ in range(batch)]
            tables = [[0] * self.decode_blocks for _ in rows]
            feed = {k: to_numpy(v) for k, v in zip(names, _decode_inputs(rows, tables, self.decode_blocks,
                                                                          self.pool.block_size))}
            feed.update(zip(names[DECODE_INPUTS:], pools))
            if self.kv_lengths is not None:
                feed[self.kv_lengths] = _kv_lengths(rows)
            ge_us, device_us = self._ready("decode", feed, ge_us, device_us)
        for batch, slots in self.prefill_gears() if prefill else ():
            feed = self._dummy_prefill(self.names["prefill"], batch, slots, pools)
            ge_us, device_us = self._ready("prefill", feed, ge_us, device_us)
        self.startup_misses += sum(session.misses for session, _ in self.loop.sessions.values()) - misses
        self.startup = (self.startup[0] + ge_us, self.startup_misses, device_us)

    def _ready(self, phase: str, feed: dict[str, Any], ge_us: float, device_us: float) -> tuple[float, float]:
        """One gear made ready before the first arrival: planned by GE, and in graph mode captured by a dummy run
        (no step: nobody is told of its tasks); the startup's GE and device time with it added."""
        if self.loop.launch == "graph":
            run = self.loop.plan_and_run(phase, feed, timing_only=True, listened=False)
            return ge_us + run.ge_us, device_us + run.device_us
        session = self.loop.sessions[phase][0]
        misses = session.misses
        session.program({k: v.shape for k, v in feed.items()})
        return ge_us + (session.last_ge_us if session.misses > misses else 0.0), device_us

    def _memory_profile(self, utilisation: float) -> PoolSizing:
        """vLLM's profile run, before the pool exists: GE's plan of the prefill at its largest gear (the most tokens
        a step runs) over the provisional pool, whose activation arena is every step's largest (no plan's arena
        grows with the pool: GE leaves a donated pool in its input buffer, passes/plan.py); with the weights and
        the step's other inputs, as that plan lays them out."""
        from geir.passes.plan import align

        session = self.loop.sessions["prefill"][0]
        batch, slots = max(self.prefill_gears(), key=lambda gear: gear[0] * gear[1])
        pools = self._empty_pools(stand_ins=True)
        feed = self._dummy_prefill(self.names["prefill"], batch, slots, pools)
        program = session.program({k: v.shape for k, v in feed.items()})
        memory = program.attributes["memory"]
        pool_inputs = sum(align(a.type.nbytes, ALIGN) for a in program.args[PREFILL_INPUTS:])
        return PoolSizing(self.target.memory.hbm_bytes, utilisation, memory["constants"], memory["arena"],
                          memory["inputs"] - pool_inputs, self._scratch_slots(), session.last_ge_us)

    def _pool_from(self, sizing: PoolSizing) -> KVBlockPool:
        """The pool of as many blocks as the free bytes hold; ValueError if not one block does."""
        tensors, per_token, bs = 2 * self.layers, self.pool.bytes_per_token, self.pool.block_size
        # the pool tensors (a key and a value tensor per layer, each 512-byte aligned as GE lays inputs out) share
        # the free bytes: each takes the slots a whole number of alignments holds
        each = sizing.free_bytes // tensors // ALIGN * ALIGN
        slots = each // (per_token // tensors) - sizing.scratch_slots
        if slots < bs:
            raise ValueError(f"the device's memory leaves no room for a KV pool: {sizing.budget_bytes} B "
                             f"({100 * sizing.utilisation:.0f} % of {sizing.device_bytes} B) less the weights "
                             f"({sizing.weights_bytes} B), activations ({sizing.activation_bytes} B) and inputs "
                             f"({sizing.input_bytes} B)")
        return KVBlockPool(slots // bs, bs, per_token)

    def _dummy_prefill(self, names: list[str], batch: int, slots: int, pools: list[Any]) -> dict[str, Any]:
        """A warm-up's prefill feed at gear (batch, slots): full rows of token 0 over block 0, and `pools`."""
        bs = self.pool.block_size
        rows, writes = [[0] * slots] * batch, [list(range(slots))] * batch  # full rows: no scratch slot needed
        tables = [[0] * (slots // bs)] * batch
        feed = {k: to_numpy(v) for k, v in zip(names, _prefill_inputs(rows, slots, writes, tables, bs))}
        feed.update(zip(names[PREFILL_INPUTS:], pools))
        return feed

    def _scratch_slots(self) -> int:
        """Slots past the pool's blocks for a prefill row's pads (see _pool_shape)."""
        return max((self._prefill_slots(s.most_slots) for s in self.seqs), default=0)

    def _pool_shape(self) -> tuple[int, int, int]:
        """One layer's key (or value) pool: [pool slots + scratch slots, Nkv, D]. The scratch slots, past the
        pool's blocks, take the keys of a prefill row's pads that lie past its own blocks (a shorter row of a
        batched prefill, or a `buckets` gear longer than its blocks): no sequence's block holds them, no table
        names them."""
        return (self.pool.num_blocks * self.pool.block_size + self._scratch_slots(), self.kv_heads, self.head_dim)

    def _empty_pools(self, stand_ins: bool = False) -> list[DeviceTensor]:
        """Every layer's key and value pool, resident on the device from the start (zeros; timing only, or
        `stand_ins` for a warm-up's or the memory profile's dummy feed: stand-ins that hold no bytes)."""
        t = TensorType(self._pool_shape(), geir_dtype(self.dtype, "the KV pool"))
        none = self.timing_only or stand_ins
        storage = (lambda: np.empty(0, np.uint8)) if none else (lambda: np.zeros(t.shape, t.dtype.np))
        return [DeviceTensor(t, storage()) for _ in range(2 * self.layers)]

    def _programs(self, model: torch.nn.Module, prompt: list[int]) -> tuple[Any, Any]:
        """The prefill (one sequence, its length dynamic) and the decode step (batch and blocks dynamic) over the
        KV pools, exported from the model and imported by GEIR's frontend (its attention over the pools' blocks
        becomes ge.paged_attention in GE's fuse pass: passes/fusion/paged_attention.py)."""
        return self._prefill_program(model, prompt), self._decode_program(model, prompt)

    def _stand_in_pools(self, model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        """Stand-ins of the pools' shape for tracing (broadcast views: no memory, whatever the pool's size); the
        model's layer count, KV heads, head size and dtype noted."""
        step = _StepModule(model, False)
        self.layers, self.kv_heads, self.head_dim, self.dtype = step.layers, step.kv_heads, step.head_dim, model.dtype
        return tuple(torch.zeros(1, 1, 1, dtype=model.dtype).expand(self._pool_shape()) for _ in range(2 * step.layers))

    def _step_program(self, step: type[_PagedStep], model: torch.nn.Module, inputs: tuple, dynamic: tuple,
                      source: str) -> Any:
        """A step program over the pools (`inputs` with their `dynamic` dims, then each layer's pools), exported and
        imported: from a two-layer cut of the model where its layers are one layer repeated (generate.import_step)."""
        pools, bs = self._stand_in_pools(model), self.pool.block_size
        return import_step(lambda m: step(m, bs), model, inputs, dynamic, pools, tuple(None for _ in pools),
                           source=source)

    def _prefill_program(self, model: torch.nn.Module, prompt: list[int]) -> Any:
        """The batched prefill over the pools (batch and blocks dynamic), exported and imported."""
        bs = self.pool.block_size
        b_dim, n_dim = _DIMS
        s_dim = _slots_dim(n_dim, bs)
        # a batch of two rows of different lengths over three blocks: the trace sees padding (each row's mask)
        slots = 3 * bs
        rows = [(prompt * slots)[:slots], (prompt * slots)[:max(2, slots - 1)]]
        tables = [[0, 1, 2], [3, 4, 5]]
        writes = [[_slot_of(t, j, bs) for j in range(slots)] for t in tables]
        dynamic = ({0: b_dim, 1: s_dim}, {0: b_dim, 1: s_dim}, {0: s_dim}, {0: b_dim, 1: s_dim}, {0: b_dim},
                   {0: b_dim, 1: s_dim}, {0: b_dim, 1: n_dim})
        prefill = self._step_program(_PagedPrefill, model, _prefill_inputs(rows, slots, writes, tables, bs), dynamic,
                                     "<prefill>")
        self.pools_unpinned &= _unpin_pools(prefill.module.graph(), PREFILL_INPUTS)
        _donate_pools(prefill.module.graph(), PREFILL_INPUTS)
        return prefill

    def _decode_program(self, model: torch.nn.Module, prompt: list[int]) -> Any:
        """The decode step over the pools (batch and table width dynamic), exported and imported."""
        bs = self.pool.block_size
        b_dim, n_dim = _DIMS
        rows = [_Sequence(0, prompt, 2, 0.0, [1, 2]), _Sequence(1, prompt, 2, 0.0, [1, 2])]
        dynamic = ({0: b_dim}, {0: b_dim, 1: _slots_dim(n_dim, bs)}, None, {0: b_dim}, {0: b_dim}, {0: b_dim, 1: n_dim})
        decode = self._step_program(_PagedDecode, model, _decode_inputs(rows, [[0, 0], [0, 0]], 2, bs), dynamic,
                                    "<decode>")
        self.pools_unpinned &= _unpin_pools(decode.module.graph(), DECODE_INPUTS)
        _donate_pools(decode.module.graph(), DECODE_INPUTS)
        return decode

    # --- the slots rule ---

    def _slots(self, tokens: int) -> int:
        """Cache slots per row for sequences of up to `tokens` cached tokens: `buckets`' gear, or whole blocks."""
        if self.buckets is not None:
            return bucket_length(tokens, self.buckets)
        return self.pool.blocks_for(tokens) * self.pool.block_size

    def _prefill_slots(self, tokens: int) -> int:
        """A prefill row's slots for up to `tokens` tokens, in whole blocks (the row attends through its block
        table, which names whole blocks): `buckets`' gear, or else a power of two of blocks, as the batch is a
        power of two of rows. So a run's prefill gears are few (log2 x log2) and known before the first arrival,
        and the warm-up plans them all, as vLLM pads a batch's tokens to its next captured size
        (cudagraph_capture_sizes) and GE's dynamic gears (ge.dynamicDims) pad an input to its next listed gear."""
        if self.buckets is not None:
            return self.pool.blocks_for(self._slots(tokens)) * self.pool.block_size
        return _batch_gear(self.pool.blocks_for(tokens)) * self.pool.block_size

    def _prefill_cost(self, seqs: list[_Sequence]) -> int:
        """The tokens a batched prefill of `seqs` runs: its batch gear x its slots (pads included: the work the
        step does, counted against the iteration's token budget)."""
        return _batch_gear(len(seqs)) * self._prefill_slots(max(len(s.tokens) for s in seqs))

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

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """One batched prefill (vLLM's: an iteration's admitted prompts in one step) over each sequence's tokens
        (its prompt, and what it had before a preemption): each row's keys and values written into its blocks of
        the pools, its attention through its block table over its own length, its first token from its own last
        position. The batch is padded to a power of two (rows repeating the first, results dropped) and the rows
        to the longest's whole blocks: GE's gears."""
        bs = self.pool.block_size
        slots = self._prefill_slots(max(len(s.tokens) for s in seqs))
        batch = _batch_gear(len(seqs))
        padded = seqs + [seqs[0]] * (batch - len(seqs))
        scratch = self.pool.num_blocks * bs
        tables, writes = [], []
        for s in padded:
            table = self.pool.allocate(s.index, len(s.tokens))  # a no-op when admission or a reservation made it
            own = len(table) * bs
            tables.append(table)
            writes.append([_slot_of(table, j, bs) if j < own else scratch + j - own for j in range(slots)])
        names = self.names["prefill"]
        feed = {k: to_numpy(t) for k, t in zip(names, _prefill_inputs([s.tokens for s in padded], slots, writes,
                                                                      tables, bs))}
        feed.update(zip(names[PREFILL_INPUTS:], self.pools))
        run = self.loop.plan_and_run("prefill", feed, self.timing_only)
        for s in seqs:
            self.pool.store(s.index, len(s.tokens))
        self.pools = self._results(run.program, run.result)[1:]
        split = time_split(run.result)
        step = self._record("prefill", seqs, batch, slots, run.ge_us, run.replanned, split,
                            max(s.arrival_us for s in seqs))
        logits = None if self.timing_only else np.asarray(run.result.outputs[0])
        for i, s in enumerate(seqs):
            self._emit(s, None if logits is None else logits[i], step.end_us)

    def _results(self, program: Any, result: Any) -> list[Any]:
        """A run's results; timing only: stand-ins of their types for the cache (on the device, never read)."""
        if not self.timing_only:
            return list(result.outputs)
        return [DeviceTensor(v.type, np.empty(0, np.uint8)) for v in program.terminator.operands]

    def _emit(self, seq: _Sequence, logits: np.ndarray | None, at_us: float) -> None:
        """The row's greedy token, ready when its step ends (timing only: not known, -1)."""
        seq.tokens.append(-1 if logits is None else int(np.asarray(logits, dtype=np.float64).argmax(-1)))
        seq.token_us.append(at_us)

    def _decode(self, rows: list[_Sequence], live: set[int]) -> None:
        """One decode step over the running rows (`live`: the rows whose tokens count; static batching keeps
        finished rows in the batch, their results dropped), each attending over its own blocks of the pools."""
        batch = _batch_gear(len(rows))
        blocks = self.decode_blocks  # the table's fixed width: the step's program depends on its batch gear only
        slots = blocks * self.pool.block_size
        names = self.names["decode"]
        # the padded rows repeat the first row (its slot written twice with the same values); their results dropped
        padded = rows + [rows[0]] * (batch - len(rows))
        tables = [self.pool.tables[r.index] for r in padded]
        feed = {k: to_numpy(t) for k, t in zip(names, _decode_inputs(padded, tables, blocks, self.pool.block_size))}
        feed.update(zip(names[DECODE_INPUTS:], self.pools))
        if self.kv_lengths is not None:
            feed[self.kv_lengths] = _kv_lengths(padded)
        run = self.loop.plan_and_run("decode", feed, self.timing_only)
        self.pools = self._results(run.program, run.result)[1:]
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
                       sum(s.misses for s in sessions) - self.startup_misses, self.regroups, warmup=self.warmup,
                       startup_ge_us=self.startup[0], startup_plans=self.startup[1], startup_device_us=self.startup[2],
                       pool_sizing=self.sizing)

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
            # admit what has arrived and fits, first come first served, within the iteration's token budget
            # (vLLM's scheduler, _schedule_prefills: stop at the first request the blocks or the budget refuse);
            # the admitted prompts are prefilled together in one step, then join the running batch
            admitted: list[_Sequence] = []
            for seq in list(waiting):
                if seq.arrival_us > now:
                    break
                if not self.pool.can_hold(seq.index, len(seq.tokens) + (0 if seq.new + 1 >= seq.max_new else 1)):
                    break
                if admitted and self._prefill_cost(admitted + [seq]) > self.max_batched_tokens:
                    break  # a prompt over the budget runs alone (vLLM ignores it: here no request is lost)
                waiting.remove(seq)
                self.pool.allocate(seq.index, len(seq.tokens))
                seq.admitted = self.admissions
                self.admissions += 1
                admitted.append(seq)
            if admitted:
                self._prefill(admitted)
                for seq in admitted:
                    if seq.done:
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
            # the batch's prompts prefilled together, in as few steps as the token budget allows
            chunk: list[_Sequence] = []
            for seq in batch:
                if chunk and self._prefill_cost(chunk + [seq]) > self.max_batched_tokens:
                    self._prefill(chunk)
                    chunk = []
                chunk.append(seq)
            self._prefill(chunk)
            for _ in range(steps - 1):
                self._decode(batch, {s.index for s in batch if not s.done})
            for seq in batch:
                self._finish(seq)


