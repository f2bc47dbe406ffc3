"""geimport: bring an ONNX model into GEIR.

    geimport MODEL.onnx -o OUT.geir [--graph-name NAME]

Writes OUT.geir (one verified `ge.graph`) and OUT.npz beside it: the weights its
`dense_resource<"key">` constants name (initializers larger than a few elements; smaller constants
are `dense` literals), so `gerun OUT.geir` finds them. Both files are written atomically, and only
when the whole import succeeded. Value names are the model's, with characters GEIR names do not take
replaced by `_` (so `gerun --inputs` keys are the graph's argument names as printed).

Exit codes: 0 success, 1 a model that cannot be read or imported (an unsupported op names its node
and op type), 2 bad usage (-o onto the model included), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from geir.files import npz_bytes
from geir.tools.common import (
    EXIT_OK,
    EXIT_USAGE,
    ToolError,
    add_version,
    refuse_overwrites,
    refuse_unwritable,
    run_tool,
    write_all_atomically,
)

from geir.printer import print_module

TOOL = "geimport"
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_$.\-]*\Z")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=TOOL, description="Import an ONNX model as a GEIR graph and its weights.")
    add_version(p, TOOL)
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX model (external data beside it is read too)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.geir",
                   help="the graph to write; the weights go to the .npz with the same stem")
    p.add_argument("--graph-name", default="main", metavar="NAME", help="name of the graph (default: main)")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_tool(TOOL, run, build_arg_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if not _SYMBOL.match(args.graph_name):
        raise ToolError(f"--graph-name: '{args.graph_name}' is not a graph name (letters, digits, _ $ . -, "
                        f"not starting with a digit)", EXIT_USAGE)
    out = Path(args.output)
    if out.suffix == ".npz":
        raise ToolError(f"-o {args.output}: the graph goes to a .geir file; the weights go beside it", EXIT_USAGE)
    weights_path = out.with_suffix(".npz")
    outputs = [("-o", args.output), ("the weights beside -o", str(weights_path))]
    refuse_overwrites([("MODEL.onnx", args.model)], outputs)
    refuse_unwritable(outputs)
    from geir.frontends.onnx import OnnxImportError, import_onnx

    if not os.path.isfile(args.model):
        raise ToolError(f"{args.model}: cannot read it: " + ("no such file" if not os.path.exists(args.model)
                                                            else "not a file"))
    try:
        module, weights = import_onnx(args.model, graph_name=args.graph_name)
    except OnnxImportError as e:
        raise ToolError(f"{args.model}: {e}") from None
    text = print_module(module)
    # both files or neither, and an existing pair stays whole if either cannot be written
    write_all_atomically([(str(weights_path), npz_bytes(weights)), (str(out), text)])
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
