"""Write the ONNX example: self-attention as an exporter spells it, and inputs for it.

    python examples/onnx/make_model.py [OUT_DIR]      (default: examples/onnx; needs the onnx extra)

attention.onnx takes x: [1, 64, 64] f32 and applies one attention layer with 2 heads of 32: the
q, k and v projections (MatMul with 64x64 initializers), heads by Reshape + Transpose, k
transposed, the scores divided by sqrt(32), Softmax, the weighted sum, the heads merged back and
the output projection. attention_inputs.npz holds an `x` for it (`gerun --inputs` keys are the
graph's argument names). Weights and inputs are random from seed 0, so the files are the same
on every run.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from geir.files import write_all_atomically

SEQ, HIDDEN, HEADS = 64, 64, 2
HEAD_DIM = HIDDEN // HEADS
OPSET = 17
IR_VERSION = 8  # fixed, so the bytes do not depend on the installed onnx's default


def build() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model and its inputs."""
    rng = np.random.default_rng(0)
    weights = {name: (rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
               for name in ("wq", "wk", "wv", "wo")}
    inits = [numpy_helper.from_array(a, name) for name, a in weights.items()]
    inits += [numpy_helper.from_array(np.array([1, SEQ, HEADS, HEAD_DIM], np.int64), "heads_shape"),
              numpy_helper.from_array(np.array([1, SEQ, HIDDEN], np.int64), "merged_shape"),
              numpy_helper.from_array(np.array(np.sqrt(HEAD_DIM), np.float32), "sqrt_d")]
    node = helper.make_node
    nodes = []
    for p in ("q", "k", "v"):
        nodes += [node("MatMul", ["x", f"w{p}"], [f"{p}_proj"]),
                  node("Reshape", [f"{p}_proj", "heads_shape"], [f"{p}_split"])]
    nodes += [
        node("Transpose", ["q_split"], ["q"], perm=[0, 2, 1, 3]),
        node("Transpose", ["k_split"], ["k_t"], perm=[0, 2, 3, 1]),
        node("Transpose", ["v_split"], ["v"], perm=[0, 2, 1, 3]),
        node("MatMul", ["q", "k_t"], ["scores"]),
        node("Div", ["scores", "sqrt_d"], ["scaled"]),
        node("Softmax", ["scaled"], ["probs"], axis=-1),
        node("MatMul", ["probs", "v"], ["context"]),
        node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3]),
        node("Reshape", ["context_t", "merged_shape"], ["merged"]),
        node("MatMul", ["merged", "wo"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="geir examples/onnx/make_model.py")
    onnx.checker.check_model(model)
    return model, {"x": rng.standard_normal((1, SEQ, HIDDEN)).astype(np.float32)}


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    # argparse, so that --help is help and not a folder named "--help"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", metavar="OUT_DIR", nargs="?", default=str(Path(__file__).parent),
                    help="the folder to write into (default: examples/onnx)")
    folder = Path(ap.parse_args(argv).out)
    model, inputs = build()
    folder.mkdir(parents=True, exist_ok=True)
    # both files or neither, each with the mode the umask gives, as the tools write theirs
    write_all_atomically([(str(folder / "attention.onnx"), model.SerializeToString(deterministic=True)),
                          (str(folder / "attention_inputs.npz"), npz_bytes(inputs))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
