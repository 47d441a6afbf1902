"""Many queries from the command line (``app/query_files.py``): files decoded in worker processes, embedded in
whole batches with the served encoder and answered by vector search, checked against the engine's answers to
each image alone, on the real ONNX / FAISS / LMDB serving fixtures."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moco_retrieval.contracts.errors import DataError

pytest_plugins = ("tests._serve_fixtures",)  # the shared serving fixtures (index, engine, server)


@pytest.fixture(scope="module")
def query_folder(tmp_path_factory, serve_corpus, held_out) -> Path:
    """64 images (the indexed ones and 16 never indexed), more than one batch, plus a file that does not decode."""
    folder = tmp_path_factory.mktemp("queries") / "queries"
    shutil.copytree(serve_corpus, folder / "indexed")
    shutil.copytree(held_out, folder / "new")
    (folder / "new" / "red" / "broken.png").write_bytes(b"not an image")
    return folder


def _sorted_images(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.png"))


def test_classify_cli__a_folder_equals_each_image_classified_alone(
    served_index, served_engine, query_folder, tmp_path, capsys
):
    from moco_retrieval.app.cli import main

    out = tmp_path / "preds.csv"
    assert main(["classify", str(served_index), str(query_folder), "--out", str(out), "--device", "cpu"]) == 0
    assert "65 queries answered" in capsys.readouterr().out
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["query", "label", "share", "ids", "paths", "scores", "error"]
    assert [str(Path(r["query"]).relative_to(query_folder)) for r in rows] == _sorted_images(query_folder)
    (broken,) = [r for r in rows if r["query"].endswith("broken.png")]
    assert broken["error"] and not broken["label"] and not broken["ids"]  # its own row, not the end of the run
    for row in rows:
        if row is broken:
            continue
        assert not row["error"]
        (single,) = served_engine.classify([row["query"]])
        assert row["label"] == single.label
        assert row["ids"] == ";".join(str(h["id"]) for h in single.neighbors)
        assert float(row["share"]) == pytest.approx(single.probabilities[single.label], abs=1e-5)


def test_answer_files__several_workers_keep_the_order_given_and_bad_files_are_their_rows(served_engine, query_folder):
    from moco_retrieval.app.query_files import answer_files

    images = [str(query_folder / p) for p in _sorted_images(query_folder) if not p.endswith("broken.png")]
    rng = np.random.default_rng(5)
    paths = [images[i] for i in rng.permutation(len(images))]  # not path order: the order given is kept
    paths[3:3] = [str(query_folder / "new" / "red" / "broken.png")]
    paths[40:40] = [str(query_folder / "missing.png")]
    got = list(
        answer_files(served_engine.encoder, paths, lambda xq: served_engine.search_vectors(xq, 5), batch=7, workers=3)
    )
    assert [path for path, _ in got] == paths
    for path, res in got:
        if path.endswith(("broken.png", "missing.png")):
            assert isinstance(res, DataError) and str(res) and "\n" not in str(res)
            continue
        (single,) = served_engine.search([path], 5)
        assert [h["id"] for h in res.hits] == [h["id"] for h in single.hits]
        assert [h["score"] for h in res.hits] == pytest.approx([h["score"] for h in single.hits], abs=1e-5)


def test_search_cli__a_folder_with_filters_min_score_and_k_equals_single_searches(
    served_index, served_engine, query_folder, tmp_path, capsys
):
    from moco_retrieval.app.cli import main
    from moco_retrieval.serve.search_filter import SearchFilter

    out = tmp_path / "neighbours.jsonl"
    argv = ["search", str(served_index), str(query_folder), "-k", "4", "--min-score", "0.5", "--label", "red"]
    assert main([*argv, "--exclude", "0", "--out", str(out), "--device", "cpu", "--no-progress"]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [str(Path(r["query"]).relative_to(query_folder)) for r in rows] == _sorted_images(query_folder)
    flt = SearchFilter(labels=("red",), exclude=(0,))
    for row in rows:
        if row["query"].endswith("broken.png"):
            assert row["error"] and row["results"] == []
            continue
        (single,) = served_engine.search([row["query"]], 4, 0.5, flt)
        assert [h["id"] for h in row["results"]] == [h["id"] for h in single.hits]
        assert all(h["label"] == "red" and h["score"] >= 0.5 and h["id"] != 0 for h in row["results"])


def test_classify_vectors__votes_as_classify_does(served_engine, serve_corpus):
    paths = [str(p) for p in sorted(serve_corpus.rglob("*.png"))[::7]]
    xq = served_engine.encoder.embed_images(paths)
    for by_vector, by_image in zip(served_engine.classify_vectors(xq, 9), served_engine.classify(paths, 9)):
        assert by_vector.label == by_image.label
        assert [h["id"] for h in by_vector.neighbors] == [h["id"] for h in by_image.neighbors]
        assert by_vector.probabilities == pytest.approx(by_image.probabilities, abs=1e-6)


def test_search_cli__an_unknown_label_over_a_folder_is_one_line_and_writes_nothing(
    served_index, query_folder, tmp_path, capsys
):
    from moco_retrieval.app.cli import main

    out = tmp_path / "rows.csv"
    argv = ["search", str(served_index), str(query_folder), "--label", "purple", "--out", str(out)]
    assert main([*argv, "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "purple" in err
    assert not out.exists()
