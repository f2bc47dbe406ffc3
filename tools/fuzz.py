"""A fuzz harness for the command-line tools: mutated programs and models in, the tools' manners checked.

Each case mutates a program from the corpus (examples/ and test/lit/ .geir files, small ONNX models
made here), runs geopt, gerun or geimport in-process on it and checks what any input must give: an
exit code of 0, 1 or 2, no Python traceback, no "internal error", and every `FILE:LINE:COL:`
diagnostic about the input pointing inside it. `test/test_fuzz.py` runs a bounded campaign in
the suite; `bench/fuzz.py` runs long ones and prints the distinct reproducers.
"""

from __future__ import annotations

import contextlib
import io
import random
import re
import signal
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import attrs

REPO = Path(__file__).resolve().parent.parent
# fragments a mutation splices in: the IR's own tokens, and values at the edges of what it takes
TOKENS = [
    b"tensor<", b">", b"x", b"?", b"{", b"}", b"[", b"]", b"(", b")", b",", b":", b"=", b"%", b"@", b"\"", b"//",
    b"dense<", b"dense_resource<\"w\">", b"ge.", b"rt.", b"f16", b"bf16", b"f32", b"f64", b"i1", b"i64", b"NZ",
    b"0", b"-1", b"1e999", b"-inf", b"nan", b"9" * 30, b"9" * 5000, b"65536", b"2147483648", b"[" * 40, b"]" * 40,
    b"1x" * 70, b"true", b"ge.return", b"ge.graph @main() -> () {", b"\x00", b"\xff", "é".encode(), b"\n", b" ",
]
GERUN_SECONDS = 20  # a mutated run that simulates for longer is dropped (counted as slow), not failed


@attrs.frozen
class Case:
    """One fuzz input: which tool, the file's name and bytes, and the extra arguments."""

    tool: str
    name: str
    data: bytes
    args: tuple[str, ...] = ()


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


def mutate(data: bytes, rng: random.Random) -> bytes:
    """A few random edits: bytes flipped, inserted or deleted, tokens spliced in, lines dropped or doubled."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(9)
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
        else:  # a token of the program is repeated
            words = list(re.finditer(rb"[A-Za-z_.%@0-9]+", bytes(out)))
            if words:
                m = rng.choice(words)
                out[at:at] = bytes(out[m.start():m.end()])
    return bytes(out)


def onnx_models() -> list[tuple[str, bytes]]:
    """Small ONNX models made with onnx's helper (empty when onnx is not installed)."""
    try:
        import numpy as np
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return []
    f = TensorProto.FLOAT
    w = numpy_helper.from_array(np.arange(32, dtype=np.float32).reshape(4, 8) / 32, "w")
    graphs = {
        "matmul_add": helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "g",
            [helper.make_tensor_value_info("x", f, [2, 4])], [helper.make_tensor_value_info("z", f, [2, 8])], [w]),
        "softmax": helper.make_graph(
            [helper.make_node("Softmax", ["x"], ["y"], axis=-1), helper.make_node("Transpose", ["y"], ["z"], perm=[1, 0])],
            "g", [helper.make_tensor_value_info("x", f, [3, 5])], [helper.make_tensor_value_info("z", f, [5, 3])]),
    }
    out = []
    for name, g in graphs.items():
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        out.append((f"{name}.onnx", model.SerializeToString()))
    return out


def cases(rng: random.Random, tool: str, count: int, sources: list[tuple[str, bytes]]) -> Iterator[Case]:
    """`count` mutated cases for one tool."""
    args = {"geopt": [(), ("--passes=canonicalize,fuse,layout,tile,plan",), ("--passes=lower",), ("--explain",)],
            "gerun": [("--check",), ("--no-fuse",), ("--profile",)], "geimport": [()]}[tool]
    for _ in range(count):
        name, data = rng.choice(sources)
        yield Case(tool, Path(name).name, mutate(data, rng), rng.choice(args))


def _tool_main(tool: str) -> Callable[[list[str]], int]:
    from geir.tools import geimport, geopt, gerun

    return {"geopt": geopt.main, "gerun": gerun.main, "geimport": geimport.main}[tool]


class _Slow(BaseException):
    """The alarm of a run that simulates too long (a BaseException, so that the tools' wrapper lets it through)."""


def run_case(case: Case, workdir: Path) -> Outcome:
    """Run one case in-process in `workdir` and judge the tool's behaviour."""
    src = workdir / case.name
    src.write_bytes(case.data)
    argv = [str(src), *case.args]
    if case.tool == "geimport":
        argv += ["-o", str(workdir / "out.geir")]
    err, out = io.StringIO(), io.StringIO()
    slow = False
    previous = signal.signal(signal.SIGALRM, _raise_slow) if case.tool == "gerun" else None
    if previous is not None:
        signal.alarm(GERUN_SECONDS)
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
    sources = {"geopt": corpus(), "gerun": [c for c in corpus() if len(c[1]) < 4000], "geimport": onnx_models()}
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="geir-fuzz-") as tmp:
        for tool, count in counts.items():
            if not sources[tool]:
                continue
            for case in cases(rng, tool, count, sources[tool]):
                outcomes.append(run_case(case, Path(tmp)))
    return outcomes


def signature(outcome: Outcome) -> str:
    """What tells two failures apart: the tool and the kind of problem (numbers and names stripped)."""
    return f"{outcome.case.tool}: " + re.sub(r"'[^']*'|\d+", "#", outcome.problem or "")[:160]
