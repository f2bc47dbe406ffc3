"""GEIR's simulated times against published measurements of real Atlas A2 / A3 boards: one row per measurement.

    python bench/calibration.py [--markdown | --json] [--fa-tiling] [--decode]

Each row names its source (repository, path and commit, or URL), the shape, the chip it was measured on,
the measured time, GEIR's simulated time for the same work, their ratio and what bounds each side (the
source's own profile where it gives one; GEIR's busiest pipe). GEIR's time is one launch timed standalone on
the target closest to the measured chip (`ascend910b`: 24 AIC + 48 AIV at 1.85 GHz), its operands in HBM, as
a single-operator measurement runs it (runtime/single_launch.py; the FIA rows in a loop's steady state, below); it
includes the launch's head overhead on the device. The table ends with the mean absolute error
|GEIR / measured - 1| and the worst row, over every row and over the rows where the board's time is the device's
(not the host's: see the notes).

What the FIA rows time: pto-isa's fa_benchmark.py records an event, makes 50 eager torch_npu calls of
npu_fused_infer_attention_score, records a second event and divides the elapsed time by 50 (after 10 warm-up
calls on the same q, k and v). The calls are queued asynchronously, so a call costs the larger of the host's work
per call (torch_npu's eager dispatch, aclnn's GetWorkspaceSize with FIA's tiling, the launch) and the device's
time per call: in every row the board's time bounds the device's from above. Where it sits on the table's flat
floor the host's work is the larger, and no cited figure gives that host cost for the torch_npu / aclnn FIA path
on an aarch64 host (the only one is this table's own floor; its x86 run is ~24 us lower). GEIR models none (its
[host] launch_latency_us is a bare kernel launch), so those rows check only that GEIR's device time stays under
the board's. Each call finds in the L2 what the calls before it left: GEIR times an FIA row as a launch that
follows one of the same op on the same operands (runtime/single_launch.time_warm_launch), so K and V (at most
2 MiB each) come from the L2, not from HBM.
The board's FIA calls with S0 > 1 run PromptFlashAttention, so the FIA rows are timed as PFA splits them, on GEIR's
CV-split schedule: its 128 x 512 blocks, one 128-row unit per AIC and every core launched (README, "GEIR against
silicon"). `--fa-tiling` times them with GEIR's own FlashAttention rules instead (FlashAttentionScore's A2 design
document's blocks, flash-decoding where a head's query rows fit one block): a kernel the board did not run.

`--decode` adds two whole models' steps (about a minute, so not in the default table): torchair's Qwen2-7B decode in
graph mode at batch 1 on one Atlas 800I A2 card (`decode_anchor()`, the anchor bench/serve.py's TPOT goal answers to)
and the same repository's LLaMA-2-7B (Atom-7B) case, graph mode at batch 1 on the same card (`llama2_anchor()`), each
beside GEIR serving a stand-in of that shape timing-only in graph mode, its step attending the whole fixed cache as the
board's IncreFlashAttention does (the script's cache, read under a padding mask: 2048 and 4096 positions), and GEIR's
steps by kernel after the table.

Nothing here is fitted: the kernels' schedules and the targets' cited constants produce GEIR's column, and a
row that misses says why in its notes.
"""

from __future__ import annotations

import argparse
import json
import math

import attrs

from geir.kernels import KERNELS
from geir.kernels.flash_attention_tiling import choose_cv_tiling
from geir.kernels.tiling import OpSignature
from geir.runtime.single_launch import time_launch, time_warm_launch
from geir.target_npu.sim import PIPES
from geir.target_npu.target import load_target
from geir.types import DType, TensorType

F16 = DType("f16")

PTO_GEMM = ("pto-isa (mirror zouzias/pto-isa-mirror), kernels/manual/a2a3/gemm_performance/README.md, "
            "commit c138a4b2c1ef2bfc60745cf9c7a8b9309c166a38")
PTO_FIA = ("pto-isa (mirror zouzias/pto-isa-mirror), demos/torch_jit/flash_atten/README.md, "
           "commit 067f1e7d667f6e062f5f044ad01d9db65add562f")
# how the FIA rows were timed: the version of the benchmark whose CSV kernel names the README lists
PTO_FIA_BENCH = ("pto-isa (mirror zouzias/pto-isa-mirror), demos/torch_jit/flash_atten/fa_benchmark.py, "
                 "commit e57ba37af6c298a78d4a391cbc0c70e0339fb9d0")
# FIA with S0 > 1 in BSH runs PromptFlashAttention (fused_infer_attention_score_tiling.cpp routes only S = 1 and
# a few MTP / MLA shapes to IFA), with the inner_precise torch_npu passes: 0 by default (torch_npu's
# npu_fused_infer_attention_score signature, "int inner_precise=0"), which PFA's tiling reads as high precision. For
# fp16 in high precision with D in [128, 200) PFA's CV-diff tiling takes 128 query rows x 512 keys a block, 8-row
# softmax sub-blocks (prompt_flash_attention_tiling.cpp, AdjustCVTilingCVDiff; 512 keys too where S1 <= 1024:
# CVDIFF_SINNER_FACTOR_SMALL_KVS), cuts the (head, 128-row block) units over the 48 AIVs by their key blocks
# (PromptFlashAttentionSplitNSNew; with B = 1 the first AIV gets none) and launches every core (blockDim =
# CalcTschBlockDim(aivNum, aicNum, aivNum): 24 AIC with their 48 AIV). With at most 25 AIVs busy the kernel maps its
# AIV indices so that each busy one sits on an AIC of its own (prompt_flash_attention_s1s2_bns1_x910_base.h, Init:
# "For small B*N perform skip core optimization"): one unit per AIC, its second AIV idle
OPS_PFA = ("hicann/ops-transformer, attention/prompt_flash_attention/op_host/prompt_flash_attention_tiling.cpp, "
           "commit c29bc1069d3252c641e2aa059ec88f392d3f05ac")
