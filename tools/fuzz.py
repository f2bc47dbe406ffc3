"""A fuzz harness for the command-line tools: mutated programs and models in, the tools' manners checked.

Each case mutates a program from the corpus (examples/ and test/lit/ .geir files, rt.programs lowered from
them, small ONNX models made here) - bytes, tokens, numbers, nesting, constants their types cannot hold,
2^40-element dimensions, operands rewired to other values, mul chains deeper than Python's recursion limit -
sometimes with a target file one number of which is at an edge, a what-if chip of astronomical counts or
latencies, or a damaged tuning repository (or one with a poisoned entry: a tiling field or a time no tuning
gives, for `tile{db=...}` and getune) beside it; runs geopt, gerun, geimport, gedoctor or getune in-process
on it (geserve on a tiny LLaMA's request trace and its config, either or both mutated: fields set to the edges of
what JSON says, with its flags at theirs) and checks what any input must
give: an exit code of 0, 1 or 2, no Python traceback, no "internal error", and every
`FILE:LINE:COL:` diagnostic about the input pointing inside it. `test/test_fuzz.py` runs a bounded campaign in
the suite; `bench/fuzz.py` runs long ones and prints the distinct reproducers.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import attrs

if TYPE_CHECKING:
    import onnx

REPO = Path(__file__).resolve().parent.parent
# fragments a mutation splices in: the IR's own tokens, and values at the edges of what it takes
TOKENS = [
    b"tensor<", b">", b"x", b"?", b"{", b"}", b"[", b"]", b"(", b")", b",", b":", b"=", b"%", b"@", b"\"", b"//",
    b"dense<", b"dense_resource<\"w\">", b"ge.", b"rt.", b"f16", b"bf16", b"f32", b"f64", b"i1", b"i64", b"NZ",
    b"0", b"-1", b"1e999", b"-inf", b"nan", b"9" * 30, b"9" * 5000, b"65536", b"2147483648", b"[" * 40, b"]" * 40,
    b"1x" * 70, b"true", b"ge.return", b"ge.graph @main() -> () {", b"\x00", b"\xff", "é".encode(), b"\n", b" ",
]
RUN_SECONDS = 20  # a mutated gerun or gedoctor run that simulates for longer is dropped (counted as slow), not failed
SIMULATING = ("gerun", "gedoctor", "getune", "geserve")


@attrs.frozen
class Case:
    """One fuzz input: which tool, the file's name and bytes, and the extra arguments."""

    tool: str
    name: str
    data: bytes
    args: tuple[str, ...] = ()
    # files written beside the input first (a target file, a tuning repository); "{dir}" in args is their folder
    files: tuple[tuple[str, bytes], ...] = ()


@attrs.frozen
class Outcome:
    """What the tool did with a case, and why that breaks the tools' contract (None: it did not)."""

    case: Case
    code: int | None
    problem: str | None
    slow: bool = False


def corpus() -> list[tuple[str, bytes]]:
    """The .geir programs of examples/ and test/lit/ (name, bytes), smallest first."""
    files = sorted(p for d in ("examples", "test/lit") for p in (REPO / d).rglob("*.geir"))
    return sorted(((str(p.relative_to(REPO)), p.read_bytes()) for p in files), key=lambda c: len(c[1]))


SMALL_PROGRAM_BYTES = 4 << 20


def lowered(programs: list[tuple[str, bytes]], count: int = 6) -> list[tuple[str, bytes]]:
    """rt.programs lowered from the first `count` of `programs` that lower (for mutations of the Runtime's input)."""
    from geir.parser import parse
    from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
    from geir.printer import print_module

    out = []
    for name, data in programs:
        try:
            module = parse(data.decode("utf-8"), name)
            if len(module.graphs) != 1 or not PassManager(complete_pipeline(parse_pipeline("lower"))).run(
                    module, PassContext()):
                continue
            if sum(module.graphs[0].attributes["memory"].values()) > SMALL_PROGRAM_BYTES:
                continue  # quick to simulate, so that a campaign spends its time on many programs
        except Exception:  # noqa: BLE001 - a corpus file that does not parse or lower is simply not used
            continue
        out.append((Path(name).stem + ".lowered.geir", print_module(module).encode()))
        if len(out) == count:
            break
    return out


