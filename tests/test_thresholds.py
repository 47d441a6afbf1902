"""Every size threshold of the index side, crossed cheaply (tiny vectors, a lowered constant) and checked to
give exactly what the same work gives without crossing it: ids, records, label counts, duplicates, vectors,
reconstructions and search results, not just "it runs" (issue 19: the suite indexes a few hundred items, so a
bug that starts at 10,000 or 1M rows would otherwise land unseen).

One test per threshold; each docstring's first line names the threshold and what would break. Vectors come
from a synthetic embedder (no model) except where an image is served or read."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from types import SimpleNamespace

import faiss
import numpy as np
import pytest

from moco_retrieval.indexer import commit as commit_module
from moco_retrieval.indexer import faiss_index, metadata, update, vectors
from moco_retrieval.indexer.build import IndexConfig, build_index_dir
from moco_retrieval.indexer.index_dir import IndexDirectory
from moco_retrieval.indexer.layout import IndexLayout
from moco_retrieval.indexer.metadata import MetadataStore
from moco_retrieval.indexer.vectors import BlockWriter, live_blocks
from tests.index_fixtures import SyntheticEmbedder, touch_files

D = 8  # vector dimension of the synthetic corpora: thresholds, not quality, are tested
_DBS = ("items", "paths", "sha256", "tombstones", "skipped", "info")


# --- helpers -------------------------------------------------------------------------------------------------


class DupEmbedder(SyntheticEmbedder):
    """A SyntheticEmbedder whose files in ``groups`` (path -> content tag) share content: the same sha256 and
    the same vector per tag, as exact duplicate files would have."""

    def __init__(self, folder: Path, groups: dict[str, str] | None = None, d: int = D):
        super().__init__(folder, d=d)
        self.groups = dict(groups or {})

    def embed_into(self, entries, shards, progress: bool = False) -> dict:
        pending = [e for e in entries if shards.lookup(e.path, e.bytes, e.mtime_ns) is None]
        for e in pending:
            content = self.groups.get(e.path, f"{e.path}:{e.mtime_ns}")
            shards.add(
                {
                    "path": e.path,
                    "stat_bytes": e.bytes,
                    "mtime_ns": e.mtime_ns,
                    "sha256": hashlib.sha256(content.encode()).hexdigest(),
                    "width": 32,
                    "height": 32,
                    "bytes": e.bytes,
                    "error": None,
                },
                self.vector(content),
            )
        shards.flush()
        self.calls.append(len(pending))
        return {
            "embedded": len(pending),
            "resumed": len(entries) - len(pending),
            "embed": 0.0,
            "decode_wait": 0.0,
            "encoder": 0.0,
            "decode_cpu": 0.0,
        }


def _cfg(data: Path, emb: SyntheticEmbedder, out: Path, **kw) -> IndexConfig:
    values = dict(workers=0, batch_size=8, progress=False, shard_size=16, index_type="flat")
    values.update(kw)
    return IndexConfig(str(data), str(emb.encoder.path), str(out), **values)


def _names(start: int, stop: int) -> list[str]:
    return [f"c{i % 3}/f{i:05d}.png" for i in range(start, stop)]


def touch(root: Path, names) -> None:
    """Empty files with an mtime fixed by their name: the synthetic vectors (keyed by path and mtime) are then
    the same in every folder and after a file is deleted and made again."""
    touch_files(root, names)
    for name in names:
        ns = 1_600_000_000 * 10**9 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
        os.utime(root / name, ns=(ns, ns))


def _queries(n: int = 12, d: int = D, seed: int = 5) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _dump_store(store: MetadataStore) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every live key and value of every named database, as the (layered) store reads."""
    with store._read() as view:
        return {db: [(k, bytes(v)) for k, v in view.items(db)] for db in _DBS}