OPS_PFA_KERNEL = ("hicann/ops-transformer, attention/prompt_flash_attention/op_kernel/"
                  "prompt_flash_attention_s1s2_bns1_x910_base.h, commit c29bc1069d3252c641e2aa059ec88f392d3f05ac")
TORCH_NPU_FIA = "https://hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000837.html"
PFA_S1_BLOCK, PFA_S2_BLOCK = 128, 512
# the kernel issues the next block's Q K^T before the softmax of this one (ComputeEachCoreSInnerLoop: "Pre fetch the
# next mm1 calculation"), and the next P V after it: one mm1 ahead
PFA_PRELOAD = 1
ASC_ADD = ("hicann/asc-devkit, examples/01_simd_cpp_api/05_best_practices/00_vector_compute/add_high_performance/"
           "README.md, commit 4c68db07c483e21d3d63ceb9ef38c2963da2162f")
CATLASS_HEAD = ("hicann/catlass, docs/zh/1_Practice/evaluation/bottleneck_analysis_and_optimization.md, "
                "commit 9c85a821a967086fa538cdb6e3016fefc1f47cba")
# torchair's Qwen2 case: Qwen2-7B in bf16 on one card of an Atlas 800I A2 (aarch64 host), prompt padded to 1024 tokens,
# 1024 new tokens, torch.compile with torchair's NPU backend (GE graph mode, frozen parameters), every step bracketed
# by torch.npu.synchronize(); "增量" (decode) is the mean of the steps after the first. Its table of batch sizes in
# graph mode: 23 ms a decode step at batch 1 (24 ms at batch 4), with its fusions (IFA / PFA, npu_apply_rotary_pos_emb,
# npu_add_rms_norm, one QKV matmul) and a KV cache of fixed size updated in place by scatter_update_
TORCHAIR_QWEN2 = ("Ascend/torchair, npu_tuned_model/llm/qwen/README.md, "
                  "commit 023f5b264496f872a16580d351df2be3f3ae4711")
# The same case's single-card script: the KV cache is one tensor per layer of max_position_embeddings = input_max_len +
# max_new_tokens = 1024 + 1024 positions. The README's 7B tables predate its "IFA算子计算优化" step (actual_seq_lengths
# and kv_padding_size, timed on Qwen2-72B only, 2024-08-20), which it adds because without them IFA computes over the
# padding too: so each measured step's IncreFlashAttention reads all 2048 positions under the padding mask, whatever
# the step's position
TORCHAIR_QWEN2_BENCH = ("Ascend/torchair, npu_tuned_model/llm/qwen/benchmark/npu/benchmark_qwen.py, "
                        "commit e45676cff400ab7ac860d8005a9a8fa2945d8ce8")
# IncreFlashAttention's rules on A2, GEIR's paged kernel's too (kernels/paged_attention_tiling.ifa_kv_parts:
# incre_flash_attention_tiling_check.cpp, IsFlashDecode / CheckCoreOkFlag: B x Nkv < 0.4 x cores and, with GQA, a cache
# of at least 2048 keys; incre_flash_attention_tiling.cpp, SplitBNS: cores / (B x Nkv) key parts, fewer while a part
# holds under 512 keys): at batch 1 over the 2048-key cache, 4 parts of each of the 4 K/V heads on 16 cores
OPS_IFA = ("hicann/ops-transformer, attention/incre_flash_attention/op_host/incre_flash_attention_tiling_check.cpp, "
           "commit c29bc1069d3252c641e2aa059ec88f392d3f05ac")
OPS_IFA_SPLIT = ("hicann/ops-transformer, attention/incre_flash_attention/op_host/incre_flash_attention_tiling.cpp, "
                 "commit c29bc1069d3252c641e2aa059ec88f392d3f05ac")
# the card's SoC: the README names only "800I A2", whose servers ship with more than one 910B SoC (e.g. a user's
# "Atlas 800I A2 (910B4 32G 4-card)"); GEIR's ascend910b is the 910B1 of Ascend910B1.ini
ATLAS_800I_A2_SOC = "https://github.com/vllm-project/vllm/issues/40869"
# Qwen2-7B's config.json (Qwen/Qwen2-7B on Hugging Face): the shape the row builds, with stand-in weights
QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
# torchair's LLaMA-2-7B case in its reduce-overhead README, after its change to batch 1 (2025-07): one card of an Atlas
# 800I A2 (aarch64 host), fp16, a prompt padded to 1024 tokens and 1024 new ones; "增量" is the mean of the steps after
# the first. Its table: 14.2 ms a decode step in graph mode (max-autotune: GE's graph, as the Qwen2 case), 21.6 ms in
# reduce-overhead (aclgraph capture), 28.1 ms single-op
TORCHAIR_LLAMA2 = ("Ascend/torchair, npu_tuned_model/llm/llama/reduce-overhead/README.md, "
                   "commit 4e6e491d85bb8c2a6c9c3f97c965c822b34645cd")
