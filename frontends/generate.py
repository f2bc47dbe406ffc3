"""A Hugging Face causal LM generating token by token on the simulated NPU: GE and the Runtime adapting per step.

`generate` exports two step programs once, with the lengths dynamic: a prefill (the prompt, the KV
cache made on the device) and a decode step (one token, the cache passed in). Each step writes its
keys and values into the cache at its positions (`index_copy`, GEIR's `ge.index_put`) and attends
over the whole cache, the slots past the tokens masked, as a static cache does. The cache stays on
the device between steps: each step keeps it there (DeviceTensors, never host arrays) and the next
takes it as resident inputs, so it never crosses the host link; when a step needs more slots than
the cache has, the Runtime grows it into a larger region (a device copy, on the timeline). Every new
cache length is a shape signature: the plan cache re-plans for it, so `buckets` (GE's gears: a list
of lengths, or "pow2") round the cache up and trade padding for plan-cache hits. One timeline: GE's
host work (each re-plan prepared for the next step while the device runs the current one, as
the seed describes) and the device's runs; every step is a `Step` record, and `Generation.timeline`
the typed timeline (geir.runtime.trace) its Chrome trace renders from.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import attrs
import numpy as np
import torch

from geir.builder import Builder
from geir.frontends.torch_builder import TorchImportError, to_numpy
from geir.frontends.torch_import import ImportedProgram, import_program
from geir.frontends.torch_regional import LayersDiffer, cut_to_two_layers
from geir.ir import Module
from geir.runtime.device import DeviceTensor
from geir.runtime.interpreter import LAUNCH_MODES, GraphCaptures, RuntimeListener
from geir.runtime.launch_memo import LaunchMemo
from geir.runtime.profile import time_split
from geir.runtime.trace import Counter, Span, Trace, Track, chrome_trace
from geir.session import DEFAULT_PIPELINE, Session, run_program
from geir.target_npu.target import DEFAULT_TARGET, Target, as_target
from geir.types import TensorType

PHASES = ("prefill", "decode", "grow")
# the tracks of a generation's timeline: GE's host work, the device's steps (and its memory counters)
GE_HOST = Track(0, 0, "host: GE", "GE")
DEVICE_STEPS = Track(1, 0, "device", "steps")


@attrs.frozen
class Step:
    """One step of a generation run, on the one timeline (microseconds from the start)."""

    index: int
    phase: str  # "prefill" or "decode"
    query_tokens: int  # the tokens this step feeds: the prompt, then 1
    length: int  # tokens in the KV cache after the step
    cache_length: int  # slots the cache has (a bucket, or `length` without buckets)
    signature: tuple[tuple[int, ...], ...]
    plan_cache: str  # "hit" or "miss"
    host_ge_us: float  # GE's compile or re-plan for this step (0 on a hit), measured host time
    ge_start_us: float
    ge_end_us: float
    grow_us: float  # device time moving the cache into a larger region before the step (0 when it fits)
    device_us: float  # the step's run: the device's span
    kernel_time_us: float  # of which kernels ran (summed over streams)
    transfer_time_us: float  # and host-device copies
    start_us: float  # when the device started the step (its growth first)
    end_to_end_us: float  # when the step ended, from the start of the run
    arena_bytes: int
    arena_lower_bound: int  # the most bytes the step's arena holds live at once (GE's plan)
    kv_bytes: int
    transfers: int  # host-device copies of the step's run (the cache is never one of them)
    tokens: tuple[int, ...]  # the token chosen for each row

    @property
    def padding(self) -> int:
        """Cache slots allocated beyond the tokens."""
        return self.cache_length - self.length

    def as_dict(self) -> dict[str, Any]:
        """The record as plain data (JSON: signatures as lists)."""
        return {**attrs.asdict(self), "signature": [list(s) for s in self.signature], "padding": self.padding}

    def __getitem__(self, key: str) -> Any:
        """The spec's step dictionary reads the record's fields by name: `step["plan_cache"]`."""
        if key == "padding" or key in attrs.fields_dict(Step):
            return getattr(self, key)
        raise KeyError(key)

    def keys(self) -> list[str]:
        """The field names, so that dict(step) is the record as a dictionary."""
        return [*attrs.fields_dict(Step), "padding"]


@attrs.frozen
class StepRun:
    """One step program planned (a plan-cache hit, or GE re-plans it) and run on the simulated device."""

    program: Any
    result: Any
    replanned: bool
    ge_us: float  # GE's host time: the re-plan (0 on a hit), and the program's compile on the first step that runs it
    device_us: float  # the run's span on the device
    kernel_time_us: float
    transfer_time_us: float


@attrs.frozen
class Generation:
    """What `generate` returns: the tokens (prompt and new, per row) and one record per step."""

    tokens: torch.Tensor
    steps: list[Step]
    compiles: int  # GE's compiles of step programs (the prefill and the decode step: 2)
    # per phase, gedoctor's kernel findings on its last step's run (roofline: which kernels are far from it)
    kernel_findings: dict[str, tuple[Any, ...]] = attrs.field(factory=dict)

    def phases(self) -> dict[str, dict[str, float]]:
        """Per phase, where the time went: GE's host work, the cache's growth, copies and kernels (us)."""
        out: dict[str, dict[str, float]] = {}
        for s in self.steps:
            p = out.setdefault(s.phase, {"steps": 0, "host_ge_us": 0.0, "grow_us": 0.0, "transfer_time_us": 0.0,
                                         "kernel_time_us": 0.0, "device_us": 0.0})
            p["steps"] += 1
            p["host_ge_us"] += s.host_ge_us
            p["grow_us"] += s.grow_us
            p["transfer_time_us"] += s.transfer_time_us
            p["kernel_time_us"] += s.kernel_time_us
            p["device_us"] += s.device_us + s.grow_us
        return out

    def doctor(self) -> dict[str, dict[str, Any]]:
        """gedoctor's verdict per phase: the layer most of the time is in (its layer names: ge-host, host-launch,
        runtime, kernel), the time split, and the kernel findings (which kernels are far from their roofline)."""
        out = {}
        for phase, p in self.phases().items():
            # the device's span less its kernels, copies and growth: the device waiting for the Runtime to submit
            idle = max(0.0, p["device_us"] - p["grow_us"] - p["kernel_time_us"] - p["transfer_time_us"])
            split = {"ge-host": p["host_ge_us"], "host-launch": idle, "runtime": p["transfer_time_us"] + p["grow_us"],
                     "kernel": p["kernel_time_us"]}
            out[phase] = {"culprit": max(split, key=split.get), "split_us": split, "submission_idle_us": idle,
                          "steps": p["steps"],
                          "findings": [f.to_json() for f in self.kernel_findings.get(phase, ())]}
        return out

    def diagnose(self) -> str:
        """The doctor's verdict per phase, as prose."""
        words = {"ge-host": "GE's host work (compile, re-plans)",
                 "host-launch": "the host submitting launch after launch (try launch='graph')",
                 "runtime": "the Runtime (copies, the cache's growth)", "kernel": "the kernels"}
        lines = []
        for phase, d in self.doctor().items():
            total = sum(d["split_us"].values()) or 1.0
            split = ", ".join(f"{layer} {us:.0f} us ({100 * us / total:.0f} %)" for layer, us in d["split_us"].items())
            lines.append(f"{phase} ({d['steps']} step(s)): culprit {d['culprit']}, {words[d['culprit']]}; {split}; "
                         f"device idle waiting for submissions {d['submission_idle_us']:.0f} us")
            far = [f for f in d["findings"] if f["kind"] == "far_from_roofline"]
            lines.extend(f"  kernel: {f['message']}" for f in far[:3])
        return "\n".join(lines)

    @property
    def end_to_end_us(self) -> float:
        return self.steps[-1].end_to_end_us if self.steps else 0.0

    @property
    def host_ge_us(self) -> float:
        return sum(s.host_ge_us for s in self.steps)

    @property
    def ge_hidden_us(self) -> float:
        """GE's host work done while the device was running a step (off the critical path)."""
        return sum(max(0.0, min(g.ge_end_us, d.end_to_end_us) - max(g.ge_start_us, d.start_us))
                   for g in self.steps for d in self.steps)

    def summary(self) -> dict[str, Any]:
        """The run in figures: steps, plan-cache hits and misses, host GE share, padding, peak KV bytes."""
        hits = sum(s.plan_cache == "hit" for s in self.steps)
        slots = sum(s.cache_length for s in self.steps[1:]) or 1
        return {"steps": len(self.steps), "compiles": self.compiles, "plan_cache_hits": hits,
                "plan_cache_misses": len(self.steps) - hits, "end_to_end_us": self.end_to_end_us,
                "host_ge_us": self.host_ge_us, "ge_hidden_us": self.ge_hidden_us,
                "host_ge_share": self.host_ge_us / self.end_to_end_us if self.end_to_end_us else 0.0,
                "device_us": sum(s.device_us + s.grow_us for s in self.steps),
                "padding_waste": sum(s.padding for s in self.steps[1:]) / slots,
                "peak_kv_bytes": max((s.kv_bytes for s in self.steps), default=0),
                "peak_arena_bytes": max((s.arena_bytes for s in self.steps), default=0),
                "peak_arena_lower_bound": max((s.arena_lower_bound for s in self.steps), default=0)}

    def timeline(self) -> Trace:
        """The run's one timeline (geir.runtime.trace): GE's host work and the device's steps on one axis, and
        counters of the arena (with its live-bytes bound) and the KV cache per step."""
        trace = Trace()
        for s in self.steps:
            label = f"{s.phase} {s.index} (cache {s.cache_length})"
            if s.host_ge_us:
                trace.spans.append(Span(GE_HOST, f"GE: plan {label}", s.ge_start_us, s.ge_start_us + s.host_ge_us,
                                        "ge", {"signature": [list(x) for x in s.signature]}))
            if s.grow_us:
                trace.spans.append(Span(DEVICE_STEPS, f"grow cache to {s.cache_length}", s.start_us,
                                        s.start_us + s.grow_us, "grow"))
            begin = s.start_us + s.grow_us
            trace.spans.append(Span(DEVICE_STEPS, label, begin, begin + s.device_us, "step",
                                    {"plan_cache": s.plan_cache, "tokens": list(s.tokens)}))
            trace.counters.append(Counter(DEVICE_STEPS, "device memory (bytes)", s.start_us,
                                          {"arena": s.arena_bytes, "arena_lower_bound": s.arena_lower_bound,
                                           "kv_cache": s.kv_bytes}))
        return trace

    def trace(self) -> dict[str, Any]:
        """A Chrome trace (chrome://tracing, Perfetto) of the run's timeline."""
        return chrome_trace(self.timeline(), display_unit="ms")

    def render(self) -> str:
        """The steps as a table, then the summary."""
        lines = [f"{'step':>4} {'phase':<8}{'len':>5}{'cache':>6} {'plan':<5}{'GE us':>9}{'grow us':>9}"
                 f"{'device us':>11}{'end us':>11}{'arena B':>10}{'KV B':>10}  token"]
        for s in self.steps:
            lines.append(f"{s.index:>4} {s.phase:<8}{s.length:>5}{s.cache_length:>6} {s.plan_cache:<5}"
                         f"{s.host_ge_us:>9.0f}{s.grow_us:>9.1f}{s.device_us:>11.1f}{s.end_to_end_us:>11.0f}"
                         f"{s.arena_bytes:>10}{s.kv_bytes:>10}  {','.join(map(str, s.tokens))}")
        m = self.summary()
        lines.append(f"{m['steps']} steps, {m['compiles']} compiles, plan cache {m['plan_cache_hits']} hits / "
                     f"{m['plan_cache_misses']} misses; end to end {m['end_to_end_us']:.0f} us, host GE "
                     f"{m['host_ge_us']:.0f} us ({100 * m['host_ge_share']:.0f} %, {m['ge_hidden_us']:.0f} us of it "
                     f"hidden behind the device), padding {100 * m['padding_waste']:.0f} % of decode cache slots, "
                     f"peak KV {m['peak_kv_bytes']} B, peak arena {m['peak_arena_bytes']} B (live-bytes bound "
                     f"{m['peak_arena_lower_bound']} B)")
        return "\n".join(lines)


