"""Write the inputs of the dynamic examples: prefill and decode steps, and model inputs of several lengths.

    python examples/dynamic/make_inputs.py OUT_DIR

attention_kv.geir takes q, k, v ({prefill,decode}_*.npz); the model from
`make_model.py --dynamic-seq --hidden 256` takes x and an additive causal mask (model_*.npz).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# name -> (query rows, keys) for attention_kv.geir (B=1, N=8, D=128)
STEPS = {"prefill_1024": (1024, 1024), "decode_1024": (1, 1024), "decode_2048": (1, 2048), "prefill_128": (128, 128)}
MODEL_LENGTHS = (128, 512, 2048)
MODEL_HIDDEN = 256


def main(argv: list[str] | None = None) -> int:
    # argparse, so that --help is help and not a folder named "--help"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", metavar="OUT_DIR", nargs="?", default=".", help="the folder to write into (default: .)")
    out = ap.parse_args(argv).out
    rng = np.random.default_rng(0)
    Path(out).mkdir(parents=True, exist_ok=True)
    for name, (sq, skv) in STEPS.items():
        q = rng.standard_normal((1, 8, sq, 128), dtype=np.float32)
        k, v = (rng.standard_normal((1, 8, skv, 128), dtype=np.float32) for _ in range(2))
        np.savez(Path(out) / f"{name}.npz", q=q, k=k, v=v)
    for s in MODEL_LENGTHS:
        x = rng.standard_normal((1, s, MODEL_HIDDEN), dtype=np.float32)
        mask = np.triu(np.full((s, s), -np.inf, dtype=np.float32), 1)[None, None]
        np.savez(Path(out) / f"model_{s}.npz", x=x, mask=mask)
    return 0


if __name__ == "__main__":
    sys.exit(main())
