"""Random attention inputs for the FlashAttention kernel tests (one recipe, so every test draws the same way)."""

from __future__ import annotations

import numpy as np


def attention_inputs(b: int, n: int, sq: int, d: int, *, nkv: int | None = None, skv: int | None = None,
                     dtype=np.float16, mask_kind: str | None = None, keep: float = 0.8, seed: int = 0):
    """q, k, v in BNSD (q and k scaled by 0.5) and an optional mask: "additive" (f32, broadcast over B and N) or
    "boolean" (each key kept with probability `keep`, key 0 always, so no row is wholly masked)."""
    rng = np.random.default_rng(seed)
    nkv, skv = nkv or n, skv or sq
    q = (0.5 * rng.standard_normal((b, n, sq, d))).astype(dtype)
    k = (0.5 * rng.standard_normal((b, nkv, skv, d))).astype(dtype)
    v = rng.standard_normal((b, nkv, skv, d)).astype(dtype)
    mask = None
    if mask_kind == "additive":
        mask = rng.standard_normal((1, 1, sq, skv)).astype(np.float32)
    elif mask_kind == "boolean":
        mask = rng.random((b, 1, sq, skv)) > 1 - keep
        mask[..., 0] = True
    return q, k, v, mask
