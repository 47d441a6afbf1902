"""The parts of ``moco index`` on their own, with numpy vectors and tiny files: FAISS choice, recall and
ground truth; the LMDB store; resumable shards; scanning rules; the directory layout and its errors."""

from __future__ import annotations

import errno
import json
import os

import faiss
import numpy as np
import pytest

from moco_retrieval.contracts.atomic import output_errors
from moco_retrieval.contracts.errors import ArtifactError, ConfigError, DataError, IndexBuildError, OutputError
from moco_retrieval.indexer import metadata
from moco_retrieval.indexer.factory import Factory
from moco_retrieval.indexer.faiss_index import build_index, choose_factory, exact_knn, read_flags, recall_at_k
from moco_retrieval.indexer.layout import IndexLayout, current_generation
from moco_retrieval.indexer.metadata import MetadataStore, link_store
from moco_retrieval.indexer.scan import read_labels_csv, scan_folder
from moco_retrieval.indexer.shards import WorkShards, discard_other_models
from moco_retrieval.indexer.vectors import block_dtype


def _clustered(n: int, d: int = 32, clusters: int = 20, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, d))
    x = centers[rng.integers(0, clusters, n)] + 0.4 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _source(ids: np.ndarray, xb: np.ndarray, block: int = 700):
    return lambda: iter([(ids[i : i + block], xb[i : i + block]) for i in range(0, len(ids), block)])


# -- FAISS ------------------------------------------------------------------------------------------------------
def test_exact_knn__equals_brute_force_over_blocks():
    xb = _clustered(2000)
    ids = np.arange(2000, dtype=np.int64) * 5 + 3
    xq = xb[::97]
    D, I = exact_knn(xq, _source(ids, xb), 10)
    scores = xq @ xb.T
    want = np.argsort(-scores, axis=1)[:, :10]
    np.testing.assert_array_equal(I, ids[want])
    np.testing.assert_allclose(D, np.take_along_axis(scores, want, 1), rtol=1e-5)


def test_recall_at_k__counts_shared_ids():
    assert recall_at_k(np.array([[1, 2, 3], [4, 5, 6]]), np.array([[3, 2, 9], [4, 5, 6]])) == pytest.approx(5 / 6)


def test_choose_factory__auto_grows_with_corpus_and_memory():
    assert choose_factory("auto", 5_000, 512) == "IDMap2,Flat"
    assert choose_factory("auto", 500_000, 512, memory=64 << 30) == "IDMap2,HNSW32"
    assert choose_factory("auto", 5_000_000, 512, memory=64 << 30).endswith(",Flat")
    assert choose_factory("auto", 5_000_000, 512, memory=64 << 30).startswith("IVF")
    assert choose_factory("auto", 50_000_000, 512, memory=64 << 30).endswith(",PQ64x8np")
    assert choose_factory("HNSW16", 10, 8) == "IDMap2,HNSW16"  # a factory string without ids gets IDMap2
    assert choose_factory("IVF4,Flat", 10, 8) == "IVF4,Flat"
    with pytest.raises(ConfigError, match="factory string"):
        choose_factory("bogus", 10, 8)


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivf", "ivfpq"])
def test_build_index__ids_kept_recall_measured_and_stored_on_cpu(index_type, tmp_path):
    n, d = 3000, 32
    xb = _clustered(n, d)
    ids = np.arange(n, dtype=np.int64) * 2 + 100
    factory = choose_factory(index_type, n, d)
    built = build_index(factory, d, n, _source(ids, xb), use_gpu=False)
    assert built.index.ntotal == n and 0 < built.recall_at_10 <= 1
    if index_type == "flat":
        assert built.exact and built.recall_at_10 == 1.0
    else:
        # the recall it reports is the recall one measures independently with the stored parameters
        faiss.write_index(built.index, str(tmp_path / "x.faiss"))
        index = faiss.read_index(str(tmp_path / "x.faiss"))
        xq = xb[1::37]
        _, I_ref = exact_knn(xq, _source(ids, xb), 10)
        assert recall_at_k(index.search(xq, 10)[1], I_ref) == pytest.approx(built.recall_at_10, abs=0.08)
        if index_type in ("hnsw", "ivf"):
            assert built.recall_at_10 >= 0.95 and built.search_params
    D, I = built.index.search(xb[:5], 1)
    if index_type != "ivfpq":
        np.testing.assert_array_equal(I[:, 0], ids[:5])