# The case's model file: one KV cache tensor per layer of config.max_position_embeddings positions (BSND), updated by
# scatter_update_; IncreFlashAttention gets actual_seq_lengths and kv_padding_size only where the ACTUAL_SEQ variable
# is "True" (default "False"; the README's table runs the default script, its actual_seq_lengths recipe a separate
# section): so each measured step's IFA reads all max_position_embeddings positions under the padding mask
TORCHAIR_LLAMA2_MODEL = ("Ascend/torchair, npu_tuned_model/llm/llama/reduce-overhead/modeling_llama.py, "
                         "commit 4e6e491d85bb8c2a6c9c3f97c965c822b34645cd")
# The case's "llama2-7B" is FlagAlpha's Atom-7B v1.0.0 (the README's download link): LLaMA-2-7B continued in
# pretraining on Chinese text, its vocabulary extended to 65,000 words, a 4K context (the model card)
ATOM_7B = "https://huggingface.co/FlagAlpha/Atom-7B"
# MatMulV3's tiling on Atlas A2 (DoBasicTiling -> DoIncreTiling): with M <= 128, fp16/bf16 A, B and C in ND, A not
# transposed, B transposed and no bias ("增量场景要求M<=128"), it takes the legacy TBE cache tiling (GetV2Tiling ->
# GenTiling, the closed LegacyGenTbeMatmulTiling) and converts it (Convert2AscendCTiling): cores = m_dim x n_dim (at most
# the AICs), singleCoreK = K, column-first order
OPS_MM_INCRE = ("hicann/ops-nn, matmul/mat_mul_v3/op_host/op_tiling/matmul_v3_base_tiling.cpp, "
                "commit e5c3fa9327ea95ba26d06227e746923580d10921")
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=65000, max_position_embeddings=4096, tie_word_embeddings=False)

# pto-isa's fp16 GEMMs on a 24-core A3: m = k = n, measured ms and the TMATMUL (cube) and TLOAD (MTE2) ratios
GEMMS = [(1536, 0.0388, 0.545, 0.722), (3072, 0.2067, 0.790, 0.909), (6144, 1.5060, 0.867, 0.952),
         (7680, 3.1680, 0.806, 0.984)]
# npu_fused_infer_attention_score (ops-transformer's FIA) on a 910B2, B 1, one head, D 128, fp16, BSH:
# (S0, S1, us) of the README's aarch64 table, "average execution time over 50 iterations"
FIA = [(128, 1024, 70.338), (128, 2048, 70.898), (128, 4096, 72.652), (128, 8192, 73.365),
       (256, 1024, 72.522), (256, 2048, 73.369), (256, 4096, 74.567), (256, 8192, 73.150),
       (512, 1024, 71.964), (512, 2048, 74.180), (512, 4096, 73.984), (512, 8192, 75.936),
       (1024, 1024, 74.404), (1024, 2048, 73.102), (1024, 4096, 75.043), (1024, 8192, 90.272),
       (2048, 1024, 76.777), (2048, 2048, 75.535), (2048, 4096, 91.798), (2048, 8192, 126.845)]
# the board's floor under every FIA call of that table (its smallest entry): the host's per-call cost of the
# torch_npu / aclnn path, which the same table measured from an x86 host is ~24 us lower (46.8 us at 128 x 1024)
FIA_FLOOR_US = min(us for _, _, us in FIA)
# the same README's sweep from an x86_64 host, at the aarch64 table's device-bound points: the same board model
# times these 11-14 % slower, a spread between two runs of one benchmark that no model can be judged finer than
FIA_X86 = {(1024, 8192): 103.27, (2048, 4096): 101.94, (2048, 8192): 142.38}
# The chip-wide L2 rates published for Atlas A2, which the device-bound FIA rows' notes weigh their launch's L2
# traffic against (GEIR models per-core rates only): asc-devkit's DataCopy guide estimates with an L2 peak of about
# 5.2 TB/s (GM 1.8) on A2/A3 ...
ASC_DATA_COPY = ("hicann/asc-devkit, examples/01_simd_cpp_api/05_best_practices/04_memory_access/data_copy/README.md, "
                 "commit ca3f6d33903bf4f357c99272d42672efbaac6819")
L2_PEAK_TB_S = 5.2
# ... and CANN's Ascend C guide ("L2 Cache切分") assumes an L2 of 192 MB at about 7 TB/s for reads and writes mixed
CANN_L2_TILING = ("https://www.hiascend.com/document/detail/zh/CANNCommunityEdition/850alpha002/opdevg/ascendcbestP/"
                  "atlas_ascendc_best_practices_10_0035.html")
L2_MIXED_TB_S = 7.0
# The same guide's "避免同地址访问" (Atlas A2/A3): requests of several cores into one 512-byte window at the same time
# are served one after another, the more cores the worse; it gives no rate. PFA's units all start at key block 0
# (prompt_flash_attention_s1s2_bns1_x910.h, ComputeEachCoreBalance / SInnerLoopFunc at c29bc10), so its busy AICs
# read one head's K and V in step
CANN_SAME_ADDRESS = ("https://www.hiascend.com/document/detail/en/canncommercial/850/opdevg/Ascendcopdevg/"
                     "atlas_ascendc_best_practices_10_00013.html")
# pto-isa's own FA kernel (one 128-row block per core) on the board: the same per-core work slows with the cores
# (S1 8192: 74.54 us on 1 core, 107.34 on 8)
PTO_FA = ("pto-isa (mirror zouzias/pto-isa-mirror), kernels/manual/common/flash_atten/README.md, "
          "commit 2e2a82ff94dd1a636cb4568a9a475ede0e307476")


