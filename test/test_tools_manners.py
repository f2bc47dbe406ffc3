"""The tools' manners (mlir-opt's) and their files: --version, --help's pass list, --list-targets,
did-you-mean, no traceback, outputs never onto inputs, umask modes, stale temporaries, SIGKILL and
SIGINT, the profile legend, and every command the README shows run as written.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import typing
from importlib import metadata
from pathlib import Path

import attrs
import numpy as np
import pytest

from geir import files
from geir.files import STALE_TEMPORARY_S, current_umask, write_atomically
from geir.passes import PASSES
from geir.runtime.profile import PROFILE_KEYS, format_profile
from geir.target_npu.target import available_targets, load_target
from geir.tools import common, geopt

from helpers import graph_text

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = ROOT / "examples" / "attention.geir"
TOOLS = ("geopt", "gerun", "geimport", "gedoctor", "getune")
GOOD = graph_text("  %y = ge.neg %x\n  ge.return %y")


def tool(name: str, *argv, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a tool as a subprocess (`python -m geir.tools.NAME`), text output."""
    return subprocess.run([sys.executable, "-m", f"geir.tools.{name}", *map(str, argv)], capture_output=True,
                          text=True, cwd=cwd, timeout=300, **kw)


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr


# --- 1. no traceback, ever ----------------------------------------------------------------------------

