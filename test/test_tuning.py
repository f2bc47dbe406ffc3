"""getune and the tuning repository: candidates timed, the best checked and kept, tile{db=DB} consulting it.

Oracles: a brute-force minimum over every candidate the kernel offers, the full (numerics) run's timing
of the same launch, the slice of the whole op's results that a check instance must reproduce bit for
bit, the counts of candidates (a resumed run times none again), and the physics of the chip (less HBM
bandwidth never makes a graph faster).
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3

import numpy as np
import pytest

from geir.kernels import KERNELS, LaunchContext
from geir.kernels.base import flops_of, measure
from geir.kernels.tiling import OpSignature
from geir.parser import parse
from geir.passes import PassContext, PassManager, PipelineError, complete_pipeline, parse_pipeline
from geir.passes.tuning_repository import Entry, RepositoryError, TuningRepository, target_key
from geir.runtime.single_launch import check_numerics, launch_us, op_of, time_launch
from geir.session.executors import InProcess
from geir.session.tuning import Point, ops_to_tune, tune
from geir.target_npu import load_target
from geir.target_npu.sim import Cores, GlobalMemory
from geir.tools.getune import main as getune_main
from geir.types import DType, TensorType

F16 = DType.f16


def t(*shape: int, dtype: DType = F16) -> TensorType:
    return TensorType(shape, dtype)


GRAPH = """ge.graph @main(%x: tensor<128x256xf16>, %w: tensor<256x256xf16>, %a: tensor<48x4096xf16>) -> (tensor<128x256xf16>, tensor<48x4096xf16>) {
  %y = ge.matmul %x, %w : tensor<128x256xf16>
  %e = ge.exp %a : tensor<48x4096xf16>
  ge.return %y, %e
}
"""


@pytest.fixture
def repo(tmp_path):
    with TuningRepository(tmp_path / "tuning.sqlite", create=True) as r:
        yield r


def _tile(text: str, db: str, target: str = "ascend910b"):
    module = parse(text)
    ctx = PassContext(target=target)
    assert PassManager(complete_pipeline(parse_pipeline(f"tile{{db={db}}}" if db else "tile"))).run(module, ctx)
    return module.graphs[0]


# --- timing -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [
    OpSignature("ge.matmul", (t(200, 256), t(256, 300)), (t(200, 300),), {}),
    OpSignature("ge.flash_attention", (t(1, 2, 256, 64), t(1, 2, 256, 64), t(1, 2, 256, 64)), (t(1, 2, 256, 64),),
                {"causal": True}),
    OpSignature("ge.softmax", (t(64, 1000),), (t(64, 1000),), {"axis": -1}),
])
def test_a_timing_only_launch_times_exactly_as_the_full_run(sig):
    chip = load_target("ascend910b")
    kernel = KERNELS[sig.name]
    rng = np.random.default_rng(0)
    for tiling in kernel.candidates(sig, chip)[::3]:
        op = op_of(sig)
        ctx = LaunchContext(chip, Cores(chip.cube_cores), GlobalMemory(chip), ["arg0", "arg1", "arg2"][:len(sig.operands)],
                            ["out0"])
        inputs = [rng.standard_normal(x.shape).astype(x.dtype.np) for x in sig.operands]
        _, full = measure(ctx, sig.name, tiling, flops_of(op), lambda: kernel.run(op, inputs, tiling, ctx))
        quick = time_launch(sig, tiling, chip)
        assert (quick.cycles, quick.busy, quick.gm_read_bytes) == (full.cycles, full.busy, full.gm_read_bytes)


@pytest.mark.parametrize("target", ["ascend910b", "ascend910a", "ascend310p"])
def test_the_best_is_the_fastest_of_every_candidate_and_never_slower_than_the_rules(tmp_path, target):
    with TuningRepository(tmp_path / "db.sqlite", create=True) as repo:
        report = tune(GRAPH, [Point(target)], InProcess(), repo, graph_times=False)
    chip = load_target(target)
    assert {o.op.sig.name for o in report.ops} >= {"ge.matmul", "ge.exp"}  # and TransData where layout put it
    for o in report.ops:
        kernel = KERNELS[o.op.sig.name]
        times = {json.dumps(c.to_attr()): launch_us(o.op.sig, c, chip) for c in kernel.candidates(o.op.sig, chip)}
        rules = launch_us(o.op.sig, kernel.choose(o.op.sig, chip), chip)
        assert o.rules_us == rules
        assert o.best_us == min(min(times.values()), rules) and o.best_us <= o.rules_us


def test_a_second_run_times_nothing_again(repo):
    first = tune(GRAPH, [Point("ascend910b")], InProcess(), repo, graph_times=False)
    chip = load_target("ascend910b")
    expected = sum(len({json.dumps(c.to_attr()) for c in KERNELS[o.op.sig.name].candidates(o.op.sig, chip)}
                       | {json.dumps(o.op.rules.to_attr())}) for o in first.ops)
    assert first.timed == repo.measurement_count() == expected
    second = tune(GRAPH, [Point("ascend910b")], InProcess(), repo, graph_times=False)
    assert second.timed == 0 and repo.measurement_count() == expected
    assert [(o.best.to_attr(), o.best_us) for o in second.ops] == [(o.best.to_attr(), o.best_us) for o in first.ops]


def test_the_graph_runs_faster_with_the_tuned_tilings(repo):
    report = tune(GRAPH, [Point("ascend910b")], InProcess(), repo)
    (graph,) = report.graphs
    # the matmul has a faster candidate at this shape (the exp's rule is already the best: UB-sized tiles on the
    # units worth their head); nothing is slower
    assert all(o.best_us <= o.rules_us for o in report.ops)
    assert [o.op.sig.name for o in report.ops if o.best_us < o.rules_us] == ["ge.matmul"]
    assert graph.best_us < graph.rules_us


# --- the tile pass consults the repository ------------------------------------------------------------

ONE_MATMUL = """ge.graph @main(%x: tensor<128x256xf16>, %w: tensor<256x256xf16>) -> tensor<128x256xf16> {
  %y = ge.matmul %x, %w : tensor<128x256xf16>
  ge.return %y
}
"""


def _entry_case(repo, change):
    """A hand-written entry for ONE_MATMUL's op, then the tile pass's tiling and remark with the repository."""
    chip = load_target("ascend910b")
    op = _tile(ONE_MATMUL, "").ops[0]
    sig = OpSignature.of(op)
    kernel = KERNELS[sig.name]
    rules = kernel.choose(sig, chip)
    other = next(c for c in kernel.candidates(sig, chip) if c.to_attr() != rules.to_attr())
    entry = change(Entry(sig.name, rules.to_attr(), 10.0, other.to_attr(), 5.0, 7, "checked"), other)
    repo.store(sig, 2, target_key(chip), entry)
    module = parse(ONE_MATMUL)
    remarks = []
    ctx = PassContext(target="ascend910b", explain=True)
    ctx.diagnostics.handler = remarks.append
    assert PassManager(complete_pipeline(parse_pipeline(f"tile{{db={repo.path}}}"))).run(module, ctx)
    tiled = module.graphs[0].ops[0].attributes["tiling"]
    return tiled, rules.to_attr(), other.to_attr(), " ".join(d.message for d in remarks)


def test_an_entry_that_beats_the_rules_is_used(repo):
    tiled, rules, other, remark = _entry_case(repo, lambda e, o: e)
    assert tiled == other != rules
    assert "from the tuning repository: 5.00 us against the rules'" in remark and "(2.00x, best of 7" in remark


def test_an_entry_slower_than_the_rules_is_never_used(repo):
    import attrs

    tiled, rules, _, remark = _entry_case(repo, lambda e, o: attrs.evolve(e, time_us=12.0))
    assert tiled == rules and "found nothing faster in 7 candidates" in remark


def test_an_entry_measured_against_other_rules_is_not_used(repo):
    import attrs

    tiled, rules, _, remark = _entry_case(repo, lambda e, o: attrs.evolve(e, rules_tiling={**e.rules_tiling, "k": 16}))
    assert tiled == rules and "measured against other rules" in remark and "run getune again" in remark


def test_an_entry_of_another_cost_model_is_not_used_and_its_times_not_reused(repo):
    import attrs

    tiled, rules, _, remark = _entry_case(repo, lambda e, o: attrs.evolve(e, model="0123456789ab"))
    assert tiled == rules and "measured by another version of the cost model (0123456789ab)" in remark
    with sqlite3.connect(repo.path) as db:
        db.execute("INSERT INTO measurements VALUES ('k', 't', '0123456789ab', '{}', 1.0)")
    repo.record("k", "t", [('{"a": 1}', 2.0)])
    assert repo.measured("k", "t") == {'{"a": 1}': 2.0}  # the other version's time is not offered


def test_an_entry_that_does_not_fit_the_chip_is_not_used(repo):
    import attrs

    big = {"base_m": 4096, "base_n": 4096, "base_k": 4096, "single_core_m": 4096, "single_core_n": 4096}
    huge = lambda e, o: attrs.evolve(e, tiling={**o.to_attr(), **big})  # noqa: E731
    tiled, rules, other, remark = _entry_case(repo, huge)
    # L1 holds depth_a1 k slices of A (4096 x 4096) and depth_b1 of B, in f16
    need = (other["depth_a1"] + other["depth_b1"]) * 4096 * 4096 * 2
    assert tiled == rules and f"needs {need} bytes of L1, which holds 524288" in remark


def test_a_missing_or_foreign_repository_is_a_usage_error(tmp_path):
    with pytest.raises(PipelineError, match="option 'db': no tuning repository at"):
        parse_pipeline(f"tile{{db={tmp_path / 'none.sqlite'}}}")
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(RepositoryError, match="is not a tuning repository"):
        TuningRepository(junk)


# --- numerics -------------------------------------------------------------------------------------------

def _kernel_on(sig, tiling, inputs):
    chip = load_target("ascend910b")
    op = op_of(sig)
    ctx = LaunchContext(chip, Cores(chip.cube_cores), GlobalMemory(chip), [f"arg{i}" for i in range(len(inputs))],
                        ["out0"])
    return KERNELS[sig.name].run(op, inputs, tiling, ctx)[0]


@pytest.mark.parametrize("sig, cut, ulps", [
    # a batched matmul: one batch, two base blocks of rows and columns. Each k block's dot product is
    # numpy's (BLAS's) own, whose internal order may differ with the matrices' sizes: one rounding step apart
    (OpSignature("ge.matmul", (t(3, 300, 512), t(3, 512, 700)), (t(3, 300, 700),), {}),
     lambda out, small: out[:1, :small.shape[1], :small.shape[2]], 1),
    # grouped-query attention: one batch, one K/V head and the query heads that share it
    (OpSignature("ge.flash_attention", (t(2, 4, 300, 64), t(2, 2, 300, 64), t(2, 2, 300, 64)), (t(2, 4, 300, 64),),
                 {"causal": True}),
     lambda out, small: out[:1, :small.shape[1]], 0),
    (OpSignature("ge.rms_norm", (t(4096, 512), t(512)), (t(4096, 512),), {"epsilon": 1e-5}),
     lambda out, small: out[:small.shape[0]], 0),
])
def test_a_check_instance_computes_what_the_whole_op_computes_there(sig, cut, ulps):
    chip = load_target("ascend910b")
    kernel = KERNELS[sig.name]
    tiling = kernel.candidates(sig, chip)[-1]
    small = kernel.check_instance(sig, tiling)
    assert small.operands[0].num_elements < sig.operands[0].num_elements
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(x.shape).astype(x.dtype.np) for x in sig.operands]
    full = _kernel_on(sig, tiling, inputs)
    # the instance's inputs are the leading part of the whole op's
    small_inputs = [np.ascontiguousarray(a[tuple(slice(0, d) for d in s.shape)]) for a, s in zip(inputs, small.operands)]
    part = _kernel_on(small, tiling, small_inputs)
    whole = cut(full, part)
    assert part.shape == whole.shape
    apart = np.abs(part.astype(np.float64) - whole) / np.spacing(np.abs(whole)).astype(np.float64)
    assert apart.max() <= ulps


def test_the_check_fails_a_kernel_whose_numbers_are_wrong(monkeypatch):
    sig = OpSignature("ge.matmul", (t(128, 256), t(256, 256)), (t(128, 256),), {})
    chip = load_target("ascend910b")
    tiling = KERNELS[sig.name].choose(sig, chip)
    assert check_numerics(sig, tiling, chip).passed
    run = type(KERNELS[sig.name]).run
    monkeypatch.setattr(type(KERNELS[sig.name]), "run",
                        lambda self, op, inputs, tl, ctx: [o * 1.05 for o in run(self, op, inputs, tl, ctx)])
    result = check_numerics(sig, tiling, chip)
    assert not result.passed and "FAIL" in result.render()


def test_a_faster_tiling_whose_numbers_fail_is_never_stored(repo, monkeypatch):
    kernel_class = type(KERNELS["ge.matmul"])
    run = kernel_class.run
    chip = load_target("ascend910b")

    def wrong_unless_rules(self, op, inputs, tiling, ctx):
        out = run(self, op, inputs, tiling, ctx)
        rules = self.choose(OpSignature.of_arrays(op, inputs), chip)
        if not ctx.compute or tiling.base_k == rules.base_k:
            return out
        return [o + np.asarray(0.5, o.dtype) for o in out]

    monkeypatch.setattr(kernel_class, "run", wrong_unless_rules)
    report = tune(ONE_MATMUL, [Point("ascend910b")], InProcess(), repo, graph_times=False)
    (result,) = report.ops
    faster = [c for c in result.op.candidates if launch_us(result.op.sig, c, chip) < result.rules_us]
    assert any(c.base_k != result.op.rules.base_k for c in faster)  # there was a faster candidate with other numbers
    assert result.best.base_k == result.op.rules.base_k  # only candidates that sum K as the rules do survive
    entry = repo.entry(result.op.sig, 2, chip)
    assert entry.tiling == result.best.to_attr()


# --- the command ----------------------------------------------------------------------------------------

def _getune(capsys, *argv):
    code = getune_main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_getune_json_has_the_spec_keys_and_tile_db_gives_the_same_tilings(tmp_path, capsys):
    src = tmp_path / "g.geir"
    src.write_text(GRAPH)
    db = tmp_path / "db.sqlite"
    code, out, err = _getune(capsys, src, "--workers", "0", "--db", db, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert {"op", "loc", "rules_us", "best_us", "tiling"} <= set(report["ops"][0])
    assert set(report["graph"]) >= {"rules_us", "best_us"}
    assert report["graph"]["best_us"] <= report["graph"]["rules_us"]
    locs = {o["op"]: o["loc"] for o in report["ops"]}
    assert locs == {"ge.matmul": f"{src}:2:3", "ge.exp": f"{src}:3:3"}
    # the repository is plain SQLite: what tile{db} reads back is what getune reported
    rows = sqlite3.connect(db).execute("SELECT kernel, tiling FROM entries").fetchall()
    assert {k: json.loads(v) for k, v in rows} == {o["op"]: o["tiling"] for o in report["ops"]}
    graph = _tile(GRAPH, str(db))
    assert {op.name: op.attributes["tiling"] for op in graph.ops if "tiling" in op.attributes} == \
        {o["op"]: o["tiling"] for o in report["ops"]}


def test_getune_sweep_tabulates_each_parameter_against_the_baseline(tmp_path, capsys):
    src = tmp_path / "g.geir"
    src.write_text(ONE_MATMUL)
    out_csv = tmp_path / "sweep.csv"
    code, out, err = _getune(capsys, src, "--workers", "0", "--db", tmp_path / "db.sqlite", "--sweep",
                             "--set", "ub_bytes=x1,x2", "--set", "hbm_tb_per_s=x0.5", "--csv", out_csv)
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out_csv.read_text())))
    assert [(r["parameter"], r["value"]) for r in rows] == [("baseline", ""), ("ub_bytes", "x1"), ("ub_bytes", "x2"),
                                                            ("hbm_tb_per_s", "x0.5")]
    base, same, twice, slow = rows
    assert same["rules_us"] == base["rules_us"]  # x1 is the same chip
    assert twice["chip"] == f"ascend910b[ub_bytes={2 * 192 * 1024}]"
    assert float(slow["rules_us"]) >= float(base["rules_us"])  # half the HBM bandwidth is never faster
    assert "most sensitive to" in out


def test_getune_sweeps_shapes(tmp_path, capsys):
    src = tmp_path / "g.geir"
    src.write_text("ge.graph @main(%a: tensor<?x1024xf16>) -> tensor<?x1024xf16> {\n"
                   "  %e = ge.exp %a : tensor<?x1024xf16>\n  ge.return %e\n}\n")
    code, out, err = _getune(capsys, src, "--workers", "0", "--db", tmp_path / "db.sqlite", "--sweep",
                             "--shape", "a=64x1024,256x1024", "--json")
    assert code == 0, err
    sweep = json.loads(out)["sweep"]
    assert [r["value"] for r in sweep] == ["", "256x1024"]
    assert sweep[1]["rules_us"] > sweep[0]["rules_us"]  # four times the elements take longer


@pytest.mark.parametrize("argv, code, message", [
    (["--set", "ub_byte=x2"], 2, "did you mean 'ub_bytes'"),
    (["--csv", "out.csv"], 2, "--csv writes a sweep's table: give --sweep"),
    (["--sweep"], 2, "--sweep needs at least one --set or --shape"),
    (["--set", "ub_bytes=x1,x2"], 2, "has several values: give --sweep"),
    (["--target", "ascend999"], 2, "unknown target 'ascend999'"),
    (["--workers", "0", "--address", "127.0.0.1:1"], 2, "--workers 0 tunes in this process"),
    (["--shape", "a"], 2, "expected ARG=DIMS"),
])
def test_getune_usage_errors(tmp_path, capsys, argv, code, message):
    src = tmp_path / "g.geir"
    src.write_text(ONE_MATMUL)
    got, _, err = _getune(capsys, src, "--db", tmp_path / "db.sqlite", *argv)
    assert got == code and message in err and "Traceback" not in err


def test_getune_bad_input_is_a_located_error(tmp_path, capsys):
    src = tmp_path / "bad.geir"
    src.write_text("ge.graph @main(%x: tensor<4xf16>) -> tensor<4xf16> {\n  %y = ge.exp %x, : tensor<4xf16>\n}\n")
    db = tmp_path / "db.sqlite"
    code, _, err = _getune(capsys, src, "--workers", "0", "--db", db)
    assert code == 1 and f"{src}:2:" in err and "^" in err
    assert not db.exists()  # nothing written for an input that does not parse


def test_ops_are_keyed_by_chip(tmp_path):
    chip = load_target("ascend910b")
    (a,) = ops_to_tune(parse(ONE_MATMUL), "ascend910b")
    (b,) = ops_to_tune(parse(ONE_MATMUL), "ascend910b[ub_bytes=x2]")
    assert a.key == b.key and a.target_key != b.target_key and a.target_key == target_key(chip)


def test_a_tiling_the_kernel_cannot_run_fails_its_check_with_the_reason(monkeypatch):
    sig = OpSignature("ge.exp", (t(64, 512),), (t(64, 512),), {})
    chip = load_target("ascend910b")
    tiling = KERNELS[sig.name].choose(sig, chip)

    def refuse(self, op, inputs, tl, ctx):
        raise ValueError("no such tile")

    monkeypatch.setattr(type(KERNELS[sig.name]), "run", refuse)
    result = check_numerics(sig, tiling, chip)
    assert not result.passed and "the kernel failed: ValueError: no such tile" in result.render()


def test_getune_tunes_an_onnx_model_through_the_frontend(tmp_path, capsys):
    pytest.importorskip("onnx")
    from pathlib import Path

    model = Path(__file__).resolve().parent.parent / "examples" / "onnx" / "attention.onnx"
    code, out, err = _getune(capsys, model, "--workers", "0", "--db", tmp_path / "db.sqlite", "--json")
    assert code == 0, err
    report = json.loads(out)
    ops = {o["op"] for o in report["ops"]}
    assert "ge.flash_attention" in ops  # the exporter's attention, fused, is what gets tuned
    assert all(o["loc"].startswith(f"{model} (as imported):") for o in report["ops"])
    assert report["graph"]["best_us"] <= report["graph"]["rules_us"]


# --- a repository that is damaged, of another program or layout, or read-only: an error that says so ------------

def _sqlite(path, script: str):
    db = sqlite3.connect(path)
    db.executescript(script)
    db.commit()
    db.close()
    return path


@pytest.mark.parametrize("script, message", [
    # another program's database: refused, and nothing is written into it
    ("CREATE TABLE users (id, name);", "is an SQLite database of another program (it holds users), not a tuning "
                                       "repository"),
    # an older layout: the query would meet "no such column"
    ("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT); INSERT INTO meta VALUES ('schema', '1');"
     "CREATE TABLE measurements (op_key, target, model, tiling, time_us);"
     "CREATE TABLE entries (op_key, target, tiling);",
     "has no column model, kernel, operands, results, attributes, buffers, rules_tiling, rules_us, time_us, "
     "candidates, check_report in table entries: a tuning repository of another layout than this GEIR's (schema 1)"),
    ("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT); INSERT INTO meta VALUES ('schema', '7');",
     "is a tuning repository of schema '7', not schema 1"),
    ("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);",
     "is a tuning repository of no schema version, not schema 1"),
])
def test_a_repository_of_another_program_schema_or_layout_is_refused(tmp_path, capsys, script, message):
    db = _sqlite(tmp_path / "other.sqlite", script)
    before = db.read_bytes()
    src = tmp_path / "g.geir"
    src.write_text(ONE_MATMUL)
    code, out, err = _getune(capsys, src, "--workers", "0", "--db", db)
    advice = "" if "another program" in message else ": give getune another --db, or remove it to start afresh"
    assert (code, out, err) == (1, "", f"getune: error: --db: '{db}' {message}{advice}\n")
    assert db.read_bytes() == before
    with pytest.raises(PipelineError, match="option 'db': .*" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_pipeline(f"tile{{db={db}}}")


def test_a_schema_version_stored_as_a_number_is_the_same_schema(tmp_path):
    # SQLite hands back the integer 1 for a value written as 1: once "schema 1, not 1"
    from geir.passes.tuning_repository import _SCHEMA

    db = _sqlite(tmp_path / "int.sqlite", "CREATE TABLE meta (key TEXT PRIMARY KEY, value); "
                                          "INSERT INTO meta VALUES ('schema', 1);" + _SCHEMA)
    with TuningRepository(db) as r:
        assert r.entry_count() == 0


def test_a_read_only_repository_is_an_error_naming_it(tmp_path, capsys, monkeypatch):
    src = tmp_path / "g.geir"
    src.write_text(ONE_MATMUL)
    db = tmp_path / "ro.sqlite"
    TuningRepository(db, create=True).close()
    # file permissions do not stop root: open it read-only the way SQLite does for a read-only file
    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda path, *a, **k: connect(f"file:{path}?mode=ro", *a, uri=True, **k))
    code, out, err = _getune(capsys, src, "--workers", "0", "--db", db)
    assert (code, out) == (1, "")
    assert err == (f"getune: error: --db: cannot write to the tuning repository '{db}': attempt to write a "
                   f"readonly database\n")
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    with pytest.raises(RepositoryError, match=f"cannot write to the tuning repository '{empty}'"):
        TuningRepository(empty)


ATTENTION = """ge.graph @main(%q: tensor<1x8x1024x128xf16>, %k: tensor<1x8x1024x128xf16>, %v: tensor<1x8x1024x128xf16>) -> tensor<1x8x1024x128xf16> {
  %kt = ge.transpose %k {perm = [0, 1, 3, 2]}
  %s = ge.matmul %q, %kt
  %c = ge.const dense<0.125> : tensor<f16>
  %ss = ge.mul %s, %c
  %p = ge.softmax %ss {axis = -1}
  %o = ge.matmul %p, %v
  ge.return %o
}
"""


@pytest.mark.parametrize("field, value", [("s1", 0), ("s2", 0), ("s1", 7), ("d", 32)])
def test_a_poisoned_entry_is_not_used_and_never_reaches_the_kernel(tmp_path, capsys, field, value):
    from geir.tools.gerun import main as gerun_main

    src = tmp_path / "attention.geir"
    src.write_text(ATTENTION)
    db = tmp_path / "db.sqlite"
    assert _getune(capsys, src, "--workers", "0", "--db", db)[0] == 0
    con = sqlite3.connect(db)
    ((tiling, rules),) = con.execute("SELECT tiling, rules_tiling FROM entries WHERE kernel = 'ge.flash_attention'")
    assert tiling != rules  # the tuned one is used until it is damaged
    damaged = {**json.loads(tiling), field: value}
    con.execute("UPDATE entries SET tiling = ? WHERE kernel = 'ge.flash_attention'", (json.dumps(damaged),))
    con.commit()
    con.close()
    pipeline = f"--passes=fuse,tile{{db={db}}},plan,lower"
    assert gerun_main([str(src), pipeline, "--explain", "--check"]) == 0
    err = capsys.readouterr().err
    assert (f" {field} {value} " in err and "the tuning repository's S1" in err
            and "is not one of the kernel's legal tilings for this op: run getune again" in err)
    assert "internal error" not in err


def test_damaged_times_are_timed_again(repo):
    from geir.passes.tuning_repository import cost_model_version

    repo.record("k", "t", [("a", 1.0), ("c", -2.0)])
    with repo._db:
        repo._db.execute("INSERT INTO measurements VALUES ('k', 't', ?, 'd', 'text')", (cost_model_version(),))
        repo._db.execute("INSERT INTO measurements VALUES ('k', 't', ?, 'e', 1e999)", (cost_model_version(),))
    assert repo.measured("k", "t") == {"a": 1.0}  # c, d and e are offered for timing again


def test_getune_is_never_silent_for_long_off_a_terminal(tmp_path, capsys, monkeypatch):
    from geir.tools import getune

    src = tmp_path / "g.geir"
    src.write_text(ONE_MATMUL)
    monkeypatch.setattr(getune, "PROGRESS_EVERY_S", 0.0)  # every task: the interval has always passed
    code, _, err = _getune(capsys, src, "--workers", "0", "--db", tmp_path / "db.sqlite")
    lines = err.splitlines()
    assert code == 0 and lines[-1] == f"getune: repository {tmp_path / 'db.sqlite'}"
    timed = [ln for ln in lines if ln.endswith("tasks timed")]
    total = int(timed[0].split("/")[1].split()[0])
    assert timed == [f"getune: {i}/{total} tasks timed" for i in range(1, total + 1)] and "\r" not in err
    monkeypatch.setattr(getune, "PROGRESS_EVERY_S", 3600.0)  # a quick run says nothing until its result
    code, _, err = _getune(capsys, src, "--workers", "0", "--db", tmp_path / "db2.sqlite")
    assert code == 0 and err == f"getune: repository {tmp_path / 'db2.sqlite'}\n"
