"""Near-duplicate groups of a generation: connected components of the graph "scores at least ``threshold``".

Each live item is searched with its stored vector for its ``k`` nearest neighbours (in batches, through the same
layered search as queries: base - removed + delta); pairs scoring at least the threshold are edges, and a
union-find joins them into groups. Cost: N searches of depth k, never the N² pairs: exact copies, re-encodes,
crops and resizes of one photo fall together even when a group is larger than ``k`` (its members link in
chains). Exact copies also share a sha256 in the metadata; this finds what bytes cannot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from moco_retrieval.indexer.records import ItemRecord

LOG = logging.getLogger(__name__)

DUPLICATE_K = 10  # neighbours looked at per item: groups larger than this still join through chains
BATCH = 1024  # items searched per call


@dataclass
class DuplicateGroup:
    """One group: ``ids`` (ascending) and the edges found, ``pairs`` ``(a, b, score)`` with a < b."""

    ids: list[int]
    pairs: list[tuple[int, int, float]]


def _find(parent: dict, a: int) -> int:
    root = a
    while parent[root] != root:
        root = parent[root]
    while parent[a] != root:  # path compression
        parent[a], a = root, parent[a]
    return root


def duplicate_groups(
    index,
    threshold: float,
    k: int = DUPLICATE_K,
    batch: int = BATCH,
    progress: Callable[[int, int], None] | None = None,
) -> list[DuplicateGroup]:
    """Groups of items scoring at least ``threshold`` with one another, largest first.

    Args:
        index: a :class:`~indexer.searcher.LayeredIndex` (``ids()``, ``search``, stored vectors).
        threshold: cosine similarity, in [-1, 1].
        k: neighbours per item.

    Returns:
        every group of two or more items.
    """
    ids = index.ids()
    parent: dict[int, int] = {}
    pairs: dict[tuple[int, int], float] = {}
    for start in range(0, len(ids), batch):
        chunk = ids[start : start + batch]
        xq = _vectors(index, chunk)
        D, I = index.search(xq, min(k + 1, max(1, index.ntotal)))
        for a, d_row, i_row in zip(chunk, D, I):
            a = int(a)
            for s, b in zip(d_row, i_row):
                b = int(b)
                if b < 0 or b == a or s < threshold:
                    continue
                key = (a, b) if a < b else (b, a)
                pairs[key] = max(pairs.get(key, -1.0), float(s))
                parent.setdefault(a, a)
                parent.setdefault(b, b)
                ra, rb = _find(parent, a), _find(parent, b)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
        if progress is not None:
            progress(min(start + batch, len(ids)), len(ids))
    members: dict[int, list[int]] = {}
    for item in parent:
        members.setdefault(_find(parent, item), []).append(item)
    edges: dict[int, list[tuple[int, int, float]]] = {}
    for (a, b), s in pairs.items():
        edges.setdefault(_find(parent, a), []).append((a, b, s))
    groups = [DuplicateGroup(sorted(m), sorted(edges.get(root, []))) for root, m in members.items() if len(m) > 1]
    return sorted(groups, key=lambda g: (-len(g.ids), g.ids[0]))


def _vectors(index, ids: np.ndarray) -> np.ndarray:
    """float32 ``[m, d]`` stored vectors of live ``ids``: the vector blocks where they open, else reconstruct."""
    vectors = index.vectors
    if vectors is not None:
        found, xb = vectors.get(ids)
        if found.all():
            norms = np.linalg.norm(xb, axis=1, keepdims=True)  # float16 blocks: renormalize their rounding
            return np.ascontiguousarray(xb / np.maximum(norms, 1e-12), dtype=np.float32)
    return np.stack([index.reconstruct(int(i)) for i in ids]).astype(np.float32)


def iter_group_rows(
    groups: list[DuplicateGroup], records: Callable[[list[int]], list[ItemRecord | None]]
) -> Iterator[dict]:
    """One row per member: ``group`` (1-based), ``id``, ``path``, ``score`` (its best score within the group)."""
    for number, group in enumerate(groups, 1):
        best: dict[int, float] = {}
        for a, b, s in group.pairs:
            best[a], best[b] = max(best.get(a, -1.0), s), max(best.get(b, -1.0), s)
        for rec in records(group.ids):
            if rec is not None:
                yield {"group": number, "id": rec.id, "path": rec.path, "score": round(best[rec.id], 6)}