@attrs.frozen
class Row:
    """One published measurement beside GEIR's time for the same work."""

    name: str
    source: str
    shape: str
    chip: str
    measured_us: float
    geir_us: float
    measured_bound: str
    geir_bound: str
    device_bound: bool = True  # False: the board's time is the host's (a floor of per-call cost), not the kernel's
    notes: str = ""
    # False: the measurement is the source of a GEIR constant (the row shows it is used, it checks nothing)
    independent: bool = True

    @property
    def ratio(self) -> float:
        return self.geir_us / self.measured_us

    @property
    def under_board(self) -> bool:
        """Whether GEIR's device time stays within the board's time (which bounds the device's from above)."""
        return self.geir_us <= self.measured_us


def _launch(sig: OpSignature, target, tiling=None):
    """Statistics of one standalone launch with the rules' tiling (or `tiling`)."""
    tiling = tiling if tiling is not None else KERNELS[sig.name].choose(sig, target)
    stats = time_launch(sig, tiling, target)
    return stats, tiling


def _bound(stats) -> str:
    """GEIR's busiest pipe and its share of the launch's time on the cores it used."""
    ratios = {p: stats.busy[p] / stats.cores / stats.cycles for p in PIPES if stats.busy.get(p)}
    if not ratios:
        return "head only"
    pipe = max(ratios, key=ratios.get)
    return f"{pipe} {ratios[pipe]:.0%}"


def gemm_rows(target) -> list[Row]:
    """pto-isa's GEMMs: A m x k, B n x k (transposed), fp16, with the rules' TCubeTiling."""
    out = []
    for s, ms, cube, tload in GEMMS:
        a, b = TensorType((s, s), F16), TensorType((s, s), F16)
        sig = OpSignature("ge.matmul", (a, b), (TensorType((s, s), F16),), {"transpose_b": True})
        stats, tiling = _launch(sig, target)
        us = stats.cycles / (target.clock_hz / 1e6)
        geir_cube = stats.busy["CUBE"] / stats.cores / stats.cycles
        out.append(Row(f"GEMM {s}^3", PTO_GEMM, f"m=k=n={s}, fp16, B transposed", "Atlas A3, 24 cube cores",
                       ms * 1000, us, f"cube {cube:.1%}, MTE2 {tload:.1%}", f"{_bound(stats)}, cube {geir_cube:.1%}",
                       notes="C is f32 on the board, f16 in GEIR (TSTORE 2-8 % of the board's time)"))
    return out


def _pfa_tiling(s0: int, s1: int, target):
    """The CV-split tiling of PromptFlashAttention's blocks for one FIA row (128 x 512, see OPS_PFA): its units of
    128 query rows go one to a core, as GEIR's contiguous split puts at most 24 of them."""
    return choose_cv_tiling(1, 1, 1, s0, s1, 128, F16, False, 0, target, preload=PFA_PRELOAD,
                            blocks=(PFA_S1_BLOCK, PFA_S2_BLOCK))


def _pfa_us(stats, target) -> float:
    """Microseconds of a launch timed with PFA's blocks, its head that of every core (PFA launches them all)."""
    return (stats.cycles - stats.head + target.head_cycles(target.launch_cores)) / (target.clock_hz / 1e6)