def test_build_index__wrong_count_is_an_index_build_error():
    from moco_retrieval.contracts.errors import IndexBuildError

    xb = _clustered(100, 8)
    with pytest.raises(IndexBuildError, match="expected 150"):
        build_index("IDMap2,Flat", 8, 150, _source(np.arange(100), xb))


@pytest.mark.parametrize(
    "factory, kind, nlist, pq_m, exact",
    [
        ("IDMap2,Flat", "flat", None, None, True),
        ("IDMap2,HNSW32", "hnsw", None, None, False),
        ("IVF1024,Flat", "ivf", 1024, None, False),
        ("IVF1024,PQ64x8np", "ivfpq", 1024, 64, False),
        ("OPQ16_64,IVF1024,Flat", "custom", 1024, None, False),  # "PQ" in the string, but Flat codes
        ("IVF1024_HNSW32,PQ16", "custom", 1024, 16, False),
        ("IDMap2,PCA16,Flat", "custom", None, None, False),
    ],
)
def test_factory__questions_are_answered_from_its_components(factory, kind, nlist, pq_m, exact):
    parsed = Factory.parse(factory)
    assert (parsed.kind, parsed.nlist, parsed.pq_m, parsed.exact) == (kind, nlist, pq_m, exact)
    assert parsed.is_ivf == (nlist is not None) and parsed.pq_codes == (pq_m is not None)


def test_factory__opq_with_flat_codes_keeps_float32_blocks_and_no_re_ranking():
    n, d = 2000, 32
    xb = _clustered(n, d)
    ids = np.arange(n, dtype=np.int64)
    factory = choose_factory("OPQ8_32,IVF16,Flat", n, d)
    assert block_dtype(factory) == np.float32 and block_dtype("IVF16,PQ8x4np") == np.float16
    built = build_index(factory, d, n, _source(ids, xb), use_gpu=False)
    assert "refine" not in built.search_params and built.recall_at_10 > 0.9
    assert read_flags(factory) == faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY  # IVF lists are mapped


# -- LMDB -------------------------------------------------------------------------------------------------------
def _rec(i: int, path: str, sha: str) -> dict:
    return {
        "id": i,
        "path": path,
        "label": "a",
        "width": 1,
        "height": 1,
        "bytes": 1,
        "sha256": sha,
        "mtime": 0.0,
        "mtime_ns": 0,
    }


def test_metadata__duplicates_tombstones_and_promotion(tmp_path):
    with MetadataStore(tmp_path / "m", readonly=False) as store:
        store.add_items(
            [_rec(0, "a.png", "s1"), _rec(1, "b.png", "s1"), _rec(2, "c.png", "s1"), _rec(3, "d.png", "s2")]
        )
        assert [store.record(i)["duplicate_of"] for i in range(4)] == [None, 0, 0, None]
        store.remove_items([0], "g000002")  # the original goes: the next copy becomes the original
        assert store.record(0) is None and store.tombstone(0)["removed_in"] == "g000002"
        assert store.record(1)["duplicate_of"] is None and store.record(2)["duplicate_of"] == 1
        assert store.ids_of_sha256("s1") == [1, 2] and store.id_of_path("a.png") is None
        assert store.next_id() == 4 and store.count() == 3
        store.sync()
    ro = MetadataStore(tmp_path / "m")  # read-only, lock-free; a second open in this process shares it
    ro2 = MetadataStore(tmp_path / "m")
    assert [r["id"] for r in ro.iter_records()] == [1, 2, 3] and ro2.records([3, 0, -1])[1:] == [None, None]
    ro.close()
    assert ro2.record(3)["path"] == "d.png"
    ro2.close()


