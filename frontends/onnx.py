"""ONNX models into GEIR: `import_onnx` gives a verified `ge.graph` module and its weights.

The `onnx` package (the `onnx` extra) is imported only when a model is imported, so `import geir`
works without it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from geir.ir import Module

if TYPE_CHECKING:
    import onnx


class OnnxImportError(Exception):
    """A model GEIR cannot import; the message names the node and its op type where there is one.

    `unsupported` is true for what GEIR cannot express (an op, a dtype, a value known only at run
    time) and false for a model that is malformed or unreadable.
    """

    def __init__(self, message: str, node: str | None = None, op_type: str | None = None,
                 unsupported: bool = False):
        self.reason = message
        self.node = node
        self.op_type = op_type
        self.unsupported = unsupported
        where = f"node '{node}' ({op_type}): " if node is not None else ""
        super().__init__(where + message)


def import_onnx(model: "str | os.PathLike | onnx.ModelProto", *,
                graph_name: str = "main") -> tuple[Module, dict[str, np.ndarray]]:
    """Import an ONNX model (a file or a ModelProto) as a module holding one verified `ge.graph`.

    Returns the module and the weights its `dense_resource` constants name (initializers larger than
    a few elements); smaller constants are `dense` literals in the graph.
    """
    try:
        import onnx  # noqa: F401
    except ImportError:
        raise OnnxImportError("importing ONNX models needs the onnx package: pip install -e '.[onnx]'") from None
    from geir.frontends.onnx_graph import OnnxGraphImporter, load_model

    if isinstance(model, (str, os.PathLike)):
        source = os.fspath(model)
        proto: Any = load_model(source)
        base_dir = os.path.dirname(os.path.abspath(source))
    else:
        proto, source, base_dir = model, model.graph.name or "<onnx>", ""
    return OnnxGraphImporter(proto, source, graph_name, base_dir).run()
