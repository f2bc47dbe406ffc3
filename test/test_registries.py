"""Registries are explicit (issue 27 item 5): ops, kernels and passes are registered by `load_all()`, which each
registry calls on its first read, never as a side effect of which module was imported first. And an op's FLOP
count is a fact of the op (issue 27 item 1), checked here against the analytic counts."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from geir.kernels.base import flops_of
from geir.parser import parse
from geir.passes import PASSES, get_all_passes

ROOT = Path(__file__).resolve().parent.parent


def _fresh(code: str) -> str:
    """Run `code` in a fresh interpreter (nothing imported or registered yet); its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _declared(pattern: str, folder: str) -> set[str]:
    """The names a decorator registers with a literal string in the sources of `folder` (the oracle)."""
    return {m for p in (ROOT / folder).glob("*.py") for m in re.findall(pattern, p.read_text())}


def test_importing_the_packages_registers_nothing_until_a_registry_is_read():
    out = _fresh("""
        import geir, geir.ops, geir.kernels, geir.passes
        from geir.opdef import OPS
        from geir.kernels import KERNELS
        from geir.passes import PASSES
        print([r.loaded for r in (OPS, KERNELS, PASSES)])
        kernel = KERNELS["ge.softmax"]  # the first lookup loads the kernels, and the ops they ask about
        print([r.loaded for r in (OPS, KERNELS, PASSES)], type(kernel).__name__)
        print(sorted(PASSES))
    """).splitlines()
    assert out[0] == "[False, False, False]"
    assert out[1] == "[True, True, False] RowKernel"
    assert eval(out[2]) == sorted(_declared(r'@register_pass\("([^"]+)"\)', "passes"))


def test_importing_one_module_first_does_not_leave_a_registry_half_filled():
    # a pass module, one kernel module and one dialect module imported alone, then every registry read
    out = _fresh("""
        import geir.passes.cse, geir.kernels.matmul, geir.ops.linalg
        from geir.opdef import OPS
        from geir.kernels import KERNELS
        from geir.passes import PASSES
        print(sorted(PASSES))
        print(sorted(OPS))
        print(type(KERNELS["ge.add"]).__name__, type(KERNELS["ge.flash_attention"]).__name__)
    """).splitlines()
    assert eval(out[0]) == sorted(_declared(r'@register_pass\("([^"]+)"\)', "passes"))
    assert _declared(r'@op\("([^"]+)"\)', "geir/ops") <= set(eval(out[1]))
    assert out[2] == "ElementwiseKernel FlashAttentionKernel"


def test_a_pass_registered_before_any_read_joins_the_built_in_ones():
    out = _fresh("""
        from geir.passes.pass_manager import PASSES, Pass, register_pass, parse_pipeline

        @register_pass("test-early")
        class Early(Pass):
            def run(self, module, ctx):
                pass

        print([p.NAME for p in parse_pipeline("test-early,cse,tile")])
    """)
    assert out.strip() == "['test-early', 'cse', 'tile']"


def test_get_all_passes_is_the_loaded_registry():
    assert get_all_passes() == dict(PASSES)
    assert set(get_all_passes()) >= _declared(r'@register_pass\("([^"]+)"\)', "passes")


def _op(text: str, name: str):
    module = parse(text)
    return next(o for o in module.graphs[0].ops if o.name == name)


@pytest.mark.parametrize("n,d", [(64, 1000), (3, 7)])
def test_the_flops_of_a_row_op_and_an_elementwise_op_are_one_per_result_element(n, d):
    text = (f"ge.graph @main(%x: tensor<{n}x{d}xf32>) -> tensor<{n}x{d}xf32> {{\n"
            f"  %s = ge.softmax %x : tensor<{n}x{d}xf32>\n  %r = ge.reduce_sum %s {{axes = [1]}} : tensor<{n}xf32>\n"
            f"  %t = ge.tanh %s : tensor<{n}x{d}xf32>\n  ge.return %t\n}}\n")
    assert flops_of(_op(text, "ge.softmax")) == n * d
    assert flops_of(_op(text, "ge.tanh")) == n * d
    assert flops_of(_op(text, "ge.reduce_sum")) == n


def test_the_flops_of_the_cube_ops_are_their_multiply_adds():
    m, k, n = 48, 80, 24
    text = (f"ge.graph @main(%a: tensor<2x{k}x{m}xf16>, %b: tensor<{k}x{n}xf16>) -> tensor<2x{m}x{n}xf16> {{\n"
            f"  %y = ge.matmul %a, %b {{transpose_a = true}} : tensor<2x{m}x{n}xf16>\n"
            f"  %z = ge.fused_matmul %a, %b {{transpose_a = true, activation = \"relu\"}} : tensor<2x{m}x{n}xf16>\n"
            f"  %t = ge.transpose %y {{perm = [0, 2, 1]}} : tensor<2x{n}x{m}xf16>\n"
            "  ge.return %z\n}\n")
    assert flops_of(_op(text, "ge.matmul")) == 2 * (2 * m * n) * k  # 2 per multiply-add, M*N*K a batch
    assert flops_of(_op(text, "ge.fused_matmul")) == 2 * (2 * m * n) * k
    assert flops_of(_op(text, "ge.transpose")) == 0  # moves bytes only
    b, h, s, d = 2, 4, 64, 32
    for causal, pairs in (("false", s * s), ("true", s * (s + 1) // 2)):  # causal: the lower triangle
        text = (f"ge.graph @main(%q: tensor<{b}x{h}x{s}x{d}xf16>) -> tensor<{b}x{h}x{s}x{d}xf16> {{\n"
                f"  %o = ge.flash_attention %q, %q, %q {{causal = {causal}}} : tensor<{b}x{h}x{s}x{d}xf16>\n"
                "  ge.return %o\n}\n")
        assert flops_of(_op(text, "ge.flash_attention")) == 2 * 2 * b * h * pairs * d  # q @ k^T and p @ v
