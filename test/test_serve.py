"""Serving many requests (geir.frontends.torch.serve): continuous and static batching over the KV block pool.

Oracles: Hugging Face's greedy `model.generate` on each prompt alone for the tokens; for the figures, what
follows from the step records and the shapes: a request's token times are the ends of the device runs that
served it, KV bytes per token = 2 x layers x KV heads x head dim x 4, blocks = ceil(tokens / block size),
throughput = new tokens / makespan; static batching's reservation from its definition.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from geir.frontends.torch import serve  # noqa: E402
from helpers.tiny_models import tiny_gpt2, tiny_llama  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4


def _llama() -> torch.nn.Module:
    return tiny_llama(LAYERS, KV_HEADS)


def _gpt2() -> torch.nn.Module:
    return tiny_gpt2(LAYERS)


def _trace(lengths=((5, 6, 0.0), (9, 4, 0.0), (3, 7, 300.0), (12, 5, 2000.0)), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, 100, (n,), generator=g), new, at) for n, new, at in lengths]


def _hf(model, ids, new):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=new,
                              do_sample=False, pad_token_id=0)[0]


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def runs(llama):
    """Both policies on one trace, a pool large enough for all (block size 8), and a pool that forces preemption,
    every plan on the trace's clock (no warm-up); and both policies after vLLM's warm-up (the default)."""
    trace = _trace()
    return {"trace": trace,
            "continuous": serve(llama, trace, policy="continuous", block_size=8, warmup="none"),
            "static": serve(llama, trace, policy="static", block_size=8, warmup="none"),
            "tight": serve(llama, trace, policy="continuous", block_size=4, pool_bytes=10 * 4 * PER_TOKEN + 100,
                           warmup="none"),
            "warm continuous": serve(llama, trace, policy="continuous", block_size=8),
            "warm static": serve(llama, trace, policy="static", block_size=8)}


@pytest.mark.parametrize("name", ["continuous", "static", "tight", "warm continuous", "warm static"])
def test_every_request_gets_hugging_faces_greedy_tokens(runs, llama, name):
    run = runs[name]
    assert len(run.requests) == len(runs["trace"])
    for record, (ids, new, _) in zip(run.requests, runs["trace"]):
        assert record.tokens.dtype == torch.long
        assert torch.equal(record.tokens, _hf(llama, ids, new))  # all of them: never lost, never truncated
        assert record.new_tokens == new and record.prompt_length == len(ids)


def test_gpt2_served_continuously_matches_hugging_face():
    model = _gpt2()
    trace = _trace(((4, 3, 0.0), (7, 5, 0.0), (2, 4, 10.0)), seed=2)
    told = []
    run = serve(model, trace, block_size=4, progress=lambda done, total: told.append((done, total)))
    assert told == [(1, 3), (2, 3), (3, 3)]  # once per finished request
    for record, (ids, new, _) in zip(run.requests, trace):
        assert torch.equal(record.tokens, _hf(model, ids, new))
    assert all(s.slots % 4 == 0 for s in run.steps)  # without buckets, whole blocks
    geared = serve(model, trace, block_size=4, buckets=[8, 16], policy="static")
    assert [r.tokens.tolist() for r in geared.requests] == [r.tokens.tolist() for r in run.requests]
    assert {s.slots for s in geared.steps} <= {8, 16}


def test_a_full_pool_preempts_by_recompute_and_says_so(runs):
    run = runs["tight"]
    assert run.pool_blocks == 10 and run.pool_bytes == 10 * 4 * PER_TOKEN
    assert sum(r.preempted for r in run.requests) >= 1
    assert run.pool_peak_blocks <= 10 and all(s.pool_used_blocks <= 10 for s in run.steps)
    # a preempted request is prefilled again (over its prompt and the tokens it had)
    for i, r in enumerate(run.requests):
        prefills = [s for s in run.steps if s.kind == "prefill" and i in s.requests]
        assert len(prefills) == 1 + r.preempted
    assert runs["continuous"].summary()["preemptions"] == 0


def _token_times(run, i):
    """When request i's tokens were ready: the ends of the prefills and decode steps that served it."""
    return [s.end_us for s in run.steps if s.kind in ("prefill", "decode") and i in s.requests]


