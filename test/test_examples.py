"""The bundled examples: every `examples/**/*.geir` parses, verifies and round-trips; each attention
spelling fuses to one ge.flash_attention with its values kept; the near miss misses for the
reason its header gives; the GPT-2 block fuses into its kernels with the same results; and
`examples/make_model.py` writes N-layer models that parse, verify, fuse and run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from geir.diagnostics import Diagnostic, DiagnosticEngine
from geir.ir import Graph, Module
from geir.parser import parse
from geir.passes import PassContext, PassManager, complete_pipeline, parse_pipeline
from geir.printer import print_module
from geir.reference import run_graph
from geir.verifier import verify_module
from helpers import module_sig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ATTENTION = sorted((EXAMPLES / "attention").glob("*.geir"))
ALL_GEIR = sorted(EXAMPLES.rglob("*.geir"))
NEAR_MISS_PREFIX = "near_miss_"
# gerun --check's tolerances against a float64 reference (spec section 3)
TOLERANCE = {"f32": (1e-4, 1e-5), "f16": (1e-2, 1e-3), "bf16": (2e-2, 1e-2)}
# the kernels one GPT-2 block becomes
def block_ops(layers: int) -> dict[str, int]:
    """The fused kernels of `layers` GPT-2 blocks: each block's two layer norms take the residual add before
    them (add_layer_norm), but the first block's first one, which reads the model's input."""
    return {"ge.layer_norm": 1, "ge.add_layer_norm": 2 * layers - 1, "ge.flash_attention": layers,
            "ge.fused_matmul": 4 * layers}


def _rel(path: Path) -> str:
    return path.relative_to(EXAMPLES.parent).as_posix()


@lru_cache(maxsize=None)
def _text(path: Path) -> str:
    return path.read_text()


def _fuse(text: str, name: str = "<example>") -> tuple[Module, list[Diagnostic]]:
    """Parse and run `fuse` with --explain; returns the module and the remarks."""
    module = parse(text, name)
    diags: list[Diagnostic] = []
    ctx = PassContext(diagnostics=DiagnosticEngine(diags.append), explain=True)
    ok = PassManager(complete_pipeline(parse_pipeline("fuse"))).run(module, ctx)
    errors = [d.message for d in diags if d.severity == "error"]
    assert ok and not errors, errors
    return module, [d for d in diags if d.severity == "remark"]


@lru_cache(maxsize=None)
def _parsed(path: Path) -> Module:
    """The example as written (shared by the tests that only read it: printing and running do not mutate)."""
    return parse(_text(path), _rel(path))


@lru_cache(maxsize=None)
def _fused(path: Path) -> tuple[Module, tuple[str, ...]]:
    module, remarks = _fuse(_text(path), _rel(path))
    return module, tuple(d.message for d in remarks)


def _op_counts(g: Graph) -> Counter:
    return Counter(op.name for op in g.ops)


def _inputs(graph: Graph, seed: int = 0, seq: int | None = None) -> dict[str, np.ndarray]:
    """Random inputs with moderate magnitudes (`?` dimensions become `seq`); i1 masks keep the diagonal."""
    rng = np.random.default_rng(seed)
    out = {}
    for a in graph.args:
        shape = tuple(seq if d is None else d for d in a.type.shape)
        if a.type.dtype.name == "i1":
            keep = rng.random(shape) > 0.3
            keep[..., np.arange(shape[-2]), np.arange(shape[-2])] = True  # no fully masked row
            out[a.name] = keep
        else:
            out[a.name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    return out


def _check_same_values(before: Graph, after: Graph, inputs, resources=None) -> None:
    """Fused and unfused agree in float64, and the fused graph in its own dtype is within tolerance."""
    ref_before = run_graph(before, inputs, float64=True, resources=resources)
    ref_after = run_graph(after, inputs, float64=True, resources=resources)
    got = run_graph(after, inputs, resources=resources)
    for rb, ra, g, t in zip(ref_before, ref_after, got, after.result_types):
        assert np.all(np.isfinite(rb))
        np.testing.assert_allclose(ra, rb, rtol=1e-4, atol=1e-4)
        rtol, atol = TOLERANCE[t.dtype.value]
        np.testing.assert_allclose(g.astype(np.float64), rb, rtol=rtol, atol=atol)


def _load_make_model():
    spec = importlib.util.spec_from_file_location("make_model", EXAMPLES / "make_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_model = _load_make_model()


# --- every example ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ALL_GEIR, ids=[_rel(p) for p in ALL_GEIR])
def test_example_parses_verifies_and_round_trips(path: Path) -> None:
    module = _parsed(path)
    errors: list[Diagnostic] = []
    assert verify_module(module, errors.append), [d.message for d in errors]
    assert module.graph().name == "main"
    printed = print_module(module)
    again = parse(printed)
    assert module_sig(again) == module_sig(module)
    assert print_module(again) == printed


def test_the_expected_examples_are_there() -> None:
    names = {p.stem for p in ATTENTION}
    assert {"transpose_b", "transpose_div", "scale_q", "additive_mask", "causal", "bool_mask",
            "softmax_written_out", "f32_softmax", "gqa", "near_miss_softmax_axis"} <= names
    assert (EXAMPLES / "attention.geir").is_file()
    assert (EXAMPLES / "gpt2_block.geir").is_file() and (EXAMPLES / "gpt2_block.npz").is_file()
    readme = (EXAMPLES / "README.md").read_text()
    for p in ALL_GEIR + [EXAMPLES / "make_model.py"]:
        assert p.relative_to(EXAMPLES).as_posix() in readme, f"{p.name} is not in examples/README.md"


# --- attention spellings ------------------------------------------------------------------------

@pytest.mark.parametrize("path", ATTENTION, ids=[p.stem for p in ATTENTION])
def test_attention_header_says_what_and_how(path: Path) -> None:
    lines = _text(path).splitlines()
    header = []
    for line in lines:
        if not line.startswith("//"):
            break
        header.append(line)
    assert len(header) >= 2, "the file starts with // comments saying what it shows"
    assert any(f"geopt {_rel(path)} --passes=fuse --explain" in line for line in header)


FUSING = [p for p in ATTENTION if not p.stem.startswith(NEAR_MISS_PREFIX)]
NEAR_MISSES = [p for p in ATTENTION if p.stem.startswith(NEAR_MISS_PREFIX)]


@pytest.mark.parametrize("path", FUSING + [EXAMPLES / "attention.geir"],
                         ids=[p.stem for p in FUSING] + ["attention"])
def test_attention_spelling_fuses_to_one_flash_attention(path: Path) -> None:
    module, remarks = _fused(path)
    g = module.graph()
    ops = [op.name for op in g.ops if op.name not in ("ge.const", "ge.return")]
    assert ops == ["ge.flash_attention"], ops
    assert not any("not fused" in r for r in remarks), remarks
    before = _parsed(path).graph()
    _check_same_values(before, g, _inputs(before))


def test_causal_constants_become_causal_true() -> None:
    (op,) = [o for o in _fused(EXAMPLES / "attention" / "causal.geir")[0].graph().ops if o.name == "ge.flash_attention"]
    assert op.causal is True and len(op.operands) == 3


@pytest.mark.parametrize("path", NEAR_MISSES, ids=[p.stem for p in NEAR_MISSES])
def test_near_miss_does_not_fuse_for_the_reason_in_its_header(path: Path) -> None:
    stated = re.search(r"^//\s*remark: (.*\S)\s*$", _text(path), re.MULTILINE)
    assert stated, "the header quotes the --explain remark"
    module, remarks = _fused(path)
    assert "ge.flash_attention" not in _op_counts(module.graph())
    assert stated.group(1) in remarks, remarks
    before = _parsed(path).graph()
    _check_same_values(before, module.graph(), _inputs(before))


# --- the GPT-2 block ----------------------------------------------------------------------------

BLOCK = EXAMPLES / "gpt2_block.geir"


def _resources(npz: Path) -> dict[str, np.ndarray]:
    with np.load(npz) as z:
        return {k: z[k] for k in z.files}


def _resource_keys(g: Graph) -> set[str]:
    return {op.value.key for op in g.ops if op.name == "ge.const" and hasattr(op.value, "key")}


def test_gpt2_block_fuses_into_its_kernels() -> None:
    module, remarks = _fused(BLOCK)
    counts = _op_counts(module.graph())
    for name, n in block_ops(1).items():
        assert counts[name] == n, (name, counts)
    assert [op.attributes.get("activation") for op in module.graph().ops
            if op.name == "ge.fused_matmul"].count("gelu_tanh") == 1
    assert (op := next(o for o in module.graph().ops if o.name == "ge.flash_attention")).causal
    assert len(op.operands) == 3 and op.scale == 0.125
    # nothing written out is left: no softmax, reductions, bare matmuls or GELU pieces
    for gone in ("ge.matmul", "ge.softmax", "ge.reduce_mean", "ge.tanh", "ge.pow", "ge.select", "ge.rsqrt"):
        assert gone not in counts, (gone, counts)
    assert not any("not fused" in r for r in remarks), remarks


def test_gpt2_block_weights_are_beside_it() -> None:
    g = _parsed(BLOCK).graph()
    weights = _resources(BLOCK.with_suffix(".npz"))
    assert _resource_keys(g) == set(weights)
    for op in g.ops:
        if op.name == "ge.const" and hasattr(op.value, "key"):
            assert weights[op.value.key].shape == op.results[0].type.shape, op.value.key


def test_gpt2_block_fused_and_unfused_agree() -> None:
    before = _parsed(BLOCK).graph()
    _check_same_values(before, _fused(BLOCK)[0].graph(), _inputs(before), _resources(BLOCK.with_suffix(".npz")))


def test_gpt2_block_is_what_make_model_writes(tmp_path: Path) -> None:
    out = tmp_path / "gpt2_block.geir"
    assert make_model.main(["--layers", "1", "--hidden", "256", "--heads", "4", "--seq", "128", "-o", str(out)]) == 0

    def body(text: str) -> list[str]:
        lines = text.splitlines()
        return lines[next(i for i, line in enumerate(lines) if not line.startswith("//")):]

    assert body(out.read_text()) == body(_text(BLOCK)), "regenerate: see the block's 'Generated by' line"
    mine, shipped = _resources(out.with_suffix(".npz")), _resources(BLOCK.with_suffix(".npz"))
    assert mine.keys() == shipped.keys()
    for k in mine:
        np.testing.assert_array_equal(mine[k], shipped[k], err_msg=k)


# --- make_model.py ------------------------------------------------------------------------------

def _make(tmp_path: Path, *args: str, name: str = "model.geir") -> Path:
    out = tmp_path / name
    assert make_model.main([*args, "-o", str(out)]) == 0
    assert out.is_file() and out.with_suffix(".npz").is_file()
    return out


def _check_model(path: Path, layers: int) -> Module:
    text = path.read_text()
    module = parse(text, path.name)
    errors: list[Diagnostic] = []
    assert verify_module(module, errors.append), [d.message for d in errors]
    fused, remarks = _fuse(text, path.name)
    counts = _op_counts(fused.graph())
    for name, n in block_ops(layers).items():
        assert counts[name] == n, (name, counts)
    misses = [r.message for r in remarks if "not fused" in r.message]
    assert not misses, misses
    keys = _resource_keys(module.graph())
    assert len(keys) == 12 * layers and f"l{layers - 1}.attn.wqkv" in keys
    assert keys == set(np.load(path.with_suffix(".npz")).files)
    return fused


def test_make_model_two_layers_runs_with_its_weights(tmp_path: Path) -> None:
    path = _make(tmp_path, "--layers", "2", "--hidden", "128", "--heads", "2", "--seq", "32")
    fused = _check_model(path, 2)
    before = parse(path.read_text()).graph()
    (out,) = run_graph(before, _inputs(before), resources=np.load(path.with_suffix(".npz")))
    assert out.shape == (1, 32, 128) and out.dtype == np.float16 and np.all(np.isfinite(out))
    _check_same_values(before, fused.graph(), _inputs(before), _resources(path.with_suffix(".npz")))


def test_make_model_32_layers(tmp_path: Path) -> None:
    path = _make(tmp_path, "--layers", "32", "--hidden", "64", "--heads", "1", "--seq", "16")
    _check_model(path, 32)


def test_make_model_default_shape_text_is_fast_and_fuses() -> None:
    # the defaults (32 layers, hidden 512, 8 heads, seq 128); weights skipped: 100M parameters
    t0 = time.perf_counter()
    text = make_model.model_text(32, 512, 8, 128, 2048, "f16")
    assert time.perf_counter() - t0 < 0.5
    fused, _ = _fuse(text)
    counts = _op_counts(fused.graph())
    assert {name: counts[name] for name in block_ops(32)} == block_ops(32)


def test_make_model_dynamic_seq_takes_a_mask(tmp_path: Path) -> None:
    path = _make(tmp_path, "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "16", "--dynamic-seq",
                 "--dtype", "f32")
    fused = _check_model(path, 2)
    g = fused.graph()
    assert [str(a.type) for a in g.args] == ["tensor<1x?x64xf32>", "tensor<1x1x?x?xf32>"]
    for op in g.ops:
        if op.name == "ge.flash_attention":
            assert op.operands[3] is g.args[1] and not op.causal
    before = parse(path.read_text()).graph()
    for seq in (8, 24):  # one graph, any sequence length
        inputs = _inputs(before, seq=seq)
        inputs["mask"] = np.triu(np.full((1, 1, seq, seq), -1e9, np.float32), 1)
        _check_same_values(before, g, inputs, _resources(path.with_suffix(".npz")))


def test_make_model_no_weights_writes_only_the_text(tmp_path: Path) -> None:
    out = tmp_path / "big.geir"
    assert make_model.main(["--layers", "3", "--no-weights", "-o", str(out)]) == 0
    assert out.is_file() and not out.with_suffix(".npz").exists()
    assert out.read_text().count("ge.softmax") == 3


@pytest.mark.parametrize("args", [["--hidden", "100", "--heads", "3"], ["--mlp", "four"], ["--layers", "0"]])
def test_make_model_rejects_bad_options(tmp_path: Path, args: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        make_model.main([*args, "-o", str(tmp_path / "m.geir")])
    assert e.value.code == 2


SCRIPTS = sorted(EXAMPLES.rglob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_example_script_treats_help_as_help_and_writes_nothing(tmp_path: Path, script: Path) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ") and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []  # no folder named --help, no file


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_example_scripts_write_with_the_mode_the_umask_gives(tmp_path: Path, umask: int) -> None:
    import subprocess
    import sys

    runs = [[str(EXAMPLES / "make_model.py"), "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8",
             "-o", str(tmp_path / "m.geir")],
            [str(EXAMPLES / "dynamic" / "make_inputs.py"), str(tmp_path / "dyn")]]
    try:
        import onnx  # noqa: F401

        runs.append([str(EXAMPLES / "onnx" / "make_model.py"), str(tmp_path / "onnx")])
    except ImportError:
        pass
    for argv in runs:
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                           preexec_fn=lambda: os.umask(umask))
        assert r.returncode == 0, r.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.suffix for p in written} >= {".geir", ".npz"}
    for p in written:
        assert p.stat().st_mode & 0o777 == 0o666 & ~umask, (p, oct(p.stat().st_mode))


# --- the ONNX example ---------------------------------------------------------------------------

def test_onnx_example_is_what_its_script_writes(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    spec = importlib.util.spec_from_file_location("make_onnx_model", EXAMPLES / "onnx" / "make_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(tmp_path)]) == 0
    assert onnx.load(str(tmp_path / "attention.onnx")) == onnx.load(str(EXAMPLES / "onnx" / "attention.onnx"))
    with (np.load(tmp_path / "attention_inputs.npz") as made,
          np.load(EXAMPLES / "onnx" / "attention_inputs.npz") as shipped):
        assert made.files == shipped.files == ["x"]
        np.testing.assert_array_equal(made["x"], shipped["x"])


def test_onnx_example_imports_to_one_flash_attention() -> None:
    pytest.importorskip("onnx")
    from geir.frontends.onnx import import_onnx

    module, weights = import_onnx(str(EXAMPLES / "onnx" / "attention.onnx"))
    assert set(weights) == {"wq", "wk", "wv", "wo"}
    fused, remarks = _fuse(print_module(module))
    assert _op_counts(fused.graph())["ge.flash_attention"] == 1, remarks
