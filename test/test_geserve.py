"""geserve: a JSONL trace and a transformers config in, each request's tokens and times out; bad input said at
its line and column with a caret, exit 1; usage errors exit 2; never a traceback.

Oracles: Hugging Face's greedy generate on the same random-init model (same config, same seed) for the tokens;
the trace's own lines and columns for the diagnostics.
"""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from importlib import metadata  # noqa: E402

from geir.tools import geserve  # noqa: E402

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
TRACE = [{"prompt_ids": [5, 6, 7, 8], "max_new_tokens": 4, "arrival_us": 0},
         {"prompt_ids": [9, 10, 11, 12, 13, 14], "max_new_tokens": 3, "arrival_us": 100.5},
         {"prompt_ids": [1, 2], "max_new_tokens": 2}]


@pytest.fixture
def files(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG, indent=1))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in TRACE[:2]) + "\n\n" + json.dumps(TRACE[2]) + "\n")
    return tmp_path, trace, config


def _main(capsys, *argv):
    rc = geserve.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


@pytest.mark.parametrize("block_size", [4, 1])  # 1: a row's slots are its table's width (one export dim)
def test_the_json_run_has_hugging_faces_tokens_for_every_request(files, capsys, block_size):
    tmp, trace, config = files
    rc, out, err = _main(capsys, trace, "--model", config, "--block-size", block_size, "--json", "--seed", 3)
    assert rc == 0, err
    run = json.loads(out)
    torch.manual_seed(3)
    cfg = transformers.AutoConfig.for_model(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert len(run["per_request"]) == 3
    for got, req in zip(run["per_request"], TRACE):
        ids = torch.tensor([req["prompt_ids"]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req["max_new_tokens"],
                                  do_sample=False, pad_token_id=0)[0]
        assert got["tokens"] == want.tolist()
        assert got["arrival_us"] == req.get("arrival_us", 0)
    for key in ("throughput_tok_per_s", "pool_bytes", "pool_waste", "plan_cache_hits", "plan_cache_misses",
                "host_ge_us", "device_idle_us", "steps"):
        assert key in run
    assert run["block_size"] == block_size and run["policy"] == "continuous"


def test_the_table_has_a_row_per_request_and_the_runs_figures(files, capsys):
    tmp, trace, config = files
    rc, out, err = _main(capsys, trace, "--model", config, "--policy", "static", "--block-size", 8)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["req", "prompt", "new"]
    assert [line.split()[:3] for line in lines[1:4]] == [["0", "4", "4"], ["1", "6", "3"], ["2", "2", "2"]]
    assert lines[4].startswith("static batching: 3 requests, 9 new tokens") and lines[5].startswith("KV pool: ")


# each bad line, the text the caret points at (its first character), and the message
@pytest.mark.parametrize("line, at, message", [
    ('{"prompt_ids": [5, 6,, 7], "max_new_tokens": 4}', ", 7]", "invalid JSON: Expecting value"),
    ('{"prompt_ids": [5, 600], "max_new_tokens": 4}', '"prompt_ids"',
     "token id 600 is outside the model's vocabulary (0 to 99)"),
    ('{"prompt_ids": [5], "max_new_tokens": 4}', '"prompt_ids"', "prompt_ids has 1 token(s): a prompt needs at least 2"),
    ('{"prompt_ids": [5, 6], "max_new_tokens": 0}', '"max_new_tokens"',
     "max_new_tokens must be an integer of at least 1, not 0"),
    ('{"prompt_ids": [5, 6], "max_new_tokens": 2, "arrival_us": -1}', '"arrival_us"',
     "arrival_us must be a finite number"),
    ('{"prompt_ids": [5, 6], "max_new": 2}', '"max_new"', "unknown field 'max_new'"),
    ('[1, 2]', "[", "expected a JSON object, not list"),
])
def test_a_bad_trace_line_is_said_at_its_line_and_column(files, capsys, line, at, message):
    col = line.index(at) + 1
    tmp, _, config = files
    trace = tmp / "bad.jsonl"
    trace.write_text(json.dumps(TRACE[0]) + "\n" + line + "\n")
    rc, out, err = _main(capsys, trace, "--model", config)
    assert rc == 1 and out == ""
    head, source, caret = err.splitlines()[:3]
    assert head.startswith(f"{trace}:2:{col}: error: {message}")
    assert source == line and caret == " " * (col - 1) + "^"


def test_timing_only_gives_unknown_tokens_and_the_same_schedule(files, capsys):
    tmp, trace, config = files
    rc, out, err = _main(capsys, trace, "--model", config, "--block-size", 4, "--json", "--timing-only")
    assert rc == 0, err
    fast = json.loads(out)
    rc, out, _ = _main(capsys, trace, "--model", config, "--block-size", 4, "--json")
    full = json.loads(out)
    assert [r["tokens"] for r in fast["per_request"]] == [t["prompt_ids"] + [-1] * t["max_new_tokens"] for t in TRACE]
    assert [s["device_us"] for s in fast["per_step"]] == [s["device_us"] for s in full["per_step"]]


def test_the_chrome_trace_is_written_and_never_over_an_input(files, capsys):
    tmp, trace, config = files
    out_path = tmp / "run.json"
    rc, _, err = _main(capsys, trace, "--model", config, "--block-size", 4, "--timing-only", "--trace", out_path)
    assert rc == 0, err
    events = json.loads(out_path.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == 2} == \
        {f"request {i}" for i in range(len(TRACE))}
    rc, _, err = _main(capsys, trace, "--model", config, "--trace", trace)
    assert rc == 2 and "an output must not overwrite an input" in err


def test_a_request_that_can_never_fit_is_refused_at_its_line(files, capsys):
    tmp, _, config = files
    trace = tmp / "big.jsonl"
    trace.write_text(json.dumps(TRACE[0]) + "\n" + json.dumps({"prompt_ids": list(range(1, 10)),
                                                                "max_new_tokens": 40}) + "\n")
    per_token = 2 * 2 * 2 * 16 * 4
    rc, out, err = _main(capsys, trace, "--model", config, "--block-size", 4, "--pool-bytes", 9 * 4 * per_token)
    assert rc == 1
    assert err.startswith(f"{trace}:2:1: error: request 1 can never fit the KV pool: its prompt of 9 tokens and 40 "
                          f"new tokens need 12 blocks of 4 tokens")


def test_the_pool_sized_from_the_devices_memory(files, capsys):
    """--memory-utilization: the pool is what that share of the (what-if, 64 MiB) device leaves; the JSON says how,
    and its parts add up to the budget (oracle: the budget = share x the target's memory); a target that names no
    memory is an error, the flag beside --pool-bytes a usage error."""
    tmp, trace, config = files
    rc, out, err = _main(capsys, trace, "--model", config, "--block-size", 4, "--timing-only", "--json",
                         "--memory-utilization", "0.5", "--target", "ascend910b[hbm_gib=0.0625]")
    assert rc == 0, err
    run = json.loads(out)
    z = run["pool_sizing"]
    assert run["pool_sized_from"] == "memory" and z["budget_bytes"] == (64 << 20) // 2
    assert z["free_bytes"] == z["budget_bytes"] - z["weights_bytes"] - z["activation_bytes"] - z["input_bytes"]
    assert 0 < z["free_bytes"] - run["pool_bytes"] < z["free_bytes"] // 100  # the pool takes nearly all of it
    from test_serve import _target_without_memory

    rc, _, err = _main(capsys, trace, "--model", config, "--memory-utilization", "0.9", "--target",
                       _target_without_memory(tmp))
    assert rc == 1 and "names no device memory" in err and "Traceback" not in err
    for argv in (["--memory-utilization", "0.5", "--pool-bytes", "4096"], ["--memory-utilization", "0"],
                 ["--memory-utilization", "x"]):
        with pytest.raises(SystemExit) as e:
            geserve.main([str(trace), "--model", str(config), *argv])
        assert e.value.code == 2


def test_a_block_larger_than_one_cube_tile_is_refused_before_any_step(files, capsys):
    # ATB PagedAttention: block_size x head dim <= 128 x 128; this model's head dim is 64 / 4 = 16, so 1024 tokens
    tmp, trace, config = files
    rc, out, err = _main(capsys, trace, "--model", config, "--block-size", 2048, "--timing-only")
    assert rc == 1 and out == ""
    assert err == ("geserve: error: block_size 2048: a block of 2048 keys of head dim 16 (32768 elements) exceeds one "
                   "128 x 128 cube tile (ATB PagedAttention: block_size x head dim <= 128 x 128); this model takes "
                   "blocks of at most 1024 tokens\n")
    rc, _, err = _main(capsys, trace, "--model", config, "--block-size", 1024, "--timing-only")
    assert rc == 0, err


def test_a_pool_the_host_cannot_hold_with_numbers_is_refused(files, capsys, monkeypatch):
    # the simulated device's bytes are the host's: with numbers, a pool larger than the host's available memory
    # is refused up front (timing only it holds no bytes and serves)
    import geir.frontends.serve as serve_module

    tmp, trace, config = files
    monkeypatch.setattr(serve_module, "host_bytes_available", lambda: 1 << 20)
    rc, out, err = _main(capsys, trace, "--model", config, "--block-size", 4, "--pool-bytes", 4 << 20)
    assert rc == 1 and out == ""
    assert err.startswith("geserve: error: a KV pool of ") and "does not fit the 1048576 B this host has" in err
    assert "serve it timing only" in err
    rc, _, err = _main(capsys, trace, "--model", config, "--block-size", 4, "--pool-bytes", 4 << 20, "--timing-only")
    assert rc == 0, err


def test_a_bad_config_is_said_where_it_is(files, capsys):
    tmp, trace, _ = files
    bad = tmp / "bad.json"
    bad.write_text('{"model_type": "llama",\n "hidden_size": 64 "x": 1}\n')
    rc, _, err = _main(capsys, trace, "--model", bad)
    assert rc == 1 and err.startswith(f"{bad}:2:20: error: invalid JSON: Expecting ',' delimiter")
    bad.write_text('{"model_type": "lama"}\n')
    rc, _, err = _main(capsys, trace, "--model", bad)
    assert rc == 1 and err.startswith(f"{bad}:1:2: error: transformers has no model_type 'lama'; did you mean "
                                      f"'llama'?")


@pytest.mark.parametrize("edit, where, message", [
    # Python reads no integer of more than 4300 digits (sys.get_int_max_str_digits): not JSON it can take
    ({"num_attention_heads": "9" * 5000}, (1, 1), "invalid JSON: Exceeds the limit (4300 digits)"),
    # the model's constructor divides by the K/V heads
    ({"num_key_value_heads": 0}, None, "no causal LM for a 'llama' config: integer division or modulo by zero"),
    # 64 / 64 = head dim 1: RoPE's cos and sin are 2 wide, so the keys the step writes are not the pool's width
    ({"num_attention_heads": 64, "num_key_value_heads": 64}, "geserve", "torch.export cannot trace the model's step"),
])
def test_a_config_whose_model_cannot_be_made_or_run_is_an_error(files, capsys, edit, where, message):
    tmp, trace, _ = files
    bad = tmp / "bad.json"
    text = json.dumps({**CONFIG, **edit}, indent=1)
    bad.write_text(text.replace(f'"{"9" * 5000}"', "9" * 5000))  # the digits as a JSON number
    rc, out, err = _main(capsys, trace, "--model", bad, "--timing-only")
    assert rc == 1 and out == "" and message in err
    if where == "geserve":
        assert err.startswith(f"geserve: error: {bad}: GEIR cannot import the model's step programs")
    else:
        line, col = where or (2, 2)  # the model_type's line and column
        assert err.startswith(f"{bad}:{line}:{col}: error: ")


def test_a_model_with_no_kv_cache_is_refused(files, capsys):
    tmp, trace, _ = files
    flat = tmp / "flat.json"
    flat.write_text(json.dumps({**CONFIG, "num_hidden_layers": 0}))
    rc, out, err = _main(capsys, trace, "--model", flat, "--pool-bytes", 4096)
    assert rc == 1 and out == "" and err == ("geserve: error: the model keeps no keys or values (no layers, or no "
                                             "K/V heads): it has no KV cache to serve\n")


def test_a_model_ge_cannot_compile_is_an_error_naming_why(files, capsys):
    # head dim 2048: no FlashAttention tiling of its f32 blocks fits the 910B's 512 KiB L1 (GE's own diagnostic)
    tmp, trace, _ = files
    wide = tmp / "wide.json"
    wide.write_text(json.dumps({**CONFIG, "head_dim": 2048}))
    rc, out, err = _main(capsys, trace, "--model", wide, "--timing-only", "--block-size", 4)
    assert rc == 1 and out == ""
    assert err.startswith(f"geserve: error: {wide}: GE cannot compile the model's step programs: ")
    assert "no flash_attention tiling fits ascend910b" in err and "head dim 2048" in err


def test_a_model_larger_than_the_host_and_a_pool_larger_than_the_device_are_refused(files, capsys, monkeypatch):
    import geir.runtime.device as device

    tmp, trace, config = files
    rc, _, err = _main(capsys, trace, "--model", config, "--pool-bytes", 2 ** 40, "--timing-only")
    assert rc == 1 and err == (f"geserve: error: pool_bytes {2 ** 40}: a KV pool larger than the ascend910b device's "
                               f"{64 * 2 ** 30} B of memory\n")
    # the tiny LLaMA's weights: embedding and LM head 100 x 64, per layer q, o 64 x 64, k, v 32 x 64, three MLP
    # matrices 64 x 128 and two norms of 64, and the final norm; f32
    weights = 4 * (2 * 100 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64) + 64)
    monkeypatch.setattr(device, "host_bytes_available", lambda: weights - 1)
    rc, _, err = _main(capsys, trace, "--model", config, "--timing-only")
    assert rc == 1 and err.startswith(f"{config}:2:2: error: the 'llama' model this config makes has {weights} B "
                                      f"of weights, more than the {weights - 1} B this host has available")


def test_missing_files_and_bad_usage(files, capsys):
    tmp, trace, config = files
    rc, _, err = _main(capsys, tmp / "none.jsonl", "--model", config)
    assert rc == 1 and err.startswith("geserve: error: cannot read ") and "none.jsonl" in err
    for argv in ([trace], [trace, "--model", config, "--block-size", "0"], [trace, "--model", config, "--policy", "x"]):
        with pytest.raises(SystemExit) as e:
            geserve.main([str(a) for a in argv])
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        geserve.main([str(trace), "--model", str(config), "--launch", "eager"])
    assert e.value.code == 2


def test_help_states_the_trace_format_and_version(capsys):
    with pytest.raises(SystemExit) as e:
        geserve.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(k in out for k in ('"prompt_ids"', '"max_new_tokens"', '"arrival_us"'))
    with pytest.raises(SystemExit):
        geserve.main(["--version"])
    assert capsys.readouterr().out.startswith(f"geserve (GEIR) {metadata.version('geir')}")
