"""geopt in-process and as a subprocess: exit codes, -o atomicity, diagnostics with source line and caret."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from geir.tools.geopt import main

from helpers import graph_text

GOOD = graph_text("  %y = ge.neg %x\n  ge.return %y")
CANONICAL = graph_text("  %y = ge.neg %x\n  ge.return %y")
INFERRED = graph_text("  %y = ge.neg %x : tensor<4xf32>\n  ge.return %y")
BAD_LINE = "  %y = ge.add %x, %nope"
BAD = graph_text(BAD_LINE + "\n  ge.return %y")

def write(tmp_path, name: str, data: str | bytes):
    p = tmp_path / name
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data)
    return p

def geopt(argv, capsys):
    """(exit code, stdout, stderr) of an in-process run; argparse's exits count as return codes."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err

def diagnostic_blocks(err: str) -> list[list[str]]:
    """stderr split into (header, source line, caret line) triples."""
    lines = err.rstrip("\n").split("\n")
    assert len(lines) % 3 == 0, err
    return [lines[i:i + 3] for i in range(0, len(lines), 3)]

def check_caret(block: list[str], file: str, line: int, col: int, severity: str, message: str, source: str):
    header, src, caret = block
    assert header == f"{file}:{line}:{col}: {severity}: {message}"
    assert src == source
    assert caret == " " * (col - 1) + "^"

def test_round_trip_by_default(tmp_path, capsys):
    f = write(tmp_path, "a.geir", "// a comment\n" + GOOD.replace("  %y", "\t%y"))
    rc, out, err = geopt([f], capsys)
    assert (rc, out, err) == (0, CANONICAL, "")

def test_passes_and_print_pipeline(tmp_path, capsys):
    f = write(tmp_path, "a.geir", GOOD)
    rc, out, err = geopt([f, "--passes=canonicalize", "--print-pipeline"], capsys)
    assert rc == 0 and out == INFERRED
    assert err.strip() == "infer-shapes,canonicalize"

def test_undefined_value_diagnostic(tmp_path, capsys):
    f = write(tmp_path, "bad.geir", BAD)
    rc, out, err = geopt([f], capsys)
    assert rc == 1 and out == ""
    (block,) = diagnostic_blocks(err)
    check_caret(block, str(f), 2, BAD_LINE.index("%nope") + 1, "error", "use of undefined value '%nope'", BAD_LINE)

def test_redefinition_diagnostic_with_note(tmp_path, capsys):
    lines = ["ge.graph @main(%x: tensor<4xf32>) -> tensor<4xf32> {", "  %x = ge.neg %x", "  ge.return %x", "}"]
    f = write(tmp_path, "r.geir", "\n".join(lines) + "\n")
    rc, _, err = geopt([f], capsys)
    assert rc == 1
    error, note = diagnostic_blocks(err)
    check_caret(error, str(f), 2, 3, "error", "redefinition of value '%x'", lines[1])
    check_caret(note, str(f), 1, 16, "note", "previously defined here", lines[0])

def test_verifier_diagnostic_points_at_the_attribute(tmp_path, capsys):
    line = "  %y = ge.softmax %x {axis = 1.5}"
    f = write(tmp_path, "v.geir", graph_text(line + "\n  ge.return %y"))
    rc, _, err = geopt([f], capsys)
    assert rc == 1
    (block,) = diagnostic_blocks(err)
    check_caret(block, str(f), 2, line.index("axis") + 1, "error",
                "attribute 'axis' must be an integer, not the number 1.5", line)

def test_caret_under_tabs_and_non_ascii(tmp_path, capsys):
    f = write(tmp_path, "t.geir", graph_text("\t%a = ge.neg %x // caf\u00e9\n\t%y = ge.neg %zz\n  ge.return %y"))
    rc, _, err = geopt([f], capsys)
    assert rc == 1
    header, src, caret = diagnostic_blocks(err)[0]
    assert header == f"{f}:3:14: error: use of undefined value '%zz'"
    assert src == "\t%y = ge.neg %zz"
    assert caret == "\t" + " " * 12 + "^"