def _dump_layer(path: Path) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every key of one LMDB layer as written (deletion markers of a delta included)."""
    with MetadataStore(path) as store, store._read() as view:
        return {db: [(k, bytes(v)) for k, v in metadata._raw_items(view, db)] for db in _DBS}


def _snapshot(out: Path, xq: np.ndarray | None = None, k: int = 10) -> dict:
    """What a generation holds and answers: ids, records, store contents, counts, vectors, reconstructions and
    (exact) search results."""
    xq = _queries() if xq is None else xq
    with IndexDirectory.open(out) as d:
        m = d.manifest
        ids = d.index.ids()
        got_ids, got_vec = [], []
        for i, x in live_blocks(IndexLayout(out), m.vector_blocks, ids)():
            got_ids.append(i)
            got_vec.append(x)
        D_, I_ = d.index.search(xq, k)
        order = np.lexsort((I_, -D_), axis=1)  # equal scores (duplicates' vectors) in id order: ties may come
        D_, I_ = np.take_along_axis(D_, order, 1), np.take_along_axis(I_, order, 1)  # either way
        snap = {
            "ids": ids,
            "records": d.records(ids.tolist()),
            "store": _dump_store(d._store),
            "count": m.count,
            "next_id": m.next_id,
            "duplicates": m.duplicates,
            "labels": m.labels,
            "block_ids": np.concatenate(got_ids) if got_ids else np.zeros(0, np.int64),
            "block_vectors": np.concatenate(got_vec) if got_vec else np.zeros((0, xq.shape[1]), np.float32),
            "reconstructed": np.stack([d.index.reconstruct(int(i)) for i in ids]),
            "search_ids": I_,
            "search_scores": D_,
        }
    np.testing.assert_array_equal(snap["block_ids"], ids)  # every live id has its stored vector, once
    if m.block_dtype == "float32":  # Flat / HNSW / IVF-Flat: the index gives back exactly the stored vectors
        np.testing.assert_array_equal(snap["reconstructed"], snap["block_vectors"])
    return snap


def _assert_same(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key in skip:
            continue
        if isinstance(a[key], np.ndarray):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        else:
            assert a[key] == b[key], key


def _count_calls(monkeypatch, owner, name: str) -> list:
    """Record the positional arguments of every call of ``owner.name`` (which still runs)."""
    calls, original = [], getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


# --- indexer/commit.py -------------------------------------------------------------------------------------


def test_record_chunk__a_full_build_in_chunks_equals_one_chunk(tmp_path, monkeypatch):
    """RECORD_CHUNK (commit.py, files per commit step of a full build): a chunked build must not shift ids, lose
    labels or miss a duplicate whose original was committed in an earlier chunk."""
    data = tmp_path / "images"
    names = _names(0, 50)
    touch(data, names)
    order = sorted(names)  # ids are given in path order
    groups = {
        order[6]: "pair",
        order[7]: "pair",  # straddles the 1st chunk boundary (7)
        order[13]: "triple",
        order[14]: "triple",
        order[29]: "triple",
    }  # and two more
    emb = DupEmbedder(tmp_path / "model", groups)
    ref = build_index_dir(_cfg(data, emb, tmp_path / "ref"), embedder=emb)
    adds = _count_calls(monkeypatch, MetadataStore, "add_items")
    monkeypatch.setattr(commit_module, "RECORD_CHUNK", 7)
    low = build_index_dir(_cfg(data, emb, tmp_path / "low"), embedder=emb)
    assert [len(c[1]) for c in adds] == [7] * 7 + [1]  # the threshold was crossed, 7 times
    assert low.count == ref.count == 50 and low.duplicates == ref.duplicates == 3
    a, b = _snapshot(tmp_path / "ref"), _snapshot(tmp_path / "low")
    _assert_same(a, b)
    by_path = {r["path"]: r for r in b["records"]}
    assert [by_path[p]["id"] for p in order] == list(range(50))
    assert by_path[order[7]]["duplicate_of"] == by_path[order[6]]["id"] == 6
    assert [by_path[order[i]]["duplicate_of"] for i in (13, 14, 29)] == [None, 13, 13]
    assert b["labels"] == {"c0": 17, "c1": 17, "c2": 16}


# --- indexer/metadata.py -----------------------------------------------------------------------------------


def test_write_chunk__build_update_and_compaction_store_the_same_in_small_transactions(tmp_path, monkeypatch):
    """WRITE_CHUNK (metadata.py, records per LMDB transaction of add_items / remove_items / materialize): a
    write split over transactions must not lose a duplicate hand-over, a tombstone or a deletion marker."""
    data = tmp_path / "images"
    names = _names(0, 60)
    touch(data, names)
    order = sorted(names)
    groups = {
        order[0]: "a",
        order[5]: "a",
        order[6]: "a",  # original, then its heir removed in the next txn
        order[10]: "b",
        order[41]: "b",  # both removed, in different transactions
        order[30]: "c",
    }  # a copy of it is added by the update
    new = _names(60, 78)
    groups[new[4]] = "c"
    groups[new[5]] = "a"
    emb = DupEmbedder(tmp_path / "model", groups)
    writes = _count_calls(monkeypatch, MetadataStore, "_write")

    def run(out: Path, lowered: bool, **kw):
        before = len(writes)
        with monkeypatch.context() as patch:
            if lowered:
                patch.setattr(metadata, "WRITE_CHUNK", 3)
            result = build_index_dir(_cfg(data, emb, out, **{"compact": "never", **kw}), embedder=emb)
        return result, len(writes) - before

    (_, ref_w), (_, low_w) = run(tmp_path / "ref", False), run(tmp_path / "low", True)
    assert low_w - ref_w == math.ceil(60 / 3) - 1  # the build's records went in 20 transactions, not one
    _assert_same(_snapshot(tmp_path / "ref"), _snapshot(tmp_path / "low"))

    gone = [order[0], order[1], order[2], order[5], order[10]] + order[40:49]  # 14 removed: [0 1 2] [5 10 40] ...
    for name in gone:
        (data / name).unlink()
    touch(data, new)  # 18 added
    for name in order[50:53]:  # 3 changed
        st = (data / name).stat()
        os.utime(data / name, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    (ref_u, ref_w), (low_u, low_w) = run(tmp_path / "ref", False), run(tmp_path / "low", True)
    assert (low_u.added, low_u.removed, low_u.updated) == (ref_u.added, ref_u.removed, ref_u.updated) == (18, 14, 3)
    assert low_w - ref_w == (math.ceil(17 / 3) - 1) + (math.ceil(21 / 3) - 1)  # removes, then adds
    a, b = _snapshot(tmp_path / "ref"), _snapshot(tmp_path / "low")
    _assert_same(a, b)
    by_path = {r["path"]: r for r in b["records"]}
    assert by_path[order[6]]["duplicate_of"] is None and by_path[new[5]]["duplicate_of"] == by_path[order[6]]["id"]
    assert by_path[new[4]]["duplicate_of"] == by_path[order[30]]["id"]
    assert b["duplicates"] == 2
    with IndexDirectory.open(tmp_path / "ref") as d:
        ref_delta = _dump_layer(d.generation_path / "delta.lmdb")
    with IndexDirectory.open(tmp_path / "low") as d:
        low_delta = _dump_layer(d.generation_path / "delta.lmdb")
    assert low_delta == ref_delta and any(len(v) == 0 for _, v in low_delta["items"])  # deletion markers kept

    (ref_c, ref_w), (low_c, low_w) = (
        run(tmp_path / "ref", False, compact="now"),
        run(tmp_path / "low", True, compact="now"),
    )
    assert ref_c.mode == low_c.mode == "compaction"
    assert low_w > ref_w + 10  # materialize applied the delta in many transactions
    c, e = _snapshot(tmp_path / "ref"), _snapshot(tmp_path / "low")
    _assert_same(c, e)
    _assert_same(a, c)  # the compaction holds and answers what the layered update did
    with IndexDirectory.open(tmp_path / "low") as d:
        assert not (d.generation_path / "delta.lmdb").exists()


# --- indexer/faiss_index.py --------------------------------------------------------------------------------


def _unit_rows(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_exact_chunk__exact_search_and_recall_in_small_products_equal_brute_force(monkeypatch):
    """EXACT_CHUNK (faiss_index.py, database rows per matrix product of exact search): merging the top-k of
    chunks (smaller than k, uneven, across blocks) must give numpy's brute-force top-k and the same recall."""
    xb = _unit_rows(203, 16, seed=1)
    ids = np.arange(203, dtype=np.int64) * 3 + 5  # not row numbers
    xq = _unit_rows(9, 16, seed=2)
    cuts = [0, 50, 51, 140, 203]

    def blocks():
        return iter([(ids[a:b], xb[a:b]) for a, b in zip(cuts, cuts[1:])])

    scores = xq @ xb.T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    ref_D, ref_I = faiss_index.exact_knn(xq, blocks, 10)
    np.testing.assert_array_equal(ref_I, ids[top])
    for chunk in (1, 7, 64):
        monkeypatch.setattr(faiss_index, "EXACT_CHUNK", chunk)
        D_, I_ = faiss_index.exact_knn(xq, blocks, 10)
        np.testing.assert_array_equal(I_, ids[top])
        np.testing.assert_allclose(D_, np.take_along_axis(scores, top, 1), rtol=0, atol=1e-6)
    # recall measurement (the tuning of an approximate index) over the same lists, chunked or not
    monkeypatch.setattr(faiss_index, "EXACT_CHUNK", 65_536)
    xb2, ids2 = _unit_rows(2000, 16, seed=3), np.arange(2000, dtype=np.int64)

    def blocks2():
        return iter([(ids2[:1500], xb2[:1500]), (ids2[1500:], xb2[1500:])])

    first = faiss_index.build_index("IVF16,Flat", 16, 2000, blocks2, use_gpu=False)
    trained = faiss.deserialize_index(np.asarray(first.trained))
    monkeypatch.setattr(faiss_index, "EXACT_CHUNK", 64)
    low = faiss_index.build_index("IVF16,Flat", 16, 2000, blocks2, use_gpu=False, trained=trained)
    assert (low.recall_at_10, low.search_params) == (first.recall_at_10, first.search_params)


