"""Search filters as FAISS ``IDSelector`` bitmaps over a generation's ids, and how deep a filtered search goes.

An :class:`IdFilter` is a bitmap over ``[0, next_id)`` (one bit per id ever given out: 125 KB per million), built
from sorted id arrays that come from range scans of the metadata store (a label's ids, a path prefix's ids:
:meth:`indexer.metadata.MetadataStore.label_ids`, ``path_prefix_ids``), minus excluded ids. FAISS checks it
inside the search of the base and of the delta (``IDSelectorBitmap``), for flat, IVF and HNSW alike.

A restrictive filter starves an approximate search: IVF probes ``nprobe`` lists that hold few allowed items,
HNSW's beam meets few of them. So :func:`filtered_params` raises ``nprobe`` / ``efSearch`` by the inverse of the
fraction kept over :data:`DEPTH_SLACK` (:func:`depth_factor`), and a filter that keeps at most
:data:`EXACT_FILTER_MAX` items, or too small a share for a raise of at most :data:`SELECTOR_MAX_FACTOR`, is
answered exactly from the stored vectors of those items instead (:func:`answered_exactly`,
:meth:`indexer.searcher.LayeredIndex.search`), which costs what the filter keeps, not the corpus.

The slack is measured, not assumed (1M x 512, ``bench/results/search_filters_1000000_depth_sweep.json``): the
depth tuned for recall@10 already reaches well past the first ten, so a filter keeping 5% needed no raise at all
(IVF4096 0.978, HNSW32 0.987 at x1) and the full inverse (x20) cost HNSW 8x its queries/s for 0.7 points; the
most any measured case needed was a sixth of the inverse (HNSW at 1%: 0.90 at x8, 0.967 at x16 of 100).
Dividing the inverse by 4 keeps a margin under that and every filter measured on the selector path at
recall@10 >= 0.95 (``search_filters_1000000_depth_rule.json``: 1% x25, HNSW 0.98, IVF 0.99).

A threshold search (``min_score``) starves it the same way: nprobe / efSearch are tuned to find the first
:data:`RECALL_K` neighbours, and the first hundred above a threshold lie in more lists than the first ten
(recall of the first tens above a threshold fell to 0.83 on IVF-PQ at the tuned nprobe, issue 24). So
:func:`threshold_factor` raises the depth by the number of items the threshold search reaches over ``RECALL_K``,
with the same cap.
"""

from __future__ import annotations

import math

import faiss
import numpy as np

EXACT_FILTER_MAX = 5_000  # filters keeping at most this many items are scored exactly (gathered per query: 5k x 512)
DEPTH_SLACK = 4  # the tuned depth finds the allowed first ten at this fraction of the inverse of the share kept
SELECTOR_MAX_FACTOR = 32  # a filter that would need a deeper raise is scored exactly, whatever it keeps
MAX_DEPTH_FACTOR = 64  # nprobe / efSearch are raised at most this much (beyond it the exact path is cheaper)
RECALL_K = 10  # the k whose recall approximate indexes are tuned for (recall@10, indexer.faiss_index._tune)


