"""Write the inputs of the tour's dynamic-length model: one prompt per sequence length, with its causal mask.

    python examples/tour/make_inputs.py OUT_DIR [--hidden 256] [--seq 128 512]

For a model from `examples/make_model.py --dynamic-seq` (arguments %x: [1, S, hidden] and the
additive %mask: [1, 1, S, S], 0 = attend, a large negative = masked), each length S becomes
OUT_DIR/seqS.npz holding `x` and the causal `mask`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# large enough that exp() of a masked score is 0 in f16, small enough to stay finite in f16
MASKED = -30000.0


def causal_mask(s: int) -> np.ndarray:
    """The additive causal mask [1, 1, S, S]: 0 where key j <= query i, MASKED above the diagonal."""
    keep = np.tril(np.ones((s, s), dtype=bool))
    return np.where(keep, 0.0, MASKED).astype(np.float32)[None, None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", metavar="OUT_DIR")
    ap.add_argument("--hidden", type=int, default=256, help="the model width (default 256)")
    ap.add_argument("--seq", type=int, nargs="+", default=[128, 512], help="sequence lengths (default 128 512)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for s in args.seq:
        x = rng.standard_normal((1, s, args.hidden), dtype=np.float32)
        np.savez(out / f"seq{s}.npz", x=x, mask=causal_mask(s))
        print(f"wrote {out / f'seq{s}.npz'}: x [1, {s}, {args.hidden}], mask [1, 1, {s}, {s}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