def test_metadata__add_items_in_chunks_finds_duplicates_and_used_ids_across_them(tmp_path, monkeypatch):
    monkeypatch.setattr(metadata, "WRITE_CHUNK", 2)  # each transaction writes its chunk in one putmulti per db
    with MetadataStore(tmp_path / "m", readonly=False) as store:
        stored = store.add_items([_rec(i, f"{i}.png", "dup" if i in (0, 3, 4) else f"s{i}") for i in range(5)])
        assert [r.duplicate_of for r in stored] == [None, None, None, 0, 0]  # across chunks and within one
        assert store.ids_of_sha256("dup") == [0, 3, 4] and store.id_of_path("4.png") == 4 and store.next_id() == 5
        for again in ([_rec(5, "5.png", "s5"), _rec(5, "6.png", "s6")], [_rec(2, "x.png", "sx")]):
            with pytest.raises(IndexBuildError, match="id [25] is already used"):
                store.add_items(again)  # twice in one chunk, or already in the store: nothing of the chunk written
        assert store.count() == 5 and store.id_of_path("5.png") is None and store.record(2).path == "2.png"
        assert store.label_ids("a").tolist() == [0, 1, 2, 3, 4]


def test_metadata__a_records_bytes_are_the_json_encoders_whatever_it_holds(tmp_path):
    # to_json formats the usual types into a template: byte for byte what the sorted-key encoder writes, for
    # names with quotes, escapes, non-ASCII and surrogate-escaped bytes, no label, a duplicate, odd floats and
    # ints that are not plain ints (the encoder's way for those)
    from dataclasses import replace

    from moco_retrieval.indexer.records import ItemRecord

    # every field a different value: a value put in another field's place in the template shows
    base = ItemRecord(0, "a.png", "cls", 28, 27, 700, "ab" * 32, 1.7e9 + 0.123456, 1_700_000_000_123_456_789)
    odd = [
        {},
        {"path": 'dir "q"/x\\y\n\t.png', "label": None},
        {"path": "caf\u00e9/\u65e5\u672c/\u2028.png", "label": "\u00e9t\u00e9", "duplicate_of": 5},
        {"path": os.fsdecode(b"bad\xff\xfe.png"), "id": 2**62, "mtime": 0.0, "mtime_ns": 0},
        {"mtime": 1e-7},
        {"mtime": 1e22},
        {"mtime": 5},  # an int where a float is usual
        {"width": np.int64(28)},  # not a plain int: the encoder refuses it, as it always did
    ]
    for change in odd:
        rec = replace(base, **change)
        try:
            expected = json.dumps(rec.to_dict(), separators=(",", ":"), sort_keys=True).encode()
        except TypeError:
            with pytest.raises(TypeError):
                rec.to_json()
            continue
        assert rec.to_json() == expected, change
    with MetadataStore(tmp_path / "m", readonly=False) as store:  # the label keys of a chunk share one prefix
        store.add_items([{**_rec(i, f"{i}.png", f"s{i}"), "label": "b" if i % 2 else "a"} for i in range(6)])
        assert store.label_ids("a").tolist() == [0, 2, 4] and store.label_ids("b").tolist() == [1, 3, 5]
        assert metadata.label_key("a", 4) == metadata.label_prefix("a") + metadata.id_key(4)


def test_metadata__ids_above_the_store_skip_the_per_record_check_and_others_do_not(tmp_path):
    # a chunk of increasing ids above every id held (live, removed, or in the base under a delta) is fresh by a
    # range check; an id at or below that bound is read record by record and refused when it is in use
    with MetadataStore(tmp_path / "m", readonly=False) as store:
        store.add_items([_rec(i, f"{i}.png", "same") for i in range(4)])
        store.remove_items([3], "g000002")  # the highest id is now a tombstone only
        with pytest.raises(IndexBuildError, match="id 3 is already used"):
            store.add_items([_rec(3, "again.png", "s3")])
        stored = store.add_items([_rec(4, "4.png", "same"), _rec(6, "6.png", "same")])
        assert [r.duplicate_of for r in stored] == [0, 0] and store.ids_of_sha256("same") == [0, 1, 2, 4, 6]
        store.sync()
    for ids in ([], [7], [0, 12, 345678901234]):
        assert metadata._dump_ids(ids) == metadata._dump(ids)
    link_store(tmp_path / "m", tmp_path / "base")
    with MetadataStore(tmp_path / "base", readonly=False, delta=tmp_path / "delta") as layered:
        with pytest.raises(IndexBuildError, match="id 6 is already used"):
            layered.add_items([_rec(6, "x.png", "sx")])  # in the base only
        layered.add_items([_rec(7, "7.png", "s7")])
        assert layered.record(7).path == "7.png" and layered.record(6).path == "6.png"


