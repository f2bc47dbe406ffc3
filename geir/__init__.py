"""GEIR: an MLIR-style graph IR and compiler toolkit for a simulated Ascend-style NPU.

The IR core lives here (types, ops, builder, parser, printer, verifier, diagnostics, reference
interpreter); `geir.passes` is the graph engine, `geir.runtime`, `geir.kernels` and
`geir.target_npu` the execution side, `geir.tools` the command-line programs.
"""

from geir.diagnostics import Diagnostic, DiagnosticError, Location
from geir.ir import Graph, Module, Operation, Value
from geir.parser import parse, parse_file
from geir.printer import print_graph, print_module
from geir.types import DType, TensorType
from geir.verifier import verify_module

__all__ = [
    "DType", "Diagnostic", "DiagnosticError", "Graph", "Location", "Module", "Operation", "TensorType",
    "Value", "parse", "parse_file", "print_graph", "print_module", "verify_module",
]
__version__ = "0.1.0"