def test_invalid_utf8_diagnostic(tmp_path, capsys):
    data = GOOD.encode().replace(b"%y = ge.neg %x", b"%y = ge.neg %x // \xe9t\xe9")
    f = write(tmp_path, "u.geir", data)
    rc, out, err = geopt([f], capsys)
    assert rc == 1 and out == ""
    header, src, caret = diagnostic_blocks(err)[0]
    col = len("  %y = ge.neg %x // ") + 1
    assert header == f"{f}:2:{col}: error: input is not valid UTF-8 (byte 0xe9)"
    assert caret == " " * (col - 1) + "^"
    assert src[col - 1] in "\ufffd?"

def test_nul_byte_diagnostic(tmp_path, capsys):
    f = write(tmp_path, "n.geir", GOOD.encode().replace(b"ge.neg", b"ge.n\0g"))
    rc, _, err = geopt([f], capsys)
    assert rc == 1
    header, src, caret = diagnostic_blocks(err)[0]
    col = len("  %y = ge.n") + 1
    assert header == f"{f}:2:{col}: error: unexpected NUL byte"
    assert "\0" not in src and caret == " " * (col - 1) + "^"

def test_empty_input(tmp_path, capsys):
    f = write(tmp_path, "e.geir", "")
    rc, out, err = geopt([f], capsys)
    assert rc == 1 and out == ""
    assert err.startswith(f"{f}:1:1: error: expected a graph")

def test_bad_usage_exits_2(tmp_path, capsys):
    f = write(tmp_path, "a.geir", GOOD)
    rc, out, err = geopt([f, "--no-such-flag"], capsys)
    assert rc == 2 and out == "" and "unrecognized arguments" in err
    rc, out, err = geopt([f, "--passes=cse,bogus"], capsys)
    assert rc == 2 and out == ""
    header, src, caret = diagnostic_blocks(err)[0]
    assert header.startswith("--passes:1:5: error: unknown pass 'bogus'")
    assert src == "cse,bogus" and caret == "    ^"
    rc, _, err = geopt([f, "--passes=cse{nope=1}"], capsys)
    assert rc == 2 and err.startswith("--passes:1:5: error: pass 'cse' has no option 'nope'")
    rc, _, err = geopt([f, "--target=no-such-chip"], capsys)
    assert rc == 2 and "unknown target 'no-such-chip'" in err
    rc, _, err = geopt([f, "--print-ir-after=nope"], capsys)
    assert rc == 2 and "unknown pass 'nope'" in err

def test_missing_input_file(tmp_path, capsys):
    rc, out, err = geopt([tmp_path / "missing.geir"], capsys)
    assert rc == 1 and out == ""
    assert err.startswith("geopt: error: cannot read ") and "missing.geir" in err

def test_output_file_written_on_success(tmp_path, capsys):
    f = write(tmp_path, "a.geir", GOOD)
    out_path = tmp_path / "out.geir"
    rc, out, err = geopt([f, "--passes=infer-shapes", "-o", out_path], capsys)
    assert (rc, out, err) == (0, "", "")
    assert out_path.read_text() == INFERRED
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left

def test_output_file_not_created_on_error(tmp_path, capsys):
    f = write(tmp_path, "bad.geir", BAD)
    out_path = tmp_path / "out.geir"
    rc, _, _ = geopt([f, "-o", out_path], capsys)
    assert rc == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.geir"]

def test_existing_output_untouched_on_error(tmp_path, capsys):
    out_path = write(tmp_path, "out.geir", "previous contents\n")
    before = os.stat(out_path)
    f = write(tmp_path, "bad.geir", graph_text("  %y = ge.matmul %x, %x\n  ge.return %y"))
    rc, _, err = geopt([f, "--passes=infer-shapes", "-o", out_path], capsys)
    assert rc == 1 and "matmul operands need rank 2 or more" in err
    assert out_path.read_text() == "previous contents\n"
    assert os.stat(out_path).st_mtime_ns == before.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.geir", "out.geir"]

