"""A norm computed in f32 on a 16-bit tensor and cast back becomes the norm of the 16-bit tensor itself:
cast_h(norm(cast_f32(x_h), params)) -> norm(x_h, params in h), h f16 or bf16.

Hugging Face's RMSNorm (LLaMA, Qwen2, Phi-3, Mistral) writes it so: `hidden_states.to(torch.float32)`, the norm,
`.to(input_dtype)`. ops-nn's RmsNorm, AddRmsNorm and LayerNorm kernels take FLOAT16 / BFLOAT16 x and gamma and do
the arithmetic in f32 inside (their goldens: x cast to float32, rstd in float32, y cast back; hicann/ops-nn
norm/add_rms_norm/tests/assets/golden.py), and AddRmsNormCast exists to fold such a cast "to reduce moves in and
out" (norm/add_rms_norm_cast/README.md). GE's norms compute 16-bit inputs in f32 the same way (geir.ops.numerics
`work`) and round the result once to its dtype, so the fold is exact: the up-cast of x is exact, the f32 steps are
the same, and the one rounding is the cast's. The parameters become 16-bit constants, which keeps it exact only when
each is exactly representable there (else the rule says so). With the casts gone the residual add before the norm
meets it, and add_rms_norm (a lower tier) takes it too.

That moves one rounding in a 16-bit decode step: where the residual add had become the output projection's matmul
epilogue (the residual added to the f32 accumulator, one rounding), add_rms_norm now takes it (the projection's
16-bit result added to the residual and rounded, as torch's eager f16 add does), as the f32 layers already did.
LLaMA f16's decode logits move by at most one f16 ulp of their size (2.4e-4), their RMS error against float64 stays
beside torch's own (bench/llm_layer.py).
"""

from __future__ import annotations

import numpy as np

from geir.attributes import DenseAttr
from geir.ir import Operation
from geir.passes.fusion.match import const_array, defining, named, used_only_by
from geir.passes.pattern import Match, Miss, Pattern, Rewriter
from geir.types import DType

_HALF = (DType.f16, DType.bf16)


class FoldNormCasts(Pattern):
    """cast_h(norm(cast_f32(x_h), params)) -> norm(x_h, params as h constants)."""

    # above add_rms_norm / add_layer_norm (30), which then meet the 16-bit add; below the norm rules (34, 35)
    NAME, ROOT, BENEFIT, EXPLAIN = "norm_cast", "ge.cast", 32, True

    def match(self, down: Operation) -> Match | Miss | None:
        norm = defining(down.operands[0], "ge.rms_norm", "ge.layer_norm")
        half = down.result.type.dtype
        if norm is None or half not in _HALF:
            return None
        up = defining(norm.operands[0], "ge.cast")
        if up is None or norm.operands[0].type.dtype != DType.f32 or up.operands[0].type.dtype != half:
            return None  # not a 16-bit tensor normalised in f32
        if not used_only_by(norm.result, down):
            return Miss(f"the f32 result of {named(norm)} is also used elsewhere; folding the casts would drop it")
        params = []
        for name, p in zip(norm.OPERAND_NAMES[1:], norm.operands[1:]):
            arr = const_array(p)
            if arr is None:
                source = "a graph argument" if p.owner is None else named(p.owner)
                return Miss(f"the {name} of {named(norm)} comes from {source}, not a dense constant to cast to {half}")
            narrow = arr.astype(half.np)
            if not np.array_equal(narrow.astype(np.float32), arr.astype(np.float32)):
                return Miss(f"the {name} of {named(norm)} is not exact in {half}: the norm of the {half} input would "
                            f"scale by other numbers")
            params.append((p, narrow))
        return Match(down, norm=norm, x=up.operands[0], params=params)

    def rewrite(self, m: Match, rw: Rewriter) -> None:
        operands = [m.x]
        for p, narrow in m.params:
            attr = p.owner.value
            # a splat stays one value (a splat of no elements: its empty array, there is no value to keep)
            values = narrow.reshape(-1)[:1].reshape(()) if attr.is_splat and narrow.size else narrow
            operands.append(rw.create("ge.const", [], {"value": DenseAttr(values)}, [p.type.with_dtype(m.x.type.dtype)],
                                      before=m.norm).result)
        norm = rw.create(m.norm.name, operands, dict(m.norm.attributes), [m.root.result.type], before=m.root,
                         loc=m.norm.loc)
        rw.replace(m.root, norm)