def test_geopt_turns_an_unexpected_error_into_one_line(tmp_path, capsys, monkeypatch):
    f = tmp_path / "a.geir"
    f.write_text(GOOD)

    def boom(self, module, ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(PASSES["cse"], "run", boom)
    monkeypatch.delenv("GEIR_TRACEBACK", raising=False)
    rc = geopt.main([str(f), "--passes=cse"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert err == "geopt: error: internal error: RuntimeError: boom (set GEIR_TRACEBACK=1 to see where)\n"


def test_geopt_bad_input_is_a_caret_diagnostic_exit_1(tmp_path):
    f = tmp_path / "bad.geir"
    f.write_text(graph_text("  %y = ge.neg %nope\n  ge.return %y"))
    r = tool("geopt", f)
    no_traceback(r)
    assert r.returncode == 1
    header, line, caret = r.stderr.rstrip("\n").split("\n")
    assert header == f"{f}:2:15: error: use of undefined value '%nope'"
    assert caret == " " * 14 + "^" and line == "  %y = ge.neg %nope"


def _expected_errors(case: str) -> list[tuple[int, str]]:
    """(line, message) of each `expected-error` annotation in a split-input-file case, as --verify-diagnostics
    reads it (`@+N` for the line N below, else its own line)."""
    out = []
    for i, line in enumerate(case.split("\n"), 1):
        m = re.search(r"expected-error(?:@\+(\d+))? \{\{(.*)\}\}", line)
        if m:
            out.append((i + int(m[1] or 0), m[2]))
    return out


def _lit_cases(name: str) -> list[str]:
    return (ROOT / "test" / "lit" / "diagnostics" / name).read_text().split("// -----\n")


# rt programs reading a value where it is not; sizes read from a malformed constant or size op (the last
# five cases of sizes.geir): once a KeyError, a TypeError, a ValueError, an IndexError or a MemoryError
BAD_INPUT = _lit_cases("rt.geir") + _lit_cases("sizes.geir")[-5:]


@pytest.mark.parametrize("case", range(len(BAD_INPUT)))
@pytest.mark.parametrize("argv", [("gerun",), ("gerun", "--timing-only"), ("gedoctor",), ("geopt", "--passes=lower")])
def test_bad_input_is_its_diagnostic_in_every_tool(tmp_path, capsys, monkeypatch, case, argv):
    from geir.tools import gedoctor, gerun

    monkeypatch.delenv("GEIR_TRACEBACK", raising=False)
    f = tmp_path / "p.geir"
    f.write_text(BAD_INPUT[case])
    rc = {"gerun": gerun.main, "gedoctor": gedoctor.main, "geopt": geopt.main}[argv[0]]([str(f), *argv[1:]])
    out, err = capsys.readouterr()
    first, message = _expected_errors(BAD_INPUT[case])[0]
    assert rc == 1 and out == "" and "internal error" not in err
    assert err.startswith(f"{f}:{first}:3: error: {message}\n{BAD_INPUT[case].split(chr(10))[first - 1]}\n  ^\n")


ZERO_BLOCK = """rt.program @main(%x: tensor<4xf32>) -> tensor<4xf32> attributes {memory = {inputs = 512, constants = 0, arena = 512}, streams = 1, target = "ascend910b"} {
  %x.dev = rt.h2d %x {offset = 0, stream = 0} : tensor<4xf32>
  %y = rt.launch %x.dev {kernel = "ge.relu", offsets = [512], stream = 0, tiling = {template = "VectorElementwise", elems = 0, buffers = 2, cores = 1, ub_bytes = 512}} : tensor<4xf32>
  %0 = rt.d2h %y {stream = 0} : tensor<4xf32>
  rt.return %0
}
"""


@pytest.mark.parametrize("argv", [(), ("--timing-only",)])
def test_a_tiling_block_of_0_is_refused_when_the_program_loads(tmp_path, capsys, monkeypatch, argv):
    from geir.tools import gerun

    monkeypatch.delenv("GEIR_TRACEBACK", raising=False)
    f = tmp_path / "p.geir"
    f.write_text(ZERO_BLOCK)
    assert gerun.main([str(f), *argv]) == 1  # once a ZeroDivisionError in the kernel
    out, err = capsys.readouterr()
    col = ZERO_BLOCK.splitlines()[2].index("tiling = ") + 1
    line = ZERO_BLOCK.splitlines()[2]
    assert out == "" and err == (f"{f}:3:{col}: error: the tiling of ge.relu: 'elems' is 0, but the launch's tensors "
                                 f"are not empty: a block must hold at least one element\n{line}\n{' ' * (col - 1)}^\n")


def test_a_matmul_walked_m_first_is_not_a_block_of_0(tmp_path):
    # iterate_order 0 is MatMul's M-first order (an LM head's), not an empty block: the program runs
    from geir.session import DEFAULT_PIPELINE, compile_module, run_program
    from geir.parser import parse

    text = ("ge.graph @main(%a: tensor<64x128xf16>, %b: tensor<128x256xf16>) -> tensor<64x256xf16> {\n"
            "  %c = ge.matmul %a, %b : tensor<64x256xf16>\n  ge.return %c\n}\n")
    module, _ = compile_module(parse(text, "m.geir"), DEFAULT_PIPELINE)
    (launch,) = [op for op in module.graphs[0].ops if op.name == "rt.launch"]
    launch.attributes["tiling"] = {**launch.attributes["tiling"], "iterate_order": 0}
    result = run_program(module.graphs[0], {"a": np.ones((64, 128), np.float16), "b": np.ones((128, 256), np.float16)})
    assert np.array_equal(result.outputs[0], np.full((64, 256), 128, np.float16))


# --- 2. mlir-opt's manners ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", TOOLS)
def test_every_tool_has_version(name):
    r = tool(name, "--version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{name} (GEIR) {metadata.version('geir')}\n", "")


def _option_line(name: str, field: attrs.Attribute, hint) -> re.Pattern:
    kind = typing.get_args(hint)[0].__name__ + ",..." if typing.get_origin(hint) is list else hint.__name__
    return re.compile(rf"^ +{re.escape(name.replace('_', '-'))}=<{re.escape(kind)}> +default \S+", re.MULTILINE)


def test_geopt_help_lists_every_pass_with_its_description_and_options():
    r = tool("geopt", "--help")
    assert r.returncode == 0
    for name, cls in PASSES.items():
        first_line = cls.__doc__.strip().split("\n")[0]
        assert re.search(rf"^  {re.escape(name)} +{re.escape(first_line)}$", r.stdout, re.MULTILINE), name
        hints = typing.get_type_hints(cls)
        for field in attrs.fields(cls):
            assert _option_line(field.name, field, hints[field.name]).search(r.stdout), (name, field.name)
    assert re.search(r"^      max-elements=<int> +default 65536$", r.stdout, re.MULTILINE)
    assert re.search(r"^      inplace=<bool> +default true$", r.stdout, re.MULTILINE)
    assert re.search(r"^      rules=<str,\.\.\.> +default empty$", r.stdout, re.MULTILINE)


@pytest.mark.parametrize("name", ["geopt", "gerun", "gedoctor"])
def test_list_targets_prints_every_bundled_target_and_exits_0(name):
    r = tool(name, "--list-targets")  # gerun and gedoctor need no FILE for it
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.rstrip("\n").split("\n")
    assert [line.split()[0] for line in lines] == available_targets()
    for line in lines:
        t = load_target(line.split()[0])
        assert f"{t.cube_cores} cube cores" in line and f"{t.vector_cores} vector cores" in line
        assert f"{t.clock_hz / 1e9:.2f} GHz" in line


@pytest.mark.parametrize("name", ["geopt", "gerun"])
def test_an_unknown_pass_gets_did_you_mean_with_the_caret_under_it(name):
    r = tool(name, ATTENTION, "--passes=cse,fsue")
    no_traceback(r)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "--passes:1:5: error: unknown pass 'fsue'; did you mean 'fuse'?\ncse,fsue\n    ^\n"


def test_an_unknown_option_gets_did_you_mean():
    r = tool("geopt", ATTENTION, "--passes=plan{alignmnt=64}")
    assert r.returncode == 2
    assert r.stderr.split("\n")[:3] == ["--passes:1:6: error: pass 'plan' has no option 'alignmnt'; did you mean "
                                        "'alignment'?", "plan{alignmnt=64}", "     ^"]


def test_a_name_far_from_every_pass_lists_them():
    r = tool("geopt", ATTENTION, "--passes=zzzzzz")
    assert r.returncode == 2 and "unknown pass 'zzzzzz' (known passes: canonicalize, " in r.stderr


@pytest.mark.parametrize("name", ["geopt", "gerun", "gedoctor", "getune"])
def test_an_unknown_target_gets_did_you_mean(name):
    r = tool(name, ATTENTION, "--target", "ascend91b")
    no_traceback(r)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"{name}: error: unknown target 'ascend91b'; did you mean 'ascend910b'?\n"
    r = tool(name, ATTENTION, "--target", "xyz")
    assert r.returncode == 2 and "unknown target 'xyz' (available: ascend310p, ascend910a, ascend910b)" in r.stderr


def _profile() -> dict:
    figures = {key: 0.25 for key in PROFILE_KEYS}
    figures.update(gm_read_bytes=3 * 2**20, gm_write_bytes=2**20, hbm_read_bytes=2**20, hbm_write_bytes=2**20,
                   plan_cache={"hits": 0, "misses": 1, "replan_ms": 0.0}, faults=[])
    kernel = {key: 0.5 for key in PROFILE_KEYS if key not in ("kernels", "plan_cache", "faults")}
    figures["kernels"] = [dict(kernel, name="ge.flash_attention", time_us=1.0, cores=8)]
    return figures


def test_every_figure_of_the_profile_has_its_key_and_a_legend():
    text = format_profile(_profile())
    for key in PROFILE_KEYS:
        if key in ("kernels", "plan_cache", "faults"):
            continue
        m = re.search(rf"^{key} +\S+ {{3}}(\S.*)$", text, re.MULTILINE)
        assert m, key
        assert len(m.group(1)) >= 10, key  # a definition, not a bare unit
    # the figures say what they are, never a verdict a number could contradict
    assert "hidden under compute" not in text
    assert "overlapped share of the shorter of MTE2 (data in) and compute time" in text
    # the kernel table's short column names are tied to the keys
    assert "overlap = overlap_ratio, mem_bnd = memory_bound" in text and "peak% = 100 x cube_peak_fraction" in text


def test_gerun_profile_prints_the_legend():
    r = tool("gerun", ATTENTION, "--profile")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^overlap_ratio +0\.\d\d   overlapped share of the shorter", r.stdout, re.MULTILINE)
    assert re.search(r"^simulated_time_us +\d+\.\d\d   the device's span", r.stdout, re.MULTILINE)
    # where the time went comes first, in the spec's order
    keys = re.findall(r"^(\w+_us) ", r.stdout, re.MULTILINE)
    assert keys == ["simulated_time_us", "kernel_time_us", "transfer_time_us", "host_ge_us", "end_to_end_us",
                    "device_idle_us"]


def test_gerun_profile_says_when_faults_were_injected_and_rolls_kernels_up_by_op_type(tmp_path):
    import json
    from collections import defaultdict

    clean = tool("gerun", ROOT / "examples" / "gpt2_block.geir", "--no-fuse", "--profile")
    assert clean.returncode == 0, clean.stderr
    assert "FAULTS INJECTED" not in clean.stdout
    r = tool("gerun", ROOT / "examples" / "gpt2_block.geir", "--no-fuse", "--profile", "--profile-json",
             tmp_path / "p.json", "--inject-fault", "core@3", "--inject-fault", "dma@1")
    assert r.returncode == 0, r.stderr
    p = json.loads((tmp_path / "p.json").read_text())
    text = r.stdout[r.stdout.index("FAULTS INJECTED"):]
    assert text.startswith("FAULTS INJECTED: 2, recovered; every figure below includes the recovery\n")
    assert "  core@3 on ge.reduce_mean (" in text and "  dma@1 on copy out (" in text
    # the rollup, recomputed from the JSON's kernels (the same run) by hand
    times = defaultdict(list)
    for k in p["kernels"]:
        times[k["name"]].append(k["time_us"])
    total = sum(map(sum, times.values()))
    rollup = text[text.index("per op type"):text.index("top 10 of")].splitlines()[2:-1]
    assert [line.split()[0] for line in rollup] == sorted(times, key=lambda n: (-sum(times[n]), n))
    for line in rollup:
        name, count, tot, avg, lo, hi, share, engine = line.split()
        t = times[name]
        assert int(count) == len(t) and engine == "aicore"
        assert [float(tot), float(avg), float(lo), float(hi)] == pytest.approx(
            [sum(t), sum(t) / len(t), min(t), max(t)], abs=0.006)
        assert float(share) == pytest.approx(100 * sum(t) / total, abs=0.06)
    top = text[text.index("top 10 of"):].splitlines()[2:]
    order = sorted(range(len(p["kernels"])), key=lambda i: (-p["kernels"][i]["time_us"], i))[:10]
    assert [int(line.split()[0]) for line in top] == order
    assert float(top[-1].split()[-1]) == pytest.approx(
        100 * sum(p["kernels"][i]["time_us"] for i in order) / total, abs=0.11)


# --- 3. files: outputs never onto inputs -----------------------------------------------------------------

@pytest.fixture
def graph_with_weights(tmp_path):
    """A copy of the GPT-2 block and its weights archive beside it (gerun reads both)."""
    for name in ("gpt2_block.geir", "gpt2_block.npz"):
        shutil.copy(ROOT / "examples" / name, tmp_path / name)
    return tmp_path / "gpt2_block.geir"


def _refused(r: subprocess.CompletedProcess, *flags: str) -> None:
    no_traceback(r)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    (line,) = r.stderr.rstrip("\n").split("\n")
    assert "are the same file" in line
    for flag in flags:
        assert flag in line, (flag, line)


@pytest.mark.parametrize("argv, flags", [
    (["--output", "{geir}"], ["--output", "FILE"]),
    (["-o", "{npz}"], ["--output", "the weights archive beside FILE"]),
    (["--trace", "{dir}/./gpt2_block.geir"], ["--trace", "FILE"]),
    (["--weights", "{dir}/w2.npz", "--timeline", "{dir}/w2.npz"], ["--timeline", "--weights"]),
    (["--inputs", "{dir}/in.npz", "-o", "{dir}/in.npz"], ["--output", "--inputs"]),
    (["--trace", "{dir}/t.json", "--profile-json", "{dir}/t.json"], ["--trace", "--profile-json"]),
])
def test_gerun_refuses_an_output_onto_an_input_or_another_output(graph_with_weights, argv, flags):
    d = graph_with_weights.parent
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    argv = [a.format(geir=graph_with_weights, npz=d / "gpt2_block.npz", dir=d) for a in argv]
    r = tool("gerun", graph_with_weights, *argv)
    _refused(r, *flags)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # nothing written, nothing touched


def test_outputs_are_refused_before_any_work(tmp_path):
    # the input does not even parse: the refusal (2) comes before the diagnostic (1)
    bad = tmp_path / "bad.geir"
    bad.write_text("not GEIR\n")
    _refused(tool("gerun", bad, "-o", bad), "--output", "FILE")
    _refused(tool("geopt", bad, "-o", bad), "-o", "FILE")
    assert bad.read_text() == "not GEIR\n"


def test_links_count_as_the_file_they_name(tmp_path):
    f = tmp_path / "a.geir"
    f.write_text(GOOD)
    (tmp_path / "sym.geir").symlink_to(f)
    os.link(f, tmp_path / "hard.geir")
    _refused(tool("geopt", f, "-o", tmp_path / "sym.geir"), "-o", "FILE")
    _refused(tool("geopt", f, "--dot", tmp_path / "hard.geir"), "--dot", "FILE")
    _refused(tool("geopt", f, "-o", tmp_path / "out.geir", "--dot", tmp_path / "sub" / ".." / "out.geir"),
             "-o", "--dot")
    assert f.read_text() == GOOD and not (tmp_path / "out.geir").exists()


def test_geimport_refuses_to_write_over_its_model(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not really onnx")
    _refused(tool("geimport", model, "-o", model), "-o", "MODEL.onnx")
    assert model.read_bytes() == b"not really onnx"


def test_devices_are_no_files_to_protect(tmp_path):
    f = tmp_path / "a.geir"
    f.write_text(GOOD)
    r = tool("geopt", f, "-o", os.devnull, "--dot", os.devnull)
    assert r.returncode == 0, r.stderr


# --- 3. files: modes, stale temporaries ------------------------------------------------------------------

def test_current_umask_reads_the_umask_without_changing_it():
    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        assert current_umask() == 0o027
    finally:
        os.umask(old)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_outputs_get_the_mode_the_umask_gives(tmp_path, umask):
    f = tmp_path / "a.geir"
    f.write_text(GOOD)
    out, dot = tmp_path / "out.geir", tmp_path / "out.dot"
    r = tool("geopt", f, "-o", out, "--dot", dot, preexec_fn=lambda: os.umask(umask))
    assert r.returncode == 0, r.stderr
    for p in (out, dot):
        assert p.stat().st_mode & 0o777 == 0o666 & ~umask, (p, oct(p.stat().st_mode))


def _temporaries(folder: Path, name: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(f".{name}."))


def test_the_next_write_removes_stale_temporaries_of_its_own_target_only(tmp_path):
    old = time.time() - STALE_TEMPORARY_S - 60
    stale = tmp_path / ".out.geir.abcd_123"
    young = tmp_path / ".out.geir.efgh5678"
    other = tmp_path / ".other.geir.abcd1234"  # another target's
    unlike = tmp_path / ".out.geir.swp"  # not mkstemp's pattern
    for p in (stale, young, other, unlike):
        p.write_text("partial")
        if p is not young:
            os.utime(p, (old, old))
    write_atomically(str(tmp_path / "out.geir"), "done\n")
    assert (tmp_path / "out.geir").read_text() == "done\n"
    assert not stale.exists()
    assert young.exists() and other.exists() and unlike.exists()


def test_several_files_are_written_all_or_none_and_a_failed_rename_puts_back_what_was_there(tmp_path, monkeypatch):
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    a.write_text("old a")
    b.write_text("old b")
    real_replace = os.replace

    def fail_on_c(src, dst, *args, **kw):
        if Path(dst) == c:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst, *args, **kw)

    monkeypatch.setattr(os, "replace", fail_on_c)
    with pytest.raises(files.ToolError, match="cannot write '.*c.txt': No space left on device"):
        files.write_all_atomically([(str(a), "new a"), (str(b), b"new b"), (str(c), "new c")])
    # a and b were renamed over before c failed: both have their old contents back, c never appeared
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt"]
    assert a.read_text() == "old a" and b.read_text() == "old b"
    monkeypatch.setattr(os, "replace", real_replace)
    files.write_all_atomically([(str(a), "new a"), (str(b), b"new b"), (str(c), "new c")])
    assert [p.read_text() for p in (a, b, c)] == ["new a", "new b", "new c"]
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "c.txt"]  # no temporary, no kept link left


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_device_that_cannot_be_written_replaces_no_file(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("keep")
    with pytest.raises(files.ToolError, match="cannot write '/dev/full'"):
        files.write_all_atomically([(str(keep), "new"), ("/dev/full", "x" * 100_000)])
    assert keep.read_text() == "keep" and os.listdir(tmp_path) == ["keep.txt"]


@pytest.mark.parametrize("name, argv, flag", [
    ("gerun", [ATTENTION, "-o", "{dir}/ok.npz", "--trace", "{dir}/no/such/t.json"], "--trace"),
    ("gerun", [ATTENTION, "--profile-json", "{dir}"], "--profile-json"),
    ("geopt", ["{dir}/a.geir", "-o", "{dir}/ok.geir", "--dot", "{dir}/a.geir/x.dot"], "--dot"),
    ("geimport", ["{dir}/m.onnx", "-o", "{dir}/no/m.geir"], "-o"),
])
def test_an_output_that_cannot_be_written_is_an_error_before_any_work(tmp_path, name, argv, flag):
    (tmp_path / "a.geir").write_text(GOOD)
    (tmp_path / "m.onnx").write_bytes(b"not read: the output is checked first")
    r = tool(name, *[str(a).format(dir=tmp_path) for a in argv])
    no_traceback(r)
    assert r.returncode == 1 and r.stdout == ""  # nothing ran: no result line, no import error
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"{name}: error: cannot write {flag} '{tmp_path}") and ": " in line[len(name) + 9:]
    assert sorted(os.listdir(tmp_path)) == ["a.geir", "m.onnx"]


# --- 3. files: SIGKILL and SIGINT ------------------------------------------------------------------------

# Runs a tool's main with one function wrapped: after (or instead of) it, the process says so in
# READY and waits to be signalled. SIGINT raises KeyboardInterrupt as in a terminal, even where the
# test runner's parent ignores it.
HARNESS = """
import importlib, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
module_name, attr, when, ready, *argv = sys.argv[1:]
module = importlib.import_module(module_name)
original = getattr(module, attr)

def stop(*args, **kwargs):
    if when == "after":
        original(*args, **kwargs)
    open(ready, "w").close()
    time.sleep(120)
    return original(*args, **kwargs)

setattr(module, attr, stop)
tool = importlib.import_module("geir.tools." + os.environ["GEIR_TOOL"])
sys.exit(tool.main(argv))
"""


def _start(tmp_path: Path, tool_name: str, module: str, attr: str, when: str, *argv) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, "-c", HARNESS, module, attr, when, str(ready), *map(str, argv)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, GEIR_TOOL=tool_name))
    deadline = time.time() + 120
    while not ready.exists():
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline, "the tool never reached the point to signal"
        time.sleep(0.05)
    return p, ready