def test_existing_output_untouched_when_a_pass_fails(tmp_path, capsys):
    out_path = write(tmp_path, "out.geir", "previous contents\n")
    text = graph_text("  %y = ge.matmul %a, %b\n  ge.return %y", "%a: tensor<4x8xf32>, %b: tensor<9x3xf32>",
                      "tensor<4x3xf32>")
    f = write(tmp_path, "bad.geir", text)
    rc, _, err = geopt([f, "-o", out_path], capsys)
    assert rc == 1 and "matmul contraction dims differ: 8 vs 9" in err
    assert out_path.read_text() == "previous contents\n"

def test_print_ir_after_all(tmp_path, capsys):
    f = write(tmp_path, "a.geir", GOOD)
    rc, out, err = geopt([f, "--passes=infer-shapes,cse", "--print-ir-after-all"], capsys)
    assert rc == 0 and out == INFERRED
    assert err == ("// -----// IR Dump After infer-shapes //----- //\n" + INFERRED +
                   "// -----// IR Dump After cse //----- //\n" + INFERRED)

def test_split_input_file_reports_each_chunk(tmp_path, capsys):
    text = GOOD + "// -----\n" + BAD + "// -----\n" + GOOD
    f = write(tmp_path, "s.geir", text)
    rc, out, err = geopt([f, "--split-input-file"], capsys)
    assert rc == 1
    (block,) = diagnostic_blocks(err)
    bad_line_no = GOOD.count("\n") + 1 + 2
    check_caret(block, str(f), bad_line_no, BAD_LINE.index("%nope") + 1, "error", "use of undefined value '%nope'",
                BAD_LINE)
    assert out == CANONICAL + "// -----\n" + CANONICAL

def test_verify_diagnostics(tmp_path, capsys):
    ok = graph_text("  // expected-error@+1 {{use of undefined value '%nope'}}\n" + BAD_LINE + "\n  ge.return %y")
    f = write(tmp_path, "d.geir", ok)
    rc, _, err = geopt([f, "--verify-diagnostics"], capsys)
    assert (rc, err) == (0, "")
    wrong = ok.replace("@+1", "@+2")
    f = write(tmp_path, "d2.geir", wrong)
    rc, _, err = geopt([f, "--verify-diagnostics"], capsys)
    assert rc == 1 and "unexpected error: use of undefined value '%nope'" in err and "was not produced" in err

def _subprocess(args, stdin: bytes | None = None):
    return subprocess.run([sys.executable, "-m", "geir.tools.geopt", *map(str, args)], input=stdin,
                          capture_output=True, timeout=120)

def test_subprocess_exit_codes_and_streams(tmp_path):
    good = write(tmp_path, "a.geir", GOOD)
    bad = write(tmp_path, "bad.geir", BAD)
    r = _subprocess([good, "--passes=infer-shapes"])
    assert r.returncode == 0 and r.stdout.decode() == INFERRED and r.stderr == b""
    r = _subprocess([bad])
    assert r.returncode == 1 and r.stdout == b""
    err = r.stderr.decode()
    assert "Traceback" not in err
    (block,) = diagnostic_blocks(err)
    check_caret(block, str(bad), 2, BAD_LINE.index("%nope") + 1, "error", "use of undefined value '%nope'", BAD_LINE)
    r = _subprocess([good, "--bogus"])
    assert r.returncode == 2 and b"Traceback" not in r.stderr

def test_subprocess_stdin_and_hostile_strings(tmp_path):
    r = _subprocess(["-"], stdin=GOOD.encode())
    assert r.returncode == 0 and r.stdout.decode() == CANONICAL
    r = _subprocess(["-"], stdin=BAD.encode())
    assert r.returncode == 1 and r.stderr.decode().startswith("<stdin>:2:")
    # an escape that no UTF-8 output could hold is a diagnostic, not a crash while printing
    text = GOOD.replace("-> tensor<4xf32> {", '-> tensor<4xf32> attributes {a = "\\ud800"} {')
    r = _subprocess(["-"], stdin=text.encode())
    assert r.returncode == 1 and b"Traceback" not in r.stderr and b"surrogate" in r.stderr


def test_output_to_a_device_is_written_in_place_not_replaced(tmp_path):
    # -o /dev/null must not rename a temporary file over the device (we may run as root)
    import stat

    from geir.tools.common import write_atomically

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_atomically(str(fifo), "ge.graph\n")
    reader.join(timeout=10)
    assert got == [b"ge.graph\n"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)