def _ivf_lists(index: faiss.Index) -> list[tuple[np.ndarray, bytes]]:
    """(ids, codes) of every inverted list, in list order."""
    ivf = faiss.extract_index_ivf(index)
    out = []
    for lst in range(ivf.nlist):
        n = ivf.invlists.list_size(lst)
        if n == 0:
            out.append((np.zeros(0, np.int64), b""))
            continue
        ids = faiss.rev_swig_ptr(ivf.invlists.get_ids(lst), n).copy()
        codes = faiss.rev_swig_ptr(ivf.invlists.get_codes(lst), n * ivf.code_size).tobytes()
        out.append((ids, codes))
    return out


def test_ondisk_part_rows__a_sharded_on_disk_build_equals_the_in_ram_build(tmp_path, monkeypatch):
    """ONDISK_PART_ROWS (faiss_index.py, vectors per shard of an on-disk IVF-PQ build, merged by merge_ondisk):
    shards must hold every id once, each list in the same order with the same codes as one in-RAM fill."""
    n, d = 3000, 16
    xb, ids = _unit_rows(n, d, seed=4), np.arange(n, dtype=np.int64) * 2 + 1
    cuts = sorted(set(range(0, n, 120)) | {1001, n})  # blocks that do not line up with the shards

    def blocks():
        return iter([(ids[a:b], xb[a:b]) for a, b in zip(cuts, cuts[1:])])

    choice = faiss_index.choose_index("ivfpq", n, d, budget=1000)  # tiny --max-index-memory: lists on disk
    assert choice.on_disk and faiss_index.Factory.parse(choice.factory).kind == "ivfpq"
    ram = faiss_index.build_index(choice.factory, d, n, blocks, use_gpu=False)
    trained = faiss.deserialize_index(np.asarray(ram.trained))
    monkeypatch.setattr(faiss_index, "ONDISK_PART_ROWS", 300)
    writes = _count_calls(monkeypatch, faiss_index, "write_index")
    disk = faiss_index.build_index(
        choice.factory, d, n, blocks, use_gpu=False, trained=trained, on_disk=tmp_path / "vectors.ivfdata"
    )
    parts = [c for c in writes if ".part-" in str(c[1])]
    expected, held = 0, 0  # a shard is flushed at the first block end at or past ONDISK_PART_ROWS rows
    for a, b in zip(cuts, cuts[1:]):
        held += b - a
        if held >= 300:
            expected, held = expected + 1, 0
    expected += held > 0
    assert disk.on_disk and len(parts) == expected >= 9  # the threshold crossed many times
    assert (tmp_path / "vectors.ivfdata").stat().st_size > 0
    ram_lists, disk_lists = _ivf_lists(ram.index), _ivf_lists(disk.index)
    assert sorted(np.concatenate([i for i, _ in disk_lists]).tolist()) == ids.tolist()  # every id, once
    for (ri, rc), (di, dc) in zip(ram_lists, disk_lists, strict=True):
        np.testing.assert_array_equal(ri, di)
        assert rc == dc
    assert (disk.recall_at_10, disk.search_params) == (ram.recall_at_10, ram.search_params)
    for index in (ram.index, disk.index):
        faiss.extract_index_ivf(index).nprobe = faiss.extract_index_ivf(index).nlist
    xq = _unit_rows(20, d, seed=6)
    (rd, ri), (dd, di) = ram.index.search(xq, 10), disk.index.search(xq, 10)
    np.testing.assert_array_equal(ri, di)
    np.testing.assert_array_equal(rd, dd)
    for index in (ram.index, disk.index):
        faiss.extract_index_ivf(index).set_direct_map_type(faiss.DirectMap.Hashtable)
    np.testing.assert_array_equal(
        np.stack([ram.index.reconstruct(int(i)) for i in ids[::97]]),
        np.stack([disk.index.reconstruct(int(i)) for i in ids[::97]]),
    )


