"""bench/calibration.py: the table of published board measurements is produced and every row cites its source.

The ratios are a benchmark (README, "GEIR against silicon"), not asserted here; what is asserted is that each
row is a real measurement beside a real simulation: a positive measured and simulated time, and a source that
names a repository with a path and a 40-hex commit, or a URL.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = re.compile(r"(\S+/\S+.*, \S+\.\w+, commit [0-9a-f]{40}$)|(https?://\S+)")


def _calibration():
    spec = importlib.util.spec_from_file_location("calibration", ROOT / "bench" / "calibration.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_row_is_a_cited_measurement_beside_a_simulated_time():
    cal = _calibration()
    table = cal.rows()
    names = [r.name for r in table]
    # the rows the calibration issue names: the four GEMMs, the FIA sweep (20 points), the HBM add, the empty kernel
    assert sum(n.startswith("GEMM") for n in names) == 4
    assert sum(n.startswith("FIA") for n in names) == 20
    assert any(n.startswith("Add") for n in names) and any("empty" in n for n in names)
    for r in table:
        assert r.measured_us > 0 and r.geir_us > 0, r.name
        assert SOURCE.search(r.source), f"{r.name}: {r.source!r} names no repository path and commit, nor a URL"
        assert r.measured_bound and r.geir_bound and r.chip and r.shape
    s = cal.summary(table)
    # the summary judges every row but those that are a constant's own source (they check nothing)
    assert s["all"]["rows"] == sum(r.independent for r in table) and 0 <= s["all"]["mean_abs_error"]
    assert [r.name for r in table if not r.independent] == ["empty full-core kernel"]
    assert s["all"]["worst"] in names


def test_the_table_prints_its_error_and_sources(capsys):
    cal = _calibration()
    assert cal.main(["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"rows", "summary"} <= set(doc) and doc["rows"][0]["ratio"] > 0
    assert cal.main([]) == 0
    text = capsys.readouterr().out
    assert "mean absolute error" in text and "worst" in text and "sources:" in text


def test_fia_rows_are_judged_by_what_the_board_timed():
    """The FIA sweep's flat floor is the host's work per call (a loop of eager calls): those rows are judged only as a
    bound, GEIR's device time against the board's per-call time; the rest by their error."""
    cal = _calibration()
    table = cal.rows()
    fia = [r for r in table if r.name.startswith("FIA")]
    floor = min(r.measured_us for r in fia)
    # from the measurements alone: the three points well above the floor are the device's
    assert sorted(r.name for r in fia if r.device_bound) == ["FIA 1024 x 8192", "FIA 2048 x 4096", "FIA 2048 x 8192"]
    assert all(r.measured_us < 1.1 * floor for r in fia if not r.device_bound)
    host = cal.summary(table)["host_floor"]
    assert host["rows"] == 17
    assert host["under_board"] == sum(r.geir_us <= r.measured_us for r in fia if not r.device_bound)


def test_fia_rows_model_promptflashattention_by_default_and_geirs_rules_behind_a_flag(capsys):
    """The board's FIA calls with S0 > 1 ran PromptFlashAttention: the default table times that kernel's split;
    --fa-tiling times GEIR's own FlashAttention rules, and each row's notes say which kernel it models."""
    cal = _calibration()
    fia = [r for r in cal.rows() if r.name.startswith("FIA")]
    # PFA never splits one row's keys over cores: no flash-decoding template, which GEIR's rules pick at S0 128
    assert not any("Bn2S2FD" in r.geir_bound for r in fia)
    assert all(r.notes.startswith("models PromptFlashAttention") for r in fia)
    ours = [r for r in cal.rows(fa_tiling=True) if r.name.startswith("FIA")]
    assert any("Bn2S2FD" in r.geir_bound for r in ours if r.name.startswith("FIA 128 x"))
    assert all(r.notes.startswith("models GEIR's own FlashAttention rules") for r in ours)
    assert cal.main([]) == 0
    assert "prompt_flash_attention_tiling.cpp" in capsys.readouterr().out
    assert cal.main(["--fa-tiling"]) == 0
    assert "--fa-tiling" in capsys.readouterr().out


def test_pfa_reading_is_promptflashattentions_split():
    """FIA's S0 > 1 path with torch_npu's default inner_precise (0, high precision) at fp16, D 128: 128 x 512 blocks
    (AdjustCVTilingCVDiff), one 128-row unit per AIC (the kernel's skip-core mapping), every core launched: each row's
    time holds the head of the whole chip (catlass's 20.5 us)."""
    cal = _calibration()
    target = cal.load_target("ascend910b")
    for s0, s1, _ in cal.FIA:
        tiling = cal._pfa_tiling(s0, s1, target)
        assert (tiling.s1, tiling.s2) == (128, 512)
        assert tiling.work_units == tiling.cores == s0 // 128
    for r in cal.rows():
        if r.name.startswith("FIA"):
            assert r.geir_us > 20.5, r.name


def test_the_decode_anchor_is_a_cited_graph_mode_step_of_a_7b_class_decoder():
    """The anchor bench/serve.py's TPOT goal answers to: a published 7-8B dense decoder's decode step on one card, with
    the conditions GEIR needs to serve the same work (batch, the cache lengths its steps ran over, the launch mode)."""
    cal = _calibration()
    a = cal.decode_anchor()
    assert SOURCE.search(a.source) and a.measured_ms > 0
    assert a.batch == 1 and a.launch == "graph" and "A2" in a.chip
    # the measured steps run over prompt + 1 .. prompt + new - 1 cached tokens, but the script's cache is one tensor of
    # max_position_embeddings = input_max_len + max_new_tokens positions that IFA reads whole under the padding mask
    # (no actual_seq_lengths in the 7B tables): every step attends all of them, a cited fact of its own
    assert a.prompt + 1 < a.mean_context < a.prompt + a.new_tokens - 1
    assert a.attended == a.cache_tokens == a.prompt + a.new_tokens == 2048
    assert all(SOURCE.search(src) for src in (cal.TORCHAIR_QWEN2_BENCH, cal.OPS_IFA, cal.OPS_IFA_SPLIT,
                                              cal.ATLAS_800I_A2_SOC))
    assert "benchmark_qwen.py" in cal.TORCHAIR_QWEN2_BENCH
    # the stand-in has Qwen2-7B's size: about 7.6e9 parameters (Qwen's model card), with no bytes behind them
    import torch

    model = cal._stand_in(cal.QWEN2_7B, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert 7.5e9 < params < 7.7e9
    assert all(p.stride() == (0,) * p.dim() for p in model.parameters())
    # behind a flag: the default table stays quick, and its rows are the single-operator ones
    assert not any("decode" in r.name for r in cal.rows())


def test_geirs_decode_step_for_the_anchor_is_a_served_step_no_faster_than_its_weights_read():
    """GEIR's side of the anchor's row, on 2 of Qwen2-7B's 28 layers (the full shape is the same path, ~30 s): a decode
    step served in graph mode reads every weight once (the input embedding's one row a token), so it takes at least
    those bytes over the chip's HBM rate."""
    cal = _calibration()
    a = cal.decode_anchor()
    step = cal.decode_step(a, "ascend910b", dict(cal.QWEN2_7B, num_hidden_layers=2))
    us, weights = step.us, step.weights_read
    hbm = cal.load_target("ascend910b").memory.hbm_bytes_per_s
    # 2 layers (2 x 233 M parameters) and the LM head (545 M), in bf16: the input embedding is gathered, not read
    assert 1.0e9 * 2 < weights < 1.02e9 * 2
    assert us >= weights / hbm * 1e6
    # the breakdown by kernel is the step's own launches: back to back within its span (graph mode), their heads
    # within them, and the matmuls read at least every linear weight from HBM once: Qwen2-7B's config, per layer
    # QKV (3584 -> 3584 + 2 x 512, with bias), O (3584 -> 3584), gate and up (3584 -> 18944) and down, and the LM
    # head (3584 -> 152064), 2 bytes an element
    h, i, kv, vocab = 3584, 18944, 512, 152064
    linear = 2 * (2 * (h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * i) + h * vocab)
    mm = step.share(*cal.MATMULS)
    assert linear <= mm.hbm_read_bytes < 1.01 * linear
    assert mm.launches == 2 * 4 + 1  # QKV, O, gate-up, down a layer, and the LM head
    assert 0 < step.heads_us < step.kernels_us <= us
    assert all(0 <= k.head_us <= k.us for k in step.shares)
    assert step.share("ge.paged_attention").launches == 2  # one attention a layer, over the block table


def test_the_llama_anchor_is_torchairs_batch1_graph_step_over_its_whole_4096_position_cache():
    """The second decode row: torchair's LLaMA-2-7B case (FlagAlpha's Atom-7B) at batch 1 in graph mode. Its model file
    sizes each layer's cache to max_position_embeddings and passes IFA no actual_seq_lengths by default, so every
    measured step attends all 4096 positions; the stand-in has the model card's shape (LLaMA-2-7B, 65,000 words)."""
    cal = _calibration()
    a = cal.llama2_anchor()
    assert SOURCE.search(a.source) and "reduce-overhead" in a.source and a.measured_ms > 0
    assert a.batch == 1 and a.launch == "graph" and "A2" in a.chip and a.dtype == "fp16"
    assert all(SOURCE.search(src) for src in (cal.TORCHAIR_LLAMA2_MODEL, cal.ATOM_7B, cal.OPS_MM_INCRE))
    cfg = cal.ANCHOR_CONFIGS[a.family]
    assert a.attended == a.cache_tokens == cfg["max_position_embeddings"] == 4096
    assert a.prompt + a.new_tokens < a.attended  # the cache is longer than the steps' context: read under the mask
    assert cal.decode_anchors()[0] == cal.decode_anchor()  # the TPOT goal's anchor stays first
    import torch

    model = cal._stand_in(cfg, torch.float16, a.family)
    # LLaMA's parameters by formula: per layer Q, K, V, O (h x h each, MHA), gate, up, down (h x i) and two norms;
    # the input embedding and the untied LM head (V x h each) and the final norm
    h, i, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    assert sum(p.numel() for p in model.parameters()) == L * (4 * h * h + 3 * h * i + 2 * h) + 2 * V * h + h
    assert all(p.stride() == (0,) * p.dim() and p.dtype == torch.float16 for p in model.parameters())


def test_geirs_llama_step_reads_its_weights_and_the_whole_cache_shape():
    """GEIR's side of the LLaMA row on 2 of its 32 layers: a graph-mode step no faster than its weights' read, whose
    matmuls read every linear weight once (per layer Q, K, V, O, gate, up, down; the LM head), one attention a layer
    over the 4096-key cache."""
    cal = _calibration()
    a = cal.llama2_anchor()
    cfg = dict(cal.LLAMA2_7B, num_hidden_layers=2)
    step = cal.decode_step(a, "ascend910b", cfg)
    h, i, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    linear = 2 * (2 * (4 * h * h + 3 * h * i) + h * V)
    assert step.weights_read == linear + 2 * (2 * 2 * h + h)  # and the norms': two a layer, the final one
    hbm = cal.load_target("ascend910b").memory.hbm_bytes_per_s
    assert step.us >= step.weights_read / hbm * 1e6
    mm = step.share(*cal.MATMULS)
    assert linear <= mm.hbm_read_bytes < 1.01 * linear
    # each layer's K and V (4096 positions x 32 heads x 128, fp16) were last touched by earlier steps, each of which
    # read 13 GB of weights through the 192 MiB L2 after them (and a run starts on a cold L2): the attention reads
    # them from HBM, all but at most the one slot of each that the step itself just wrote, and little else (its
    # query, the mask: under 1 %)
    att = step.share("ge.paged_attention")
    kv = 2 * 2 * a.attended * h * 2
    assert kv - 2 * 2 * h * 2 <= att.hbm_read_bytes < 1.01 * kv
    row = cal.decode_row("ascend910b", step, a)
    assert row.source == a.source and "4096-position cache" in row.shape and row.geir_us == step.us
