"""A bare numpy FlashAttention-2 loop, and the whole command that runs it: the baseline of GEIR.md section 5's host speed.

    python bench/flash_loop.py B N S D S1 S2 [SEED]

The command is what `gerun FILE --seed SEED` is measured against as a whole process: a Python that imports
numpy (and nothing else), makes the same random inputs as gerun's `--seed` (q, k and v in that order, normal f32
rounded to f16), runs the loop with the blocks GE chose (S1 query rows, S2 key rows) and prints the result's
summary line as gerun does. This module imports numpy only, so its start-up is the bare loop's own.
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np


def flash_attention_loop(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, s1: int, s2: int,
                         round_p: Callable[[np.ndarray, np.dtype], np.ndarray] | None = None) -> np.ndarray:
    """A bare FlashAttention-2 loop: q blocks outside, k blocks inside, vectorised over B and N, f32 softmax.

    With `round_p` (a function of an f32 array and a dtype), P is rounded to the inputs' dtype before P @ V, as an
    f16 kernel's cube takes it.
    """
    B, N, Sq, D = q.shape
    Skv = k.shape[2]
    kf, vf = k.astype(np.float32), v.astype(np.float32)
    out = np.empty(q.shape, dtype=q.dtype)
    for i in range(0, Sq, s1):
        qb = q[:, :, i:i + s1].astype(np.float32) * np.float32(scale)
        rows = qb.shape[2]
        m = np.full((B, N, rows, 1), -np.inf, dtype=np.float32)
        l = np.zeros((B, N, rows, 1), dtype=np.float32)
        acc = np.zeros((B, N, rows, D), dtype=np.float32)
        for j in range(0, Skv, s2):
            s = qb @ np.swapaxes(kf[:, :, j:j + s2], -1, -2)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            p = np.exp(s - m_new)
            alpha = np.exp(m - m_new)
            l = l * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * alpha + (p if round_p is None else round_p(p, q.dtype)) @ vf[:, :, j:j + s2]
            m = m_new
        out[:, :, i:i + s1] = (acc / l).astype(q.dtype)
    return out


def seeded_qkv(shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k and v as `gerun --seed` makes a graph's f16 arguments in order: one generator, normal f32, rounded."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(np.float16) for _ in range(3))
    return q, k, v


def summary(a: np.ndarray) -> str:
    """The statistics gerun prints of a float result (mean, std, min, max of the finite values, in f64)."""
    x = a.astype(np.float64)
    finite = x[np.isfinite(x)]
    return f"mean {finite.mean():.6g}, std {finite.std():.6g}, min {finite.min():.6g}, max {finite.max():.6g}"


def main(argv: list[str]) -> int:
    """The bare-loop command: B N S D S1 S2 [SEED]; prints the result's summary line."""
    if len(argv) not in (6, 7) or not all(a.isdigit() for a in argv):
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    b, n, s, d, s1, s2 = (int(a) for a in argv[:6])
    q, k, v = seeded_qkv((b, n, s, d), int(argv[6]) if len(argv) == 7 else 0)
    out = flash_attention_loop(q, k, v, 1 / d ** 0.5, s1, s2)
    print(f"result0: {summary(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