def fia_rows(target, fa_tiling: bool = False) -> list[Row]:
    """ops-transformer's FIA at B 1, one head, D 128 (BSH with one head is BNSD's layout), each timed as the benchmark
    loop's steady state (a launch after one on the same operands: K and V in the L2), as PromptFlashAttention (the
    kernel FIA runs at S0 > 1) splits it: its blocks, a unit per AIC, every core launched; or (`fa_tiling`) with
    GEIR's own FlashAttention rules' tiling (FlashAttentionScore's A2 blocks, flash-decoding at S0 128)."""
    out = []
    clock_us = target.clock_hz / 1e6
    for s0, s1, us_measured in FIA:
        q, kv = TensorType((1, 1, s0, 128), F16), TensorType((1, 1, s1, 128), F16)
        sig = OpSignature("ge.flash_attention", (q, kv, kv), (q,), {"scale": 1 / math.sqrt(128)})
        pfa = _pfa_tiling(s0, s1, target)
        pfa_stats = time_warm_launch(sig, pfa, target)
        units = -(-s0 // PFA_S1_BLOCK)
        pfa_split = (f"128 x 512 blocks, one 128-row unit on each of {units} AIC, every core launched; GEIR's AIV pair "
                     "shares a unit's rows where PFA's second AIV idles")
        if fa_tiling:
            tiling = KERNELS[sig.name].choose(sig, target)
            stats = time_warm_launch(sig, tiling, target)
            us = stats.cycles / clock_us
            models = (f"models GEIR's own FlashAttention rules ({tiling.template}, {tiling.s1} x {tiling.s2} blocks "
                      f"on {tiling.cores} AIC), not the kernel the board ran: PromptFlashAttention ({pfa_split}) takes "
                      f"{_pfa_us(pfa_stats, target):.1f} us")
        else:
            tiling, stats, us = pfa, pfa_stats, _pfa_us(pfa_stats, target)
            models = ("models PromptFlashAttention, the kernel the board ran (FIA's S0 > 1 path), on GEIR's CV-split "
                      f"schedule: {pfa_split}")
        # judged by the measurement alone: on the table's flat floor the host's work per call is the larger
        host = us_measured < 1.1 * FIA_FLOOR_US
        if host:
            notes = (f"{models}; host-bound: the table's floor (~{FIA_FLOOR_US:.0f} us a call; its x86 run ~24 us lower) is the "
                     "host's torch_npu / aclnn work per call, for which no cited figure exists: not modelled, so the "
                     "row checks only that GEIR's device time stays under the board's "
                     f"({'holds' if us <= us_measured else 'FAILS'})")
        else:
            x86 = FIA_X86[(s0, s1)]
            body_s = (stats.cycles - stats.head) / target.clock_hz  # the launch's time after its head
            read, moved = stats.gm_read_bytes, stats.gm_read_bytes + stats.gm_write_bytes
            notes = f"{models}; not reached"
            notes += ("; each unit's work is the same at every S0, yet the board's time grows with the units (S1 8192: "
                      "90.3 us at 8, 126.8 at 16; pto-isa's own FA kernel slows alike, 74.5 us on 1 core, 107.3 on 8): a "
                      "limit the cores share, for which GEIR has no cited constant. The chip's published L2 rates do "
                      f"not bind: the launch moves {moved / 1e6:.0f} MB through the L2 in {body_s * 1e6:.0f} us "
                      f"({read / body_s / 1e12:.1f} TB/s read, L2 peak ~{L2_PEAK_TB_S} TB/s; "
                      f"{moved / body_s / 1e12:.1f} in all, ~{L2_MIXED_TB_S:.0f} mixed); the busy AICs read one head's "
                      "K and V in step, which CANN serialises as same-address access at no stated rate. The same "
                      f"sweep from an x86 host measured {x86:.1f} us ({x86 / us_measured - 1:+.0%})")
        out.append(Row(f"FIA {s0} x {s1}", PTO_FIA, f"B 1, N 1, S0 {s0}, S1 {s1}, D 128, fp16",
                       "Atlas A2 (910B2)", us_measured, us, "host per-call floor" if host else "device",
                       f"{_bound(stats)}, {tiling.template}", device_bound=not host, notes=notes))
    return out


def add_rows(target) -> list[Row]:
    """asc-devkit's Add of two 8192 x 8192 fp16 tensors on 48 AIV: case 3 (one buffer, 32 KiB copies) and case 4
    (double-buffered); the L2-bypass cases 5-6 use a cache hint GEIR does not model."""
    out = []
    x = TensorType((8192, 8192), F16)
    sig = OpSignature("ge.add", (x, x), (x,), {})
    for case, buffers, us_measured, bound in ((3, 1, 268.5, "MTE2 70.5 %, read 1.456 TB/s"),
                                              (4, 2, 264.02, "MTE2 97.3 %")):
        tiling = KERNELS["ge.add"].choose(sig, target, buffers)
        stats, _ = _launch(sig, target, tiling)
        us = stats.cycles / (target.clock_hz / 1e6)
        out.append(Row(f"Add case {case}", ASC_ADD, f"8192 x 8192 + 8192 x 8192, fp16, {buffers} buffer"
                       f"{'s' * (buffers > 1)}", "Atlas A2, 48 AIV", us_measured, us, bound, _bound(stats),
                       notes="HBM-bound: 384 MiB through a 192 MiB L2 writes the result back within the launch; "
                             "reads and write-back at the chip's 1.6 TB/s (GEIR's assumption)"))
    return out


def head_row(target) -> Row:
    """catlass's empty kernel on every core of the chip: GEIR's head of a launch that starts them all."""
    us = target.head_cycles(target.launch_cores) / (target.clock_hz / 1e6)
    return Row("empty full-core kernel", CATLASS_HEAD, f"no work, on {target.cube_cores} AIC + {target.vector_cores} AIV",
               "Atlas A2", 20.5, us, "head overhead (20-21 us)", "head only",
               notes="the source of GEIR's [overhead] head_full_chip_us: shows it is used, checks nothing",
               independent=False)


@attrs.frozen
class DecodeAnchor:
    """A published decode step of a 7-8B dense decoder on one Atlas A2 card: what a served 7B shape's TPOT answers to."""

    source: str
    model: str
    dtype: str
    chip: str
    batch: int
    prompt: int  # tokens the prompt was padded to
    new_tokens: int  # the measured decode steps run from prompt + 1 to prompt + new_tokens - 1 cached tokens
    launch: str  # "graph" or "single-op"
    measured_ms: float
    # the positions each step's attention reads: a KV cache of fixed size read whole under a padding mask (0: only the
    # positions cached so far, as a paged or length-aware kernel reads)
    cache_tokens: int = 0
    family: str = "qwen2"  # the Hugging Face decoder whose shape GEIR serves (ANCHOR_CONFIGS)
    # the cited facts of the board's attention (its cache, how IFA splits it), for the row's notes
    setup: str = ""

    @property
    def mean_context(self) -> int:
        """The cached tokens of the mean decode step."""
        return self.prompt + self.new_tokens // 2

    @property
    def attended(self) -> int:
        """The keys the mean step's attention reads: the whole fixed cache where it is read whole, else the mean
        step's cached tokens (attention's cost is linear in them)."""
        return self.cache_tokens or self.mean_context


def decode_anchor() -> DecodeAnchor:
    """torchair's Qwen2-7B decode step in graph mode at batch 1 on an Atlas 800I A2 (TORCHAIR_QWEN2), its IFA reading
    the whole 2048-position cache (TORCHAIR_QWEN2_BENCH)."""
    return DecodeAnchor(TORCHAIR_QWEN2, "Qwen2-7B", "bf16", "Atlas 800I A2", batch=1, prompt=1024, new_tokens=1024,
                        launch="graph", measured_ms=23.0, cache_tokens=1024 + 1024,
                        setup=f"The cache is the script's 2048 positions, read whole by IFA under the padding mask "
                              f"({TORCHAIR_QWEN2_BENCH}), split as IFA's own rules split it: 4 key parts of each K/V "
                              f"head on 16 cores ({OPS_IFA}; {OPS_IFA_SPLIT})")


def llama2_anchor() -> DecodeAnchor:
    """torchair's LLaMA-2-7B (Atom-7B) decode step in graph mode at batch 1 on an Atlas 800I A2 (TORCHAIR_LLAMA2), its
    IFA reading the whole 4096-position cache (TORCHAIR_LLAMA2_MODEL: no actual_seq_lengths by default)."""
    return DecodeAnchor(TORCHAIR_LLAMA2, "LLaMA-2-7B (Atom-7B)", "fp16", "Atlas 800I A2", batch=1, prompt=1024,
                        new_tokens=1024, launch="graph", measured_ms=14.2,
                        cache_tokens=LLAMA2_7B["max_position_embeddings"], family="llama",
                        setup=f"The model is FlagAlpha's Atom-7B (LLaMA-2-7B's shape, 65,000-word vocabulary, 4K "
                              f"context: {ATOM_7B}); its cache is max_position_embeddings = 4096 positions, read whole "
                              f"by IFA under the padding mask (ACTUAL_SEQ off by default: {TORCHAIR_LLAMA2_MODEL}); "
                              f"with 32 K/V heads at batch 1 IFA splits no key range (B x Nkv >= 0.4 x cores: "
                              f"{OPS_IFA}), nor does GEIR's paged kernel")


def decode_anchors() -> tuple[DecodeAnchor, ...]:
    """Every published 7B-class decode step the table holds (behind --decode): the TPOT goal's anchor first."""
    return decode_anchor(), llama2_anchor()


def stand_in(causal_lm: type, config: object, rotary: type, dtype: object) -> object:
    """A Hugging Face causal LM of `config` whose weights are one element broadcast to each weight's shape (no bytes
    behind them: timing only needs the shapes), its rotary table real (`rotary`, computed from the config)."""
    import torch

    with torch.device("meta"):
        model = causal_lm(config).to(dtype).eval()
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.zeros((), dtype=dtype).expand(p.shape), requires_grad=False))
    model.model.rotary_emb = rotary(config)
    return model