def test_ondisk_part_rows__an_on_disk_index_directory_serves_every_item(tmp_path, monkeypatch):
    """ONDISK_PART_ROWS through `moco index` (a tiny --max-index-memory forces on-disk IVF-PQ lists): the
    published generation must hold every item and reconstruct its stored vector."""
    data = tmp_path / "images"
    touch(data, _names(0, 2000))
    emb = SyntheticEmbedder(tmp_path / "model", d=16)
    monkeypatch.setattr(faiss_index, "ONDISK_PART_ROWS", 256)
    monkeypatch.setattr(vectors, "READ_ROWS", 100)  # blocks of 100 rows: shards end at 300 rows
    writes = _count_calls(monkeypatch, faiss_index, "write_index")
    result = build_index_dir(_cfg(data, emb, tmp_path / "idx", index_type="ivfpq", max_index_memory=1000), embedder=emb)
    assert result.count == 2000
    assert len([c for c in writes if ".part-" in str(c[1])]) == 7  # 6 of 300 rows, then 200
    with IndexDirectory.open(tmp_path / "idx") as d:
        assert d.manifest.on_disk and (d.generation_path / "vectors.ivfdata").is_file()
        ids = d.index.ids()
        assert ids.tolist() == list(range(2000))
        by_id = {r["id"]: r for r in d.records(ids.tolist())}
        xq = np.stack([emb.vector(f"{by_id[i]['path']}:{by_id[i]['mtime_ns']}") for i in range(0, 2000, 40)])
        _, I_ = d.index.search(xq, 10)
        hits = np.mean([i in row for i, row in zip(range(0, 2000, 40), I_.tolist())])
        assert hits >= 0.95  # tuned to recall@10 0.95, re-ranked with the stored vectors: itself in its top 10
        stored = vectors.BlockVectors(IndexLayout(tmp_path / "idx"), d.manifest.vector_blocks)
        found, x = stored.get(ids)
        assert found.all()
        np.testing.assert_array_equal(np.stack([d.index.reconstruct(int(i)) for i in ids[::50]]), x[::50])


def test_flat_max_and_hnsw_max__auto_index_type_on_each_side(monkeypatch):
    """FLAT_MAX / HNSW_MAX (and HEADROOM) of choose_index (faiss_index.py): auto must switch Flat -> HNSW at
    100,000 items, HNSW -> IVF at 1,000,000, and IVF-PQ lists to disk exactly when 1.5x their size does not fit."""
    d, big = 64, 1 << 50

    def kind(n, **kw):
        return faiss_index.Factory.parse(faiss_index.choose_index("auto", n, d, memory=big, **kw).factory).kind

    assert kind(faiss_index.FLAT_MAX - 1) == "flat" and kind(faiss_index.FLAT_MAX) == "hnsw"
    assert kind(faiss_index.HNSW_MAX - 1) == "hnsw" and kind(faiss_index.HNSW_MAX) == "ivf"
    n = 5000  # under FLAT_MAX, but the budget decides: flat exactly when it fits with headroom
    flat_bytes = faiss_index.serving_bytes("IDMap2,Flat", n, d)
    assert kind(n, budget=int(flat_bytes * faiss_index.HEADROOM)) == "flat"
    assert kind(n, budget=int(flat_bytes * faiss_index.HEADROOM) - 1) != "flat"
    pq = faiss_index.choose_index("ivfpq", n, d).factory
    pq_bytes = int(faiss_index.serving_bytes(pq, n, d) * faiss_index.HEADROOM)
    assert not faiss_index.choose_index("ivfpq", n, d, budget=pq_bytes).on_disk
    assert faiss_index.choose_index("ivfpq", n, d, budget=pq_bytes - 1).on_disk
    monkeypatch.setattr(faiss_index, "FLAT_MAX", 10)  # read at call time: a test can lower it
    assert kind(9) == "flat" and kind(10) == "hnsw"


# --- indexer/vectors.py ------------------------------------------------------------------------------------


