"""``moco embeddings``: an index's live items as Parquet, read back by pyarrow, pandas and DuckDB."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from moco_retrieval.app.cli import main
from tests._serve_helpers import build_index_in_subprocess

pytest_plugins = ("tests._serve_fixtures",)

NON_UTF8 = os.fsdecode(b"red/caf\xe9.png")


@pytest.fixture
def updated_index(private_index, encoder_onnx):
    """An index with a base, a delta (a new file whose name is not UTF-8) and a removed item."""
    corpus, index = private_index
    (corpus / NON_UTF8).write_bytes((corpus / "red" / "red_002.png").read_bytes())
    (corpus / "blue" / "blue_005.png").unlink()
    build_index_in_subprocess(corpus, encoder_onnx, index)
    return corpus, index


def test_embeddings__parquet_opens_everywhere_and_holds_what_the_index_searches(updated_index, tmp_path, capsys):
    import duckdb
    import pandas as pd
    import pyarrow.parquet as pq

    from moco_retrieval.indexer.index_dir import IndexDirectory

    _, index = updated_index
    out = tmp_path / "items.parquet"
    assert main(["embeddings", str(index), "--out", str(out), "--no-progress"]) == 0
    assert "wrote 48 items (512-d vectors" in capsys.readouterr().out
    table = pq.read_table(out)
    assert table.num_rows == 48 and table.schema.field("vector").type.list_size == 512
    frame = pd.read_parquet(out)
    assert "blue/blue_005.png" not in set(frame.path)  # deleted: absent
    odd = frame[frame.path == "red/caf\\xe9.png"]
    assert len(odd) == 1 and os.fsdecode(odd.path_bytes.iloc[0]) == NON_UTF8  # the raw name survives
    assert frame.path_bytes.isna().sum() == 47
    assert duckdb.sql(f"select count(*), count(distinct id) from '{out}'").fetchall() == [(48, 48)]
    assert dict(duckdb.sql(f"select label, count(*) from '{out}' group by label").fetchall()) == {
        "blue": 11,
        "green": 12,
        "red": 13,
        "yellow": 12,
    }
    vectors = np.stack(frame.vector.to_numpy())
    with IndexDirectory.open(index) as directory:
        assert sorted(frame.id) == directory.index.ids().tolist()
        stored = np.stack([directory.index.reconstruct(int(i)) for i in frame.id])
        np.testing.assert_allclose(vectors, stored, rtol=0, atol=1e-6)
        D, I = directory.index.search(vectors[:5], 1)  # each vector finds its own item first
        assert I[:, 0].tolist() == frame.id[:5].tolist() and np.allclose(D[:, 0], 1, atol=1e-4)
        rec = directory.record(int(frame.id.iloc[0]))
        assert frame.sha256.iloc[0] == rec["sha256"] and frame.width.iloc[0] == rec["width"]


def test_embeddings__npy_and_parquet_metadata_row_for_row(updated_index, tmp_path):
    import pyarrow.parquet as pq

    from moco_retrieval.indexer.embeddings_file import write_embeddings

    _, index = updated_index
    whole = write_embeddings(index, tmp_path / "all.parquet", row_group=7)  # several row groups
    split = write_embeddings(index, tmp_path / "split", npy=True, row_group=7)
    assert [p.name for p in split.paths] == ["split.npy", "split.parquet"]
    vectors = np.load(tmp_path / "split.npy")
    meta = pq.read_table(tmp_path / "split.parquet").to_pandas()
    reference = pq.read_table(whole.paths[0]).to_pandas()
    assert pq.ParquetFile(whole.paths[0]).metadata.num_row_groups >= 7
    assert vectors.shape == (48, 512) and vectors.dtype == np.float32 and "vector" not in meta
    assert meta.id.tolist() == reference.id.tolist()
    np.testing.assert_array_equal(vectors, np.stack(reference.vector.to_numpy()))


def test_embeddings__missing_index_and_unwritable_out_are_one_line(tmp_path, served_index, capsys):
    assert main(["embeddings", str(tmp_path / "nope"), "--out", str(tmp_path / "x.parquet")]) == 4
    assert capsys.readouterr().err.startswith("moco: error: index directory not found")
    assert main(["embeddings", str(served_index), "--out", str(tmp_path / "no" / "dir" / "x.parquet")]) == 5
    err = capsys.readouterr().err.strip()
    assert err.startswith("moco: error:") and "\n" not in err


def test_embed__a_folder_to_parquet_equals_the_encoder_and_resumes(
    serve_corpus, encoder_onnx, tmp_path, monkeypatch, capsys
):
    import pandas as pd

    import moco_retrieval.indexer.embed_folder as embed_folder
    from moco_retrieval.indexer.encoder import OnnxEncoder

    corpus = tmp_path / "photos"
    shutil.copytree(serve_corpus, corpus)
    (corpus / "red" / "broken.png").write_bytes(b"\x89PNG not really")
    out = tmp_path / "photos.parquet"
    args = [
        "embed",
        str(corpus),
        "--model",
        str(encoder_onnx),
        "--out",
        str(out),
        "--workers",
        "0",
        "--no-progress",
        "--shard-size",
        "8",
    ]
    calls = []

    def dies_once(*a, **k):  # the run is stopped after embedding everything, before the file is written
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(embed_folder, "write_embeddings", dies_once)
    with pytest.raises(KeyboardInterrupt):
        embed_folder.embed_folder(
            embed_folder.IndexConfig(str(corpus), str(encoder_onnx), str(out), workers=0, progress=False)
        )
    assert calls and embed_folder.work_dir_for(out).is_dir() and not out.exists()
    monkeypatch.undo()
    assert main(args) == 0  # the identical command goes on: nothing embedded again
    printed = capsys.readouterr().out
    assert "embedded 0 images" in printed and "wrote 48 rows (512-d)" in printed and "red/broken.png" in printed
    assert not embed_folder.work_dir_for(out).exists()
    frame = pd.read_parquet(out)
    assert frame.id.tolist() == list(range(48)) and frame.path.tolist() == sorted(frame.path)
    encoder = OnnxEncoder(encoder_onnx, device="cpu", threads=1)
    some = frame.iloc[[0, 17, 47]]
    expected = encoder.embed_images([corpus / p for p in some.path])
    np.testing.assert_allclose(np.stack(some.vector.to_numpy()), expected, atol=1e-5)
    assert set(frame.label) == {"blue", "green", "red", "yellow"}
    assert main(["embed", str(corpus), "--model", str(tmp_path / "missing.onnx"), "--out", str(out)]) == 4
    assert capsys.readouterr().err.startswith("moco: error: encoder not found")