class IdFilter:
    """The ids a search may return: a bitmap over ``[0, next_id)``.

    Args:
        next_id: ids run from 0 to ``next_id - 1``.
        allowed: sorted int64 ids allowed (``None``: every id).
        exclude: ids never returned.
    """

    def __init__(self, next_id: int, allowed: np.ndarray | None = None, exclude=()):
        self.next_id = int(next_id)
        bits = np.zeros(self.next_id, dtype=bool) if allowed is not None else np.ones(self.next_id, dtype=bool)
        if allowed is not None:
            allowed = np.asarray(allowed, dtype=np.int64)
            bits[allowed[(allowed >= 0) & (allowed < self.next_id)]] = True
        exclude = np.asarray(list(exclude), dtype=np.int64)
        bits[exclude[(exclude >= 0) & (exclude < self.next_id)]] = False
        self.bits = bits
        self.bitmap = np.packbits(bits, bitorder="little")  # FAISS reads bit (i & 7) of byte i >> 3
        self.selector = faiss.IDSelectorBitmap(len(self.bitmap), faiss.swig_ptr(self.bitmap))

    @classmethod
    def of_bits(cls, bits: np.ndarray) -> "IdFilter":
        out = cls.__new__(cls)
        out.next_id, out.bits = len(bits), bits
        out.bitmap = np.packbits(bits, bitorder="little")
        out.selector = faiss.IDSelectorBitmap(len(out.bitmap), faiss.swig_ptr(out.bitmap))
        return out

    def ids(self) -> np.ndarray:
        """The allowed ids, sorted (live or not: the caller's selector of removed ids still applies)."""
        return np.flatnonzero(self.bits).astype(np.int64)

    def count(self) -> int:
        return int(np.count_nonzero(self.bits))

    def allows(self, I: np.ndarray) -> np.ndarray:
        """bool mask of ``I`` (-1 pads: False)."""
        ok = (I >= 0) & (I < self.next_id)
        return ok & self.bits[np.where(ok, I, 0)]


def depth_factor(kept: int, total: int) -> int:
    """How much deeper a search filtered to ``kept`` of ``total`` items goes: ``total / kept / DEPTH_SLACK``
    rounded up, at least 1, at most ``MAX_DEPTH_FACTOR`` (50% -> 1, 5% -> 5, 1% -> 25, 0.1% -> 64)."""
    if total <= 0 or kept >= total:
        return 1
    return int(min(MAX_DEPTH_FACTOR, max(1, math.ceil(total / (max(1, kept) * DEPTH_SLACK)))))


def answered_exactly(kept: int, total: int) -> bool:
    """True when a filter keeping ``kept`` of ``total`` items is scored exactly over the kept items' stored
    vectors instead of searched with the selector: few enough to gather per query (``EXACT_FILTER_MAX``), or a
    share so small (under 1 / (``DEPTH_SLACK`` x ``SELECTOR_MAX_FACTOR``), 0.78%) that the selector would need
    more than ``SELECTOR_MAX_FACTOR`` times the tuned depth: at 0.5% of 1M, HNSW32 at x50 found 0.947 of the
    ten at 25 queries/s, the exact path all of them at 142."""
    return kept <= EXACT_FILTER_MAX or kept * DEPTH_SLACK * SELECTOR_MAX_FACTOR < total


def threshold_factor(reached: int) -> int:
    """How much deeper a threshold search goes that has reached ``reached`` items above its threshold: the tuned
    depth finds the first ``RECALL_K``, so ``reached / RECALL_K`` times that (1 up to ``RECALL_K``, at most
    ``MAX_DEPTH_FACTOR``)."""
    return int(min(MAX_DEPTH_FACTOR, max(1, math.ceil(reached / RECALL_K))))


def combined_factor(*factors: int) -> int:
    """Depth factors that apply together (a filter's and a threshold's), multiplied, at most ``MAX_DEPTH_FACTOR``."""
    return int(min(MAX_DEPTH_FACTOR, math.prod(max(1, int(f)) for f in factors)))


def filtered_params(params: dict, factor: int, nlist: int | None = None, min_ef: int = 0) -> dict:
    """``params`` (``{"nprobe": n}`` / ``{"efSearch": n}``) ``factor`` times deeper (nprobe at most ``nlist``), and
    efSearch at least ``min_ef``: a filtered HNSW beam must hold ``k / share kept`` items to meet ``k`` allowed
    ones, which the factor alone misses where the tuned efSearch is small (16 on a 400-item index: 8 of the 10
    allowed neighbours of a 4% filter came back at x6)."""
    out = dict(params)
    if "nprobe" in out and factor > 1:
        out["nprobe"] = int(min(nlist or out["nprobe"] * factor, out["nprobe"] * factor))
    if "efSearch" in out:
        out["efSearch"] = int(max(out["efSearch"] * max(1, factor), min_ef))
    return out