def test_read_rows__live_blocks_in_small_reads_yield_the_same_ids_and_vectors(tmp_path, monkeypatch):
    """READ_ROWS (vectors.py, rows per block handed to FAISS): reads of a few rows (some all dead) must yield
    every live row once, in id order, with its own vector, as one read does."""
    layout = IndexLayout(tmp_path / "idx")
    rows = _unit_rows(80, D, seed=7)
    for name, (a, b), dtype in (("g000001", (0, 50), np.float32), ("g000002", (50, 80), np.float32)):
        with BlockWriter(layout, name, b - a, D, dtype) as w:
            w.extend(np.arange(a, b, dtype=np.int64), rows[a:b])
    live = np.asarray([i for i in range(80) if i % 4 != 1 and not 20 <= i < 30 and i != 79], dtype=np.int64)

    def read():
        got = list(live_blocks(layout, ["g000001", "g000002"], live)())
        return got, np.concatenate([i for i, _ in got]), np.concatenate([x for _, x in got])

    ref, ref_ids, ref_x = read()
    monkeypatch.setattr(vectors, "READ_ROWS", 3)
    low, low_ids, low_x = read()
    assert len(ref) == 2 and len(low) > 20 and max(len(i) for i, _ in low) <= 3
    np.testing.assert_array_equal(low_ids, live)
    np.testing.assert_array_equal(ref_ids, live)
    np.testing.assert_array_equal(low_x, ref_x)
    np.testing.assert_array_equal(low_x, rows[live])


# --- indexer/update.py -------------------------------------------------------------------------------------


def test_compact_fraction_and_min__compaction_exactly_past_both(monkeypatch):
    """COMPACT_FRACTION / COMPACT_MIN (update.py): compaction once delta + removed pass 5% of the base AND the
    minimum, neither at nor below either (test_index_updates crosses 5% only with a wide margin)."""

    def wanted(delta, removed, base):
        return update.needs_compaction(SimpleNamespace(delta_count=delta, removed_count=removed, base_count=base))

    assert not wanted(600, 400, 10_000) and wanted(601, 400, 10_000)  # the 1,000-item minimum binds
    assert not wanted(3000, 2000, 100_000) and wanted(3001, 2000, 100_000)  # 5% binds
    monkeypatch.setattr(update, "COMPACT_MIN", 20)
    assert not wanted(10, 10, 300) and wanted(11, 10, 300)  # minimum 20 over 5% of 300 = 15
    assert not wanted(10, 5, 200) and not wanted(20, 0, 200) and wanted(21, 0, 200)
    monkeypatch.setattr(update, "COMPACT_MIN", 10)
    assert not wanted(10, 5, 300) and wanted(10, 6, 300)  # 5% of 300 = 15 over the minimum 10


def test_compact_fraction__the_auto_compacted_generation_holds_what_the_updates_made(tmp_path, monkeypatch):
    """COMPACT_FRACTION through `moco index` (COMPACT_MIN lowered): an update at 5% publishes no compaction, one
    past it does, and that compaction must hold the same ids, records, vectors and results as no compaction."""
    monkeypatch.setattr(update, "COMPACT_MIN", 10)
    data = tmp_path / "images"
    names = _names(0, 300)
    touch(data, names)
    emb = SyntheticEmbedder(tmp_path / "model", d=D)
    for out in ("auto", "never"):
        build_index_dir(_cfg(data, emb, tmp_path / out), embedder=emb)
    for name in sorted(names)[::60]:  # 5 removed
        (data / name).unlink()
    touch(data, _names(300, 310))  # 10 added: 15 changes, exactly 5% of 300
    at = build_index_dir(_cfg(data, emb, tmp_path / "auto"), embedder=emb)
    build_index_dir(_cfg(data, emb, tmp_path / "never", compact="never"), embedder=emb)
    assert at.compacted is None and (at.delta_count, at.removed_count) == (10, 5)
    touch(data, _names(310, 311))  # 16 changes: past it
    past = build_index_dir(_cfg(data, emb, tmp_path / "auto"), embedder=emb)
    build_index_dir(_cfg(data, emb, tmp_path / "never", compact="never"), embedder=emb)
    assert past.compacted == past.generation and past.delta_count == past.removed_count == 0
    a, b = _snapshot(tmp_path / "auto"), _snapshot(tmp_path / "never")
    _assert_same(a, b)
    assert a["count"] == 306


def _run_block_history(data: Path, emb, out: Path, adds: list[tuple[int, int]], removed: list[str]) -> None:
    """A build of what ``data`` holds now, then one update per (start, stop) of added names, then the
    removal of ``removed`` with a compaction (``--compact now``). Restores the folder afterwards."""
    extra = [name for a, b in adds for name in _names(a, b)]
    for name in extra:
        if (data / name).exists():
            (data / name).unlink()
    build_index_dir(_cfg(data, emb, out, compact="never"), embedder=emb)
    for a, b in adds:
        touch(data, _names(a, b))
        build_index_dir(_cfg(data, emb, out, compact="never"), embedder=emb)
    for name in removed:
        (data / name).unlink()
    result = build_index_dir(_cfg(data, emb, out, compact="now"), embedder=emb)
    assert result.compacted == result.generation or result.mode == "compaction"
    touch(data, removed)  # the next history sees the same files, same mtimes


def test_max_blocks__merged_vector_blocks_hold_the_same_live_vectors(tmp_path, monkeypatch):
    """MAX_BLOCKS (update.py, vector blocks merged by a compaction past 16): merging must keep every live id's
    own vector; at the limit the blocks are kept, past it they become one."""
    data = tmp_path / "images"
    touch(data, _names(0, 60))
    emb = SyntheticEmbedder(tmp_path / "model", d=D)
    adds = [(60, 70), (70, 75)]  # 3 blocks, nothing dead
    with monkeypatch.context() as patch:
        patch.setattr(update, "MAX_BLOCKS", 3)  # at the limit: kept
        _run_block_history(data, emb, tmp_path / "kept", adds, [])
    with monkeypatch.context() as patch:
        patch.setattr(update, "MAX_BLOCKS", 2)  # past it: merged
        _run_block_history(data, emb, tmp_path / "merged", adds, [])
    with IndexDirectory.open(tmp_path / "kept") as d:
        assert len(d.manifest.vector_blocks) == 3
    with IndexDirectory.open(tmp_path / "merged") as d:
        assert d.manifest.vector_blocks == [d.generation]
    _assert_same(_snapshot(tmp_path / "kept"), _snapshot(tmp_path / "merged"))


