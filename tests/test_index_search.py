"""Searching a generation: memory-mapped bases, base - removed + delta as one index, re-ranking from stored
vectors, and the GPU guards (tested with the CPU build: a fake GPU count and cloner)."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.indexer import faiss_gpu
from moco_retrieval.indexer.build import IndexConfig, build_index_dir
from moco_retrieval.indexer.faiss_index import build_index, exact_knn, read_index, recall_at_k
from moco_retrieval.indexer.index_dir import IndexDirectory
from moco_retrieval.indexer.layout import IndexLayout
from moco_retrieval.indexer.searcher import GPU_MAX_K, LayeredIndex
from moco_retrieval.indexer.vectors import BlockVectors, BlockWriter
from tests.index_fixtures import SyntheticEmbedder, touch_files


def _clustered(n: int, d: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(20, d))[rng.integers(0, 20, n)] + 0.4 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _source(ids, xb):
    return lambda: iter([(ids, xb)])


def _mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("index_type,budget", [("flat", None), ("hnsw", None), ("ivf", None), ("ivfpq", 1000)])
def test_index_dir__base_is_memory_mapped_and_searches_like_a_loaded_one(index_type, budget, tmp_path):
    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model")
    touch_files(data, [f"c{i % 3}/{i:04d}.png" for i in range(500)])
    build_index_dir(
        IndexConfig(
            str(data),
            str(emb.encoder.path),
            str(out),
            workers=0,
            progress=False,
            index_type=index_type,
            max_index_memory=budget,
        ),
        embedder=emb,
    )
    xq = np.stack(
        [
            emb.vector(f"c{i % 3}/{i:04d}.png:{(data / f'c{i % 3}/{i:04d}.png').stat().st_mtime_ns}")
            for i in range(0, 500, 25)
        ]
    )
    with IndexDirectory.open(out) as mapped, IndexDirectory.open(out, mmap=False) as loaded:
        name = str(mapped.generation_path / ("vectors.ivfdata" if budget else "vectors.faiss"))
        assert name in _mapped_files()  # served from the page cache, shareable between processes
        if budget:
            lists = faiss.extract_index_ivf(mapped.index.base).invlists
            assert isinstance(faiss.downcast_InvertedLists(lists), faiss.OnDiskInvertedLists)
        D1, I1 = mapped.index.search(xq, 5)
        D2, I2 = loaded.index.search(xq, 5)
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_allclose(D1, D2, rtol=1e-5)


def test_layered_index__removed_ids_never_come_back_and_the_delta_is_merged():
    xb = _clustered(600)
    ids = np.arange(600, dtype=np.int64)
    for factory, params in (("IDMap2,Flat", {}), ("IVF8,Flat", {"nprobe": 8}), ("IDMap2,HNSW16", {"efSearch": 64})):
        base = build_index(factory, 32, 500, _source(ids[:500], xb[:500]), use_gpu=False).index
        delta = faiss.index_factory(32, "IDMap2,Flat", faiss.METRIC_INNER_PRODUCT)
        delta.add_with_ids(xb[500:], ids[500:])
        removed = ids[:500:3]
        layered = LayeredIndex(base, delta, removed, params)
        assert layered.ntotal == 600 - len(removed)
        live = np.setdiff1d(ids, removed)
        _, I = layered.search(xb, 10)
        assert not np.isin(I, removed).any()
        _, I_ref = exact_knn(xb, _source(live, xb[live]), 10)
        assert recall_at_k(I, I_ref) > 0.9, factory
        np.testing.assert_array_equal(layered.ids(), live)
        with pytest.raises(RuntimeError):
            layered.reconstruct(int(removed[1]))


def test_layered_index__ivfpq_is_reranked_with_the_stored_vectors(tmp_path):
    n, d = 3000, 32
    xb = _clustered(n, d)
    ids = np.arange(n, dtype=np.int64) * 2 + 7
    layout = IndexLayout(tmp_path)
    with BlockWriter(layout, "g000001", n, d, np.float16) as writer:
        writer.extend(ids, xb)
    vectors = BlockVectors(layout, ["g000001"])
    found, got = vectors.get(np.array([ids[5], 4, ids[-1]]))
    assert found.tolist() == [True, False, True]
    np.testing.assert_allclose(got[0], xb[5], atol=2e-3)
    plain = build_index("IVF32,PQ4x8np", d, n, _source(ids, xb), use_gpu=False)
    refined = build_index("IVF32,PQ4x8np", d, n, _source(ids, xb), use_gpu=False, vectors=vectors)
    assert refined.search_params["refine"] > 1 and refined.recall_at_10 > plain.recall_at_10 + 0.2
    searcher = LayeredIndex(refined.index, params=refined.search_params, vectors=vectors)
    np.testing.assert_allclose(searcher.reconstruct(int(ids[9])), xb[9], atol=2e-3)  # IVF-PQ cannot; blocks can


class _FakeGpu:
    """Stands in for a GPU copy: a CPU clone that counts its searches."""

    def __init__(self, index):
        self.index, self.searches = faiss.clone_index(index), 0
        self.d, self.ntotal = index.d, index.ntotal

    def search(self, xq, k):
        self.searches += 1
        return self.index.search(xq, k)


def test_faiss_gpu__guards_route_to_the_cpu_where_a_gpu_cannot(tmp_path):
    xb = _clustered(800)
    ids = np.arange(800, dtype=np.int64)
    flat = build_index("IDMap2,Flat", 32, 800, _source(ids, xb), use_gpu=False).index
    hnsw = build_index("IDMap2,HNSW16", 32, 800, _source(ids, xb), use_gpu=False).index
    ivf = build_index("IVF8,Flat", 32, 800, _source(ids, xb), use_gpu=False).index
    sharded: list[bool] = []

    def fake(index, all_gpus):  # stands in for index_cpu_to_gpu / index_cpu_to_all_gpus
        sharded.append(all_gpus)
        return faiss.clone_index(index)

    assert faiss_gpu.gpu_count() == 0  # this machine: the CPU build's fallback
    assert faiss_gpu.gpu_copy_for_search(flat, {}, "auto") is None
    with pytest.raises(ConfigError, match="sees no GPU"):
        faiss_gpu.gpu_copy_for_search(flat, {}, "one")
    with pytest.raises(ConfigError, match="--faiss-gpu"):
        faiss_gpu.gpu_copy_for_search(flat, {}, "bogus")
    assert faiss_gpu.gpu_copy_for_search(hnsw, {}, "all", gpus=2, cloner=fake) is None  # no GPU HNSW
    assert faiss_gpu.gpu_copy_for_search(ivf, {"nprobe": 4}, "all", on_disk=True, gpus=2, cloner=fake) is None
    assert faiss_gpu.gpu_copy_for_search(flat, {}, "none", gpus=2, cloner=fake) is None
    assert sharded == []
    one = faiss_gpu.gpu_copy_for_search(flat, {}, "one", gpus=2, cloner=fake)
    assert one is not None and sharded == [False] and one.gpus == 1
    copy = faiss_gpu.gpu_copy_for_search(ivf, {"nprobe": 4}, "auto", gpus=2, cloner=fake)
    assert sharded == [False, True] and copy.gpus == 2 and faiss.extract_index_ivf(copy.index).nprobe == 4
    assert copy.can_search(GPU_MAX_K) and not copy.can_search(GPU_MAX_K + 1)

    big_x = _clustered(3000, seed=1)
    big_ids = np.arange(3000, dtype=np.int64)
    big = build_index("IDMap2,Flat", 32, 3000, _source(big_ids, big_x), use_gpu=False).index
    removed = big_ids[::5]
    layered = LayeredIndex(big, None, removed, {}, gpu=faiss_gpu.GpuCopy(_FakeGpu(big), {}, 1))
    _, I = layered.search(big_x[:4], 10)
    assert layered.gpu.index.searches == 1 and not np.isin(I, removed).any()  # searched deeper, then filtered
    _, I_deep = layered.search(big_x[:1], GPU_MAX_K)  # plus the removed ids: deeper than a GPU goes
    assert layered.gpu.index.searches == 1 and (I_deep[0] >= 0).sum() == GPU_MAX_K
    assert not np.isin(I_deep, removed).any()

    def failing(index, all_gpus):
        raise RuntimeError("out of GPU memory")

    assert faiss_gpu.gpu_copy_for_search(flat, {}, "auto", gpus=1, cloner=failing) is None


def test_faiss_gpu__ivf_trains_and_fills_on_the_gpu_and_is_stored_for_the_cpu(tmp_path):
    xb = _clustered(1000)
    ids = np.arange(1000, dtype=np.int64)
    clones = []

    def cloner(index):
        clones.append(type(index).__name__)
        return faiss.clone_index(index)  # stands in for index_cpu_to_gpu (index_gpu_to_cpu copies it back)

    built = build_index("IVF16,PQ8x8np", 32, 1000, _source(ids, xb), gpus=1, cloner=cloner)
    assert built.on_gpu and len(clones) == 2  # training, then adding
    faiss.write_index(built.index, str(tmp_path / "x.faiss"))
    assert read_index(tmp_path / "x.faiss", "IVF16,PQ8x8np").ntotal == 1000  # a plain CPU index on disk
    flat = build_index("IDMap2,Flat", 32, 1000, _source(ids, xb), gpus=1, cloner=cloner)
    assert not flat.on_gpu and len(clones) == 2  # only IVF goes to the GPU for building
