"""getune on Ray: a local Ray and a multi-node cluster time the same candidates to the same results as one process.

Oracle: the in-process run (the timing is a deterministic model, so every worker must agree bit for bit),
and the cluster's own count of CPUs. Skips without the `tune` extra.
"""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from geir.passes.tuning_repository import TuningRepository  # noqa: E402
from geir.session.executors import InProcess, OnRay  # noqa: E402
from geir.session.tuning import Point, tune  # noqa: E402
from geir.tools.getune import main as getune_main  # noqa: E402

GRAPH = """ge.graph @main(%x: tensor<128x256xf16>, %w: tensor<256x256xf16>, %a: tensor<48x4096xf16>) -> (tensor<128x256xf16>, tensor<48x4096xf16>) {
  %y = ge.matmul %x, %w : tensor<128x256xf16>
  %e = ge.exp %a : tensor<48x4096xf16>
  ge.return %y, %e
}
"""
POINTS = [Point("ascend910b"), Point("ascend310p")]


def _results(report):
    return [(o.op.sig.key, o.op.target_key, o.rules_us, o.best_us, o.best.to_attr()) for o in report.ops]


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    with TuningRepository(tmp_path_factory.mktemp("serial") / "db.sqlite", create=True) as repo:
        return _results(tune(GRAPH, POINTS, InProcess(), repo, graph_times=False))


def test_a_local_ray_finds_what_one_process_finds(tmp_path, in_process):
    executor = OnRay(2)
    try:
        assert executor.workers == 2
        with TuningRepository(tmp_path / "db.sqlite", create=True) as repo:
            report = tune(GRAPH, POINTS, executor, repo, graph_times=False)
    finally:
        executor.close()
    assert not ray.is_initialized()  # the executor shuts down the Ray it started
    assert _results(report) == in_process and report.timed > 0


def test_a_multi_node_cluster_finds_what_one_process_finds(tmp_path, in_process):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        executor = OnRay(address=cluster.address)
        assert executor.workers == 2  # the CPUs of both nodes
        with TuningRepository(tmp_path / "db.sqlite", create=True) as repo:
            report = tune(GRAPH, POINTS, executor, repo, graph_times=False)
        executor.close()  # disconnects: a cluster it joined is not its to stop
        ray.init(address=cluster.address, log_to_driver=False)
        assert ray.cluster_resources()["CPU"] == 2
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert _results(report) == in_process


def test_getune_runs_on_a_local_ray(tmp_path, capsys, in_process):
    src = tmp_path / "g.geir"
    src.write_text(GRAPH)
    code = getune_main([str(src), "--workers", "2", "--db", str(tmp_path / "db.sqlite"), "--json",
                        "--target", "ascend910b", "--target", "ascend310p"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["workers"] == 2
    assert [(o["rules_us"], o["best_us"], o["tiling"]) for o in report["ops"]] == \
        [(r[2], r[3], r[4]) for r in in_process]
    assert [g["target"] for g in report["graphs"]] == ["ascend910b", "ascend310p"]