def test_max_dead_fraction__blocks_merged_past_10_percent_dead_hold_the_same_live_vectors(tmp_path, monkeypatch):
    """MAX_DEAD_FRACTION (update.py, blocks merged by a compaction once over 10% of their rows are dead): at 10%
    the block is kept, at 11% it is rewritten, and both hold the same live ids and vectors."""
    data = tmp_path / "images"
    names = _names(0, 100)
    touch(data, names)
    emb = SyntheticEmbedder(tmp_path / "model", d=D)
    _run_block_history(data, emb, tmp_path / "ten", [], sorted(names)[:10])  # 10 of 100 rows dead: kept
    _run_block_history(data, emb, tmp_path / "eleven", [], sorted(names)[:11])  # 11 dead: merged
    with IndexDirectory.open(tmp_path / "ten") as d:
        assert d.manifest.vector_blocks == ["g000001"]
    with IndexDirectory.open(tmp_path / "eleven") as d:
        assert d.manifest.vector_blocks == [d.generation]
        assert len(np.load(IndexLayout(tmp_path / "eleven").vector_block(d.generation)[0])) == 89
    # the same 11 removed, block kept (limit raised) or merged: the same generation content
    with monkeypatch.context() as patch:
        patch.setattr(update, "MAX_DEAD_FRACTION", 0.5)
        _run_block_history(data, emb, tmp_path / "kept11", [], sorted(names)[:11])
    with IndexDirectory.open(tmp_path / "kept11") as d:
        assert d.manifest.vector_blocks == ["g000001"]
    _assert_same(_snapshot(tmp_path / "eleven"), _snapshot(tmp_path / "kept11"))


# --- indexer/embeddings_file.py ----------------------------------------------------------------------------


def test_row_group__many_row_groups_hold_the_same_rows_as_one(tmp_path, monkeypatch):
    """ROW_GROUP (embeddings_file.py, rows per Parquet row group): row groups of 7 over 50 rows (and vector reads
    of 3 rows) must write the same rows, in the same order, as one row group."""
    import pyarrow.parquet as pq

    from moco_retrieval.indexer.embeddings_file import write_embeddings

    data = tmp_path / "images"
    touch(data, _names(0, 50))
    emb = SyntheticEmbedder(tmp_path / "model", d=D)
    build_index_dir(_cfg(data, emb, tmp_path / "idx"), embedder=emb)
    idx = tmp_path / "idx"
    one = write_embeddings(idx, tmp_path / "one.parquet")
    seven = write_embeddings(idx, tmp_path / "seven.parquet", row_group=7)
    monkeypatch.setattr(vectors, "READ_ROWS", 3)
    reads3 = write_embeddings(idx, tmp_path / "reads3.parquet", row_group=7)
    write_embeddings(idx, tmp_path / "npy1.parquet", npy=True)
    npy7 = write_embeddings(idx, tmp_path / "npy7.parquet", npy=True, row_group=7)
    assert one.rows == seven.rows == reads3.rows == npy7.rows == 50
    assert pq.ParquetFile(tmp_path / "one.parquet").metadata.num_row_groups == 1
    assert pq.ParquetFile(tmp_path / "seven.parquet").metadata.num_row_groups == 8
    ref = pq.read_table(tmp_path / "one.parquet")
    assert pq.read_table(tmp_path / "seven.parquet").equals(ref)
    assert pq.read_table(tmp_path / "reads3.parquet").equals(ref)
    assert pq.read_table(tmp_path / "npy7.parquet").equals(pq.read_table(tmp_path / "npy1.parquet"))
    np.testing.assert_array_equal(np.load(tmp_path / "npy7.npy"), np.load(tmp_path / "npy1.npy"))
    np.testing.assert_array_equal(
        np.load(tmp_path / "npy7.npy"), np.stack(ref.column("vector").to_numpy(zero_copy_only=False))
    )
    assert ref.column("id").to_pylist() == list(range(50))


# --- contracts/images.py -----------------------------------------------------------------------------------


def _png(path: Path, side: int, noise: bool, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.integers(0, 256, (side, side, 3)) if noise else np.full((side, side, 3), 90 + seed)).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path.read_bytes()


def test_max_file_bytes__a_file_at_the_limit_is_read_one_byte_over_is_refused(tmp_path, monkeypatch):
    """MAX_FILE_BYTES (contracts/images.py, files over 1 GiB refused before being read): every reader (the raw
    read, the decode, the check, the indexer's decode of a file) must read a file at the limit whole and refuse
    one a byte over in one line, never read it into memory."""
    from moco_retrieval.contracts import images
    from moco_retrieval.contracts.encoder_format import RESIZE_POLICY
    from moco_retrieval.contracts.errors import DataError
    from moco_retrieval.indexer.decode import decode_file

    path = tmp_path / "img.png"
    data = _png(path, 16, noise=True)
    n = len(data)
    assert images.read_image_bytes(path, max_bytes=n) == data
    with pytest.raises(DataError, match=rf"^file too large \({n} bytes, limit {n - 1}\)$"):
        images.read_image_bytes(path, max_bytes=n - 1)
    monkeypatch.setattr(images, "MAX_FILE_BYTES", n)  # at the limit: read
    assert images.read_image_bytes(path) == data
    assert images.decode_image(path).size == (16, 16)
    assert images.check_image(path) is None
    ok = decode_file(("img.png", str(path), 16, RESIZE_POLICY))
    assert ok.error is None and ok.bytes == n and ok.sha256 == hashlib.sha256(data).hexdigest()
    monkeypatch.setattr(images, "MAX_FILE_BYTES", n - 1)  # one byte over: refused, the same line everywhere
    reason = f"file too large ({n} bytes, limit {n - 1})"
    with pytest.raises(DataError) as raw:
        images.read_image_bytes(path)
    with pytest.raises(DataError) as decoded:
        images.decode_image(path)
    assert str(raw.value) == reason and str(decoded.value) == f"{path}: {reason}"
    assert images.check_image(path) == reason
    refused = decode_file(("img.png", str(path), 16, RESIZE_POLICY))
    assert refused.pixels is None and f"{reason}" in refused.error and "\n" not in refused.error


