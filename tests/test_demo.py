"""``moco demo`` end to end with a tiny budget: data, training with the auto recipe, the k-NN report, export and
index (the serving step is covered by the serve tests)."""

from __future__ import annotations

import pytest

from moco_retrieval.app.demo import knn_report, run_demo
from moco_retrieval.indexer.index_dir import IndexDirectory


@pytest.mark.timeout(600)
def test_demo__runs_the_whole_flow_and_reports_the_knn_gain(tmp_path, capsys, monkeypatch):
    import moco_retrieval.app.demo as demo

    monkeypatch.setattr(demo, "DEMO_IMAGES_PER_CLASS", 24)  # 192 images: the flow, not the learning
    run_demo(tmp_path / "demo", budget="6s", device="cpu", serve=False)
    out = capsys.readouterr().out
    assert "k-NN top-1 at random init:" in out and "points)" in out and "to search it: moco serve" in out
    with IndexDirectory.open(tmp_path / "demo" / "index") as index:
        assert index.manifest.count == 192
    assert (tmp_path / "demo" / "encoder.onnx").is_file() and (tmp_path / "demo" / "run" / "metrics.png").is_file()


def test_knn_report__says_what_the_numbers_mean():
    class Result:
        knn_acc, knn_before, steps, epochs_done = 0.73, 0.52, 1340, 26

    text = knn_report(Result())
    assert "52.0%" in text and "73.0%" in text and "+21.0 points" in text and "chance" in text