def test_metadata__a_read_only_store_keeps_decoded_records_up_to_its_cap(tmp_path, monkeypatch):
    with MetadataStore(tmp_path / "m", readonly=False) as store:
        store.add_items([_rec(i, f"{i}.png", f"s{i}") for i in range(5)])
        store.sync()
    decoded = []
    load = metadata._load_item
    monkeypatch.setattr(metadata, "_load_item", lambda raw: decoded.append(1) or load(raw))
    monkeypatch.setattr(metadata, "RECORD_CACHE", 3)
    with MetadataStore(tmp_path / "m") as ro:
        assert [r.path for r in ro.records([0, 1, 0, 1])] == ["0.png", "1.png", "0.png", "1.png"]
        assert len(decoded) == 2  # each id decoded once
        assert ro.records([1, 9, -1]) == [ro.record(1), None, None] and len(decoded) == 3  # 9: unknown, kept too
        assert [r.path for r in ro.records([2, 3, 4])] == ["2.png", "3.png", "4.png"]  # past the cap: cleared
        assert len(ro._cache) <= 3 and len(decoded) == 6
        assert ro.record(4).path == "4.png" and len(decoded) == 6


def test_item_record__stored_json_round_trips_byte_for_byte(tmp_path):
    from moco_retrieval.indexer.records import FIELDS, ItemRecord
    from moco_retrieval.serve.answers import Item

    with MetadataStore(tmp_path / "m", readonly=False) as store:
        (stored,) = store.add_items([_rec(0, "a.png", "s1")])
        with store.env.begin() as txn:
            raw = bytes(txn.get(metadata.id_key(0), db=store._db["items"]))
    # the JSON as this code always wrote it: a dict with sorted keys, duplicate_of set
    assert (
        raw
        == json.dumps(dict(_rec(0, "a.png", "s1"), duplicate_of=None), separators=(",", ":"), sort_keys=True).encode()
    )
    assert ItemRecord.from_dict(json.loads(raw)) == stored and list(stored.to_dict()) == sorted(FIELDS)
    assert stored["path"] == stored.path == "a.png"
    # what clients see of a record are fields of the stored one (plus image_url and score)
    assert set(Item.model_fields) - {"image_url"} <= set(FIELDS)


def test_metadata__map_grows_when_full(tmp_path, monkeypatch):
    monkeypatch.setattr(metadata, "INITIAL_MAP_SIZE", 256 << 10)
    with MetadataStore(tmp_path / "m", readonly=False) as store:
        store.add_items([_rec(i, f"dir/{i:06d}_{'x' * 100}.png", f"{i:064x}") for i in range(5000)])
        assert store.count() == 5000 and store.env.info()["map_size"] > 256 << 10


def test_metadata__missing_store_is_an_artifact_error(tmp_path):
    with pytest.raises(ArtifactError, match="--rebuild"):
        MetadataStore(tmp_path / "nothing")


# -- shards -----------------------------------------------------------------------------------------------------
def test_shards__only_finished_shards_survive_and_other_model_discards(tmp_path):
    shards = WorkShards(tmp_path / "work", "sha-a", 4, shard_size=2)
    for i in range(5):
        shards.add({"path": f"{i}.png", "stat_bytes": i, "mtime_ns": i}, np.full(4, i, dtype=np.float32))
    # 2 finished shards; the 5th result is pending (as if the process were killed now)
    (shards.dir / "shard_000_000009.vec.npy").write_bytes(b"half-written")  # this rank's, no .done marker
    (shards.dir / "shard_001_000000.vec.npy").write_bytes(b"being written")  # another rank's: left alone
    again = WorkShards(tmp_path / "work", "sha-a", 4, shard_size=2)
    assert len(again) == 4 and not (shards.dir / "shard_000_000009.vec.npy").exists()
    assert (shards.dir / "shard_001_000000.vec.npy").exists()
    assert again.lookup("3.png", 3, 3) is not None and again.lookup("3.png", 3, 4) is None  # changed mtime
    np.testing.assert_array_equal(again.vector("3.png"), np.full(4, 3))
    assert again.lookup("4.png", 4, 4) is None
    other = WorkShards(tmp_path / "work", "sha-b", 4)
    assert len(other) == 0
    discard_other_models(tmp_path / "work", other.dir)
    assert not shards.dir.exists() and other.dir.exists()