def bucket_length(n: int, buckets: Sequence[int] | str | None) -> int:
    """The cache length for `n` tokens: n itself, the next power of two (at least 16), or the smallest gear."""
    if buckets is None:
        return n
    if buckets == "pow2":
        return max(16, 1 << (n - 1).bit_length())
    if isinstance(buckets, str):
        raise ValueError(f"buckets must be None, 'pow2' or a list of lengths, not {buckets!r}")
    fitting = [b for b in sorted(buckets) if b >= n]
    if not fitting:
        raise ValueError(f"{n} tokens exceed the largest bucket ({max(buckets)}): add a larger one")
    return fitting[0]


# --- the step programs ------------------------------------------------------------------------------------

def _cache_layer_class():
    """transformers' StaticLayer over tensors a step takes as inputs, written functionally at the step's slots."""
    from transformers.cache_utils import StaticLayer

    class BoundLayer(StaticLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.slots = keys, values, slots
            self.batch_size, self.num_heads = keys.shape[:2]
            self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
            self.device = keys.device
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            self.keys = self.keys.index_copy(2, self.slots, key_states)
            self.values = self.values.index_copy(2, self.slots, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> torch.Tensor:
            return self.slots[0]  # the tokens before this step's (the masks' query offset)

    return BoundLayer


def kv_heads_of(cfg: Any) -> int:
    """The number of key/value heads as each Hugging Face config spells it: `num_key_value_heads` (LLaMA, Qwen2,
    Mistral), `num_kv_heads` (Falcon's new decoder), `multi_query` (one K/V head: Falcon, GPT-BigCode), else one per
    query head; a config that names no head count is an error saying what was looked for."""
    for name in ("num_key_value_heads", "num_kv_heads"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0 and (name != "num_kv_heads" or getattr(cfg, "new_decoder_architecture",
                                                                                     True)):
            return value
    if getattr(cfg, "multi_query", False):
        return 1
    for name in ("num_attention_heads", "n_head", "num_heads"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"generate: cannot tell how many key/value heads {type(cfg).__name__} has: it sets none of "
                     f"num_key_value_heads, num_kv_heads, multi_query, num_attention_heads, n_head")


class _StepModule(torch.nn.Module):
    """One step as a function of tensors: token ids, the mask over the cache's slots, the slots written, the
    position ids, and the cache (made here, zeroed, for the prefill); returns the last logits and the cache."""

    def __init__(self, model: torch.nn.Module, prefill: bool):
        super().__init__()
        self.model = model
        self.prefill = prefill
        cfg = model.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = kv_heads_of(cfg)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layer_class = _cache_layer_class()

    def forward(self, input_ids, attention_mask, slots, position_ids, *past):
        from transformers.cache_utils import Cache

        if self.prefill:
            batch, length = attention_mask.shape
            zeros = attention_mask.new_zeros((batch, self.kv_heads, length, self.head_dim), dtype=self.model.dtype)
            past = [zeros] * (2 * self.layers)
        cache = Cache(layers=[self.layer_class(past[2 * i], past[2 * i + 1], slots) for i in range(self.layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return (self.next_token_logits(out.logits), *kv)

    def next_token_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the next token is chosen from: the last position's."""
        return logits[:, -1, :]


def _export(step: _StepModule, args: tuple, dynamic: tuple) -> Any:
    """torch.export a step program with its lengths dynamic (transformers' notes on tracing kept quiet)."""
    import contextlib
    import io
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return torch.export.export(step, args, dynamic_shapes=dynamic, strict=False)
        except Exception as e:  # noqa: BLE001 - the model's own forward under the trace may raise anything
            text = str(e).strip()
            raise TorchImportError(f"torch.export cannot trace the model's step program: "
                                   f"{text.splitlines()[0] if text else type(e).__name__}") from e


def import_step(make: Callable[[torch.nn.Module], torch.nn.Module], model: torch.nn.Module, inputs: tuple,
                dynamic: tuple, per_layer: tuple = (), per_layer_dynamic: tuple = (),
                source: str = "<torch.export>") -> ImportedProgram:
    """`make(model)` (a step module over `model`) exported and imported: its `inputs` with their `dynamic` dims,
    then the layers' own inputs (`per_layer`: the same number for each layer, in layer order; the module's
    varargs). Where the model's layers are one layer repeated, a copy cut to two layers is exported and its second
    layer stamped out for the rest (frontends/torch_regional.py: the module the whole model's export imports to,
    op for op, in a fraction of torch.export's time)."""
    cut = cut_to_two_layers(model)
    if cut is not None:
        few = len(per_layer) * 2 // cut.count
        ep = _export(make(cut.model), (*inputs, *per_layer[:few]),
                     (*dynamic, tuple(per_layer_dynamic[:few])) if per_layer else dynamic)
        try:
            return import_program(ep, source=source, repeat=cut.repeat(make(model), "model"))
        except LayersDiffer:
            pass  # the two layers traced differently after all: the whole model, as below
    ep = _export(make(model), (*inputs, *per_layer), (*dynamic, tuple(per_layer_dynamic)) if per_layer else dynamic)
    return import_program(ep, source=source)


def _grow_graph(types: list[TensorType], new_length: int) -> Module:
    """Each cache tensor [B, Nkv, L, D] moved into a region of new_length slots, the new ones zero."""
    b = Builder()
    args = [b.argument(t, f"cache{i}") for i, t in enumerate(types)]
    out = []
    for a in args:
        bsz, heads, length, dim = a.type.shape
        zeros = b.constant(np.array(0, dtype=a.type.dtype.np),
                           TensorType((bsz, heads, new_length - length, dim), a.type.dtype))
        out.append(b.create("ge.concat", [a, zeros], {"axis": 2}).result)
    return Module([b.finish(out)], "<grow cache>")


# --- the generation loop ----------------------------------------------------------------------------------

def generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
             attention_mask: torch.Tensor | None = None, buckets: Sequence[int] | str | None = None,
             dtype: torch.dtype | None = None, target: Target | str = DEFAULT_TARGET,
             pipeline: str = DEFAULT_PIPELINE, listeners: Sequence[RuntimeListener] = (),
             launch: str = "single-op") -> Generation:
    """Greedy generation of `max_new_tokens` by a Hugging Face causal LM (GPT-2, LLaMA-family) on the simulated
    NPU: a prefill, then one decode step per token, the KV cache resident on the device (`listeners`: told of
    every task of every step's run, the cache's growth included)."""
    if dtype is not None:  # a copy in that dtype: the caller's model stays as it is
        import copy

        model = copy.deepcopy(model).to(dtype)
    model = model.eval()
    batch, prompt = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if prompt < 2:  # torch.export specialises a length of 1, so the step programs could not serve others
        raise ValueError(f"the prompt has {prompt} token(s); generate takes prompts of at least 2")
    prefill, decode = export_steps(model, input_ids, mask, bucket_length(prompt, buckets))
    return _Loop(prefill, decode, as_target(target), pipeline, listeners, launch).run(input_ids, mask, max_new_tokens,
                                                                                      buckets)


def export_steps(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor,
                 cache_length: int) -> tuple[ImportedProgram, ImportedProgram]:
    """The prefill and decode step programs `generate` runs, imported (lengths dynamic; the examples: the prompt
    `input_ids` with its `mask` into a cache of `cache_length` slots, then one token after it)."""
    prompt = input_ids.shape[1]
    prefill_args = (input_ids, _slot_mask(mask, cache_length), torch.arange(prompt), _positions(mask)[:, -prompt:])
    s_dim, l_dim = torch.export.Dim("prompt", min=2, max=1 << 16), torch.export.Dim("cache", min=2, max=1 << 16)
    prefill = import_step(lambda m: _StepModule(m, True), model, prefill_args,
                          ({1: s_dim}, {1: l_dim}, {0: s_dim}, {1: s_dim}), source="<prefill>")
    with torch.no_grad():
        example = _StepModule(model, True)(*prefill_args)
    decode_args = (input_ids[:, :1], prefill_args[1], torch.tensor([prompt]), prefill_args[3][:, :1])
    return prefill, import_step(lambda m: _StepModule(m, False), model, decode_args, (None, {1: l_dim}, None, None),
                                example[1:], tuple({2: l_dim} for _ in example[1:]), source="<decode>")


def _slot_mask(mask: torch.Tensor, slots: int) -> torch.Tensor:
    """The attention mask over a cache of `slots`: the tokens' own mask, then zeros for the free slots."""
    out = torch.zeros(mask.shape[0], slots, dtype=torch.long)
    out[:, :mask.shape[1]] = mask
    return out


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as Hugging Face's generate makes them: running counts of real tokens (padding at 0)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


class _Loop:
    """The generation loop: GE's sessions for both step programs, the cache on the device, the one timeline."""

    def __init__(self, prefill: Any, decode: Any, target: Target, pipeline: str,
                 listeners: Sequence[RuntimeListener] = (), launch: str = "single-op"):
        if launch not in LAUNCH_MODES:
            raise ValueError(f"launch must be one of {', '.join(LAUNCH_MODES)}, not {launch!r}")
        self.target = target
        # graph mode: each step program (a plan-cache entry: GE's bucket) is captured on the device once and
        # replayed by one submission per step, as vllm-ascend runs decode with ACL Graph
        self.launch = launch
        self.graphs = GraphCaptures()
        # timing only: launches timed in one step replayed in the next (a decode step repeats its launches)
        self.memo = LaunchMemo()
        self.pipeline = pipeline
        self.listeners = listeners
        self.sessions = {}
        for phase, imported in (("prefill", prefill), ("decode", decode)):
            m = imported.module
            self.sessions[phase] = (Session(Module([m.graph()], m.file, m.resources), pipeline, target),
                                    m.resources)
        self.grows: dict[tuple, Any] = {}
        self.uncompiled = set(self.sessions)  # a step program's compile counts for the first step that runs it
        self.host_free = 0.0
        self.device_free = 0.0
        self.last: dict[str, tuple] = {}  # per phase, its latest step's program and run

    def run(self, input_ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
            buckets: Sequence[int] | str | None) -> Generation:
        batch, prompt = input_ids.shape
        tokens = input_ids.clone()
        steps: list[Step] = []
        cache: list[DeviceTensor] = []  # kept on the device from step to step: never a host array
        for index in range(new_tokens):
            phase = "prefill" if index == 0 else "decode"
            length = prompt + index  # tokens in the cache after this step
            slots = bucket_length(length, buckets)
            grow_us = ge_us = 0.0
            if phase == "decode" and cache[0].shape[2] < slots:
                cache, grow_us, ge_us = self._grow(cache, slots)
            fed = tokens if phase == "prefill" else tokens[:, -1:]
            positions = _positions(mask)[:, -fed.shape[1]:]
            first = 0 if phase == "prefill" else length - 1
            feed_t = (fed, _slot_mask(mask, slots), torch.arange(first, first + fed.shape[1]), positions)
            session = self.sessions[phase][0]
            names = [a.name for a in session.generic.args]
            feed = {n: to_numpy(t) for n, t in zip(names, feed_t)}
            if phase == "decode":
                feed.update({n: c for n, c in zip(names[4:], cache)})
            run = self.plan_and_run(phase, feed)
            program, result, replanned, device_us = run.program, run.result, run.replanned, run.device_us
            ge_us += run.ge_us
            split = {"kernel_time_us": run.kernel_time_us, "transfer_time_us": run.transfer_time_us}
            logits = np.asarray(result.outputs[0], dtype=np.float64)
            cache = list(result.outputs[1:])
            chosen = torch.from_numpy(logits.argmax(-1)).to(tokens.dtype)
            tokens = torch.cat([tokens, chosen[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
            # GE prepares a step as soon as the host is free (the next signature is known in advance), while
            # the device still runs the step before; the device starts once the plan and the previous token are
            ge_start = self.host_free
            ge_end = ge_start + ge_us
            self.host_free = ge_end
            begin = max(self.device_free, ge_end)
            end = begin + grow_us + device_us
            self.device_free = end
            memory = program.attributes.get("memory") or {}
            steps.append(Step(index, phase, fed.shape[1], length, slots,
                              tuple(tuple(v.shape) for v in feed.values()), "miss" if replanned else "hit", ge_us,
                              ge_start, ge_end, grow_us, device_us, split["kernel_time_us"],
                              split["transfer_time_us"], begin, end, int(memory.get("arena", 0)),
                              int(program.attributes.get("arena_lower_bound", memory.get("arena", 0))),
                              sum(c.nbytes for c in cache), sum(t.kind != "kernel" for t in result.tasks),
                              tuple(int(t) for t in chosen)))
        from geir.session.doctor import kernel_findings, kernel_views

        findings = {phase: tuple(kernel_findings(kernel_views(program, result), result.target))
                    for phase, (program, result) in self.last.items()}
        return Generation(tokens, steps, len(self.sessions), findings)

    def plan_and_run(self, phase: str, feed: dict[str, Any], timing_only: bool = False,
                     listened: bool = True) -> StepRun:
        """A step of `phase`'s program on these inputs: its plan (from the plan cache, or GE re-plans it) run on
        the device, the results after the first (the cache) kept there (`listened`: the listeners are told of its
        tasks; False for an engine's warm-up runs, which are no step)."""
        session, weights = self.sessions[phase]
        misses = session.misses
        program = session.program({k: v.shape for k, v in feed.items()})
        replanned = session.misses > misses
        ge_us = session.last_ge_us if replanned else 0.0
        if phase in self.uncompiled:
            self.uncompiled.discard(phase)
            ge_us += session.compile_us
        kv_results = range(1, len(session.generic.terminator.operands))  # the cache: it stays on the device
        result = run_program(program, feed, weights, target=self.target, keep=kv_results,
                             listeners=self.listeners if listened else (),
                             timing_only=timing_only, launch_mode=self.launch, graphs=self.graphs, memo=self.memo)
        ge_us += result.capture_us  # graph mode: GE loads a new program's task graph onto the device once
        split = time_split(result)
        self.last[phase] = (program, result)
        return StepRun(program, result, replanned, ge_us, split["simulated_time_us"], split["kernel_time_us"],
                       split["transfer_time_us"])

    def _grow(self, cache: list[DeviceTensor], slots: int) -> tuple[list[DeviceTensor], float, float]:
        """The cache moved into a region of `slots` on the device: the moved cache, the move's device time, and
        GE's host time compiling the move (once per pair of lengths)."""
        from geir.session import compile_module

        key = (cache[0].shape, slots)
        ge_us = 0.0
        if key not in self.grows:
            types = [c.type for c in cache]
            start = time.perf_counter()
            self.grows[key] = compile_module(_grow_graph(types, slots), self.pipeline, self.target)[0].graphs[0]
            ge_us = (time.perf_counter() - start) * 1e6
        program = self.grows[key]
        names = [a.name for a in program.args]
        # the cache, DeviceTensors, is resident: the move is a device copy, nothing crosses the host link
        result = run_program(program, dict(zip(names, cache)), target=self.target, keep=range(len(cache)),
                             listeners=self.listeners, launch_mode=self.launch, graphs=self.graphs)
        return list(result.outputs), time_split(result)["simulated_time_us"], ge_us + result.capture_us
