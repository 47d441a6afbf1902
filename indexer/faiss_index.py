"""Choosing, training, building and checking the FAISS index (inner product on L2-normalized vectors).

Vectors arrive as a *block source*: a callable returning a fresh iterator of ``(ids, xb)`` blocks, int64
``[n]`` and float32 ``[n, d]``, so nothing here needs all vectors in memory at once (IVF trains on a sample,
every index is filled block by block, ground truth is computed block by block).

``auto`` picks by corpus size ``n`` and memory:

    n < 100,000                      Flat     exact inner product
    n < 1,000,000                    HNSW32   graph; efSearch tuned
    fits in memory                   IVF{4*sqrt(n)},Flat         nprobe tuned
    does not fit comfortably         IVF{4*sqrt(n)},PQ{d/8}np    64 bytes/vector at d=512; nprobe tuned

Indexes without native ids (Flat, HNSW) are wrapped in ``IDMap2``. IVF is trained (and filled) on the GPU
when FAISS sees one, then copied back: the stored index is always a CPU index. For every approximate index
the search parameter (nprobe / efSearch) is raised until recall@10 against exact search on a sample of
queries reaches ``target_recall``; the final recall is returned for the manifest.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import faiss
import numpy as np

from contracts.errors import ConfigError, IndexBuildError, OutputError

LOG = logging.getLogger(__name__)

INDEX_TYPES = ("auto", "flat", "hnsw", "ivf", "ivfpq")
FLAT_MAX = 100_000
HNSW_MAX = 1_000_000
HNSW_M = 32
TARGET_RECALL = 0.95
RECALL_QUERIES = 256
RECALL_K = 10
PLATEAU = 0.002  # stop raising nprobe/efSearch when recall@10 improves by less than this
EXACT_CHUNK = 65_536  # database rows per matrix product in exact search

BlockSource = Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]


@dataclass
class BuiltIndex:
    """A filled CPU index and what was measured about it."""

    index: faiss.Index
    factory: str
    search_params: dict = field(default_factory=dict)  # {"nprobe": 16} / {"efSearch": 64} / {}
    recall_at_10: float | None = None  # None only for an empty corpus
    exact: bool = False
    trained_on: int = 0
    on_gpu: bool = False


def memory_bytes() -> int:
    """Physical memory of this machine (a large default where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 << 30


def _nlist(n: int) -> int:
    # ~4 sqrt(n) lists, but at least 39 training points per list (FAISS warns below that)
    return int(max(1, min(4 * math.sqrt(max(n, 1)), n // 39)))


def _pq_m(d: int) -> int:
    """Sub-quantizers for IVF-PQ: d/8 (one byte per 8 dimensions), a divisor of d."""
    for m in range(max(1, d // 8), 0, -1):
        if d % m == 0:
            return m
    return 1


def choose_factory(index_type: str, n: int, d: int, memory: int | None = None) -> str:
    """The FAISS factory string for ``index_type`` over ``n`` vectors of dimension ``d``.

    Args:
        index_type: ``auto``, ``flat``, ``hnsw``, ``ivf``, ``ivfpq`` or any FAISS factory string.
        memory: bytes of RAM to plan for (default: this machine's).

    Raises:
        ConfigError: a factory string FAISS does not understand.
    """
    if index_type == "auto":
        memory = memory_bytes() if memory is None else memory
        if n < FLAT_MAX:
            index_type = "flat"
        elif n * d * 4 * 1.5 > memory / 2:  # raw float32 vectors + headroom would take over half the RAM
            index_type = "ivfpq"
        elif n < HNSW_MAX:
            index_type = "hnsw"
        else:
            index_type = "ivf"
    if index_type == "flat":
        return "IDMap2,Flat"
    if index_type == "hnsw":
        return f"IDMap2,HNSW{HNSW_M}"
    if index_type == "ivf":
        return f"IVF{_nlist(n)},Flat"
    if index_type == "ivfpq":
        nbits = max(1, min(8, int(math.log2(max(n, 78) / 39))))  # 39 training points per PQ centroid
        return f"IVF{_nlist(n)},PQ{_pq_m(d)}x{nbits}np"  # np: no polysemous training (slow, unused here)
    try:
        probe = faiss.index_factory(d, index_type, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ConfigError(f"--index-type {index_type!r} is neither {', '.join(INDEX_TYPES)} nor a FAISS factory "
                          f"string FAISS accepts ({str(exc).splitlines()[-1]})") from exc
    if faiss.try_extract_index_ivf(probe) is None and not isinstance(probe, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        return f"IDMap2,{index_type}"
    return index_type


def _sample(blocks: BlockSource, n: int, size: int, seed: int = 0) -> np.ndarray:
    """``size`` rows drawn without replacement (deterministic for a seed) from the ``n`` rows of ``blocks``."""
    size = min(size, n)
    wanted = np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))
    out, start = [], 0
    for _, xb in blocks():
        stop = start + len(xb)
        lo, hi = np.searchsorted(wanted, [start, stop])
        if hi > lo:
            out.append(np.asarray(xb[wanted[lo:hi] - start], dtype=np.float32))
        start = stop
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


def exact_knn(xq: np.ndarray, blocks: BlockSource, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-``k`` of ``xq`` (nq, d) over all blocks: ``(D, I)``, each (nq, k), best first."""
    nq = len(xq)
    D = np.full((nq, k), -np.inf, dtype=np.float32)
    I = np.full((nq, k), -1, dtype=np.int64)
    for ids, xb in blocks():
        for start in range(0, len(xb), EXACT_CHUNK):
            sub_ids = np.asarray(ids[start:start + EXACT_CHUNK])
            scores = xq @ np.asarray(xb[start:start + EXACT_CHUNK], dtype=np.float32).T  # nq x nb
            allD = np.concatenate([D, scores], axis=1)
            allI = np.concatenate([I, np.broadcast_to(sub_ids, scores.shape)], axis=1)
            top = np.argpartition(-allD, k - 1, axis=1)[:, :k]
            D, I = np.take_along_axis(allD, top, 1), np.take_along_axis(allI, top, 1)
    order = np.argsort(-D, axis=1, kind="stable")
    return np.take_along_axis(D, order, 1), np.take_along_axis(I, order, 1)


def recall_at_k(I: np.ndarray, I_ref: np.ndarray) -> float:
    """Mean fraction of the reference top-k ids (nq, k) found in the approximate top-k ids (nq, k)."""
    k = I_ref.shape[1]
    hits = sum(len(set(a[a >= 0].tolist()) & set(r[r >= 0].tolist())) for a, r in zip(I, I_ref))
    return hits / (len(I_ref) * k) if len(I_ref) else 1.0


def _set_param(index: faiss.Index, name: str, value: int) -> None:
    ivf = faiss.try_extract_index_ivf(index)
    if name == "nprobe" and ivf is not None:
        ivf.nprobe = value
        return
    inner = faiss.downcast_index(index.index) if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)) else index
    inner = faiss.downcast_index(inner)
    if name == "efSearch" and hasattr(inner, "hnsw"):
        inner.hnsw.efSearch = value
        return
    raise IndexBuildError(f"cannot set {name} on {type(inner).__name__}")


def _search_param_ladder(index: faiss.Index) -> tuple[str, list[int]] | None:
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return "nprobe", sorted({min(ivf.nlist, 2 ** i) for i in range(0, 17)})
    inner = faiss.downcast_index(index.index) if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)) else index
    if hasattr(faiss.downcast_index(inner), "hnsw"):
        return "efSearch", [16, 32, 64, 128, 256, 512, 1024]
    return None


def _gpu_count() -> int:
    try:
        return faiss.get_num_gpus()
    except AttributeError:  # a CPU-only FAISS build
        return 0


def build_index(factory: str, d: int, n: int, blocks: BlockSource, use_gpu: bool | None = None,
                target_recall: float = TARGET_RECALL, recall_queries: int = RECALL_QUERIES,
                hnsw_ef_construction: int = 80) -> BuiltIndex:
    """Create, train (on a sample), fill and check the index ``factory`` over the ``n`` vectors of ``blocks``.

    Args:
        factory: from :func:`choose_factory`.
        d: vector dimension; every block must be ``(ids [m], xb [m, d])``.
        n: total rows over all blocks.
        use_gpu: build IVF indexes on GPU 0 (default: when FAISS sees a GPU).
        target_recall: recall@10 the tuned search parameter must reach (or its largest value).

    Raises:
        IndexBuildError: FAISS failed, or the blocks do not hold ``n`` rows of dimension ``d``.
    """
    try:
        index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise IndexBuildError(f"FAISS cannot create {factory!r}: {str(exc).splitlines()[-1]}") from exc
    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap) else index
    if hasattr(inner, "hnsw"):
        inner.hnsw.efConstruction = hnsw_ef_construction
    result = BuiltIndex(index=index, factory=factory)
    if n == 0:
        return result
    ivf = faiss.try_extract_index_ivf(index)
    use_gpu = (_gpu_count() > 0) if use_gpu is None else use_gpu
    work = index
    if ivf is not None and use_gpu:
        work = _to_gpu(index)
        result.on_gpu = work is not index
    try:
        if not index.is_trained:
            pq = "PQ" in factory
            size = min(n, max(100 * (ivf.nlist if ivf is not None else 1), 100_000 if pq else 10_000))
            xt = _sample(blocks, n, size)
            LOG.info("training %s on %d of %d vectors%s", factory, len(xt), n, " on GPU" if result.on_gpu else "")
            work.train(xt)
            result.trained_on = len(xt)
        added = 0
        for ids, xb in blocks():
            xb = np.ascontiguousarray(xb, dtype=np.float32)
            if xb.ndim != 2 or xb.shape[1] != d:
                raise IndexBuildError(f"vector block of shape {xb.shape} does not have dimension {d}")
            work.add_with_ids(xb, np.ascontiguousarray(ids, dtype=np.int64))
            added += len(xb)
        if added != n:
            raise IndexBuildError(f"expected {n} vectors, the blocks held {added}; rerun `moco index`")
        if result.on_gpu:
            index = faiss.index_gpu_to_cpu(work)
            result.index = index
    except RuntimeError as exc:
        raise IndexBuildError(f"FAISS failed building {factory!r}: {str(exc).splitlines()[-1]}") from exc
    _tune(result, blocks, n, target_recall, recall_queries)
    return result


def _to_gpu(index: faiss.Index) -> faiss.Index:
    """The index cloned to GPU 0, or the CPU index itself when this FAISS/GPU cannot host it."""
    try:
        options = faiss.GpuClonerOptions()
        options.useFloat16 = True  # IVF-PQ lookup tables with many sub-quantizers need it
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index, options)
    except (RuntimeError, AttributeError) as exc:
        LOG.warning("building on CPU: the GPU cannot host this index (%s)", str(exc).splitlines()[-1])
        return index


def _tune(result: BuiltIndex, blocks: BlockSource, n: int, target_recall: float, recall_queries: int) -> None:
    """Measure recall@10 against exact search; raise nprobe/efSearch until it reaches ``target_recall``."""
    ladder = _search_param_ladder(result.index)
    if ladder is None and "Flat" in result.factory and "IVF" not in result.factory and "HNSW" not in result.factory:
        result.exact, result.recall_at_10 = True, 1.0
        return
    xq = _sample(blocks, n, recall_queries, seed=1)
    k = min(RECALL_K, n)
    _, I_ref = exact_knn(xq, blocks, k)
    if ladder is None:  # some other factory string: measure as it is
        result.recall_at_10 = recall_at_k(result.index.search(xq, k)[1], I_ref)
        return
    name, values = ladder
    previous = None  # (value, recall) of the step before
    for value in values:
        _set_param(result.index, name, value)
        recall = recall_at_k(result.index.search(xq, k)[1], I_ref)
        LOG.debug("%s=%d: recall@%d %.4f", name, value, k, recall)
        if previous is not None and recall < previous[1] + PLATEAU:
            # a plateau (compressed vectors cap the recall): keep the cheaper setting
            value, recall = previous
            _set_param(result.index, name, value)
            break
        if recall >= target_recall or value == values[-1]:
            break
        previous = (value, recall)
    result.search_params = {name: value}
    result.recall_at_10 = recall
    LOG.info("%s: recall@%d %.4f at %s=%d over %d queries", result.factory, k, recall, name, value, len(xq))


def write_index(index: faiss.Index, path: str) -> None:
    """Write ``index`` to ``path``.

    Raises:
        OutputError: FAISS could not write the file (full disk, permissions).
    """
    try:
        faiss.write_index(index, path)
    except RuntimeError as exc:
        raise OutputError(f"cannot write {path} ({str(exc).splitlines()[-1].strip()}); "
                          "check free space and permissions, then rerun") from exc


def read_index(path: str, mmap: bool = False) -> faiss.Index:
    """Read a stored index (``mmap`` maps IVF lists / flat codes instead of loading them)."""
    flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if mmap else 0
    return faiss.read_index(path, flags)
