"""Tensors with an extent of 0, end to end through gerun: an empty result, a sum over nothing (a matmul's K, a
softmax's row, attention over no keys), and the reductions that have no value over nothing. Each is either
numpy's and torch's answer or an error at the op, never an internal error (the fuzz harness's mutation that
makes an extent 0 in every type found these).

Oracles: numpy's and torch's semantics for the same shapes, stated in each test.
"""

from __future__ import annotations

import numpy as np
import pytest

from geir.tools.gerun import main as gerun_main


def _gerun(tmp_path, capsys, text: str, *args: str) -> tuple[int, str, str]:
    src = tmp_path / "empty.geir"
    src.write_text(text)
    rc = gerun_main([str(src), *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "internal error" not in err
    return rc, out, err.replace(str(src), "empty.geir")


def test_a_max_over_an_axis_of_no_elements_is_an_error_at_the_op(tmp_path, capsys):
    # np.max and torch.amax both refuse an empty reduction: a max has no identity
    rc, _, err = _gerun(tmp_path, capsys, """ge.graph @main(%a: tensor<4x0xf32>) -> tensor<4xf32> {
  %m = ge.reduce_max %a {axes = [1]}
  ge.return %m
}
""")
    assert rc == 1 and err.startswith("empty.geir:2:3: error: axis 1 has no elements: ge.reduce_max over nothing "
                                      "has no value")


def test_a_sum_a_mean_and_a_softmax_over_nothing_are_numpys(tmp_path, capsys):
    # np.sum over nothing is 0, np.mean NaN (torch gives the same), a softmax over an empty row an empty row
    rc, out, err = _gerun(tmp_path, capsys, """ge.graph @main(%a: tensor<4x0xf32>) -> (tensor<4xf32>, tensor<4xf32>, tensor<4x0xf32>) {
  %s = ge.reduce_sum %a {axes = [1]}
  %m = ge.reduce_mean %a {axes = [1]}
  %p = ge.softmax %a
  ge.return %s, %m, %p
}
""", "--check", "--output", str(tmp_path / "out.npz"))
    assert rc == 0, err
    saved = np.load(tmp_path / "out.npz")
    s, m, p = (saved[k] for k in sorted(saved.files))
    assert np.array_equal(s, np.zeros(4, np.float32)) and np.isnan(m).all() and p.shape == (4, 0)


def test_attention_over_no_keys_is_zeros_and_with_head_dim_0_needs_a_scale(tmp_path, capsys):
    # torch's SDPA over no keys gives zeros: P V sums nothing
    torch = pytest.importorskip("torch")
    rc, out, err = _gerun(tmp_path, capsys, """ge.graph @main(%q: tensor<1x2x3x8xf32>, %k: tensor<1x2x0x8xf32>, %v: tensor<1x2x0x8xf32>) -> tensor<1x2x3x8xf32> {
  %o = ge.flash_attention %q, %k, %v
  ge.return %o
}
""", "--check", "--output", str(tmp_path / "o.npz"))
    assert rc == 0, err
    (o,) = np.load(tmp_path / "o.npz").values()
    want = torch.nn.functional.scaled_dot_product_attention(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 0, 8),
                                                            torch.ones(1, 2, 0, 8))
    assert np.array_equal(o, want.numpy())
    # head dim 0: the default scale 1 / sqrt(D) is undefined
    rc, _, err = _gerun(tmp_path, capsys, """ge.graph @main(%q: tensor<1x2x3x0xf32>, %k: tensor<1x2x4x0xf32>, %v: tensor<1x2x4x8xf32>) -> tensor<1x2x3x8xf32> {
  %o = ge.flash_attention %q, %k, %v
  ge.return %o
}
""")
    assert rc == 1 and err.startswith("empty.geir:2:3: error: head dim 0: the default scale 1/sqrt(head dim) is "
                                      "undefined (give `scale`)")


def test_attention_with_no_query_heads_and_a_matmul_over_no_k(tmp_path, capsys):
    # no query heads: an empty result; a matmul whose K is 0 sums nothing: zeros (np.matmul gives the same)
    rc, out, err = _gerun(tmp_path, capsys, """ge.graph @main(%q: tensor<1x0x16x8xf16>, %k: tensor<1x2x16x8xf16>, %a: tensor<5x0xf16>, %b: tensor<0x7xf16>) -> (tensor<1x0x16x8xf16>, tensor<5x7xf16>) {
  %o = ge.flash_attention %q, %k, %k
  %c = ge.matmul %a, %b
  ge.return %o, %c
}
""", "--check", "--output", str(tmp_path / "o.npz"))
    assert rc == 0, err
    saved = np.load(tmp_path / "o.npz")
    shapes = sorted(saved[k].shape for k in saved.files)
    assert shapes == [(1, 0, 16, 8), (5, 7)]
    assert all(np.array_equal(saved[k], np.zeros((5, 7), np.float16)) for k in saved.files if saved[k].size)


def test_an_index_past_a_table_of_empty_rows_is_still_a_device_fault(tmp_path, capsys):
    # np.take and torch's embedding refuse index 4 of 4 rows, however wide the rows (here: none)
    np.savez(tmp_path / "in.npz", ids=np.array([[0, 4]], dtype=np.int32), w=np.zeros((4, 0), np.float16))
    rc, _, err = _gerun(tmp_path, capsys, """ge.graph @main(%w: tensor<4x0xf16>, %ids: tensor<1x2xi32>) -> tensor<1x2x0xf16> {
  %e = ge.gather %w, %ids {axis = 0}
  ge.return %e
}
""", "--inputs", str(tmp_path / "in.npz"))
    assert rc == 1 and "empty.geir:2:3: device fault: gather index 4 is out of range for axis 0 of size 4" in err


@pytest.mark.parametrize("edit, why", [
    # its batch of 0: the fused kernel it would compare with takes no time
    (("tensor<1x", "tensor<0x"), "it has no elements: the fused kernel takes no time"),
    # its head dim of 0: the fused kernel's default scale is undefined
    (("x64xf16", "x0xf16"), "its head dim is 0 (no scale 1/sqrt(head dim) to compare with)"),
])
def test_gedoctor_on_an_empty_attention_near_miss_says_why_it_has_no_cost(tmp_path, capsys, edit, why):
    from pathlib import Path

    from geir.tools.gedoctor import main as gedoctor_main

    text = (Path(__file__).resolve().parent.parent / "examples/attention/near_miss_softmax_axis.geir").read_text()
    src = tmp_path / "near_miss.geir"
    src.write_text(text.replace(*edit))
    rc = gedoctor_main([str(src)])
    out, err = capsys.readouterr()
    assert rc == 0 and "internal error" not in err and "Traceback" not in out + err
    assert f"attention not fused: softmax axis is 2, not the last axis. Its cost is not measured: {why}" in out


def test_the_norm_cast_fusion_takes_a_gamma_of_no_elements(tmp_path, capsys):
    # its hidden size of 0: the f32 gamma is a splat of no elements, narrowed to f16 as an empty constant
    import re
    from pathlib import Path

    from geir.tools.geopt import main as geopt_main

    text = (Path(__file__).resolve().parent / "lit/passes/fuse-norm-cast.geir").read_text()
    src = tmp_path / "norm_cast.geir"
    src.write_text(re.sub(r"(?<=[<x])64(?=x)", "0", text))
    rc = geopt_main([str(src), "--passes=canonicalize,fuse"])
    out, err = capsys.readouterr()
    assert rc == 0 and "internal error" not in err, err
    assert "ge.add_rms_norm" in out and "tensor<0xf16>" in out