def test_shards__ranks_write_their_own_and_read_everyones(tmp_path):
    rank1 = WorkShards(tmp_path / "work", "sha-a", 4, shard_size=2, rank=1, dtype=np.float16)
    rank1.add({"path": "b.png", "stat_bytes": 1, "mtime_ns": 1}, np.full(4, 0.5, dtype=np.float32))
    rank1.flush()
    rank0 = WorkShards(tmp_path / "work", "sha-a", 4, shard_size=2, rank=0)
    rank0.add({"path": "a.png", "stat_bytes": 1, "mtime_ns": 1}, np.full(4, 0.25, dtype=np.float32))
    rank0.flush()
    assert sorted(p.name for p in rank0.dir.glob("*.done")) == ["shard_000_000000.done", "shard_001_000000.done"]
    assert rank0.lookup("b.png", 1, 1) is not None and rank0.vector("b.png").dtype == np.float32
    np.testing.assert_array_equal(rank0.vectors(["a.png", "b.png"]), [[0.25] * 4, [0.5] * 4])
    assert np.load(rank1.dir / "shard_001_000000.vec.npy").dtype == np.float16


def test_shards__vectors_gathers_rows_across_shards_in_the_order_asked(tmp_path):
    shards = WorkShards(tmp_path / "work", "sha-a", 3, shard_size=4)
    for i in range(11):  # shards of 4, 4 and 3 results; 5.png unreadable (no row), so rows differ from positions
        vector = None if i == 5 else np.full(3, i, dtype=np.float32)
        shards.add({"path": f"{i}.png", "stat_bytes": i, "mtime_ns": i}, vector)
    shards.flush()
    asked = ["9.png", "0.png", "6.png", "3.png", "10.png", "4.png", "6.png"]  # shuffled, one twice
    got = WorkShards(tmp_path / "work", "sha-a", 3).vectors(asked)
    np.testing.assert_array_equal(got, [[int(p.split(".")[0])] * 3 for p in asked])


