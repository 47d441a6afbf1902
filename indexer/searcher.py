"""Searching one generation: its base FAISS index minus the base ids removed since (tombstones), plus the
small delta index of items added since, as one index; re-ranked with stored vectors for compressed codes.

:class:`LayeredIndex` has the ``search`` / ``reconstruct`` / ``ntotal`` / ``d`` of a FAISS index, so the
server uses it as one. Removed ids are excluded inside FAISS with an ``IDSelector`` in the search parameters
(IVF, HNSW and flat indexes all honour it), where the tuned ``nprobe`` / ``efSearch`` travel too; where an
index cannot take a selector (a GPU copy, a custom factory string) it is searched ``len(removed)`` deeper
and the removed ids are dropped, which is exact. Results of base and delta are merged by score.

A search can ask to go ``depth`` times deeper than tuned (nprobe / efSearch raised, as a filter raises them:
:mod:`indexer.filters`): a threshold search that reaches past the first ``RECALL_K`` items does.

For IVF-PQ the codes alone cap recall (0.38 at 100k x 512 in ``bench/results/faiss_indexes_cpu2.json``),
so candidates are re-ranked: ``refine`` x k candidates are fetched and scored exactly against their stored
vectors (:class:`indexer.vectors.BlockVectors`, float16 blocks on disk, memory-mapped).
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import faiss
import numpy as np

from moco_retrieval.indexer.filters import answered_exactly, combined_factor, depth_factor, filtered_params

LOG = logging.getLogger(__name__)

GPU_MAX_K = 2048  # FAISS GPU search returns at most this many neighbours (and probes at most this many lists)
HNSW_SCAN_MAX = 100_000  # HNSW bases up to this size answer thresholds and filters exactly (a threshold: ~14 ms)


def unwrap(index: faiss.Index) -> faiss.Index:
    """The index inside an ``IDMap`` / ``IDMap2`` wrapper (downcast), or ``index`` itself."""
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        return faiss.downcast_index(index.index)
    return index


def takes_parameters(index: faiss.Index) -> bool:
    """True when ``index.search(..., params=...)`` honours a selector and our nprobe / efSearch directly."""
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexIVF):
        return True
    if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        inner = unwrap(index)
        return isinstance(inner, (faiss.IndexFlat, faiss.IndexHNSW)) or hasattr(inner, "hnsw")
    return isinstance(index, faiss.IndexFlat)


def search_parameters(index: faiss.Index, params: dict, sel=None):
    """FAISS search parameters for ``index`` carrying the tuned ``params`` and an optional selector, or
    ``None`` for index types that cannot take them (see :func:`takes_parameters`)."""
    if not takes_parameters(index):
        return None
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        p = faiss.SearchParametersIVF()
        p.nprobe = int(params.get("nprobe", ivf.nprobe))
    elif hasattr(unwrap(index), "hnsw"):
        p = faiss.SearchParametersHNSW()
        p.efSearch = int(params.get("efSearch", unwrap(index).hnsw.efSearch))
    else:
        p = faiss.SearchParameters()
    if sel is not None:
        p.sel = sel
    return p


def index_ids(index: faiss.Index) -> np.ndarray:
    """Every id stored in ``index`` (IDMap or IVF), sorted."""
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        return np.sort(faiss.vector_to_array(index.id_map).astype(np.int64))
    invlists = faiss.extract_index_ivf(index).invlists
    ids = [
        faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy()
        for i in range(invlists.nlist)
        if invlists.list_size(i)
    ]
    return np.sort(np.concatenate(ids).astype(np.int64)) if ids else np.zeros(0, dtype=np.int64)


def merge_results(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of several ``(D, I)`` results (inner product: larger is better; -1 pads)."""
    D = np.concatenate([p[0] for p in parts], axis=1).astype(np.float32, copy=False)
    I = np.concatenate([p[1] for p in parts], axis=1)
    D = np.where(I < 0, -np.inf, D)
    if D.shape[1] < k:
        pad = k - D.shape[1]
        D = np.pad(D, ((0, 0), (0, pad)), constant_values=-np.inf)
        I = np.pad(I, ((0, 0), (0, pad)), constant_values=-1)
    order = np.argsort(-D, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(D, order, 1), np.take_along_axis(I, order, 1)


class LayeredIndex:
    """base - removed + delta, searched as one index (see the module docstring).

    Args:
        base: the base FAISS index (CPU; memory-mapped or on disk is fine).
        delta: FAISS index of the items added since the base, or ``None``.
        removed: int64 base ids removed since the base.
        params: the tuned ``{"nprobe": n}`` / ``{"efSearch": n}`` / ``{"refine": r}``.
        vectors: stored vectors by id (``BlockVectors``), for re-ranking when ``params`` has ``refine``, and
            for :meth:`reconstruct` where the index cannot give vectors back; or a callable opening them
            when first needed.
        gpu: a GPU copy of ``base`` (``indexer.faiss_gpu.GpuCopy``) searched when it can answer.
    """

    def __init__(
        self,
        base: faiss.Index,
        delta: faiss.Index | None = None,
        removed: np.ndarray | None = None,
        params: dict | None = None,
        vectors=None,
        gpu=None,
    ):
        self.base = base
        self.delta = delta if delta is not None and delta.ntotal > 0 else None
        self.removed = np.unique(np.asarray(removed if removed is not None else [], dtype=np.int64))
        self.params = dict(params or {})
        self.refine = int(self.params.get("refine", 0))
        self.gpu = gpu
        self._vectors = vectors
        self.d = base.d
        self.base_ntotal = int(base.ntotal)
        self.ntotal = self.base_ntotal - len(self.removed) + (int(self.delta.ntotal) if self.delta else 0)
        self._selector = None
        if len(self.removed):
            self._batch = faiss.IDSelectorBatch(self.removed)  # referenced: the Not selector does not own it
            self._selector = faiss.IDSelectorNot(self._batch)
        self._base_params = search_parameters(base, self.params, self._selector)
        self._delta_params = search_parameters(self.delta, self.params) if self.delta is not None else None

    @property
    def vectors(self):
        if callable(self._vectors):
            self._vectors = self._vectors()
        return self._vectors

    def __repr__(self) -> str:
        return (
            f"LayeredIndex(base={self.base_ntotal}, removed={len(self.removed)}, "
            f"delta={self.delta.ntotal if self.delta else 0}, params={self.params})"
        )

    # -- search ---------------------------------------------------------------------------------------------
    def _drop_removed(self, D: np.ndarray, I: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.removed):
            gone = np.isin(I, self.removed)
            I = np.where(gone, -1, I)
        return merge_results([(D, I)], k)

    def _params(self, part: faiss.Index, is_base: bool, factor: int, k: int = 0):
        """The search parameters of one layer ``factor`` times deeper than tuned (``None``: a type without them),
        an HNSW beam (efSearch) at least ``k``: FAISS's HNSW returns at most efSearch found neighbours, so a
        deeper k alone finds nothing more (5,000 items at efSearch 16: recall of the first 11 0.93 at k = 11,
        100 or 1,000)."""
        if factor <= 1 and k <= self.params.get("efSearch", k):
            return self._base_params if is_base else self._delta_params
        ivf = faiss.try_extract_index_ivf(part)
        params = filtered_params(self.params, factor, ivf.nlist if ivf is not None else None, min_ef=k)
        return search_parameters(part, params, self._selector if is_base else None)

    def _search_base(self, xq: np.ndarray, k: int, depth: int = 1) -> tuple[np.ndarray, np.ndarray]:
        deeper = min(self.base_ntotal, k + len(self.removed))
        if self.gpu is not None and depth <= 1 and self.gpu.can_search(deeper):  # (the copy keeps the tuned nprobe)
            D, I = self.gpu.search(xq, deeper)
            return self._drop_removed(D, I, k)
        params = self._params(self.base, True, depth, k)
        if params is not None:
            return self.base.search(xq, k, params=params)
        D, I = self.base.search(xq, max(1, deeper))
        return self._drop_removed(D, I, k)

    def _filtered_part(self, part: faiss.Index, xq: np.ndarray, k: int, filt, factor: int, is_base: bool):
        """One layer searched with the filter's selector (and the removed ids' for the base), ``factor`` deeper
        (an HNSW beam at least ``k`` over the share the filter keeps, at most the layer's size)."""
        ivf = faiss.try_extract_index_ivf(part)
        beam = min(int(part.ntotal), math.ceil(k * self.ntotal / max(1, filt.count())))
        params = filtered_params(self.params, factor, ivf.nlist if ivf is not None else None, min_ef=beam)
        sel = filt.selector
        if is_base and self._selector is not None:
            sel = faiss.IDSelectorAnd(self._selector, filt.selector)
        p = search_parameters(part, params, sel)
        if p is not None:  # (``sel`` stays referenced here until the search is over: FAISS does not own it)
            return part.search(xq, k, params=p)
        deeper = min(int(part.ntotal), k * factor + (len(self.removed) if is_base else 0))
        D, I = part.search(xq, max(1, deeper))  # a type that takes no selector: deeper, then filtered
        ok = filt.allows(I)
        if is_base and len(self.removed):
            ok &= ~np.isin(I, self.removed)
        return merge_results([(D, np.where(ok, I, -1))], k)

    def _exact_filtered(self, xq: np.ndarray, k: int, filt) -> tuple[np.ndarray, np.ndarray] | None:
        """The exact best ``k`` among the filter's ids, scored against their stored vectors; ``None`` when they
        cannot be read (no blocks, no reconstruct)."""
        bits = filt.bits
        if len(self.removed):  # (a mask, not np.isin: hashing the removed ids per query was a third of the path)
            bits = bits.copy()
            bits[self.removed[self.removed < len(bits)]] = False
        ids = np.flatnonzero(bits).astype(np.int64)
        if not len(ids):
            return (np.full((len(xq), k), -np.inf, dtype=np.float32), np.full((len(xq), k), -1, dtype=np.int64))
        vectors = self.vectors
        if vectors is not None:
            found, xb = vectors.get(ids)
        else:
            found, xb = np.zeros(len(ids), dtype=bool), np.zeros((len(ids), self.d), dtype=np.float32)
            for j, i in enumerate(ids):
                try:
                    xb[j] = self.reconstruct(int(i))
                    found[j] = True
                except RuntimeError:
                    return None
        ids, xb = ids[found], xb[found]
        D = xq @ xb.T
        return merge_results([(D.astype(np.float32), np.broadcast_to(ids, D.shape))], k)

    def search(self, xq: np.ndarray, k: int, filt=None, depth: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """``xq`` float32 ``[n, d]`` -> ``(D, I)`` float32 / int64 ``[n, k]``, best first (-1 pads).

        ``filt``: an :class:`indexer.filters.IdFilter`; only its ids come back. Few of them, or a small share,
        are scored exactly; more are searched with the selector, the index's depth raised by the inverse of the
        fraction kept over a measured slack (``indexer.filters.answered_exactly``, ``depth_factor``).
        ``depth``: nprobe / efSearch this many times the tuned value (nprobe at most nlist; with a filter, the two
        factors multiplied, at most ``MAX_DEPTH_FACTOR``); no effect on exact parts and on types that take no
        search parameters.
        """
        xq = np.ascontiguousarray(xq, dtype=np.float32)
        if filt is not None:
            return self._search_filtered(xq, k, filt, depth)
        fetch = k * self.refine if self.refine > 1 else k
        parts = [self._search_base(xq, fetch, depth)] if self.base_ntotal else []
        if self.delta is not None:
            kd = max(1, min(fetch, int(self.delta.ntotal)))
            params = self._params(self.delta, False, depth, kd)
            parts.append(self.delta.search(xq, kd, params=params) if params is not None else self.delta.search(xq, kd))
        if not parts:
            return (np.full((len(xq), k), -np.inf, dtype=np.float32), np.full((len(xq), k), -1, dtype=np.int64))
        D, I = merge_results(parts, fetch)
        if self.refine > 1 and self.vectors is not None:
            D, I = self._rerank(xq, I, k)
        return merge_results([(D, I)], k) if D.shape[1] != k else (D, I)

    def _hnsw_scan(self, part: faiss.Index):
        """``(flat storage, position -> id)`` of an ``IDMap(2),HNSW..Flat`` part of at most ``HNSW_SCAN_MAX``
        vectors, for an exact range search; the id map is copied once per generation (it is immutable), never
        per request. ``None`` for other types and larger parts (searched with a growing k instead)."""
        cache = self.__dict__.setdefault("_scans", {})
        if id(part) not in cache:
            found = None
            outer = faiss.downcast_index(part)
            inner = unwrap(part)
            small = part.ntotal <= HNSW_SCAN_MAX
            if small and isinstance(outer, (faiss.IndexIDMap, faiss.IndexIDMap2)) and hasattr(inner, "hnsw"):
                storage = faiss.downcast_index(inner.storage)
                if isinstance(storage, faiss.IndexFlat):
                    found = (storage, faiss.vector_to_array(outer.id_map).astype(np.int64))
            cache[id(part)] = found
        return cache[id(part)]

    def _parts(self) -> list[tuple[faiss.Index, object, bool]]:
        """``(index, its search parameters, is the base)`` of each non-empty layer."""
        parts = [(self.base, self._base_params, True)] if self.base_ntotal else []
        return parts + ([(self.delta, self._delta_params, False)] if self.delta is not None else [])

    @property
    def can_range_search(self) -> bool:
        """True when :meth:`range_search` finds every item above the radius that a k-NN search as deep would
        (or more): flat and IVF parts take our parameters (selector, nprobe); HNSW parts of at most
        ``HNSW_SCAN_MAX`` vectors are scanned exactly over their flat storage, because FAISS's HNSW range
        search, like a deep HNSW k-NN search, stops where its beam ends (measured on 460 clustered items: 132
        of 200 asked for came back, recall 0.50). False for larger HNSW parts (a scan reads the whole corpus:
        138 ms a query at 1M x 512) and for scores of compressed codes that wait to be re-ranked (IVF-PQ): those
        grow k, with efSearch / nprobe raised by what the threshold reaches, instead."""
        if self.refine > 1:
            return False
        return all(
            self._hnsw_scan(p) is not None if hasattr(unwrap(p), "hnsw") else params is not None
            for p, params, _ in self._parts()
        )

    def range_search(self, xq: np.ndarray, radius: float, depth: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every item scoring at least ``radius`` (inner product) with each query, as the index finds them.

        Args:
            xq: float32 ``[n, d]``.
            depth: nprobe this many times the tuned value (at most nlist), as in :meth:`search`.

        Returns:
            n ``(D, I)`` pairs (float32 / int64 ``[m_i]``), best first.

        Raises:
            RuntimeError: the index cannot range-search with our parameters (check :attr:`can_range_search`).
        """
        if not self.can_range_search:
            raise RuntimeError(f"{self!r} cannot range-search; search with a growing k")
        xq = np.ascontiguousarray(xq, dtype=np.float32)
        # FAISS keeps scores strictly above the radius (inner product): step just below it, then keep >= radius
        below = float(np.nextafter(np.float32(radius), np.float32(-np.inf)))
        found = []
        for part, _, is_base in self._parts():
            scan = self._hnsw_scan(part) if hasattr(unwrap(part), "hnsw") else None
            if scan is not None:
                lims, D, pos = scan[0].range_search(xq, below)
                I = scan[1][pos]
                if is_base and len(self.removed):
                    keep = ~np.isin(I, self.removed)
                    lims = np.concatenate([[0], np.cumsum([keep[a:b].sum() for a, b in zip(lims[:-1], lims[1:])])])
                    D, I = D[keep], I[keep]
            else:
                lims, D, I = part.range_search(xq, below, params=self._params(part, is_base, depth))
            found.append((lims, D, I))
        out = []
        for q in range(len(xq)):
            D = np.concatenate([f[1][f[0][q] : f[0][q + 1]] for f in found] + [np.zeros(0, np.float32)])
            I = np.concatenate([f[2][f[0][q] : f[0][q + 1]] for f in found] + [np.zeros(0, np.int64)]).astype(np.int64)
            keep = D >= radius
            D, I = D[keep], I[keep]
            order = np.argsort(-D, kind="stable")
            out.append((D[order].astype(np.float32), I[order]))
        return out

    def _search_filtered(self, xq: np.ndarray, k: int, filt, depth: int = 1) -> tuple[np.ndarray, np.ndarray]:
        kept = filt.count()
        # a small HNSW base is scored exactly whatever the filter keeps: its beam, filtered, stays near the query
        # (56,000 Fashion-MNIST images, a label other than the query's: recall@10 0.61 at any raise up to x20)
        small_hnsw = hasattr(unwrap(self.base), "hnsw") and self.base_ntotal <= HNSW_SCAN_MAX
        if small_hnsw or answered_exactly(kept, self.ntotal):
            exact = self._exact_filtered(xq, k, filt)
            if exact is not None:
                return exact
        factor = combined_factor(depth_factor(kept, self.ntotal), depth)
        fetch = k * self.refine if self.refine > 1 else k
        parts = [self._filtered_part(self.base, xq, fetch, filt, factor, True)] if self.base_ntotal else []
        if self.delta is not None:
            parts.append(
                self._filtered_part(self.delta, xq, max(1, min(fetch, int(self.delta.ntotal))), filt, factor, False)
            )
        if not parts:
            return (np.full((len(xq), k), -np.inf, dtype=np.float32), np.full((len(xq), k), -1, dtype=np.int64))
        D, I = merge_results(parts, fetch)
        if self.refine > 1 and self.vectors is not None:
            D, I = self._rerank(xq, I, k)
        return merge_results([(D, I)], k)

    def _rerank(self, xq: np.ndarray, I: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact inner products of the candidates ``I`` with their stored vectors; the best ``k``."""
        flat = I.ravel()
        found, vec = self.vectors.get(np.where(flat >= 0, flat, 0))
        vec = vec.reshape(I.shape[0], I.shape[1], -1)
        D = np.einsum("qd,qkd->qk", xq, vec)
        ok = (I >= 0) & found.reshape(I.shape)
        return merge_results([(np.where(ok, D, -np.inf), np.where(ok, I, -1))], k)

    # -- vectors and ids -------------------------------------------------------------------------------------
    def reconstruct(self, item_id: int) -> np.ndarray:
        """The stored vector ``[d]`` of a live id.

        Raises:
            RuntimeError: a removed or unknown id, or one no part can give back (as FAISS does).
        """
        item_id = int(item_id)
        pos = np.searchsorted(self.removed, item_id)
        if pos < len(self.removed) and self.removed[pos] == item_id:
            raise RuntimeError(f"id {item_id} was removed")
        for part in (self.delta, self.base):
            if part is None:
                continue
            try:
                return np.asarray(part.reconstruct(item_id), dtype=np.float32)
            except RuntimeError:
                continue
        vectors = self.vectors
        if vectors is not None:
            found, vec = vectors.get(np.array([item_id]))
            if found[0]:
                return vec[0]
        raise RuntimeError(f"no stored vector for id {item_id}")

    def ids(self) -> np.ndarray:
        """Every live id, sorted."""
        base = index_ids(self.base)
        if len(self.removed):
            base = base[~np.isin(base, self.removed)]
        if self.delta is None:
            return base
        return np.sort(np.concatenate([base, index_ids(self.delta)]))


def open_vectors_lazily(opener: Callable[[], object]) -> Callable[[], object]:
    """Wrap ``opener`` so that a failure to open the blocks (gone with a compaction) reads as "no vectors"."""

    def lazy():
        try:
            return opener()
        except Exception as exc:  # ArtifactError or OSError: reconstruct then says "no stored vector"
            LOG.debug("stored vectors unavailable: %s", exc)
            return None

    return lazy
