"""Choosing, training, building and checking the FAISS index (inner product on L2-normalized vectors).

Vectors arrive as a *block source*: a callable returning a fresh iterator of ``(ids, xb)`` blocks, int64
``[n]`` and float32 ``[n, d]``, so nothing here needs all vectors in memory at once (IVF trains on a sample,
every index is filled block by block, ground truth is computed block by block).

``auto`` picks by corpus size ``n`` and the memory budget (``--max-index-memory``, default half the RAM),
each with 50% headroom:

    n < 100,000 and raw vectors fit         Flat     exact inner product
    n < 1,000,000 and the graph fits        HNSW32   graph; efSearch tuned
    raw vectors fit                         IVF{4*sqrt(n)},Flat          nprobe tuned
    otherwise                               IVF{4*sqrt(n)},PQ{d/8}np     64 bytes/vector at d=512; nprobe tuned,
                                            re-ranked with the stored float16 vectors
    ... and the PQ codes do not fit either  the same, inverted lists on disk (``vectors.ivfdata``), built in
                                            shards of 1M vectors and merged with FAISS's ``merge_ondisk``

Indexes without native ids (Flat, HNSW) are wrapped in ``IDMap2``. IVF is trained (and filled) on the GPU
when FAISS sees one (:mod:`indexer.faiss_gpu`), then copied back: the stored index is always a CPU index.
For every approximate index the search parameter (nprobe / efSearch) is raised until recall@10 against
exact search on a sample of queries reaches ``target_recall``; the final recall is returned for the manifest.
The trained, still empty IVF index is kept too, so later updates grow a delta with the same lists.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import faiss
import numpy as np

from moco_retrieval.contracts.atomic import WriteErrors, check_free_space, output_errors
from moco_retrieval.contracts.errors import ConfigError, IndexBuildError, OutputError
from moco_retrieval.indexer import faiss_gpu
from moco_retrieval.indexer.config import TARGET_RECALL
from moco_retrieval.indexer.factory import Factory
from moco_retrieval.indexer.filters import RECALL_K
from moco_retrieval.indexer.searcher import LayeredIndex, unwrap

LOG = logging.getLogger(__name__)

INDEX_TYPES = ("auto", "flat", "hnsw", "ivf", "ivfpq")
FLAT_MAX = 100_000
HNSW_MAX = 1_000_000
HNSW_M = 32
RECALL_QUERIES = 256
PLATEAU = 0.002  # stop raising nprobe/efSearch when recall@10 improves by less than this
EXACT_CHUNK = 65_536  # database rows per matrix product in exact search
HEADROOM = 1.5  # an index "fits" a memory budget when its size times this does
# IVF-PQ: candidates re-ranked with the stored vectors, per neighbour asked for: the smallest factor that reaches
# the target recall. Measured at 1M x 512 (IVF1024,PQ64): 10 candidates per neighbour stopped at recall@10 0.66,
# since a list holds ~1,000 vectors that PQ codes cannot tell apart; at 100k 10 were enough (0.995).
REFINE_LADDER = (10, 30, 100, 300)
ONDISK_PART_ROWS = 1_000_000  # vectors per shard of an on-disk IVF-PQ build (each one a small in-RAM index)

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
    on_disk: bool = False  # inverted lists in a .ivfdata file beside the index
    trained: np.ndarray | None = None  # the trained, empty index, serialized (IVF only): deltas grow from it


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


@dataclass(frozen=True)
class IndexChoice:
    """What ``auto`` (or an explicit type) chose: the factory string, and whether the lists live on disk."""

    factory: str
    on_disk: bool = False


def serving_bytes(factory: str, n: int, d: int) -> int:
    """Estimated RAM of a filled index of ``factory`` (in-memory lists) over ``n`` vectors."""
    parsed = Factory.parse(factory)
    if parsed.kind == "hnsw":
        return n * (4 * d + 2 * HNSW_M * 4 + 8)
    if parsed.kind == "ivfpq":
        return n * (parsed.pq_m + 8) + parsed.nlist * d * 4
    return n * (4 * d + 8)


def choose_index(index_type: str, n: int, d: int, memory: int | None = None, budget: int | None = None) -> IndexChoice:
    """The index for ``index_type`` over ``n`` vectors of dimension ``d`` under a memory budget.

    Args:
        index_type: ``auto``, ``flat``, ``hnsw``, ``ivf``, ``ivfpq`` or any FAISS factory string.
        memory: bytes of RAM of the machine (default: this machine's); the budget defaults to half of it.
        budget: bytes the index may take in RAM (``--max-index-memory``); an IVF-PQ index larger than this
            keeps its inverted lists on disk.

    Raises:
        ConfigError: a factory string FAISS does not understand.
    """
    memory = memory_bytes() if memory is None else memory
    budget = memory // 2 if budget is None else budget

    def fits(factory: str) -> bool:
        return serving_bytes(factory, n, d) * HEADROOM <= budget

    if index_type == "auto":
        if n < FLAT_MAX and fits(_factory("flat", n, d)):
            index_type = "flat"
        elif n < HNSW_MAX and fits(_factory("hnsw", n, d)):
            index_type = "hnsw"
        elif fits(_factory("ivf", n, d)):
            index_type = "ivf"
        else:
            index_type = "ivfpq"
    factory = _factory(index_type, n, d)
    return IndexChoice(factory, on_disk=Factory.parse(factory).kind == "ivfpq" and not fits(factory))


def choose_factory(index_type: str, n: int, d: int, memory: int | None = None, budget: int | None = None) -> str:
    """The FAISS factory string of :func:`choose_index`."""
    return choose_index(index_type, n, d, memory, budget).factory


def _factory(index_type: str, n: int, d: int) -> str:
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
        raise ConfigError(
            f"--index-type {index_type!r} is neither {', '.join(INDEX_TYPES)} nor a FAISS factory "
            f"string FAISS accepts ({str(exc).splitlines()[-1]})"
        ) from exc
    if faiss.try_extract_index_ivf(probe) is None and not isinstance(probe, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        return f"IDMap2,{index_type}"
    return index_type


def same_structure(built: str, wanted: str) -> bool:
    """True when an index built as ``built`` can keep serving where ``wanted`` is chosen now: the same kind
    (and codec: Flat, or PQ with as many sub-quantizers), and for IVF a list count within a factor of 2 of the
    wanted one (4 sqrt(n) moves with every update; retraining is worth it only when it moved a lot)."""
    old, new = Factory.parse(built), Factory.parse(wanted)
    kind = old.kind
    if kind != new.kind:
        return False
    if kind in ("ivf", "ivfpq"):
        ratio = old.nlist / max(1, new.nlist)
        return 0.5 <= ratio <= 2 and old.codec == new.codec  # PQ bits also move with small n
    if kind == "custom":
        return built == wanted or built == f"IDMap2,{wanted}"
    return built == wanted


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
            sub_ids = np.asarray(ids[start : start + EXACT_CHUNK])
            scores = xq @ np.asarray(xb[start : start + EXACT_CHUNK], dtype=np.float32).T  # nq x nb
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
    inner = unwrap(index)
    if name == "efSearch" and hasattr(inner, "hnsw"):
        inner.hnsw.efSearch = value
        return
    raise IndexBuildError(f"cannot set {name} on {type(inner).__name__}")


def _search_param_ladder(index: faiss.Index) -> tuple[str, list[int]] | None:
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return "nprobe", sorted({min(ivf.nlist, 2**i) for i in range(0, 17)})
    if hasattr(unwrap(index), "hnsw"):
        return "efSearch", [16, 32, 64, 128, 256, 512, 1024]
    return None


def build_index(
    factory: str,
    d: int,
    n: int,
    blocks: BlockSource,
    use_gpu: bool | None = None,
    target_recall: float = TARGET_RECALL,
    recall_queries: int = RECALL_QUERIES,
    hnsw_ef_construction: int = 80,
    on_disk: str | os.PathLike | None = None,
    trained: faiss.Index | None = None,
    vectors=None,
    gpus: int | None = None,
    cloner=None,
) -> BuiltIndex:
    """Create, train (on a sample), fill and check the index ``factory`` over the ``n`` vectors of ``blocks``.

    Args:
        factory: from :func:`choose_index`.
        d: vector dimension; every block must be ``(ids [m], xb [m, d])``.
        n: total rows over all blocks.
        use_gpu: train and fill IVF indexes on GPU 0 (default: when FAISS sees a GPU).
        target_recall: recall@10 the tuned search parameter must reach (or its largest value).
        on_disk: IVF only: the ``.ivfdata`` file to keep the inverted lists in; the index is then filled in
            shards of ``ONDISK_PART_ROWS`` vectors, each written beside it, and merged (``merge_ondisk``).
        trained: an already trained, empty index of this factory (a compaction keeps the lists it has).
        vectors: stored vectors by id (``BlockVectors``): IVF-PQ results are re-ranked with them (and tuned so).
        gpus, cloner: see :func:`indexer.faiss_gpu.clone_for_build` (tests).

    Raises:
        IndexBuildError: FAISS failed, or the blocks do not hold ``n`` rows of dimension ``d``.
    """
    try:
        index = (
            faiss.deserialize_index(faiss.serialize_index(trained))
            if trained is not None
            else faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
        )
    except RuntimeError as exc:
        raise IndexBuildError(f"FAISS cannot create {factory!r}: {str(exc).splitlines()[-1]}") from exc
    inner = unwrap(index)
    if hasattr(inner, "hnsw"):
        inner.hnsw.efConstruction = hnsw_ef_construction
    result = BuiltIndex(index=index, factory=factory)
    if n == 0:
        return result
    ivf = faiss.try_extract_index_ivf(index)
    if on_disk is not None and ivf is None:
        raise IndexBuildError(f"only IVF indexes keep their lists on disk, not {factory!r}")
    gpus = faiss_gpu.gpu_count() if gpus is None else gpus
    use_gpu = (gpus > 0) if use_gpu is None else use_gpu
    try:
        if not index.is_trained:
            pq = Factory.parse(factory).pq_codes  # PQ codebooks want a larger sample than k-means alone
            size = min(n, max(100 * (ivf.nlist if ivf is not None else 1), 100_000 if pq else 10_000))
            xt = _sample(blocks, n, size)
            work, on_gpu = faiss_gpu.clone_for_build(index, gpus, cloner) if use_gpu else (index, False)
            LOG.info("training %s on %d of %d vectors%s", factory, len(xt), n, " on GPU" if on_gpu else "")
            work.train(xt)
            if on_gpu:
                index = faiss_gpu.to_cpu(work)
                result.on_gpu = True
            result.trained_on = len(xt)
            del xt
        if ivf is not None:
            result.trained = faiss.serialize_index(index)
        if on_disk is not None:
            index = _fill_on_disk(index, blocks, n, d, Path(on_disk), use_gpu, gpus, cloner, result)
            result.on_disk = True
        else:
            work, on_gpu = (
                faiss_gpu.clone_for_build(index, gpus, cloner) if use_gpu and ivf is not None else (index, False)
            )
            added = _add_blocks(work, blocks, d)
            if added != n:
                raise IndexBuildError(f"expected {n} vectors, the blocks held {added}; rerun `moco index`")
            if on_gpu:
                index = faiss_gpu.to_cpu(work)
                result.on_gpu = True
        result.index = index
    except RuntimeError as exc:
        raise IndexBuildError(f"FAISS failed building {factory!r}: {str(exc).splitlines()[-1]}") from exc
    _tune(result, blocks, n, target_recall, recall_queries, vectors if Factory.parse(factory).pq_codes else None)
    return result


def _add_blocks(index: faiss.Index, blocks: BlockSource, d: int) -> int:
    added = 0
    for ids, xb in blocks():
        xb = np.ascontiguousarray(xb, dtype=np.float32)
        if xb.ndim != 2 or xb.shape[1] != d:
            raise IndexBuildError(f"vector block of shape {xb.shape} does not have dimension {d}")
        index.add_with_ids(xb, np.ascontiguousarray(ids, dtype=np.int64))
        added += len(xb)
    return added


def _fill_on_disk(
    trained: faiss.Index,
    blocks: BlockSource,
    n: int,
    d: int,
    lists: Path,
    use_gpu: bool,
    gpus: int,
    cloner,
    result: BuiltIndex,
) -> faiss.Index:
    """Fill copies of the trained index with ``ONDISK_PART_ROWS`` vectors each (in RAM: codes only), write
    each beside ``lists``, then merge their inverted lists into ``lists`` (FAISS's ``merge_ondisk``)."""
    from faiss.contrib.ondisk import merge_ondisk

    parts: list[str] = []
    empty = faiss.serialize_index(trained)

    def flush(buffer: list[tuple[np.ndarray, np.ndarray]]) -> None:
        part = faiss.deserialize_index(empty)
        work, on_gpu = faiss_gpu.clone_for_build(part, gpus, cloner) if use_gpu else (part, False)
        _add_blocks(work, lambda: iter(buffer), d)
        if on_gpu:
            part = faiss_gpu.to_cpu(work)
            result.on_gpu = True
        path = lists.parent / f".part-{len(parts):05d}.faiss"
        write_index(part, str(path))
        parts.append(str(path))
        buffer.clear()

    try:
        buffer, rows, added = [], 0, 0
        for ids, xb in blocks():
            buffer.append((np.asarray(ids, dtype=np.int64), np.ascontiguousarray(xb, dtype=np.float32)))
            rows += len(ids)
            added += len(ids)
            if rows >= ONDISK_PART_ROWS:
                flush(buffer)
                rows = 0
        if buffer:
            flush(buffer)
        if added != n:
            raise IndexBuildError(f"expected {n} vectors, the blocks held {added}; rerun `moco index`")
        index = faiss.deserialize_index(empty)
        # FAISS writes the merged lists through a memory map it grows with ftruncate: on a full disk that is a
        # SIGBUS, not an error, so the space is checked first (codes and ids of every vector, +10% for the lists'
        # slack)
        code_size = faiss.extract_index_ivf(index).code_size
        check_free_space(lists.parent, int(1.1 * n * (code_size + 8)) + (1 << 20), f"inverted lists {lists}")
        LOG.info("merging %d shards of inverted lists into %s", len(parts), lists)
        merge_ondisk(index, parts, str(lists))
    finally:
        for part in parts:
            Path(part).unlink(missing_ok=True)
    return index


def _tune(
    result: BuiltIndex, blocks: BlockSource, n: int, target_recall: float, recall_queries: int, vectors=None
) -> None:
    """Measure recall@10 against exact search; raise nprobe/efSearch until it reaches ``target_recall``.

    With ``vectors`` (IVF-PQ), results are re-ranked with them (``refine``) as the server re-ranks them.
    """
    ladder = _search_param_ladder(result.index)
    if ladder is None and Factory.parse(result.factory).exact:
        result.exact, result.recall_at_10 = True, 1.0
        return
    xq = _sample(blocks, n, recall_queries, seed=1)
    k = min(RECALL_K, n)
    _, I_ref = exact_knn(xq, blocks, k)
    if ladder is None:  # some other factory string: measure as it is
        result.recall_at_10 = recall_at_k(result.index.search(xq, k)[1], I_ref)
        return
    name, values = ladder
    best = None  # (recall, params)
    for refine in REFINE_LADDER if vectors is not None else (0,):
        params, recall = _climb(
            result.index, name, values, xq, I_ref, k, target_recall, {"refine": refine} if refine else {}, vectors
        )
        if best is None or recall > best[0] + PLATEAU:
            best = (recall, params)
        if recall >= target_recall:
            break
    recall, params = best
    _set_param(result.index, name, params[name])
    result.search_params = params
    result.recall_at_10 = recall
    LOG.info(
        "%s: recall@%d %.4f at %s over %d queries",
        result.factory,
        k,
        recall,
        ", ".join(f"{a}={b}" for a, b in result.search_params.items()),
        len(xq),
    )


def _climb(
    index: faiss.Index,
    name: str,
    values: list[int],
    xq: np.ndarray,
    I_ref: np.ndarray,
    k: int,
    target_recall: float,
    extra: dict,
    vectors,
) -> tuple[dict, float]:
    """Raise ``name`` along ``values`` until recall@k reaches the target or stops improving (a plateau:
    compressed vectors cap it; the cheaper setting is kept). Returns ``(params, recall)``."""
    previous = None  # (value, recall) of the step before
    for value in values:
        _set_param(index, name, value)
        searcher = LayeredIndex(index, params={name: value, **extra}, vectors=vectors)
        recall = recall_at_k(searcher.search(xq, k)[1], I_ref)
        LOG.debug("%s=%d %s: recall@%d %.4f", name, value, extra, k, recall)
        if previous is not None and recall < previous[1] + PLATEAU:
            value, recall = previous
            break
        if recall >= target_recall or value == values[-1]:
            break
        previous = (value, recall)
    return {name: value, **extra}, recall


def write_index(index: faiss.Index, path: str) -> None:
    """Write ``index`` to ``path`` through Python's file I/O (``faiss.PyCallbackIOWriter``), so a failed write
    raises here, once: FAISS's own file writer also printed "file ... close error: No space left on device"
    to stderr from a destructor, beside the command's one-line error.

    Raises:
        OutputError: the file could not be written (full disk, permissions).
    """
    try:
        with output_errors(path, "check free space and permissions, then rerun"), open(path, "wb") as f:
            with WriteErrors(f) as out:
                faiss.write_index(index, faiss.PyCallbackIOWriter(out.write))
    except RuntimeError as exc:
        raise OutputError(
            f"cannot write {path} ({str(exc).splitlines()[-1].strip()}); check free space and permissions, then rerun"
        ) from exc


def read_flags(factory: str, on_disk: bool = False, mmap: bool = True) -> int:
    """FAISS read flags for a stored index of ``factory``: on-disk lists are found beside the file; with
    ``mmap``, IVF lists (``IO_FLAG_MMAP``) or flat codes / HNSW storage (``IO_FLAG_MMAP_IFC``) are mapped
    read-only from the file instead of copied into memory, so processes serving one file share its pages.
    """
    if on_disk:
        return faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY
    if not mmap:
        return 0
    if Factory.parse(
        factory
    ).is_ivf:  # the two flags do not combine: IVF lists are mapped by IO_FLAG_MMAP's reader hook
        return faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY
    return faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY


def read_index(
    path: str | os.PathLike, factory: str | None = None, on_disk: bool = False, mmap: bool = True
) -> faiss.Index:
    """Read a stored index, memory-mapped where its type allows (see :func:`read_flags`).

    Raises:
        ArtifactError: an unreadable file.
    """
    from moco_retrieval.contracts.errors import ArtifactError

    flags = read_flags(factory, on_disk, mmap) if factory is not None else 0
    try:
        return faiss.read_index(str(path), flags)
    except RuntimeError as exc:
        raise ArtifactError(
            f"unreadable FAISS index {path} ({str(exc).splitlines()[-1].strip()}); rebuild with `moco index --rebuild`"
        ) from exc