def mutate(data: bytes, rng: random.Random) -> bytes:
    """A few random edits: bytes flipped, inserted or deleted, tokens spliced in, lines dropped or doubled,
    numbers changed, an extent made 0 in every type, literals and types nested deeper."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(14)
        at = rng.randrange(len(out) + 1)
        if kind == 0 and out:
            out[min(at, len(out) - 1)] = rng.randrange(256)
        elif kind == 1:
            out[at:at] = rng.choice(TOKENS)
        elif kind == 2 and out:
            del out[at:at + rng.randint(1, 16)]
        elif kind == 3:
            lines = bytes(out).split(b"\n")
            i = rng.randrange(len(lines))
            lines.insert(i, lines[rng.randrange(len(lines))])
            out = bytearray(b"\n".join(lines))
        elif kind == 4:
            lines = bytes(out).split(b"\n")
            if len(lines) > 1:
                del lines[rng.randrange(len(lines))]
            out = bytearray(b"\n".join(lines))
        elif kind == 5:  # a number somewhere becomes another
            nums = list(re.finditer(rb"\d+", bytes(out)))
            if nums:
                m = rng.choice(nums)
                out[m.start():m.end()] = rng.choice([b"0", b"1", b"3", b"-5", b"4097", b"100000", b"9" * 25,
                                                     b"9" * 5000, b"9223372036854775808"])
        elif kind == 6:  # a dense literal nested deeper
            at = bytes(out).find(b"dense<")
            end = bytes(out).find(b">", at)
            if at >= 0 and end > at:
                depth = rng.choice([2, 33, 40, 200])
                out[end:end] = b"]" * depth
                out[at + 6:at + 6] = b"[" * depth
        elif kind == 7:  # a type gets many more dimensions
            at = bytes(out).find(b"tensor<")
            if at >= 0:
                out[at + 7:at + 7] = b"1x" * rng.choice([2, 33, 65])
        elif kind == 8:  # a constant nested deeper with its type to match, so that it gets past the type check
            m = re.search(rb"dense<([^<>\n]*)>\s*:\s*tensor<", bytes(out))
            if m:
                depth = rng.choice([1, 31, 32, 33, 40, 65])
                out[m.end():m.end()] = b"1x" * depth
                out[m.start(1):m.end(1)] = b"[" * depth + m[1] + b"]" * depth
        elif kind == 9:  # an extent becomes 0 in every type it appears in: still consistent, so empty tensors and
            # sums over nothing (a matmul's K) reach the passes and the kernels
            extents = [e for t in re.findall(rb"tensor<([^<>]*)>", bytes(out)) for e in re.findall(rb"\d+", t)]
            if extents:
                d = rng.choice(extents)
                out = bytearray(re.sub(rb"tensor<[^<>]*>", lambda t: re.sub(rb"(?<![\d.])" + d + rb"(?=x)", b"0",
                                                                            t[0]), bytes(out)))
        elif kind == 10:  # a constant its type cannot hold, or with a `?` in its type (once read as sizes)
            m = re.search(rb"dense<([^<>\n]*)>\s*:\s*tensor<", bytes(out)[at:])
            if m:
                start = at + m.start(1)
                if rng.randrange(2):
                    out[start:at + m.end(1)] = rng.choice([b"[]", b"-1", b"[-1]", b"[0, 0]"])
                else:
                    out[at + m.end():at + m.end()] = b"?x"
        elif kind == 11:  # a dimension of 2^40 elements: within what GEIR models, beyond any host
            base, m = at, re.search(rb"tensor<(\d+)", bytes(out)[at:])
            if m is None:
                base, m = 0, re.search(rb"tensor<(\d+)", bytes(out))
            if m:
                out[base + m.start(1):base + m.end(1)] = b"1099511627776"
        elif kind == 12:  # an operand becomes another value of the program (a host value where a device one is read)
            names = list(dict.fromkeys(re.findall(rb"%[A-Za-z_0-9.]+", bytes(out))))
            uses = list(re.finditer(rb"(?<=[ ,])%[A-Za-z_0-9.]+(?=[ ,}\n])", bytes(out)))
            if names and uses:
                m = rng.choice(uses)
                out[m.start():m.end()] = rng.choice(names)
        elif kind == 13:  # a chain of single-use muls deeper than Python's recursion limit after some value (no pass
            # may recurse on the graph's depth); rarer than the others, as such a program takes long to compile
            m = rng.choice(list(re.finditer(rb"\n(\s*)(%[A-Za-z_0-9.]+) = ge\.[^\n]*", bytes(out))) or [None])
            if m and rng.randrange(4) == 0:
                v = m[2].decode()
                chain = "".join(f"\n{m[1].decode()}{v}_d{i} = ge.mul {v if i == 0 else f'{v}_d{i - 1}'}, {v}"
                                for i in range(DEPTH))
                out[m.end():m.end()] = chain.encode()
        else:  # a token of the program is repeated
            words = list(re.finditer(rb"[A-Za-z_.%@0-9]+", bytes(out)))
            if words:
                m = rng.choice(words)
                out[at:at] = bytes(out[m.start():m.end()])
    return bytes(out)


DEPTH = 1100  # a chain longer than Python's default recursion limit (1000)


def mutate_target(rng: random.Random) -> bytes:
    """A bundled target file with one number made non-finite, fractional, negative or astronomically large."""
    data = rng.choice(sorted((REPO / "target_npu" / "targets").glob("*.toml"))).read_bytes()
    numbers = list(re.finditer(rb"(?m)^([a-z_0-9]+ = )(-?[0-9.]+)", data))
    m = rng.choice(numbers)
    value = rng.choice([b"nan", b"inf", b"-inf", b"2.5", b"0", b"-1", b"1e30", b"100000000000000000000", b"1e-300"])
    return data[:m.start(2)] + value + data[m.end(2):]


# what-if chips at the edges: astronomically large counts, latencies and clocks, fractional counts
EXTREME_TARGETS = [f"ascend910b[{o}]" for o in (
    "cube_cores=1e12", "vector_cores=x1e9", "dma_latency_cycles=1e20", "clock_ghz=x1e30", "aicpu.cores=2.5",
    "host.launch_latency_us=1e30", "ub_bytes=x1e20", "fusion.flash_attention_decode_max_q=1e30")]


def damaged_repositories() -> list[bytes]:
    """Tuning repositories getune must refuse with a reason: another program's database, an old layout, another
    schema, no schema version, bytes that are not SQLite (an empty file is a new repository, not a damaged one)."""
    import sqlite3

    scripts = ["CREATE TABLE users (id, name);",
               "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT); INSERT INTO meta VALUES ('schema', '1');"
               "CREATE TABLE entries (op_key, target, tiling); CREATE TABLE measurements (op_key, tiling);",
               "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT); INSERT INTO meta VALUES ('schema', '7');",
               "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);"]
    out = [b"SQLite format 3\x00" + b"\xff" * 200]
    with tempfile.TemporaryDirectory(prefix="geir-fuzz-db-") as tmp:
        for i, script in enumerate(scripts):
            path = Path(tmp) / f"{i}.sqlite"
            db = sqlite3.connect(path)
            db.executescript(script)
            db.commit()
            db.close()
            out.append(path.read_bytes())
    return out


# what a poisoned entry holds in place of a tiling field or a time: zero, a size no block takes, negative, huge,
# not a number, missing
POISONS = [0, 7, -1, 2 ** 40, "x", None, 1e30]
TUNE_SECONDS = 2


def poisoned_repositories(programs: list[tuple[str, bytes]], count: int = 3) -> dict[str, list[bytes]]:
    """Tuning repositories of the first `count` of `programs` that getune tunes, each with one entry poisoned (a
    tiling field, or its time, set to a value from POISONS: the kernel's `choose` would never give it), by the
    program's name: planted for that program's `tile{db=...}`, and for getune's own --db."""
    import contextlib
    import json
    import sqlite3

    from geir.tools import getune

    out: dict[str, list[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="geir-fuzz-poison-") as tmp:
        for name, data in programs:
            src, db = Path(tmp) / Path(name).name, Path(tmp) / f"{len(out)}.sqlite"
            src.write_bytes(data)
            previous = signal.signal(signal.SIGALRM, _raise_slow)
            signal.alarm(TUNE_SECONDS)  # a program that takes long to tune (gemm_6144's candidates) is passed over
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                try:
                    tuned = getune.main([str(src), "--workers", "0", "--db", str(db)]) == 0
                except BaseException:  # noqa: BLE001 - a program getune does not take is simply not used
                    tuned = False
                finally:
                    signal.alarm(0)
                    signal.signal(signal.SIGALRM, previous)
            if not tuned or not db.exists():
                continue
            con = sqlite3.connect(db)
            rows = con.execute("SELECT rowid, tiling FROM entries").fetchall()
            con.close()
            variants = []
            for rowid, tiling in rows:
                fields = sorted(json.loads(tiling))
                for i, poison in enumerate(POISONS):
                    field = fields[(rowid + i) % len(fields)] if fields else None
                    copy = Path(tmp) / "copy.sqlite"
                    copy.write_bytes(db.read_bytes())
                    con = sqlite3.connect(copy)
                    if i % 3 == 2:  # a time poisoned instead (s1 = 0 once reached a ZeroDivisionError this way)
                        con.execute(f"UPDATE entries SET {('time_us', 'rules_us')[i % 2]} = ? WHERE rowid = ?",
                                    ((0, -1)[i // 3 % 2], rowid))
                    else:
                        value = {k: v for k, v in json.loads(tiling).items() if k != field or poison is not None}
                        if poison is not None and field is not None:
                            value[field] = poison
                        # claimed faster than the rules' tiling, so that the tile pass takes it (and must check it)
                        con.execute("UPDATE entries SET tiling = ?, time_us = rules_us / 2 WHERE rowid = ?",
                                    (json.dumps(value), rowid))
                    con.commit()
                    con.close()
                    variants.append(copy.read_bytes())
            if variants:
                out[Path(name).name] = variants
            if len(out) == count:
                break
    return out


def onnx_models() -> list[tuple[str, bytes]]:
    """Small ONNX models made with onnx's helper, one per kind of converter input (empty without onnx)."""
    try:
        import numpy as np
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return []
    f = TensorProto.FLOAT

    def vi(name: str, shape: list) -> object:
        return helper.make_tensor_value_info(name, f, shape)

    def ints(name: str, values: list[int]) -> object:
        return numpy_helper.from_array(np.array(values, dtype=np.int64), name)

    w = numpy_helper.from_array(np.arange(32, dtype=np.float32).reshape(4, 8) / 32, "w")
    node = helper.make_node
    graphs = {
        "matmul_add": ([node("MatMul", ["x", "w"], ["y"]), node("Relu", ["y"], ["z"])], [vi("x", [2, 4])],
                       [vi("z", [2, 8])], [w]),
        "softmax": ([node("Softmax", ["x"], ["y"], axis=-1), node("Transpose", ["y"], ["z"], perm=[1, 0])],
                    [vi("x", [3, 5])], [vi("z", [5, 3])], []),
        "shapes": ([node("Reshape", ["x", "shape"], ["r"]), node("Expand", ["r", "big"], ["e"]),
                    node("Unsqueeze", ["e", "axes"], ["u"]), node("ReduceSum", ["u", "axes"], ["z"], keepdims=0)],
                   [vi("x", [2, 3])], [vi("z", [3, 2, 2])], [ints("shape", [3, 2, 1]), ints("big", [3, 2, 2]),
                                                            ints("axes", [0])]),
        "slices": ([node("Slice", ["x", "starts", "ends", "axes"], ["s"]), node("Gather", ["s", "idx"], ["g"], axis=1),
                    node("Concat", ["g", "g"], ["c"], axis=0), node("Split", ["c"], ["a", "b"], axis=0),
                    node("Pad", ["a", "pads"], ["z"])],
                   [vi("x", [4, 6])], [vi("z", [4, 4])], [ints("starts", [1]), ints("ends", [3]), ints("axes", [0]),
                                                          ints("idx", [0, 2]), ints("pads", [1, 1, 1, 1])]),
        "norm": ([node("LayerNormalization", ["x", "gamma"], ["n"], axis=-1, epsilon=1e-5),
                  node("Gemm", ["n", "w"], ["m"], transB=0, alpha=0.5),
                  node("Cast", ["m"], ["c"], to=TensorProto.FLOAT16),
                  node("Clip", ["c"], ["z"])],
                 [vi("x", [2, 4])], [helper.make_tensor_value_info("z", TensorProto.FLOAT16, [2, 8])],
                 [w, numpy_helper.from_array(np.ones(4, dtype=np.float32), "gamma")]),
        "function": ([node("Twice", ["x"], ["z"], domain="local")], [vi("x", [2, 3])], [vi("z", [2, 3])], []),
    }
    twice = helper.make_function("local", "Twice", ["a"], ["b"], [node("Add", ["a", "a"], ["b"])],
                                 [helper.make_opsetid("", 18)])
    out = []
    for name, (nodes, inputs, outputs, inits) in graphs.items():
        g = helper.make_graph(nodes, "g", inputs, outputs, inits)
        local = name == "function"
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]
                                  + ([helper.make_opsetid("local", 1)] if local else []),
                                  functions=[twice] if local else [])
        out.append((f"{name}.onnx", model.SerializeToString()))
    return out


# values an ONNX attribute is set to, of every type an attribute can have
ATTRIBUTE_VALUES = [0, 1, -1, 7, 2**40, -(2**62), 1.5, float("nan"), "", "ab", "none", [0, 1], [5, -7], [0.5, 2.0],
                    ["a", "b"], [1] * 70]
# op types a node is switched to: the converters', ones evaluated at import, function-bodied and unknown ones
ONNX_OPS = ["Add", "Relu", "Softmax", "LogSoftmax", "Transpose", "Reshape", "Expand", "Concat", "Split", "Slice",
            "Gather", "Pad", "MatMul", "Gemm", "Cast", "CastLike", "Unsqueeze", "Squeeze", "Flatten", "ReduceSum",
            "ReduceMax", "ReduceMin", "LayerNormalization", "RMSNormalization", "Where", "Clip", "Shape", "Size",
            "Identity", "Dropout", "Attention", "Gelu", "Softplus", "Mean", "Pow", "Not", "Range", "ConstantOfShape",
            "TopK", "Constant", "Trilu", "Mod", "NoSuchOp"]


def mutate_onnx(data: bytes, rng: random.Random) -> bytes:
    """A few edits of a model's structure (attributes, dims, opsets, op types, wiring, initializers, local
    functions), or of its bytes."""
    from onnx import ModelProto

    if rng.randrange(3) == 0:
        return mutate(data, rng)
    model = ModelProto()
    model.ParseFromString(data)
    for _ in range(rng.randint(1, 3)):
        rng.choice(_ONNX_EDITS)(model, rng)
    return model.SerializeToString()


def _set_attribute(model: onnx.ModelProto, rng: random.Random) -> None:
    """An attribute of some node (one its schema names, one it has, or `axis`) set to a value of any type."""
    import onnx
    from onnx import helper

    nodes = list(model.graph.node)
    if not nodes:
        return
    n = rng.choice(nodes)
    try:
        names = list(onnx.defs.get_schema(n.op_type, 18, n.domain).attributes)
    except onnx.defs.SchemaError:
        names = []
    names += [a.name for a in n.attribute] + ["axis"]
    name = rng.choice(names)
    value = rng.choice(ATTRIBUTE_VALUES + [_tensor(rng)])
    kept = [a for a in n.attribute if a.name != name]
    del n.attribute[:]
    n.attribute.extend(kept + [helper.make_attribute(name, value)])


def _tensor(rng: random.Random) -> onnx.TensorProto:
    """A small tensor attribute value of some dtype, float64 included."""
    import numpy as np
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array(rng.choice([[1, 2, 3], 0.5, [[1.0, 2.0]], []]), dtype=rng.choice(
        [np.float32, np.int64, np.float64, np.bool_])))


def _set_dim(model: onnx.ModelProto, rng: random.Random) -> None:
    """A dimension of a graph input or output becomes negative, zero, huge or symbolic."""
    values = list(model.graph.input) + list(model.graph.output)
    dims = [d for v in values if v.type.HasField("tensor_type") for d in v.type.tensor_type.shape.dim]
    if not dims:
        return
    d = rng.choice(dims)
    value = rng.choice([-3, -1, 0, 1, 7, 2**40, 2**62, None])
    if value is None:
        d.dim_param = "n"
    else:
        d.dim_value = value


def _set_opset(model: onnx.ModelProto, rng: random.Random) -> None:
    """The default domain's opset becomes another version, one out of range, or is dropped."""
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = rng.choice([0, -1, 1, 6, 7, 10, 11, 12, 13, 17, 18, 23, 24, 28, 29, 10**6])
            if rng.randrange(8) == 0:
                model.opset_import.remove(o)
            return


def _set_op_type(model: onnx.ModelProto, rng: random.Random) -> None:
    """A node becomes an op of another type, attributes and inputs unchanged."""
    if model.graph.node:
        rng.choice(model.graph.node).op_type = rng.choice(ONNX_OPS)


def _rewire(model: onnx.ModelProto, rng: random.Random) -> None:
    """A node's input becomes another value, an absent one or an undefined one, or it gains an input."""
    nodes = list(model.graph.node)
    if not nodes:
        return
    n = rng.choice(nodes)
    names = [v.name for v in model.graph.input] + [i.name for i in model.graph.initializer]
    names += [o for m in nodes for o in m.output] + ["", "undefined"]
    if n.input and rng.randrange(3):
        n.input[rng.randrange(len(n.input))] = rng.choice(names)
    else:
        n.input.append(rng.choice(names))


def _set_initializer(model: onnx.ModelProto, rng: random.Random) -> None:
    """An initializer's dims, data type or data made inconsistent."""
    inits = list(model.graph.initializer)
    if not inits:
        return
    t = rng.choice(inits)
    edit = rng.randrange(3)
    if edit == 0 and t.dims:
        t.dims[rng.randrange(len(t.dims))] = rng.choice([-1, 0, 3, 2**40])
    elif edit == 1:
        t.data_type = rng.randrange(27)
    else:
        t.raw_data = t.raw_data[:rng.randrange(len(t.raw_data) + 1)]


def _recursive_function(model: onnx.ModelProto, rng: random.Random) -> None:
    """A node becomes a call of a model-local function that calls itself, directly or through another."""
    from onnx import helper

    if not model.graph.node:
        return
    n = rng.choice(model.graph.node)
    names = ["Loop1"] if rng.randrange(2) else ["LoopA", "LoopB"]
    for i, name in enumerate(names):
        callee = names[(i + 1) % len(names)]
        body = [helper.make_node(callee, ["a"], ["b"], domain="rec")]
        model.functions.append(helper.make_function("rec", name, ["a"], ["b"], body,
                                                    [helper.make_opsetid("", 18), helper.make_opsetid("rec", 1)]))
    model.opset_import.append(helper.make_opsetid("rec", 1))
    n.op_type, n.domain = names[0], "rec"
    del n.input[1:]
    del n.attribute[:]


_ONNX_EDITS = [_set_attribute, _set_attribute, _set_dim, _set_opset, _set_op_type, _rewire, _set_initializer,
               _recursive_function]


# geserve's inputs: a trace of a tiny LLaMA's requests (the case's file) and its transformers config beside it
SERVE_CONFIG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                "max_position_embeddings": 64}
SERVE_TRACE = [{"prompt_ids": [1, 5, 9, 12], "max_new_tokens": 3, "arrival_us": 0},
               {"prompt_ids": [3, 7, 8], "max_new_tokens": 2, "arrival_us": 50.5},
               {"prompt_ids": [2, 4, 6, 8, 10], "max_new_tokens": 1}]
# values a mutated trace or config field takes: the edges of what a JSON number, list or string can say
JSON_EDGES = [0, -1, 1, 2, 3, 7, 1000, 2 ** 31, 2 ** 63, 10 ** 40, 1e308, -1e-300, 0.5, 1e-9, "x", "", None, True,
              [], {}, [[1]], [1.5], [-5], [10 ** 6], list(range(1, 300)), "float16", "bfloat16", "int8", "gpt2",
              "bert", "lama"]
SERVE_KEYS = ["prompt_ids", "max_new_tokens", "arrival_us", "extra"]
CONFIG_KEYS = list(SERVE_CONFIG) + ["torch_dtype", "head_dim", "rope_theta", "tie_word_embeddings", "n_positions"]


def serve_sources() -> list[tuple[str, bytes]]:
    """geserve's traces: the tiny LLaMA's three requests, each line one JSON object."""
    return [("trace.jsonl", ("\n".join(json.dumps(r) for r in SERVE_TRACE) + "\n").encode())]


def mutate_json(data: bytes, rng: random.Random, keys: list[str]) -> bytes:
    """One object of a JSON text (one a line) with a field set to an edge value (or removed, or the line emptied);
    text that is not JSON any more gets `mutate`'s byte edits instead."""
    lines = data.decode("utf-8", errors="replace").split("\n")
    at = rng.choice([i for i, line in enumerate(lines) if line.strip()] or [0])
    try:
        value = json.loads(lines[at])
    except ValueError:
        return mutate(data, rng)
    if not isinstance(value, dict) or rng.randrange(10) == 0:
        lines[at] = json.dumps(rng.choice(JSON_EDGES))
    else:
        key = rng.choice(keys)
        if key in value and rng.randrange(5) == 0:
            del value[key]
        else:
            value[key] = rng.choice(JSON_EDGES)
        lines[at] = json.dumps(value)
    return "\n".join(lines).encode()


def mutate_serve_case(data: bytes, rng: random.Random) -> tuple[bytes, bytes]:
    """A trace and its config, JSON-aware edits mostly and byte edits sometimes to one or both (a quarter of the
    cases neither: runs that serve, with the flags alone at their edges)."""
    config = json.dumps(SERVE_CONFIG, indent=1).encode()
    which = rng.randrange(4)
    if which in (0, 2):
        data = mutate(data, rng) if rng.randrange(4) == 0 else mutate_json(data, rng, SERVE_KEYS)
    if which in (1, 2):
        config = mutate(config, rng) if rng.randrange(4) == 0 else mutate_json(config, rng, CONFIG_KEYS)
    return data, config


def cases(rng: random.Random, tool: str, count: int, sources: list[tuple[str, bytes]],
          poisoned: dict[str, list[bytes]] | None = None) -> Iterator[Case]:
    """`count` mutated cases for one tool (`poisoned`: repositories with a poisoned entry, by program name, planted
    beside that program where a case takes a repository; a damaged one beside any other)."""
    args = {"geopt": [(), ("--passes=canonicalize,fuse,layout,tile,plan",), ("--passes=lower",), ("--explain",),
                      ("--passes=const-fold,canonicalize,cse,dce",), ("--split-input-file", "--verify-diagnostics"),
                      ("--dot", "-"), ("--passes=fuse,layout,tile{db={dir}/planted.sqlite},plan,lower", "--explain")],
            "gerun": [("--check",), ("--no-fuse",), ("--profile",), ("--explain",), ("--inject-fault", "dma@0"),
                      ("--timing-only",), ("--target", "{target}"), ("--target", "{what-if}"),
                      ("--passes=fuse,layout,tile{db={dir}/planted.sqlite},plan", "--check")],
            "geimport": [()],
            "gedoctor": [(), ("--json",), ("--no-fuse",), ("--target", "{target}")],
            "getune": [(), ("--json",), ("--target", "ascend310p"), ("--sweep", "--set", "ub_bytes=x0.5"),
                       ("--sweep", "--set", "l2_mib=x0.01,x2", "--json"), ("--target", "{what-if}"),
                       ("--db", "{dir}/planted.sqlite")],
            "geserve": [(), ("--timing-only",), ("--policy", "static"), ("--launch", "graph", "--json"),
                        ("--block-size", "1"), ("--block-size", "3"), ("--block-size", "1024"),
                        ("--block-size", "4096"), ("--block-size", "99999999999999999999"),
                        ("--pool-bytes", "1"), ("--pool-bytes", "4096"), ("--pool-bytes", "10" + "0" * 30),
                        ("--memory-utilization", "0.9", "--timing-only"), ("--memory-utilization", "1e-9"),
                        ("--memory-utilization", "nan"), ("--target", "{what-if}", "--timing-only"),
                        ("--trace", "{dir}/chrome.json"), ("--seed", "-1")]}[tool]
    repositories = damaged_repositories() if tool in ("geopt", "gerun", "getune") else []
    poisoned = poisoned or {}
    for _ in range(count):
        name, data = rng.choice(sources)
        edit = mutate_onnx if name.endswith(".onnx") else mutate
        chosen, files = rng.choice(args), ()
        if tool == "geserve":  # the trace is the case's file, its config (maybe mutated too) beside it
            trace, config = mutate_serve_case(data, rng)
            chosen = ("--model", "{dir}/config.json") + tuple(
                a.replace("{what-if}", rng.choice(EXTREME_TARGETS)) for a in chosen)
            yield Case(tool, Path(name).name, trace, chosen, (("config.json", config),))
            continue
        if "{target}" in chosen:  # a target file with one number at an edge
            chosen = tuple(a.replace("{target}", "{dir}/chip.toml") for a in chosen)
            files = (("chip.toml", mutate_target(rng)),)
        elif "{what-if}" in chosen:
            chosen = tuple(a.replace("{what-if}", rng.choice(EXTREME_TARGETS)) for a in chosen)
        elif any("{dir}/planted.sqlite" in a for a in chosen):
            own = poisoned.get(Path(name).name)
            files = (("planted.sqlite", rng.choice(own if own and rng.randrange(4) else repositories)),)
        yield Case(tool, Path(name).name, edit(data, rng), chosen, files)


def _tool_main(tool: str) -> Callable[[list[str]], int]:
    from geir.tools import gedoctor, geimport, geopt, gerun, geserve, getune

    return {"geopt": geopt.main, "gerun": gerun.main, "geimport": geimport.main, "gedoctor": gedoctor.main,
            "getune": getune.main, "geserve": geserve.main}[tool]


class _Slow(BaseException):
    """The alarm of a run that simulates too long (a BaseException, so that the tools' wrapper lets it through)."""


def run_case(case: Case, workdir: Path) -> Outcome:
    """Run one case in-process in `workdir` and judge the tool's behaviour."""
    src = workdir / case.name
    src.write_bytes(case.data)
    for name, data in case.files:
        (workdir / name).write_bytes(data)
    argv = [str(src), *(a.replace("{dir}", str(workdir)) for a in case.args)]
    if case.tool == "geimport":
        argv += ["-o", str(workdir / "out.geir")]
    if case.tool == "getune":  # in this process, into a repository of the campaign's own (unless one was planted)
        argv += ["--workers", "0"] + ([] if "--db" in case.args else ["--db", str(workdir / "tuning.sqlite")])
    err, out = io.StringIO(), io.StringIO()
    slow = False
    previous = signal.signal(signal.SIGALRM, _raise_slow) if case.tool in SIMULATING else None
    if previous is not None:
        signal.alarm(RUN_SECONDS)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = _tool_main(case.tool)(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 2
    except _Slow:
        code, slow = None, True
    except BaseException as e:  # noqa: BLE001 - that is what the harness is looking for
        return Outcome(case, None, f"raised {type(e).__name__}: {e}")
    finally:
        if previous is not None:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
    if slow:
        return Outcome(case, None, None, slow=True)
    return Outcome(case, code, judge(case, code, err.getvalue()))


def _raise_slow(signum, frame) -> None:
    raise _Slow()


_DIAG = re.compile(r"^(?P<file>[^\n:]+):(?P<line>\d+):(?P<col>\d+): (?:error|warning|remark|note):", re.MULTILINE)


def judge(case: Case, code: int | None, err: str) -> str | None:
    """Why the tool's behaviour on this case breaks its contract, or None."""
    if code not in (0, 1, 2):
        return f"exit code {code}"
    if "Traceback (most recent call last)" in err:
        return "a Python traceback"
    if "internal error" in err:
        return "an internal error: " + next(line for line in err.splitlines() if "internal error" in line)
    lines = case.data.decode("utf-8", errors="replace").split("\n")
    for m in _DIAG.finditer(err):
        if Path(m["file"]).name != case.name:
            continue
        line, col = int(m["line"]), int(m["col"])
        if not 1 <= line <= len(lines) or not 1 <= col <= len(lines[line - 1]) + 1:
            return f"a diagnostic at {line}:{col}, outside the input ({len(lines)} lines)"
    return None


def campaign(seed: int, counts: dict[str, int]) -> list[Outcome]:
    """Run `counts[tool]` mutated cases per tool; every outcome, in order."""
    rng = random.Random(seed)
    small = [c for c in corpus() if len(c[1]) < 4000]
    programs = lowered(small)  # the Runtime's own input: rt.programs to mutate
    sources = {"geopt": corpus() + programs, "gerun": small + programs, "geimport": onnx_models(),
               "gedoctor": small + onnx_models() + programs, "getune": small, "geserve": serve_sources()}
    # repositories with a poisoned entry, for the tools that read one (getune tunes these programs first)
    poisoned = poisoned_repositories(small) if {"geopt", "gerun", "getune"} & {t for t, n in counts.items() if n} else {}
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="geir-fuzz-") as tmp:
        for tool, count in counts.items():
            if not sources[tool]:
                continue
            for case in cases(rng, tool, count, sources[tool], poisoned):
                outcomes.append(run_case(case, Path(tmp)))
    return outcomes


def signature(outcome: Outcome) -> str:
    """What tells two failures apart: the tool and the kind of problem (paths, numbers and names stripped)."""
    problem = re.sub(r"\S*" + re.escape(outcome.case.name), "FILE", outcome.problem or "")
    return f"{outcome.case.tool}: " + re.sub(r"'[^']*'|\d+", "#", problem)[:160]
