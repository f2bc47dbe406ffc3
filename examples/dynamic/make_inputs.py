"""Write the inputs of the dynamic examples: prefill and decode steps of several lengths.

    python examples/dynamic/make_inputs.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

# name -> (query rows, keys) for attention_kv.geir (B=1, N=8, D=128)
STEPS = {"prefill_1024": (1024, 1024), "decode_1024": (1, 1024), "decode_2048": (1, 2048), "prefill_128": (128, 128)}


def main(out: str) -> int:
    rng = np.random.default_rng(0)
    Path(out).mkdir(parents=True, exist_ok=True)
    for name, (sq, skv) in STEPS.items():
        q = rng.standard_normal((1, 8, sq, 128), dtype=np.float32)
        k, v = (rng.standard_normal((1, 8, skv, 128), dtype=np.float32) for _ in range(2))
        np.savez(Path(out) / f"{name}.npz", q=q, k=k, v=v)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