@pytest.mark.parametrize("name", ["continuous", "static", "tight", "warm continuous", "warm static"])
def test_times_are_read_off_the_one_clock(runs, name):
    run = runs[name]
    for a, b in zip(run.steps, run.steps[1:]):
        assert b.start_us >= a.end_us  # one device: runs one after another
    for s in run.steps:
        assert s.end_us == pytest.approx(s.start_us + s.device_us)
        assert s.start_us >= s.ge_start_us + s.host_ge_us - 1e-6  # GE planned it before the device ran it
    for i, (r, (_, new, arrival)) in enumerate(zip(run.requests, runs["trace"])):
        first_prefill = next(s for s in run.steps if s.kind == "prefill" and i in s.requests)
        assert first_prefill.start_us >= arrival and first_prefill.ge_start_us >= arrival
        times = _token_times(run, i)
        # a preemption drops the tokens of no step: recompute's prefill yields the next one
        assert len(times) == new
        assert r.ttft_us == pytest.approx(times[0] - arrival)
        assert r.latency_us == pytest.approx(times[-1] - arrival)
        assert r.tpot_us == pytest.approx((times[-1] - times[0]) / (new - 1) if new > 1 else 0.0)
    total = sum(new for _, new, _ in runs["trace"])
    makespan = run.steps[-1].end_us - min(a for _, _, a in runs["trace"])
    assert run.throughput_tok_per_s == pytest.approx(total / makespan * 1e6)
    busy = sum(s.device_us for s in run.steps)
    inside = sum(s.device_us - s.kernel_time_us - s.transfer_time_us for s in run.steps)
    assert run.device_idle_us == pytest.approx(makespan - busy + inside)
    assert run.host_ge_us == pytest.approx(sum(s.host_ge_us for s in run.steps))
    assert (run.host_ge_us > 0) == (run.warmup == "none")  # the default warm-up leaves GE nothing to plan here
    assert run.plan_cache_hits + run.plan_cache_misses == sum(s.kind != "regroup" for s in run.steps)


