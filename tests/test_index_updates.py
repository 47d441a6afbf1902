"""Updates that cost what changed: a generation is a shared base plus a small delta, and every generation stays
exactly itself. Real FAISS, real LMDB, real files scanned; vectors come from a synthetic embedder (no model)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from moco_retrieval.indexer import build as build_module, commit as commit_module
from moco_retrieval.indexer import update
from moco_retrieval.indexer.build import IndexConfig, build_index_dir
from moco_retrieval.indexer.index_dir import IndexDirectory, current_generation
from moco_retrieval.indexer.metadata import MetadataStore
from tests.index_fixtures import SyntheticEmbedder, touch_files

N = 600


def _cfg(data: Path, emb: SyntheticEmbedder, out: Path, **kw) -> IndexConfig:
    values = dict(workers=0, batch_size=8, progress=False, shard_size=64)
    values.update(kw)
    return IndexConfig(str(data), str(emb.encoder.path), str(out), **values)


def _names(start: int, stop: int) -> list[str]:
    return [f"c{i % 7}/f{i:05d}.png" for i in range(start, stop)]


def _check_consistent(out: Path) -> dict[str, int]:
    """FAISS ids == LMDB ids, every record found by its path, nothing orphaned; returns path -> id."""
    with IndexDirectory.open(out) as d:
        faiss_ids = d.index.ids()
        assert len(faiss_ids) == len(set(faiss_ids.tolist())) == d.index.ntotal == d.manifest.count
        with MetadataStore(
            d.generation_path / "meta.lmdb",
            delta=(d.generation_path / "delta.lmdb") if (d.generation_path / "delta.lmdb").is_dir() else None,
        ) as store:
            lmdb_ids = store.live_ids()
            by_path = dict(store.iter_ids_with_paths())
        np.testing.assert_array_equal(faiss_ids, lmdb_ids)
        assert sorted(by_path.values()) == lmdb_ids.tolist()
        for rec in d.records(lmdb_ids.tolist()):
            assert rec is not None and by_path[rec["path"]] == rec["id"]
        assert d.manifest.labels == {
            f"c{j}": sum(p.startswith(f"c{j}/") for p in by_path)
            for j in range(7)
            if any(p.startswith(f"c{j}/") for p in by_path)
        }
        return by_path


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivf", "ivfpq", "ivfpq-disk"])
def test_update__add_remove_round_trips_keep_faiss_ids_equal_to_lmdb_ids(index_type, tmp_path):
    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model")
    touch_files(data, _names(0, N))
    kw = {"index_type": "ivfpq", "max_index_memory": 1000} if index_type == "ivfpq-disk" else {"index_type": index_type}
    first = build_index_dir(_cfg(data, emb, out, **kw), embedder=emb)
    assert first.mode == "build" and first.count == N
    if index_type == "ivfpq-disk":
        assert (out / "generations" / first.generation / "vectors.ivfdata").is_file()
    live = _check_consistent(out)
    rng = np.random.default_rng(3)
    next_name = N
    for round_no in range(3):
        gone = sorted(rng.choice(sorted(live), size=25, replace=False).tolist())  # base and delta items
        for name in gone:
            (data / name).unlink()
        new = _names(next_name, next_name + 40)
        next_name += 40
        touch_files(data, new)
        changed = sorted(set(live) - set(gone))[round_no::97][:5]
        for name in changed:
            st = (data / name).stat()
            os.utime(data / name, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        result = build_index_dir(_cfg(data, emb, out, **kw), embedder=emb)
        assert result.mode == "update" and result.compacted is None
        assert (result.added, result.removed, result.updated) == (40, 25, 5)
        assert emb.calls[-1] == 45  # only the new and changed files were embedded
        after = _check_consistent(out)
        assert set(after) == (set(live) - set(gone)) | set(new)
        for name in set(after) - set(changed) - set(new):
            assert after[name] == live[name]  # unchanged files keep their ids
        live = after
        with IndexDirectory.open(out) as d:
            assert d.manifest.delta_count == sum(1 for i in after.values() if i >= d.manifest.base_next_id)
            assert d.manifest.base_count == N and d.manifest.count == len(after)
            xq = np.stack([emb.vector(f"{p}:{(data / p).stat().st_mtime_ns}") for p in sorted(after)[::50]])
            _, I = d.index.search(xq, 5)
            assert set(I.ravel().tolist()) - {-1} <= set(after.values())  # nothing removed comes back
    compacted = build_index_dir(_cfg(data, emb, out, compact="now", **kw), embedder=emb)
    assert compacted.mode == "compaction" and compacted.delta_count == compacted.removed_count == 0
    assert _check_consistent(out) == live
    with IndexDirectory.open(out) as d:
        assert not (d.generation_path / "delta.lmdb").exists() and d.manifest.recall_at_10 > 0


def test_update__reader_of_old_generation_sees_only_old_items(tmp_path):
    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model")
    touch_files(data, _names(0, N))
    build_index_dir(_cfg(data, emb, out, index_type="flat"), embedder=emb)
    build_index_dir(_cfg(data, emb, out, index_type="flat", compact="never"), embedder=emb)
    touch_files(data, _names(N, N + 30))  # a delta that the next update extends
    build_index_dir(_cfg(data, emb, out, index_type="flat"), embedder=emb)
    old = IndexDirectory.open(out)
    old_live = _check_consistent(out)
    old_ids = set(old.index.ids().tolist())
    gone = sorted(old_live)[::40]
    for name in gone:
        (data / name).unlink()
    new = _names(N + 30, N + 80)
    touch_files(data, new)
    result = build_index_dir(_cfg(data, emb, out, index_type="flat"), embedder=emb)  # in this process, beside it
    assert current_generation(out) == result.generation != old.generation
    # the old view is exactly the old generation: same ids, records, searches
    assert set(old.index.ids().tolist()) == old_ids and old.index.ntotal == len(old_ids)
    assert all(old.record(old_live[p])["path"] == p for p in gone)
    xq = np.stack([emb.vector(f"{p}:{(data / p).stat().st_mtime_ns}") for p in new[:10]])
    _, I_old = old.index.search(xq, 20)
    assert set(I_old.ravel().tolist()) - {-1} <= old_ids
    with IndexDirectory.open(out) as fresh:
        new_ids = set(fresh.index.ids().tolist())
        assert old_ids - new_ids == {old_live[p] for p in gone} and len(new_ids - old_ids) == len(new)
        _, I_new = fresh.index.search(xq, 1)
        assert all(fresh.record(int(i))["path"] in new for i in I_new[:, 0])
        assert all(old.record(i) is None for i in new_ids - old_ids)
        assert all(fresh.record(old_live[p]) is None for p in gone)
    # a compaction published meanwhile changes nothing for the old view either
    build_index_dir(_cfg(data, emb, out, index_type="flat", compact="now"), embedder=emb)
    assert set(old.index.ids().tolist()) == old_ids
    assert [r["path"] for r in old.records(sorted(old_ids)[:50])] == [
        p for p, _ in sorted(old_live.items(), key=lambda kv: kv[1])
    ][:50]
    old.close()


def test_update__shares_the_base_and_writes_only_the_delta(tmp_path):
    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model")
    touch_files(data, _names(0, N))
    first = build_index_dir(_cfg(data, emb, out, index_type="ivf"), embedder=emb)
    touch_files(data, _names(N, N + 10))
    second = build_index_dir(_cfg(data, emb, out, index_type="ivf"), embedder=emb)
    a, b = out / "generations" / first.generation, out / "generations" / second.generation
    for rel in ("vectors.faiss", "trained.faiss", "meta.lmdb/data.mdb"):
        assert (a / rel).stat().st_ino == (b / rel).stat().st_ino  # the same file, not a copy
    assert (b / "delta.faiss").stat().st_size < (b / "vectors.faiss").stat().st_size / 10
    with IndexDirectory.open(out) as d:
        assert d.manifest.base_count == N and d.manifest.delta_count == 10 and d.manifest.base_next_id == N
        assert d.manifest.search_params == first.search_params  # the delta is searched with the same nprobe


def test_update__auto_compaction_past_the_threshold(tmp_path, monkeypatch):
    monkeypatch.setattr(update, "COMPACT_MIN", 10)
    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model")
    touch_files(data, _names(0, N))
    build_index_dir(_cfg(data, emb, out, index_type="hnsw"), embedder=emb)
    touch_files(data, _names(N, N + 20))  # 20 changes: under 5% of 600
    small = build_index_dir(_cfg(data, emb, out, index_type="hnsw"), embedder=emb)
    assert small.compacted is None and small.delta_count == 20
    touch_files(data, _names(N + 20, N + 40))  # 40 changes in all: past 5%
    big = build_index_dir(_cfg(data, emb, out, index_type="hnsw"), embedder=emb)
    assert big.compacted == big.generation == "g000004" and big.delta_count == 0
    report = big.timings
    assert report["compact_index"] > 0 and report["publish"] > 0
    assert len(_check_consistent(out)) == N + 40


def test_update__changed_list_looks_only_at_the_listed_files(tmp_path):
    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model")
    touch_files(data, _names(0, N))
    build_index_dir(_cfg(data, emb, out, index_type="flat"), embedder=emb)
    before = _check_consistent(out)
    touch_files(data, _names(N, N + 3) + _names(N + 3, N + 5))  # two of these new files are not listed
    (data / _names(0, 1)[0]).unlink()
    listing = tmp_path / "changes.txt"
    listing.write_text("# added and deleted\n" + "\n".join(_names(N, N + 3) + _names(0, 1) + ["c1/never.png"]) + "\n")
    result = build_index_dir(_cfg(data, emb, out, index_type="flat", changed_list=str(listing)), embedder=emb)
    assert (result.added, result.removed, result.updated) == (3, 1, 0)
    assert result.unchanged == N - 1
    after = _check_consistent(out)
    assert set(after) == (set(before) - set(_names(0, 1))) | set(_names(N, N + 3))


def test_update__a_crash_at_any_step_leaves_the_live_generation_and_a_rerun_finishes(tmp_path, monkeypatch):
    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model")
    touch_files(data, _names(0, N))
    build_index_dir(_cfg(data, emb, out, index_type="ivf"), embedder=emb)
    live = _check_consistent(out)
    touch_files(data, _names(N, N + 50))

    class Crash(BaseException):
        pass

    def crash(*args, **kwargs):
        raise Crash

    steps = [(update, "update_faiss"), (commit_module, "_copy_encoder"), (build_module, "publish")]
    for module, name in steps:
        with monkeypatch.context() as patch:
            patch.setattr(module, name, crash)
            with pytest.raises(Crash):
                build_index_dir(_cfg(data, emb, out, index_type="ivf"), embedder=emb)
        assert current_generation(out) == "g000001" and _check_consistent(out) == live
    # ... and while compacting, after the update was published
    with monkeypatch.context() as patch:
        patch.setattr(commit_module, "materialize", crash)
        with pytest.raises(Crash):
            build_index_dir(_cfg(data, emb, out, index_type="ivf", compact="now"), embedder=emb)
    assert current_generation(out) == "g000002"
    after = _check_consistent(out)
    assert set(after) == set(live) | set(_names(N, N + 50))
    assert sum(emb.calls) == N + 50  # the crashed runs' shards were reused: nothing embedded twice
    done = build_index_dir(_cfg(data, emb, out, index_type="ivf", compact="now"), embedder=emb)
    assert done.mode == "compaction" and _check_consistent(out) == after
    assert not list((out / "generations").glob(".tmp-*"))


def test_update__hnsw_index_type_switch_rebuilds(tmp_path):
    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model")
    touch_files(data, _names(0, 200))
    build_index_dir(_cfg(data, emb, out, index_type="flat"), embedder=emb)
    switched = build_index_dir(_cfg(data, emb, out, index_type="hnsw"), embedder=emb)
    assert switched.mode == "compaction" and switched.factory == "IDMap2,HNSW32"
    assert len(_check_consistent(out)) == 200


def _vectors_by_path(out: Path) -> dict[str, np.ndarray]:
    """path -> the stored vector of every item of the live generation."""
    from moco_retrieval.indexer.layout import IndexLayout
    from moco_retrieval.indexer.vectors import BlockVectors

    with IndexDirectory.open(out) as d:
        ids = d.index.ids()
        found, vectors = BlockVectors(IndexLayout(out), d.manifest.vector_blocks).get(ids)
        assert found.all()
        return {rec.path: v for rec, v in zip(d.records(ids.tolist()), vectors)}


@pytest.mark.parametrize("chunk", [10_000, 5])  # the default, and lowered below the 32 files: 7 chunks
def test_update__files_whose_bytes_did_not_change_keep_their_vectors_without_the_encoder(tmp_path, monkeypatch, chunk):
    """A copy without -p, a git checkout or an edited labels CSV changes a file's mtime or label, not its bytes.
    The update compares such a file's sha256 with its record's and reuses the stored vector; only the file whose
    bytes changed goes through the (real, ONNX) encoder."""
    from PIL import Image

    from moco_retrieval.indexer import reuse
    from moco_retrieval.trainer.demo_data import write_demo_dataset
    from tests.index_fixtures import write_tiny_encoder

    monkeypatch.setattr(reuse, "REUSE_CHUNK", chunk)

    data = write_demo_dataset(tmp_path / "images", per_class=4, size=24, seed=0)
    encoder = write_tiny_encoder(tmp_path / "tiny.onnx")
    paths = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.png"))
    labels = tmp_path / "labels.csv"
    labels.write_text("path,label\n" + "".join(f"{p},{p.split('/')[0]}\n" for p in paths))
    out = tmp_path / "index"
    cfg = IndexConfig(str(data), str(encoder), str(out), workers=0, progress=False, labels_csv=str(labels))
    assert build_index_dir(cfg).count == len(paths)
    before = _vectors_by_path(out)
    for p in paths:  # what `cp -r` or a checkout does: new mtimes, the same bytes
        st = (data / p).stat()
        os.utime(data / p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    rewritten, relabelled = paths[0], paths[1]
    Image.new("RGB", (24, 24), (250, 10, 10)).save(data / rewritten)
    labels.write_text(labels.read_text().replace(f"{relabelled},{relabelled.split('/')[0]}", f"{relabelled},other"))

    result = build_index_dir(cfg)
    assert (result.mode, result.updated, result.embedded, result.reused) == ("update", len(paths), 1, len(paths) - 1)
    after = _vectors_by_path(out)
    assert set(after) == set(paths)
    for p in paths[1:]:
        np.testing.assert_array_equal(after[p], before[p])
    assert not np.allclose(after[rewritten], before[rewritten])
    with IndexDirectory.open(out) as d:
        assert d.record(d.id_of_path(relabelled)).label == "other"
    again = build_index_dir(cfg)  # the records now hold the new mtimes: nothing is read again
    assert (again.mode, again.embedded, again.reused) == ("unchanged", 0, 0)


def test_reuse__a_fifo_in_a_changed_files_place_is_hashed_as_unreadable_without_blocking(tmp_path):
    """The comparison reads a file as the decoders do: a FIFO that took an image's place after the scan would
    hang a plain open() for ever."""
    from moco_retrieval.indexer.reuse import _sha256_or_none

    os.mkfifo(tmp_path / "x.png")
    assert _sha256_or_none(tmp_path / "x.png") is None
    (tmp_path / "y.png").write_bytes(b"\x89PNG bytes")
    assert _sha256_or_none(tmp_path / "y.png") == hashlib.sha256(b"\x89PNG bytes").hexdigest()
