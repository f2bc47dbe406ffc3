"""Token-by-token generation on the simulated NPU (geir.frontends.torch.generate), against Hugging Face's own.

Oracles: `model.generate(do_sample=False)` for the tokens; for the records, counts that follow from the
shapes (cache slots from the bucket rule, KV bytes = 2 x layers x batch x kv heads x slots x head dim x
4, the copies a decode step needs when the cache stays on the device).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from geir.frontends.generate import bucket_length  # noqa: E402
from geir.frontends.torch import generate  # noqa: E402
from helpers.tiny_models import tiny_gpt2, tiny_llama  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def _llama() -> torch.nn.Module:
    return tiny_llama(LAYERS, KV_HEADS)


def _gpt2() -> torch.nn.Module:
    return tiny_gpt2(LAYERS)


def _gptj() -> torch.nn.Module:
    torch.manual_seed(0)  # interleaved rotary over half the head dim: repeat_interleave of sin and cos over the steps
    cfg = transformers.GPTJConfig(n_embd=64, n_inner=128, n_layer=LAYERS, n_head=4, rotary_dim=8, n_positions=64,
                                  vocab_size=100, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPTJForCausalLM(cfg).eval()


def _hf(model, ids, mask, new):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("make", [_llama, _gpt2, _gptj], ids=["llama", "gpt2", "gptj"])
def test_greedy_tokens_equal_hugging_faces_generate(make):
    model = make()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 100, (1, 5), generator=g)
    run = generate(model, ids, 6, buckets="pow2")
    assert torch.equal(run.tokens, _hf(model, ids, torch.ones_like(ids), 6))


def test_a_left_padded_batch_generates_what_hugging_face_does():
    model = _llama()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 100, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second prompt is two tokens shorter, padded on the left as generation wants
    run = generate(model, ids, 5, attention_mask=mask, buckets=[8, 16])
    assert torch.equal(run.tokens, _hf(model, ids, mask, 5))


@pytest.fixture(scope="module")
def run14():
    """14 tokens after a 5-token prompt, the cache in gears of 8, 16 and 32 slots."""
    ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(5))
    return generate(_llama(), ids, 14, buckets=[8, 16, 32])


def test_the_steps_record_phases_plans_cache_sizes_and_copies(run14):
    run = run14
    steps = run.steps
    assert [s.phase for s in steps] == ["prefill"] + ["decode"] * 13
    assert [s.length for s in steps] == list(range(5, 19))
    assert [s.cache_length for s in steps] == [bucket_length(n, [8, 16, 32]) for n in range(5, 19)]
    assert [s.cache_length for s in steps][:5] == [8, 8, 8, 8, 16]
    # a plan per cache length per program: the prefill, then decode at 8, 16 and 32 slots
    assert [s.plan_cache for s in steps].count("miss") == 1 + len({s.cache_length for s in steps[1:]})
    assert run.compiles == 2
    for s in steps:
        assert s.kv_bytes == 2 * LAYERS * 1 * KV_HEADS * s.cache_length * HEAD_DIM * 4
        assert s.padding == s.cache_length - s.length >= 0
    # the cache grows on the device only where a step needs more slots than it has
    assert [s.grow_us > 0 for s in steps[1:]] == [a.cache_length < b.cache_length for a, b in zip(steps, steps[1:])]
    # the cache never crosses the link: a decode step copies in its token, mask, slot and position, and out its logits
    assert all(s.transfers == 5 for s in steps[1:])
    # one timeline: GE's work for a step ends before the device starts it, and steps run one after another
    for a, b in zip(steps, steps[1:]):
        assert b.start_us >= a.end_to_end_us and b.start_us >= b.ge_end_us >= b.ge_start_us
    assert run.end_to_end_us == steps[-1].end_to_end_us
    assert run.summary()["plan_cache_hits"] == len(steps) - [s.plan_cache for s in steps].count("miss")
    # the spec's step dictionaries: the record read by key
    spec_keys = {"phase", "signature", "plan_cache", "host_ge_us", "kernel_time_us", "end_to_end_us", "arena_bytes",
                 "kv_bytes"}
    assert spec_keys <= set(dict(steps[1])) and steps[1]["plan_cache"] == steps[1].plan_cache
    assert isinstance(run.steps, list) and run.tokens.dtype == torch.long


def test_without_buckets_every_decode_step_is_a_new_signature():
    run = generate(_llama(), torch.randint(1, 100, (1, 4), generator=torch.Generator().manual_seed(6)), 4)
    assert [s.plan_cache for s in run.steps] == ["miss"] * 4
    assert [s.cache_length for s in run.steps] == [4, 5, 6, 7]
    assert run.summary()["padding_waste"] == 0


def test_a_one_token_prompt_or_no_new_token_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="prompts of at least 2"):
        generate(_llama(), torch.tensor([[5]]), 3)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        generate(_llama(), torch.tensor([[5, 6]]), 0)


def test_bucket_rules():
    assert [bucket_length(n, "pow2") for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert bucket_length(9, [8, 12, 32]) == 12 and bucket_length(7, None) == 7
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        bucket_length(40, [8, 32])
    with pytest.raises(ValueError, match="buckets must be"):
        bucket_length(4, "fibonacci")


def test_the_run_says_per_phase_where_the_time_went(run14):
    run = run14
    phases = run.phases()
    assert set(phases) == {"prefill", "decode"} and phases["decode"]["steps"] == 13
    assert phases["decode"]["kernel_time_us"] == pytest.approx(sum(s.kernel_time_us for s in run.steps[1:]))
    verdict = run.doctor()
    decode = verdict["decode"]
    assert decode["culprit"] == max(decode["split_us"], key=decode["split_us"].get)
    assert decode["split_us"]["kernel"] == pytest.approx(phases["decode"]["kernel_time_us"])
    assert decode["split_us"]["ge-host"] == pytest.approx(sum(s.host_ge_us for s in run.steps[1:]))
    text = run.diagnose()
    assert text.startswith("prefill (1 step(s)): culprit ") and "decode (13 step(s)): culprit " in text


def test_the_trace_puts_ge_and_the_device_on_one_axis_with_memory_counters(run14):
    run = run14
    events = run.trace()["traceEvents"]
    device = [e for e in events if e["ph"] == "X" and e["pid"] == 1 and not e["name"].startswith("grow")]
    assert [e["name"].split()[0] for e in device] == ["prefill"] + ["decode"] * 13
    grows = [e for e in events if e["ph"] == "X" and e["name"].startswith("grow")]
    assert [e["name"] for e in grows] == ["grow cache to 16", "grow cache to 32"]
    counters = [e for e in events if e["ph"] == "C"]
    assert [c["args"]["kv_cache"] for c in counters] == [s.kv_bytes for s in run.steps]
    assert all(c["args"]["arena"] >= c["args"]["arena_lower_bound"] > 0 for c in counters)
    ge = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    assert len(ge) == [s.plan_cache for s in run.steps].count("miss")


def test_falcon_multi_query_generates_what_hugging_face_does():
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, vocab_size=100,
                                    multi_query=True, new_decoder_architecture=False, bos_token_id=0, eos_token_id=0)
    model = transformers.FalconForCausalLM(cfg).eval()
    ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(3))
    run = generate(model, ids, 6, buckets="pow2")
    assert torch.equal(run.tokens, _hf(model, ids, torch.ones_like(ids), 6))


def test_the_kv_heads_are_read_as_each_config_spells_them():
    from geir.frontends.generate import kv_heads_of

    assert kv_heads_of(transformers.LlamaConfig(num_attention_heads=8, num_key_value_heads=2)) == 2
    assert kv_heads_of(transformers.FalconConfig(num_attention_heads=8, multi_query=True)) == 1
    assert kv_heads_of(transformers.FalconConfig(num_attention_heads=8, new_decoder_architecture=True,
                                                 num_kv_heads=4)) == 4
    assert kv_heads_of(transformers.GPT2Config(n_head=6)) == 6  # one K/V head per query head

    class Bare:
        pass

    with pytest.raises(ValueError, match="cannot tell how many key/value heads Bare has"):
        kv_heads_of(Bare())


def test_the_kv_cache_stays_on_the_device_between_steps():
    """No host round trip of the cache: each step's copies are its token, mask, slot and position in and its logits
    out (bytes from the shapes), the cache is never copied nor handed to a run from the host."""
    from geir.runtime.interpreter import RuntimeListener

    class Copies(RuntimeListener):
        def __init__(self):
            self.runs: list[dict] = []

        def run_started(self, program):
            self.runs.append({"h2d": [], "d2h": [], "from_host": []})

        def copied(self, task):
            self.runs[-1][task.kind].append(task.nbytes)

        def resident_from_host(self, name, nbytes):
            self.runs[-1]["from_host"].append(nbytes)

    batch, prompt, new, vocab = 1, 5, 10, 100
    ids = torch.randint(1, 100, (batch, prompt), generator=torch.Generator().manual_seed(5))
    copies = Copies()
    model = _llama()
    run = generate(model, ids, new, buckets=[8, 16], listeners=[copies])
    assert torch.equal(run.tokens, _hf(model, ids, torch.ones_like(ids), new))
    grows = sum(s.grow_us > 0 for s in run.steps)
    assert grows == 1 and len(copies.runs) == new + grows
    steps = [r for r in copies.runs if r["h2d"]]  # the cache's growth copies nothing over the link
    assert len(steps) == new and all(r == {"h2d": [], "d2h": [], "from_host": []} for r in copies.runs
                                     if not r["h2d"])
    i64, f32 = 8, 4
    for s, r in zip(run.steps, steps):
        fed = s.query_tokens
        # ids [B, fed], the mask over the cache's slots [B, slots], the slots written [fed], positions [B, fed]
        assert sorted(r["h2d"]) == sorted([batch * fed * i64, batch * s.cache_length * i64, fed * i64,
                                           batch * fed * i64])
        assert r["d2h"] == [batch * vocab * f32]  # the last logits: the cache is never copied out
        assert r["from_host"] == []  # nor handed back from the host as a resident input