def _stand_in(config: dict, dtype, family: str = "qwen2") -> object:
    """A Qwen2 (or, `family` "llama", LLaMA) causal LM of `config`'s shape, stand-in weights (`stand_in`)."""
    import transformers

    if family == "llama":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return stand_in(transformers.LlamaForCausalLM, transformers.LlamaConfig(**config), LlamaRotaryEmbedding, dtype)
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return stand_in(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**config), Qwen2RotaryEmbedding, dtype)


# the shape each anchor's family serves, and the torch dtype of its anchor's dtype
ANCHOR_CONFIGS = {"qwen2": QWEN2_7B, "llama": LLAMA2_7B}
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@attrs.frozen
class KindShare:
    """GEIR's launches of one kernel in a decode step: how many, their span, the heads in it, the HBM bytes read."""

    kernel: str
    launches: int
    us: float
    head_us: float
    hbm_read_bytes: int
    cores: int  # the most cores one of them used

    @property
    def hbm_tb_per_s(self) -> float:
        """The HBM read rate past the heads (0 where no byte came from HBM)."""
        body = self.us - self.head_us
        return self.hbm_read_bytes / body / 1e6 if body > 0 and self.hbm_read_bytes else 0.0


@attrs.frozen
class DecodeStep:
    """GEIR's decode step for an anchor's shape: its span on the one clock, the weights it reads, its launches by kernel."""

    us: float
    weights_read: int  # bytes of every weight but the input embedding's (gathered one row a token)
    shares: tuple[KindShare, ...]  # by kernel, the longest first

    @property
    def kernels_us(self) -> float:
        """The launches' spans summed (graph mode: they run back to back, the step's span less the replay's submission)."""
        return sum(k.us for k in self.shares)

    @property
    def heads_us(self) -> float:
        return sum(k.head_us for k in self.shares)

    def share(self, *kernels: str) -> KindShare:
        """The launches of `kernels` together (as one KindShare)."""
        sel = [k for k in self.shares if k.kernel in kernels]
        return KindShare("+".join(kernels), sum(k.launches for k in sel), sum(k.us for k in sel),
                         sum(k.head_us for k in sel), sum(k.hbm_read_bytes for k in sel), max((k.cores for k in sel), default=0))


MATMULS = ("ge.matmul", "ge.fused_matmul")


def decode_step_us(anchor: DecodeAnchor, target_name: str = "ascend910b") -> float:
    """GEIR's decode step for `anchor`'s shape in microseconds (see decode_step)."""
    return decode_step(anchor, target_name).us


def _decode_step(anchor: DecodeAnchor, target_name: str, config: dict | None = None) -> tuple[float, int]:
    """decode_step's span and weight bytes (the pair the serve bench and the tests read)."""
    step = decode_step(anchor, target_name, config)
    return step.us, step.weights_read


