"""fuse: pattern fusion with a reason for every candidate that did not fuse (--explain).

Rules run in tiers by benefit: every rule of a higher tier gets the whole graph before any rule
of a lower one, so specific fusions (softmax, norms, GELU, then attention) are not pre-empted by
generic ones (matmul epilogues, elementwise chains) that would swallow their pieces. Within a
tier the greedy driver runs to a fixpoint, so rules compose: a written-out softmax becomes
`ge.softmax` first, and the attention rule then matches it.
"""

from __future__ import annotations

from itertools import groupby
from typing import Mapping

import attrs
import numpy as np

from geir.ir import Module
from geir.passes.fusion.add_norm import FuseAddLayerNorm, FuseAddRmsNorm
from geir.passes.fusion.attention_layout import FoldAttentionTransposes, SinkHeadTranspose
from geir.passes.fusion.attention import FuseFlashAttention, NativeAttentionInputs
from geir.passes.fusion.attention_rows import FoldMaskedRowsSelect
from geir.passes.fusion.elementwise import FuseElementwiseChain
from geir.passes.fusion.epilogue import FuseMatmulEpilogue, FuseMatmulResidual
from geir.passes.fusion.gelu import FuseGelu
from geir.passes.fusion.glu import FuseGlu, FuseMatmulGlu, GluFromMergedMatmul
from geir.passes.fusion.kv_scatter import MergeIndexPutPair
from geir.passes.fusion.moe import FuseMoeFinalizeRouting, FuseMoeGating, FuseMoeInitRouting
from geir.passes.fusion.qkv import MergeSiblingMatmuls
from geir.passes.fusion.qkv_heads import DeinterleaveQkvHeads
from geir.passes.fusion.norms import FuseLayerNorm, FuseRmsNorm
from geir.passes.fusion.norm_cast import FoldNormCasts
from geir.passes.fusion.norm_add_norm import FuseRmsNormAddRmsNorm
from geir.passes.fusion.paged_attention import PagedAttentionRead
from geir.passes.fusion.rotary import FusePartialRotary, FuseRotaryEmbedding, MergeRotaryPair
from geir.passes.fusion.softmax import DecomposedSoftmax
from geir.passes.fusion.split_heads import SplitHeadsOnce
from geir.passes.pass_manager import Pass, PassContext, register_pass
from geir.passes.pattern import Pattern, PatternListener, apply_patterns_greedily
from geir.target_npu.target import Target

# Every fusion rule by name (the names `rules=` and `disable=` take).
FUSION_RULES: dict[str, type[Pattern]] = {
    p.NAME: p for p in (
        GluFromMergedMatmul, MergeRotaryPair, MergeIndexPutPair,
        DecomposedSoftmax, FuseLayerNorm, FuseRmsNorm, FuseGelu, FuseRotaryEmbedding, FusePartialRotary, FuseGlu,
        FuseFlashAttention, NativeAttentionInputs, FuseMatmulEpilogue, FuseElementwiseChain,
        FuseAddRmsNorm, FuseAddLayerNorm, MergeSiblingMatmuls, FoldAttentionTransposes, PagedAttentionRead,
        FuseMoeGating, FuseMoeInitRouting, FuseMoeFinalizeRouting, FoldNormCasts, FoldMaskedRowsSelect,
        FuseMatmulGlu, FuseRmsNormAddRmsNorm, DeinterleaveQkvHeads, FuseMatmulResidual,
    )
}


# Rewrites that come with a rule and have no name of their own: what they do only serves that rule (the head
# transposes sink towards attention so that attention_layout can fold them; the merged projection's pieces, each
# viewed as heads and transposed, are transposed once and split on the head axis).
COMPANIONS: dict[str, tuple[type[Pattern], ...]] = {"attention_layout": (SinkHeadTranspose,),
                                                     "qkv_merge": (SplitHeadsOnce,)}


def _instantiate(rule: type[Pattern], target: Target, resources: Mapping[str, np.ndarray] | None = None) -> Pattern:
    # rules whose decision depends on the chip (a kernel's shape guards) take the target, and the module's
    # weights (a mask may be a dense_resource constant)
    return rule(target, resources) if rule in (FuseFlashAttention, NativeAttentionInputs, MergeSiblingMatmuls,
                                                    DeinterleaveQkvHeads, FuseMatmulResidual) else rule()


def _known_rules(instance: object, attribute: attrs.Attribute, names: list[str]) -> None:
    unknown = [n for n in names if n not in FUSION_RULES]
    if unknown:
        raise ValueError(f"unknown fusion rule '{unknown[0]}' (rules: {', '.join(FUSION_RULES)})")


@register_pass("fuse")
@attrs.define(kw_only=True)
class Fuse(Pass):
    """Fuse op patterns into kernels; `rules` picks rules (default all), `disable` drops some."""

    REQUIRES = ("infer-shapes",)
    rules: list[str] = attrs.field(factory=list, validator=_known_rules)
    disable: list[str] = attrs.field(factory=list, validator=_known_rules)

    def selected(self, target: Target, resources: Mapping[str, np.ndarray] | None = None) -> list[Pattern]:
        names = self.rules or list(FUSION_RULES)
        chosen = [n for n in names if n not in self.disable]
        rules = [FUSION_RULES[n] for n in chosen] + [c for n in chosen for c in COMPANIONS.get(n, ())]
        return [_instantiate(rule, target, resources) for rule in rules]

    def run(self, module: Module, ctx: PassContext) -> None:
        patterns = sorted(self.selected(ctx.target, module.resources), key=lambda p: -p.BENEFIT)
        tiers = [list(group) for _, group in groupby(patterns, key=lambda p: p.BENEFIT)]
        for g in module.graphs:
            listener = PatternListener()
            for tier in tiers:
                apply_patterns_greedily(g, tier, listener)
            for outcome in listener.outcomes():
                ctx.record(outcome)
                ctx.remark(outcome.render(), outcome.loc)
