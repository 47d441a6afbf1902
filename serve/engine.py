"""The search engine: nearest-neighbour search and k-NN classification over one index directory.

A query image is decoded and resized with the index's own encoder preprocessing (the one decode,
:func:`contracts.images.decode_image`, told the encoder's size), embedded and searched in a micro-batch with
concurrent queries (:mod:`serve.batching`), and its neighbours' records are read from LMDB (each read in its
own read-only transaction, so threads never share one). Tombstoned ids never come back: the index is searched
a little deeper than ``k`` and ids without a live record are dropped.

Three ways in: :meth:`SearchEngine.search` (and ``classify``) decode in the caller's thread and wait for the
batch (one image on the CLI, the Gradio UI); :meth:`SearchEngine.search_async` (the HTTP API) decodes on the
engine's decode threads and awaits the batch without holding a thread; :meth:`SearchEngine.search_vectors` (and
``classify_vectors``) answer vectors the caller embedded with :attr:`SearchEngine.encoder` (the CLI over many
images, which decodes them in worker processes). At most ``decode_slots`` of the engine's decodes run at once,
whoever asks (a semaphore), so concurrent hostile uploads cannot each allocate a large image at the same time.

The engine watches ``CURRENT`` of the index directory; when ``moco index`` publishes a new generation it
opens and checks it beside the old one, switches new requests to it, and closes the old one once its last
request has finished. A generation that fails its checks is logged and the old one keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from moco_retrieval.contracts.encoder_format import model_summary, preprocess_image
from moco_retrieval.contracts.errors import (
    ArtifactError,
    BatchTooLargeError,
    ConfigError,
    DataError,
    MocoError,
    UnknownItemError,
)
from moco_retrieval.contracts.images import decode_image
from moco_retrieval.contracts.knn import KNN_TEMPERATURE, SEARCH_K
from moco_retrieval.indexer.encoder import OnnxEncoder, available_cores
from moco_retrieval.indexer.filters import threshold_factor
from moco_retrieval.indexer.layout import current_generation
from moco_retrieval.indexer.records import ItemRecord
from moco_retrieval.serve.batching import MicroBatcher
from moco_retrieval.serve.config import DUPLICATE_THRESHOLD, MAX_K, MAX_QUERIES, EngineConfig  # noqa: F401 (API)
from moco_retrieval.serve.files import open_indexed_file
from moco_retrieval.serve.generation import ServedGeneration
from moco_retrieval.serve.search_filter import SearchFilter  # noqa: F401 (part of the engine's API)

LOG = logging.getLogger(__name__)

THRESHOLD_FIRST_K = 100  # a min_score search first asks for this many; most thresholds are answered by it


@dataclass
class SearchResult:
    """The neighbours of one query, best first.

    Attributes:
        hits: item records (id, path, label, width, height, bytes, sha256, mtime, duplicate_of) plus
            ``score``, the cosine similarity to the query.
        generation: the index generation that answered.
        timings: seconds per phase: decode, queue, embed, search, metadata, total (embed and search are of
            the whole batch this query was part of).
        batch_size: query images embedded together with this one (itself included).
        query: the record of the query item, for :meth:`SearchEngine.search_by_id`.
    """

    hits: list[dict]
    generation: str
    timings: dict[str, float] = field(default_factory=dict)
    batch_size: int = 1
    query: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Classification:
    """The k-NN prediction for one query.

    Attributes:
        label: the most probable label, or ``None`` when no neighbour is labeled.
        probabilities: label -> probability (sum 1), most probable first.
        neighbors: the k neighbours that voted (labeled or not), as in :class:`SearchResult`.
    """

    label: str | None
    probabilities: dict[str, float]
    neighbors: list[dict]
    generation: str
    timings: dict[str, float] = field(default_factory=dict)
    batch_size: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


def knn_vote(scores: np.ndarray, labels: list[str | None], temperature: float) -> dict[str, float]:
    """Weighted k-NN vote: each labeled neighbour adds ``exp(score / temperature)`` to its label.

    Args:
        scores: float ``[k]`` cosine similarities; labels: ``k`` labels (``None`` for unlabeled, not voting).

    Returns:
        label -> probability, most probable first (ties by label name); empty when nobody voted.
    """
    voters = [(float(s), lab) for s, lab in zip(scores, labels) if lab is not None]
    if not voters:
        return {}
    top = max(s for s, _ in voters)  # subtracted for stability; it cancels in the normalization
    totals: dict[str, float] = {}
    for s, lab in voters:
        totals[lab] = totals.get(lab, 0.0) + math.exp((s - top) / temperature)
    norm = sum(totals.values())
    return {lab: w / norm for lab, w in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))}


class SearchEngine:
    """Search and classify over the live generation of an index directory, safe to call from many threads.

    Args:
        index_dir: a directory written by ``moco index``.
        config: :class:`EngineConfig` (defaults when omitted).

    Raises:
        ArtifactError: not an index directory, or its model does not match it.
        ConfigError: a bad device or config value.
    """

    def __init__(self, index_dir: str | os.PathLike, config: EngineConfig | None = None):
        self.index_dir = Path(index_dir)
        self.config = config or EngineConfig()
        self._current = self._open(reuse=None)
        self._swap_lock = threading.Lock()
        self._failed_generation: str | None = None
        self._pointer_problem: str | None = None  # the last CURRENT problem logged
        self.swaps = 0
        self.last_swap: float | None = None  # time.time() of the last switch to a new generation
        self.queries = 0  # query images answered
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._batcher = MicroBatcher(self._run_batch, self.config.max_batch, self.config.max_wait_ms / 1000)
        slots = self.config.decode_slots or available_cores()
        self._decode_slots = threading.BoundedSemaphore(slots)
        self._decoders = ThreadPoolExecutor(slots, thread_name_prefix="moco-decode")
        self._watcher = None
        if self.config.poll_seconds > 0:
            self._watcher = threading.Thread(target=self._watch, name="moco-index-watcher", daemon=True)
            self._watcher.start()
        LOG.debug(
            "opened %s: generation %s, %d items, model %s",
            self.index_dir,
            self._current.name,
            self._current.ntotal,
            self._current.encoder.metadata.get("arch"),
        )

    def _open(self, reuse) -> ServedGeneration:
        cfg = self.config
        return ServedGeneration.open(
            self.index_dir,
            model=cfg.model,
            reuse=reuse,
            device=cfg.device,
            threads=cfg.threads,
            faiss_threads=cfg.faiss_threads,
            spin=cfg.spin,
            faiss_gpu=cfg.faiss_gpu,
        )

    def close(self) -> None:
        """Stop watching, finish queued queries and close the index."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        self._batcher.close()
        self._decoders.shutdown(wait=True)
        self._current.retire()

    def __enter__(self) -> "SearchEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generations ---------------------------------------------------------------------------------------
    @property
    def generation(self) -> str:
        return self._current.name

    @contextmanager
    def _generation(self) -> Iterator[ServedGeneration]:
        gen = self._acquire()
        try:
            yield gen
        finally:
            gen.release()

    def _acquire(self) -> ServedGeneration:
        """A reference to the live generation (release it with ``release()``)."""
        while True:  # a swap may close the generation we read between the read and the acquire: retry
            gen = self._current
            if gen.acquire():
                return gen
            if self._stop.is_set():
                raise ArtifactError(f"the search engine over {self.index_dir} was closed; open a new one")

    def refresh(self) -> bool:
        """Switch to a newly published generation if there is one; True when it switched.

        A generation that cannot be opened or fails the model check is logged (once) and skipped; the
        current one keeps serving.
        """
        with self._swap_lock:
            try:
                live = current_generation(self.index_dir)
            except ArtifactError as exc:
                if str(exc) != self._pointer_problem:  # once per problem, not every poll
                    LOG.warning(
                        "cannot read the live generation of %s (still serving %s): %s",
                        self.index_dir,
                        self._current.name,
                        exc,
                    )
                    self._pointer_problem = str(exc)
                return False
            self._pointer_problem = None
            old = self._current
            if live == old.name or live == self._failed_generation:
                return False
            try:
                new = self._open(reuse=old.encoder)
            except Exception as exc:  # whatever a damaged generation raises: skip it until another is published
                self._failed_generation = live
                reason = str(exc) if isinstance(exc, MocoError) else f"{type(exc).__name__}: {exc}".splitlines()[0]
                LOG.error("not switching to generation %s of %s: %s", live, self.index_dir, reason)
                LOG.debug("generation %s could not be opened", live, exc_info=True)
                return False
            self._current, self._failed_generation = new, None
            self.swaps += 1
            self.last_swap = time.time()
        LOG.info("switched %s from generation %s to %s (%d items)", self.index_dir, old.name, new.name, new.ntotal)
        old.retire()
        return True

    def _watch(self) -> None:
        while not self._stop.wait(self.config.poll_seconds):
            try:
                self.refresh()
            except Exception:  # the watcher must survive anything a half-written directory throws at it
                LOG.exception("index watcher error (will retry)")

    # -- queries ---------------------------------------------------------------------------------------------
    def _count(self, n: int) -> None:
        with self._count_lock:
            self.queries += n

    def _check_k(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= self.config.max_k:
            raise ConfigError(f"k must be an integer from 1 to {self.config.max_k}, got {k!r}")

    def resolve_k(self, k: int | None, min_score: float | None) -> int:
        """The checked ``k`` of a query: as given, else ``SEARCH_K``, or ``max_k`` for a threshold search (every
        item above ``min_score``, at most ``max_k``).

        Raises:
            ConfigError: k out of range, or min_score not a number in [-1, 1].
        """
        if min_score is not None:
            if (
                isinstance(min_score, bool)
                or not isinstance(min_score, (int, float, np.floating))
                or not -1.0 <= float(min_score) <= 1.0
            ):
                raise ConfigError(f"min_score must be a number from -1 to 1 (a cosine similarity), got {min_score!r}")
        k = (SEARCH_K if min_score is None else self.config.max_k) if k is None else k
        self._check_k(k)
        return k

    def check_batch(self, n: int, what: str) -> None:
        """Raises DataError for an empty batch, BatchTooLargeError past ``max_queries``."""
        if n == 0:
            raise DataError(f"no query {what} given; send 1 to {self.config.max_queries}")
        if n > self.config.max_queries:
            raise BatchTooLargeError(
                f"{n} query {what} in one request; the limit is {self.config.max_queries} "
                "(split the batch, or raise --max-queries)"
            )

    def _decode(self, gen: ServedGeneration, images: list) -> np.ndarray:
        """Images (bytes, paths or PIL) -> uint8 ``[n, H, W, 3]`` for ``gen``'s encoder, one decode slot each."""
        if not images:
            raise DataError("no query image given")
        enc = gen.encoder
        rows = []
        for image in images:
            with self._decode_slots:
                if not hasattr(image, "mode"):  # bytes or a path; a PIL image is used as it is
                    image = decode_image(image, target_size=enc.image_size)
                rows.append(preprocess_image(image, enc.image_size, enc.resize))
        return np.stack(rows)

    def _run_batch(self, gen: ServedGeneration, rows: np.ndarray, k: int):
        """Batcher worker: embed ``rows`` and search them; per-row ``(vector, D, I)``."""
        tic = time.perf_counter()
        xq = gen.encoder.embed(rows)
        toc = time.perf_counter()
        D, I = gen.search(xq, k)
        return list(zip(xq, D, I)), {"embed": toc - tic, "search": time.perf_counter() - toc}

    @staticmethod
    def _fetch_k(gen: ServedGeneration, k: int, min_score: float | None = None) -> int:
        # a little deeper than k, so that ids dropped as tombstones (or the query itself) leave k behind; a
        # threshold search starts smaller and goes deeper only when its last result is still above the threshold
        if min_score is not None:
            k = min(k, THRESHOLD_FIRST_K)
        return min(max(1, gen.ntotal), k + max(4, k // 4))

    def _hits(
        self,
        gen: ServedGeneration,
        xq: np.ndarray,
        D: np.ndarray,
        I: np.ndarray,
        k: int,
        exclude: int | None = None,
        min_score: float | None = None,
        flt: SearchFilter | None = None,
        idf=None,
    ) -> list[dict]:
        """The first ``k`` live neighbours from ``(D, I)``, searching deeper while tombstones (or the size range
        of ``flt``) ate some.

        With ``min_score``: every live neighbour scoring at least ``min_score`` (at most ``k``): a FAISS range
        search where the index type answers one (flat, IVF, HNSW scanned exactly over its flat storage, since
        HNSW's own beam misses most of a large result), else a k doubled while the last result is still above
        the threshold (IVF-PQ re-ranked, GPU copies, custom factory strings, filters). Either way the index is
        searched again deeper (nprobe / efSearch) while the items reached above the threshold ask for more than
        the tuned depth (:func:`indexer.filters.threshold_factor`: the tuned depth finds the first 10).
        With ``idf`` (the id filter of ``flt``): ``(D, I)`` are searched again with it.
        """

        def deeper(fetch: int, depth: int = 1):
            return tuple(row[0] for row in gen.search(xq[None], fetch, idf, depth))

        fetched, depth = len(I), 1
        if idf is not None:
            D, I = deeper(fetched)
        reach = self._fetch_k(gen, k) + 1  # a threshold search needs no more than this many above it
        if min_score is not None and gen.can_range_search and idf is None:
            D, I = gen.range_search(xq, min_score)
            while threshold_factor(min(len(I), reach)) > depth:
                depth = threshold_factor(min(len(I), reach))
                D, I = gen.range_search(xq, min_score, depth)
            fetched = gen.ntotal
        while min_score is not None:
            found = I >= 0
            above = int(np.count_nonzero(found & (D >= min_score)))
            # (-1 pads do not mean the index is exhausted: a filtered HNSW search returns fewer than k)
            more = fetched < gen.ntotal and above and D[found][-1] >= min_score and above < reach
            need = threshold_factor(min(above, reach))
            if not more and need <= depth:
                break  # the index has nothing more above the threshold at this depth (or already more than k)
            fetched, depth = min(gen.ntotal, 2 * fetched) if more else fetched, max(depth, need)
            D, I = deeper(fetched, depth)
        while True:
            keep = (I >= 0) if min_score is None else (I >= 0) & (D >= min_score)
            ids = [i for i in I[keep].tolist() if i != exclude]
            records = gen.directory.records(ids)
            score = dict(zip(I.tolist(), D.tolist()))
            hits = []
            for rec in records:
                if rec is not None and (flt is None or flt.accepts(rec)):
                    hit = rec.to_dict()
                    hit["score"] = score[rec.id]
                    hits.append(hit)
            if len(hits) >= k or fetched >= gen.ntotal or (min_score is not None and not (flt and flt.sized)):
                return hits[:k]
            if min_score is not None and len(I) and I[-1] >= 0 and D[-1] < min_score:
                return hits[:k]  # deeper would only find items below the threshold
            fetched = min(gen.ntotal, 2 * fetched)
            D, I = deeper(fetched, depth)

    def _results(
        self,
        gen: ServedGeneration,
        out,
        n: int,
        k: int,
        min_score: float | None,
        t0: float,
        t1: float,
        t2: float,
        flt: SearchFilter | None = None,
    ) -> list[SearchResult]:
        """The batch's rows -> results: read the hits' records, attach the phase timings."""
        results = []
        idf = gen.id_filter(flt)
        for xq, D, I in out.value:
            hits = self._hits(gen, xq, D, I, k, min_score=min_score, flt=flt, idf=idf)
            timings = {"decode": (t1 - t0) / n, "queue": out.queued, **out.seconds}
            results.append(SearchResult(hits, gen.name, timings, out.batch_rows))
        t3 = time.perf_counter()
        for res in results:
            res.timings["metadata"] = (t3 - t2) / len(results)
            res.timings["total"] = (t3 - t0) / len(results)
        self._count(n)
        return results

    def _neighbours(
        self, images: list, k: int, min_score: float | None = None, flt: SearchFilter | None = None
    ) -> list[SearchResult]:
        """Decode in this thread, embed + search in a micro-batch, read the records in this thread."""
        with self._generation() as gen:
            t0 = time.perf_counter()
            rows = self._decode(gen, images)
            t1 = time.perf_counter()
            gen.id_filter(flt)  # an unknown label fails before the encoder runs
            out = self._batcher.submit(gen, rows, self._fetch_k(gen, k, min_score)).result()
            return self._results(gen, out, len(images), k, min_score, t0, t1, time.perf_counter(), flt)

    async def _neighbours_async(
        self, images: list, k: int, min_score: float | None = None, flt: SearchFilter | None = None
    ) -> list[SearchResult]:
        """Decode on a decode thread, which hands the rows straight to the batcher; the batch's end wakes the
        event loop once (one loop wake-up per request instead of two: measured +6% requests/s at 8 clients),
        which reads the records (LMDB reads of a published store: memory-mapped, lock-free, microseconds).

        The generation stays referenced until its decode and batch are over, even when the awaiting request is
        cancelled (the threads still use its encoder and index)."""
        loop = asyncio.get_running_loop()
        gen = self._acquire()
        try:
            gen.id_filter(flt)  # an unknown label fails before anything is decoded
        except BaseException:
            gen.release()
            raise
        t0 = time.perf_counter()
        fetch_k = self._fetch_k(gen, k, min_score)
        done = loop.create_future()
        state = {"over": False, "abandoned": False}
        lock = threading.Lock()

        def finish(outcome) -> None:  # in a decode or batcher thread, once
            with lock:
                state["over"] = True
                abandoned = state["abandoned"]
            if abandoned:
                gen.release()
            else:
                loop.call_soon_threadsafe(lambda: done.cancelled() or done.set_result(outcome))

        def decode_and_submit() -> None:
            try:
                rows = self._decode(gen, images)
                t1 = time.perf_counter()
                batch = self._batcher.submit(gen, rows, fetch_k)
            except BaseException as exc:  # handed to the awaiting request, raised there
                finish((exc, None))
                return
            batch.add_done_callback(lambda future: finish((future, t1)))

        self._decoders.submit(decode_and_submit)
        try:
            got, t1 = await done
        except asyncio.CancelledError:
            with lock:
                state["abandoned"] = True
                over = state["over"]
            if over:
                gen.release()
            raise
        try:
            if t1 is None:
                raise got
            return self._results(gen, got.result(), len(images), k, min_score, t0, t1, time.perf_counter(), flt)
        finally:
            gen.release()

    def search(
        self, images: list, k: int | None = None, min_score: float | None = None, flt: SearchFilter | None = None
    ) -> list[SearchResult]:
        """The ``k`` nearest items to each query image, or every item scoring at least ``min_score``.

        Args:
            images: encoded image bytes, image file paths or PIL images (n of them).
            k: neighbours per query, 1 to ``config.max_k`` (fewer come back when the index holds fewer);
                default ``SEARCH_K``, or ``max_k`` with ``min_score`` (then a cap, not a count).
            min_score: keep only neighbours with a cosine similarity of at least this, in [-1, 1].
            flt: only items this :class:`SearchFilter` allows.

        Returns:
            n :class:`SearchResult`, in query order.

        Raises:
            DataError: an image that does not decode (corrupt, truncated, not an image, too large).
            ConfigError: k or min_score out of range, an unknown label (named, with those that exist).
        """
        k = self.resolve_k(k, min_score)
        return self._neighbours(images, k, min_score, flt)

    def search_vectors(
        self, xq: np.ndarray, k: int | None = None, min_score: float | None = None, flt: SearchFilter | None = None
    ) -> list[SearchResult]:
        """The ``k`` nearest items to each query vector (``min_score``: as in :meth:`search`).

        Args:
            xq: float32 ``[n, D]``, L2-normalized rows (as the index's encoder makes them); ``D`` is the
                index's dimension.

        Raises:
            DataError: not a finite ``[n, D]`` array of unit rows. ConfigError: k or min_score out of range.
        """
        k = self.resolve_k(k, min_score)
        xq = np.asarray(xq, dtype=np.float32)
        with self._generation() as gen:
            d = gen.manifest.embedding_dim
            if xq.ndim != 2 or xq.shape[1] != d or not len(xq):
                raise DataError(f"query vectors must be a float32 [n, {d}] array, got shape {list(xq.shape)}")
            norms = np.linalg.norm(xq, axis=1)
            if not np.all(np.isfinite(xq)) or np.abs(norms - 1).max() > 1e-3:
                raise DataError("query vectors must be finite and L2-normalized (unit rows), as the encoder makes them")
            t0 = time.perf_counter()
            idf = gen.id_filter(flt)
            D, I = gen.search(np.ascontiguousarray(xq), self._fetch_k(gen, k, min_score), idf)
            t1 = time.perf_counter()
            results = [
                SearchResult(
                    self._hits(gen, q, d_row, i_row, k, min_score=min_score, flt=flt, idf=idf), gen.name, {}, len(xq)
                )
                for q, d_row, i_row in zip(xq, D, I)
            ]
            t2 = time.perf_counter()
        for res in results:
            res.timings = {"search": (t1 - t0) / len(xq), "metadata": (t2 - t1) / len(xq), "total": (t2 - t0) / len(xq)}
        self._count(len(xq))
        return results

    def _by_id(
        self,
        gen: ServedGeneration,
        item_id: int,
        k: int,
        min_score: float | None,
        flt: SearchFilter | None = None,
        idf=None,
    ) -> SearchResult:
        t0 = time.perf_counter()
        query = self._record(gen, item_id)
        xq = gen.vector(item_id)
        if xq is None:  # this index type cannot return stored vectors: embed the item's image again
            f, _ = open_indexed_file(gen.manifest.image_root, query)
            with f:
                data = f.read()
            xq = gen.encoder.embed(self._decode(gen, [data]))[0]
        t1 = time.perf_counter()
        D, I = gen.search(xq[None], self._fetch_k(gen, k + 1, min_score), idf)
        t2 = time.perf_counter()
        hits = self._hits(gen, xq, D[0], I[0], k, exclude=int(item_id), min_score=min_score, flt=flt, idf=idf)
        t3 = time.perf_counter()
        timings = {
            "decode": 0.0,
            "queue": 0.0,
            "embed": t1 - t0,
            "search": t2 - t1,
            "metadata": t3 - t2,
            "total": t3 - t0,
        }
        return SearchResult(hits, gen.name, timings, 1, query=query.to_dict())

    def search_by_id(
        self, item_id: int, k: int | None = None, min_score: float | None = None, flt: SearchFilter | None = None
    ) -> SearchResult:
        """The ``k`` nearest items to an indexed item (the item itself left out); ``min_score`` as in
        :meth:`search`.

        Raises:
            UnknownItemError: no live item ``item_id``. ConfigError: k or min_score out of range.
        """
        (res,) = self.search_by_ids([item_id], k, min_score, flt)
        return res

    def search_by_ids(
        self, item_ids: list[int], k: int | None = None, min_score: float | None = None, flt: SearchFilter | None = None
    ) -> list[SearchResult]:
        """:meth:`search_by_id` for several items, answered in their order from one generation.

        Raises:
            UnknownItemError: one of the ids is not a live item (named). DataError: no ids.
            BatchTooLargeError: more than ``max_queries`` ids. ConfigError: k or min_score out of range.
        """
        k = self.resolve_k(k, min_score)
        self.check_batch(len(item_ids), "ids")
        with self._generation() as gen:
            idf = gen.id_filter(flt)
            results = [self._by_id(gen, int(i), k, min_score, flt, idf) for i in item_ids]
        self._count(len(results))
        return results

    def duplicates(self, item_id: int, threshold: float = DUPLICATE_THRESHOLD) -> SearchResult:
        """The near-duplicates of an indexed item: every other item scoring at least ``threshold`` with it (at
        most ``max_k``), as ``moco duplicates`` pairs them.

        Raises:
            UnknownItemError: no live item ``item_id``. ConfigError: threshold not in [-1, 1].
        """
        return self.search_by_id(item_id, None, threshold)

    def search_async(
        self, images: list, k: int | None = None, min_score: float | None = None, flt: SearchFilter | None = None
    ):
        """:meth:`search` for an asyncio caller: a coroutine that decodes on the engine's decode threads and
        awaits the micro-batch without holding a thread (the HTTP API)."""
        k = self.resolve_k(k, min_score)
        return self._neighbours_async(images, k, min_score, flt)

    def _check_classify(self, k: int | None, temperature: float | None) -> tuple[int, float]:
        """The checked ``(k, temperature)`` of a vote (defaults: ``config.knn_k``, ``KNN_TEMPERATURE``)."""
        k = self.config.knn_k if k is None else k
        temperature = KNN_TEMPERATURE if temperature is None else temperature
        self._check_k(k)
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ConfigError(f"temperature must be a positive number, got {temperature!r}")
        with self._generation() as gen:
            if not gen.labels():
                raise ArtifactError(
                    f"index {self.index_dir} has no labels to vote with; index a folder with one "
                    "subfolder per class to classify"
                )
        return k, temperature

    @staticmethod
    def _votes(results: list[SearchResult], temperature: float) -> list[Classification]:
        out = []
        for res in results:
            scores = np.array([h["score"] for h in res.hits], dtype=np.float64)
            probs = knn_vote(scores, [h.get("label") for h in res.hits], float(temperature))
            label = next(iter(probs), None)
            out.append(Classification(label, probs, res.hits, res.generation, res.timings, res.batch_size))
        return out

    def classify(self, images: list, k: int | None = None, temperature: float | None = None) -> list[Classification]:
        """k-NN classification: the labels of the ``k`` nearest items (default ``config.knn_k``, the one default of
        the CLI, the API and the web app) vote with weights ``exp(s / T)``.

        Raises:
            ArtifactError: the index has no labeled items (index a folder with one subfolder per class).
            DataError: an image that does not decode. ConfigError: k or temperature out of range.
        """
        k, temperature = self._check_classify(k, temperature)
        return self._votes(self._neighbours(images, k), temperature)

    def classify_vectors(
        self, xq: np.ndarray, k: int | None = None, temperature: float | None = None
    ) -> list[Classification]:
        """:meth:`classify` of query vectors (``xq`` as in :meth:`search_vectors`): for callers that embed
        themselves, e.g. ``moco classify`` over a folder, which decodes in worker processes.

        Raises:
            ArtifactError: the index has no labeled items. DataError: not a finite ``[n, D]`` array of unit rows.
            ConfigError: k or temperature out of range.
        """
        k, temperature = self._check_classify(k, temperature)
        return self._votes(self.search_vectors(xq, k), temperature)

    def classify_by_id(self, item_id: int, k: int | None = None, temperature: float | None = None) -> Classification:
        """:meth:`classify` of an indexed item by its stored vector (the item itself does not vote)."""
        k, temperature = self._check_classify(k, temperature)
        (out,) = self._votes([self.search_by_id(item_id, k)], temperature)
        return out

    async def classify_async(
        self, images: list, k: int | None = None, temperature: float | None = None
    ) -> list[Classification]:
        """:meth:`classify` for an asyncio caller (see :meth:`search_async`)."""
        k, temperature = self._check_classify(k, temperature)
        return self._votes(await self._neighbours_async(images, k), temperature)

    # -- items and statistics ----------------------------------------------------------------------------------
    @staticmethod
    def _record(gen: ServedGeneration, item_id: int) -> ItemRecord:
        rec = gen.directory.record(int(item_id)) if 0 <= int(item_id) < 2**63 else None
        if rec is None:
            raise UnknownItemError(f"no item with id {item_id} in this index; ids come from search results")
        return rec

    def item(self, item_id: int) -> dict:
        """The record of a live item. Raises UnknownItemError."""
        with self._generation() as gen:
            return self._record(gen, item_id).to_dict()

    def open_image(self, item_id: int):
        """``(open binary file, fstat, record)`` of a live item's image, only while it is still the indexed file
        (:func:`serve.files.open_indexed_file`: a regular file inside the image folder, same size and mtime).

        Raises:
            UnknownItemError: unknown id. ImageGoneError: the file is gone, moved outside, or changed.
        """
        with self._generation() as gen:
            rec = self._record(gen, item_id)
            root = gen.manifest.image_root
        f, st = open_indexed_file(root, rec)
        return f, st, rec.to_dict()

    def labels(self) -> dict[str, int]:
        """label -> live item count of the live generation (empty for an unlabeled corpus)."""
        with self._generation() as gen:
            return gen.labels()

    @property
    def encoder(self) -> OnnxEncoder:
        """The live generation's encoder (``image_size``, ``resize``, ``embed``), for callers that decode and embed
        query images themselves, then answer with :meth:`search_vectors` / :meth:`classify_vectors`. With a
        watcher (``poll_seconds`` > 0) a newly published generation may bring another one between two calls."""
        return self._current.encoder

    @property
    def image_root(self) -> Path:
        """The folder the live generation's item paths are relative to."""
        return Path(self._current.manifest.image_root)

    def examples(self, n: int) -> list[dict]:
        """Up to ``n`` live records to offer as example queries, spread over the labels (lowest ids first)."""
        with self._generation() as gen:
            next_id = int(gen.manifest.next_id)
            by_label: dict[str | None, list[dict]] = {}
            for start in range(0, next_id, 1024):
                for rec in gen.directory.records(range(start, min(next_id, start + 1024))):
                    if rec is not None and len(by_label.setdefault(rec.label, [])) < n:
                        by_label[rec.label].append(rec.to_dict())
                if sum(map(len, by_label.values())) >= n * max(1, len(gen.labels())):
                    break
        picked, rounds = [], list(by_label.values())
        while len(picked) < n and any(rounds):  # round-robin over the labels
            for recs in rounds:
                if recs and len(picked) < n:
                    picked.append(recs.pop(0))
        return picked

    def queue_depth(self) -> int:
        """Query batches waiting for the encoder."""
        return self._batcher.pending()

    def item_count(self) -> int:
        """Items of the live generation."""
        return self._current.ntotal

    def encoder_info(self) -> dict:
        """``provider``, ``arch`` and ``sha256`` of the live generation's encoder."""
        enc = self._current.encoder
        return {"provider": enc.provider, "arch": str(enc.metadata.get("arch")), "sha256": enc.sha256}

    def stats(self) -> dict:
        """What is served: items, labels, model, index type, recall@10, generation, counters."""
        with self._generation() as gen:
            m, enc = gen.manifest, gen.encoder
            labels = gen.labels()
            return {
                "index_dir": str(self.index_dir),
                "image_root": m.image_root,
                "generation": gen.name,
                "items": gen.ntotal,
                "labels": labels,
                "model": model_summary(enc.metadata) | {"sha256": enc.sha256, "provider": enc.provider},
                "index": {
                    "factory": m.factory,
                    "metric": m.metric,
                    "type": type(gen.directory.index).__name__,
                    "recall_at_10": m.recall_at_10,
                },
                "created_at": m.created_at,
                "updated_at": m.updated_at,
                "queries_served": self.queries,
                "swaps": self.swaps,
            }