# --- serve/http.py -----------------------------------------------------------------------------------------


def test_small_file_bytes__item_images_read_whole_or_streamed_are_the_same_bytes(tmp_path, monkeypatch):
    """SMALL_FILE_BYTES (serve/http.py, item images up to this size sent from one read, larger ones streamed):
    through a real server, a file at the limit and one past it (streamed in several chunks) must arrive byte for
    byte, with the right length."""
    import httpx

    from moco_retrieval.serve import http
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine
    from tests._serve_helpers import RunningServer
    from tests.index_fixtures import write_tiny_encoder

    data = tmp_path / "images"
    files = {
        "a/small.png": _png(data / "a/small.png", 8, noise=False),
        "a/big.png": _png(data / "a/big.png", 48, noise=True, seed=1),
        "b/other.png": _png(data / "b/other.png", 16, noise=True, seed=2),
    }
    small, big = len(files["a/small.png"]), len(files["a/big.png"])
    assert big > small + 4000
    encoder = write_tiny_encoder(tmp_path / "model" / "encoder.onnx")
    out = tmp_path / "idx"
    build_index_dir(IndexConfig(str(data), str(encoder), str(out), workers=0, progress=False, device="cpu"))
    with IndexDirectory.open(out) as d:
        ids = {p: d.id_of_path(p) for p in files}
    streamed = []
    chunks = http._chunks

    def small_chunks(f, size=1 << 20):  # the streaming path, in 1,000-byte chunks (several for the big file)
        sent = []
        streamed.append(sent)
        for chunk in chunks(f, 1000):
            sent.append(len(chunk))
            yield chunk

    monkeypatch.setattr(http, "_chunks", small_chunks)
    engine = SearchEngine(out, EngineConfig(device="cpu", threads=1, poll_seconds=0))
    server = RunningServer(http.create_app(engine))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:

            def fetch(path: str) -> bytes:
                r = client.get(f"/api/items/{ids[path]}/image")
                assert r.status_code == 200 and int(r.headers["content-length"]) == len(files[path])
                return r.content

            for limit, expect_streamed in ((small, [big]), (big - 1, [big]), (big, [])):
                monkeypatch.setattr(http, "SMALL_FILE_BYTES", limit)
                streamed.clear()
                for path in ("a/small.png", "a/big.png"):
                    assert fetch(path) == files[path]
                assert [sum(sent) for sent in streamed] == expect_streamed  # which file took the streaming path
                assert all(len(sent) == math.ceil(big / 1000) for sent in streamed)
            monkeypatch.setattr(http, "SMALL_FILE_BYTES", small - 1)  # even the small one streamed
            streamed.clear()
            assert fetch("a/small.png") == files["a/small.png"] and len(streamed) == 1
    finally:
        server.stop()
        engine.close()


# --- thresholds the issue did not list ---------------------------------------------------------------------


def test_flat_max__an_update_past_it_rebuilds_as_hnsw_holding_what_a_fresh_build_holds(tmp_path, monkeypatch):
    """FLAT_MAX crossed by an update (build.py's restructure check): auto moves Flat -> HNSW in a compaction,
    which must hold the same ids, records, vectors and results as a fresh build of the same folder."""
    monkeypatch.setattr(faiss_index, "FLAT_MAX", 80)
    data = tmp_path / "images"
    touch(data, _names(0, 60))
    emb = SyntheticEmbedder(tmp_path / "model", d=D)
    first = build_index_dir(_cfg(data, emb, tmp_path / "grown", index_type="auto"), embedder=emb)
    assert first.factory == "IDMap2,Flat"
    touch(data, [f"zz/new{i:03d}.png" for i in range(19)])  # 79 items: still under FLAT_MAX
    below = build_index_dir(_cfg(data, emb, tmp_path / "grown", index_type="auto"), embedder=emb)
    assert below.compacted is None and below.factory == "IDMap2,Flat"
    touch(data, ["zz/new019.png"])  # 80: at FLAT_MAX, auto wants HNSW
    grown = build_index_dir(_cfg(data, emb, tmp_path / "grown", index_type="auto"), embedder=emb)
    assert grown.compacted == grown.generation and grown.factory.endswith("HNSW32")
    fresh = build_index_dir(_cfg(data, emb, tmp_path / "fresh", index_type="auto"), embedder=emb)
    assert fresh.factory == grown.factory and fresh.search_params == grown.search_params
    _assert_same(_snapshot(tmp_path / "grown"), _snapshot(tmp_path / "fresh"))