@pytest.mark.parametrize("name", ["continuous", "static", "tight"])
def test_ge_plans_once_per_gear_not_per_prompt_length(runs, name):
    run = runs[name]
    # a prefill's rows are padded to a power of two of blocks, each step runs a power-of-two batch: one plan per
    # (batch, slots); without preemption a prefill's rows are its requests' prompts
    bs = run.block_size
    for s in run.steps if run.summary()["preemptions"] == 0 else ():
        if s.kind == "prefill":
            longest = max(len(runs["trace"][i][0]) for i in s.requests)
            assert s.slots == bs * (1 << (-(-longest // bs) - 1).bit_length())
    for kind in ("prefill", "decode"):
        steps = [s for s in run.steps if s.kind == kind]
        assert [s.plan_cache for s in steps].count("miss") == len({(s.batch, s.slots) for s in steps})
        assert all(s.slots % run.block_size == 0 for s in steps)
        assert all(s.batch >= len(s.requests) and s.batch & (s.batch - 1) == 0 for s in steps)
        assert all(s.batch < 2 * len(s.requests) for s in steps if kind == "prefill")
    if name != "static":  # continuous batching runs a lone sequence as a batch of one, unpadded
        assert any(s.batch == 1 for s in run.steps if s.kind == "decode")


@pytest.mark.parametrize("name", ["continuous", "static", "tight"])
def test_the_decode_step_is_planned_once_per_batch_gear_while_its_rows_grow_blocks(runs, name):
    """The decode step's block table is one width for the run (the longest request's blocks: prompt + new tokens - 1
    cached at most, vLLM's max blocks per sequence), so its program depends on the batch gear alone: GE plans it
    once per power-of-two batch gear that occurs, however many blocks its rows hold."""
    run, trace = runs[name], runs["trace"]
    bs = run.block_size
    width = max(-(-(len(ids) + new - 1) // bs) for ids, new, _ in trace)
    decodes = [s for s in run.steps if s.kind == "decode"]
    assert all(s.slots == width * bs for s in decodes)
    gears = {1 << (len(set(s.requests)) - 1).bit_length() for s in decodes if name != "static"}
    assert name == "static" or {s.batch for s in decodes} == gears
    assert [s.plan_cache for s in decodes].count("miss") == len({s.batch for s in decodes})
    # the rows did grow blocks meanwhile: some request ends on more blocks than its prompt took
    assert any(-(-len(ids) // bs) < -(-(len(ids) + new - 1) // bs) for ids, new, _ in trace)


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_the_warm_up_plans_every_gear_before_the_first_arrival(runs, policy):
    """vLLM's startup (no compile while serving): the decode step planned at every power-of-two batch up to the
    most sequences the pool holds (here the 4 requests: gears 1, 2, 4), and the prefill at every such batch by
    every power of two of blocks up to the longest sequence's (prompt + new - 1 = 16 tokens of 8-token blocks:
    1 and 2 blocks; the budget of 2048 cuts none): 3 + 3 x 2 = 9 plans, counted here from the trace. So no step of
    the trace waits for GE, whatever the policy (continuous batching then admits by other times: other batches)."""
    warm, cold, trace = runs["warm " + policy], runs[policy], runs["trace"]
    bs = warm.block_size
    batch_gears = [1 << i for i in range(((min(len(trace), warm.pool_blocks) - 1).bit_length() + 1))]
    longest = max(len(ids) + new - 1 for ids, new, _ in trace)
    block_gears = {1 << (-(-t // bs) - 1).bit_length() for t in range(2, longest + 1)}
    assert batch_gears == [1, 2, 4] and block_gears == {1, 2}
    assert warm.warmup == "gears" and warm.startup_plans == len(batch_gears) * (1 + len(block_gears)) == 9
    # single-op launches (the default): GE plans every gear and nothing runs, as vLLM's eager mode captures nothing
    assert warm.startup_ge_us > 0 and warm.startup_device_us == 0
    assert all(s.plan_cache == "hit" and s.host_ge_us == 0 for s in warm.steps)
    assert warm.plan_cache_misses == 0 and warm.host_ge_us == 0
    # every prefill gear a run took, with the warm-up or without (planned then in the trace, once each), is one the
    # warm-up plans
    planned = {(b, n * bs) for b in batch_gears for n in block_gears}
    for run in (warm, cold):
        assert {(s.batch, s.slots) for s in run.steps if s.kind == "prefill"} <= planned
    cold_gears = {(s.kind, s.batch, s.slots) for s in cold.steps}
    assert cold.plan_cache_misses == len(cold_gears)
    if policy == "static":  # its batches do not depend on the clock: the same steps, the same device times
        assert [(s.kind, s.batch, s.slots, s.device_us) for s in warm.steps] == \
            [(s.kind, s.batch, s.slots, s.device_us) for s in cold.steps]
    assert cold.warmup == "none" and cold.startup_plans == 0 and cold.startup_ge_us == 0
    assert "startup (gears warm-up" in warm.render() and "startup" not in cold.render()


def test_the_decode_warm_up_leaves_each_prefill_gear_to_its_first_occurrence(runs, llama):
    """warmup="decode": the decode gears only (3 here); each distinct prefill (batch, slots) of the trace is planned
    on the trace's clock once, when it first occurs."""
    trace = runs["trace"]
    run = serve(llama, trace, policy="continuous", block_size=8, warmup="decode", timing_only=True)
    prefills = [s for s in run.steps if s.kind == "prefill"]
    assert run.startup_plans == 3 and all(s.plan_cache == "hit" for s in run.steps if s.kind == "decode")
    assert run.plan_cache_misses == len({(s.batch, s.slots) for s in prefills}) > 0
    firsts = {}
    for s in prefills:
        firsts.setdefault((s.batch, s.slots), s.index)
    assert [s.index for s in prefills if s.plan_cache == "miss"] == sorted(firsts.values())


def test_one_step_prefills_every_admitted_prompt_whatever_their_lengths(llama):
    from geir.runtime.interpreter import RuntimeListener

    runs = []

    class Runs(RuntimeListener):
        def run_finished(self, result):
            runs.append(result)

    # three prompts of 5, 21 and 9 tokens there at once: one prefill step (a batch of 4 rows, the longest's 3
    # blocks of 8 padded to 4, a power of two), each row's first token from its own last position
    trace = _trace(((5, 4, 0.0), (21, 3, 0.0), (9, 5, 0.0)), seed=3)
    run = serve(llama, trace, block_size=8, listeners=[Runs()])
    for record, (ids, new, _) in zip(run.requests, trace):
        assert torch.equal(record.tokens, _hf(llama, ids, new))
    prefills = [(s, r) for s, r in zip(run.steps, runs) if s.kind == "prefill"]
    assert [(s.requests, s.batch, s.slots) for s, _ in prefills] == [((0, 1, 2), 4, 32)]
    # its attention reads each row's blocks through the table (FIA's PromptFlashAttention branch: Sq > 1)
    kernels = {t.name for t in prefills[0][1].tasks}
    assert "ge.paged_attention" in kernels and "ge.flash_attention" not in kernels
    # a token budget of 32 (batch gear x slots) splits them as vLLM's max_num_batched_tokens does, first come
    # first served: 0 alone (8), since 0 and 1 would be 2 x 32; 1 alone (32, 2 x 32 with 2); then 2 (16)
    small = serve(llama, trace, block_size=8, max_batched_tokens=32)
    assert [r.tokens.tolist() for r in small.requests] == [r.tokens.tolist() for r in run.requests]
    assert [(s.requests, s.batch * s.slots) for s in small.steps if s.kind == "prefill"] == \
        [((0,), 8), ((1,), 32), ((2,), 16)]
    # the warm-up plans the prefill gears that budget allows (a row alone always): batch gears 1, 2, 4 by slots of
    # 1, 2 and 4 blocks (the longest sequence, 21 + 3 - 1 tokens, spans 3), and the 3 decode gears
    gears = [(b, n) for b in (1, 2, 4) for n in (8, 16, 32) if b == 1 or b * n <= 32]
    assert small.startup_plans == len(gears) + 3 == 9 and small.plan_cache_misses == 0


def test_continuous_batching_lets_a_late_request_join_the_running_batch(runs):
    run = runs["continuous"]
    # request 2 arrives at 300 us while 0 and 1 decode: some decode step serves all three
    assert any(s.kind == "decode" and {0, 1, 2} <= set(s.requests) for s in run.steps)
    # finished requests leave: no step serves a request after its last token
    for i, r in enumerate(run.requests):
        last = r.latency_us + r.arrival_us
        assert all(s.end_us <= last for s in run.steps if s.kind == "decode" and i in s.requests)


def test_static_batching_runs_a_batch_to_its_end_and_reserves_its_longest(runs):
    run, trace = runs["static"], runs["trace"]
    first = [s for s in run.steps if s.kind == "decode"]
    batch = set(first[0].requests)
    assert batch == {0, 1}  # the two there at 0 us; the others arrive while it runs
    batch_end = max(s.end_us for s in run.steps if s.kind == "decode" and set(s.requests) <= batch)
    later = [s for s in run.steps if s.kind == "prefill" and s.requests[0] not in batch]
    assert later and all(s.start_us >= batch_end for s in later)
    # each row reserves blocks for its prompt plus the batch's longest run, whatever it needs itself
    steps = max(trace[i][1] for i in batch)
    reserved = sum(-(-(len(trace[i][0]) + steps - 1) // 8) for i in batch)
    assert first[0].pool_used_blocks == reserved
    # rows that finished stay in the batch (their slot runs on), so static wastes more of what it allocates
    assert run.pool_waste > runs["continuous"].pool_waste


def test_the_pool_is_sized_from_its_bytes_or_from_the_requests(runs):
    run, trace = runs["continuous"], runs["trace"]
    assert run.block_size == 8
    assert run.pool_blocks == sum(-(-(len(ids) + new - 1) // 8) for ids, new, _ in trace)  # pool_bytes=None
    assert run.pool_bytes == run.pool_blocks * 8 * PER_TOKEN
    assert run.pool_sized_from == "requests" and runs["tight"].pool_sized_from == "pool_bytes"
    for s in run.steps:
        assert s.pool_allocated_slots == 8 * s.pool_used_blocks >= s.pool_token_slots
    assert 0 < run.pool_waste < 1 and 0 < run.pool_utilisation <= 1
    summary = run.summary()
    for key in ("throughput_tok_per_s", "pool_bytes", "pool_waste", "plan_cache_hits", "plan_cache_misses",
                "host_ge_us", "device_idle_us", "steps"):
        assert key in summary


def test_the_donated_pools_live_in_the_step_inputs_not_in_the_arena(llama):
    """Serve donates the pools to each step, which updates them in place: GE's plan leaves them in the step's input
    buffers, so a 16x larger pool grows the inputs by exactly its bytes and every program's arena not at all."""
    from geir.runtime.interpreter import RuntimeListener

    class Layouts(RuntimeListener):
        def __init__(self):
            self.memory = []

        def run_started(self, program):
            self.memory.append((program.name, dict(program.attributes["memory"])))

    runs = {}
    for mib in (1, 16):
        seen = Layouts()
        runs[mib] = (serve(llama, _trace(), block_size=8, pool_bytes=mib << 20, timing_only=True, listeners=[seen],
                           warmup="none"), seen.memory)
    (small, small_mem), (large, large_mem) = runs[1], runs[16]
    assert large.pool_bytes > 15 * small.pool_bytes  # the pool itself did grow
    assert [name for name, _ in small_mem] == [name for name, _ in large_mem] and small_mem
    for (_, a), (_, b) in zip(small_mem, large_mem):
        assert a["arena"] == b["arena"] and a["constants"] == b["constants"]
        # the pools are 512-byte multiples (a block of 8 tokens x 2 heads x 16 f32 = 1 KiB per layer, K or V)
        assert b["inputs"] - a["inputs"] == large.pool_bytes - small.pool_bytes
        assert a["arena"] < small.pool_bytes  # not a second copy of the pools


def test_graph_mode_captures_every_gear_by_a_dummy_run_before_the_first_arrival(runs, llama):
    """In graph mode the warm-up captures each plan by a dummy run (vLLM's capture_model), device time kept apart
    from the trace; single-op mode plans the same gears and runs nothing. Either way no step waits for GE."""
    graph = serve(llama, runs["trace"], policy="static", block_size=8, launch="graph", timing_only=True)
    eager = runs["warm static"]
    assert graph.startup_plans == eager.startup_plans == 9
    assert graph.startup_device_us > 0 and eager.startup_device_us == 0
    assert graph.plan_cache_misses == eager.plan_cache_misses == 0


def test_the_pool_takes_the_device_memory_left_after_weights_inputs_and_activations(llama):
    """memory_utilization sizes the pool as vLLM sizes its KV cache. Oracles: every step program's device memory
    (its inputs, the pools among them, its constants and its arena, as GE's lowering lays them out) fits the
    budget; one block more would not; the weights are at least the model's parameters' bytes."""
    from geir.runtime.interpreter import RuntimeListener

    class Layouts(RuntimeListener):
        def __init__(self):
            self.memory = []

        def run_started(self, program):
            self.memory.append(dict(program.attributes["memory"]))

    seen = Layouts()
    device, share = 64 << 20, 0.5  # a what-if device of 64 MiB: a pool of a few MiB on the host, not of 57 GB
    run = serve(llama, _trace(), block_size=8, memory_utilization=share, target="ascend910b[hbm_gib=0.0625]",
                timing_only=True, listeners=[seen])
    z = run.pool_sizing
    assert run.pool_sized_from == "memory" and z.device_bytes == device and z.budget_bytes == device * share
    assert seen.memory  # the warm-up's dummy runs are not listened to; the trace's steps are
    used = [m["inputs"] + m["constants"] + m["arena"] for m in seen.memory]
    assert max(used) <= z.budget_bytes
    assert max(m["arena"] for m in seen.memory) <= z.activation_bytes  # the profile's gear is the largest
    one_block = 8 * PER_TOKEN
    assert max(used) - max(m["arena"] for m in seen.memory) + z.activation_bytes + one_block > z.budget_bytes
    params = sum(p.numel() * p.element_size() for p in llama.parameters())
    assert params <= z.weights_bytes < 1.1 * params  # the weights, and little else (rope tables)
    assert run.pool_blocks > 1000 and run.pool_bytes == run.pool_blocks * one_block
    assert "sized from 50 % of the device's 67108864 B" in run.render()


def _target_without_memory(folder):
    """The 910B's target file without its [memory] hbm_gib."""
    from geir.target_npu.target import TARGET_DIR

    source = (TARGET_DIR / "ascend910b.toml").read_text()
    path = folder / "no_memory.toml"
    path.write_text("\n".join(line for line in source.splitlines() if not line.startswith("hbm_gib")) + "\n")
    return path


@pytest.mark.parametrize("kwargs, message", [
    ({"memory_utilization": 0.5, "pool_bytes": 1 << 20}, "not both"),
    ({"memory_utilization": 0.0}, "share of the device's memory"),
    ({"memory_utilization": 1.5}, "share of the device's memory"),
    ({"memory_utilization": 0.9, "target": "NO_MEMORY"}, "names no device memory"),
    ({"memory_utilization": 0.9, "target": "ascend910b[hbm_gib=0.0005]"}, "no room for a KV pool"),
])
def test_a_pool_sized_from_memory_that_cannot_be_is_refused(llama, kwargs, message, tmp_path):
    if kwargs.get("target") == "NO_MEMORY":  # a target file that names no device memory
        kwargs = {**kwargs, "target": str(_target_without_memory(tmp_path))}
    with pytest.raises(ValueError, match=message):
        serve(llama, _trace(), block_size=8, timing_only=True, warmup="none", **kwargs)


def test_the_trace_has_a_track_per_request_and_the_pool_as_a_counter(runs):
    run = runs["tight"]
    events = run.trace()["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert [names[(2, i)] for i in range(4)] == [f"request {i}" for i in range(4)]
    device = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    assert [e["name"].split()[0] for e in device] == [s.kind for s in run.steps]
    counters = [e for e in events if e["ph"] == "C"]
    assert [c["args"]["used"] for c in counters] == [s.pool_used_blocks for s in run.steps]
    assert all(c["args"]["used"] + c["args"]["free"] == run.pool_blocks for c in counters)
    for i, r in enumerate(run.requests):
        mine = [e for e in events if e["ph"] == "X" and e["pid"] == 2 and e["tid"] == i]
        assert [e["name"] for e in mine].count("prefill") == 1 + r.preempted
        served = next(e for e in mine if e["name"] == f"request {i}")
        assert served["args"]["preempted"] == r.preempted


def test_timing_only_runs_the_same_schedule_with_the_same_device_times(runs, llama):
    full = runs["tight"]
    fast = serve(llama, runs["trace"], policy="continuous", block_size=4, pool_bytes=10 * 4 * PER_TOKEN + 100,
                 timing_only=True, warmup="none")  # as the full run's: the same GE on the clock
    assert [(s.kind, s.requests, s.batch, s.slots) for s in fast.steps] == \
        [(s.kind, s.requests, s.batch, s.slots) for s in full.steps]
    assert [s.device_us for s in fast.steps] == [s.device_us for s in full.steps]
    assert [s.transfer_time_us for s in fast.steps] == [s.transfer_time_us for s in full.steps]
    for record, (ids, new, _) in zip(fast.requests, runs["trace"]):  # the new tokens are not known
        assert record.tokens.tolist() == ids.tolist() + [-1] * new


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_timing_only_steps_replayed_whole_time_what_walking_their_launches_times(runs, llama, policy, monkeypatch):
    # the oracle: the same serve with every step's launches walked (LaunchMemo(whole_runs=False)); the decode
    # steps repeat (same gear, same key tiles per row), so the run memo replays most of them whole
    import geir.frontends.generate as generate
    from geir.runtime.launch_memo import LaunchMemo

    memos = []

    def memo(whole):
        def make():
            memos.append(LaunchMemo(whole_runs=whole))
            return memos[-1]
        return make

    import types

    import geir.session.plan_cache as plan_cache

    got = {}
    # None: no memo at all (every launch timed), the oracle of the launch memo itself (cold distances keyed alike)
    for whole in (True, False, None):
        monkeypatch.setattr(generate, "LaunchMemo", memo(whole) if whole is not None else lambda: False)
        # GE's host time is measured, and it moves the schedule (what has arrived when a step starts): a clock
        # that ticks 1 ms a reading makes both runs' GE times the same, so every figure can be compared
        ticks = iter(range(10 ** 9))
        monkeypatch.setattr(plan_cache, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3))
        got[whole] = serve(llama, runs["trace"], policy=policy, block_size=8, timing_only=True)
    replayed, walked = memos
    # each gear's first step is walked (single-op mode's warm-up runs nothing), its repeats replayed
    decode_gears = {s.batch for s in got[True].steps if s.kind == "decode"}
    decodes = sum(s.kind == "decode" for s in got[True].steps)
    assert replayed.runs.hits >= min(1, decodes - len(decode_gears)) and walked.runs.hits == 0
    assert got[True].as_dict() == got[False].as_dict()  # every step's and request's times, the run's figures
    assert got[False].as_dict() == got[None].as_dict()


def test_a_request_that_can_never_fit_is_refused_before_anything_runs(llama, monkeypatch):
    import geir.frontends.serve as serving

    def never(*args, **kwargs):
        raise AssertionError("the scheduler ran")

    monkeypatch.setattr(serving, "_Server", never)
    trace = _trace(((5, 4, 0.0), (30, 10, 0.0)))
    with pytest.raises(ValueError, match=r"request 1 can never fit the KV pool: its prompt of 30 tokens and 10 new "
                                         r"tokens need 5 blocks of 8 tokens .* the pool has 4"):
        serve(llama, trace, block_size=8, pool_bytes=4 * 8 * PER_TOKEN)


def test_bad_arguments_are_refused_with_the_reason(llama):
    trace = _trace(((5, 4, 0.0),))
    with pytest.raises(ValueError, match="policy must be one of continuous, static"):
        serve(llama, trace, policy="fifo")
    with pytest.raises(ValueError, match=r"12 tokens exceed the largest bucket \(8\)"):
        serve(llama, _trace(((5, 4, 0.0), (9, 4, 0.0))), buckets=[8])
    with pytest.raises(ValueError, match="launch must be one of single-op, graph, not 'eager'"):
        serve(llama, trace, launch="eager")
    with pytest.raises(ValueError, match="request 0: the prompt has 1 token"):
        serve(llama, [([7], 3, 0.0)])
    with pytest.raises(ValueError, match=r"request 0: token id 100 is outside the model's vocabulary \(0 to 99\)"):
        serve(llama, [([7, 100], 3, 0.0)])
    with pytest.raises(ValueError, match="request 0: max_new_tokens must be at least 1"):
        serve(llama, [([7, 8], 0, 0.0)])
    with pytest.raises(ValueError, match=r"request 0: expected \(input_ids, max_new_tokens, arrival_us\)"):
        serve(llama, [[1, 2]])


def test_the_bench_compares_both_policies_on_its_stated_trace(capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parent.parent / "bench" / "serve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    trace = bench.sharegpt_trace(200, 20.0, 100, 0, bench.TINY_SCALE)  # the tiny shape's: half scale
    assert all(4 <= len(p) <= 1024 and 1 <= n <= 512 for p, n, _ in trace)
    arrivals = [a for _, _, a in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0
    # Poisson arrivals at 20 per ms: the mean gap is 50 us, within sampling error over 199 gaps
    assert 35 < arrivals[-1] / 199 < 65
    assert bench.main(["--requests", "5", "--timing-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("5 requests, prompts ") and [line.split()[0] for line in out[2:4]] == ["continuous",
                                                                                                      "static"]
    assert out[4].startswith("continuous batching: ") and out[5].startswith("startup (gears warm-up")
    assert out[6] == "goals (tiny shape):" and "in device time" in out[7] and "pool waste < 4 %" in out[8]


def test_the_schedulers_waste_is_each_sequences_last_block_tail_over_its_life():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parent.parent / "bench" / "serve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lengths = ((20, 6), (9, 3), (33, 4))
    trace = [(list(range(1, p + 1)), n, 0.0) for p, n in lengths]
    # all admitted in one prefill, each held in every step of its life: after its prefill p tokens, then p + k after
    # its k-th decode step; allocated: whole blocks of those
    for bs in (8, 16):
        held = [t for p, n in lengths for t in range(p, p + n)]
        allocated = sum(-(-t // bs) * bs for t in held)
        assert bench.scheduler_waste(trace, (bs,))[bs] == pytest.approx((allocated - sum(held)) / allocated)


POOL_STEP = """
ge.graph @step(%new: tensor<2x2x16xf32>, %at: tensor<2xi64>, %table: tensor<1x2xi64>, %pool: tensor<32x2x16xf32>) -> (tensor<1x2x8x2x16xf32>, tensor<32x2x16xf32>) {
  %w = ge.index_put %pool, %new, %at {axis = 0}
  %blocks = ge.reshape %w {shape = [4, 8, 2, 16]}
  %rows = ge.gather %blocks, %table {axis = 0}
  ge.return %rows, %w
}
"""


def test_a_step_program_takes_a_pool_of_any_size_or_stays_as_it_was(monkeypatch):
    """_unpin_pools: the pool's slot axis unknown, its reshape into blocks -1, the rest inferred again (the gather's
    rows keep their static size); where the types would not check, the program is left exactly as it was."""
    from geir.diagnostics import Diagnostic, DiagnosticError
    from geir.frontends.serve import _unpin_pools
    from geir.parser import parse
    from geir.printer import print_module

    module = parse(POOL_STEP)
    g = module.graphs[0]
    assert _unpin_pools(g, 3)
    assert g.args[3].type.shape == (None, 2, 16) and g.ops[1].attributes["shape"] == [-1, 8, 2, 16]
    assert g.ops[2].results[0].type.shape == (1, 2, 8, 2, 16) and g.result_types[1].shape == (None, 2, 16)

    module = parse(POOL_STEP)
    before = print_module(module)

    def refuse(graph):
        raise DiagnosticError(Diagnostic("error", "a use that fixes the pool's size", graph.loc))

    import geir.verifier
    monkeypatch.setattr(geir.verifier, "infer_types_again", refuse)
    assert not _unpin_pools(module.graphs[0], 3)
    assert print_module(module) == before