def test_sigkill_while_writing_leaves_no_partial_file_and_the_next_run_cleans_up(tmp_path):
    f = tmp_path / "a.geir"
    f.write_text(GOOD)
    out = tmp_path / "out.geir"
    out.write_text("old contents\n")
    # killed between writing the temporary and renaming it: the worst moment
    p, _ = _start(tmp_path, "geopt", "os", "replace", "before", f, "-o", out)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert out.read_text() == "old contents\n"  # the old file, whole
    (left,) = _temporaries(tmp_path, "out.geir")
    assert re.fullmatch(r"\.out\.geir\.[a-z0-9_]{8}", left)
    # a fresh temporary may be another run's: kept; once old, the next run removes it
    r = tool("geopt", f, "-o", out)
    assert r.returncode == 0 and _temporaries(tmp_path, "out.geir") == [left]
    old = time.time() - STALE_TEMPORARY_S - 5
    os.utime(tmp_path / left, (old, old))
    r = tool("geopt", f, "-o", out)
    assert r.returncode == 0 and _temporaries(tmp_path, "out.geir") == []
    assert out.read_text() == GOOD


def test_sigint_after_the_output_is_written_exits_130_with_one_line(tmp_path):
    f = tmp_path / "a.geir"
    f.write_text(GOOD)
    out = tmp_path / "out.geir"
    p, _ = _start(tmp_path, "geopt", "geir.tools.geopt", "write_all_atomically", "after", f, "-o", out)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=60)
    assert (p.returncode, stdout, stderr) == (130, "", "geopt: interrupted\n")
    assert out.read_text() == GOOD and _temporaries(tmp_path, "out.geir") == []