def decode_step(anchor: DecodeAnchor, target_name: str = "ascend910b", config: dict | None = None) -> DecodeStep:
    """GEIR's decode step for `anchor`'s shape: one request served timing-only in its launch mode, its decode step over
    the keys the anchor's mean step attends (`anchor.attended`), on the one clock (the step's start, its submission, to
    its last task), with its launches by kernel and the bytes of the weights it reads (all but the input embedding's).
    `config`: the shape served (None: the anchor's, ANCHOR_CONFIGS; fewer layers for a quick check)."""
    import warnings

    import torch

    from geir.frontends.torch import serve
    from geir.runtime.interpreter import RuntimeListener

    class LastRun(RuntimeListener):
        """The launches of the latest run (the request's decode step runs after its prefill)."""

        def __init__(self) -> None:
            self.launches: list = []

        def run_started(self, program) -> None:
            self.launches = []

        def launched(self, task, stats) -> None:
            self.launches.append(stats)

    config = ANCHOR_CONFIGS[anchor.family] if config is None else config
    model = _stand_in(config, getattr(torch, _TORCH_DTYPES[anchor.dtype]), anchor.family)
    prompt = anchor.attended - 1  # its one decode step attends over `attended` keys
    last = LastRun()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = serve(model, [(torch.arange(1, prompt + 1), 2, 0.0)], timing_only=True, launch=anchor.launch,
                    target=target_name, listeners=[last])
    # its one decode step: a plan-cache miss costs GE's host time before start_us, not the step's span
    step = next(s for s in run.steps if s.kind == "decode")
    # a step reads every weight once but the input embedding's, of which it gathers one row a token
    embedding = model.get_input_embeddings().weight
    read = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    cycles_per_us = load_target(target_name).clock_hz / 1e6
    by: dict[str, list] = {}
    for stats in last.launches:
        if stats.cores:  # a view (reshape, split) launches nothing
            by.setdefault(stats.name, []).append(stats)
    shares = [KindShare(name, len(ks), sum(k.cycles for k in ks) / cycles_per_us, sum(k.head for k in ks) / cycles_per_us,
                        sum(k.hbm_read_bytes for k in ks), max(k.cores for k in ks)) for name, ks in by.items()]
    return DecodeStep(step.end_us - step.start_us, read, tuple(sorted(shares, key=lambda k: -k.us)))


def breakdown_lines(step: DecodeStep, layers: int) -> list[str]:
    """GEIR's decode step by kernel: launches (a layer's), time, heads and the HBM rate past them."""
    lines = [f"GEIR's decode step by kernel: {step.us / 1e3:.2f} ms on the one clock, its launches {step.kernels_us / 1e3:.2f} ms "
             f"back to back, {step.heads_us / 1e3:.2f} ms of it heads"]
    for k in step.shares:
        rate = f", {k.hbm_tb_per_s:.2f} TB/s of HBM past the heads" if k.hbm_read_bytes > 1e6 else ""
        lines.append(f"  {k.kernel:24s} {k.launches:4d} launches ({k.launches / layers:4.1f} a layer), {k.us / 1e3:6.2f} ms, "
                     f"heads {k.head_us / 1e3:5.2f} ms, up to {k.cores} cores{rate}")
    return lines


def decode_row(target_name: str = "ascend910b", step: DecodeStep | None = None,
               anchor: DecodeAnchor | None = None) -> Row:
    """A 7B-class decode anchor (the TPOT goal's by default) beside GEIR's step for the same shape (about 30 s: a
    whole model's export and plan; or `step`, timed before)."""
    a = anchor if anchor is not None else decode_anchor()
    step = step if step is not None else decode_step(a, target_name)
    us, weights = step.us, step.weights_read
    read_us = weights / load_target(target_name).memory.hbm_bytes_per_s * 1e6
    measured = a.measured_ms * 1000
    mm = step.share(*MATMULS)
    layers = ANCHOR_CONFIGS[a.family]["num_hidden_layers"]
    verdict = "reached" if abs(us / measured - 1) <= 0.15 else "not reached"
    return Row(f"{a.model} decode step", a.source,
               f"{a.model} shape, {a.dtype}, batch {a.batch}, attention over the whole {a.attended}-position cache "
               f"(steps {a.prompt + 1}-{a.prompt + a.new_tokens - 1}), {a.launch} mode", f"{a.chip}, one card",
               measured, us, "whole step (host-synchronised), graph mode", "whole step, graph mode",
               notes=f"{verdict}: the board's step is {measured / read_us:.2f}x the weights' read ({weights / 1e9:.1f} "
                     f"GB at GEIR's HBM rate, {read_us / 1000:.1f} ms), GEIR's {us / read_us:.2f}x; GEIR's matmuls take "
                     f"{mm.us / 1e3:.1f} ms of it ({mm.launches} launches, {mm.hbm_tb_per_s:.2f} TB/s past their heads), "
                     f"{sum(k.launches for k in step.shares) / layers:.0f} launches a layer and "
                     f"{step.heads_us / 1e3:.1f} ms of heads in all. {a.setup}. The board's bias-free projections at "
                     f"M = 1 take MatMulV3's IncreShape path (M <= 128, fp16/bf16, ND, B transposed: {OPS_MM_INCRE}): "
                     "C split over M and N only, each core summing the whole K, as GEIR's rules split it, but its base "
                     "blocks and core count come from the legacy TBE cache tiling, a closed library. Not modelled, "
                     "no cited figure: the card's SoC (the README says 800I A2 only, sold with more than one 910B: "
                     f"{ATLAS_800I_A2_SOC}) and its HBM rate; a MatMul's measured HBM fraction at M = 1 on A2; the task "
                     "scheduler's dispatch between a graph's tasks; torchair's host work inside the synchronised "
                     "bracket (guards, GE's graph run)")


def rows(target_name: str = "ascend910b", fa_tiling: bool = False, decode: bool = False,
         steps: tuple[DecodeStep, ...] | None = None) -> list[Row]:
    """Every row of the table, timed on `target_name` (the FIA rows as PromptFlashAttention splits them, or with
    GEIR's own FlashAttention rules where `fa_tiling`; the 7B decode anchors where `decode`: about a minute, or
    `steps`, GEIR's steps for decode_anchors() timed before)."""
    target = load_target(target_name)
    out = gemm_rows(target) + fia_rows(target, fa_tiling) + add_rows(target) + [head_row(target)]
    if not decode:
        return out
    anchors = decode_anchors()
    steps = steps if steps is not None else (None,) * len(anchors)
    return out + [decode_row(target_name, st, a) for a, st in zip(anchors, steps)]