# -- scanning ---------------------------------------------------------------------------------------------------
def test_scan__sorted_labels_hidden_symlinks(tmp_path):
    root = tmp_path / "imgs"
    for rel in ["b/2.png", "b/1.JPG", "a/x/3.png", "top.png", ".hid/4.png", "a/.5.png", "a/6.txt"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    os.symlink(root / "b", root / "c")  # a second link to folder b: walked once
    os.symlink(root / "a" / "x", root / "a" / "x" / "loop")  # a loop: not walked again
    os.symlink(root / "gone.png", root / "b" / "broken.png")  # a broken link: reported
    os.symlink(root / "top.png", root / "b" / "linked.png")  # a linked file: indexed under its link
    result = scan_folder(root)
    assert [e.path for e in result.entries] == ["a/x/3.png", "b/1.JPG", "b/2.png", "b/linked.png", "top.png"]
    assert [e.label for e in result.entries] == ["a", "b", "b", "b", None]
    assert result.skipped == [("b/broken.png", "broken symlink")]


def test_scan__labels_csv_overrides_folders(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "1.png").write_bytes(b"x")
    (tmp_path / "d" / "2.png").write_bytes(b"x")
    (tmp_path / "l.csv").write_text("path,label\n./sub/1.png,cat\n")
    result = scan_folder(tmp_path / "d", read_labels_csv(tmp_path / "l.csv"))
    assert [(e.path, e.label) for e in result.entries] == [("2.png", None), ("sub/1.png", "cat")]
    (tmp_path / "bad.csv").write_text("a,b,c\n")
    with pytest.raises(ConfigError, match="path,label"):
        read_labels_csv(tmp_path / "bad.csv")


def test_scan__missing_or_empty_folder_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        scan_folder(tmp_path / "nope")
    with pytest.raises(DataError, match="no image files"):
        scan_folder(tmp_path)


# -- layout -----------------------------------------------------------------------------------------------------
def test_layout__full_disk_and_non_index_are_one_line_errors(tmp_path):
    with pytest.raises(OutputError, match="disk full"):
        with output_errors(tmp_path / "x"):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(ArtifactError, match="not an index directory"):
        current_generation(tmp_path)
    layout = IndexLayout(tmp_path)
    layout.current_file.write_text("g000004\n")
    assert current_generation(tmp_path) == "g000004" == layout.current()
    assert json.dumps(str(layout.generation("g000004").manifest)).endswith('g000004/manifest.json"')


class _Drawn:
    """An iterable of paths that counts how many have been drawn from it."""

    def __init__(self, paths: list[str]):
        self.paths, self.drawn = paths, 0

    def __iter__(self):
        for p in self.paths:
            self.drawn += 1
            yield p


def test_decode_files__a_decoding_process_that_dies_is_a_one_line_error_not_a_hang(tmp_path):
    """A decoder killed mid-run (out of memory, a signal, a crash on a file) ends the stream with a DataError that
    says to rerun; ``multiprocessing.Pool`` waited forever for the files it had lost."""
    import multiprocessing
    import signal

    from PIL import Image

    from moco_retrieval.contracts.encoder_format import RESIZE_POLICY
    from moco_retrieval.indexer.decode import decode_files

    Image.new("RGB", (16, 16), (200, 0, 0)).save(tmp_path / "a.png")
    paths = ["a.png"] * 400
    stream = decode_files(tmp_path, paths, 16, RESIZE_POLICY, workers=1, chunksize=1, window=4)
    assert next(stream).error is None
    decoders = multiprocessing.active_children()
    assert decoders
    for process in decoders:
        os.kill(process.pid, signal.SIGKILL)
    with pytest.raises(DataError, match="a decoding process died.*run the same command again"):
        for _ in stream:
            pass


def test_decode_files__decoders_end_when_the_process_that_started_them_is_killed(tmp_path):
    """``kill -9`` of a run leaves no decode process (nor its fork server) behind."""
    import signal
    import subprocess
    import sys
    import time

    from PIL import Image

    Image.new("RGB", (16, 16), (200, 0, 0)).save(tmp_path / "a.png")
    script = (
        "import multiprocessing, sys, time\n"
        "from pathlib import Path\n"
        "from moco_retrieval.indexer.decode import decode_files\n"
        "if __name__ == '__main__':\n"
        "    stream = decode_files(Path(sys.argv[1]), ['a.png'] * 400, 16, 'shorter_side_center_crop', 1, 1, 4)\n"
        "    next(stream)\n"
        "    print(' '.join(str(p.pid) for p in multiprocessing.active_children()), flush=True)\n"
        "    time.sleep(60)\n"
    )
    (tmp_path / "run.py").write_text(script)
    run = subprocess.Popen([sys.executable, str(tmp_path / "run.py"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    decoders = [int(pid) for pid in run.stdout.readline().split()]
    assert decoders
    run.send_signal(signal.SIGKILL)
    run.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"  # a zombie waits for init to reap it: ended
        except (ProcessLookupError, FileNotFoundError):
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in decoders) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in decoders)


@pytest.mark.parametrize("chunksize", [1, 3])  # 3: 03-05 in one chunk, its array without a row for 04.png
def test_decode_files__windows_keep_order_and_bound_the_files_decoded_ahead(tmp_path, chunksize):
    """DECODE_WINDOW, crossed with a window of 3: results in input order, a bad file in its place, each file's
    own pixels, the same as decoding in this process, and never more than two windows handed to the pool ahead
    of the reader."""
    from PIL import Image

    from moco_retrieval.contracts.encoder_format import RESIZE_POLICY
    from moco_retrieval.indexer.decode import decode_files

    for i in range(11):
        Image.new("RGB", (20 + i, 16), (10 * i, 0, 0)).save(tmp_path / f"{i:02d}.png")
    (tmp_path / "04.png").write_bytes(b"not an image")
    paths = sorted(p.name for p in tmp_path.glob("*.png"))
    alone = list(decode_files(tmp_path, paths, 16, RESIZE_POLICY, 0))
    drawn = _Drawn(paths)
    stream = decode_files(tmp_path, drawn, 16, RESIZE_POLICY, workers=2, chunksize=chunksize, window=3)
    first = next(stream)
    assert drawn.drawn <= 2 * 3  # two windows handed to the pool, not the whole list
    pooled = [first, *stream]
    assert [(d.path, d.width, d.error is None) for d in pooled] == [(d.path, d.width, d.error is None) for d in alone]
    for d, a in zip(pooled, alone):
        assert (d.pixels is None and a.pixels is None) or np.array_equal(d.pixels, a.pixels), d.path
    assert [d.path for d in pooled if d.error] == ["04.png"] and drawn.drawn == len(paths)