def test_sigint_during_a_gerun_run_writes_nothing(tmp_path):
    out = tmp_path / "out.npz"
    p, _ = _start(tmp_path, "gerun", "geir.tools.gerun", "run_once", "before", ATTENTION, "-o", out)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=60)
    assert (p.returncode, stderr) == (130, "gerun: interrupted\n")
    assert sorted(os.listdir(tmp_path)) == ["ready"]


def test_run_tool_maps_keyboard_interrupt_to_130(capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    assert common.run_tool("gerun", interrupted, None) == 130
    assert capsys.readouterr().err == "gerun: interrupted\n"


# --- 2. every command the README shows runs ----------------------------------------------------------------

README = ROOT / "README.md"
BIN = Path(sys.executable).parent
# what a README command needs that a fresh clone with the test extras may lack
NEEDS = [
    (re.compile(r"\.onnx\b|\bmodel\.geir\b"), "onnx", "the onnx extra"),
    (re.compile(r"\bgetune\b(?!.*--workers 0)"), "ray", "the tune extra"),
]


def readme_commands() -> list[str]:
    """Every command line of the README's ```sh blocks, continuations joined, comment lines left out."""
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").split("\n"):
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def runnable(command: str) -> tuple[str | None, str]:
    """(the command to run, or None to skip it; why it is changed or skipped).

    Installing is left out (this is the installed environment, and there is no network), and so
    is running the test suite inside itself; `.venv/bin/` is this environment's bin folder.
    """
    steps = [s.strip() for s in command.split(" && ")]
    kept = [s for s in steps if not (s.startswith("python3 -m venv") or "pip install" in s or s.endswith("/pytest")
                                     or s == "pytest")]
    if not kept:
        return None, "installs and runs the test suite"
    if kept[0].startswith("dot ") and shutil.which("dot") is None:
        return None, "Graphviz's dot is not installed"
    for pattern, module, what in NEEDS:
        if pattern.search(command):
            try:
                __import__(module)
            except ImportError:
                return None, f"needs {what}"
    return " && ".join(s.replace(".venv/bin/", f"{BIN}/") for s in kept), ""


COMMANDS = readme_commands()


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory) -> dict[int, subprocess.CompletedProcess | str]:
    """Every README command run in order, in a copy of the repository's files (a fresh clone's)."""
    clone = tmp_path_factory.mktemp("clone")
    scratch = tmp_path_factory.mktemp("scratch")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True)
    for name in listed.stdout.decode().split("\0") if listed.returncode == 0 else []:
        if name and (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    if listed.returncode != 0:  # no git: the tree without the environment and build outputs
        shutil.copytree(ROOT, clone, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build"))
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # as in an activated venv
    results: dict[int, subprocess.CompletedProcess | str] = {}
    for i, command in enumerate(COMMANDS):
        # scratch files the README puts under /tmp go to this test's own folder: runs in parallel must not
        # share (replaced in the README's words only: this environment itself may live under /tmp)
        run, why = runnable(command.replace("/tmp/", f"{scratch}/"))
        if run is None:
            results[i] = why
            continue
        results[i] = subprocess.run(["bash", "-c", run], cwd=clone, env=env, capture_output=True, text=True,
                                    timeout=600)
    return results


def _uses_a_tool(command: str) -> bool:
    return any(re.search(rf"(^|[\s/]){name} ", command) for name in TOOLS)


def test_every_tool_command_of_the_readme_runs():
    assert all(any(re.search(rf"(^|[\s/]){name} ", c) for c in COMMANDS) for name in TOOLS)
    for command in filter(_uses_a_tool, COMMANDS):
        run, why = runnable(command)
        assert run is not None or why.startswith("needs the"), (command, why)  # only a missing extra skips one


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[c[:70] for c in COMMANDS])
def test_readme_command_runs_as_written(readme_runs, index):
    result = readme_runs[index]
    if isinstance(result, str):
        pytest.skip(result)
    no_traceback(result)
    assert result.returncode == 0, f"$ {shlex.quote(COMMANDS[index])}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