def summary(table: list[Row]) -> dict:
    """Mean absolute error and the worst row, over every independent row (not a constant's own source) and over
    the device-bound ones."""
    def stats(sel: list[Row]) -> dict:
        if not sel:
            return {"rows": 0}
        errors = [abs(r.ratio - 1) for r in sel]
        worst = max(sel, key=lambda r: abs(r.ratio - 1))
        return {"rows": len(sel), "mean_abs_error": sum(errors) / len(errors), "worst": worst.name,
                "worst_ratio": worst.ratio, "within_15": sum(e <= 0.15 for e in errors)}
    checks = [r for r in table if r.independent]
    host = [r for r in checks if not r.device_bound]
    return {"all": stats(checks), "device_bound": stats([r for r in checks if r.device_bound]),
            "host_floor": {"rows": len(host), "under_board": sum(r.under_board for r in host)}}


def _render(table: list[Row], markdown: bool, fa_tiling: bool = False) -> str:
    """The table as text or markdown, its summaries and its sources."""
    head = ("row", "shape", "chip", "measured us", "GEIR us", "GEIR / measured", "bound (board)", "bound (GEIR)",
            "notes")
    cells = [(r.name, r.shape, r.chip, f"{r.measured_us:.1f}", f"{r.geir_us:.1f}", f"{r.ratio:.2f}",
              r.measured_bound, r.geir_bound, r.notes) for r in table]
    lines = []
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines += ["| " + " | ".join(c) + " |" for c in cells]
    else:
        widths = [max(len(x[i]) for x in cells + [head]) for i in range(len(head) - 1)]
        for c in [head] + cells:
            lines.append("  ".join(x.ljust(w) for x, w in zip(c, widths)) + "  " + c[-1])
    s = summary(table)
    lines.append("")
    lines.append("the FIA rows model " + ("GEIR's own FlashAttention rules (FlashAttentionScore's A2 tiling; --fa-tiling), "
                                          "not the PromptFlashAttention kernel the board ran" if fa_tiling else
                                          "PromptFlashAttention, the kernel FIA runs at S0 > 1 (its split on GEIR's "
                                          "CV-split schedule; --fa-tiling: GEIR's own FlashAttention rules)"))
    for key, what in (("all", "every row but a constant's source"),
                      ("device_bound", "of those, rows where the board's time is the device's")):
        x = s[key]
        lines.append("")
        lines.append(f"{what}: {x['rows']} rows, mean absolute error {x['mean_abs_error']:.1%}, worst "
                     f"{x['worst']} at {x['worst_ratio']:.2f}x, {x['within_15']} of {x['rows']} within 15 %")
    host = s["host_floor"]
    lines.append("")
    lines.append(f"rows where the board's time is the host's (not modelled: no cited host cost): {host['rows']} rows, "
                 f"GEIR's device time under the board's in {host['under_board']} of {host['rows']}")
    lines.append("")
    lines.append("sources:")
    for src in dict.fromkeys(r.source for r in table):
        lines.append(f"- {src}")
    lines.append(f"- how the FIA rows were timed: {PTO_FIA_BENCH}")
    lines.append(f"- FIA's S0 > 1 path (PromptFlashAttention) as its tiling splits it: {OPS_PFA}")
    lines.append(f"- and as its kernel places the units on the cores: {OPS_PFA_KERNEL}")
    lines.append(f"- torch_npu's npu_fused_infer_attention_score (inner_precise=0 by default): {TORCH_NPU_FIA}")
    lines.append(f"- the device-bound FIA rows' notes: the A2 L2 peak, {ASC_DATA_COPY}; its mixed rate, {CANN_L2_TILING}; "
                 f"same-address access, {CANN_SAME_ADDRESS}; pto-isa's FA kernel by cores, {PTO_FA}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="ascend910b", help="the simulated chip (default ascend910b)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--markdown", action="store_true", help="a markdown table (the README's)")
    out.add_argument("--json", action="store_true", help="every row and the summary as JSON")
    parser.add_argument("--fa-tiling", action="store_true",
                        help="time the FIA rows with GEIR's own FlashAttention rules (FlashAttentionScore's A2 blocks, "
                             "flash-decoding where a head's query rows fit one block) instead of as PromptFlashAttention "
                             "(the kernel the board ran) splits them")
    parser.add_argument("--decode", action="store_true",
                        help="add the 7B-class decode anchors' rows (torchair's Qwen2-7B and LLaMA-2-7B steps; about a "
                             "minute: two whole models' timing-only export and plan)")
    args = parser.parse_args(argv)
    steps = tuple(decode_step(a, args.target) for a in decode_anchors()) if args.decode else None
    table = rows(args.target, args.fa_tiling, args.decode, steps)
    if args.json:
        out = {"rows": [dict(attrs.asdict(r), ratio=r.ratio) for r in table], "summary": summary(table)}
        if steps is not None:
            out["decode_steps"] = {a.model: attrs.asdict(st) for a, st in zip(decode_anchors(), steps)}
        print(json.dumps(out, indent=2))
    else:
        print(_render(table, args.markdown, args.fa_tiling))
        for a, st in zip(decode_anchors(), steps or ()):
            print(f"\n{a.model}: " + "\n".join(breakdown_lines(st, ANCHOR_CONFIGS[a.family]["num_hidden_layers"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