def test_recall_k__an_approximate_index_of_fewer_items_than_k(tmp_path):
    """RECALL_K (faiss_index.py, recall@10 measured at k = min(10, n)): an HNSW or IVF index of fewer than 10
    items must be tuned and measured over the items it has (recall 1.0), not fail on missing neighbours."""
    for factory in ("IDMap2,HNSW32", "IVF1,Flat"):
        for n in (1, 9, 10, 11):
            xb, ids = _unit_rows(n, 16, seed=n), np.arange(n, dtype=np.int64) + 100
            built = faiss_index.build_index(factory, 16, n, lambda: iter([(ids, xb)]), use_gpu=False)
            assert built.index.ntotal == n and built.recall_at_10 == 1.0, (factory, n)
            _, I_ = built.index.search(xb, min(n, 10))
            assert I_[:, 0].tolist() == ids.tolist()


def test_training_sample__ivf_trained_on_a_sample_past_10000_vectors_draws_the_same_rows(monkeypatch):
    """The IVF training sample (faiss_index.py build_index: at most max(100 x nlist, 10,000) rows): past it,
    the rows drawn across uneven blocks must be exactly the rows chosen, and every vector still indexed."""
    n, d = 12_000, 8
    xb, ids = _unit_rows(n, d, seed=9), np.arange(n, dtype=np.int64)
    cuts = [0, 1, 4000, 4001, 9999, n]

    def blocks():
        return iter([(ids[a:b], xb[a:b]) for a, b in zip(cuts, cuts[1:])])

    wanted = np.sort(np.random.default_rng(0).choice(n, size=10_000, replace=False))
    np.testing.assert_array_equal(faiss_index._sample(blocks, n, 10_000), xb[wanted])
    np.testing.assert_array_equal(faiss_index._sample(blocks, n, n), xb)  # at the limit: every row, in order
    trained = _count_calls(monkeypatch, faiss.IndexIVFFlat, "train")
    built = faiss_index.build_index("IVF4,Flat", d, n, blocks, use_gpu=False)
    assert built.trained_on == 10_000 and len(trained) == 1
    np.testing.assert_array_equal(np.asarray(trained[0][1]), xb[wanted])
    assert built.index.ntotal == n and built.recall_at_10 >= 0.95
    small = faiss_index.build_index("IVF4,Flat", d, 10_000, lambda: iter([(ids[:10_000], xb[:10_000])]), use_gpu=False)
    assert small.trained_on == 10_000 and small.index.ntotal == 10_000


def test_reducing_gap__a_jpeg_is_decoded_reduced_only_past_3x_the_target(tmp_path):
    """REDUCING_GAP (contracts/images.py, a JPEG decoded reduced by DCT scaling once its shorter side passes 3x
    the target): at 3x the decode must equal the full one, past it keep at least 3x, and the record's size is
    always the file's own."""
    from PIL import Image

    from moco_retrieval.contracts.images import REDUCING_GAP, decode_image

    target = 16
    gap = int(REDUCING_GAP * target)  # 48
    rng = np.random.default_rng(3)
    for short, expect_full in ((gap, True), (gap + 1, False), (2 * gap, False), (8 * gap + 5, False)):
        path = tmp_path / f"img{short}.jpg"
        size = (short, short * 3 // 2)
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3)).astype(np.uint8)).save(path, quality=90)
        full = decode_image(path)
        reduced = decode_image(path, target_size=target)
        assert reduced.info["source_size"] == full.info["source_size"] == size
        assert min(reduced.size) >= gap
        if expect_full:
            assert reduced.size == size and np.array_equal(np.asarray(reduced), np.asarray(full))
        elif short >= 2 * gap:
            assert reduced.size != size  # reduced by the decoder


def test_ivf_list_ratio__an_update_that_moves_nlist_past_2x_retrains_as_a_fresh_build_would(tmp_path):
    """same_structure's nlist ratio (faiss_index.py: an IVF base keeps its lists while the wanted count stays
    within 2x, is retrained past it): at 2x the lists are kept, past it the compaction must hold what a fresh
    build of the folder holds (ids, records, vectors, lists)."""
    assert faiss_index.same_structure("IVF5,Flat", "IVF10,Flat") and faiss_index.same_structure(
        "IVF10,Flat", "IVF5,Flat"
    )
    assert not faiss_index.same_structure("IVF5,Flat", "IVF11,Flat")
    assert not faiss_index.same_structure("IVF11,Flat", "IVF5,Flat")
    data = tmp_path / "images"
    touch(data, _names(0, 200))
    emb = SyntheticEmbedder(tmp_path / "model", d=D)
    first = build_index_dir(_cfg(data, emb, tmp_path / "grown", index_type="ivf", compact="never"), embedder=emb)
    assert first.factory == "IVF5,Flat"  # 200 // 39 lists
    touch(data, [f"zz/new{i:04d}.png" for i in range(428 - 200)])  # 428 items want 10 lists: 2x, kept
    kept = build_index_dir(_cfg(data, emb, tmp_path / "grown", index_type="ivf", compact="never"), embedder=emb)
    assert kept.compacted is None and kept.factory == "IVF5,Flat"
    touch(data, ["zz/new9999.png"])  # 429 want 11: retrained
    grown = build_index_dir(_cfg(data, emb, tmp_path / "grown", index_type="ivf", compact="never"), embedder=emb)
    assert grown.compacted == grown.generation and grown.factory == "IVF11,Flat"
    fresh = build_index_dir(_cfg(data, emb, tmp_path / "fresh", index_type="ivf"), embedder=emb)
    assert fresh.factory == grown.factory
    a, b = _snapshot(tmp_path / "grown"), _snapshot(tmp_path / "fresh")
    _assert_same(a, b)
